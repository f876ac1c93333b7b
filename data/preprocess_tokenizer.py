"""The tokenizer of a ``preprocess`` run: copied (``--spm-model``, ``--tokenizer HF_DIR``) or
trained (sentencepiece on the train split, streamed), and the part of metadata.json that
describes it. Shared by the ``datasets`` path (data/preprocess.py) and the corpus path
(data/corpus_run.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from data.errors import DataError
from data.hf_tokenizer import HF_TOKENIZER_FILE, HFTokenizer, chat_template_path, hf_tokenizer_paths
from data.indexed_dataset import best_fitting_dtype
from data.tokenizer import SentencePieceTokenizer, file_sha256, train_sentencepiece

METADATA_FORMAT = "shardlm-mmidx-1"
TOKENIZER_FILE = "tokenizer.model"
METADATA_FILE = "metadata.json"


def tokenizer_outputs(args) -> dict[str, Path | None]:
    """destdir's tokenizer files -> where each comes from (None: trained here)."""
    if args.tokenizer:
        tokenizer_json, configs = hf_tokenizer_paths(args.tokenizer)
        template = chat_template_path(tokenizer_json)
        return {HF_TOKENIZER_FILE: tokenizer_json, **{p.name: p for p in configs + ([template] if template else [])}}
    return {TOKENIZER_FILE: Path(args.spm_model) if args.spm_model else None}


def training_sentences(texts, errors: list):
    """Rows as sentencepiece's training lines, streamed: the lines of each non-empty row (a
    json/parquet document's newlines just make more lines, which is what sentencepiece
    wants), split as a file of them read back would be (universal newlines). A DataError of
    the reader (bad UTF-8) ends the stream and lands in ``errors``: sentencepiece's C++
    would otherwise turn it into its own message."""
    try:
        for text in texts:
            if text:
                yield from (text + "\n").replace("\r\n", "\n").replace("\r", "\n").split("\n")[:-1]
    except DataError as e:
        errors.append(e)


def place_tokenizer(args, out: Path, train_texts, trained_sha: str | None = None) -> tuple[dict, Path]:
    """The tokenizer's files in ``out`` (copied, or sentencepiece trained on ``train_texts()``
    unless ``out`` already holds the model of sha ``trained_sha``, from a killed run); returns
    metadata's tokenizer part and the file workers encode with."""
    if args.tokenizer:
        for name, source in tokenizer_outputs(args).items():
            shutil.copyfile(source, out / name)
        tokenizer = HFTokenizer(out / HF_TOKENIZER_FILE)
        names = tokenizer.special_tokens()
        print(
            f"tokenizer {args.tokenizer}: vocab {tokenizer.vocab_size:,}, "
            + ", ".join(f"{key} {tokenizer.special_ids()[key]} ({token})" for key, token in names.items())
            + ("" if tokenizer.pad_reason == "pad_token" else f"; pad is {tokenizer.pad_reason}"),
            flush=True,
        )
        metadata = {
            "format": METADATA_FORMAT,
            "tokenizer": HF_TOKENIZER_FILE,
            "tokenizer_kind": "hf",
            "tokenizer_sha256": file_sha256(out / HF_TOKENIZER_FILE),
            "tokenizer_source": os.path.abspath(args.tokenizer),
            "vocab_size": tokenizer.vocab_size,
            "dtype": best_fitting_dtype(tokenizer.vocab_size).name,
            "special_ids": tokenizer.special_ids(),
            "special_tokens": names,
        }
        return metadata, out / HF_TOKENIZER_FILE
    model_path = out / TOKENIZER_FILE
    if args.spm_model:
        shutil.copyfile(args.spm_model, model_path)
    elif not (trained_sha and model_path.is_file() and file_sha256(model_path) == trained_sha):
        print(
            f"training sentencepiece {args.spm_model_type} (vocab {args.vocab_size:,}) on the train split's lines "
            "(a seeded sample of at most 10,000,000)",
            flush=True,
        )
        errors: list = []
        sentences = training_sentences(train_texts(), errors)
        spm_dir = out / "spm"
        spm_dir.mkdir(exist_ok=True)
        try:
            trained = train_sentencepiece(sentences, spm_dir / "spm", args.vocab_size, args.spm_model_type, args.seed)
        except DataError:
            if errors:
                raise errors[0] from None
            raise
        if errors:
            raise errors[0]
        os.replace(trained, model_path)
        shutil.rmtree(spm_dir)
    tokenizer = SentencePieceTokenizer(model_path)
    metadata = {
        "format": METADATA_FORMAT,
        "tokenizer": TOKENIZER_FILE,
        "vocab_size": tokenizer.vocab_size,
        "dtype": best_fitting_dtype(tokenizer.vocab_size).name,
        "special_ids": tokenizer.special_ids(),
    }
    return metadata, model_path
