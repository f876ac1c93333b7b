"""fairseq's Adafactor (fairseq/optim/adafactor.py, the same code as transformers'), exact
under FSDP2's row shards.

A matrix's second moment is kept factored: one value per row (the mean of its squared
gradients over the columns) and one per column (the mean over the rows). A rank holds
whole rows, so the row statistics are its own; but the column statistics, the mean of the
row statistics, the RMS of the update (its clipping) and the RMS of the parameter
(--scale-parameter) are over the whole matrix. Each rank computes its rows' partial sums,
and a step sums them over the shard group in two all-reduces: one of everything known
before the update (the parameters' squares, the row statistics, the column sums), one of
the updates' squares. One process and DDP reduce nothing (sum_over_shards' identity), and
run the same arithmetic.

FSDP2's last shard may be shorter, or empty, than the others (torch.chunk's split); the
sums are of the rows a rank truly holds and the means divide by the parameter's whole row
count, so its padding never counts.
"""

import math

import torch

from trainer.parallel.shard_sums import local_shards, replicated_like, rows_like, shard_layout, sum_over_shards


class Adafactor(torch.optim.Optimizer):
    """fairseq's Adafactor. The per-parameter state holds `step` as a 0-d tensor (fairseq's
    int would be a pickled object in a checkpoint), `exp_avg_sq_row` sharded like the rows,
    `exp_avg_sq_col` replicated (a DTensor on the mesh: DCP saves it once and loads it on any
    number of ranks), `exp_avg_sq` for vectors and `exp_avg` with --beta1. fairseq's `RMS`
    entry is recomputed every step and not kept."""

    def __init__(
        self,
        params,
        lr,
        eps=(1e-30, 1e-3),
        clip_threshold=1.0,
        decay_rate=-0.8,
        beta1=None,
        weight_decay=0.0,
        scale_parameter=False,
        relative_step=False,
        warmup_init=False,
    ):
        defaults = dict(
            lr=lr,
            eps=tuple(eps),
            clip_threshold=clip_threshold,
            decay_rate=decay_rate,
            beta1=beta1,
            weight_decay=weight_decay,
            scale_parameter=scale_parameter,
            relative_step=relative_step,
            warmup_init=warmup_init,
        )
        super().__init__(params, defaults)

    @classmethod
    def from_config(cls, groups, lr, cfg):
        return cls(
            groups,
            lr=lr,
            eps=tuple(cfg.adafactor_eps),
            clip_threshold=cfg.clip_threshold,
            decay_rate=cfg.decay_rate,
            beta1=cfg.beta1,
            weight_decay=cfg.weight_decay,
            scale_parameter=cfg.scale_parameter,
            relative_step=cfg.relative_step,
            warmup_init=cfg.warmup_init,
        )

    @staticmethod
    def step_size(group, step, rms):
        """fairseq's _get_lr: --lr, or with --relative-step min(1e-2 (1e-6 * step with
        --warmup-init), 1/sqrt(step)); times max(eps[1], the parameter's RMS) with
        --scale-parameter. A tensor where it depends on the RMS (no host read)."""
        rel_step = group["lr"]
        if group["relative_step"]:
            min_step = 1e-6 * step if group["warmup_init"] else 1e-2
            rel_step = min(min_step, 1.0 / math.sqrt(step))
        if group["scale_parameter"]:
            return torch.clamp(rms, min=group["eps"][1]) * rel_step
        return rel_step

    def init_state(self, p, local, group):
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        if group["beta1"] is not None:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        if p.ndim < 2:
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            return
        zeros = dict(dtype=torch.float32, device=local.device)
        state["exp_avg_sq_row"] = rows_like(p, torch.zeros(local.shape[:-1], **zeros))
        if p.ndim == 2:  # the columns span every rank's rows: each rank keeps them whole
            state["exp_avg_sq_col"] = replicated_like(p, torch.zeros(p.shape[-1:], **zeros))
        else:  # a stack of matrices, split between them: its columns are a rank's own
            state["exp_avg_sq_col"] = rows_like(p, torch.zeros(local.shape[:-2] + local.shape[-1:], **zeros))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not items:
            return loss
        layout = shard_layout([p for _, p in items])
        work, partial = [], []

        def slot(t):
            """Queue partial sums `t` for the first all-reduce; their offset in it."""
            offset = sum(x.numel() for x in partial)
            partial.append(t.reshape(-1))
            return offset

        for group, p in items:
            (local,) = local_shards([p])
            grad = local_shards([p.grad])[0].float()
            if not self.state[p]:
                self.init_state(p, local, group)
            state = self.state[p]
            state["step"] += 1
            step = state["step"].item()  # a host tensor, as torch's Adam keeps it
            beta2t = 1.0 - math.pow(step, group["decay_rate"])
            squared = grad * grad + group["eps"][0]
            w = dict(group=group, p=p, local=local, grad=grad, step=step, beta2t=beta2t)
            if group["scale_parameter"]:
                w["param_sq"] = slot(local.float().square().sum())
            if p.ndim >= 2:
                row, col = local_shards([state["exp_avg_sq_row"], state["exp_avg_sq_col"]])
                row.mul_(beta2t).add_(squared.mean(dim=-1), alpha=1.0 - beta2t)
                if p.ndim == 2:  # means over the rows: over every rank's rows
                    w["row_sum"] = slot(row.sum())
                    w["col_sum"] = slot(squared.sum(dim=0))
                else:
                    col.mul_(beta2t).add_(squared.mean(dim=-2), alpha=1.0 - beta2t)
            else:
                (exp_avg_sq,) = local_shards([state["exp_avg_sq"]])
                exp_avg_sq.mul_(beta2t).add_(squared, alpha=1.0 - beta2t)
            work.append(w)
        sums = sum_over_shards(torch.cat(partial), layout) if partial else None
        update_sq = [self.direction(w, sums) for w in work]
        update_sums = sum_over_shards(torch.stack(update_sq), layout)
        for w, update_sum in zip(work, update_sums):
            self.apply(w, update_sum)
        return loss

    def direction(self, w, sums):
        """The parameter's update before clipping and lr (w["update"]), and the local sum of
        its squares."""
        p, group, grad, beta2t = w["p"], w["group"], w["grad"], w["beta2t"]
        state = self.state[p]
        if p.ndim >= 2:
            row, col = local_shards([state["exp_avg_sq_row"], state["exp_avg_sq_col"]])
            if p.ndim == 2:
                rows = p.shape[0]
                col.mul_(beta2t).add_(sums[w["col_sum"] : w["col_sum"] + col.numel()] / rows, alpha=1.0 - beta2t)
                row_mean = sums[w["row_sum"]] / rows
            else:
                row_mean = row.mean(dim=-1, keepdim=True)
            r_factor = (row / row_mean).rsqrt_().unsqueeze(-1)
            update = r_factor * col.unsqueeze(-2).rsqrt() * grad
        else:
            (exp_avg_sq,) = local_shards([state["exp_avg_sq"]])
            update = exp_avg_sq.rsqrt() * grad
        rms = (sums[w["param_sq"]] / p.numel()).sqrt() if "param_sq" in w else None
        w["lr"] = self.step_size(group, w["step"], rms)
        w["update"] = update
        return update.square().sum()

    def apply(self, w, update_sum):
        """Clip the update by its RMS over the whole parameter, scale it by the lr, and step."""
        p, group, update, lr, local = w["p"], w["group"], w["update"], w["lr"], w["local"]
        rms = (update_sum / p.numel()).sqrt()
        update.div_((rms / group["clip_threshold"]).clamp_(min=1.0))
        update.mul_(lr)
        if group["beta1"] is not None:
            (exp_avg,) = local_shards([self.state[p]["exp_avg"]])
            exp_avg.mul_(group["beta1"]).add_(update, alpha=1 - group["beta1"])
            update = exp_avg
        weights = local.float() if local.dtype != torch.float32 else local
        if group["weight_decay"] != 0:
            weights.add_(weights * (-group["weight_decay"] * lr))
        weights.add_(-update)
        if weights is not local:
            local.copy_(weights)
