"""A decoder-only transformer language model with fairseq's transformer_lm options.

Reads top to bottom: embeddings → N decoder layers → final norm → output projection.
It holds no parallelism: sharding, activation checkpointing and mixed precision are
applied from the outside by trainer/parallel/parallelize.py, one `DecoderLayer` at a time.
Generation passes a `KVCache` so each new token runs each layer over one position only.
"""
import math
import zlib
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.cpu_attention import causal_matmul_attention, use_matmul_attention
from models.linear_cross_entropy import linear_cross_entropy

ACTIVATION_FNS = {
    "relu": F.relu,
    "relu_squared": lambda x: F.relu(x).pow(2),  # Primer (So et al., 2021), as fairseq
    "gelu": F.gelu,
    "gelu_fast": partial(F.gelu, approximate="tanh"),  # fairseq's old name of gelu_accurate
    "gelu_accurate": partial(F.gelu, approximate="tanh"),
    "tanh": torch.tanh,
    "linear": lambda x: x,
    "swish": F.silu,
}


def _dropout(x, p, training):
    # Skip the op entirely at p=0: it still costs a pass over x in training mode.
    return F.dropout(x, p, training) if training and p > 0 else x


class DecoderLayer(nn.Module):
    """Causal self-attention + feed-forward, each in a residual branch (pre-LN by default)."""

    def __init__(self, cfg):
        super().__init__()
        d, ffn = cfg.decoder_embed_dim, cfg.decoder_ffn_embed_dim
        self.num_heads = cfg.decoder_attention_heads
        self.normalize_before = cfg.decoder_normalize_before
        self.dropout, self.attention_dropout = cfg.dropout, cfg.attention_dropout
        self.activation_dropout = cfg.activation_dropout
        self.activation_fn = ACTIVATION_FNS[cfg.activation_fn]
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.qkv_proj = nn.Linear(d, 3 * d)  # one matmul for q, k and v
        self.out_proj = nn.Linear(d, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)

    def attention(self, x, cache=None):
        B, T, C = x.shape
        q, k, v = self.qkv_proj(x).view(B, T, 3, self.num_heads, C // self.num_heads).transpose(1, 3).unbind(2)
        # Right padding only: a causal mask already keeps every real token off the pads.
        mask, causal = None, True
        if cache is not None:
            # Incremental decoding: the new positions attend to every cached one and causally
            # among themselves. is_causal would align the mask top-left (wrong once the cache
            # holds anything), so say it explicitly; a single new token sees all: no mask.
            k, v = cache(k, v)
            start = k.shape[2] - T
            mask = None if T == 1 else torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
            causal = False
        dropout_p = self.attention_dropout if self.training else 0.0
        if causal and use_matmul_attention(q, dropout_p):
            y = causal_matmul_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))

    def feed_forward(self, x):
        x = _dropout(self.activation_fn(self.fc1(x)), self.activation_dropout, self.training)
        return self.fc2(x)

    def forward(self, x, cache=None):
        """cache: this layer's `KVCache.append` (generation only); None in training."""
        attention = self.attention if cache is None else partial(self.attention, cache=cache)
        for norm, sublayer in ((self.self_attn_layer_norm, attention),
                               (self.final_layer_norm, self.feed_forward)):
            h = sublayer(norm(x) if self.normalize_before else x)
            x = x + _dropout(h, self.dropout, self.training)
            if not self.normalize_before:
                x = norm(x)
        return x


def sinusoidal_positions(num_positions, dim, device, dtype, start=0):
    """fairseq's sinusoidal table: sin on the first half of the channels, cos on the second.
    Rows for positions start … start+num_positions-1 (start > 0 when decoding after a cache)."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=device, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
    angles = torch.arange(start, start + num_positions, device=device, dtype=torch.float32)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = F.pad(table, (0, 1))
    return table.to(dtype)


class KVCache:
    """Every layer's keys and values of the positions decoded so far, in buffers allocated
    once (B×H×max_len×head_dim per layer), so that generating a token runs each layer over
    that one position instead of re-running the whole prefix."""

    def __init__(self, model, batch_size=1, max_len=None):
        p = model.embed_tokens.weight
        heads = model.layers[0].num_heads
        self.max_len = max_len or model.max_positions
        shape = (batch_size, heads, self.max_len, p.shape[1] // heads)
        self.k = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in model.layers]
        self.v = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in model.layers]
        self.length = 0  # positions stored so far = the position of the next token

    def append(self, layer, k, v):
        """Store layer `layer`'s keys/values of the new positions; return those of all so far.
        The model advances `length` once every layer has appended."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} were asked for")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class TransformerLM(nn.Module):
    def __init__(self, cfg, vocab_size, max_positions, padding_idx=1):
        super().__init__()
        d = cfg.decoder_embed_dim
        self.vocab_size, self.max_positions, self.padding_idx = vocab_size, max_positions, padding_idx
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(d)
        self.dropout = cfg.dropout
        self.positions = None if cfg.no_token_positional_embeddings else (
            "learned" if cfg.decoder_learned_pos else "sinusoidal")
        self.embed_tokens = nn.Embedding(vocab_size, d, padding_idx=padding_idx)
        self.embed_positions = nn.Embedding(max_positions, d) if self.positions == "learned" else None
        self.layernorm_embedding = nn.LayerNorm(d) if cfg.layernorm_embedding else None
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        final_norm = cfg.decoder_normalize_before and not cfg.no_decoder_final_norm
        self.layer_norm = nn.LayerNorm(d) if final_norm else None
        self.output_projection = None if cfg.share_decoder_input_output_embed else nn.Linear(d, vocab_size, bias=False)
        self._param_kinds = self._kinds()

    @torch.no_grad()
    def init_parameter(self, name, tensor, seed):
        """Fill `tensor` with parameter `name`'s initial value (fairseq's init).

        Each parameter draws from its own generator, seeded by (seed, name), so its
        value does not depend on which other parameters were initialized before it —
        a rank holding only shards can recreate exactly what one process would."""
        g = torch.Generator(device=tensor.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        d = self.embed_tokens.embedding_dim
        kind = self._param_kinds[name]
        if kind == "embedding":
            tensor.normal_(0.0, d ** -0.5, generator=g)
            if name == "embed_tokens.weight":
                tensor[self.padding_idx].zero_()
        elif kind == "linear":
            nn.init.xavier_uniform_(tensor, generator=g)
        elif kind == "norm_weight":
            tensor.fill_(1.0)
        else:  # biases
            tensor.zero_()

    def init_weights(self, seed=1):
        for name, p in self.named_parameters():
            self.init_parameter(name, p.data, seed)

    def _kinds(self):
        kinds = {"embed_tokens.weight": "embedding"}
        if self.embed_positions is not None:
            kinds["embed_positions.weight"] = "embedding"
        if self.output_projection is not None:
            kinds["output_projection.weight"] = "embedding"  # N(0, d^-0.5), like the tied table
        for mname, module in self.named_modules():
            prefix = mname + "." if mname else ""
            if isinstance(module, nn.Linear) and module is not self.output_projection:
                kinds[prefix + "weight"], kinds[prefix + "bias"] = "linear", "bias"
            elif isinstance(module, nn.LayerNorm):
                kinds[prefix + "weight"], kinds[prefix + "bias"] = "norm_weight", "bias"
        return kinds

    def embed(self, tokens, start=0):
        """start: the first token's position (the cache's length when decoding incrementally)."""
        T = tokens.shape[1]
        if start + T > self.max_positions:
            raise ValueError(f"sequence of {start + T} tokens exceeds the model's {self.max_positions} positions")
        x = self.embed_scale * self.embed_tokens(tokens)
        if self.positions == "learned":
            x = x + self.embed_positions(torch.arange(start, start + T, device=tokens.device))
        elif self.positions == "sinusoidal":
            x = x + sinusoidal_positions(T, x.shape[-1], x.device, x.dtype, start)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return _dropout(x, self.dropout, self.training)

    def forward(self, tokens, cache=None, target=None):
        """tokens: B×T token ids → B×T×V logits. With a `KVCache`, tokens are the next T
        positions after those cached: they are appended to it and attend to all of them.
        With `target` (B×T ids; padding_idx is ignored), the summed cross-entropy in nats
        instead, computed without ever holding the B×T×V logits (training)."""
        if cache is None:  # training, and generation without a cache
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
        else:
            x = self.embed(tokens, cache.length)
            for i, layer in enumerate(self.layers):
                x = layer(x, cache=partial(cache.append, i))
            cache.length += tokens.shape[1]
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        if target is not None:
            return self.loss(x, weight, target)
        return F.linear(x, weight)

    def loss(self, x, weight, target):
        device = x.device.type
        if torch.is_autocast_enabled(device):  # the op runs outside autocast: cast as it would
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
        with torch.autocast(device, enabled=False):
            return linear_cross_entropy(x, weight, target, ignore_index=self.padding_idx)


def build_model(cfg, vocab_size, max_positions, device=None, padding_idx=1, seed=1):
    """Build and initialize on `device`; device="meta" allocates nothing and initializes
    nothing (to count, or to shard first and initialize each shard after)."""
    with torch.device(device or "cpu"):
        model = TransformerLM(cfg, vocab_size, max_positions, padding_idx)
    if torch.device(device or "cpu").type != "meta":
        model.init_weights(seed)
    return model


def num_parameters(model):
    # Tied weights are one Parameter, so counting unique parameters counts them once.
    return sum(p.numel() for p in model.parameters())
