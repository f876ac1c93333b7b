"""Optimizers (adam, adamw, sgd) and fairseq's learning-rate schedules."""
import math

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam


def param_groups(model, weight_decay):
    """No weight decay on biases, norms and embeddings: every parameter with fewer than 2
    dimensions, and the embedding tables (found by module type, since FSDP2 keeps each
    parameter's original shape, unlike FSDP1's flat parameters)."""
    no_decay = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, rest = [], []
    for p in model.parameters():
        if p.requires_grad:
            (rest if p.ndim < 2 or id(p) in no_decay else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model, cfg):
    o = cfg.optimizer
    groups = param_groups(model, o.weight_decay)
    lr = cfg.optimization.lr
    if o._name in ("adam", "adamw"):
        # fairseq's adam decouples weight decay, i.e. it is AdamW. The fused kernel is
        # one pass over all parameters per step, on CPU and GPU alike, and takes FSDP2's
        # DTensor shards too; the default (foreach) path allocates temporaries the size
        # of the model every step.
        return ShardLocalAdamW(groups, lr=lr, betas=tuple(o.adam_betas), eps=o.adam_eps, fused=True)
    return torch.optim.SGD(groups, lr=lr, momentum=o.momentum)


def local_shards(tensors):
    """Each DTensor's local shard (itself for a plain tensor), without DTensor's dispatch:
    under no_grad `to_local` is the attribute read."""
    with torch.no_grad():
        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


class ShardLocalAdamW(torch.optim.AdamW):
    """torch's AdamW, stepped on each parameter's local shard.

    Under FSDP2 parameters, gradients and optimizer state are DTensors, and torch's step
    sends its one fused op through DTensor's dispatch, which propagates the sharding of
    every argument in Python: on a CPU that takes longer than the update's arithmetic, and
    on a GPU the device waits through it, its queue drained by the gradient norm's
    `.item()`. AdamW updates each element from that element alone, so the same kernel on
    the local shards computes the same values. The state is still created (lazily, by
    torch) and kept as DTensors, so checkpoints and `state_dict` do not change.

    `step(first=ids, then=callback)` steps the parameters whose ids are in `first`, calls
    `then()`, and steps the rest (trainer/parallel/grad_sync.EarlyGather starts the next
    forward's all-gathers there). AdamW updates each element from itself alone, so the
    order computes the same values."""

    @torch.no_grad()
    def step(self, closure=None, first=None, then=None):
        if "decoupled_weight_decay" not in self.defaults:  # torch < 2.7: AdamW is not an Adam yet
            loss = super().step(closure)
            if then is not None:
                then()
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = []
        for group in self.param_groups:
            lists = [], [], [], [], [], []  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
            has_complex = self._init_group(group, *lists)
            groups.append((group, has_complex, lists))
        first = first or set()
        for group, has_complex, lists in groups:
            self._step_group(group, has_complex, lists, [i for i, p in enumerate(lists[0]) if id(p) in first])
        if then is not None:
            then()
        for group, has_complex, lists in groups:
            self._step_group(group, has_complex, lists, [i for i, p in enumerate(lists[0]) if id(p) not in first])
        return loss

    def _step_group(self, group, has_complex, lists, indices):
        """torch's AdamW step of one parameter group, on the local shards of `indices`."""
        if not indices:
            return
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = (
            local_shards([t[i] for i in indices]) if t else [] for t in lists)
        beta1, beta2 = group["betas"]
        adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
            has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
            foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
            fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            decoupled_weight_decay=group["decoupled_weight_decay"])


class LRSchedule:
    """lr as a function of num_updates (fairseq's fixed, inverse_sqrt, polynomial_decay,
    cosine, each with linear warmup); stateless, so resuming needs only num_updates."""

    def __init__(self, cfg):
        s = cfg.lr_scheduler
        self.name, self.peak = s._name, cfg.optimization.lr
        self.warmup = s.warmup_updates
        self.warmup_init = 0.0 if s.warmup_init_lr < 0 else s.warmup_init_lr
        self.end_lr, self.power, self.min_lr = s.end_learning_rate, s.power, s.min_lr
        max_update = cfg.optimization.max_update
        self.total = s.total_num_update or max_update
        self.period = s.lr_period_updates if s.lr_period_updates > 0 else max(max_update - self.warmup, 1)

    def lr(self, num_updates):
        if self.warmup > 0 and num_updates < self.warmup:
            return self.warmup_init + (self.peak - self.warmup_init) * (num_updates + 1) / self.warmup
        if self.name == "fixed":
            return self.peak
        if self.name == "inverse_sqrt":
            return self.peak * math.sqrt(max(self.warmup, 1)) / math.sqrt(max(num_updates, 1))
        if self.name == "polynomial_decay":
            if num_updates >= self.total:
                return self.end_lr
            frac = 1 - (num_updates - self.warmup) / max(self.total - self.warmup, 1)
            return (self.peak - self.end_lr) * frac ** self.power + self.end_lr
        t = min(num_updates - self.warmup, self.period) / self.period  # cosine
        return self.min_lr + 0.5 * (self.peak - self.min_lr) * (1 + math.cos(math.pi * t))

    def apply(self, optimizer, num_updates):
        lr = self.lr(num_updates)
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr
