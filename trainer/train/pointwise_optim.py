"""fairseq's adagrad, adadelta and adamax: each element updated from itself alone, so each
is stepped on FSDP2's local shards as ShardLocalAdamW is (trainer/train/optim.py), with no
collective; the state is created like the parameter (a DTensor under FSDP2), so
checkpoints hold it sharded and reshard it as they do Adam's.

fairseq's adagrad and adadelta are torch's optimizers with --lr and --weight-decay (and
adadelta's rho and eps): here torch's functional step runs on the local shards. Its
adamax is its own (fairseq/optim/adamax.py): written out below."""

import torch
from torch.optim.adadelta import adadelta
from torch.optim.adagrad import adagrad

from trainer.parallel.shard_sums import local_shards


def _closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class ShardLocalAdagrad(torch.optim.Adagrad):
    """torch's Adagrad (fairseq's: its defaults for lr_decay, the initial accumulator and eps),
    stepped on the local shards."""

    @classmethod
    def from_config(cls, groups, lr, cfg):
        return cls(groups, lr=lr, weight_decay=cfg.weight_decay)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lists = [], [], [], []  # params, grads, sums, steps
            has_sparse_grad, has_complex = self._init_group(group, *lists)
            if not lists[0]:
                continue
            params, grads, sums, steps = (local_shards(t) for t in lists)
            adagrad(
                params,
                grads,
                sums,
                steps,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                lr_decay=group["lr_decay"],
                eps=group["eps"],
                has_sparse_grad=has_sparse_grad,
                foreach=group["foreach"],
                maximize=group["maximize"],
                differentiable=group["differentiable"],
                has_complex=has_complex,
            )
        return loss


class ShardLocalAdadelta(torch.optim.Adadelta):
    """torch's Adadelta with fairseq's --adadelta-rho and --adadelta-eps, stepped on the local
    shards. fairseq's --anneal-eps is accepted there and read by nothing: refused here
    (trainer/config/checks/optim.py)."""

    @classmethod
    def from_config(cls, groups, lr, cfg):
        return cls(groups, lr=lr, rho=cfg.adadelta_rho, eps=cfg.adadelta_eps, weight_decay=cfg.weight_decay)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lists = [], [], [], [], []  # params, grads, square_avgs, acc_deltas, steps
            has_complex = self._init_group(group, *lists)
            if not lists[0]:
                continue
            params, grads, square_avgs, acc_deltas, steps = (local_shards(t) for t in lists)
            adadelta(
                params,
                grads,
                square_avgs,
                acc_deltas,
                steps,
                lr=group["lr"],
                rho=group["rho"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                foreach=group["foreach"],
                maximize=group["maximize"],
                differentiable=group["differentiable"],
                capturable=group["capturable"],
                has_complex=has_complex,
            )
        return loss


class Adamax(torch.optim.Optimizer):
    """fairseq's Adamax (fairseq/optim/adamax.py), stepped on the local shards. Unlike
    torch's: eps is added to the infinity norm at the update, not inside the max; the
    weight decay is decoupled (p <- p (1 - lr wd)); --no-bias-correction drops the step
    size's 1 / (1 - beta1^t). Per element, at step t:

        m <- b1 m + (1 - b1) g;   u <- max(b2 u, |g|)
        p <- p (1 - lr wd) - lr / (1 - b1^t) * m / (u + eps)

    `step` is per-parameter state, a 0-d host tensor (fairseq's int would be pickled)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True):
        super().__init__(
            params,
            dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction),
        )

    @classmethod
    def from_config(cls, groups, lr, cfg):
        return cls(
            groups,
            lr=lr,
            betas=tuple(cfg.adamax_betas),
            eps=cfg.adamax_eps,
            weight_decay=cfg.weight_decay,
            bias_correction=not cfg.no_bias_correction,
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            by_step = {}  # parameters at the same step share one step size
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_inf"] = torch.zeros_like(p)
                state["step"] += 1
                by_step.setdefault(state["step"].item(), []).append(p)
            for step, params in by_step.items():
                ps = local_shards(params)
                grads = local_shards([p.grad for p in params])
                exp_avgs = local_shards([self.state[p]["exp_avg"] for p in params])
                exp_infs = local_shards([self.state[p]["exp_inf"] for p in params])
                torch._foreach_mul_(exp_avgs, beta1)
                torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
                torch._foreach_mul_(exp_infs, beta2)
                torch._foreach_maximum_(exp_infs, torch._foreach_abs(grads))
                step_size = lr / (1 - beta1**step) if group["bias_correction"] else lr
                if wd != 0:
                    torch._foreach_mul_(ps, 1 - wd * lr)
                torch._foreach_addcdiv_(ps, exp_avgs, torch._foreach_add(exp_infs, group["eps"]), value=-step_size)
        return loss
