"""The rows preprocess encodes: lines of plain-text files, or one column of a ``datasets`` table.

Both kinds answer ``len()`` and ``batches(size)`` (lists of strings, in input order), which
is all that training sentencepiece and encoding need.

Plain text is read here, line by line, the way fairseq-preprocess reads it, because
importing ``datasets`` and building an Arrow cache of the file cost time and buy nothing
for lines. The rows are exactly those of ``datasets``' "text" builder: universal newlines
(``\\r\\n`` and ``\\r`` end a line too), the newline dropped, a blank line is an empty row,
no row after a final newline, strict UTF-8 (tests/test_preprocess.py compares the two on
such a file).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from data.errors import DataError

_READ_CHARS = 1 << 24


def _count_lines(path: Path) -> int:
    """Rows in one text file; reading it whole here also finds bad UTF-8 before any work."""
    count, last = 0, "\n"
    try:
        with open(path, encoding="utf-8") as f:
            while block := f.read(_READ_CHARS):
                count += block.count("\n")
                last = block[-1]
    except UnicodeDecodeError as e:
        raise DataError(f"could not read {path} as text: {e}; check the file, or pass --input-format") from e
    return count + (last != "\n")


class TextFileRows:
    """The lines of uncompressed UTF-8 text files, in order, as one sequence of rows."""

    def __init__(self, paths: list[Path]):
        self.paths = list(paths)
        self._rows = sum(_count_lines(path) for path in self.paths)

    def __len__(self) -> int:
        return self._rows

    def batches(self, size: int) -> Iterator[list[str]]:
        batch: list[str] = []
        for path in self.paths:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    batch.append(line[:-1] if line.endswith("\n") else line)
                    if len(batch) == size:
                        yield batch
                        batch = []
        if batch:
            yield batch


class DatasetRows:
    """One string column of a ``datasets.Dataset`` (json, parquet, csv, arrow, saved, compressed)."""

    def __init__(self, dataset, column: str):
        self.dataset = dataset
        self.column = column

    def __len__(self) -> int:
        return len(self.dataset)

    def batches(self, size: int) -> Iterator[list]:
        for start in range(0, len(self.dataset), size):
            yield self.dataset[start : start + size][self.column]
