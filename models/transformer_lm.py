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

from models.adaptive import AdaptiveInput, AdaptiveSoftmax
from models.config import num_layers
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
    """Causal self-attention + feed-forward, each in a residual branch (pre-LN by default).

    NormFormer (Shleifer et al., 2021), placed as fairseq's TransformerDecoderLayerBase
    places it: --scale-heads scales each head's slice of the attention block's output and
    --scale-attn normalizes that output (both after out_proj, where fairseq applies them),
    --scale-fc normalizes the feed-forward's hidden activations, --scale-resids scales the
    feed-forward residual per channel."""

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
        # getattr: off in configs without them, as fairseq's safe_getattr reads them
        self.c_attn = nn.Parameter(torch.ones(self.num_heads)) if getattr(cfg, "scale_heads", False) else None
        self.attn_ln = nn.LayerNorm(d) if getattr(cfg, "scale_attn", False) else None
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn)
        self.ffn_layernorm = nn.LayerNorm(ffn) if getattr(cfg, "scale_fc", False) else None
        self.fc2 = nn.Linear(ffn, d)
        self.w_resid = nn.Parameter(torch.ones(d)) if getattr(cfg, "scale_resids", False) else None

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
        y = self.out_proj(y.transpose(1, 2).reshape(B, T, C))
        if self.c_attn is not None:
            y = (y.view(B, T, self.num_heads, C // self.num_heads) * self.c_attn[:, None]).view(B, T, C)
        return y if self.attn_ln is None else self.attn_ln(y)

    def feed_forward(self, x):
        x = _dropout(self.activation_fn(self.fc1(x)), self.activation_dropout, self.training)
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        return self.fc2(x)

    def forward(self, x, cache=None):
        """cache: this layer's `KVCache.append` (generation only); None in training."""
        attention = self.attention if cache is None else partial(self.attention, cache=cache)
        for norm, sublayer, scale in ((self.self_attn_layer_norm, attention, None),
                                      (self.final_layer_norm, self.feed_forward, self.w_resid)):
            h = sublayer(norm(x) if self.normalize_before else x)
            x = (x if scale is None else scale * x) + _dropout(h, self.dropout, self.training)
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
        p = model.layers[0].out_proj.weight  # d×d (an adaptive input has no single table)
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
        if cfg.adaptive_input:  # narrower tables for rarer tokens, each projected to d (models/adaptive.py)
            self.embed_tokens = AdaptiveInput(vocab_size, padding_idx, cfg.decoder_input_dim or d,
                                              cfg.adaptive_input_factor, d, cfg.adaptive_input_cutoff)
        else:
            self.embed_tokens = nn.Embedding(vocab_size, cfg.decoder_input_dim or d, padding_idx=padding_idx)
        # fairseq's project_in_dim / project_out_dim: embeddings (--decoder-input-dim) and the
        # output projection's input (--decoder-output-dim) of another width than the layers.
        width_in = self.embed_tokens.embedding_dim
        self.project_in_dim = nn.Linear(width_in, d, bias=False) if width_in != d else None
        self.embed_positions = nn.Embedding(max_positions, d) if self.positions == "learned" else None
        self.layernorm_embedding = nn.LayerNorm(d) if cfg.layernorm_embedding else None
        # --decoder-layers-to-keep builds only those (renumbered from 0), as fairseq does.
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(num_layers(cfg)))
        self.layerdrop = cfg.decoder_layerdrop
        final_norm = cfg.decoder_normalize_before and not cfg.no_decoder_final_norm
        self.layer_norm = nn.LayerNorm(d) if final_norm else None
        width_out = cfg.decoder_output_dim or d
        # fairseq: a tied adaptive softmax takes the layers' width (no projection).
        self.project_out_dim = (nn.Linear(d, width_out, bias=False)
                                if width_out != d and not cfg.tie_adaptive_weights else None)
        self.adaptive_softmax = None
        if cfg.adaptive_softmax_cutoff is not None:  # replaces the output projection
            self.adaptive_softmax = AdaptiveSoftmax(
                vocab_size, cfg.decoder_output_dim or d, cfg.adaptive_softmax_cutoff, cfg.adaptive_softmax_dropout,
                cfg.adaptive_softmax_factor, self.embed_tokens if cfg.tie_adaptive_weights else None,
                cfg.tie_adaptive_proj)
        self.output_projection = (None if cfg.share_decoder_input_output_embed or self.adaptive_softmax is not None
                                  else nn.Linear(width_out, vocab_size, bias=False))
        self._param_kinds = self._kinds()

    @torch.no_grad()
    def init_parameter(self, name, tensor, seed):
        """Fill `tensor` with parameter `name`'s initial value (fairseq's init).

        Each parameter draws from its own generator, seeded by (seed, name), so its
        value does not depend on which other parameters were initialized before it —
        a rank holding only shards can recreate exactly what one process would."""
        g = torch.Generator(device=tensor.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        kind = self._param_kinds[name]
        if kind == "embedding":  # N(0, width^-0.5): tokens, learned positions, output projection
            tensor.normal_(0.0, tensor.shape[1] ** -0.5, generator=g)
            if name == "embed_tokens.weight":
                tensor[self.padding_idx].zero_()
        elif kind == "adaptive_embedding":  # fairseq's AdaptiveInput: N(0, width^-0.5), the pad row 0
            tensor.normal_(0.0, tensor.shape[1] ** -0.5, generator=g)
            if name == "embed_tokens.embeddings.0.0.weight":
                tensor[self.padding_idx].zero_()
        elif kind == "linear":
            nn.init.xavier_uniform_(tensor, generator=g)
        elif kind in ("norm_weight", "scale"):  # NormFormer's scales start at 1, as fairseq's
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
        if isinstance(self.embed_tokens, AdaptiveInput):  # its tables; its projections are Linear (below)
            for i in range(len(self.embed_tokens.bands)):
                kinds[f"embed_tokens.embeddings.{i}.0.weight"] = "adaptive_embedding"
        for mname, module in self.named_modules():
            prefix = mname + "." if mname else ""
            if isinstance(module, DecoderLayer):
                kinds[prefix + "c_attn"] = kinds[prefix + "w_resid"] = "scale"
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
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if self.positions == "learned":
            x = x + self.embed_positions(torch.arange(start, start + T, device=tokens.device))
        elif self.positions == "sinusoidal":
            x = x + sinusoidal_positions(T, x.shape[-1], x.device, x.dtype, start)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return _dropout(x, self.dropout, self.training)

    def layerdrop_layers(self, seed):
        """LayerDrop (fairseq's LayerDropModuleList): the ids of the layers one training
        forward runs, each kept when its uniform draw exceeds --decoder-layerdrop. The draws
        come from a generator seeded with `seed` alone, so every rank given the same seed
        runs the same layers: sharded and replicated runs, and one process, compute the
        same update, and no rank waits in a collective for a layer its peers skip.
        None when nothing is dropped."""
        if self.layerdrop == 0:
            return None
        draws = torch.rand(len(self.layers), generator=torch.Generator().manual_seed(seed), device="cpu")
        return [i for i, u in enumerate(draws.tolist()) if u > self.layerdrop]

    def forward(self, tokens, cache=None, target=None, layers=None, softmax_batch=None):
        """tokens: B×T token ids → B×T×V logits. With a `KVCache`, tokens are the next T
        positions after those cached: they are appended to it and attend to all of them.
        With `target` (B×T ids; padding_idx is ignored), the summed cross-entropy in nats
        instead, computed without ever holding the B×T×V logits (training).
        layers: in training, the ids of the layers to run (`layerdrop_layers`); None, and
        always in eval mode, runs them all. softmax_batch: with `target`, score at most this
        many tokens' output distributions at a time (eval-lm's --softmax-batch)."""
        if cache is None:  # training, and generation without a cache
            x = self.embed(tokens)
            for i in range(len(self.layers)) if layers is None or not self.training else layers:
                x = self.layers[i](x)
        else:
            x = self.embed(tokens, cache.length)
            for i, layer in enumerate(self.layers):
                x = layer(x, cache=partial(cache.append, i))
            cache.length += tokens.shape[1]
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        if target is not None and softmax_batch:
            x, target = x.reshape(-1, x.shape[-1]), target.reshape(-1)
            return sum(self.output_loss(x[i:i + softmax_batch], target[i:i + softmax_batch])
                       for i in range(0, len(target), softmax_batch))
        if target is not None:
            return self.output_loss(x, target)
        if self.adaptive_softmax is not None:  # log-probabilities serve as logits
            return self.adaptive_softmax.log_probs(x)
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        return F.linear(x, weight)

    def output_loss(self, x, target):
        """Summed cross-entropy (nats) of the output layer on hidden states x."""
        if self.adaptive_softmax is not None:  # its loss; without a target, log-probabilities serve as logits
            return self.adaptive_softmax.loss(x, target, self.padding_idx)
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        return self.loss(x, weight, target)

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
