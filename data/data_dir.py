"""Checks of a data directory before a run starts, so a bad one costs seconds and writes nothing.

Reads only the small files (metadata.json, the tokenizer, each split's .idx) and a
bounded sample of each token file, so the check costs the same whatever the corpus size.
Torch-free: `train` runs it before any rank starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from data.errors import DataError
from data.indexed_dataset import IndexedDataset, bin_path, exists
from data.tokenizer import has_tokenizer, load_tokenizer

# Token ids read from each end of a token file to see that they fit the tokenizer.
SAMPLE_TOKENS = 1 << 20


def data_dirs(data: str | os.PathLike) -> list[Path]:
    """DATA's directories: one, or several joined by os.pathsep (fairseq's sharded data:
    epoch e trains on the ((e - 1) mod n)-th; the vocabulary and every other split come
    from the first). Each must be an existing directory."""
    parts = os.fspath(data).split(os.pathsep)
    if not all(parts):
        raise DataError(
            f"DATA {os.fspath(data)!r} has an empty path; separate data directories with a single {os.pathsep!r}"
        )
    dirs = [Path(p) for p in parts]
    for i, path in enumerate(dirs):
        which = f" (shard {i + 1} of {len(dirs)} in DATA)" if len(dirs) > 1 else ""
        if not path.exists():
            raise DataError(
                f"data directory {path}{which} does not exist; pass a directory written by `preprocess` "
                "(shardlm reads local data only: preprocess a hub dataset's files first)"
            )
        if not path.is_dir():
            raise DataError(f"DATA {path}{which} is a file, not a directory; pass the --destdir of `preprocess`")
    return dirs


def check_data_dir(data: str | os.PathLike, splits, subset_flag: str = "--train-subset", train_split=None):
    """The tokenizer of DATA's first dir, after checking every dir of DATA, its metadata,
    ``splits`` in the first dir and ``train_split`` in every one (sharded data)."""
    dirs = data_dirs(data)
    tokenizer = load_tokenizer(dirs[0])
    for i, path in enumerate(dirs):
        # Like fairseq, only the first dir's vocabulary is read; a shard that has its own
        # must have the same one, or its token ids would mean other tokens.
        if i and has_tokenizer(path) and load_tokenizer(path).pieces() != tokenizer.pieces():
            raise DataError(
                f"{path} has another vocabulary than {dirs[0]}; every data directory of DATA must be preprocessed "
                "with the same tokenizer (preprocess --spm-model or --tokenizer, fairseq-preprocess --srcdict)"
            )
        _check_metadata(path, tokenizer.vocab_size)
        for split in (list(splits) if i == 0 else []) + ([train_split] if train_split else []):
            flag = "--train-subset" if split == train_split else subset_flag
            if not exists(path / split):
                raise DataError(
                    f"no split {split!r} in {path} (expected {split}.bin and {split}.idx); "
                    f"check {flag} or re-run preprocess"
                )
            check_token_ids(IndexedDataset(path / split), tokenizer.vocab_size)
    return tokenizer


def check_mixture(sources, splits, train_split):
    """The tokenizer every source of a mixture shares, after checking each source's DATA as
    check_data_dir does (``train_split`` in each directory; ``splits`` where they exist)."""
    first = tokenizer = None
    for data in sources:
        theirs = check_data_dir(data, [], train_split=train_split)
        if tokenizer is None:
            first, tokenizer = data, theirs
        elif theirs.pieces() != tokenizer.pieces():
            raise DataError(
                f"--data-mixture: {data} has another vocabulary than {first}; every source of a mixture must be "
                "preprocessed with the same tokenizer (preprocess --spm-model or --tokenizer)"
            )
        for path in data_dirs(data):
            for split in splits:
                if exists(path / split):
                    check_token_ids(IndexedDataset(path / split), tokenizer.vocab_size)
    return tokenizer


def _check_metadata(path: Path, vocab_size: int) -> None:
    meta_file = path / "metadata.json"
    if not meta_file.is_file():  # fairseq-preprocess dirs have none
        return
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{meta_file} is not valid JSON ({e}); re-run preprocess into an empty --destdir") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_file} is not preprocess metadata (a JSON object); re-run preprocess")
    recorded = meta.get("vocab_size")
    if recorded is not None and recorded != vocab_size:
        raise DataError(
            f"{meta_file} records a vocabulary of {recorded}, the data dir's tokenizer has {vocab_size}: "
            "they come from different preprocess runs; re-run preprocess into an empty --destdir"
        )


def check_token_ids(dataset: IndexedDataset, vocab_size: int) -> None:
    """Token ids at both ends of the file must be ids of the tokenizer (a file made with a
    bigger vocabulary would index past the model's embedding)."""
    tokens = dataset.tokens
    if not len(tokens):
        return
    ends = (tokens[:SAMPLE_TOKENS], tokens[-SAMPLE_TOKENS:])
    largest = max(int(np.max(part)) for part in ends)
    smallest = min(int(np.min(part)) for part in ends)
    if largest >= vocab_size or smallest < 0:
        bad = largest if largest >= vocab_size else smallest
        raise DataError(
            f"{bin_path(dataset.prefix)} holds token id {bad}, outside the tokenizer's {vocab_size} ids: the token "
            "files were made with another tokenizer; re-run preprocess (with --spm-model or --tokenizer to reuse a "
            "tokenizer)"
        )
