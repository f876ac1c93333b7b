"""Batches per epoch, sharded over ranks, resumable mid-epoch, loaded by worker processes
(fairseq's EpochBatchIterator)."""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from data.errors import DataError


def collate(items: Sequence[np.ndarray], pad: int, bos: int | None = None, width: int | None = None) -> dict:
    """A batch of items: ``src_tokens = item[:-1]``, ``target = item[1:]``, right-padded
    (see collate_pairs for ``bos`` and ``width``)."""
    out = collate_pairs([(item[:-1], item[1:]) for item in items], pad, bos, width)
    # Counted from lengths, not from target != pad, so data never gets miscounted.
    out["ntokens"] = sum(max(len(item) - 1, 0) for item in items)
    return out


def collate_pairs(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], pad: int, bos: int | None = None, width: int | None = None
) -> dict:
    """(input, target) rows right-padded into two B×T int64 tensors, T = the longest row or
    ``width`` if that is more (--pad-to-fixed-length). With ``bos`` (--add-bos-token) each
    row starts with <s>, whose target is pad: fairseq scores a <s> target there (and its
    eval-lm drops it); shardlm never scores it, so the valid loss is eval-lm's loss."""
    import torch  # torch-free callers (preflight's batch count) never collate

    if bos is not None:
        pairs = [(np.concatenate([[bos], s]), np.concatenate([[pad], t])) for s, t in pairs]
    width = max([len(s) for s, _ in pairs] + [width or 0])
    src = np.full((len(pairs), width), pad, dtype=np.int64)
    target = np.full((len(pairs), width), pad, dtype=np.int64)
    for row, (s, t) in enumerate(pairs):
        src[row, : len(s)], target[row, : len(t)] = s, t
    return {
        "src_tokens": torch.from_numpy(src),
        "target": torch.from_numpy(target),
        "ntokens": int((target != pad).sum()),
        "nsentences": len(pairs),
    }


def batch_by_size(
    order: np.ndarray, num_tokens: np.ndarray, batch_size: int | None, max_tokens: int | None, multiple: int = 1
) -> list[list[int]]:
    """Consecutive items of ``order`` in batches of at most ``batch_size`` items and at most
    ``max_tokens`` = items × longest, with sizes below ``multiple`` or multiples of it
    (fairseq's batch_by_size_vec, --required-batch-size-multiple).

    A batch that would overflow ends at its last size that was a multiple (the
    ``max(N * (len // N), len % N)`` cut); the items after that start the next batch (or
    become a batch of their own when they and the new item overflow by tokens). At the end
    the last batch and the items after its last multiple are two batches. fairseq then
    drops that final batch when it is not a multiple (its issue #5036: up to N - 1 valid
    sentences never scored, all of them when they are fewer than N); here it is kept.
    """
    sizes = num_tokens[order].tolist()
    cuts = []  # where batches end, as positions in ``order``
    # The open batch is order[start:end] (a size that fits the multiple); order[end:pos] its tail.
    start = end = 0
    batch_longest = tail_longest = 0
    for pos, n in enumerate(sizes):
        tail_longest = max(tail_longest, n)
        count, longest = pos + 1 - start, max(batch_longest, tail_longest)
        if (batch_size is not None and count > batch_size) or (max_tokens is not None and count * longest > max_tokens):
            cuts.append(end)
            if max_tokens is not None and (pos + 1 - end) * tail_longest > max_tokens:
                cuts.append(pos)
                end, tail_longest = pos, n
            start, end, batch_longest, tail_longest = end, pos + 1, tail_longest, 0
        elif count < multiple or count % multiple == 0:
            end, batch_longest, tail_longest = pos + 1, longest, 0
    cuts.append(end)
    return [b.tolist() for b in np.split(np.asarray(order), cuts) if len(b)]


class EpochBatchIterator:
    """Collated batches for epoch 1, 2, …; this rank's share; same batches on every run.

    Epoch ``e``'s batches depend only on ``(seed, e, num_shards, shard_id)``: items are
    permuted by ``default_rng((seed, e))``, cut into batches, the batch list is truncated
    to a multiple of ``num_shards`` (every rank runs the same number of steps, or
    collectives would hang) and rank ``shard_id`` takes ``batches[shard_id::num_shards]``.

    ``dataset`` is a dataset, or a function ``epoch -> dataset`` (sharded data: each epoch
    reads its own). An item's size for ``max_tokens`` is its input length, ``len(item) - 1``
    (fairseq's block size). ``num_workers`` processes read and collate batches ahead of
    the loop (torch's DataLoader, as fairseq's iterators); 0 does it in this process.
    The batches and their order are the same for any number of workers.
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
        required_batch_size_multiple: int = 1,
        num_workers: int = 0,
        collater: Callable | None = None,
        worker_init: Callable | None = None,
    ):
        if batch_size is None and max_tokens is None:
            raise DataError("set --batch-size or --max-tokens")
        if batch_size is not None and batch_size < 1:
            raise DataError(f"--batch-size must be at least 1, got {batch_size}")
        if max_tokens is not None and max_tokens < 1:
            raise DataError(f"--max-tokens must be at least 1, got {max_tokens}")
        if required_batch_size_multiple < 1:
            raise DataError(f"--required-batch-size-multiple must be at least 1, got {required_batch_size_multiple}")
        if num_workers < 0:
            raise DataError(f"--num-workers must be >= 0, got {num_workers}")
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise DataError(f"shard {shard_id} of {num_shards} does not exist; need 0 <= shard_id < num_shards")
        self._dataset_for_epoch = dataset if callable(dataset) else (lambda epoch: dataset)
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.seed = seed
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.shuffle = shuffle
        # Validation must see every batch: instead of dropping the uneven tail, ranks with
        # one batch fewer get a dummy batch (ntokens 0), so all run the same forwards.
        self.every_batch = every_batch
        self.multiple = required_batch_size_multiple
        self.num_workers = num_workers
        self.worker_init = worker_init  # run first in each worker process (torch's worker_init_fn)
        self.collater = collater or functools.partial(collate, pad=pad)
        self.epoch = 0
        self.iterations_in_epoch = 0
        self._resume_pending = False
        self._cached = None  # (epoch, its dataset, this shard's batches)

    def _epoch_batches(self, epoch: int):
        """(dataset, this shard's batches as lists of item indices) of ``epoch``."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1:]
        dataset = self._dataset_for_epoch(epoch)
        num_tokens = np.asarray(dataset.sizes) - 1
        if self.shuffle:
            order = np.random.default_rng((self.seed, epoch)).permutation(len(num_tokens))
        else:
            order = np.arange(len(num_tokens))
        batches = batch_by_size(order, num_tokens, self.batch_size, self.max_tokens, self.multiple)
        if self.every_batch and batches:
            # A dummy batch (None) is the epoch's first batch, counted as nothing.
            batches = batches + [None] * (-len(batches) % self.num_shards)
        usable = len(batches) // self.num_shards * self.num_shards
        if usable == 0:
            raise DataError(
                f"only {len(batches)} batches for {self.num_shards} ranks; lower --batch-size/--max-tokens "
                "or use fewer ranks"
            )
        mine = [b if b is not None else _Dummy(batches[0]) for b in batches[self.shard_id : usable : self.num_shards]]
        self._cached = (epoch, dataset, mine)
        return dataset, mine

    def __len__(self) -> int:
        """Batches per shard in the current epoch (the next one before the first call)."""
        return len(self._epoch_batches(max(self.epoch, 1))[1])

    def next_epoch_itr(self) -> Iterator[dict]:
        """Collated batches of the next epoch, or the rest of a restored, unfinished one."""
        if self._resume_pending:
            self._resume_pending = False
        else:
            self.epoch += 1
            self.iterations_in_epoch = 0
        return self._iterate(self.epoch, self.iterations_in_epoch)

    def _iterate(self, epoch: int, offset: int) -> Iterator[dict]:
        dataset, batches = self._epoch_batches(epoch)
        loaded = _load(_CollatedBatches(dataset, batches[offset:], self.collater), self.num_workers, self.worker_init)
        for out in loaded:
            # Counted as the loop takes the batch, not as a worker reads it: a checkpoint
            # saved after training on it records it as consumed.
            self.iterations_in_epoch += 1
            yield out

    def end_of_epoch(self) -> bool:
        """True when the current epoch has no batches left (or none has started)."""
        if self.epoch == 0:
            return True
        return self.iterations_in_epoch >= len(self._epoch_batches(self.epoch)[1])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "iterations_in_epoch": self.iterations_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``next_epoch_itr()`` yields the rest of that epoch, then epochs go on."""
        self.epoch = int(state["epoch"])
        self.iterations_in_epoch = int(state["iterations_in_epoch"])
        # A finished (or never started) epoch resumes by starting the next one.
        self._resume_pending = self.epoch > 0 and not self.end_of_epoch()


class _Dummy(list):
    """Validation's padding batch: real items, run by every rank, counted as nothing."""


class _CollatedBatches:
    """An epoch's batches as a map-style dataset of collated batches: what a worker loads."""

    def __init__(self, dataset, batches, collater):
        self.dataset, self.batches, self.collater = dataset, batches, collater

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> dict:
        batch = self.batches[k]
        out = self.collater([self.dataset[i] for i in batch])
        if isinstance(batch, _Dummy):
            out.update(ntokens=0, nsentences=0, dummy=True)
        return out


def _as_is(batch):
    return batch


def _load(batches: _CollatedBatches, num_workers: int, worker_init: Callable | None = None):
    """The batches in order, read by ``num_workers`` processes (0: here, one at a time)."""
    if num_workers == 0 or len(batches) == 0:
        return map(batches.__getitem__, range(len(batches)))
    import torch  # torch-free callers (preflight) never load batches
    from torch.utils.data import DataLoader

    # fork starts a worker in milliseconds, sharing the memory-mapped token files;
    # elsewhere the datasets pickle by path and re-map them.
    context = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    # The loader draws its workers' seeds from this generator, not from torch's global one,
    # whose state (dropout) checkpoints save: a resumed run must draw what the first one did.
    return iter(
        DataLoader(
            batches,
            batch_size=None,
            shuffle=False,
            num_workers=num_workers,
            collate_fn=_as_is,
            multiprocessing_context=context,
            generator=torch.Generator().manual_seed(0),
            worker_init_fn=worker_init,
        )
    )
