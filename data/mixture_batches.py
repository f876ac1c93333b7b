"""A mixture's batches per epoch, sharded over ranks, resumable at any slot on any number of
ranks and any per-rank batch (the mixture's EpochBatchIterator; data/mixture.py has the stream)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

from data.errors import DataError
from data.iterator import CollatedBatches, collate, load_batches
from data.mixture import Mixture


class MixtureBatchIterator:
    """Batches of ``batch_size`` consecutive slots of the mixture's stream; rank ``r`` takes
    batches ``r, r + W, …`` of each epoch.

    An epoch is ``mixture.epoch_slots`` slots: epoch ``e`` holds slots ``[(e - 1) N, e N)``
    whatever the ranks, batch size or weights. Its batches are cut from where this run
    entered it (its first slot, or the slot a resumed run stopped at); the last may be
    shorter, and their count is cut to a multiple of the ranks (all ranks run as many
    steps): the slots of the batches left out are skipped, never moved to another epoch.

    The position is a slot, so a run resumes after exactly the blocks trained on, with any
    number of ranks and any per-rank batch: the same updates follow when the new ranks ×
    batch × --update-freq is the old one.
    """

    split = 1  # EpochBatchIterator's split of a resumed order: a mixture's position is a slot

    def __init__(
        self,
        mixture: Mixture,
        batch_size: int,
        num_shards: int = 1,
        shard_id: int = 0,
        pad: int = 1,
        collater: Callable | None = None,
        num_workers: int = 0,
        worker_init: Callable | None = None,
        pin_memory: bool = False,
    ):
        if batch_size < 1:
            raise DataError(f"a mixture's batch must hold at least one block, got {batch_size}")
        self.mixture, self.batch_size = mixture, batch_size
        self.num_shards, self.shard_id = num_shards, shard_id
        self.collater = collater or functools.partial(collate, pad=pad)
        self.num_workers, self.worker_init, self.pin_memory = num_workers, worker_init, pin_memory
        self.epoch = 0
        self.iterations_in_epoch = 0
        self._entry = 0  # the slot of the epoch where this run's batches of it begin
        self._entry_iterations = 0  # the steps counted for the epoch before it (a resumed one's)
        self._resume_pending = False

    def _steps(self, entry: int) -> int:
        """Steps per rank of an epoch entered at slot ``entry``."""
        batches = math.ceil((self.mixture.epoch_slots - entry) / self.batch_size)
        steps = batches // self.num_shards
        if steps == 0 and entry == 0:
            raise DataError(
                f"only {batches} batches of {self.batch_size} blocks for {self.num_shards} ranks in an epoch of the "
                f"mixture ({self.mixture.epoch_slots} blocks); lower --batch-size/--max-tokens or use fewer ranks"
            )
        return steps

    def __len__(self) -> int:
        """Batches per shard in the current epoch (the next one before the first call)."""
        if self.epoch == 0:
            return self._steps(0)
        return self._entry_iterations + self._steps(self._entry)

    def next_epoch_itr(self) -> Iterator[dict]:
        if self._resume_pending:
            self._resume_pending = False
        else:
            self.epoch += 1
            self.iterations_in_epoch = self._entry = self._entry_iterations = 0
        first = (self.epoch - 1) * self.mixture.epoch_slots + self._entry
        last = self.epoch * self.mixture.epoch_slots
        done = self.iterations_in_epoch - self._entry_iterations
        mine = _RankBatches(self.mixture, first, last, self.batch_size, self.num_shards, self.shard_id)
        collated = CollatedBatches(self.mixture, mine[done:], self.collater)
        return self._count(load_batches(collated, self.num_workers, self.worker_init, self.pin_memory))

    def _count(self, batches):
        for out in batches:
            # Counted as the loop takes the batch: a checkpoint saved after it records it as read.
            self.iterations_in_epoch += 1
            yield out

    def end_of_epoch(self) -> bool:
        if self.epoch == 0:
            return True
        return self.iterations_in_epoch >= self._entry_iterations + self._steps(self._entry)

    def slot(self) -> int:
        """The stream's slot after every rank's batches so far (the next one to read)."""
        epoch_slots = self.mixture.epoch_slots
        if self.epoch == 0:
            return 0
        if self.end_of_epoch():
            return self.epoch * epoch_slots
        done = (self.iterations_in_epoch - self._entry_iterations) * self.num_shards * self.batch_size
        return (self.epoch - 1) * epoch_slots + self._entry + done

    def trained_slot(self) -> int:
        """The slot after every rank's batches so far, short of the epoch's skipped tail."""
        if self.epoch == 0:
            return 0
        done = (self.iterations_in_epoch - self._entry_iterations) * self.num_shards * self.batch_size
        return (self.epoch - 1) * self.mixture.epoch_slots + min(self._entry + done, self.mixture.epoch_slots)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "iterations_in_epoch": self.iterations_in_epoch,
            "slot": self.slot(),
            "mixture": self.mixture.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved slot: the next ``next_epoch_itr()`` yields the rest of its epoch."""
        self.mixture.load_state_dict(state["mixture"])
        epoch_slots = self.mixture.epoch_slots
        self.epoch, self.iterations_in_epoch = int(state["epoch"]), int(state["iterations_in_epoch"])
        entry = int(state["slot"]) - (self.epoch - 1) * epoch_slots
        if self.epoch == 0 or entry >= epoch_slots or self._steps(entry) == 0:
            # Its epoch had ended (or has no step left for these ranks): the next one starts.
            self._entry, self._entry_iterations = epoch_slots, self.iterations_in_epoch
            self._resume_pending = False
            return
        self._entry = entry
        # Steps counted before the entry: the progress figures, as if this run had read the
        # epoch from its start.
        self._entry_iterations = self.iterations_in_epoch = entry // (self.num_shards * self.batch_size)
        self._resume_pending = True


class _RankBatches:
    """One rank's batches of an epoch as a lazy sequence of item keys: batch ``k`` is the
    ``(k * W + r)``-th run of ``size`` slots from ``first`` (none past ``last``)."""

    def __init__(self, mixture, first, last, size, num_shards, shard_id, start=0, stop=None):
        self.mixture, self.first, self.last, self.size = mixture, first, last, size
        self.num_shards, self.shard_id = num_shards, shard_id
        self.start = start
        self.stop = stop if stop is not None else math.ceil((last - first) / size) // num_shards

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)

    def __getitem__(self, k):
        if isinstance(k, slice):
            start, stop, _ = k.indices(len(self))
            return _RankBatches(
                self.mixture,
                self.first,
                self.last,
                self.size,
                self.num_shards,
                self.shard_id,
                self.start + start,
                self.start + stop,
            )
        if not 0 <= k < len(self):
            raise IndexError(k)
        lo = self.first + ((self.start + k) * self.num_shards + self.shard_id) * self.size
        return self.mixture.keys(lo, min(lo + self.size, self.last)).tolist()
