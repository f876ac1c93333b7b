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

Text in text, jsonl and parquet files (plain or gzip) takes the corpus path: streamed in
chunks, one shard per chunk (train, train1, …), resumable after a kill
(data/corpus_files.py, data/corpus_run.py). Everything else is read through ``datasets``,
built in a temp dir inside destdir and moved into place at the end, ``metadata.json``
last, so a crash or Ctrl-C leaves no half-written split behind.
"""

from __future__ import annotations

import json
import os
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
from data.corpus_files import streamable
from data.corpus_run import preprocess_corpus
from data.encode import ChatSpec, EncodePool, encode_splits
from data.errors import DataError
from data.hf_tokenizer import HF_TOKENIZER_FILE, HFTokenizer
from data.indexed_dataset import best_fitting_dtype
from data.preprocess_tokenizer import (
    METADATA_FILE,
    place_tokenizer,
    tokenizer_outputs,
)
from data.sources import (
    ChatRowsFound,
    Source,
    load_rows,
    refuse_destdir_inside_inputs,
    resolve_sources,
    split_specs,
)
from data.tokenizer import (
    DEFAULT_SPM_MODEL_TYPE,
    DEFAULT_SPM_SEED,
    DEFAULT_SPM_VOCAB_SIZE,
    SPECIAL_IDS,
    SentencePieceTokenizer,
)


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


def _outputs(splits, tokenizer_files) -> list[str]:
    """Every file preprocess may write (the targets and the template only for chat rows)."""
    names = [METADATA_FILE, *tokenizer_files, CHAT_TEMPLATE_FILE]
    for split in splits:
        names += [f"{split}.bin", f"{split}.idx", f"{split}.targets.bin", f"{split}.targets.idx"]
    return names


def _refuse_bad_destdir(destdir: Path) -> None:
    if destdir.exists() and not destdir.is_dir():
        raise DataError(f"--destdir {destdir} is a file; choose a directory")
    blocker = next((p for p in destdir.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise DataError(f"--destdir {destdir} cannot be created: {blocker} is a file; choose another --destdir")


def _refuse_existing(destdir: Path, names) -> None:
    for name in names:
        if (destdir / name).exists():
            raise DataError(f"{destdir / name} already exists; choose another --destdir or delete it")


def _refuse_overwrite(destdir: Path, splits, tokenizer_files) -> None:
    _refuse_bad_destdir(destdir)
    _refuse_existing(destdir, _outputs(splits, tokenizer_files))


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
    metadata, model_path = place_tokenizer(args, out, lambda: _row_texts(rows["train"]))
    if args.tokenizer:
        return _encode_hf(args, metadata, rows, sources, work, out, pool)
    tokenizer = SentencePieceTokenizer(model_path)
    metadata["splits"] = _encode(rows, sources, model_path, tokenizer, work, out, pool)
    return metadata


def _row_texts(rows):
    for batch in rows.batches(10_000):
        yield from batch


def _encode_hf(args, metadata, rows, sources, work: Path, out: Path, pool) -> dict:
    """--tokenizer: the model's tokenizer files, copied into the data dir, encode it."""
    tokenizer = HFTokenizer(out / HF_TOKENIZER_FILE)
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


def _streams(args, sources) -> bool:
    """The corpus path (data/corpus_run.py: streamed, sharded, resumable) takes text in
    text/jsonl/parquet files; the rest (csv, arrow, saved datasets, conversations, a column
    that is not text) goes through ``datasets``, merged into one file per split."""
    if args.chat_template or args.max_length:
        return False  # the datasets path says what these apply to
    return all(streamable(split_sources, args.text_column) for split_sources in sources.values())


def preprocess(options) -> Path:
    """Run preprocess; returns the data dir it wrote. ``options`` holds the value of each of its
    flags as an attribute: a PreprocessConfig (trainer/config/commands.py, where the flags are
    generated) from cli.py, or any object with those attributes, as data/ imports nothing
    from trainer/."""
    args = SimpleNamespace(**vars(options))  # _check_args fills in defaults: not in the caller's object
    _check_args(args)
    destdir = Path(args.destdir)
    # Every input is checked before anything is written.
    specs = split_specs(args.trainpref, args.validpref, args.testpref)
    sources = {split: resolve_sources(spec, args.input_format) for split, spec in specs.items()}
    refuse_destdir_inside_inputs(specs.values(), destdir)
    if args.spm_model:
        _load_spm_model(args.spm_model)
    if args.tokenizer:
        HFTokenizer(args.tokenizer)  # its special ids and pad, refused now if it has none
    if args.chat_template:
        read_chat_template(args.tokenizer, args.chat_template)
    tokenizer_files = tokenizer_outputs(args)
    if _streams(args, sources):
        _refuse_bad_destdir(destdir)
        refuse = lambda names: _refuse_existing(destdir, names)  # noqa: E731
        return preprocess_corpus(args, sources, destdir, tokenizer_files, refuse, EncodePool)
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
