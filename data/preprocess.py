"""``preprocess``: local text/json/parquet/csv/saved datasets -> sentencepiece -> token files.

Writes into ``--destdir``:

* ``{split}.bin`` / ``{split}.idx``: fairseq's MMIDIDX format (``data/indexed_dataset.py``),
  one sequence per input line (text) or row (json, parquet, csv, arrow, saved), each
  ending in ``</s>`` (the tokenizer's eos);
* ``tokenizer.model``: the sentencepiece model; or, with ``--tokenizer HF_DIR``, that
  model's ``tokenizer.json`` (+ ``tokenizer_config.json``, ``special_tokens_map.json``);
* ``metadata.json``: vocabulary size, dtype, special ids, per-split counts and sources
  (and for ``--tokenizer``: the tokenizer's kind and sha256, to tell which model it is).

With ``--tokenizer``, rows with a ``messages`` column (conversations, for SFT) or ``prompt``,
``chosen``, ``rejected`` columns (preference pairs, for DPO) are rendered with the model's
chat template instead (data/chat_encode.py), each split with ``{split}.targets.bin/.idx``
beside it and the template as ``chat_template.jinja`` (data/targets.py says what training
reads).

Everything is built in a temp dir inside destdir and moved into place at the end,
``metadata.json`` last, so a crash or Ctrl-C leaves no half-written split behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

from data.chat_rows import load_chat_rows
from data.chat_template import (
    CHAT_TEMPLATE_FILE,
    compile_or_refuse,
    model_eos_ids,
    read_chat_template,
    template_sha256,
    template_variables,
)
from data.encode import ChatSpec, EncodePool, encode_splits
from data.errors import DataError
from data.hf_tokenizer import HF_TOKENIZER_FILE, HFTokenizer, chat_template_path, hf_tokenizer_paths
from data.indexed_dataset import best_fitting_dtype
from data.sources import ChatRowsFound, Source, load_rows, resolve_sources, split_specs
from data.tokenizer import (
    DEFAULT_SPM_MODEL_TYPE,
    DEFAULT_SPM_SEED,
    DEFAULT_SPM_VOCAB_SIZE,
    SPECIAL_IDS,
    SentencePieceTokenizer,
    file_sha256,
    train_sentencepiece,
)

METADATA_FORMAT = "shardlm-mmidx-1"
TOKENIZER_FILE = "tokenizer.model"
METADATA_FILE = "metadata.json"


def _check_args(args) -> None:
    """Refuse options that contradict each other; fill in the sentencepiece defaults (``args`` is preprocess's copy)."""
    paths = (("--spm-model", args.spm_model), ("--tokenizer", args.tokenizer), ("--chat-template", args.chat_template))
    for flag, value in paths:
        if value is not None and not value.strip():
            raise DataError(f"{flag} is empty; pass a path, or leave {flag} out")
    if args.chat_template and not args.tokenizer:
        raise DataError("--chat-template renders conversations for a Hugging Face tokenizer; pass --tokenizer HF_DIR")
    if args.max_length is not None and args.max_length < 1:
        raise DataError(f"--max-length must be at least 1, got {args.max_length}")
    if args.workers < 1:
        raise DataError(f"--workers must be at least 1, got {args.workers}")
    tokenizer = args.tokenizer
    if tokenizer and (
        args.spm_model or args.vocab_size is not None or args.spm_model_type is not None or args.seed is not None
    ):
        raise DataError(
            "--tokenizer encodes with that model's own tokenizer; leave out --spm-model, --vocab-size, "
            "--spm-model-type and --seed"
        )
    if args.seed is None:
        args.seed = DEFAULT_SPM_SEED
    if args.spm_model and (args.vocab_size is not None or args.spm_model_type is not None):
        raise DataError("--vocab-size and --spm-model-type shape a new tokenizer; leave them out with --spm-model")
    if args.vocab_size is None:
        args.vocab_size = DEFAULT_SPM_VOCAB_SIZE
    if args.spm_model_type is None:
        args.spm_model_type = DEFAULT_SPM_MODEL_TYPE
    if not (args.spm_model or tokenizer) and args.vocab_size <= len(SPECIAL_IDS):
        raise DataError(
            f"--vocab-size must be larger than the {len(SPECIAL_IDS)} special symbols, got {args.vocab_size}"
        )
    if not (args.trainpref or args.validpref or args.testpref):
        raise DataError("nothing to preprocess; pass --trainpref and/or --validpref/--testpref")
    if not args.trainpref and not (args.spm_model or tokenizer):
        raise DataError("--trainpref is needed to train the tokenizer; pass it, or reuse a model with --spm-model")


def _load_spm_model(path: str) -> SentencePieceTokenizer:
    tokenizer = SentencePieceTokenizer(path)
    if tokenizer.special_ids() != SPECIAL_IDS:
        found = " ".join(f"{k}={v}" for k, v in tokenizer.special_ids().items())
        raise DataError(
            f"{path} has special ids {found}, shardlm needs bos=0 pad=1 eos=2 unk=3 (fairseq's); "
            "leave out --spm-model to train a matching one"
        )
    return tokenizer


def _tokenizer_outputs(args) -> dict[str, Path | None]:
    """destdir's tokenizer files -> where each comes from (None: trained here)."""
    if args.tokenizer:
        tokenizer_json, configs = hf_tokenizer_paths(args.tokenizer)
        template = chat_template_path(tokenizer_json)
        return {HF_TOKENIZER_FILE: tokenizer_json, **{p.name: p for p in configs + ([template] if template else [])}}
    return {TOKENIZER_FILE: Path(args.spm_model) if args.spm_model else None}


def _outputs(splits, tokenizer_files) -> list[str]:
    """Every file preprocess may write (the targets and the template only for chat rows)."""
    names = [METADATA_FILE, *tokenizer_files, CHAT_TEMPLATE_FILE]
    for split in splits:
        names += [f"{split}.bin", f"{split}.idx", f"{split}.targets.bin", f"{split}.targets.idx"]
    return names


def _refuse_overwrite(destdir: Path, splits, tokenizer_files) -> None:
    if destdir.exists() and not destdir.is_dir():
        raise DataError(f"--destdir {destdir} is a file; choose a directory")
    blocker = next((p for p in destdir.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise DataError(f"--destdir {destdir} cannot be created: {blocker} is a file; choose another --destdir")
    for name in _outputs(splits, tokenizer_files):
        if (destdir / name).exists():
            raise DataError(f"{destdir / name} already exists; choose another --destdir or delete it")


def _write_training_text(rows, path: Path) -> int:
    """The train split as one sentence per line, for sentencepiece; returns the line count."""
    lines = 0
    with open(path, "w", encoding="utf-8") as f:
        for batch in rows.batches(10_000):
            for text in batch:
                if text:
                    # Newlines inside a json/parquet document just make more lines,
                    # which is what sentencepiece wants.
                    f.write(text)
                    f.write("\n")
                    lines += 1
    return lines


def _build(args, sources: dict[str, list[Source]], work: Path, out: Path) -> dict:

    # The workers start first: they spawn while this process imports datasets and reads.
    with EncodePool(args.workers) as pool:
        return _load_and_encode(args, sources, work, out, pool)


def _load_and_encode(args, sources: dict[str, list[Source]], work: Path, out: Path, pool) -> dict:

    try:
        rows = {
            split: load_rows(split_sources, args.text_column, work / "hf-cache")
            for split, split_sources in sources.items()
        }
    except ChatRowsFound:
        if not args.tokenizer:
            raise  # its message says to pass --tokenizer
        rows = {split: load_chat_rows(split_sources, work / "hf-cache") for split, split_sources in sources.items()}
        kinds = {split: split_rows.kind for split, split_rows in rows.items()}
        if len(set(kinds.values())) > 1:
            found = ", ".join(f"{split} {kind}" for split, kind in kinds.items())
            raise DataError(
                f"the splits hold different kinds of rows ({found}); preprocess each kind separately"
            ) from None
    chat_flags = [flag for flag in ("--chat-template", "--max-length") if getattr(args, flag[2:].replace("-", "_"))]
    if chat_flags and not hasattr(next(iter(rows.values())), "kind"):
        raise DataError(
            f"{' and '.join(chat_flags)} apply to conversation or preference-pair rows; these inputs hold text: "
            "leave them out"
        )
    if args.tokenizer:
        return _encode_hf(args, rows, sources, work, out, pool)
    model_path = out / TOKENIZER_FILE
    if args.spm_model:
        shutil.copyfile(args.spm_model, model_path)
    else:
        text_file = work / "spm-train.txt"
        lines = _write_training_text(rows["train"], text_file)
        print(
            f"training sentencepiece {args.spm_model_type} (vocab {args.vocab_size:,}) on {lines:,} lines",
            flush=True,
        )
        trained = train_sentencepiece(text_file, work / "spm", args.vocab_size, args.spm_model_type, seed=args.seed)
        shutil.copyfile(trained, model_path)
    tokenizer = SentencePieceTokenizer(model_path)
    return {
        "format": METADATA_FORMAT,
        "tokenizer": TOKENIZER_FILE,
        "vocab_size": tokenizer.vocab_size,
        "dtype": best_fitting_dtype(tokenizer.vocab_size).name,
        "special_ids": tokenizer.special_ids(),
        "splits": _encode(rows, sources, model_path, tokenizer, work, out, pool),
    }


def _encode_hf(args, rows, sources, work: Path, out: Path, pool) -> dict:
    """--tokenizer: the model's tokenizer files, copied into the data dir, encode it."""
    for name, source in _tokenizer_outputs(args).items():
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
    kind = getattr(next(iter(rows.values())), "kind", "text")
    if kind == "text":
        metadata["splits"] = _encode(rows, sources, out / HF_TOKENIZER_FILE, tokenizer, work, out, pool)
        return metadata
    template = read_chat_template(args.tokenizer, args.chat_template)
    compile_or_refuse(template, args.chat_template or args.tokenizer)
    (out / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    chat = ChatSpec(kind, template, template_variables(args.tokenizer), model_eos_ids(args.tokenizer), args.max_length)
    metadata.update(
        kind=kind,
        chat_template=CHAT_TEMPLATE_FILE,
        chat_template_sha256=template_sha256(template),
        max_length=args.max_length,
        max_length_rule=MAX_LENGTH_RULES[kind],
        splits=_encode(rows, sources, out / HF_TOKENIZER_FILE, tokenizer, work, out, pool, chat),
    )
    return metadata


MAX_LENGTH_RULES = {
    "conversations": "with --max-length N, a conversation of more than N tokens is dropped",
    "preference_pairs": "with --max-length N, a pair whose longer side (prompt+chosen or prompt+rejected) has more "
    "than N tokens is dropped",
}


def _encode(rows, sources, model_path: Path, tokenizer, work: Path, out: Path, pool, chat=None) -> dict:
    """Each split's token files in ``out`` (and targets, with ``chat``); returns metadata's "splits"."""
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    shard_dir = work / "shards"
    shard_dir.mkdir()
    splits = {}
    for split, stats in encode_splits(rows, model_path, out, dtype, pool, shard_dir, chat):
        paths = [os.fspath(source.path) for source in sources[split]]
        if chat is None:
            print(
                f"{split}: {stats.documents:,} documents, {stats.tokens:,} tokens, "
                f"{stats.tokens_per_second:,.0f} tokens/s",
                flush=True,
            )
            splits[split] = {"documents": stats.documents, "tokens": stats.tokens, "sources": paths}
            continue
        per_row = 1 if chat.kind == "conversations" else 2
        dropped = f", {stats.dropped:,} dropped (over --max-length {chat.max_length:,})" if chat.max_length else ""
        print(
            f"{split}: {stats.documents:,} {chat.kind.replace('_', ' ')} read, {stats.written:,} written{dropped}, "
            f"{stats.written * per_row:,} sequences, {stats.tokens:,} tokens, {stats.tokens_per_second:,.0f} tokens/s",
            flush=True,
        )
        splits[split] = {
            "rows_read": stats.documents,
            "rows_written": stats.written,
            "rows_dropped": stats.dropped,
            "sequences": stats.written * per_row,
            "tokens": stats.tokens,
            "sources": paths,
        }
    return splits


def preprocess(options) -> Path:
    """Run preprocess; returns the data dir it wrote. ``options`` holds the value of each of its
    flags as an attribute: a PreprocessConfig (trainer/config/commands.py, where the flags are
    generated) from cli.py, or any object with those attributes, as data/ imports nothing
    from trainer/."""
    args = SimpleNamespace(**vars(options))  # _check_args fills in defaults: not in the caller's object
    _check_args(args)
    destdir = Path(args.destdir)
    # Every input is checked before anything is written.
    sources = {
        split: resolve_sources(spec, args.input_format)
        for split, spec in split_specs(args.trainpref, args.validpref, args.testpref).items()
    }
    if args.spm_model:
        _load_spm_model(args.spm_model)
    if args.tokenizer:
        HFTokenizer(args.tokenizer)  # its special ids and pad, refused now if it has none
    if args.chat_template:
        read_chat_template(args.tokenizer, args.chat_template)
    tokenizer_files = _tokenizer_outputs(args)
    _refuse_overwrite(destdir, sources, tokenizer_files)

    created = not destdir.exists()
    destdir.mkdir(parents=True, exist_ok=True)
    try:
        # Inside destdir so the final moves are renames on one filesystem; datasets'
        # cache lives here too, so nothing lands in the user's home.
        with tempfile.TemporaryDirectory(dir=destdir, prefix=".preprocess-") as tmp:
            work, out = Path(tmp) / "work", Path(tmp) / "out"
            work.mkdir()
            out.mkdir()
            metadata = _build(args, sources, work, out)
            with open(out / METADATA_FILE, "w", encoding="utf-8") as f:
                json.dump(metadata, f, indent=2)
                f.write("\n")
            _refuse_overwrite(destdir, sources, tokenizer_files)  # someone may have written there meanwhile
            # metadata.json last: its presence says the data dir is complete.
            for name in _outputs(sources, tokenizer_files):
                if name != METADATA_FILE and (out / name).exists():
                    os.replace(out / name, destdir / name)
            os.replace(out / METADATA_FILE, destdir / METADATA_FILE)
    except BaseException:
        if created and destdir.is_dir() and not any(destdir.iterdir()):
            destdir.rmdir()
        raise
    return destdir
