"""Text <-> token ids: a sentencepiece model (our data dirs), a Hugging Face tokenizer.json
(``preprocess --tokenizer``, data/hf_tokenizer.py) or a fairseq dict.txt (theirs).

sentencepiece and dict.txt use fairseq's special ids, so a model trained on either kind
of data dir sees the same ``<pad>`` and ``</s>``; an HF tokenizer keeps its model's own.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Iterable
from pathlib import Path

from data.dictionary import Dictionary
from data.errors import DataError
from data.hf_tokenizer import (
    CHAT_TEMPLATE_FILE,
    HF_CONFIG_FILES,
    HF_TOKENIZER_FILE,
    HFTokenizer,
    hf_vocab_size,
    load_hf_tokenizer_file,
)

SPECIAL_IDS = dict(bos=0, pad=1, eos=2, unk=3)
# The sentencepiece model preprocess trains unless told otherwise (its --vocab-size,
# --spm-model-type and --seed: trainer/config/commands.py shows these in their help).
SPM_MODEL_TYPES = ("bpe", "unigram")
DEFAULT_SPM_VOCAB_SIZE = 8000
DEFAULT_SPM_MODEL_TYPE = "bpe"
DEFAULT_SPM_SEED = 1


def train_sentencepiece(
    input_text: str | os.PathLike | Iterable[str],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    model_type: str = DEFAULT_SPM_MODEL_TYPE,
    seed: int = DEFAULT_SPM_SEED,
) -> Path:
    """Train a sentencepiece model on a one-sentence-per-line file, or on sentences streamed
    from an iterable (preprocess: no copy of a large corpus on disk); returns ``<prefix>.model``."""
    import sentencepiece as spm

    if model_type not in SPM_MODEL_TYPES:
        raise DataError(f"unknown sentencepiece model type {model_type!r}; use bpe or unigram")
    # The seed drives sentencepiece's sentence sampling; with one thread the result is
    # the same bytes run after run.
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        # Fed through an iterator and written through model_writer, not input= and
        # model_prefix=, because sentencepiece records those two paths in the model:
        # two runs would differ by their temp dir names.
        with contextlib.ExitStack() as stack:
            if isinstance(input_text, (str, os.PathLike)):
                lines = stack.enter_context(open(input_text, encoding="utf-8"))
                sentences = (line.rstrip("\n") for line in lines)
            else:
                sentences = iter(input_text)
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences,
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                bos_id=SPECIAL_IDS["bos"],
                pad_id=SPECIAL_IDS["pad"],
                eos_id=SPECIAL_IDS["eos"],
                unk_id=SPECIAL_IDS["unk"],
                character_coverage=1.0,
                # A small corpus may not support the requested vocabulary: take fewer
                # pieces instead of failing.
                hard_vocab_limit=False,
                # Lossless: decode(encode(text)) == text for every character seen in
                # training (no NFKC rewriting, no collapsing of spaces, which would
                # corrupt e.g. code).
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                # The training text has one sentence per line, so a newline inside a
                # document (json/parquet rows) would otherwise never get a piece.
                user_defined_symbols=["\n"],
                # Bound memory on huge corpora: a seeded reservoir sample of this many
                # sentences of the whole stream (each read once, never all held).
                input_sentence_size=10_000_000,
                shuffle_input_sentence=True,
                max_sentence_length=1 << 16,
                num_threads=1,
                minloglevel=2,
            )
    except RuntimeError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        if "smaller than required_chars" in first_line:  # every character seen needs a piece
            raise DataError(
                f"--vocab-size {vocab_size} is smaller than the training text's distinct characters plus the "
                "4 special symbols; raise --vocab-size"
            ) from None
        raise DataError(
            f"sentencepiece training failed: {first_line}; check the training text and --vocab-size"
        ) from None
    path = Path(f"{os.fspath(model_prefix)}.model")
    path.write_bytes(model.getvalue())
    return path


class SentencePieceTokenizer:
    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece as spm

        path = Path(model_path)
        if not path.is_file():
            raise DataError(f"missing sentencepiece model {path}; re-run preprocess or pass an existing --spm-model")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=os.fspath(path))
        except (RuntimeError, OSError) as e:
            raise DataError(
                f"{path} is not a sentencepiece model ({e}); pass a .model file written by sentencepiece"
            ) from None
        self.model_path = path
        self.vocab_size = self._sp.get_piece_size()
        self.bos, self.pad, self.eos, self.unk = (
            self._sp.bos_id(),
            self._sp.pad_id(),
            self._sp.eos_id(),
            self._sp.unk_id(),
        )
        self._skip_on_decode = {self.bos, self.pad, self.eos}

    def special_ids(self) -> dict[str, int]:
        return dict(bos=self.bos, pad=self.pad, eos=self.eos, unk=self.unk)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without ``</s>`` (preprocess appends it per sequence)."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], add_eos: bool = False) -> list[list[int]]:
        # One thread: parallelism comes from preprocess --workers processes, and nested
        # thread pools would oversubscribe the cores.
        return self._sp.encode(list(texts), out_type=int, num_threads=1, add_eos=add_eos)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids if int(i) not in self._skip_on_decode])

    def pieces(self) -> list[str]:
        """The vocabulary, by id: two tokenizers with the same pieces give the same ids."""
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]


class DictionaryTokenizer:
    """fairseq data dirs: whitespace-split words looked up in dict.txt."""

    def __init__(self, dictionary: Dictionary):
        self.dictionary = dictionary
        self.vocab_size = len(dictionary)
        self.bos, self.pad, self.eos, self.unk = (
            dictionary.bos(),
            dictionary.pad(),
            dictionary.eos(),
            dictionary.unk(),
        )

    def special_ids(self) -> dict[str, int]:
        return dict(bos=self.bos, pad=self.pad, eos=self.eos, unk=self.unk)

    def encode(self, text: str) -> list[int]:
        return [self.dictionary.index(word) for word in text.split()]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return self.dictionary.string(ids)

    def pieces(self) -> list[str]:
        return list(self.dictionary.symbols)


# A data dir's tokenizer file, by kind. Without metadata.json naming one, tokenizer.json
# comes first: an HF model dir may also hold its slow tokenizer's tokenizer.model.
TOKENIZER_KINDS = {HF_TOKENIZER_FILE: "hf", "tokenizer.model": "sentencepiece", "dict.txt": "fairseq-dict"}
# Every file that makes up a data dir's tokenizer: checkpoints and exports copy these.
TOKENIZER_FILES = ("tokenizer.model", "dict.txt", HF_TOKENIZER_FILE, *HF_CONFIG_FILES, CHAT_TEMPLATE_FILE)


def tokenizer_files(data_dir: str | os.PathLike) -> tuple[str, Path]:
    """(kind, file) of the tokenizer of a data dir, checkpoint or export: kind is "hf"
    (tokenizer.json), "sentencepiece" (tokenizer.model) or "fairseq-dict" (dict.txt)."""
    data_dir = Path(data_dir)
    try:  # preprocess records the file it encoded with
        named = json.loads((data_dir / "metadata.json").read_text(encoding="utf-8")).get("tokenizer")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        named = None
    names = ([named] if isinstance(named, str) and named in TOKENIZER_KINDS else []) + list(TOKENIZER_KINDS)
    for name in names:
        if (data_dir / name).is_file():
            return TOKENIZER_KINDS[name], data_dir / name
    raise DataError(
        f"{data_dir} has neither tokenizer.model nor dict.txt nor tokenizer.json; run preprocess to create a data dir"
    )


def has_tokenizer(data_dir: str | os.PathLike) -> bool:
    return any((Path(data_dir) / name).is_file() for name in TOKENIZER_KINDS)


def load_tokenizer(data_dir: str | os.PathLike) -> SentencePieceTokenizer | HFTokenizer | DictionaryTokenizer:
    """The tokenizer of a data dir: ``tokenizer.model`` (ours), ``tokenizer.json``
    (preprocess --tokenizer) or ``dict.txt`` (fairseq's)."""
    kind, path = tokenizer_files(data_dir)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path)
    if kind == "hf":
        return HFTokenizer(path)
    return DictionaryTokenizer(Dictionary.load(path))


def tokenizer_identity(data_dir: str | os.PathLike) -> dict:
    """What says which tokenizer made a data dir (or a checkpoint, an export, an HF model
    dir): ``dict(kind=..., sha256=..., vocab_size=...)``; for an HF model's tokenizer,
    sha256 is that of its tokenizer.json. Torch-free and quick (no special ids resolved)."""
    kind, path = tokenizer_files(data_dir)
    if kind == "hf":
        vocab_size = hf_vocab_size(load_hf_tokenizer_file(path))
    elif kind == "sentencepiece":
        vocab_size = SentencePieceTokenizer(path).vocab_size
    else:
        vocab_size = len(Dictionary.load(path))
    return dict(kind=kind, sha256=file_sha256(path), vocab_size=vocab_size)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
