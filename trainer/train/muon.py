"""--optimizer muon: torch.optim.Muon's update of every matrix in the decoder layers, each
matrix whole even when FSDP shards it; AdamW for every other parameter.

Muon (Keller Jordan, 2024; torch.optim.Muon) orthogonalises each weight matrix's
momentum update by Newton-Schulz iterations. The matrices are the Hugging Face layout's:
shardlm's fused qkv_proj is q_proj, k_proj and v_proj, its gated fc1 gate_proj and
up_proj (models/layer.py: DecoderLayer.weight_blocks), each orthogonalised alone, so a
model steps as the same model loaded into transformers would under torch's Muon.
Embeddings, the output projection, norms, biases and scales are not hidden-layer matrices
(Muon's paper): AdamW steps them, with --adam-betas, --adam-eps and --weight-decay.

A step, per matrix parameter: the momentum (buffer <- lerp(buffer, grad, 1 - momentum);
Nesterov: update = lerp(grad, buffer, momentum)) is elementwise, on the local shard, and
the buffer stays a DTensor like its parameter, so checkpoints save and reshard it as they
do Adam's state. Newton-Schulz is not elementwise: the updates' rows go to each matrix's
owner in one all-to-all (trainer/parallel/matrix_owners.py), the owner orthogonalises its
matrices whole, another all-to-all brings the rows back, and the decoupled weight decay
and the lr-scaled update apply on the local shards. torch casts the update to bf16 before
Newton-Schulz and adds its bf16 result to the parameter: both all-to-alls carry bf16, so
they move half of fp32's bytes and change no value. Without sharding (one process, DDP)
every rank holds every matrix whole and computes them all, with no communication.
"""

import logging
import math
from dataclasses import replace

import torch

from trainer.parallel.matrix_owners import Matrix, MatrixExchange
from trainer.parallel.tp_matrices import RowLayout, is_tensor_parallel, tensor_parallel_matrices
from trainer.train.optim import ShardLocalAdamW, local_shards, param_groups

log = logging.getLogger("shardlm")


def newton_schulz(update, coefficients, steps, eps):
    """torch.optim.Muon's orthogonalisation (its _zeropower_via_newtonschulz), in bf16: the
    quintic iteration X <- aX + (bA + cA²)X with A = XXᵀ over the short side, after scaling
    X to Frobenius norm 1 (so spectral norm at most 1)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr, adjust_lr_fn, rows, cols):
    """torch.optim.Muon's lr per matrix shape: "original" (Keller Jordan's) keeps the update's
    RMS alike for tall matrices; "match_rms_adamw" (Moonshot's) matches AdamW's update RMS,
    so AdamW's lr and weight decay carry over."""
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def muon_matrices(model):
    """(the 2-D weights of the decoder layers, Matrix of each logical matrix in them)."""
    params, matrices = [], []
    for layer in getattr(model, "module", model).layers:
        blocks = layer.weight_blocks()
        for name, p in layer.named_parameters():
            if p.ndim != 2 or not p.requires_grad:
                continue
            start = 0
            for rows in blocks.get(name, (p.shape[0],)):
                matrices.append(Matrix(len(params), start, rows, p.shape[1]))
                start += rows
            params.append(p)
    return params, matrices


class MatrixPart:
    """The matrices of the Muon parameters that lie on one mesh (`indices` of them in the
    optimizer's), each Matrix's param an index into the part's own; their row layout
    (RowLayout, or None: FSDP2's rows) and the exchange that brings them to their owners."""

    def __init__(self, indices, params, matrices, layout):
        self.indices, self.layout = indices, layout
        where = {i: j for j, i in enumerate(indices)}
        self.matrices = [replace(m, param=where[m.param]) for m in matrices if m.param in where]
        own = [params[i] for i in indices]
        self.exchange = MatrixExchange(own, self.matrices, None if layout is None else layout.shards)


def matrix_parts(model, params, matrices):
    """Muon's MatrixParts: one for every matrix, or under expert parallelism one for the
    experts' (on their own mesh: trainer/parallel/experts.py) and one for the rest. A part on
    a mesh of several split dimensions (tensor parallelism's, the experts') is laid out by
    rows first (trainer/parallel/tp_matrices.py)."""
    meshes = list(dict.fromkeys(getattr(p, "device_mesh", None) for p in params))
    parts = []
    for mesh in meshes:
        indices = [i for i, p in enumerate(params) if getattr(p, "device_mesh", None) == mesh]
        own = [params[i] for i in indices]
        layout = None
        if is_tensor_parallel(own):
            layout = RowLayout(own)
            matrices = tensor_parallel_matrices(model, params, matrices)
        elif mesh is not None and "ep" in (mesh.mesh_dim_names or ()):
            layout = RowLayout(own)
        parts.append(MatrixPart(indices, params, matrices, layout))
    return parts


def build_muon(model, cfg):
    optimizer_cfg = cfg.optimizer
    params, matrices = muon_matrices(model)
    parts = matrix_parts(model, params, matrices)
    ids = {id(p) for p in params}
    adam_groups = []
    for group in param_groups(model, optimizer_cfg.weight_decay):
        rest = [p for p in group["params"] if id(p) not in ids]
        if rest:
            adam_groups.append({**group, "params": rest, "muon": False})
    return Muon(
        params,
        matrices,
        adam_groups,
        lr=cfg.optimization.lr,
        weight_decay=optimizer_cfg.weight_decay,
        betas=tuple(optimizer_cfg.adam_betas),
        adam_eps=optimizer_cfg.adam_eps,
        momentum=optimizer_cfg.muon_momentum,
        nesterov=optimizer_cfg.muon_nesterov,
        ns_coefficients=tuple(optimizer_cfg.muon_ns_coefficients),
        ns_steps=optimizer_cfg.muon_ns_steps,
        eps=optimizer_cfg.muon_eps,
        adjust_lr_fn=optimizer_cfg.muon_adjust_lr_fn,
        parts=parts,
    )


class Muon(ShardLocalAdamW):
    """Muon's step of the matrices (the first parameter group, "muon": True), torch's AdamW
    of the rest (ShardLocalAdamW's, on local shards). Its step communicates under FSDP, so
    every rank steps or none does: it leaves found_inf to the host (GradScaler's check,
    trainer/train/deferred_read.py's read_before_step), which every rank reads alike."""

    def __init__(self, params, matrices, adam_groups, lr, weight_decay, betas, adam_eps, parts=None, **muon):
        """parts: the MatrixParts the matrices are exchanged in (matrix_parts); default one,
        FSDP2's rows."""
        groups = [{"params": params, "weight_decay": weight_decay, "muon": True}] + adam_groups
        super().__init__(groups, lr=lr, betas=betas, eps=adam_eps, fused=True)
        self._step_supports_amp_scaling = False  # fused AdamW's: not this step's
        self.muon = muon
        self.matrices = matrices
        self.parts = parts or [MatrixPart(list(range(len(params))), params, matrices, None)]

    def __setstate__(self, state):
        """Adam's (load_state_dict calls it) reads the "step" of every state: the matrices'
        state is their momentum buffer alone."""
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": groups[1:]})
        self.param_groups = groups

    def describe(self):
        """The split, a line for the log."""
        muon, adam = self.param_groups[0]["params"], [p for g in self.param_groups[1:] for p in g["params"]]
        ranks = max(part.exchange.ranks for part in self.parts)
        where = (
            f", each orthogonalised whole by one owner among the {ranks} ranks of a shard group" if ranks > 1 else ""
        )
        return (
            f"--optimizer muon: {len(self.matrices)} matrices in {len(muon)} weights "
            f"({sum(p.numel() for p in muon):,} parameters) stepped by Muon{where}; "
            f"{len(adam)} other tensors ({sum(p.numel() for p in adam):,} parameters) by AdamW"
        )

    @torch.no_grad()
    def step(self, closure=None, first=None, then=None):
        """`first`/`then` as ShardLocalAdamW's, except that `then` runs after every parameter
        has stepped: the matrices step together, by collectives."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        updates = self.momentum_updates(group)
        wholes = []
        for part in self.parts:
            ups = [updates[i] for i in part.indices]
            if part.layout is not None:
                ups = [part.layout.to_rows(group["params"][i], u) for i, u in zip(part.indices, ups)]
            wholes.append(part.exchange.gather(ups))
        for adam_group in self.param_groups[1:]:
            lists = [], [], [], [], [], []
            has_complex = self._init_group(adam_group, *lists)
            self._step_group(adam_group, has_complex, lists, range(len(lists[0])))
        options = self.muon
        for part, whole in zip(self.parts, wholes):
            orthogonal = {
                m: newton_schulz(u, options["ns_coefficients"], options["ns_steps"], options["eps"])
                for m, u in whole.items()
            }
            self.apply_updates(group, part, part.exchange.scatter(orthogonal))
        if then is not None:
            then()
        return loss

    def momentum_updates(self, group):
        """The momentum step of each matrix parameter's local shard, and its (Nesterov)
        update in bf16; zeros for a parameter without a gradient (a layer LayerDrop skipped:
        skipped on every rank alike), which then does not step."""
        momentum, nesterov = self.muon["momentum"], self.muon["nesterov"]
        updates = []
        for p in group["params"]:
            (local,) = local_shards([p])
            if p.grad is None:
                updates.append(torch.zeros(local.shape, dtype=torch.bfloat16, device=local.device))
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf, grad = local_shards([state["momentum_buffer"], p.grad])
            buf.lerp_(grad, 1 - momentum)
            updates.append((grad.lerp(buf, momentum) if nesterov else buf).bfloat16())
        return updates

    def apply_updates(self, group, part, pieces):
        """torch's Muon: decoupled weight decay by the group's lr, then the orthogonalised
        update by the lr adjusted to its matrix's shape; on the parameters of `part`."""
        lr, weight_decay = group["lr"], group["weight_decay"]
        params = [group["params"][i] for i in part.indices]
        locals_ = local_shards(params)
        if weight_decay != 0:
            for p, local in zip(params, locals_):
                if p.grad is not None:
                    local.mul_(1 - lr * weight_decay)
        layout = part.layout
        if layout is not None:  # each parameter's rows of the steps, laid back as it is split
            steps = [layout.zeros(p, local.dtype) for p, local in zip(params, locals_)]
            for m, first, rows, update in pieces:
                matrix = part.matrices[m]
                step = adjusted_lr(lr, self.muon["adjust_lr_fn"], matrix.rows, matrix.cols)
                steps[matrix.param][first : first + rows] = update.to(steps[matrix.param].device).float() * step
            for p, local, rows in zip(params, locals_, steps):
                if p.grad is not None:
                    local.sub_(layout.from_rows(p, rows))
            return
        for m, first, rows, update in pieces:
            matrix = part.matrices[m]
            if rows and params[matrix.param].grad is not None:
                step = adjusted_lr(lr, self.muon["adjust_lr_fn"], matrix.rows, matrix.cols)
                locals_[matrix.param][first : first + rows].add_(update.to(locals_[matrix.param].device), alpha=-step)
