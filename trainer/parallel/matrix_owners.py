"""Whole matrices from row shards: each matrix gets one owner rank in its shard group, one
all-to-all brings every matrix's rows to its owner, one more takes the owner's result back
(--optimizer muon: trainer/train/muon.py orthogonalises whole matrices).

FSDP2 shards a parameter by rows (Shard(0), torch.chunk's split: ceil(rows / ranks) rows
a rank, the last ranks fewer or none), and an operation on a whole matrix cannot run on
rows. A parameter may stack several matrices (qkv_proj's q, k and v): each is a matrix of
its own here, (parameter, first row, rows). Owners are packed by work, longest first, onto
the least loaded rank, computed alike on every rank from shapes only, so they are never
saved: a run resumed on another number of ranks packs them again. Under HSDP the owners
are within each shard group; the replica groups compute the same. Unsharded tensors (one
process, DDP) are whole on every rank: a group of one, no collective.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.parallel.owner_packing import owners_by_work
from trainer.parallel.parallelize import local_rows


@dataclass(frozen=True)
class Matrix:
    param: int  # index into the parameters the exchange was built with
    start: int  # first row in the parameter
    rows: int
    cols: int
    # where its rows lie in the parameter's rows as the ranks split them, as runs (first row,
    # count) in the matrix's own order; None: rows start … start+rows-1. Tensor parallelism
    # orders qkv_proj's rows by rank (trainer/parallel/tensor_parallel.py): q is N runs.
    runs: tuple = None

    @property
    def segments(self):
        return self.runs or ((self.start, self.rows),)

    @property
    def work(self):
        """Newton-Schulz's cost, up to a constant: each step multiplies by the Gram matrix
        of the short side."""
        return self.rows * self.cols * min(self.rows, self.cols)


def chunk_rows(rows, ranks, rank):
    """[start, end) of the rows FSDP2's Shard(0) gives `rank` of `ranks`."""
    size = -(-rows // ranks)
    return min(rank * size, rows), min((rank + 1) * size, rows)


def shard_group(params):
    """(process group or None, ranks in it, this rank's index) of the mesh dimension the
    parameters are sharded on; (None, 1, 0) when none is."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return None, 1, 0
    mesh, placements = sharded[0].device_mesh, sharded[0].placements
    dims = [d for d, pl in enumerate(placements) if pl.is_shard()]
    if (
        len(sharded) < len(params)
        or any(p.device_mesh != mesh or p.placements != placements for p in sharded)
        or len(dims) != 1
        or placements[dims[0]].dim != 0
    ):
        raise RuntimeError(f"whole-matrix exchange expects every matrix sharded by rows alike, got {placements}")
    return mesh.get_group(dims[0]), mesh.size(dims[0]), mesh.get_local_rank(dims[0])


class RowShards:
    """How the ranks of a group hold a parameter's rows: (group or None, ranks, this rank's
    index, rows(param rows, rank) → [start, end))."""

    def __init__(self, group, ranks, rank, rows=None):
        self.group, self.ranks, self.rank = group, ranks, rank
        self.rows = rows or (lambda n, r: chunk_rows(n, ranks, r))


class MatrixExchange:
    """The owners of `matrices` (Matrix) of `params`, and the row pieces each rank sends
    and receives, fixed at construction: every step moves the same bytes. shards: how the
    ranks hold the rows (RowShards); default FSDP2's, over the parameters' shard group."""

    def __init__(self, params, matrices, shards=None):
        self.matrices = matrices
        if shards is None:
            shards = RowShards(*shard_group(params))
            for p in params:  # the split assumed here must be FSDP2's
                local, offset = local_rows(p)
                start, end = chunk_rows(p.shape[0], shards.ranks, shards.rank)
                if (offset if end > start else start) != start or local.shape[0] != end - start:
                    raise RuntimeError(f"unexpected row shards of a {list(p.shape)} parameter")
        self.group, self.ranks, self.rank, self.shard_rows = shards.group, shards.ranks, shards.rank, shards.rows
        self.owners = owners_by_work([m.work for m in matrices], self.ranks)
        self.owned = [i for i, o in enumerate(self.owners) if o == self.rank]
        self.device = None
        if self.group is not None:  # collectives run on the mesh's device (GPUs under --cpu-offload)
            mesh_device = next(p for p in params if isinstance(p, DTensor)).device_mesh.device_type
            self.device = torch.device(mesh_device, torch.cuda.current_device()) if mesh_device == "cuda" else None
        self.param_rows = [p.shape[0] for p in params]
        # What this rank sends to each owner: (matrix, run, first local row, rows), owner by
        # owner, matrices in index order; it receives the same pieces back from the owners.
        self.sent = [
            [piece for m in self.owned_by(dest) for piece in self.pieces(m, self.rank)] for dest in range(self.ranks)
        ]
        # What this rank receives as an owner: each owned matrix's pieces from each rank.
        self.received = [[piece for m in self.owned for piece in self.pieces(m, src)] for src in range(self.ranks)]

    def owned_by(self, rank):
        return [i for i, o in enumerate(self.owners) if o == rank]

    def pieces(self, m, rank):
        """[(matrix, run, first row relative to the rank's shard, rows)] of matrix m that
        `rank` holds, one for each of its runs."""
        matrix = self.matrices[m]
        start, end = self.shard_rows(self.param_rows[matrix.param], rank)
        out = []
        for j, (first, count) in enumerate(matrix.segments):
            a, b = max(start, first), min(end, first + count)
            out.append((m, j, a - start, max(b - a, 0)))
        return out

    def gather(self, local):
        """{owned matrix index: the whole matrix} from each rank's local rows `local` (one
        tensor per parameter, this rank's shard, all of one dtype)."""
        send = [local[self.matrices[m].param][a : a + n] for dest in self.sent for m, _, a, n in dest]
        recv = self.all_to_all(send, self.sent, self.received, local[0].dtype)
        pieces = {m: [] for m in self.owned}
        received = ((src, piece) for src, src_pieces in enumerate(self.received) for piece in src_pieces)
        for (src, (m, j, _, _)), t in zip(received, recv):
            pieces[m].append(((j, src), t))  # a run's rows rank after rank: the matrix's order
        return {
            m: torch.cat([t for _, t in sorted(ts, key=lambda x: x[0])]).view(
                self.matrices[m].rows, self.matrices[m].cols
            )
            for m, ts in pieces.items()
        }

    def scatter(self, whole):
        """[(matrix index, first local row, rows, tensor)] of this rank's rows of every
        matrix, from the owners' results `whole` ({owned matrix index: whole matrix})."""
        dtype = next(iter(whole.values())).dtype if whole else torch.bfloat16
        send = []
        for src, pieces in enumerate(self.received):
            for m, j, _, n in pieces:
                matrix = self.matrices[m]
                first, _ = matrix.segments[j]
                start = self.shard_rows(self.param_rows[matrix.param], src)[0]
                before = sum(count for _, count in matrix.segments[:j])  # the earlier runs' rows
                offset = before + max(start - first, 0)  # src's first row of the run, in the matrix
                send.append(whole[m][offset : offset + n])
        recv = self.all_to_all(send, self.received, self.sent, dtype)
        return [(m, a, n, t) for (m, _, a, n), t in zip((p for dest in self.sent for p in dest), recv)]

    def all_to_all(self, send, send_layout, recv_layout, dtype):
        """One all-to-all of `send` (2-D row pieces, in `send_layout` order); returns the
        pieces of `recv_layout`, each (rows, cols)."""
        shapes = [[(n, self.matrices[m].cols) for m, _, _, n in pieces] for pieces in recv_layout]
        if self.group is None:
            return send  # one rank: it sends to itself what it receives
        device = self.device or (send[0].device if send else torch.device("cpu"))
        # A rank with nothing to send (it owns no piece: more ranks than matrices) still joins
        # on the group's device: a host tensor in an NCCL all-to-all fails, or hangs its peers.
        flat = (
            torch.cat([t.reshape(-1) for t in send]).to(device) if send else torch.empty(0, dtype=dtype, device=device)
        )
        out_splits = [sum(r * c for r, c in s) for s in shapes]
        in_splits = [sum(n * self.matrices[m].cols for m, _, _, n in pieces) for pieces in send_layout]
        out = torch.empty(sum(out_splits), dtype=dtype, device=flat.device)
        dist.all_to_all_single(out, flat.to(dtype), out_splits, in_splits, group=self.group)
        views, offset = [], 0
        for r, c in (s for src in shapes for s in src):
            views.append(out[offset : offset + r * c].view(r, c))
            offset += r * c
        return views
