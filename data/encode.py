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

    dataset = None
    column: str = "text"
    tokenizer: SentencePieceTokenizer | None = None
    dtype: np.dtype = np.dtype(np.uint16)


def _init_worker(dataset, column: str, model_path: str, dtype: str) -> None:
    _WorkerState.dataset = dataset
    _WorkerState.column = column
    _WorkerState.tokenizer = SentencePieceTokenizer(model_path)
    _WorkerState.dtype = np.dtype(dtype)


def _encode_chunk(task: tuple[int, int, int, str]) -> tuple[int, int, int]:
    index, start, end, shard_prefix = task
    state = _WorkerState
    eos = state.tokenizer.eos
    builder = IndexedDatasetBuilder(shard_prefix, state.dtype)
    tokens = 0
    try:
        for lo in range(start, end, _BATCH_ROWS):
            texts = state.dataset[lo : min(lo + _BATCH_ROWS, end)][state.column]
            # A missing value or a whitespace-only line is an empty sequence: just </s>,
            # which is how complete_doc finds fairseq's blank-line document boundaries.
            texts = ["" if text is None or text.isspace() else text for text in texts]
            for ids in state.tokenizer.encode_batch(texts):
                ids.append(eos)
                builder.add_item(np.asarray(ids, dtype=state.dtype))
                tokens += len(ids)
    except BaseException:
        builder.discard()
        raise
    builder.finalize()
    return index, end - start, tokens


def _chunks(rows: int, workers: int) -> list[tuple[int, int]]:
    size = max(1, min(_MAX_CHUNK_ROWS, math.ceil(rows / (4 * workers))))
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def encode_dataset(
    dataset,
    column: str,
    model_path: Path,
    out_prefix: Path,
    dtype: np.dtype,
    workers: int,
    shard_dir: Path,
    desc: str,
) -> EncodeStats:
    """Encode every row of ``dataset[column]`` (+ ``</s>``) into ``<out_prefix>.bin/.idx``."""
    from tqdm import tqdm

    started = time.perf_counter()
    tasks = [
        (k, start, end, str(shard_dir / f"{desc}-{k:06d}"))
        for k, (start, end) in enumerate(_chunks(len(dataset), workers))
    ]
    initargs = (dataset, column, str(model_path), np.dtype(dtype).name)
    tokens = 0
    with tqdm(total=len(dataset), desc=desc, unit="doc", file=sys.stderr, mininterval=0.5) as bar:
        if workers == 1:
            _init_worker(*initargs)
            try:
                for _, documents, chunk_tokens in map(_encode_chunk, tasks):
                    tokens += chunk_tokens
                    bar.update(documents)
            finally:
                _WorkerState.dataset = _WorkerState.tokenizer = None
        else:
            # spawn, not fork: the parent has pyarrow's and tqdm's threads running, and
            # forking a threaded process can deadlock.
            context = multiprocessing.get_context("spawn")
            with context.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
                for _, documents, chunk_tokens in pool.imap_unordered(_encode_chunk, tasks):
                    tokens += chunk_tokens
                    bar.update(documents)

    builder = IndexedDatasetBuilder(out_prefix, dtype)
    try:
        for _, _, _, shard_prefix in tasks:
            builder.merge_file(shard_prefix)
            bin_path(shard_prefix).unlink()
            idx_path(shard_prefix).unlink()
    except BaseException:
        builder.discard()
        raise
    builder.finalize()
    return EncodeStats(len(dataset), tokens, time.perf_counter() - started)
