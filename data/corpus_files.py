"""A corpus of jsonl, jsonl.gz, parquet and text files read as a stream, cut into chunks.

``preprocess`` encodes each chunk into one output shard (data/corpus_run.py). A chunk is a
list of pieces of input files, about ``--shard-mb`` MB of them on disk: small files are
grouped into one chunk, a large one is cut into several, so that N workers share the work
of one big file as well as of many small ones. The cuts depend only on the files and
``--shard-mb``, never on ``--workers``: the shards are the same bytes for any number of
workers.

How a file is cut:

* uncompressed text and jsonl: at byte offsets, each moved forward to just after a
  newline, so every line lies whole in one piece;
* parquet: between row groups (the unit a parquet reader reads);
* gzip: not at all. A gzip stream can only be decompressed from its start, so a worker
  given its second half would first have to decompress the first: a ``.gz`` file is one
  piece. Split a big corpus into many ``.gz`` files (as published corpora are) to spread it
  over workers.

Reading a piece never holds more than a batch of rows (``read_piece`` is a generator), so
memory stays flat however large the file. The rows are those ``datasets`` gives for the
same files (text: universal newlines, see data/text_rows.py; jsonl: one JSON object a line,
a missing or null value an empty row); an input this reader cannot take the same way (csv,
arrow, a saved dataset, a JSON array, conversations, a column that is not text) goes
through ``datasets`` as before (``streamable``).
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from data.errors import DataError
from data.iterator import grouped

# Rows per batch handed to the tokenizer and held in memory at once.
BATCH_ROWS = 1_000
_SCAN = 1 << 16  # bytes read at a time when looking for the newline after a cut


@dataclass(frozen=True)
class Piece:
    """Part of one input file: bytes [start, stop) of text/jsonl, row groups [start, stop)
    of parquet, or a whole gzip file (start 0, stop its size)."""

    path: str
    format: str  # "text" | "json" | "parquet"
    start: int
    stop: int

    def key(self) -> list:
        """What says this piece still holds the same rows: the file's path, size and
        modification time, and the range (a resumed run redoes a chunk whose key changed)."""
        stat = os.stat(self.path)
        return [self.path, self.format, self.start, self.stop, stat.st_size, stat.st_mtime_ns]


def _gzipped(path) -> bool:
    return os.fspath(path).lower().endswith(".gz")


def _first_line(path) -> bytes:
    opener = gzip.open if _gzipped(path) else open
    with opener(path, "rb") as f:
        for line in f:
            if line.strip():
                return line
    return b""


def streamable(sources, text_column: str) -> bool:
    """True when every source can be read here: text (column "text"), JSON lines whose first
    row has ``text_column`` as a string, parquet whose column is a string; uncompressed or
    gzip. Anything else is left to ``datasets``, which also words its refusals."""
    for source in sources:
        name = source.path.name.lower()
        if name.endswith((".bz2", ".xz", ".zst", ".lz4")):
            return False
        if source.format == "text":
            if text_column != "text":
                return False
        elif source.format == "json":
            try:
                row = json.loads(_first_line(source.path))
            except (ValueError, OSError):
                return False  # a JSON array, or a broken file: datasets reads or reports it
            if not isinstance(row, dict) or not isinstance(row.get(text_column, ""), str):
                return False
            if text_column not in row:
                return False
        elif source.format == "parquet" and not _gzipped(source.path):
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                schema = pq.read_schema(source.path)
            except Exception:  # pyarrow raises several types for a bad file
                return False
            if schema.get_field_index(text_column) < 0:
                return False
            kind = schema.field(text_column).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                return False
        else:
            return False
    return True


def _line_end_after(path, offset: int, size: int) -> int:
    """The offset just after the first newline at or after ``offset`` (or ``size``)."""
    with open(path, "rb") as f:
        f.seek(offset)
        while block := f.read(_SCAN):
            found = block.find(b"\n")
            if found >= 0:
                return offset + found + 1
            offset += len(block)
    return size


def plan_chunks(sources, shard_bytes: int) -> list[list[Piece]]:
    """The chunks of one split, in input order; at least one (maybe empty), so that every
    split has a shard."""
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0

    def close():
        nonlocal current, used
        chunks.append(current)
        current, used = [], 0

    for source in sources:
        path = os.fspath(source.path)
        if source.format == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            first = 0
            for group in range(meta.num_row_groups):
                used += meta.row_group(group).total_byte_size
                if used >= shard_bytes:
                    current.append(Piece(path, "parquet", first, group + 1))
                    first = group + 1
                    close()
            if first < meta.num_row_groups:
                current.append(Piece(path, "parquet", first, meta.num_row_groups))
            continue
        size = os.path.getsize(path)
        if _gzipped(path):
            current.append(Piece(path, source.format, 0, size))
            used += size
            if used >= shard_bytes:
                close()
            continue
        position = 0
        while position < size:
            cut = position + shard_bytes - used
            if cut >= size:
                current.append(Piece(path, source.format, position, size))
                used += size - position
                position = size
                if used >= shard_bytes:
                    close()
                break
            cut = _line_end_after(path, cut - 1, size)
            current.append(Piece(path, source.format, position, cut))
            position = cut
            close()
    if current or not chunks:
        close()
    return chunks


class _Range(io.RawIOBase):
    """Bytes [start, stop) of an open file, as a file of their own."""

    def __init__(self, file, start: int, stop: int):
        file.seek(start)
        self._file, self._left = file, stop - start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._left)
        if n <= 0:
            return 0
        got = self._file.readinto(memoryview(buffer)[:n])
        self._left -= got
        return got


def _open_bytes(piece: Piece, stack):
    raw = stack.enter_context(open(piece.path, "rb"))
    if _gzipped(piece.path):
        return stack.enter_context(gzip.GzipFile(fileobj=raw))
    return io.BufferedReader(_Range(raw, piece.start, piece.stop), 1 << 20)


def _text_rows(piece: Piece, stack) -> Iterator[str]:
    # newline=None: "\r\n" and "\r" end a line too, as in data/text_rows.py.
    lines = io.TextIOWrapper(_open_bytes(piece, stack), encoding="utf-8", newline=None)
    try:
        for line in lines:
            yield line[:-1] if line.endswith("\n") else line
    except UnicodeDecodeError as e:
        raise DataError(f"could not read {piece.path} as text: {e}; check the file, or pass --input-format") from None


def _json_rows(piece: Piece, column: str, stack) -> Iterator[str | None]:
    for number, line in enumerate(_open_bytes(piece, stack), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            where = _where(piece, number)
            raise DataError(f"could not read {where} as json: {e}; check the file, or pass --input-format") from None
        value = row.get(column) if isinstance(row, dict) else None
        if value is not None and not isinstance(value, str):
            raise DataError(
                f"{_where(piece, number)}: column {column!r} holds {type(value).__name__}, not text; "
                "pass --text-column naming a text column"
            )
        yield value


def _where(piece: Piece, line: int) -> str:
    """A row's place: the line within the piece, and the piece's bytes (a cut file's line
    numbers are not counted from its start)."""
    if piece.start == 0:
        return f"{piece.path} (line {line})"
    return f"{piece.path} (line {line} of bytes {piece.start}-{piece.stop})"


def _parquet_rows(piece: Piece, column: str) -> Iterator[str | None]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(piece.path) as f:
        groups = list(range(piece.start, piece.stop))
        for batch in f.iter_batches(batch_size=BATCH_ROWS, row_groups=groups, columns=[column]):
            yield from batch.column(0).to_pylist()


def read_piece(piece: Piece, column: str) -> Iterator[str | None]:
    """The rows of one piece, one at a time (None: a missing value)."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        if piece.format == "parquet":
            yield from _parquet_rows(piece, column)
        elif piece.format == "json":
            yield from _json_rows(piece, column, stack)
        else:
            yield from _text_rows(piece, stack)


def batches(pieces: list[Piece], column: str, size: int = BATCH_ROWS) -> Iterator[list]:
    """The rows of a chunk in lists of ``size``."""
    return grouped((row for piece in pieces for row in read_piece(piece, column)), size)
