"""Sums over the ranks that hold the parts of the parameters: what an optimizer whose update
is not elementwise (Adafactor's row and column statistics, LAMB's norms) needs from the
other parts of a parameter.

FSDP2 gives a rank some of a parameter's rows; tensor parallelism gives it rows
(column-parallel weights, the vocabulary) or columns (row-parallel weights), or the whole
parameter (norms); the two compose on one mesh. So every sum is written in the whole
parameter's coordinates (one value per logical tensor, per column or per row of it), which
mean the same on every rank: a rank adds its part's partial sums at their places and zeros
elsewhere, and one sum over every mesh dimension that splits some parameter gives each the
whole parameter's. A part held whole by several ranks of those dimensions (a norm on each
tensor-parallel rank, a row-parallel weight's rows) is counted by one of them only
(RowBlocks.counted). HSDP's replicas hold the same parts and are not added.

Every sum an optimizer step needs is packed into one flat tensor and reduced in one
collective: a step of a model with hundreds of parameters then waits for one all-reduce,
not hundreds of tiny ones.

A parameter may stack several logical tensors by rows (qkv_proj's q, k and v; a gated
fc1's gate and up: DecoderLayer.weight_blocks), each a parameter of its own in Hugging
Face's and fairseq's models. Per-tensor statistics are then per logical tensor: a rank's
rows of each (RowBlocks.pieces) are summed apart (block_sums), and a value per logical
tensor is spread back over its rows (per_row). Tensor parallelism orders such a
parameter's rows by rank (tensor_parallel.tp_row_order): a rank's rows of each logical
tensor are still one run, at another place.
"""

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def shard_layout(params):
    """(mesh, placements of the sum: Partial on each mesh dimension that splits some
    parameter, Replicate on those that split none: HSDP's replicas), or None when no
    parameter is a DTensor (one process, DDP: every rank holds whole tensors and nothing is
    summed). Refuses parameters on several meshes, or a mix of DTensors and plain tensors:
    parallelize() puts every parameter on one mesh."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return None
    mesh = sharded[0].device_mesh
    if len(sharded) < len(params) or any(p.device_mesh != mesh for p in sharded):
        raise RuntimeError("parameters on different meshes: a layout parallelize() does not build")
    split = [any(not p.placements[d].is_replicate() for p in sharded) for d in range(mesh.ndim)]
    return mesh, [Partial("sum") if s else Replicate() for s in split]


def sum_over_shards(local, layout):
    """`local` (a 1-d float tensor of this rank's partial sums, in the whole parameters'
    coordinates) summed over the ranks that hold the other parts of the same parameters.
    `local` itself without a layout."""
    if layout is None:
        return local
    mesh, partial = layout
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
    keep their true lengths; `local` itself for a plain parameter. A parameter whose columns
    are split (RowBlocks.split_cols) keeps its rows' statistics whole instead
    (replicated_like)."""
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


class RowBlocks:
    """Where this rank's part of parameter p lies in the whole and in the logical tensors p
    stacks by rows (`blocks`: their row counts in the model's order; None: p is one tensor;
    `order`: p's rows as tensor parallelism orders them, tensor_parallel.row_orders, or None).

    pieces: [(first local row, row count)] of each logical tensor, in order, (0, 0) where this
    rank has none; they tile the local rows (a 0-d parameter is one row).
    rows: this rank's rows of the whole parameter (a slice, in p's own order); cols: its
    columns (a slice), or None where it holds every column.
    split_cols: p's columns are split on some mesh dimension (by its placements, the same on
    every rank), so its rows' sums are partial on each rank.
    counted: whether this rank's sums of p count, False on all but one of the ranks of the
    summed mesh dimensions that hold the same part (where p is replicated).
    counts, numel: each logical tensor's rows and elements, the divisors of its means.
    """

    def __init__(self, p, blocks, order, layout, device):
        rows = tuple(blocks or (p.shape[0] if p.ndim else 1,))
        self.counts = torch.tensor(rows, dtype=torch.float32, device=device)
        self.numel = self.counts * (p.numel() // sum(rows))
        self.model_pieces = [(sum(rows[:i]), n) for i, n in enumerate(rows)]
        self.height, self.width = (p.shape[0] if p.ndim else 1), (p.shape[-1] if p.ndim > 1 else None)
        self.cols, self.split_cols, self.counted = None, False, True
        shape, offset = tuple(p.shape), (0,) * p.ndim
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            if tuple(shape) != tuple(local_shards([p])[0].shape):
                raise RuntimeError(f"unexpected shard layout of a {list(p.shape)} parameter: {p.placements}")
            self.split_cols = p.ndim > 1 and any(pl.is_shard() and pl.dim > 0 for pl in p.placements)
            if p.ndim > 1 and shape[1] != p.shape[1]:
                self.cols = slice(offset[1], offset[1] + shape[1])
            coordinate = p.device_mesh.get_coordinate()
            self.counted = all(
                coordinate[d] == 0
                for d, (pl, summed) in enumerate(zip(p.placements, layout[1]))
                if pl.is_replicate() and not summed.is_replicate()
            )
        if p.ndim > 2 and self.split_cols:
            raise RuntimeError(f"a {list(p.shape)} parameter split by columns: a layout parallelize() does not build")
        first, count = (offset[0], shape[0]) if p.ndim else (0, 1)
        self.rows = slice(first, first + count)
        # p's rows (its own order) where the model's order has them: a split matrix's whole
        # rows are put back in that order to take their means
        self.model_order = torch.argsort(order).to(device) if order is not None else None
        model_row = order[self.rows] if order is not None else torch.arange(self.rows.start, self.rows.stop)
        block = torch.bucketize(model_row, torch.tensor([a + n for a, n in self.model_pieces]), right=True)
        self.pieces = []
        for b in range(len(rows)):
            local = (block == b).nonzero().flatten()
            if len(local) and local[-1] - local[0] + 1 != len(local):
                raise RuntimeError(f"a logical tensor's rows of a {list(p.shape)} parameter are not one run here")
            self.pieces.append((int(local[0]), len(local)) if len(local) else (0, 0))

    def counted_only(self, sums):
        """`sums` (this rank's partial sums of p) as they enter a sum over the mesh: zeros
        where another rank holding the same part counts them."""
        return sums if self.counted else torch.zeros_like(sums)

    def whole_columns(self, sums):
        """`sums` (…, this rank's columns) in p's whole columns, zeros at the others'."""
        if self.cols is None:
            return sums
        whole = sums.new_zeros((*sums.shape[:-1], self.width))
        whole[..., self.cols] = sums
        return whole

    def whole_rows(self, sums):
        """`sums` (one per local row) in p's whole rows, zeros at the others'."""
        whole = sums.new_zeros((self.height, *sums.shape[1:]))
        whole[self.rows] = sums
        return whole

    def model_block_means(self, whole_rows):
        """Per logical tensor, the mean of `whole_rows` (one value per row of p, in p's own
        order) over its rows, summed in the model's order (as one process sums them)."""
        in_model_order = whole_rows if self.model_order is None else whole_rows[self.model_order]
        return block_sums(in_model_order, self.model_pieces) / self.counts


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
