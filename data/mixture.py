"""Weighted data mixtures: blocks drawn from several sources in chosen proportions
(Megatron's ``--data-path 0.7 web 0.3 code``), in an order that is a pure function of the
seed, the weights and the sources' sizes.

The mixture is an endless stream of *slots*, one block each. Slot ``g`` of a run belongs to
a source by a fixed schedule of the weights, and is that source's ``j``-th draw; draw ``j``
of a source with ``n`` blocks is block ``perm_p[j mod n]`` of its pass ``p = j // n``, each
pass a new pseudo-random permutation. Everything about a slot is computed from ``g`` alone
(no array of the run, or of another rank's share, is held): a rank reads only its own
batches, and the stream is the same for any number of ranks.

The schedule: weights are rounded to millionths (largest remainders), ``q_s`` slots per
million for source ``s``; in each million slots, source ``s``'s draws sit at the times
``(i + 1/2) / q_s`` merged in order (ties to the lower source). So every prefix of the
stream holds each source's share to within one block.

New weights (an anneal) start a new *segment* at the slot where the run stopped; each
source's draws go on from where they were, so no block of a source's current pass is read
twice. The segments are the mixture's saved state.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.errors import DataError

PERIOD = 1_000_000  # slots per period of the schedule: weights are kept to millionths


def parse_mixture(items: Sequence) -> list[tuple[float, str]]:
    """``[W1, DIR1, W2, DIR2, …]`` (Megatron's order) as (weight, DATA) pairs; each DATA is a
    directory or several joined by os.pathsep. Weights are non-negative, not all zero."""
    items = [str(x) for x in items]
    if len(items) < 2 or len(items) % 2:
        raise DataError(
            f"--data-mixture takes pairs of weight and data directory (W1 DIR1 W2 DIR2 …), got {' '.join(items)!r}"
        )
    pairs = []
    for weight, path in zip(items[::2], items[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise DataError(
                f"--data-mixture: {weight!r} is not a weight; give each data directory's weight before it "
                "(0.7 web 0.3 code)"
            ) from None
        if not math.isfinite(w) or w < 0:
            raise DataError(f"--data-mixture: the weight of {path} is {weight}; weights are finite and >= 0")
        pairs.append((w, path))
    if not sum(w for w, _ in pairs) > 0:
        raise DataError("--data-mixture: every weight is 0; give at least one source a positive weight")
    return pairs


def source_names(paths: Sequence[str]) -> list[str]:
    """Each source's name in records (``<name>_tokens``, ``valid_<name>_loss``): its
    directory's name (of the first, for several joined by os.pathsep), with the parent's
    prepended where two would be the same."""
    dirs = [Path(os.fspath(p).split(os.pathsep)[0]).absolute() for p in paths]

    def clean(text):
        return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_") or "data"

    plain = [clean(d.name) for d in dirs]
    names = [clean(f"{d.parent.name}_{d.name}") if plain.count(n) > 1 else n for d, n in zip(dirs, plain)]
    for i, name in enumerate(names):
        if names.count(name) > 1:
            other = next(j for j in range(len(names)) if j != i and names[j] == name)
            raise DataError(
                f"--data-mixture names two sources {name!r} ({paths[other]} and {paths[i]}); a source is "
                "named after its directory: list each directory once, or rename one"
            )
    return names


def mixture_weights(weights: Sequence[float], tokens: Sequence[int], temperature: float | None) -> list[float]:
    """The weights normalised; with a temperature T (fairseq's multilingual sampling), each
    source's share is proportional to (weight × its tokens) ** (1 / T): weights of 1 and T = 1
    sample by size, a larger T flattens towards equal shares."""
    w = np.asarray(weights, dtype=np.float64)
    if temperature is not None:
        w = (w * np.asarray(tokens, dtype=np.float64)) ** (1.0 / temperature)
    if not w.sum() > 0:
        raise DataError("--data-mixture: no source with a positive weight holds any tokens")
    return (w / w.sum()).tolist()


def apportion(weights: Sequence[float], total: int = PERIOD) -> tuple[int, ...]:
    """Integer shares of ``total`` closest to the weights (largest remainders, ties to the
    lower index), summing to ``total``."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    quotas = np.floor(exact).astype(np.int64)
    short = total - int(quotas.sum())
    order = np.lexsort((np.arange(len(w)), -(exact - quotas)))
    quotas[order[:short]] += 1
    return tuple(int(q) for q in quotas)


class Schedule:
    """One set of quotas as a period of PERIOD slots: each slot's source, and which of that
    source's draws in the period it is."""

    def __init__(self, quotas: Sequence[int]):
        self.quotas = np.asarray(quotas, dtype=np.int64)
        sources = np.repeat(np.arange(len(quotas)), self.quotas)
        draw = np.concatenate([np.arange(q) for q in self.quotas])
        times = (2 * draw + 1) / (2 * self.quotas[sources])
        order = np.lexsort((sources, times))
        self.source = sources[order].astype(np.int16)
        self.draw = draw[order].astype(np.int64)

    def slots(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw number since the segment began) of its slots [start, stop)."""
        period, offset = np.divmod(np.arange(start, stop, dtype=np.int64), PERIOD)
        source = self.source[offset].astype(np.int64)
        return source, period * self.quotas[source] + self.draw[offset]

    def draws_before(self, slot: int) -> np.ndarray:
        """Each source's draws in the segment's first ``slot`` slots."""
        period, offset = divmod(slot, PERIOD)
        return period * self.quotas + np.bincount(self.source[:offset], minlength=len(self.quotas))


def permute(positions: np.ndarray, n: int, key: Sequence[int]) -> np.ndarray:
    """A pseudo-random permutation of range(n) evaluated at ``positions`` (four Feistel rounds
    on the next even power of two, cycle-walking back into range): a pass's order without an
    array of n."""
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half, mask = bits // 2, np.uint64((1 << (bits // 2)) - 1)
    round_keys = np.random.SeedSequence(list(key)).generate_state(4, dtype=np.uint64)
    x = np.asarray(positions, dtype=np.uint64).copy()
    todo = np.ones(len(x), dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            y = x[todo]
            left, right = y >> np.uint64(half), y & mask
            for k in round_keys:
                mixed = (right * np.uint64(0x9E3779B97F4A7C15) + k) & np.uint64(0xFFFFFFFFFFFFFFFF)
                mixed ^= mixed >> np.uint64(29)
                left, right = right, left ^ (mixed & mask)
            x[todo] = (left << np.uint64(half)) | right
            todo &= x >= np.uint64(n)
    return x.astype(np.int64)


@dataclass(frozen=True)
class Segment:
    """Slots from ``start`` on drawn by ``quotas``; ``offsets`` are each source's draws before it."""

    start: int
    quotas: tuple[int, ...]
    offsets: tuple[int, ...]


class Mixture:
    """The sources' blocks as one dataset (an item's key: its index in the sources one after
    another) and the stream of slots over them. ``datasets`` are the sources' training
    blocks (each with ``sizes``), ``weights`` normalised."""

    def __init__(self, names: Sequence[str], datasets: Sequence, weights: Sequence[float], seed: int):
        self.names, self.datasets, self.seed = list(names), list(datasets), seed
        self.lengths = np.asarray([len(d) for d in datasets], dtype=np.int64)
        empty = [name for name, n, w in zip(names, self.lengths, weights) if n == 0 and w > 0]
        if empty:
            raise DataError(f"--data-mixture: source {empty[0]} has no training blocks; drop it or give it weight 0")
        self.first_key = np.concatenate([[0], np.cumsum(self.lengths)])
        self.sizes = np.concatenate([np.asarray(d.sizes, dtype=np.int64) for d in datasets])
        # An epoch is as many blocks as the sources hold together: with weights by size, one
        # pass of each; an up-weighted source is read more than once in it, a down-weighted
        # one in part.
        self.epoch_slots = int(self.lengths.sum())
        self.segments = [Segment(0, apportion(weights), (0,) * len(datasets))]
        self._schedules = {}

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, key: int):
        source = int(np.searchsorted(self.first_key, key, side="right")) - 1
        return self.datasets[source][int(key - self.first_key[source])]

    def _schedule(self, segment: Segment) -> Schedule:
        if segment.quotas not in self._schedules:
            self._schedules[segment.quotas] = Schedule(segment.quotas)
        return self._schedules[segment.quotas]

    def _segment_at(self, slot: int) -> int:
        return max(i for i, s in enumerate(self.segments) if s.start <= slot)

    def draws(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw number over the run) of slots [start, stop)."""
        sources, draws = [], []
        for i in range(self._segment_at(start), len(self.segments)):
            segment = self.segments[i]
            end = self.segments[i + 1].start if i + 1 < len(self.segments) else stop
            lo, hi = max(start, segment.start), min(stop, end)
            if lo >= hi:
                break
            s, j = self._schedule(segment).slots(lo - segment.start, hi - segment.start)
            sources.append(s)
            draws.append(j + np.asarray(segment.offsets, dtype=np.int64)[s])
        if not sources:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(sources), np.concatenate(draws)

    def keys(self, start: int, stop: int) -> np.ndarray:
        """The item keys of slots [start, stop): each draw's block in its pass's order."""
        sources, draws = self.draws(start, stop)
        keys = np.empty(len(sources), dtype=np.int64)
        passes, within = np.divmod(draws, np.maximum(self.lengths[sources], 1))
        for s, p in sorted(set(zip(sources.tolist(), passes.tolist()))):
            at = (sources == s) & (passes == p)
            keys[at] = self.first_key[s] + permute(within[at], int(self.lengths[s]), (self.seed, s, p))
        return keys

    def draws_at(self, slot: int) -> np.ndarray:
        """Each source's draws before ``slot``."""
        segment = self.segments[self._segment_at(slot)]
        return np.asarray(segment.offsets) + self._schedule(segment).draws_before(slot - segment.start)

    def passes_at(self, slot: int) -> list[float]:
        """Each source's passes before ``slot`` (2.5: two whole passes and half of the third)."""
        return (self.draws_at(slot) / np.maximum(self.lengths, 1)).tolist()

    def target_tokens(self, start: int, stop: int) -> list[int]:
        """Each source's target tokens in slots [start, stop)."""
        sources, _ = self.draws(start, stop)
        keys = self.keys(start, stop)
        return np.bincount(sources, weights=self.sizes[keys] - 1, minlength=len(self.names)).astype(np.int64).tolist()

    def reweight(self, slot: int, weights: Sequence[float]) -> bool:
        """New weights from ``slot`` on (an anneal); False when they are the current ones."""
        quotas = apportion(weights)
        current = self.segments[self._segment_at(slot)]
        if quotas == current.quotas:
            return False
        self.segments = [s for s in self.segments if s.start < slot]
        self.segments.append(Segment(slot, quotas, tuple(int(x) for x in self.draws_at(slot))))
        return True

    def state_dict(self) -> dict:
        return {
            "names": list(self.names),
            "blocks": self.lengths.tolist(),
            "segments": [[s.start, list(s.quotas), list(s.offsets)] for s in self.segments],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["names"] != self.names or state["blocks"] != self.lengths.tolist():
            raise DataError(
                f"the checkpoint's mixture has the sources {', '.join(state['names'])} "
                f"({', '.join(map(str, state['blocks']))} blocks), this run {', '.join(self.names)} "
                f"({', '.join(map(str, self.lengths.tolist()))}): resume with the same sources (weights may "
                "change), or start the data over with --reset-dataloader"
            )
        self.segments = [Segment(start, tuple(q), tuple(o)) for start, q, o in state["segments"]]
