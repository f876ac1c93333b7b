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
from models.config import head_dim, kv_heads, num_layers
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
    feed-forward residual per channel.

    The Llama family's pieces keep the same parameter names, so every wrapper that works on
    a layer works on theirs: qkv_proj holds the query heads' rows, then the key heads', then
    the value heads' (fewer under grouped-query attention); fc1 holds the gate's rows, then
    the up projection's (--gated-ffn); q_norm and k_norm (--qk-norm) normalize each head."""

    def __init__(self, cfg):
        super().__init__()
        d, ffn = cfg.decoder_embed_dim, cfg.decoder_ffn_embed_dim
        self.num_heads = cfg.decoder_attention_heads
        self.num_kv_heads, self.head_dim = kv_heads(cfg), head_dim(cfg)
        self.normalize_before = cfg.decoder_normalize_before
        self.dropout, self.attention_dropout = cfg.dropout, cfg.attention_dropout
        self.activation_dropout = cfg.activation_dropout
        self.activation_fn = ACTIVATION_FNS[cfg.activation_fn]
        self.gated = getattr(cfg, "gated_ffn", False)
        bias = not getattr(cfg, "no_bias", False)
        norm = partial(make_norm, cfg)
        inner = self.num_heads * self.head_dim
        self.self_attn_layer_norm = norm(d)
        self.qkv_proj = nn.Linear(d, inner + 2 * self.num_kv_heads * self.head_dim, bias=bias)  # one matmul
        self.out_proj = nn.Linear(inner, d, bias=bias)
        qk_norm = getattr(cfg, "qk_norm", False)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if qk_norm else None
        # getattr: off in configs without them, as fairseq's safe_getattr reads them
        self.c_attn = nn.Parameter(torch.ones(self.num_heads)) if getattr(cfg, "scale_heads", False) else None
        self.attn_ln = norm(d) if getattr(cfg, "scale_attn", False) else None
        self.final_layer_norm = norm(d)
        self.fc1 = nn.Linear(d, 2 * ffn if self.gated else ffn, bias=bias)
        self.ffn_layernorm = norm(ffn) if getattr(cfg, "scale_fc", False) else None
        self.fc2 = nn.Linear(ffn, d, bias=bias)
        self.w_resid = nn.Parameter(torch.ones(d)) if getattr(cfg, "scale_resids", False) else None

    def attention(self, x, cache=None, rope=None):
        B, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).view(B, T, H + 2 * KV, D).split((H, KV, KV), dim=2)
        if self.q_norm is not None:  # Qwen3: per head, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
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
            if KV != H:  # each key/value head serves H / KV query heads
                k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
            y = causal_matmul_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p,
                                               enable_gqa=KV != H)
        y = self.out_proj(y.transpose(1, 2).reshape(B, T, H * D))
        if self.c_attn is not None:
            C = y.shape[-1]
            y = (y.view(B, T, H, C // H) * self.c_attn[:, None]).view(B, T, C)
        return y if self.attn_ln is None else self.attn_ln(y)

    def feed_forward(self, x):
        if self.gated:
            gate, up = self.fc1(x).chunk(2, dim=-1)
            x = _dropout(self.activation_fn(gate) * up, self.activation_dropout, self.training)
        else:
            x = _dropout(self.activation_fn(self.fc1(x)), self.activation_dropout, self.training)
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        return self.fc2(x)

    def forward(self, x, cache=None, rope=None):
        """cache: this layer's `KVCache.append` (generation only); None in training.
        rope: the (cos, sin) tables of x's positions (`rope_tables`), with --rope."""
        attention = partial(self.attention, cache=cache, rope=rope)
        for norm, sublayer, scale in ((self.self_attn_layer_norm, attention, None),
                                      (self.final_layer_norm, self.feed_forward, self.w_resid)):
            h = sublayer(norm(x) if self.normalize_before else x)
            x = (x if scale is None else scale * x) + _dropout(h, self.dropout, self.training)
            if not self.normalize_before:
                x = norm(x)
        return x


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm in fp32 whatever the input's dtype (as transformers' LlamaRMSNorm), saving
    only the input and its rstd, and backward in three passes over the input. On a CPU
    torch's rms_norm is a composite of small ops in both directions (its _fused_rms_norm
    too), about four times slower than this for a layer's input, and saves the fp32 input
    and normalized tensor besides."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        # transformers' own order of operations, so an imported model's logits are theirs to the bit
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, rstd, weight)
        # in x's dtype: under autocast q and k stay as narrow as their matmul made them
        return (weight * (x32 * rstd).to(x.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        x32, g32 = x.to(rstd.dtype), grad.to(rstd.dtype)
        g_w = g32 * weight
        # d/dx of x·rstd·w: rstd·(g·w − x·rstd²·mean(g·w·x))
        dot = (g_w * x32).sum(-1, keepdim=True).mul_(rstd.square() / x.shape[-1])
        dx = torch.addcmul(g_w, x32, dot, value=-1).mul_(rstd)
        dw = (g32 * x32).mul_(rstd).sum(dim=tuple(range(grad.dim() - 1)))
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm's parameter and state-dict layout, computed by _RMSNormFunction."""

    def forward(self, x):
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def make_norm(cfg, dim):
    """The decoder's norm: LayerNorm (GPT-style) or RMSNorm (Llama family)."""
    bias = not getattr(cfg, "no_bias", False)
    eps = getattr(cfg, "norm_eps", 1e-5)
    if getattr(cfg, "norm_type", "layernorm") == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps, bias=bias)


def rope_inverse_frequencies(cfg, device=None):
    """Each rotated pair's angular frequency, as Llama's RoPE computes it (fp32), with Llama
    3.1's scaling when --rope-scaling llama3: frequencies whose wavelength exceeds the
    original context are divided by the factor, the high ones kept, those between blended."""
    dim = head_dim(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if cfg.rope_scaling != "llama3":
        return inv_freq
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_context = cfg.rope_original_max_positions
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, blended, scaled)


def rope_tables(inv_freq, start, length, dtype):
    """(cos, sin) of positions start … start+length-1, each length × head_dim: the angles
    computed in fp32, then cast to the activations' dtype (as transformers does)."""
    positions = torch.arange(start, start + length, device=inv_freq.device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate x (B×H×T×D) by its positions' angles, pairing channel i with i + D/2
    (transformers' rotate_half: the layout of Llama's published q/k weights)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)  # under autocast x may be narrower than the stream


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
        layer = model.layers[0]
        p = layer.out_proj.weight  # its device and dtype (an adaptive input has no single table)
        self.max_len = max_len or model.max_positions
        shape = (batch_size, layer.num_kv_heads, self.max_len, layer.head_dim)  # grouped-query: the kv heads only
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
        # --rope rotates queries and keys inside attention: nothing is added to the embeddings.
        self.rope = cfg if getattr(cfg, "rope", False) else None
        self._inv_freq = None  # computed on first use, on the activations' device (not a buffer: FSDP builds on meta)
        self.positions = None if cfg.no_token_positional_embeddings or self.rope is not None else (
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
        self.layernorm_embedding = make_norm(cfg, d) if cfg.layernorm_embedding else None
        # --decoder-layers-to-keep builds only those (renumbered from 0), as fairseq does.
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(num_layers(cfg)))
        self.layerdrop = cfg.decoder_layerdrop
        final_norm = cfg.decoder_normalize_before and not cfg.no_decoder_final_norm
        self.layer_norm = make_norm(cfg, d) if final_norm else None
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
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
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

    def rope_tables(self, start, length, x):
        """(cos, sin) for positions start … start+length-1 with --rope, else None."""
        if self.rope is None:
            return None
        if self._inv_freq is None or self._inv_freq.device != x.device:
            self._inv_freq = rope_inverse_frequencies(self.rope, x.device)
        return rope_tables(self._inv_freq, start, length, x.dtype)

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
        start = 0 if cache is None else cache.length
        x = self.embed(tokens, start)
        rope = self.rope_tables(start, tokens.shape[1], x)
        if cache is None:  # training, and generation without a cache
            for i in range(len(self.layers)) if layers is None or not self.training else layers:
                x = self.layers[i](x, rope=rope)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, cache=partial(cache.append, i), rope=rope)
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
