"""Finding preprocess inputs on disk and reading them through HF ``datasets``.

Two steps, so that every input is checked before anything is written:
``resolve_sources`` only looks at the filesystem; ``load_rows`` reads (plain text itself,
everything else through ``datasets``, whose import is slow).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from data.errors import DataError
from data.text_rows import DatasetRows, TextFileRows

INPUT_FORMATS = ("auto", "text", "json", "parquet", "csv", "arrow")

_EXTENSION_FORMATS = {
    "": "text",
    ".txt": "text",
    ".tokens": "text",
    ".raw": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
# datasets decompresses these itself; the format is the extension underneath.
_COMPRESSION_EXTENSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
# A directory written by Dataset.save_to_disk holds these.
_SAVED_DATASET_FILES = ("state.json", "dataset_info.json")


@dataclass(frozen=True)
class Source:
    """One input: a file and the ``datasets`` builder that reads it, or a saved dataset dir."""

    path: Path
    format: str  # "text" | "json" | "parquet" | "csv" | "arrow" | "saved"


def _not_found(spec: str) -> DataError:
    return DataError(
        f"no local file or saved dataset at {spec}; preprocess reads local files only "
        "(download the dataset first, or point at a saved copy)"
    )


def _format_of(path: Path, input_format: str) -> str:
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            raise DataError(f"{path} is a saved DatasetDict; point at one of its splits, e.g. {path / 'train'}")
        return "saved"
    if input_format != "auto":
        return input_format
    name = path.name.lower()
    for compression in _COMPRESSION_EXTENSIONS:
        if name.endswith(compression):
            name = name[: -len(compression)]
    suffix = Path(name).suffix
    if suffix not in _EXTENSION_FORMATS:
        raise DataError(
            f"cannot tell the format of {path} from its extension {suffix!r}; pass --input-format "
            f"({', '.join(INPUT_FORMATS[1:])})"
        )
    return _EXTENSION_FORMATS[suffix]


def _plain_dir(path: Path) -> bool:
    """A directory of input files (a corpus), not a saved dataset or DatasetDict."""
    saved = (*_SAVED_DATASET_FILES, "dataset_dict.json")
    return path.is_dir() and not any((path / name).is_file() for name in saved)


def _files_under(path: Path) -> list[Path]:
    """Every file below a corpus directory, sorted by path (the same order run after run);
    hidden files and dirs (.git, a .preprocess-partial) are skipped."""
    files = (p for p in path.rglob("*") if p.is_file())
    return sorted(p for p in files if not any(part.startswith(".") for part in p.relative_to(path).parts))


def resolve_sources(spec: str, input_format: str = "auto") -> list[Source]:
    """Files named by one spec: a path, a directory of files, a glob, or a comma-separated
    list of them, in order.

    Globs and directories expand sorted, so the same command always reads files in the same
    order.
    """
    sources = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        if _plain_dir(Path(item)):
            paths = _files_under(Path(item))
        elif Path(item).exists():
            paths = [Path(item)]
        elif any(c in item for c in "*?["):
            paths = [Path(p) for p in sorted(glob.glob(item, recursive=True)) if Path(p).is_file()]
            if not paths:
                raise DataError(
                    f"the pattern {item} matched no files; check the path (preprocess reads local files only)"
                )
        else:
            raise _not_found(item)
        # An empty file holds no sequences, and datasets refuses to read one.
        paths = [p for p in paths if p.is_dir() or p.stat().st_size > 0]
        sources.extend(Source(p.absolute(), _format_of(p, input_format)) for p in paths)
    if not sources:
        raise DataError(f"no data in {spec!r} (no files, or only empty ones); pass files that hold text")
    return sources


def refuse_destdir_inside_inputs(specs, destdir: Path) -> None:
    """A --destdir inside an input directory would become input of the next run."""
    target = destdir.resolve()
    for spec in specs:
        for item in (part.strip() for part in spec.split(",")):
            if item and _plain_dir(Path(item)) and target.is_relative_to(Path(item).resolve()):
                raise DataError(
                    f"--destdir {destdir} is inside the input directory {item}; choose a --destdir outside it"
                )


def split_specs(trainpref: str | None, validpref: str | None, testpref: str | None) -> dict[str, str]:
    """Split name -> input spec, fairseq's way: ``--validpref a,b`` makes valid and valid1.

    For train every comma-separated part goes into the one train split.
    """
    specs = {}
    if trainpref:
        specs["train"] = trainpref
    for name, pref in (("valid", validpref), ("test", testpref)):
        parts = [part.strip() for part in (pref or "").split(",") if part.strip()]
        for k, part in enumerate(parts):
            specs[name if k == 0 else f"{name}{k}"] = part
    return specs


def import_datasets_offline():
    # Set before the import (datasets reads them then) and on the config after, in case
    # something imported datasets earlier: preprocess must never reach the network.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if hasattr(datasets.config, name):
            setattr(datasets.config, name, True)
    # Our own progress bar covers encoding; datasets' "Generating train split" bars
    # would name the wrong split.
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _load_group(datasets, fmt: str, paths: list[Path], cache_dir: Path):
    if fmt == "saved":
        (path,) = paths
        loaded = datasets.load_from_disk(os.fspath(path))
        if isinstance(loaded, datasets.DatasetDict):
            raise DataError(f"{path} is a saved DatasetDict; point at one of its splits ({', '.join(loaded)})")
        return loaded
    return datasets.load_dataset(
        fmt, data_files=[os.fspath(p) for p in paths], split="train", cache_dir=os.fspath(cache_dir)
    )


def load_rows(sources: list[Source], text_column: str, cache_dir: Path) -> TextFileRows | DatasetRows:
    """The texts of one split, in input order (see data/text_rows.py).

    Uncompressed text files are read directly; anything else goes through ``datasets``.
    """
    if all(source.format == "text" and source.path.suffix.lower() not in _COMPRESSION_EXTENSIONS for source in sources):
        if text_column != "text":
            raise DataError(
                f"{sources[0].path} has no column {text_column!r}; its columns are text; pass --text-column"
            )
        return TextFileRows([source.path for source in sources])
    return DatasetRows(load_text_dataset(sources, text_column, cache_dir), text_column)


def chat_kind(columns) -> str | None:
    """ "conversations" (a messages column), "preference_pairs" (chosen/rejected), or None (text)."""
    if "messages" in columns:
        return "conversations"
    if "chosen" in columns or "rejected" in columns:
        return "preference_pairs"
    return None


class ChatRowsFound(DataError):
    """The input holds conversations or preference pairs, not a text column: preprocess reads
    them as such with --tokenizer, and refuses them (this message) without."""


def read_group(datasets, fmt: str, paths: list[Path], cache_dir: Path):
    """One ``datasets.Dataset`` of files of one format (or a saved dataset), or a one-line DataError."""
    where = paths[0] if len(paths) == 1 else f"{paths[0]} (and {len(paths) - 1} more)"
    # datasets logs a parse error before raising it; the raise becomes our one line.
    verbosity = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    try:
        return _load_group(datasets, fmt, paths, cache_dir)
    except DataError:
        raise
    except Exception as e:  # datasets wraps parse errors in many types
        cause = e.__cause__ or e
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise DataError(f"could not read {where} as {fmt}: {reason}; check the file, or pass --input-format") from e
    finally:
        datasets.utils.logging.set_verbosity(verbosity)


def load_text_dataset(sources: list[Source], text_column: str, cache_dir: Path):
    """One ``datasets.Dataset`` with a single string column ``text_column``, rows in input order.

    ``cache_dir`` receives datasets' Arrow cache (preprocess passes a temp dir inside
    destdir, so nothing lands in the user's home).
    """
    datasets = import_datasets_offline()
    # Consecutive files of one format are read by one load_dataset call (a glob over
    # 1,000 shards is one call, not 1,000); each saved dataset dir is its own call.
    groups: list[tuple[str, list[Path]]] = []
    for source in sources:
        if groups and groups[-1][0] == source.format != "saved":
            groups[-1][1].append(source.path)
        else:
            groups.append((source.format, [source.path]))
    parts = []
    for fmt, paths in groups:
        where = paths[0] if len(paths) == 1 else f"{paths[0]} (and {len(paths) - 1} more)"
        ds = read_group(datasets, fmt, paths, cache_dir)
        if text_column not in ds.column_names and chat_kind(ds.column_names):
            raise ChatRowsFound(
                f"{where} holds {chat_kind(ds.column_names).replace('_', ' ')} (columns {', '.join(ds.column_names)}), "
                "which are rendered with a model's chat template: pass --tokenizer HF_DIR (sentencepiece has none)"
            )
        if text_column not in ds.column_names:
            raise DataError(
                f"{where} has no column {text_column!r}; its columns are {', '.join(ds.column_names)}; "
                "pass --text-column"
            )
        feature = ds.features[text_column]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise DataError(
                f"column {text_column!r} of {where} holds {feature}, not text; pass --text-column naming a text column"
            )
        parts.append(ds.select_columns([text_column]))
    if len(parts) == 1:
        return parts[0]
    # concatenate_datasets needs one type; large_string holds any size.
    if len({part.features[text_column].dtype for part in parts}) > 1:
        parts = [part.cast_column(text_column, datasets.Value("large_string")) for part in parts]
    return datasets.concatenate_datasets(parts)
