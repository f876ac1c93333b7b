"""Encoding a text dataset into one MMIDIDX file with N worker processes.

The rows are cut into contiguous chunks; each chunk is encoded into its own shard file
and the shards are merged in chunk order, so the output is byte-identical for any
number of workers.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.hf_tokenizer import HFTokenizer
from data.indexed_dataset import IndexedDatasetBuilder, bin_path, idx_path
from data.tokenizer import SentencePieceTokenizer

# Rows per chunk: small enough that the progress bar moves and N workers share the work
# evenly, large enough that a chunk's shard file is not mostly overhead.
_MAX_CHUNK_ROWS = 20_000
# Rows handed to the tokenizer per call.
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
    """What every chunk in one process reuses: tokenizers by path, loaded once."""

    tokenizers: dict[str, SentencePieceTokenizer | HFTokenizer] = {}


def _load_tokenizer(path: str) -> SentencePieceTokenizer | HFTokenizer:
    """A sentencepiece .model, or an HF tokenizer.json (its configs beside it)."""
    return HFTokenizer(path) if path.endswith(".json") else SentencePieceTokenizer(path)


def _warm_up() -> None:
    """Run first in each worker so that spawning overlaps the parent's reading of the inputs."""


def _one_thread_per_worker() -> None:
    """Each worker's initializer: `tokenizers` would otherwise start a thread per core in
    every worker; the parallelism is the workers (as sentencepiece's num_threads=1)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_chunk(task: tuple[list, str, str, str]) -> tuple[int, int]:
    """Encode one chunk's texts into a shard; returns (documents, tokens).

    The parent reads the rows and sends their text: a worker then needs only the tokenizer
    and numpy, not ``datasets`` (whose slow import every spawned worker would pay for).
    """
    texts, model_path, dtype, shard_prefix = task
    tokenizer = _WorkerState.tokenizers.get(model_path)
    if tokenizer is None:
        tokenizer = _WorkerState.tokenizers[model_path] = _load_tokenizer(model_path)
    builder = IndexedDatasetBuilder(shard_prefix, np.dtype(dtype))
    tokens = 0
    try:
        for lo in range(0, len(texts), _BATCH_ROWS):
            # A missing value or a whitespace-only line is an empty sequence: just </s>,
            # which is how complete_doc finds fairseq's blank-line document boundaries.
            batch = ["" if text is None or text.isspace() else text for text in texts[lo : lo + _BATCH_ROWS]]
            encoded = tokenizer.encode_batch(batch, add_eos=True)
            builder.add_items(encoded)
            tokens += sum(map(len, encoded))
    except BaseException:
        builder.discard()
        raise
    builder.finalize()
    return len(texts), tokens


class EncodePool:
    """Runs ``_encode_chunk`` here (1 worker) or in N spawned processes, results in order.

    Made before the inputs are read (``preprocess`` does), so the workers start while the
    parent imports ``datasets`` and loads the files.
    """

    def __init__(self, workers: int):
        self.workers = workers
        self._pool = None
        if workers > 1:
            # spawn, not fork: the parent has pyarrow's and tqdm's threads running, and
            # forking a threaded process can deadlock. An executor, not
            # multiprocessing.Pool: a worker that dies raises BrokenProcessPool instead of
            # being respawned forever.
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_one_thread_per_worker)
            self._pool.submit(_warm_up)  # spawns every worker now (3.11 spawns on first submit)

    def __enter__(self) -> EncodePool:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        _WorkerState.tokenizers.clear()

    def imap(self, tasks: Iterator[tuple]) -> Iterator[tuple[int, int]]:
        """Results of ``tasks`` in order, with at most 2 chunks per worker in flight: the
        texts of a chunk are read only shortly before a worker needs them."""
        if self._pool is None:
            yield from map(_encode_chunk, tasks)
            return
        pending: deque = deque()
        for task in tasks:
            pending.append(self._pool.submit(_encode_chunk, task))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _chunk_rows(rows: int, workers: int) -> int:
    return max(1, min(_MAX_CHUNK_ROWS, math.ceil(rows / (4 * workers))))


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


def encode_splits(
    splits: dict,
    model_path: Path,
    out_dir: Path,
    dtype: np.dtype,
    pool: EncodePool,
    shard_dir: Path,
) -> Iterator[tuple[str, EncodeStats]]:
    """Encode each split's rows (+ eos) into ``<out_dir>/<split>.bin/.idx`` with the
    tokenizer at ``model_path`` (tokenizer.model, or tokenizer.json with its configs).

    ``splits`` maps split name -> rows (data/text_rows.py). Yields ``(split, stats)`` as
    each split is written, so the caller can report it.
    """
    from tqdm import tqdm

    for split, rows in splits.items():
        started = time.perf_counter()
        size = _chunk_rows(len(rows), pool.workers)
        shards = [str(shard_dir / f"{split}-{k:06d}") for k in range(math.ceil(len(rows) / size))]
        # A generator: each chunk's texts are read only when a worker is about to need them.
        tasks = (
            (texts, str(model_path), np.dtype(dtype).name, shard)
            for texts, shard in zip(rows.batches(size), shards, strict=True)
        )
        tokens = 0
        with tqdm(total=len(rows), desc=split, unit="doc", file=sys.stderr, mininterval=0.5) as bar:
            for documents, chunk_tokens in pool.imap(tasks):
                tokens += chunk_tokens
                bar.update(documents)
        _merge_shards(shards, out_dir / split, dtype)
        yield split, EncodeStats(len(rows), tokens, time.perf_counter() - started)
