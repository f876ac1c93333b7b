"""Whole matrices of a tensor-parallel model, for an optimizer that steps them whole
(--optimizer muon: trainer/train/muon.py).

Tensor parallelism splits a layer's matrices by rows (qkv_proj, fc1) or columns (out_proj,
fc2), and FSDP splits each rank's share by rows again. MatrixExchange
(trainer/parallel/matrix_owners.py) brings rows to owners: so each update is first laid out
by rows over the ranks that shard it (a DTensor redistribution to Shard(0) on every mesh
dimension but HSDP's replicas), the owners take their matrices whole, and the result goes
back the same way. A parameter whose rows tensor parallelism orders by rank (qkv_proj, a
gated fc1) holds each of its matrices as several runs of rows, which the owner joins in the
matrix's own order.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainer.parallel.matrix_owners import Matrix, RowShards, chunk_rows
from trainer.parallel.tensor_parallel import row_orders, runs


def is_tensor_parallel(params):
    mesh = getattr(params[0], "device_mesh", None) if params else None
    return mesh is not None and "tp" in (mesh.mesh_dim_names or ())


class RowLayout:
    """The matrix parameters (all on one mesh) laid out by rows over the ranks that shard
    them, and back."""

    def __init__(self, params):
        self.mesh = params[0].device_mesh
        names = self.mesh.mesh_dim_names
        self.placements = [Replicate() if name == "replicate" else Shard(0) for name in names]
        split = [i for i, name in enumerate(names) if name != "replicate"]
        self.sizes = [self.mesh.size(i) for i in split]
        coordinate = self.mesh.get_coordinate()
        self.coordinate = [coordinate[i] for i in split]
        # the group: this rank's replica's ranks, in the mesh's order (HSDP: one per replica)
        layout = self.mesh.mesh.reshape(-1, int(torch.tensor(self.sizes).prod())) if "replicate" in names else None
        groups = [row.tolist() for row in layout] if layout is not None else [self.mesh.mesh.flatten().tolist()]
        if len(groups) == 1 and len(groups[0]) == dist.get_world_size():
            group = dist.group.WORLD
        else:
            group, _ = dist.new_subgroups_by_enumeration(groups)
        ranks = len(groups[0])
        index = 0
        for size, c in zip(self.sizes, self.coordinate):
            index = index * size + c
        self.shards = RowShards(group, ranks, index, self.rows_of)

    def rows_of(self, rows, rank):
        """[start, end) of the rows group rank `rank` holds: each mesh dimension in turn cuts
        the rows its ranks hold (torch.chunk's split), as DTensor's Shard(0) does."""
        coordinate = []
        for size in reversed(self.sizes):
            coordinate.append(rank % size)
            rank //= size
        start, end = 0, rows
        for size, c in zip(self.sizes, reversed(coordinate)):
            a, b = chunk_rows(end - start, size, c)
            start, end = start + a, start + b
        return start, end

    def zeros(self, p, dtype):
        """Zeros of this rank's rows of parameter p's shape."""
        start, end = self.rows_of(p.shape[0], self.shards.rank)
        return torch.zeros((end - start, *p.shape[1:]), dtype=dtype, device=p.to_local().device)

    def to_rows(self, p, local):
        """This rank's rows of the tensor whose shard of parameter p is `local`."""
        whole = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        return whole.redistribute(p.device_mesh, self.placements).to_local()

    def from_rows(self, p, rows):
        """This rank's shard of parameter p of the tensor whose rows here are `rows`."""
        whole = DTensor.from_local(rows, p.device_mesh, self.placements, shape=p.shape, stride=p.stride())
        return whole.redistribute(p.device_mesh, p.placements).to_local()


def tensor_parallel_matrices(model, params, matrices):
    """`matrices` (Matrix, each a run of a parameter's rows in the model's order) with their
    runs as tensor parallelism orders the rows of qkv_proj and a gated fc1."""
    orders = row_orders(getattr(model, "module", model))
    names = {id(p): name for name, p in getattr(model, "module", model).named_parameters()}
    out = []
    for m in matrices:
        order = orders.get(names[id(params[m.param])])
        if order is None:
            out.append(m)
            continue
        where = torch.argsort(order)[m.start : m.start + m.rows]  # the matrix's rows, as ranks order them
        segments = tuple((first, count) for _, first, count in runs(where, 0, m.rows))
        out.append(Matrix(m.param, m.start, m.rows, m.cols, segments))
    return out
