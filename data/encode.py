"""Encoding a dataset into one MMIDIDX file with N worker processes.

Text rows become one sequence each (+ eos); conversations and preference pairs are
rendered with the chat template in the workers too (data/chat_encode.py), each with its
targets file beside it (data/targets.py). The rows are cut into contiguous chunks; each
chunk is encoded into its own shard file and the shards are merged in chunk order, so the
output is byte-identical for any number of workers.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from data.chat_encode import ChatEncoder, RowError
from data.chat_rows import row_name
from data.errors import DataError
from data.hf_tokenizer import HFTokenizer
from data.indexed_dataset import IndexedDatasetBuilder, bin_path, idx_path
from data.targets import TARGETS_DTYPE, targets_prefix
from data.tokenizer import SentencePieceTokenizer

# Rows per chunk: small enough that the progress bar moves and N workers share the work
# evenly, large enough that a chunk's shard file is not mostly overhead.
_MAX_CHUNK_ROWS = 20_000
# Rows handed to the tokenizer per call.
_BATCH_ROWS = 1_000


@dataclass
class EncodeStats:
    documents: int  # rows read
    tokens: int
    seconds: float
    dropped: int = 0  # rows over --max-length

    @property
    def written(self) -> int:
        return self.documents - self.dropped

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class ChatSpec:
    """How a worker turns conversation or preference-pair rows into sequences and targets."""

    kind: str  # "conversations" | "preference_pairs"
    template: str
    variables: dict  # the special tokens the template sees
    model_eos_ids: list  # config.json's eos_token_id(s): end-of-turn tokens
    max_length: int | None  # rows longer than this are dropped
    files: list = ()  # (first row, file) of the split, to name a bad row


class _WorkerState:
    """What every chunk in one process reuses: tokenizers by path, loaded once."""

    tokenizers: dict[str, SentencePieceTokenizer | HFTokenizer] = {}
    encoders: dict[tuple[str, str], ChatEncoder] = {}


def _load_tokenizer(path: str) -> SentencePieceTokenizer | HFTokenizer:
    """A sentencepiece .model, or an HF tokenizer.json (its configs beside it)."""
    return HFTokenizer(path) if path.endswith(".json") else SentencePieceTokenizer(path)


def worker_tokenizer(model_path: str) -> SentencePieceTokenizer | HFTokenizer:
    """The tokenizer at ``model_path``, loaded once per process."""
    tokenizer = _WorkerState.tokenizers.get(model_path)
    if tokenizer is None:
        tokenizer = _WorkerState.tokenizers[model_path] = _load_tokenizer(model_path)
    return tokenizer


def _warm_up() -> None:
    """Run first in each worker so that spawning overlaps the parent's reading of the inputs."""


def _one_thread_per_worker() -> None:
    """Each worker's initializer: `tokenizers` would otherwise start a thread per core in
    every worker; the parallelism is the workers (as sentencepiece's num_threads=1)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_chunk(task: tuple) -> tuple[int, int, int]:
    """Encode one chunk's rows into a shard; returns (rows, tokens, rows dropped).

    The parent reads the rows and sends their text: a worker then needs only the tokenizer
    and numpy, not ``datasets`` (whose slow import every spawned worker would pay for).
    """
    texts, model_path, dtype, shard_prefix, chat, first_row = task
    if chat is not None:
        return _encode_chat_chunk(texts, model_path, np.dtype(dtype), shard_prefix, chat, first_row)
    tokenizer = worker_tokenizer(model_path)
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
    return len(texts), tokens, 0


def _chat_sequences(encoder: ChatEncoder, kind: str, row) -> list[tuple[list[int], list[int]]]:
    """A row's (ids, targets): one conversation, or a pair's chosen then rejected."""
    if kind == "conversations":
        return [encoder.conversation(row)]
    chosen, rejected, prompt_length = encoder.preference_pair(*row)
    return [(ids, [0] * prompt_length + [1] * (len(ids) - prompt_length)) for ids in (chosen, rejected)]


def _encode_chat_chunk(rows, model_path: str, dtype: np.dtype, shard_prefix: str, chat: ChatSpec, first_row: int):
    key = (model_path, chat.template)
    encoder = _WorkerState.encoders.get(key)
    if encoder is None:
        encoder = _WorkerState.encoders[key] = ChatEncoder(
            model_path, chat.template, chat.variables, chat.model_eos_ids
        )
    builders = [
        IndexedDatasetBuilder(shard_prefix, dtype),
        IndexedDatasetBuilder(targets_prefix(shard_prefix), TARGETS_DTYPE),
    ]
    tokens = dropped = 0
    try:
        for k, row in enumerate(rows):
            try:
                sequences = _chat_sequences(encoder, chat.kind, row)
            except RowError as e:
                raise DataError(f"{row_name(chat.files, first_row + k)}: {e}") from None
            if chat.max_length is not None and max(len(ids) for ids, _ in sequences) > chat.max_length:
                dropped += 1
                continue
            builders[0].add_items([ids for ids, _ in sequences])
            builders[1].add_items([targets for _, targets in sequences])
            tokens += sum(len(ids) for ids, _ in sequences)
    except BaseException:
        for builder in builders:
            builder.discard()
        raise
    for builder in builders:
        builder.finalize()
    return len(rows), tokens, dropped


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
            # Python 3.11 spawns a worker per submit while none is idle: one warm-up each
            # starts them all now, not one now and the rest when chunks arrive.
            for _ in range(workers):
                self._pool.submit(_warm_up)

    def __enter__(self) -> EncodePool:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        _WorkerState.tokenizers.clear()

    def imap(self, tasks: Iterator[tuple]) -> Iterator[tuple[int, int, int]]:
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

    def unordered(self, fn, items: list[tuple]) -> Iterator[tuple[tuple, object]]:
        """``(item, fn(item[-1]))`` for each item, as each finishes (a resumable run records
        a shard the moment it is done), with at most 2 items per worker in flight."""
        if self._pool is None:
            for item in items:
                yield item, fn(item[-1])
            return
        queue, running = deque(items), {}
        while queue or running:
            while queue and len(running) < 2 * self.workers:
                item = queue.popleft()
                running[self._pool.submit(fn, item[-1])] = item
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                yield running.pop(future), future.result()


def _chunk_rows(rows: int, workers: int) -> int:
    return max(1, min(_MAX_CHUNK_ROWS, math.ceil(rows / (4 * workers))))


def merge_shards(shard_prefixes: list[str], out_prefix: Path, dtype: np.dtype) -> None:
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
    chat: ChatSpec | None = None,
) -> Iterator[tuple[str, EncodeStats]]:
    """Encode each split's rows into ``<out_dir>/<split>.bin/.idx`` with the tokenizer at
    ``model_path`` (tokenizer.model, or tokenizer.json with its configs): texts + eos, or,
    with ``chat``, conversations or preference pairs with ``<split>.targets.bin/.idx``.

    ``splits`` maps split name -> rows (data/text_rows.py, data/chat_rows.py). Yields
    ``(split, stats)`` as each split is written, so the caller can report it.
    """
    from tqdm import tqdm

    for split, rows in splits.items():
        started = time.perf_counter()
        size = _chunk_rows(len(rows), pool.workers)
        shards = [str(shard_dir / f"{split}-{k:06d}") for k in range(math.ceil(len(rows) / size))]
        split_chat = None if chat is None else replace(chat, files=rows.files())
        # A generator: each chunk's texts are read only when a worker is about to need them.
        tasks = (
            (texts, str(model_path), np.dtype(dtype).name, shard, split_chat, k * size)
            for k, (texts, shard) in enumerate(zip(rows.batches(size), shards, strict=True))
        )
        tokens = dropped = 0
        with tqdm(total=len(rows), desc=split, unit="doc", file=sys.stderr, mininterval=0.5) as bar:
            for documents, chunk_tokens, chunk_dropped in pool.imap(tasks):
                tokens += chunk_tokens
                dropped += chunk_dropped
                bar.update(documents)
        merge_shards(shards, out_dir / split, dtype)
        if chat is not None:
            merge_shards([str(targets_prefix(s)) for s in shards], targets_prefix(out_dir / split), TARGETS_DTYPE)
        yield split, EncodeStats(len(rows), tokens, time.perf_counter() - started, dropped)
