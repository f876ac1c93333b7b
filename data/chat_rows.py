"""The rows of a conversations or preference-pairs split, read through ``datasets``.

Each file is read on its own (not one ``load_dataset`` call per glob, as for text) so that a
bad row can be named by its file and its 0-based row there; and because files of one
dataset may give their messages different struct types (a key one file lacks), which
``concatenate_datasets`` would refuse.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from pathlib import Path

from data.errors import DataError
from data.iterator import grouped
from data.sources import Source, chat_kind, import_datasets_offline, read_group

PAIR_COLUMNS = ("prompt", "chosen", "rejected")


class ChatRows:
    """Rows of one split: a conversation's ``messages`` list, or a ``(prompt, chosen, rejected)``."""

    def __init__(self, kind: str, parts: list[tuple[Path, object]]):
        self.kind = kind
        self.parts = parts
        self.starts = []  # first row of each file, in the split's numbering
        total = 0
        for _, dataset in parts:
            self.starts.append(total)
            total += len(dataset)
        self._rows = total

    def __len__(self) -> int:
        return self._rows

    def files(self) -> list[tuple[int, str]]:
        """(first row, file) of each input file: what workers need to name a bad row."""
        return [(start, str(path)) for start, (path, _) in zip(self.starts, self.parts, strict=True)]

    def batches(self, size: int) -> Iterator[list]:
        return grouped(self._each_row(size), size)

    def _each_row(self, read_size: int) -> Iterator:
        """Every row, read ``read_size`` at a time."""
        for _, dataset in self.parts:
            for lo in range(0, len(dataset), read_size):
                columns = dataset[lo : lo + read_size]
                if self.kind == "conversations":
                    yield from columns["messages"]
                else:
                    yield from zip(*(columns[name] for name in PAIR_COLUMNS), strict=True)


def row_name(files: list[tuple[int, str]], row: int) -> str:
    """'row 12 of FILE' (0-based, within that file) for the split's row ``row``."""
    k = bisect.bisect_right([start for start, _ in files], row) - 1
    start, path = files[k]
    return f"row {row - start} (0-based) of {path}"


def load_chat_rows(sources: list[Source], cache_dir: Path) -> ChatRows:
    """A split's conversations or preference pairs; every file must hold the same kind."""
    datasets = import_datasets_offline()
    parts, kind = [], None
    for source in sources:
        dataset = read_group(datasets, source.format, [source.path], cache_dir)
        found = chat_kind(dataset.column_names)
        if found is None or (kind is not None and found != kind):
            expected = kind or "conversations or preference pairs"
            raise DataError(
                f"{source.path} has columns {', '.join(dataset.column_names)}, not {expected.replace('_', ' ')} like "
                "the other inputs; give every input of a preprocess run the same kind of rows"
            )
        kind = found
        if kind == "preference_pairs":
            missing = [name for name in PAIR_COLUMNS if name not in dataset.column_names]
            if missing:
                raise DataError(
                    f"{source.path} has preference pairs without a {', '.join(missing)} column; give every row "
                    "prompt, chosen and rejected (TRL's explicit-prompt format)"
                )
        parts.append((source.path, dataset))
    return ChatRows(kind, parts)
