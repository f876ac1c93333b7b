"""Random token blocks for benchmarks and smoke tests (fairseq's ``dummy_lm`` task)."""

from __future__ import annotations

import numpy as np

from data.errors import DataError, checked_index

# Ids below this are <s> <pad> </s> <unk>; random blocks never contain them.
_FIRST_REGULAR_ID = 4


class DummyLMDataset:
    """``num_items`` blocks of ``tokens_per_sample + 1`` uniform random ids in [4, dict_size).

    Item ``i`` depends only on ``(seed, stream, i)``, so any rank or resumed run sees the
    same block without generating the ones before it. Each split is its own stream (0:
    the training split), as fairseq's dummy_lm gives data for any split name.
    """

    def __init__(self, dict_size: int, tokens_per_sample: int, num_items: int = 100000, seed: int = 1, stream: int = 0):
        if dict_size <= _FIRST_REGULAR_ID:
            raise DataError(f"dummy data needs a dictionary larger than {_FIRST_REGULAR_ID} symbols, got {dict_size}")
        if tokens_per_sample < 1:
            raise DataError(f"--tokens-per-sample must be at least 1, got {tokens_per_sample}")
        self.dict_size = dict_size
        self.tokens_per_sample = tokens_per_sample
        self.seed = seed
        self._key = (seed,) if stream == 0 else (seed, stream)  # training's data as before splits had streams
        self.sizes = np.full(num_items, tokens_per_sample + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng((*self._key, checked_index(i, len(self.sizes), "item")))
        return rng.integers(_FIRST_REGULAR_ID, self.dict_size, size=self.tokens_per_sample + 1, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        """Targets per epoch, as for ``TokenBlockDataset``."""
        return len(self.sizes) * self.tokens_per_sample
