"""What training reads of a conversations or preference-pairs data dir, beyond its tokens.

``preprocess`` writes, beside each split's ``{split}.bin/.idx``, ``{split}.targets.bin/.idx``:
an MMIDIDX dataset of uint8 with exactly the same sequence sizes, 1 where that token is a
target (token j is predicted from the tokens before it), 0 elsewhere. metadata.json's
``"kind"`` says what a sequence is:

* ``"text"`` (or no ``kind``, as in every data dir made before): documents, no targets file;
* ``"conversations"``: sequence i is conversation i, its targets the assistant's tokens;
* ``"preference_pairs"``: sequences 2i and 2i+1 are pair i's prompt+chosen and
  prompt+rejected, sharing their prompt tokens; the targets are each completion's tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from data.errors import DataError
from data.indexed_dataset import IndexedDataset, exists

KINDS = ("text", "conversations", "preference_pairs")
TARGETS_DTYPE = np.dtype(np.uint8)


def targets_prefix(prefix: str | os.PathLike) -> Path:
    """``data-bin/train`` -> ``data-bin/train.targets``."""
    return Path(f"{os.fspath(prefix)}.targets")


def data_kind(data_dir: str | os.PathLike) -> str:
    """ "text", "conversations" or "preference_pairs", from ``data_dir``'s metadata.json
    ("text" for a dir without one, such as fairseq-preprocess's, or without a kind)."""
    path = Path(data_dir) / "metadata.json"
    if not path.is_file():
        return "text"
    try:
        kind = json.loads(path.read_text(encoding="utf-8")).get("kind", "text")
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise DataError(f"{path} is not a JSON object; re-run preprocess to rebuild {data_dir}") from None
    if kind not in KINDS:
        raise DataError(f"{path} has kind {kind!r}, not one of {', '.join(KINDS)}; re-run preprocess")
    return kind


def load_targets(prefix: str | os.PathLike) -> IndexedDataset:
    """The targets of split ``prefix`` (e.g. ``data-bin/train``): ``ds[i]`` is a uint8 array
    as long as sequence i. Refused in one line if missing or not matching the tokens."""
    path = targets_prefix(prefix)
    if not exists(path):
        raise DataError(
            f"{path}.idx/.bin are missing: {prefix} has no targets; conversations and preference pairs need them: "
            "re-run preprocess --tokenizer HF_DIR on the messages / prompt, chosen, rejected rows"
        )
    targets = IndexedDataset(path)
    tokens = IndexedDataset(prefix)
    if targets.dtype != TARGETS_DTYPE or not np.array_equal(targets.sizes, tokens.sizes):
        raise DataError(f"{path}.idx does not match {prefix}.idx (dtype or sequence sizes); re-run preprocess")
    return targets
