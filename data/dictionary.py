"""fairseq's ``dict.txt`` vocabulary, so data dirs made by ``fairseq-preprocess`` train as-is."""

from __future__ import annotations

import os
from pathlib import Path

from data.errors import DataError

_OVERWRITE_FLAG = "#fairseq:overwrite"


class Dictionary:
    """Symbols ``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3, then one per line of dict.txt."""

    def __init__(self):
        self.symbols: list[str] = []
        self.counts: list[int] = []
        self.indices: dict[str, int] = {}
        for special in ("<s>", "<pad>", "</s>", "<unk>"):
            self._add(special, 1)

    def _add(self, symbol: str, count: int) -> int:
        self.indices[symbol] = len(self.symbols)
        self.symbols.append(symbol)
        self.counts.append(count)
        return self.indices[symbol]

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Dictionary":
        """Read ``"<symbol> <count>"`` lines (fairseq's format, overwrite flag included)."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"missing {path}; point at a fairseq data dir that has dict.txt")
        d = cls()
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                symbol, _, field = line.rstrip().rpartition(" ")
                overwrite = field == _OVERWRITE_FLAG
                if overwrite:
                    symbol, _, field = symbol.rpartition(" ")
                if not symbol or not field.lstrip("-").isdigit():
                    raise DataError(
                        f"{path}:{lineno}: expected '<symbol> <count>', got {line!r}; "
                        "fix the line or regenerate dict.txt with fairseq-preprocess"
                    )
                # Like fairseq: a repeated symbol is an error unless flagged, and a
                # flagged one gets a new id (the old id keeps its slot).
                if symbol in d.indices and not overwrite:
                    raise DataError(
                        f"{path}:{lineno}: duplicate symbol {symbol!r}; remove it or add "
                        f"'{_OVERWRITE_FLAG}' to the line"
                    )
                d._add(symbol, int(field))
        return d

    def __len__(self) -> int:
        return len(self.symbols)

    def __getitem__(self, i: int) -> str:
        return self.symbols[i]

    def __contains__(self, symbol: str) -> bool:
        return symbol in self.indices

    def bos(self) -> int:
        return 0

    def pad(self) -> int:
        return 1

    def eos(self) -> int:
        return 2

    def unk(self) -> int:
        return 3

    def index(self, symbol: str) -> int:
        """The id of ``symbol``, or ``unk()`` when it is not in the dictionary."""
        return self.indices.get(symbol, self.unk())

    def string(self, ids) -> str:
        """Space-joined symbols of ``ids``.

        Skips ``<pad>``, and ``<s>``/``</s>`` as fairseq's ``Dictionary.string`` does by
        default, so the result reads like the text that was encoded; it does not stop at
        the first ``</s>``.
        """
        skip = {self.bos(), self.pad(), self.eos()}
        return " ".join(self.symbols[int(i)] for i in ids if int(i) not in skip)
