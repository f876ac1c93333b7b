"""The corpus ``train`` uses when given no data: synthetic text with a known entropy floor.

The text comes from a small first-order Markov chain over ~300 made-up words, so a tiny
model learns it in a minute or two on a CPU, and the true model's cross-entropy on the
valid split is computed exactly: a trained model's valid loss (in bits per character)
can be compared with the lowest any model could reach.

Each line is one document: a start word drawn uniformly from 16; after each word the
line ends with probability 1/12, otherwise the next word is one of the current word's 4
successors with probabilities (0.5, 0.25, 0.15, 0.1).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from data.atomic_file import write_atomically
from data.errors import DataError
from data.preprocess import preprocess

VERSION_DIR = "embedded-v1"
_SEED = 20240611
_NUM_WORDS = 300
_NUM_START_WORDS = 16
_SUCCESSOR_PROBS = np.array([0.5, 0.25, 0.15, 0.1])
_END_PROB = 1 / 12
_CONSONANTS = list("bdfgklmnprstvz")
_VOWELS = list("aeiou")
# Characters per split; the splits use disjoint seed streams.
_SPLIT_CHARS = {"train": 2_000_000, "valid": 100_000, "test": 100_000}
_SPLIT_STREAMS = {"train": 1, "valid": 2, "test": 3}
SPLITS = tuple(_SPLIT_CHARS)
_VOCAB_SIZE = 1024


@dataclass(frozen=True)
class MarkovLanguage:
    words: list[str]
    successors: np.ndarray  # [num_words, 4] word ids, distinct per row
    start_words: np.ndarray  # [16] word ids


def make_language() -> MarkovLanguage:
    rng = np.random.default_rng([_SEED, 0])
    words, seen = [], set()
    while len(words) < _NUM_WORDS:
        syllables = int(rng.integers(2, 5))
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        if word not in seen:
            seen.add(word)
            words.append(word)
    successors = np.stack([rng.choice(_NUM_WORDS, size=len(_SUCCESSOR_PROBS), replace=False) for _ in words])
    start_words = rng.choice(_NUM_WORDS, size=_NUM_START_WORDS, replace=False)
    return MarkovLanguage(words, successors, start_words)


def generate_lines(language: MarkovLanguage, stream: int, min_chars: int) -> list[list[int]]:
    """Documents (lists of word ids) from seed stream ``stream``, until ``min_chars`` characters."""
    rng = np.random.default_rng([_SEED, stream])
    word_chars = [len(w) + 1 for w in language.words]  # + the space or newline after it
    successors = language.successors.tolist()
    lines, chars = [], 0
    while chars < min_chars:
        # Ending with probability 1/12 after each word makes a line's word count
        # geometric, so the random draws come in bulk and only the walk is a loop.
        word_counts = rng.geometric(_END_PROB, size=1024).tolist()
        starts = rng.integers(0, _NUM_START_WORDS, size=1024).tolist()
        slots = rng.choice(len(_SUCCESSOR_PROBS), size=sum(word_counts), p=_SUCCESSOR_PROBS).tolist()
        k = 0
        for count, start in zip(word_counts, starts):
            word = int(language.start_words[start])
            line = [word]
            for slot in slots[k : k + count - 1]:
                word = successors[word][slot]
                line.append(word)
            k += count - 1
            lines.append(line)
            chars += sum(word_chars[w] for w in line)
            if chars >= min_chars:
                break
    return lines


def render(language: MarkovLanguage, lines: list[list[int]]) -> str:
    return "".join(" ".join(language.words[w] for w in line) + "\n" for line in lines)


def entropy_bits(language: MarkovLanguage, lines: list[list[int]]) -> float:
    """-log2 P(text) under the true model: start word, each continue+successor, each end.

    Words are distinct and space-separated, so the text determines the word sequence
    and this is the probability of the text itself.
    """
    position = {}  # (word, successor) -> slot, for the successor probability
    for word, row in enumerate(language.successors):
        for slot, successor in enumerate(row):
            position[(word, int(successor))] = slot
    log_probs = np.log2(_SUCCESSOR_PROBS)
    bits = 0.0
    for line in lines:
        bits += math.log2(_NUM_START_WORDS)
        for a, b in zip(line, line[1:]):
            bits -= math.log2(1 - _END_PROB) + log_probs[position[(a, b)]]
        bits -= math.log2(_END_PROB)  # the newline
    return bits


def default_cache_dir() -> Path:
    if os.environ.get("SHARDLM_CACHE"):
        return Path(os.environ["SHARDLM_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "shardlm"


def _build(workdir: Path) -> None:

    language = make_language()
    text_dir = workdir / "text"
    text_dir.mkdir()
    floor = None
    for split, min_chars in _SPLIT_CHARS.items():
        lines = generate_lines(language, _SPLIT_STREAMS[split], min_chars)
        text = render(language, lines)
        (text_dir / f"{split}.txt").write_text(text, encoding="utf-8")
        if split == "valid":
            floor = {
                "valid_bits_per_char": entropy_bits(language, lines) / len(text),
                "valid_chars": len(text),
            }
    preprocess(preprocess_options(text_dir, workdir))
    metadata_path = workdir / "metadata.json"
    metadata = json.loads(metadata_path.read_text(encoding="utf-8"))
    # Relative: the absolute temp paths preprocess saw are gone after the rename.
    for split in metadata["splits"].values():
        split["sources"] = [os.fspath(Path("text") / Path(s).name) for s in split["sources"]]
    metadata["embedded"] = {
        **floor,
        "description": (
            f"synthetic Markov-chain text: {_NUM_WORDS} words, {_NUM_START_WORDS} start words, "
            f"4 successors per word with probabilities {_SUCCESSOR_PROBS.tolist()}, line end "
            "probability 1/12 after each word; valid_bits_per_char is the true model's "
            "-log2 P(valid text) / characters (newlines counted), the floor for any model"
        ),
    }
    write_atomically(metadata_path, json.dumps(metadata, indent=2) + "\n")


def preprocess_options(text_dir: Path, workdir: Path) -> SimpleNamespace:
    """The embedded corpus's preprocess options, every one spelled out (tests/test_preprocess_flags.py
    checks that none is missing): its files are cached by VERSION_DIR, so a new default of
    preprocess must not change them unnoticed."""
    return SimpleNamespace(
        trainpref=os.fspath(text_dir / "train.txt"),
        validpref=os.fspath(text_dir / "valid.txt"),
        testpref=os.fspath(text_dir / "test.txt"),
        destdir=os.fspath(workdir),
        text_column="text",
        input_format="auto",
        vocab_size=_VOCAB_SIZE,
        spm_model_type="bpe",
        spm_model=None,
        tokenizer=None,
        chat_template=None,
        max_length=None,
        workers=1,
        seed=None,
        shard_mb=256.0,  # one train file: the corpus is far smaller
    )


def prepare_embedded_corpus(cache_dir: Path | None = None) -> Path:
    """The embedded corpus's data dir, built on first use (a few seconds) and cached."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / VERSION_DIR
    if (target / "metadata.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    print(f"preparing the embedded corpus in {target}", file=sys.stderr, flush=True)
    workdir = Path(tempfile.mkdtemp(dir=root, prefix=f".{VERSION_DIR}-"))
    os.chmod(workdir, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        # preprocess reports on stdout; here that would land in the output of the command
        # that asked for the corpus (`plan --format json` is one JSON object on stdout).
        with contextlib.redirect_stdout(sys.stderr):
            _build(workdir)
        try:
            # Atomic: readers see no corpus or a complete one. If another process won
            # the race, its copy is as good as ours.
            os.rename(workdir, target)
        except OSError:
            if not (target / "metadata.json").is_file():
                raise DataError(f"{target} exists but holds no complete corpus; delete it and run again") from None
    finally:
        if workdir.exists():
            shutil.rmtree(workdir, ignore_errors=True)
    return target
