"""Sums over the ranks that hold the parts of FSDP2's parameters: what an optimizer whose
update is not elementwise (Adafactor's row and column statistics, LAMB's norms) needs
from the other shards of a parameter.

Every sum an optimizer step needs is packed into one flat tensor and reduced in one
collective: a step of a model with hundreds of parameters then waits for one all-reduce,
not hundreds of tiny ones."""

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate


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
