"""Batches per epoch in fairseq 0.12's order, sharded over ranks, resumable mid-epoch,
loaded by worker processes (fairseq's EpochBatchIterator)."""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from data.errors import DataError

# Names the order in saved data positions: a position saved under another order (shardlm's
# earlier one) counts the same batches but not the same sequences.
ORDER = "fairseq-0.12"


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


def ordered_indices(num_tokens: np.ndarray, seed: int) -> np.ndarray:
    """Item indices by size, ties in a random order drawn from ``seed``: fairseq's
    ``with numpy_seed(seed): np.lexsort([np.random.permutation(n), sizes])``
    (MonolingualDataset.ordered_indices), on a RandomState of its own."""
    return np.lexsort([np.random.RandomState(seed).permutation(len(num_tokens)), num_tokens])


def batch_by_size(
    order: np.ndarray, num_tokens: np.ndarray, batch_size: int | None, max_tokens: int | None, multiple: int = 1
) -> list[list[int]]:
    """Consecutive items of ``order`` in batches of at most ``batch_size`` items and at most
    ``max_tokens`` = items × longest, with sizes below ``multiple`` or multiples of it
    (fairseq's batch_by_size_vec, --required-batch-size-multiple).

    A batch that would overflow ends at its last size that was a multiple (the
    ``max(N * (len // N), len % N)`` cut); the items after that start the next batch (or
    become a batch of their own when they and the new item overflow by tokens). At the end
    the last batch and the items after its last multiple are two batches, both kept, as
    in fairseq 0.12 (its later releases drop that final batch when it is not a multiple,
    issue #5036: up to N - 1 valid sentences never scored, all of them when they are fewer
    than N).
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


def grouped(iterable, n):
    """Lists of n consecutive items; the last list may be shorter (fairseq's GroupedIterator)."""
    group = []
    for item in iterable:
        group.append(item)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group


class EpochBatchIterator:
    """Collated batches for epoch 1, 2, …; this rank's share; same batches on every run.

    The order is fairseq 0.12's (fairseq_task.get_batch_iterator, iterators.EpochBatchIterator),
    so a fairseq run resumed here reads the batches fairseq would have read:

    1. items sorted by size, ties in a random order drawn from ``seed`` (``ordered_indices``:
       MonolingualDataset.ordered_indices under ``numpy_seed(seed)``); with
       ``sort_by_size=False`` the dataset's order (eval-lm's --context-window, as
       fairseq's LMContextWindowDataset);
    2. cut into batches (``batch_by_size``). Steps 1-2 depend on the dataset and ``seed``
       only, not on the epoch: computed once per dataset (fairseq reuses its iterator across
       epochs) and again for each new one (sharded data: each epoch reads its own);
    3. with ``shuffle`` (training), the list of batches shuffled per epoch by
       ``np.random.RandomState(seed + epoch)`` (fairseq's ``numpy_seed(seed + epoch)`` then
       ``np.random.shuffle``; numpy's global state is never touched); without it
       (validation, eval-lm) the batches stay in order;
    4. rank ``shard_id`` takes ``batches[shard_id::num_shards]`` (fairseq's ShardedIterator).
       fairseq pads the shorter shards with empty batches; here training truncates the
       list to a multiple of ``num_shards`` instead (every rank runs the same number of
       steps, or collectives would hang; at most ``num_shards - 1`` batches of an epoch
       are left out) and validation (``every_batch``) pads with a dummy batch counted as
       nothing. With one shard the batches are fairseq's, in fairseq's order.

    Rank ``r`` after ``k`` steps has consumed batches ``r, r + n, …`` of the shuffled list:
    all shards together its first ``k * num_shards``, whatever ``num_shards`` is. The
    batches themselves depend on the per-rank ``batch_size``/``max_tokens``: another one
    cuts the epoch into other batches, in another order, unless ``split_batches`` keeps the
    first order (a resumed run whose per-rank --batch-size divides the saved run's).

    ``dataset`` is a dataset, or a function ``epoch -> dataset`` (sharded data: each epoch
    reads its own). An item's size for ordering and ``max_tokens`` is its target count,
    ``len(item) - 1`` (fairseq's block size). ``num_workers`` processes read and collate
    batches ahead of the loop (torch's DataLoader, as fairseq's iterators); 0 does it in
    this process. The batches and their order are the same for any number of workers.
    ``pin_memory`` reads them into page-locked host memory (torch's DataLoader's, for the
    current accelerator), from which a copy to a GPU is asynchronous: set it when the batches
    go to one (a CPU has no accelerator to pin for).
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
        sort_by_size: bool = True,
        pad: int = 1,
        every_batch: bool = False,
        required_batch_size_multiple: int = 1,
        num_workers: int = 0,
        collater: Callable | None = None,
        worker_init: Callable | None = None,
        pin_memory: bool = False,
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
        self.sort_by_size = sort_by_size
        # Validation must see every batch: instead of dropping the uneven tail, ranks with
        # one batch fewer get a dummy batch (ntokens 0), so all run the same forwards.
        self.every_batch = every_batch
        self.multiple = required_batch_size_multiple
        self.num_workers = num_workers
        self.worker_init = worker_init  # run first in each worker process (torch's worker_init_fn)
        self.pin_memory = pin_memory
        self.collater = collater or functools.partial(collate, pad=pad)
        self.split = 1  # each batch of the order cut into this many (split_batches)
        self.epoch = 0
        self.iterations_in_epoch = 0
        self._resume_pending = False
        self._cached = None  # (epoch, its dataset, this shard's batches)
        self._frozen = None  # (dataset, its batches before the epoch's shuffle)

    def _epoch_batches(self, epoch: int):
        """(dataset, this shard's batches as lists of item indices) of ``epoch``."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1:]
        dataset = self._dataset_for_epoch(epoch)
        if self._frozen is None or self._frozen[0] is not dataset:
            num_tokens = np.asarray(dataset.sizes, dtype=np.int64) - 1
            order = ordered_indices(num_tokens, self.seed) if self.sort_by_size else np.arange(len(num_tokens))
            cut = self.batch_size * self.split if self.batch_size else None
            self._frozen = (dataset, batch_by_size(order, num_tokens, cut, self.max_tokens, self.multiple))
        batches = list(self._frozen[1])
        if self.shuffle:
            np.random.RandomState(self.seed + epoch).shuffle(batches)
        if self.split > 1:
            size = self.batch_size
            batches = [batch[i : i + size] for batch in batches for i in range(0, len(batch), size)]
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

    def split_batches(self, split: int) -> None:
        """Cut the epoch at ``split`` times the per-rank --batch-size and split each batch, in
        order, into ``split`` of --batch-size: a run resumed at a per-rank batch that divides
        the saved run's reads the saved run's batches, and so the same updates."""
        if split != self.split:
            self.split, self._frozen, self._cached = split, None, None

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
        collated = CollatedBatches(dataset, batches[offset:], self.collater)
        loaded = load_batches(collated, self.num_workers, self.worker_init, self.pin_memory)
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
        return {"epoch": self.epoch, "iterations_in_epoch": self.iterations_in_epoch, "order": ORDER}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``next_epoch_itr()`` yields the rest of that epoch, then epochs go on."""
        self.epoch = int(state["epoch"])
        self.iterations_in_epoch = int(state["iterations_in_epoch"])
        # A finished (or never started) epoch resumes by starting the next one.
        self._resume_pending = self.epoch > 0 and not self.end_of_epoch()


class _Dummy(list):
    """Validation's padding batch: real items, run by every rank, counted as nothing."""


class CollatedBatches:
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


def load_batches(
    batches: CollatedBatches, num_workers: int, worker_init: Callable | None = None, pin_memory: bool = False
):
    """The batches in order, read by ``num_workers`` processes (0: here, one at a time), in
    pinned memory with ``pin_memory`` (by torch's DataLoader, workers or not)."""
    if (num_workers == 0 and not pin_memory) or len(batches) == 0:
        return map(batches.__getitem__, range(len(batches)))
    import torch  # torch-free callers (preflight) never load batches
    from torch.utils.data import DataLoader

    # fork starts a worker in milliseconds, sharing the memory-mapped token files;
    # elsewhere the datasets pickle by path and re-map them.
    context = "fork" if num_workers and "fork" in multiprocessing.get_all_start_methods() else None
    # The loader draws its workers' seeds from this generator, not from torch's global one,
    # whose state (dropout) checkpoints save: a resumed run must draw what the first one did.
    return iter(
        DataLoader(
            batches,
            batch_size=None,
            shuffle=False,
            num_workers=num_workers,
            collate_fn=_as_is,
            pin_memory=pin_memory,
            multiprocessing_context=context,
            generator=torch.Generator().manual_seed(0),
            worker_init_fn=worker_init if num_workers else None,
        )
    )
