"""Encoding a text dataset into one MMIDIDX file with N worker processes.

The rows are cut into contiguous chunks; each chunk is encoded into its own shard file
and the shards are merged in chunk order, so the output is byte-identical for any
number of workers.
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.indexed_dataset import IndexedDatasetBuilder, bin_path, idx_path
from data.tokenizer import SentencePieceTokenizer

# Rows per chunk: small enough that the progress bar moves and N workers share the work
# evenly, large enough that a chunk's shard file is not mostly overhead.
_MAX_CHUNK_ROWS = 20_000
# Rows handed to sentencepiece per call.
_BATCH_ROWS = 1_000


@dataclass
class EncodeStats:
    documents: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class _WorkerState:
    """What every chunk in one process needs; set once per process by ``_init_worker``."""

    datasets: dict = {}
    column: str = "text"
    tokenizer: SentencePieceTokenizer | None = None
    dtype: np.dtype = np.dtype(np.uint16)


def _init_worker(datasets: dict, column: str, model_path: str, dtype: str) -> None:
    _WorkerState.datasets = datasets
    _WorkerState.column = column
    _WorkerState.tokenizer = SentencePieceTokenizer(model_path)
    _WorkerState.dtype = np.dtype(dtype)


def _encode_chunk(task: tuple[str, int, int, str]) -> tuple[int, int]:
    """Encode rows [start, end) of one split into a shard; returns (documents, tokens)."""
    split, start, end, shard_prefix = task
    state = _WorkerState
    dataset = state.datasets[split]
    builder = IndexedDatasetBuilder(shard_prefix, state.dtype)
    tokens = 0
    try:
        for lo in range(start, end, _BATCH_ROWS):
            texts = dataset[lo : min(lo + _BATCH_ROWS, end)][state.column]
            # A missing value or a whitespace-only line is an empty sequence: just </s>,
            # which is how complete_doc finds fairseq's blank-line document boundaries.
            texts = ["" if text is None or text.isspace() else text for text in texts]
            encoded = state.tokenizer.encode_batch(texts, add_eos=True)
            builder.add_items(encoded)
            tokens += sum(map(len, encoded))
    except BaseException:
        builder.discard()
        raise
    builder.finalize()
    return end - start, tokens


def _chunks(rows: int, workers: int) -> list[tuple[int, int]]:
    size = max(1, min(_MAX_CHUNK_ROWS, math.ceil(rows / (4 * workers))))
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def _merge_shards(shard_prefixes: list[str], out_prefix: Path, dtype: np.dtype) -> None:
    builder = IndexedDatasetBuilder(out_prefix, dtype)
    try:
        for shard_prefix in shard_prefixes:
            builder.merge_file(shard_prefix)
            bin_path(shard_prefix).unlink()
            idx_path(shard_prefix).unlink()
    except BaseException:
        builder.discard()
        raise
    builder.finalize()


@contextmanager
def _chunk_mapper(workers: int, initargs: tuple):
    """``imap``-like function running ``_encode_chunk`` here (1 worker) or in a process pool."""
    if workers == 1:
        _init_worker(*initargs)
        try:
            yield lambda tasks: map(_encode_chunk, tasks)
        finally:
            _WorkerState.datasets, _WorkerState.tokenizer = {}, None
        return
    # spawn, not fork: the parent has pyarrow's and tqdm's threads running, and forking a
    # threaded process can deadlock. An executor, not multiprocessing.Pool: a worker that
    # dies raises BrokenProcessPool instead of being respawned forever. One pool serves
    # every split (start-up costs ~1 s).
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=initargs) as pool:
        yield lambda tasks: pool.map(_encode_chunk, tasks)


def encode_splits(
    datasets: dict,
    column: str,
    model_path: Path,
    out_dir: Path,
    dtype: np.dtype,
    workers: int,
    shard_dir: Path,
) -> Iterator[tuple[str, EncodeStats]]:
    """Encode each split's rows of ``column`` (+ ``</s>``) into ``<out_dir>/<split>.bin/.idx``.

    Yields ``(split, stats)`` as each split is written, so the caller can report it.
    """
    from tqdm import tqdm

    initargs = (datasets, column, str(model_path), np.dtype(dtype).name)
    with _chunk_mapper(workers, initargs) as imap:
        for split, dataset in datasets.items():
            started = time.perf_counter()
            tasks = [
                (split, start, end, str(shard_dir / f"{split}-{k:06d}"))
                for k, (start, end) in enumerate(_chunks(len(dataset), workers))
            ]
            tokens = 0
            with tqdm(total=len(dataset), desc=split, unit="doc", file=sys.stderr, mininterval=0.5) as bar:
                for documents, chunk_tokens in imap(tasks):
                    tokens += chunk_tokens
                    bar.update(documents)
            _merge_shards([task[3] for task in tasks], out_dir / split, dtype)
            yield split, EncodeStats(len(dataset), tokens, time.perf_counter() - started)
