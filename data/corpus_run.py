"""A resumable ``preprocess`` of a corpus: one shard per chunk (data/corpus_files.py), kept
across a kill.

Work happens in ``<destdir>/.preprocess-partial/``:

* ``manifest.json``: the run's settings (input files of each split, text column,
  ``--shard-mb``, the tokenizer's sha256 or what trains it). Written once, before any
  shard; a later run into the same destdir with other settings is refused, so shards of
  two different runs are never mixed.
* ``done.jsonl``: one line per finished shard, appended after the shard's files are
  complete: its name, its chunk's key (each piece's file, size, mtime and range, the
  tokenizer's sha256, the column), its counts and its files' sizes. A shard is kept by the
  next run when its line is there, its key still matches and its files have those sizes;
  any other shard is encoded again. The builder writes
  under a temporary name and renames when complete (data/indexed_dataset.py), so a shard
  half written when the run was killed is never taken for a finished one.
* the shards, ``train-000000.bin/.idx`` …, and the tokenizer.

When every shard is done the run moves the files into destdir: train's shards become
``train``, ``train1``, ``train2`` … (the trainer reads them as one split, fairseq's
``combine``), each other split's shards are merged into one ``valid`` (``valid1`` would be
another validation set). ``metadata.json`` goes last; its presence says the data dir is
complete. A kill during the moves is finished by the next run (``moving`` in the manifest).
The result is the same bytes as one uninterrupted run, for any ``--workers``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from data.atomic_file import write_atomically
from data.corpus_files import batches, plan_chunks
from data.encode import merge_shards, worker_tokenizer
from data.errors import DataError
from data.hf_tokenizer import hf_tokenizer_paths
from data.indexed_dataset import IndexedDatasetBuilder, best_fitting_dtype, bin_path, idx_path
from data.preprocess_tokenizer import METADATA_FILE, TOKENIZER_FILE, place_tokenizer
from data.tokenizer import file_sha256

PARTIAL_DIR = ".preprocess-partial"
MANIFEST = "manifest.json"
DONE = "done.jsonl"
MANIFEST_FORMAT = "shardlm-preprocess-partial-1"
EXTS = ("bin", "idx")


def encode_chunk(task: tuple) -> tuple[int, int]:
    """In a worker: encode one chunk's rows (+ eos each) into a shard; (rows, tokens)."""
    pieces, column, model_path, dtype, prefix = task
    tokenizer = worker_tokenizer(model_path)
    builder = IndexedDatasetBuilder(prefix, np.dtype(dtype))
    rows = tokens = 0
    try:
        for batch in batches(pieces, column):
            # As data/encode.py: a missing value or a whitespace-only row is just </s>.
            encoded = tokenizer.encode_batch(["" if t is None or t.isspace() else t for t in batch], add_eos=True)
            builder.add_items(encoded)
            rows += len(batch)
            tokens += sum(map(len, encoded))
    except BaseException:
        builder.discard()
        raise
    builder.finalize()
    return rows, tokens


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:06d}"


def final_names(split: str, chunks: int) -> list[str]:
    """The prefixes a split ends up as in destdir: train, train1, …; any other split one file."""
    if split != "train":
        return [split]
    return ["train" if k == 0 else f"train{k}" for k in range(chunks)]


class PartialRun:
    """The ``.preprocess-partial`` dir of one destdir: its manifest, its finished shards."""

    def __init__(self, destdir: Path):
        self.dir = destdir / PARTIAL_DIR

    def manifest(self) -> dict | None:
        try:
            manifest = json.loads((self.dir / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT else None

    def refuse_other_settings(self, settings: dict) -> None:
        manifest = self.manifest()
        if manifest is None or manifest.get("settings") == settings:
            return
        before = manifest.get("settings") or {}
        differ = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        raise DataError(
            f"{self.dir.parent} holds an unfinished preprocess run with other settings ({', '.join(differ)} differ); "
            f"rerun that command to finish it, or choose another --destdir, or delete {self.dir}"
        )

    def start(self, settings: dict) -> None:
        """Make the dir (or keep the one of an earlier run of these settings)."""
        manifest = self.manifest()
        if manifest is None:  # none, or killed before its manifest was written: nothing to keep
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir()
            write_atomically(self.dir / MANIFEST, json.dumps(dict(format=MANIFEST_FORMAT, settings=settings)) + "\n")
        for leftover in self.dir.glob("*.tmp*"):  # a killed builder's half-written file
            leftover.unlink()
        # A line torn by the kill would swallow the next record appended after it.
        done = self.dir / DONE
        if done.is_file() and not done.read_bytes().endswith(b"\n"):
            write_atomically(done, "".join(json.dumps(record) + "\n" for record in self.done().values()))

    def done(self) -> dict[str, dict]:
        """Finished shards recorded by earlier runs: name -> record (a torn last line is skipped)."""
        records = {}
        try:
            lines = (self.dir / DONE).read_text(encoding="utf-8").splitlines()
        except OSError:
            return records
        for line in lines:
            try:
                record = json.loads(line)
                records[record["name"]] = record
            except (ValueError, KeyError, TypeError):
                continue
        return records

    def record(self, record: dict) -> None:
        # Appended, not fsynced: a killed process's writes are in the page cache and survive
        # it. After a machine crash a shard may be shorter than recorded; the sizes in its
        # record catch that (``kept``).
        with open(self.dir / DONE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def set_moving(self, moves: list[tuple[str, str]]) -> None:
        manifest = self.manifest()
        manifest.update(moving=True, moves=moves)
        write_atomically(self.dir / MANIFEST, json.dumps(manifest) + "\n")

    def moves(self) -> list | None:
        manifest = self.manifest() or {}
        return manifest.get("moves") if manifest.get("moving") else None

    def has_finished_shards(self) -> bool:
        return bool(self.done())


def _file_sizes(prefix: Path) -> list[int] | None:
    """The sizes of a shard's .bin and .idx (None when one is missing)."""
    try:
        return [bin_path(prefix).stat().st_size, idx_path(prefix).stat().st_size]
    except OSError:
        return None


def encode_shards(partial: PartialRun, plans: dict, column: str, model_path: Path, tokenizer_sha: str, dtype, pool):
    """Encode every chunk not finished by an earlier run; yields (split, documents, tokens,
    seconds, shards kept) as each split is complete."""
    from tqdm import tqdm

    done = partial.done()
    for split, chunks in plans.items():
        started = time.perf_counter()
        counts = {}
        tasks = []
        for k, pieces in enumerate(chunks):
            name = shard_name(split, k)
            key = dict(pieces=[piece.key() for piece in pieces], tokenizer_sha256=tokenizer_sha, column=column)
            record = done.get(name)
            prefix = partial.dir / name
            if record and record.get("key") == key and record.get("bytes") == _file_sizes(prefix):
                counts[name] = (record["documents"], record["tokens"])
                continue
            tasks.append((name, key, (pieces, column, str(model_path), np.dtype(dtype).name, str(prefix))))
        kept = len(counts)
        with tqdm(total=len(chunks), initial=kept, desc=split, unit="shard", file=sys.stderr, mininterval=0.5) as bar:
            for (name, key, _), (documents, tokens) in pool.unordered(encode_chunk, tasks):
                prefix = partial.dir / name
                partial.record(dict(name=name, key=key, documents=documents, tokens=tokens, bytes=_file_sizes(prefix)))
                counts[name] = (documents, tokens)
                bar.update(1)
        documents = sum(counts[shard_name(split, k)][0] for k in range(len(chunks)))
        tokens = sum(counts[shard_name(split, k)][1] for k in range(len(chunks)))
        encoded = sum(counts[name][1] for name, _, _ in tasks)
        yield split, documents, tokens, encoded, time.perf_counter() - started, kept


def assemble(partial: PartialRun, plans: dict, dtype) -> list[tuple[str, str]]:
    """Merge each split but train into one file in the partial dir; the (from, to) renames
    that put every split in place."""
    moves = []
    for split, chunks in plans.items():
        shards = [shard_name(split, k) for k in range(len(chunks))]
        if split != "train" and len(shards) > 1:
            merge_shards([str(partial.dir / s) for s in shards], partial.dir / split, np.dtype(dtype))
            shards = [split]
        for shard, final in zip(shards, final_names(split, len(chunks)), strict=True):
            moves += [(f"{shard}.bin", f"{final}.bin"), (f"{shard}.idx", f"{final}.idx")]
    return moves


def move_into_place(partial: PartialRun, destdir: Path, moves: list) -> None:
    """Rename each file into destdir (a file already moved by a killed run is left as it is),
    metadata.json last, then drop the partial dir."""
    for source, target in moves:
        if (partial.dir / source).exists():
            os.replace(partial.dir / source, destdir / target)
        elif not (destdir / target).exists():
            raise DataError(f"{partial.dir / source} is missing; delete {partial.dir} and run preprocess again")
    shutil.rmtree(partial.dir)


def chunk_bytes(args, sources) -> int:
    """--shard-mb in bytes; by default a 64th of the split's files (a few chunks per worker
    for any --workers up to 16), at least 1 MB (a shard is not mostly overhead) and at most
    256 MB (a killed run loses little). It depends on the files only, never on --workers."""
    if args.shard_mb is not None:
        return max(1, int(args.shard_mb * 1e6))
    total = sum(os.path.getsize(source.path) for source in sources)
    return int(min(max(total / 64, 1e6), 256e6))


def run_settings(args, sources: dict) -> dict:
    """What makes two runs' shards interchangeable; ``--workers`` is not part of it."""
    if args.tokenizer:
        tokenizer = dict(hf_tokenizer_sha256=file_sha256(hf_tokenizer_paths(args.tokenizer)[0]))
    elif args.spm_model:
        tokenizer = dict(spm_model_sha256=file_sha256(args.spm_model))
    else:
        tokenizer = dict(vocab_size=args.vocab_size, spm_model_type=args.spm_model_type, seed=args.seed)
    return dict(
        sources={split: [os.fspath(s.path) for s in split_sources] for split, split_sources in sources.items()},
        text_column=args.text_column,
        shard_mb=args.shard_mb,
        **tokenizer,
    )


def build(args, sources: dict, plans: dict, partial: PartialRun, pool) -> dict:
    """Tokenizer and shards in the partial dir; returns metadata.json's content."""

    def train_texts():
        for chunk in plans["train"]:
            for batch in batches(chunk, args.text_column):
                yield from batch

    trained = partial.done().get(TOKENIZER_FILE, {}).get("sha256")
    metadata, model_path = place_tokenizer(args, partial.dir, train_texts, trained_sha=trained)
    tokenizer_sha = file_sha256(model_path)
    if not (args.tokenizer or args.spm_model) and trained != tokenizer_sha:
        partial.record(dict(name=TOKENIZER_FILE, sha256=tokenizer_sha))
    dtype = best_fitting_dtype(metadata["vocab_size"])
    splits = {}
    for split, documents, tokens, encoded, seconds, kept in encode_shards(
        partial, plans, args.text_column, model_path, tokenizer_sha, dtype, pool
    ):
        shards = len(plans[split])
        resumed = f", {kept:,} of {shards:,} shards kept from an earlier run" if kept else ""
        print(
            f"{split}: {documents:,} documents, {tokens:,} tokens, {encoded / max(seconds, 1e-9):,.0f} tokens/s"
            f" ({shards:,} shard{'s' if shards > 1 else ''}{resumed})",
            flush=True,
        )
        splits[split] = dict(documents=documents, tokens=tokens, sources=[os.fspath(s.path) for s in sources[split]])
        if split == "train":
            splits[split]["shards"] = final_names(split, shards)
    metadata["splits"] = splits
    return metadata


def preprocess_corpus(args, sources: dict, destdir: Path, tokenizer_files, refuse_existing, pool_factory) -> Path:
    """The whole resumable run (the module docstring); ``refuse_existing(names)`` refuses a
    destdir holding any of them (data/preprocess.py's check)."""
    plans = {split: plan_chunks(files, chunk_bytes(args, files)) for split, files in sources.items()}
    partial = PartialRun(destdir)
    settings = run_settings(args, sources)
    partial.refuse_other_settings(settings)
    moves = partial.moves()
    names = [f"{n}.{ext}" for split, chunks in plans.items() for n in final_names(split, len(chunks)) for ext in EXTS]
    if moves is None:
        # A train{n} beyond our shards would be read by the trainer as part of train.
        extra = [f"train{len(plans['train'])}.{ext}" for ext in EXTS] if "train" in plans else []
        refuse_existing([METADATA_FILE, *tokenizer_files, *names, *extra])
    created = not destdir.exists()
    destdir.mkdir(parents=True, exist_ok=True)
    try:
        if moves is None:
            partial.start(settings)
            with pool_factory(args.workers) as pool:
                metadata = build(args, sources, plans, partial, pool)
            moves = assemble(partial, plans, metadata["dtype"])
            moves += [(name, name) for name in tokenizer_files if (partial.dir / name).exists()]
            write_atomically(partial.dir / METADATA_FILE, json.dumps(metadata, indent=2) + "\n")
            moves.append((METADATA_FILE, METADATA_FILE))  # last: it says the data dir is complete
            partial.set_moving(moves)
        move_into_place(partial, destdir, moves)
    except DataError:
        # Bad input: keep what is finished (a rerun after fixing that file continues), but
        # leave no trace of a run that finished nothing.
        if not partial.has_finished_shards():
            shutil.rmtree(partial.dir, ignore_errors=True)
            if created and destdir.is_dir() and not any(destdir.iterdir()):
                destdir.rmdir()
        raise
    return destdir
