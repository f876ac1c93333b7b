"""fairseq's memory-mapped indexed dataset (MMIDIDX), which is also shardlm's token file format.

A dataset is two files beside each other:

* ``<prefix>.bin``: every sequence's token ids, concatenated, in one integer dtype.
* ``<prefix>.idx``: magic ``b"MMIDIDX\\x00\\x00"``, ``<Q`` version (1), ``<B`` dtype code,
  ``<Q`` count, then ``int32 sizes[count]`` (tokens per sequence) and
  ``int64 pointers[count]`` (byte offset of each sequence in ``.bin``).

Keeping fairseq's exact layout means ``fairseq-preprocess`` output and ours are read by
the same code, and ours can be read by fairseq.
"""

from __future__ import annotations

import itertools
import os
import struct
from pathlib import Path

import numpy as np

from data.errors import DataError, checked_index

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
# "<9sQBQ": magic, version, dtype code, count
_HEADER = struct.Struct("<9sQBQ")

# fairseq's codes (fairseq/data/indexed_dataset.py::_code_to_dtype); 6 and 7 are both
# float64 there too.
_CODE_TO_DTYPE = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.double),
    8: np.dtype(np.uint16),
    9: np.dtype(np.uint32),
    10: np.dtype(np.uint64),
}


def _dtype_code(dtype: np.dtype) -> int:
    for code, known in _CODE_TO_DTYPE.items():
        if known == dtype:
            return code
    raise DataError(f"token dtype {dtype} has no MMIDIDX code; use one of uint16, uint32, int64")


def best_fitting_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype fairseq would use for ``vocab_size`` ids (same thresholds)."""
    if vocab_size < 65500:
        return np.dtype(np.uint16)
    if vocab_size < 2**32 - 1:
        return np.dtype(np.uint32)
    return np.dtype(np.int64)


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def exists(prefix: str | os.PathLike) -> bool:
    """True when both ``<prefix>.idx`` and ``<prefix>.bin`` exist."""
    return idx_path(prefix).is_file() and bin_path(prefix).is_file()


class IndexedDatasetBuilder:
    """Writes one MMIDIDX dataset, sequence by sequence.

    Tokens go to a temporary file beside the target; ``finalize()`` renames it to
    ``<prefix>.bin`` and only then writes ``<prefix>.idx``, so a crash never leaves a
    pair of files that looks valid but is half written.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        _dtype_code(self.dtype)  # fail now, not at finalize
        self._tmp_bin = Path(f"{bin_path(prefix)}.tmp-{os.getpid()}")
        self._file = open(self._tmp_bin, "wb")
        # Chunks of sizes (int32 arrays) rather than one list of ints, so merging a
        # million-sequence shard is one append.
        self._sizes: list[np.ndarray] = []

    def add_item(self, array) -> None:
        tokens = np.asarray(array)
        if tokens.ndim != 1:
            raise DataError(f"add_item expects a 1-D array of token ids, got shape {tokens.shape}")
        self._file.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(np.array([tokens.size], dtype=np.int32))

    def add_items(self, sequences) -> None:
        """Append many sequences (lists of ids) at once: one write, one sizes array."""
        sizes = np.fromiter(map(len, sequences), dtype=np.int32, count=len(sequences))
        flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype=self.dtype, count=int(sizes.sum()))
        self._file.write(flat.tobytes(order="C"))
        self._sizes.append(sizes)

    def merge_file(self, other_prefix: str | os.PathLike) -> None:
        """Append every sequence of another finished dataset (a worker's shard), in order."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"cannot merge {bin_path(other_prefix)} ({other.dtype}) into a {self.dtype} "
                "dataset; re-run preprocess so all shards use one dtype"
            )
        self._sizes.append(np.array(other.sizes, dtype=np.int32))
        with open(bin_path(other_prefix), "rb") as src:
            while chunk := src.read(1 << 24):
                self._file.write(chunk)

    def finalize(self) -> None:
        self._file.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        tmp_idx = Path(f"{idx_path(self.prefix)}.tmp-{os.getpid()}")
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, _VERSION, _dtype_code(self.dtype), len(sizes)))
            f.write(sizes.astype("<i4").tobytes(order="C"))
            f.write(pointers.astype("<i8").tobytes(order="C"))
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(tmp_idx, idx_path(self.prefix))

    def discard(self) -> None:
        """Drop what was written (after an error), leaving no files behind."""
        self._file.close()
        self._tmp_bin.unlink(missing_ok=True)


def _memmap(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    # np.memmap refuses zero-length maps (an empty split is legal).
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


class IndexedDataset:
    """Read-only, memory-mapped view of an MMIDIDX dataset; ``ds[i]`` is sequence ``i``."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        self._open()

    def _open(self) -> None:
        idx, bin_ = idx_path(self.prefix), bin_path(self.prefix)
        for path in (idx, bin_):
            if not path.is_file():
                raise DataError(f"missing {path}; run preprocess to create {self.prefix}.idx/.bin")
        rerun = "re-run preprocess to rebuild it"
        idx_bytes = idx.stat().st_size
        with open(idx, "rb") as f:
            header = f.read(_HEADER.size)
        if len(header) < _HEADER.size or not header.startswith(_MAGIC):
            raise DataError(f"{idx} is not an MMIDIDX index (bad magic or too short); {rerun}")
        _, version, code, count = _HEADER.unpack(header)
        if version != _VERSION:
            raise DataError(f"{idx} has index version {version}, only {_VERSION} is supported; {rerun}")
        if code not in _CODE_TO_DTYPE:
            raise DataError(f"{idx} has unknown dtype code {code}; {rerun}")
        if idx_bytes < _HEADER.size + count * 12:
            raise DataError(f"{idx} is truncated ({idx_bytes} bytes for {count} sequences); {rerun}")
        self.dtype = _CODE_TO_DTYPE[code]
        # Plain ndarray views of the maps: arithmetic on them then yields plain arrays.
        self.sizes = _memmap(idx, np.dtype("<i4"), _HEADER.size, count).view(np.ndarray)
        self.pointers = _memmap(idx, np.dtype("<i8"), _HEADER.size + count * 4, count).view(np.ndarray)

        bin_bytes = bin_.stat().st_size
        itemsize = self.dtype.itemsize
        if bin_bytes % itemsize:
            raise DataError(f"{bin_} is truncated ({bin_bytes} bytes is not a whole number of {self.dtype}); {rerun}")
        if count:
            ends = self.pointers + self.sizes.astype(np.int64) * itemsize
            bad = (self.sizes < 0) | (self.pointers < 0) | (self.pointers % itemsize != 0) | (ends > bin_bytes)
            if bad.any():
                first = int(np.argmax(bad))
                raise DataError(
                    f"{bin_} is truncated or does not match {idx.name} (sequence {first} ends at byte "
                    f"{int(ends[first])}, file has {bin_bytes}); {rerun}"
                )
        self.tokens = _memmap(bin_, self.dtype, 0, bin_bytes // itemsize)
        self._starts = self.pointers // itemsize

    # Pickle by path, so DataLoader workers re-map the files instead of copying them.
    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        i = checked_index(i, len(self.sizes), "sequence", where=f" in {self.prefix}")
        start = int(self._starts[i])
        return np.asarray(self.tokens[start : start + int(self.sizes[i])])

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def is_contiguous(self) -> bool:
        """True when the sequences lie back to back in index order (as every builder writes them)."""
        expected = np.zeros(len(self.sizes), dtype=np.int64)
        if len(expected) > 1:
            np.cumsum(self.sizes[:-1].astype(np.int64), out=expected[1:])
        return bool(np.array_equal(expected, self._starts))
