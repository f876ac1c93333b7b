"""Batches per epoch, sharded over ranks, resumable mid-epoch (fairseq's EpochBatchIterator)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from data.errors import DataError


def collate(items: Sequence[np.ndarray], pad: int) -> dict:
    """Right-padded ``src_tokens = item[:-1]`` and ``target = item[1:]`` for a list of items."""
    src, target = collate_pairs([(item[:-1], item[1:]) for item in items], pad)
    return {
        "src_tokens": src,
        "target": target,
        # Counted from lengths, not from target != pad, so data never gets miscounted.
        "ntokens": sum(max(len(item) - 1, 0) for item in items),
        "nsentences": len(items),
    }


def collate_pairs(pairs: Sequence[tuple[np.ndarray, np.ndarray]], pad: int) -> tuple:
    """(src, target) rows right-padded to one width, as two B×T int64 tensors."""
    import torch  # torch-free callers (preflight's batch count) never collate

    width = max((len(s) for s, _ in pairs), default=0)
    src = np.full((len(pairs), width), pad, dtype=np.int64)
    target = np.full((len(pairs), width), pad, dtype=np.int64)
    for row, (s, t) in enumerate(pairs):
        src[row, : len(s)], target[row, : len(t)] = s, t
    return torch.from_numpy(src), torch.from_numpy(target)


def batch_by_size(order: np.ndarray, sizes: np.ndarray, batch_size: int | None, max_tokens: int | None) -> list:
    """Consecutive items of ``order`` while count <= batch_size and longest*count <= max_tokens."""
    batches, current, longest = [], [], 0
    for index, size in zip(order.tolist(), sizes[order].tolist()):
        grown = max(longest, size)
        full = (batch_size is not None and len(current) + 1 > batch_size) or (
            max_tokens is not None and grown * (len(current) + 1) > max_tokens
        )
        if current and full:
            batches.append(current)
            current, grown = [], size
        current.append(index)
        longest = grown
    if current:
        batches.append(current)
    return batches


class EpochBatchIterator:
    """Collated batches for epoch 1, 2, …; this rank's share; same batches on every run.

    Epoch ``e``'s batches depend only on ``(seed, e, num_shards, shard_id)``: items are
    permuted by ``default_rng((seed, e))``, cut into batches, the batch list is truncated
    to a multiple of ``num_shards`` (every rank runs the same number of steps, or
    collectives would hang) and rank ``shard_id`` takes ``batches[shard_id::num_shards]``.
    """

    def __init__(
        self,
        dataset,
        batch_size: int | None,
        max_tokens: int | None,
        seed: int,
        num_shards: int = 1,
        shard_id: int = 0,
        shuffle: bool = True,
        pad: int = 1,
        every_batch: bool = False,
    ):
        if batch_size is None and max_tokens is None:
            raise DataError("set --batch-size or --max-tokens")
        if batch_size is not None and batch_size < 1:
            raise DataError(f"--batch-size must be at least 1, got {batch_size}")
        if max_tokens is not None and max_tokens < 1:
            raise DataError(f"--max-tokens must be at least 1, got {max_tokens}")
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise DataError(f"shard {shard_id} of {num_shards} does not exist; need 0 <= shard_id < num_shards")
        self.dataset = dataset
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.seed = seed
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.shuffle = shuffle
        # Validation must see every batch: instead of dropping the uneven tail, ranks with
        # one batch fewer get a dummy batch (ntokens 0), so all run the same forwards.
        self.every_batch = every_batch
        self.pad = pad
        self.epoch = 0
        self.iterations_in_epoch = 0
        self._resume_pending = False
        self._cached_epoch, self._cached_batches = None, None

    def _batches(self, epoch: int) -> list[list[int]]:
        """This shard's batches (lists of item indices) for ``epoch``."""
        if self._cached_epoch == epoch:
            return self._cached_batches
        sizes = np.asarray(self.dataset.sizes)
        if self.shuffle:
            order = np.random.default_rng((self.seed, epoch)).permutation(len(sizes))
        else:
            order = np.arange(len(sizes))
        batches = batch_by_size(order, sizes, self.batch_size, self.max_tokens)
        if self.every_batch and batches:
            self._dummy = batches[0]
            batches = batches + [None] * (-len(batches) % self.num_shards)
        usable = len(batches) // self.num_shards * self.num_shards
        if usable == 0:
            raise DataError(
                f"only {len(batches)} batches for {self.num_shards} ranks; lower --batch-size/--max-tokens "
                "or use fewer ranks"
            )
        self._cached_epoch, self._cached_batches = epoch, batches[self.shard_id : usable : self.num_shards]
        return self._cached_batches

    def __len__(self) -> int:
        """Batches per shard in the current epoch (the next one before the first call)."""
        return len(self._batches(max(self.epoch, 1)))

    def next_epoch_itr(self) -> Iterator[dict]:
        """Collated batches of the next epoch, or the rest of a restored, unfinished one."""
        if self._resume_pending:
            self._resume_pending = False
        else:
            self.epoch += 1
            self.iterations_in_epoch = 0
        return self._iterate(self.epoch, self.iterations_in_epoch)

    def _iterate(self, epoch: int, offset: int) -> Iterator[dict]:
        for batch in self._batches(epoch)[offset:]:
            items = [self.dataset[i] for i in (batch if batch is not None else self._dummy)]
            # Counted before the batch is handed out: a checkpoint saved after training
            # on it records it as consumed.
            self.iterations_in_epoch += 1
            out = collate(items, self.pad)
            if batch is None:  # a dummy: run it, count nothing
                out.update(ntokens=0, nsentences=0, dummy=True)
            yield out

    def end_of_epoch(self) -> bool:
        """True when the current epoch has no batches left (or none has started)."""
        if self.epoch == 0:
            return True
        return self.iterations_in_epoch >= len(self._batches(self.epoch))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "iterations_in_epoch": self.iterations_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``next_epoch_itr()`` yields the rest of that epoch, then epochs go on."""
        self.epoch = int(state["epoch"])
        self.iterations_in_epoch = int(state["iterations_in_epoch"])
        # A finished (or never started) epoch resumes by starting the next one.
        self._resume_pending = self.epoch > 0 and not self.end_of_epoch()
