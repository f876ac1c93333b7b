"""eval-lm's --context-window (fairseq's LMContextWindowDataset): every block is scored
with the tokens before it as unscored context, so no token is predicted from too little."""

from __future__ import annotations

import numpy as np

from data.errors import checked_index


class ContextWindowDataset:
    """(input, target) per block of ``blocks``: the block's input and targets, after the
    last ``context_window`` input tokens of the blocks before it, whose targets are pad.

    Item ``i`` reads only the blocks it needs, so items load in any order and in worker
    processes. ``sizes`` is ``len(input) + 1``, as for blocks, so batching measures inputs.
    """

    def __init__(self, blocks, context_window: int, pad: int):
        self.blocks, self.pad = blocks, pad
        inputs = np.asarray(blocks.sizes, dtype=np.int64) - 1
        before = np.concatenate([[0], np.cumsum(inputs)[:-1]]).astype(np.int64)
        self._context = np.minimum(before, context_window)
        self.sizes = np.asarray(blocks.sizes, dtype=np.int64) + self._context

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        i = checked_index(i, len(self.sizes), "block")
        item = np.asarray(self.blocks[i], dtype=np.int64)
        context, need, j = [], int(self._context[i]), i
        while need > 0:
            j -= 1
            before = np.asarray(self.blocks[j], dtype=np.int64)[:-1][-need:]
            context.insert(0, before)
            need -= len(before)
        context = np.concatenate(context) if context else np.zeros(0, dtype=np.int64)
        return np.concatenate([context, item[:-1]]), np.concatenate([np.full(len(context), self.pad), item[1:]])
