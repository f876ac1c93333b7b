"""fairseq's Adafactor (fairseq/optim/adafactor.py, the same code as transformers'), exact
under FSDP2's row shards and tensor parallelism's rows or columns, on the tensors users have.

A matrix's second moment is kept factored: one value per row (the mean of its squared
gradients over the columns) and one per column (the mean over the rows). Under FSDP2 a rank
holds whole rows, so the row statistics are its own; but the column statistics, the mean
of the row statistics, the RMS of the update (its clipping) and the RMS of the parameter
(--scale-parameter) are over the whole matrix. Each rank computes its part's partial sums,
and a step sums them over the ranks holding the other parts in two all-reduces: one of
everything known before the update (the parameters' squares, the row statistics, the
column sums, and the row sums of a matrix split by columns), one of the updates' squares.
A matrix tensor parallelism splits by columns (out_proj, fc2; an odd vocabulary's
embedding over FSDP's ranks) has rows whose means span ranks: every rank keeps all its rows'
statistics, updates them from the summed row sums and takes their mean itself. One process
and DDP reduce nothing (sum_over_shards' identity), and run the same arithmetic.

Every statistic is per logical tensor: shardlm stacks q_proj, k_proj and v_proj in
qkv_proj and a gated feed-forward's gate_proj and up_proj in fc1, which fairseq's and
Hugging Face's models keep apart, so each of them gets its own column statistics, row
mean, update RMS and parameter RMS (the `blocks` given, models/layer.py's
weight_blocks), as Adafactor stepping the separate parameters would; their rows may
straddle two ranks' shards, or lie in the order tensor parallelism gives them
(shard_sums.RowBlocks).

FSDP2's last shard may be shorter, or empty, than the others (torch.chunk's split); the
sums are of the rows a rank truly holds and the means divide by the parameter's whole row
count, so its padding never counts.
"""

import math

import torch

from trainer.parallel.shard_sums import (
    RowBlocks,
    block_sums,
    local_shards,
    per_row,
    replicated_like,
    rows_like,
    shard_layout,
    square_sums,
    sum_over_shards,
)

BLOCK_COLUMNS = "exp_avg_sq_col_blocks"  # a stacked weight's column statistics, one row per matrix


class Adafactor(torch.optim.Optimizer):
    """fairseq's Adafactor. The per-parameter state holds `step` as a 0-d tensor (fairseq's
    int would be a pickled object in a checkpoint), `exp_avg_sq_row` sharded like the rows,
    `exp_avg_sq_col` replicated (a DTensor on the mesh: DCP saves it once and loads it on any
    number of ranks), `exp_avg_sq` for vectors and `exp_avg` with --beta1. A weight that
    stacks several matrices keeps their columns as `exp_avg_sq_col_blocks` (matrices ×
    columns), a name of its own: a checkpoint saved when qkv_proj's columns were one vector
    is then refused in one line (--reset-optimizer) instead of misread. fairseq's `RMS`
    entry is recomputed every step and not kept.

    `blocks`: {id(parameter): row counts of the logical tensors it stacks, in order}
    (trainer/train/optim.py: logical_blocks); any other parameter is one tensor."""

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
        blocks=None,
        orders=None,
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
        self.blocks = dict(blocks or {})
        self.orders = dict(orders or {})
        self.layouts = {}  # id(parameter): its RowBlocks, fixed by the sharding

    @classmethod
    def from_config(cls, groups, lr, cfg, blocks=None, orders=None):
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
            blocks=blocks,
            orders=orders,
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

    def layout(self, p, local, mesh_layout):
        """p's RowBlocks, computed once."""
        if id(p) not in self.layouts:
            blocks, order = self.blocks.get(id(p)), self.orders.get(id(p))
            self.layouts[id(p)] = RowBlocks(p, blocks, order, mesh_layout, local.device)
        return self.layouts[id(p)]

    def init_state(self, p, local, group, rows):
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        if group["beta1"] is not None:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        if p.ndim < 2:
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            return
        zeros = dict(dtype=torch.float32, device=local.device)
        if rows.split_cols:  # each row's sum spans ranks: every rank keeps all rows' statistics
            state["exp_avg_sq_row"] = replicated_like(p, torch.zeros(p.shape[:1], **zeros))
        else:
            state["exp_avg_sq_row"] = rows_like(p, torch.zeros(local.shape[:-1], **zeros))
        matrices = len(self.blocks.get(id(p), ()))
        if p.ndim == 2 and matrices > 1:  # one column vector per matrix, whole on each rank
            state[BLOCK_COLUMNS] = replicated_like(p, torch.zeros((matrices, p.shape[-1]), **zeros))
        elif p.ndim == 2:  # the columns span every rank's rows: each rank keeps them whole
            state["exp_avg_sq_col"] = replicated_like(p, torch.zeros(p.shape[-1:], **zeros))
        else:  # a stack of matrices, split between them: its columns are a rank's own
            state["exp_avg_sq_col"] = rows_like(p, torch.zeros(local.shape[:-2] + local.shape[-1:], **zeros))

    def factors(self, p):
        """The local row statistics and the column statistics, a 2-D weight's as
        (matrices, columns)."""
        state = self.state[p]
        row, col = local_shards([state["exp_avg_sq_row"], state.get(BLOCK_COLUMNS, state.get("exp_avg_sq_col"))])
        return row, (col.view(-1, p.shape[-1]) if p.ndim == 2 else col)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not items:
            return loss
        # from every parameter, not only those with gradients now: the same sums on each step
        layout = shard_layout([p for g in self.param_groups for p in g["params"]])
        work, partial = [], []

        def slot(t):
            """Queue partial sums `t` for the first all-reduce; where they will be in it."""
            offset = sum(x.numel() for x in partial)
            partial.append(t.reshape(-1))
            return slice(offset, offset + t.numel())

        for group, p in items:
            (local,) = local_shards([p])
            grad = local_shards([p.grad])[0].float()
            rows = self.layout(p, local, layout)
            if not self.state[p]:
                self.init_state(p, local, group, rows)
            state = self.state[p]
            state["step"] += 1
            step = state["step"].item()  # a host tensor, as torch's Adam keeps it
            beta2t = 1.0 - math.pow(step, group["decay_rate"])
            squared = grad * grad + group["eps"][0]
            w = dict(group=group, p=p, local=local, grad=grad, step=step, beta2t=beta2t, rows=rows)
            if group["scale_parameter"]:
                w["param_sq"] = slot(rows.counted_only(square_sums(local, rows.pieces)))
            if p.ndim == 2:  # each matrix's means over its rows: over every rank's rows
                row, _ = self.factors(p)
                if rows.split_cols:  # a row's mean over its columns, which other ranks hold too
                    w["row_sums"] = slot(rows.counted_only(rows.whole_rows(squared.sum(dim=-1))))
                else:
                    row.mul_(beta2t).add_(squared.mean(dim=-1), alpha=1.0 - beta2t)
                    w["row_sum"] = slot(rows.counted_only(block_sums(row, rows.pieces)))
                col_sums = rows.whole_columns(block_sums(squared, rows.pieces))
                w["col_sum"] = slot(rows.counted_only(col_sums))
            elif p.ndim > 2:
                row, col = self.factors(p)
                row.mul_(beta2t).add_(squared.mean(dim=-1), alpha=1.0 - beta2t)
                col.mul_(beta2t).add_(squared.mean(dim=-2), alpha=1.0 - beta2t)
            else:
                (exp_avg_sq,) = local_shards([state["exp_avg_sq"]])
                exp_avg_sq.mul_(beta2t).add_(squared, alpha=1.0 - beta2t)
            work.append(w)
        sums = sum_over_shards(torch.cat(partial), layout) if partial else None
        update_sq = [self.direction(w, sums) for w in work]
        update_sums = sum_over_shards(torch.cat(update_sq), layout).split([len(u) for u in update_sq])
        for w, update_sum in zip(work, update_sums):
            self.apply(w, update_sum)
        return loss

    def direction(self, w, sums):
        """The parameter's update before clipping and lr (w["update"]), and the local sums of
        its squares, one per logical tensor."""
        p, group, grad, beta2t, rows = w["p"], w["group"], w["grad"], w["beta2t"], w["rows"]
        if p.ndim == 2:
            row, col = self.factors(p)
            col.mul_(beta2t).add_(sums[w["col_sum"]].view(col.shape) / rows.counts[:, None], alpha=1.0 - beta2t)
            if rows.split_cols:  # every row's statistic, whole on each rank
                row.mul_(beta2t).add_(sums[w["row_sums"]] / p.shape[-1], alpha=1.0 - beta2t)
                row_mean = rows.model_block_means(row)
                row = row[rows.rows]
            else:
                row_mean = sums[w["row_sum"]] / rows.counts
            r_factor = (row / per_row(row_mean, rows.pieces, row)).rsqrt_().unsqueeze(-1)
            cols = rows.cols if rows.cols is not None else slice(None)
            update = torch.empty_like(grad)
            for c, (a, n) in zip(col, rows.pieces):  # each matrix's rows by its own columns
                torch.mul(r_factor[a : a + n] * c[cols].rsqrt(), grad[a : a + n], out=update[a : a + n])
        elif p.ndim > 2:
            row, col = self.factors(p)
            r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            update = r_factor * col.unsqueeze(-2).rsqrt() * grad
        else:
            (exp_avg_sq,) = local_shards([self.state[p]["exp_avg_sq"]])
            update = exp_avg_sq.rsqrt() * grad
        rms = (sums[w["param_sq"]] / rows.numel).sqrt() if "param_sq" in w else None
        w["lr"] = self.step_size(group, w["step"], rms)
        w["update"] = update
        return rows.counted_only(square_sums(update, rows.pieces))

    def apply(self, w, update_sum):
        """Clip the update by its RMS over each logical tensor, scale it by the lr, and step."""
        p, group, update, lr, local, pieces = w["p"], w["group"], w["update"], w["lr"], w["local"], w["rows"].pieces
        rms = (update_sum / w["rows"].numel).sqrt()
        update.div_(per_row((rms / group["clip_threshold"]).clamp_(min=1.0), pieces, update))
        if isinstance(lr, torch.Tensor):  # --scale-parameter: each logical tensor's RMS
            lr = per_row(lr, pieces, update)
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
