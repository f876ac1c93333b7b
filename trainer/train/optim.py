"""Optimizers (adam, adamw, cpu_adam, sgd, nag; the others by name from their own files).
The learning-rate schedules are in lr_schedule.py."""

import torch
from torch.optim.adam import adam

from trainer.parallel.shard_sums import local_shards
from trainer.parallel.tensor_parallel import row_orders
from trainer.train.adafactor import Adafactor
from trainer.train.lamb import LAMB
from trainer.train.pointwise_optim import Adamax, ShardLocalAdadelta, ShardLocalAdagrad

# Each built from its config by its class (from_config). Adafactor's and LAMB's statistics
# are per tensor: they are told which parameters stack several (logical_blocks).
PER_TENSOR_OPTIMIZERS = {"adafactor": Adafactor, "lamb": LAMB}
ELEMENTWISE_OPTIMIZERS = {"adagrad": ShardLocalAdagrad, "adadelta": ShardLocalAdadelta, "adamax": Adamax}


def logical_blocks(model):
    """{id(parameter): row counts of the tensors it stacks} for each decoder layer's stacked
    weights (DecoderLayer.weight_blocks: qkv_proj's q, k, v; a gated fc1's gate, up) and
    their biases, which stack the same rows: the tensors users have, in Hugging Face's and
    fairseq's models, and the ones a per-tensor statistic must be taken over."""
    blocks = {}
    for layer in getattr(getattr(model, "module", model), "layers", ()):
        params = dict(layer.named_parameters())
        for name, rows in layer.weight_blocks().items():
            for stacked in (name, name.removesuffix("weight") + "bias"):
                if stacked in params:
                    blocks[id(params[stacked])] = tuple(rows)
    return blocks


def tensor_parallel_orders(model):
    """{id(parameter): its rows' order} of the parameters whose rows tensor parallelism
    orders by rank (tensor_parallel.row_orders), whose logical tensors then lie elsewhere
    than in the model's order; {} without tensor parallelism."""
    module = getattr(model, "module", model)
    if not hasattr(module, "layers"):
        return {}
    params = dict(module.named_parameters())
    return {id(params[name]): order for name, order in row_orders(module).items()}


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


CPU_ADAM = (
    "--optimizer cpu_adam: Adam with decoupled weight decay (fairseq's cpu_adam, adam_w_mode), "
    "stepped by torch's fused CPU kernel on the host-resident shards of --cpu-offload; its state is "
    "Adam's, so its checkpoints resume with --optimizer adam and adam's with cpu_adam"
)


def build_optimizer(model, cfg):
    optimizer_cfg = cfg.optimizer
    groups = param_groups(model, optimizer_cfg.weight_decay)
    lr = cfg.optimization.lr
    if optimizer_cfg._name in ("adam", "adamw", "cpu_adam"):
        # fairseq's adam decouples weight decay, i.e. it is AdamW. The fused kernel is
        # one pass over all parameters per step, on CPU and GPU alike, and takes FSDP2's
        # DTensor shards too; the default (foreach) path allocates temporaries the size
        # of the model every step. cpu_adam is the same optimizer: fairseq's is
        # DeepSpeed's vectorised host Adam (AdamW's update, bias-corrected) over the
        # offloaded parameters, and under --cpu-offload FSDP2 keeps shards, gradients
        # and this state in host memory, so the fused kernel steps them there. Nothing
        # hooks the gradients (no post-accumulate-grad hook): such a hook would make
        # FSDP2 copy each gradient to the host synchronously instead of overlapping the
        # copy with the rest of backward.
        return ShardLocalAdamW(
            groups, lr=lr, betas=tuple(optimizer_cfg.adam_betas), eps=optimizer_cfg.adam_eps, fused=True
        )
    if optimizer_cfg._name in PER_TENSOR_OPTIMIZERS:
        optimizer = PER_TENSOR_OPTIMIZERS[optimizer_cfg._name]
        return optimizer.from_config(groups, lr, optimizer_cfg, logical_blocks(model), tensor_parallel_orders(model))
    if optimizer_cfg._name in ELEMENTWISE_OPTIMIZERS:
        return ELEMENTWISE_OPTIMIZERS[optimizer_cfg._name].from_config(groups, lr, optimizer_cfg)
    if optimizer_cfg._name == "nag":
        return NAG(groups, lr=lr, momentum=optimizer_cfg.momentum)
    return torch.optim.SGD(groups, lr=lr, momentum=optimizer_cfg.momentum)


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
            local_shards([t[i] for i in indices]) if t else [] for t in lists
        )
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=flag_for_params(getattr(self, "grad_scale", None), params[0].device),
            found_inf=flag_for_params(getattr(self, "found_inf", None), params[0].device),
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )


def flag_for_params(flag, device):
    """The fused step's skip flag (found_inf) or grad scale on the parameters' device. torch's
    step copies one from another device with non_blocking=True, and under --cpu-offload
    (the flag on the GPU, the shards on the host) the CPU kernel may then read the host copy
    before the copy has landed: copied here synchronously instead, only in that case, so a
    step on the GPU, flag and parameters both there, waits for nothing."""
    if flag is None or flag.device == device:
        return flag
    return flag.to(device, non_blocking=False)


class NAG(torch.optim.Optimizer):
    """fairseq's Nesterov accelerated gradient (fairseq/optim/nag.py), stepped on each
    parameter's local shard. With lr_correct = lr / lr_old (lr_old: the lr of the
    parameter's previous step), per element:

        p   <- p * (1 - lr * weight_decay) + momentum**2 * lr_correct * buf - (1 + momentum) * lr * grad
        buf <- momentum * lr_correct * buf - lr * grad

    Elementwise, so FSDP2's local shards compute what whole tensors would, without
    DTensor's dispatch (see ShardLocalAdamW); `momentum_buffer` is made like the parameter
    (a DTensor under FSDP2), so checkpoints hold it sharded and reshard it as they do
    Adam's state. fairseq keeps lr_old in the parameter group, which shardlm's checkpoints
    leave out (hyper-parameters come from the config); here it is per-parameter state,
    saved beside the buffer as a float64 0-d tensor (torch's load_state_dict would cast a
    tensor to the parameter's dtype and device: a float here), so a resumed run's first
    step is corrected by the lr of the step before the save, as the uninterrupted run's is.
    `step(first=ids, then=callback)`: as ShardLocalAdamW's (the order changes no value)."""

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def state_dict(self):
        sd = super().state_dict()  # its per-parameter dicts are self.state's own: copied
        sd["state"] = {
            k: {**v, "lr_old": torch.tensor(v["lr_old"], dtype=torch.float64)} if "lr_old" in v else v
            for k, v in sd["state"].items()
        }
        return sd

    def load_state_dict(self, state_dict):
        state = {k: {**v, "lr_old": float(v["lr_old"])} if "lr_old" in v else v for k, v in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": state})

    @torch.no_grad()
    def step(self, closure=None, first=None, then=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = first or set()
        self._step(lambda p: id(p) in first)
        if then is not None:
            then()
        self._step(lambda p: id(p) not in first)
        return loss

    def _step(self, selected):
        for group in self.param_groups:
            lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
            by_lr_old = {}  # one value in practice: every parameter of a group steps together
            for p in group["params"]:
                if p.grad is None or not selected(p):
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["lr_old"] = lr  # fairseq's first lr_old is --lr: either way times a zero buffer
                by_lr_old.setdefault(state["lr_old"], []).append(p)
            for lr_old, params in by_lr_old.items():
                lr_correct = lr / lr_old if lr_old > 0 else lr  # fairseq's, for an lr_old of 0 too
                ps = local_shards(params)
                grads = local_shards([p.grad for p in params])
                bufs = local_shards([self.state[p]["momentum_buffer"] for p in params])
                if weight_decay != 0:
                    torch._foreach_mul_(ps, 1 - lr * weight_decay)
                torch._foreach_add_(ps, bufs, alpha=momentum * momentum * lr_correct)
                torch._foreach_add_(ps, grads, alpha=-(1 + momentum) * lr)
                torch._foreach_mul_(bufs, momentum * lr_correct)
                torch._foreach_add_(bufs, grads, alpha=-lr)
                for p in params:
                    self.state[p]["lr_old"] = lr
