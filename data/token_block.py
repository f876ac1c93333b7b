"""Cutting a token file into training blocks, fairseq's ``--sample-break-mode`` way.

Every block is described by the range of stream positions it *predicts*,
``[target_start, target_end)`` with at most ``tokens_per_sample`` targets. The item is
the token before the first target (its context) followed by the targets, so
``input = item[:-1]``, ``target = item[1:]`` and items are at most
``tokens_per_sample + 1`` long. As in fairseq's TokenBlockDataset (``include_targets``,
as LanguageModelingTask builds it), the context of a block whose first target starts a
sequence is ``</s>`` (fairseq: ``source = cat([eos], buffer[0 : e - 1])`` when the block's
offset in its first sequence is 0), and otherwise the stream's previous token. The two
agree wherever the previous sequence ends with ``</s>``, as every sequence written by
``preprocess`` or fairseq-preprocess does; the stream's first block gets a virtual
``</s>``.

* ``none``: the stream is cut every T tokens from position 0, targets ``[kT, kT + T)``;
  the item is ``[</s>] + stream[0 : T]`` for k = 0 and ``stream[kT - 1 : kT + T]`` after
  (``</s>`` first when kT starts a sequence), so consecutive blocks overlap by one token
  and every token of the stream, its first included, is a target exactly once:
  ``ceil(len / T)`` blocks (fairseq-eval-lm's "N examples") scoring ``len`` tokens.
* ``complete`` / ``complete_doc`` / ``eos``: blocks start at a sequence boundary, so their
  context is ``</s>``, and every token of every sequence, its first included, is a target.
  ``eos`` makes one block per sequence; ``complete`` packs whole sequences greedily;
  ``complete_doc`` does too but never across a document boundary, a sequence that is
  only ``</s>`` (a blank input line), which like in fairseq belongs to no block.
  A sequence longer than T fits in no block: as in fairseq, where it becomes a block
  longer than the model's positions that batching filters out, it is left out, and
  ``too_long`` lists it (its index in the file) for the task to warn or refuse.
"""

from __future__ import annotations

import numpy as np

from data.errors import DataError, checked_index
from data.indexed_dataset import IndexedDataset
from data.iterator import collate

BREAK_MODES = ("none", "complete", "complete_doc", "eos")


def _pack(seq_starts: np.ndarray, seq_ends: np.ndarray, group: np.ndarray, limit: int):
    """Greedy packing of consecutive sequences (each at most ``limit`` long) into blocks of
    at most ``limit`` targets.

    A block never spans two ``group`` values (documents). Returns block target ranges.
    """
    n = len(seq_starts)
    if n == 0:
        return seq_starts, seq_ends
    lengths = seq_ends - seq_starts
    before = np.concatenate([[0], np.cumsum(lengths)])  # targets before sequence i
    # The block starting at sequence i ends before the first one that would overflow it,
    # or that starts a new document; computed for every i at once.
    overflow = np.searchsorted(before, before[:-1] + limit, side="right") - 1
    group_end = np.searchsorted(group, group, side="right")
    next_start = np.minimum(overflow, group_end).tolist()
    block_first = []
    i = 0
    while i < n:  # one step per block, not per token
        block_first.append(i)
        i = next_start[i]
    block_first = np.asarray(block_first, dtype=np.int64)
    block_last = np.append(block_first[1:], n) - 1
    return seq_starts[block_first], seq_ends[block_last]


class TokenBlockDataset:
    """Blocks of at most ``tokens_per_sample + 1`` tokens over an ``IndexedDataset``."""

    def __init__(
        self,
        indexed: IndexedDataset,
        tokens_per_sample: int,
        break_mode: str,
        pad: int = 1,
        eos: int = 2,
    ):
        if break_mode not in BREAK_MODES:
            raise DataError(f"unknown --sample-break-mode {break_mode!r}; use one of {', '.join(BREAK_MODES)}")
        if tokens_per_sample < 1:
            raise DataError(f"--tokens-per-sample must be at least 1, got {tokens_per_sample}")
        if not indexed.is_contiguous():
            raise DataError(
                f"{indexed.prefix}.idx does not list its sequences back to back; re-run preprocess to rebuild it"
            )
        self.indexed = indexed
        self.tokens_per_sample = tokens_per_sample
        self.break_mode = break_mode
        self.pad = pad
        self.eos = eos
        self._stream = indexed.tokens
        self.too_long = np.zeros(0, dtype=np.int64)  # sequences left out: longer than a block
        self.target_starts, self.target_ends = self._block_ranges()
        self.sizes = (self.target_ends - self.target_starts + 1).astype(np.int64)
        # Blocks whose first target starts a sequence: their context is </s> (fairseq's s == 0).
        lengths = self.indexed.sizes.astype(np.int64)
        self.starts_sequence = np.isin(self.target_starts, np.cumsum(lengths) - lengths)

    def _block_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        T = self.tokens_per_sample
        lengths = self.indexed.sizes.astype(np.int64)
        stream_len = int(lengths.sum())
        if self.break_mode == "none":
            starts = np.arange(0, stream_len, T, dtype=np.int64)
            return starts, np.minimum(starts + T, stream_len)
        seq_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        separator = np.zeros(len(lengths), dtype=bool)
        if self.break_mode == "complete_doc":
            candidates = np.flatnonzero(lengths == 1)
            separator[candidates] = self._stream[seq_starts[candidates]] == self.eos
        too_long = (lengths > T) & ~separator
        self.too_long = np.flatnonzero(too_long)
        # A left-out sequence ends packing as a document boundary does: a block is one
        # range of the stream, so it cannot hold the sequences on both sides of it.
        group = np.cumsum(separator | too_long)
        keep = ~(separator | too_long) & (lengths > 0)
        seq_starts, lengths, group = seq_starts[keep], lengths[keep], group[keep]
        if self.break_mode == "eos":
            return seq_starts, seq_starts + lengths
        return _pack(seq_starts, seq_starts + lengths, group, T)

    # Pickle without the token map (numpy would copy the whole file into the pickle);
    # the IndexedDataset pickles by path and re-maps it.
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_stream"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._stream = self.indexed.tokens

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        i = checked_index(i, len(self.sizes), "block")
        start, end = int(self.target_starts[i]), int(self.target_ends[i])
        if self.starts_sequence[i]:  # fairseq's source starts with </s> there
            return np.concatenate([[self.eos], self._stream[start:end]]).astype(np.int64)
        return self._stream[start - 1 : end].astype(np.int64)

    @property
    def num_tokens(self) -> int:
        """Targets per epoch (each item contributes ``len(item) - 1``)."""
        return int((self.target_ends - self.target_starts).sum())

    def length_of(self, sequence: int) -> int:
        """Tokens of sequence ``sequence`` of the file (one of ``too_long``)."""
        return int(self.indexed.sizes[sequence])

    def sequence_lengths(self, i: int) -> np.ndarray:
        """The lengths of the whole sequences block i holds (not with ``none``, which cuts them)."""
        if not hasattr(self, "_seq_ends"):
            self._seq_ends = np.cumsum(self.indexed.sizes.astype(np.int64))
        first = np.searchsorted(self._seq_ends, self.target_starts[i], side="right")
        last = np.searchsorted(self._seq_ends, self.target_ends[i], side="left")
        return self.indexed.sizes[first : last + 1].astype(np.int64)


class DocumentBlocks:
    """--per-document-attention: a TokenBlockDataset's items with the lengths of the
    sequences they hold. Sequence k of a block is predicted from the ``</s>`` before it and
    its own tokens but the last, so its inputs are as many as its tokens: the lengths cut
    ``item[:-1]`` into the documents the model keeps apart."""

    def __init__(self, blocks: TokenBlockDataset):
        self.blocks, self.sizes, self.too_long = blocks, blocks.sizes, blocks.too_long
        self.length_of = blocks.length_of

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int):
        return self.blocks[i], self.blocks.sequence_lengths(i)

    @property
    def num_tokens(self) -> int:
        return self.blocks.num_tokens


def collate_documents(items, pad: int, width: int | None = None) -> dict:
    """DocumentBlocks' items collated as ``collate`` does, with ``segments``: each input
    position's document, numbered from 0 in its row (padding continues the last)."""
    import torch  # torch-free callers (preflight's batch count) never collate

    out = collate([item for item, _ in items], pad, width=width)
    segments = np.zeros(tuple(out["src_tokens"].shape), dtype=np.int64)
    for row, (item, lengths) in enumerate(items):
        n = len(item) - 1
        segments[row, :n] = np.repeat(np.arange(len(lengths)), lengths)
        segments[row, n:] = len(lengths) - 1
    out["segments"] = torch.from_numpy(segments)
    return out


class ConcatDataset:
    """Several datasets' items as one dataset, in order (fairseq's ConcatDataset):
    --combine-valid-subsets validates on valid, valid1, … as one split. Each file is cut
    into blocks on its own, so no block spans two files."""

    def __init__(self, datasets):
        self.datasets = list(datasets)
        self.sizes = np.concatenate([d.sizes for d in self.datasets]).astype(np.int64)
        self._ends = np.cumsum([len(d) for d in self.datasets])

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        i = checked_index(i, len(self.sizes), "block")
        k = int(np.searchsorted(self._ends, i, side="right"))
        return self.datasets[k][i - (int(self._ends[k - 1]) if k else 0)]

    @property
    def num_tokens(self) -> int:
        return sum(d.num_tokens for d in self.datasets)
