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
from data.tokenizer import load_tokenizer

# Token ids read from each end of a token file to see that they fit the tokenizer.
SAMPLE_TOKENS = 1 << 20


def check_data_dir(path: str | os.PathLike, splits, subset_flag: str = "--train-subset"):
    """The data dir's tokenizer, after checking the dir, its metadata and each of ``splits``."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"data directory {path} does not exist; pass a directory written by `preprocess` "
            "(shardlm reads local data only: preprocess a hub dataset's files first)"
        )
    if not path.is_dir():
        raise DataError(f"DATA {path} is a file, not a directory; pass the --destdir of `preprocess`")
    tokenizer = load_tokenizer(path)
    _check_metadata(path, tokenizer.vocab_size)
    for split in splits:
        if not exists(path / split):
            raise DataError(
                f"no split {split!r} in {path} (expected {split}.bin and {split}.idx); "
                f"check {subset_flag} or re-run preprocess"
            )
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
            "files were made with another tokenizer; re-run preprocess (with --spm-model to reuse a tokenizer)"
        )
