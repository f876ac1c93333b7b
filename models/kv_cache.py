"""The keys and values of the positions generated so far (models/generate.py)."""


class KVCache:
    """Every layer's keys and values of the positions decoded so far, in buffers allocated
    once (B×H×max_len×head_dim per layer), so that generating a token runs each layer over
    that one position instead of re-running the whole prefix. Every row is at the same
    position; models/batch_cache.py holds rows at positions of their own."""

    def __init__(self, model, batch_size=1, max_len=None):
        self.batch_size, self.max_len = batch_size, max_len or model.max_positions
        # Made by the first append, as many heads as the keys it brings: grouped-query
        # attention's kv heads only, and under tensor parallelism this process's share.
        self.k, self.v = [None] * len(model.layers), [None] * len(model.layers)
        self.length = 0  # positions stored so far = the position of the next token

    def next_positions(self, num_tokens, device):
        """(start, positions, span, mask) of the next `num_tokens` tokens, as the model's
        forward reads them: they follow the cache, every row alike, so no per-row positions
        and no mask (each layer makes the causal one)."""
        return self.length, None, num_tokens, None

    def append(self, layer, k, v):
        """Store layer `layer`'s keys/values of the new positions; return those of all so far.
        The model calls `advance` once every layer has appended."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} were asked for")
        if self.k[layer] is None:
            shape = (self.batch_size, k.shape[1], self.max_len, k.shape[3])
            self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, num_tokens):
        self.length += num_tokens
