"""Keys and values of a batch of sequences, each at a length of its own (continuous batching).

A serving engine decodes many requests together: one forward a step runs every active row
over its next token. Rows start and end at different times, so each has its own position
(its positional table row, its rotary angles) and attends only to its own cached keys: the
slots past its length hold another request's leftovers or nothing, and a mask hides them.

Active rows are kept packed at the front of the buffers (rows 0 … size-1), so a step's keys
are a view of the buffers, never a gathered copy; a row that leaves is filled by the last one.
"""

import torch


class BatchKVCache:
    """Every layer's keys/values of up to `max_batch` sequences (max_batch×H×max_len×head_dim
    per layer, allocated once), and each row's length."""

    def __init__(self, model, max_batch, max_len=None):
        self.max_batch, self.max_len = max_batch, max_len or model.max_positions
        # Made by each layer's first append, as many heads as its keys: grouped-query
        # attention's kv heads only, and under tensor parallelism this process's share.
        self.k, self.v = [None] * len(model.layers), [None] * len(model.layers)
        self.lengths = []  # positions stored in each active row

    @staticmethod
    def bytes_needed(model, max_batch, max_len):
        """What the buffers take for `model` (its weights' dtype), in bytes, all heads held."""
        layer = model.layers[0]
        per_row = layer.num_kv_heads * max_len * layer.head_dim * layer.out_proj.weight.element_size()
        return 2 * len(model.layers) * max_batch * per_row

    @property
    def size(self):
        return len(self.lengths)

    def add_row(self):
        """A new empty row (its index); fill it with `rows(i, i + 1)` and a forward."""
        if self.size == self.max_batch:
            raise ValueError(f"the batch holds {self.max_batch} sequences; all are in use")
        self.lengths.append(0)
        return self.size - 1

    def remove_row(self, row):
        """Free `row`: the last row moves into it (its index becomes `row`), nothing else moves."""
        last = self.size - 1
        if row != last:
            n = self.lengths[last]
            for buffers in (self.k, self.v):
                for b in buffers:
                    if b is not None:
                        b[row, :, :n] = b[last, :, :n]
            self.lengths[row] = n
        self.lengths.pop()

    def rows(self, start, stop):
        """The cache of rows start … stop-1, as the model's forward takes a cache."""
        return CacheRows(self, start, stop)


class CacheRows:
    """A contiguous run of a BatchKVCache's rows, which one forward extends by T tokens each."""

    def __init__(self, cache, start, stop):
        self.cache, self.start, self.stop = cache, start, stop
        self.lengths = cache.lengths[start:stop]

    def next_positions(self, num_tokens, device):
        """(start, positions, span, mask) for the model's forward: each row's next positions
        (B×T), the table rows they need, and the B×1×T×L mask letting a row's query t see
        its own cached keys and its new ones up to t — L the longest row's length after them."""
        span = max(self.lengths) + num_tokens
        if span > self.cache.max_len:
            raise ValueError(f"KV cache holds {self.cache.max_len} positions; {span} were asked for")
        lengths = torch.tensor(self.lengths, device=device)
        positions = lengths[:, None] + torch.arange(num_tokens, device=device)
        self._positions = positions
        self._row_ids = torch.arange(self.start, self.stop, device=device)[:, None]
        if min(self.lengths) == max(self.lengths):  # no padded slots: the layers' causal mask (or none) will do
            return 0, positions, span, None
        mask = torch.arange(span, device=device) <= positions[:, :, None]  # B×T×L
        return 0, positions, span, mask[:, None]

    def append(self, layer, k, v):
        """Store layer `layer`'s keys/values (B×H×T×D) at each row's next positions; return
        the rows' keys/values up to the longest row's new length (a view of the buffers)."""
        cache = self.cache
        if cache.k[layer] is None:
            shape = (cache.max_batch, k.shape[1], cache.max_len, k.shape[3])
            cache.k[layer], cache.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        self.cache.k[layer][self._row_ids, :, self._positions] = k.transpose(1, 2)
        self.cache.v[layer][self._row_ids, :, self._positions] = v.transpose(1, 2)
        end = max(self.lengths) + k.shape[2]
        rows = slice(self.start, self.stop)
        return self.cache.k[layer][rows, :, :end], self.cache.v[layer][rows, :, :end]

    def advance(self, num_tokens):
        for i in range(self.start, self.stop):
            self.cache.lengths[i] += num_tokens
