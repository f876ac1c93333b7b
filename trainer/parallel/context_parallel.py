"""Context parallelism (--context-parallel-size N): each of N ranks holds 1/N of every
sequence's positions, and attention gathers the others' keys and values (Llama 3's way:
an all-gather of K/V per layer, whose backward reduce-scatters their gradients).

Causal attention costs a query in proportion to its position, so a plain split would give
the last rank most of the work: the sequence is cut into 2N chunks and rank r holds chunk r
and chunk 2N-1-r (one from each end). Everything else a layer does is per position and
runs on the rank's own positions; the tokens' positions (RoPE, learned, sinusoidal) stay
global. Each chunk attends causally to the keys up to its end, so no mask of the rank's
queries over the whole sequence is made; packed documents (--task sft,
--per-document-attention) keep their per-document mask of those queries over every key.
Ranks of one context group read the same batches; each counts and scores its own
positions, so token counts and losses are summed over them as over data-parallel ranks;
a loss of whole sequences (dpo's summed log-likelihoods) sums the ranks' parts of each
row over the group first (sum_rows). Parameters are replicated over the group and FSDP
shards them over it as over more data-parallel ranks.
"""

import torch
import torch.distributed as dist

from models.documents import document_positions


def local_positions(length, n, r):
    """The positions (of a sequence of `length`) context rank r of n holds: chunk r and
    chunk 2n-1-r of 2n as even as can be."""
    chunks = torch.arange(length).tensor_split(2 * n)
    return torch.cat((chunks[r], chunks[2 * n - 1 - r]))


class GatherKeysValues(torch.autograd.Function):
    """This rank's keys (or values), B×H×T_r×D at its positions, → the whole sequence's,
    B×H×T×D in order; backward sums every rank's gradient of them and keeps this rank's."""

    @staticmethod
    def forward(ctx, local, split, group):
        ctx.split, ctx.group = split, group
        padded = _pad(local, split.longest)
        B, H, _, D = local.shape
        # the ranks' parts one after the other along dim 0, as every backend takes them
        out = torch.empty((split.n * B, *padded.shape[1:]), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        flat = out.view(split.n, B, H, split.longest, D).permute(1, 2, 0, 3, 4).reshape(B, H, -1, D)
        return flat.index_select(2, split.gathered_index)

    @staticmethod
    def backward(ctx, grad):
        split = ctx.split
        B, H, _, D = grad.shape
        flat = grad.new_zeros(B, H, split.n * split.longest, D)
        flat.index_copy_(2, split.gathered_index, grad)
        parts = flat.view(B, H, split.n, split.longest, D).permute(2, 0, 1, 3, 4).reshape(split.n * B, H, -1, D)
        mine = grad.new_empty(B, H, split.longest, D)
        dist.reduce_scatter_tensor(mine, parts, group=ctx.group)
        return mine[:, :, : split.local_length], None, None


class SumOverGroup(torch.autograd.Function):
    """x summed over a group's ranks, on each of them; backward sums the ranks' gradients of
    that sum, each of which this rank's x reaches."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _pad(t, length):
    if t.shape[2] == length:
        return t
    return torch.cat((t, t.new_zeros(*t.shape[:2], length - t.shape[2], t.shape[3])), dim=2)


class SequenceSplit:
    """How a sequence of `length` positions is split over the n ranks of a context group;
    its index tensors on `device`, made once for each length."""

    def __init__(self, length, n, rank, device):
        self.n = n
        per_rank = [local_positions(length, n, r) for r in range(n)]
        self.local_host = per_rank[rank]  # to count the batch's host tokens with
        self.local = to_device(self.local_host, device)
        self.local_length = len(self.local_host)
        self.longest = max(len(p) for p in per_rank)
        # the rank's two chunks as runs of its positions: (first, end) there and the
        # sequence's position after the chunk's last, up to which its queries see the keys
        chunks = torch.arange(length).tensor_split(2 * n)
        mine = [chunks[rank], chunks[2 * n - 1 - rank]]
        firsts = [0, len(mine[0])]
        self.query_chunks = [(a, a + len(c), int(c[-1]) + 1) for a, c in zip(firsts, mine) if len(c)]
        # where each position of the sequence sits in the ranks' gathered, padded parts
        slots = torch.cat([r * self.longest + torch.arange(len(p)) for r, p in enumerate(per_rank)])
        self.gathered_index = to_device(slots[torch.argsort(torch.cat(per_rank))], device)


def to_device(t, device):
    """A host tensor on `device`, from pinned memory on a GPU (queued, as the batches are)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


class Context:
    """What the model's forward takes (TransformerLM.forward's `context`) on a context rank:
    its tokens' global positions, the sequence's length, its chunks as runs of its positions
    (query_chunks), with packed documents the mask of its queries over all keys (None
    otherwise), and the function attention gathers keys and values with; for losses of
    whole sequences, how the group sums rows and counts them once."""

    def __init__(self, positions, span, mask, split, group, first):
        self.positions, self.span, self.mask = positions, span, mask
        self.split, self.group, self.first = split, group, first
        self.query_chunks = split.query_chunks

    def keys_values(self, k, v):
        return GatherKeysValues.apply(k, self.split, self.group), GatherKeysValues.apply(v, self.split, self.group)

    def sum_rows(self, x):
        """Per-row sums over this rank's positions (B) → the whole rows' sums, on every rank;
        the gradient of each rank's use of them reaches every rank's positions."""
        return SumOverGroup.apply(x, self.group)

    def count_once(self, x):
        """x, a value every rank of the group computes alike from sum_rows, on its first rank
        and zero on the others, so that summing over ranks counts it once. Zero by
        multiplication, not a constant: every rank's backward must pass through sum_rows's,
        whose all-reduce the group's ranks join together."""
        return x if self.first else x * 0


class ContextSplit:
    """Cuts each batch to this rank's positions (Trainer.train_step / valid_step)."""

    def __init__(self, env, per_document, pad):
        self.env, self.per_document, self.pad = env, per_document, pad
        self.n, self.rank, self.group = env.cp, env.cp_rank, env.cp_group
        self.splits = {}  # SequenceSplit by sequence length

    def split(self, length):
        if length not in self.splits:
            self.splits[length] = SequenceSplit(length, self.n, self.rank, self.env.device)
        return self.splits[length]

    def __call__(self, batch):
        tokens, target = batch["src_tokens"], batch["target"]
        B, T = tokens.shape
        split = self.split(T)
        device = self.env.device
        segments = batch.get("segments") if self.per_document else None
        if segments is None:  # causal attention of each chunk over the keys before its end: no mask
            positions, mask = split.local.expand(B, -1), None
        else:
            # Packed documents' mask (this rank's queries × every key) is made where attention
            # reads it: on a GPU, from the segments there, never copied from the host.
            segments = segments.to(device, non_blocking=True)
            positions = document_positions(segments)[:, split.local]
            keys = torch.arange(T, device=device)
            same = segments[:, split.local, None] == segments[:, None, :]
            mask = (same & (keys[None, None, :] <= split.local[None, :, None]))[:, None]
        # cut on the device from the loader's pinned batch (a cut on the host would be a new,
        # pageable tensor to copy); the tokens counted on the host, where the batch is
        ntokens = int((target[:, split.local_host] != self.pad).sum())
        return {
            **{k: v for k, v in batch.items() if k not in ("segments",)},
            "src_tokens": tokens.to(device, non_blocking=True)[:, split.local],
            "target": target.to(device, non_blocking=True)[:, split.local],
            "ntokens": ntokens,
            # each sequence counted once in the group: by its first rank (dpo's pairs too)
            "nsentences": batch["nsentences"] if self.rank == 0 else 0,
            **({"sample_size": batch["sample_size"] if self.rank == 0 else 0} if "sample_size" in batch else {}),
            "context": Context(positions, T, mask, split, self.group, self.rank == 0),
        }
