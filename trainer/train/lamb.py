"""fairseq's --optimizer lamb: apex's FusedLAMB with the arguments fairseq passes (lr,
betas, eps, weight decay) and apex's defaults for the rest, written with torch ops, exact
under FSDP2's row shards and tensor parallelism's rows or columns.

FusedLAMB (apex/optimizers/fused_lamb.py, csrc/multi_tensor_lamb.cu), per update t:

    norm   = the global norm of all gradients; g <- g / (norm / max_grad_norm) where
             norm > max_grad_norm (apex's max_grad_norm=1.0: fairseq leaves it on)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2          (grad_averaging)
    u  = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd p  (adam_w_mode, bias_correction)
    p <- p - lr * ratio * u,  ratio = ||p|| / ||u||, or 1 where either norm is 0

and the ratio only for parameters with weight decay (use_nvlamb=False): those without
(biases, norms, embeddings here) take Adam's step. The norms are of whole parameters: a
rank sums its part's squares (a part several ranks hold, once: shard_sums.RowBlocks.counted),
and a step sums them over the ranks holding the other parts in two
all-reduces, one before the update (the gradients' and the parameters' squares) and one
of the updates' squares.

The trust ratio is per logical tensor: shardlm stacks q_proj, k_proj and v_proj in
qkv_proj and a gated feed-forward's gate_proj and up_proj in fc1, which fairseq's and
Hugging Face's models keep apart, so each gets ||w|| / ||u|| of its own rows (the `blocks`
given, models/layer.py's weight_blocks), as FusedLAMB stepping the separate parameters
would; their rows may straddle two ranks' shards, or lie in the order tensor parallelism gives them
(shard_sums.RowBlocks).

apex keeps t in the parameter group, which shardlm's checkpoints leave out
(hyper-parameters come from the config); here it is per-parameter state, a 0-d tensor.
"""

import torch

from trainer.parallel.shard_sums import RowBlocks, local_shards, per_row, shard_layout, square_sums, sum_over_shards

MAX_GRAD_NORM = 1.0  # apex FusedLAMB's default, which fairseq does not change


class LAMB(torch.optim.Optimizer):
    """`blocks`: {id(parameter): row counts of the logical tensors it stacks, in order}
    (trainer/train/optim.py: logical_blocks); any other parameter is one tensor."""

    def __init__(
        self,
        params,
        lr,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM,
        blocks=None,
        orders=None,
    ):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.blocks = dict(blocks or {})
        self.orders = dict(orders or {})
        self.layouts = {}  # id(parameter): its RowBlocks, fixed by the sharding

    @classmethod
    def from_config(cls, groups, lr, cfg, blocks=None, orders=None):
        return cls(
            groups,
            lr=lr,
            betas=tuple(cfg.lamb_betas),
            eps=cfg.lamb_eps,
            weight_decay=cfg.weight_decay,
            blocks=blocks,
            orders=orders,
        )

    def layout(self, p, local, mesh_layout):
        """p's RowBlocks, computed once."""
        if id(p) not in self.layouts:
            blocks, order = self.blocks.get(id(p)), self.orders.get(id(p))
            self.layouts[id(p)] = RowBlocks(p, blocks, order, mesh_layout, local.device)
        return self.layouts[id(p)]

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
        params = local_shards([p for _, p in items])
        grads = [g.float() for g in local_shards([p.grad for _, p in items])]
        decayed = [i for i, (group, _) in enumerate(items) if group["weight_decay"] != 0]
        rows = [self.layout(p, local, layout) for (_, p), local in zip(items, params)]
        pieces = {i: rows[i].pieces for i in decayed}
        # one all-reduce: the gradients' squares (all together, each part once), then each
        # decayed logical tensor's
        norms = [n for n, r in zip(torch._foreach_norm(grads), rows) if r.counted]
        grad_sq = torch.stack(norms).square().sum().reshape(1) if norms else grads[0].new_zeros(1)
        param_sq = [rows[i].counted_only(square_sums(params[i], pieces[i])) for i in decayed]
        sums = sum_over_shards(torch.cat([grad_sq, *param_sq]), layout)
        norm = sums[0].sqrt()
        param_norms = sums[1:].sqrt().split([len(pieces[i]) for i in decayed])
        max_norm = self.defaults["max_grad_norm"]
        clip = torch.where(norm > max_norm, norm / max_norm, torch.ones_like(norm))
        updates = []
        for (group, p), local, grad in zip(items, params, grads):
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            step = state["step"].item()  # a host tensor, as torch's Adam keeps it
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq = local_shards([state["exp_avg"], state["exp_avg_sq"]])
            grad = grad / clip
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
            update = (exp_avg / (1 - beta1**step)).div_(denom)
            if group["weight_decay"] != 0:
                update.add_(local.float(), alpha=group["weight_decay"])
            updates.append(update)
        update_sq = [rows[i].counted_only(square_sums(updates[i], pieces[i])) for i in decayed]
        update_norms = (
            sum_over_shards(torch.cat(update_sq), layout).sqrt().split([len(u) for u in update_sq]) if decayed else ()
        )
        ratios = {}  # per decayed parameter, one ratio per logical tensor it stacks
        for i, param_norm, update_norm in zip(decayed, param_norms, update_norms):
            trusted = (param_norm != 0) & (update_norm != 0)
            ratios[i] = torch.where(trusted, param_norm / update_norm.clamp(min=1e-38), torch.ones_like(param_norm))
        for i, ((group, _), local, update) in enumerate(zip(items, params, updates)):
            step_size = group["lr"] * per_row(ratios[i], pieces[i], update) if i in ratios else group["lr"]
            if local.dtype == torch.float32:
                local.sub_(update * step_size)
            else:
                local.copy_(local.float() - update * step_size)
        return loss
