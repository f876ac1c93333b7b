"""Sums over the ranks that hold the parts of FSDP2's parameters: what an optimizer whose
update is not elementwise (Adafactor's row and column statistics, LAMB's norms) needs
from the other shards of a parameter.

Every sum an optimizer step needs is packed into one flat tensor and reduced in one
collective: a step of a model with hundreds of parameters then waits for one all-reduce,
not hundreds of tiny ones.

A parameter may stack several logical tensors by rows (qkv_proj's q, k and v; a gated
fc1's gate and up: DecoderLayer.weight_blocks), each a parameter of its own in Hugging
Face's and fairseq's models. Per-tensor statistics are then per logical tensor: a rank's
rows of each (row_pieces) are summed apart (block_sums), and a value per logical tensor
is spread back over its rows (per_row).
"""

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from trainer.parallel.parallelize import local_rows


def shard_layout(params):
    """(mesh, placements) shared by the DTensor parameters, or None when there are none
    (one process, DDP: every rank holds whole tensors and nothing is summed). Refuses a
    mix: parallelize() shards every parameter alike (FSDP2's Shard(0), HSDP's
    (Replicate(), Shard(0))), and the sums assume it."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return None
    mesh, placements = sharded[0].device_mesh, sharded[0].placements
    if len(sharded) < len(params) or any(p.device_mesh != mesh or p.placements != placements for p in sharded):
        raise RuntimeError("parameters sharded in different layouts: a layout parallelize() does not build")
    if any(pl.is_shard() and pl.dim != 0 for pl in placements):
        raise RuntimeError(f"parameters sharded as {placements}: these optimizers expect rows (Shard(0))")
    return mesh, placements


def sum_over_shards(local, layout):
    """`local` (a 1-d float tensor of this rank's partial sums) summed over the ranks that
    hold the other rows of the same parameters: the mesh dimensions that shard (HSDP's
    replicas hold the same rows and are not added). `local` itself without a layout."""
    if layout is None:
        return local
    mesh, placements = layout
    partial = [Partial("sum") if pl.is_shard() else Replicate() for pl in placements]
    # Under --cpu-offload the shards are on the host and the mesh may be a GPU's: sum there.
    summed = DTensor.from_local(local.to(mesh.device_type), mesh, partial).full_tensor()
    return summed.to(local.device)


def replicated_like(p, local):
    """A tensor every rank of p's mesh holds whole (Adafactor's column statistics) as a
    DTensor on that mesh, so that checkpoints save it once and load it on any mesh; `local`
    itself for a plain parameter."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)


def rows_like(p, local):
    """A tensor of p's rows (Adafactor's row statistics: one value per row of a matrix)
    sharded as p's rows are, as a DTensor with p's global row count, so that uneven shards
    keep their true lengths; `local` itself for a plain parameter."""
    if not isinstance(p, DTensor):
        return local
    shape = (p.shape[0], *local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)


def local_shards(tensors):
    """Each DTensor's local shard (itself for a plain tensor), without DTensor's dispatch:
    under no_grad `to_local` is the attribute read."""
    with torch.no_grad():
        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def row_pieces(p, rows):
    """[(first row of this rank's shard, row count)] of each logical tensor that parameter p
    stacks, in order (`rows`: their row counts; None: p is one tensor). FSDP2 gives a rank
    contiguous rows, so each logical tensor's are one piece, (0, 0) where it has none;
    the pieces tile the shard in order."""
    if p.ndim == 0:
        return [(0, 1)]
    _, offset = local_rows(p)
    end = offset + local_shards([p])[0].shape[0]
    pieces, start = [], 0
    for count in rows or (p.shape[0],):
        a, b = max(start, offset), min(start + count, end)
        pieces.append((a - offset, b - a) if b > a else (0, 0))
        start += count
    return pieces


def block_sums(x, pieces):
    """Per logical tensor, the sum of the rows of x (a local shard, or anything with its
    rows) in its piece: a tensor of shape (len(pieces), *x.shape[1:])."""
    x = x.reshape(-1, *x.shape[1:])  # a 0-d tensor as one row
    return torch.stack([x[a : a + n].sum(0) for a, n in pieces])


def square_sums(x, pieces):
    """Per logical tensor, the sum of the squares of its elements in x's rows (fp32)."""
    rows = x.reshape(-1, *x.shape[1:]).float()
    return block_sums(rows.square().reshape(rows.shape[0], -1).sum(1), pieces)


def per_row(values, pieces, like):
    """`values` (one per logical tensor) repeated over each one's rows of the shard `like`,
    shaped to broadcast against it."""
    spread = torch.cat([v.expand(n) for v, (_, n) in zip(values, pieces)])  # no host-to-device copy
    return spread.reshape(like.shape[:1] + (1,) * max(like.ndim - 1, 0))
