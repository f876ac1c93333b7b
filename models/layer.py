"""One decoder layer: causal self-attention and a feed-forward, each in a residual branch.

The unit that trainer/parallel/parallelize.py checkpoints, compiles and shards, one at a
time; models/transformer_lm.py stacks them.
"""

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

from models.config import head_dim, kv_heads
from models.cpu_attention import causal_matmul_attention, use_matmul_attention
from models.moe import MoEFeedForward
from models.norms import RMSNorm, make_norm
from models.positions import apply_rope
from models.quant_noise import linear

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


def causal_attention(q, k, v, dropout_p):
    """Causal attention of q (B×H×T×D) over k and v (B×KV×S×D, S ≥ T), q's positions being
    the last T of the keys': each query sees the keys up to its own position (the mask
    aligned to the lower right; the usual causal one when S = T)."""
    H, KV, T, S = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if use_matmul_attention(q, dropout_p):
        if KV != H:  # each key/value head serves H / KV query heads
            k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        return causal_matmul_attention(q, k, v)
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=KV != H)
    if KV != H and q.device.type == "cuda" and q.dtype == torch.float32:
        # CUDA's flash kernel takes grouped key/value heads but not fp32, its memory-efficient
        # one fp32 but not grouped heads: fp32 gets whole heads rather than the math kernel.
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    gqa = k.shape[1] != H
    if fused_attention_fits(q, k, v, dropout_p, gqa):
        # CausalBias: SDPA runs the lower-right mask in that kernel without building it.
        mask = causal_lower_right(T, S)
    else:  # built T×S, once for the batch and heads (CausalBias would build it so here too)
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril_(S - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


def fused_attention_fits(q, k, v, dropout_p, gqa):
    """Whether CUDA's flash or memory-efficient kernel takes this attention (unmasked)."""
    if q.device.type != "cuda":
        return False
    params = SDPAParams(q, k, v, None, dropout_p, False, gqa)
    return can_use_flash_attention(params) or can_use_efficient_attention(params)


def dropout(x, p, training):
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

    def __init__(self, cfg, sparse=False):
        """sparse: the feed-forward is a mixture of experts (models/moe.py), its router and
        experts (moe.experts.fc1, moe.experts.fc2: stacked weights) in place of fc1 and fc2."""
        super().__init__()
        dim, ffn = cfg.decoder_embed_dim, cfg.decoder_ffn_embed_dim
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
        self.self_attn_layer_norm = norm(dim)
        self.qkv_proj = nn.Linear(dim, inner + 2 * self.num_kv_heads * self.head_dim, bias=bias)  # one matmul
        self.out_proj = nn.Linear(inner, dim, bias=bias)
        qk_norm = getattr(cfg, "qk_norm", False)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if qk_norm else None
        # getattr: off in configs without them, as fairseq's safe_getattr reads them
        self.c_attn = nn.Parameter(torch.ones(self.num_heads)) if getattr(cfg, "scale_heads", False) else None
        self.attn_ln = norm(dim) if getattr(cfg, "scale_attn", False) else None
        self.final_layer_norm = norm(dim)
        # Quant-Noise takes the feed-forward's layers, not the attention's: fairseq's
        # attention reads its projections' weights around their noise (models/quant_noise.py).
        self.moe = MoEFeedForward(cfg, self.activation_fn) if sparse else None
        self.fc1 = None if sparse else linear(cfg, dim, 2 * ffn if self.gated else ffn, bias=bias)
        self.ffn_layernorm = norm(ffn) if getattr(cfg, "scale_fc", False) else None
        self.fc2 = None if sparse else linear(cfg, ffn, dim, bias=bias)
        self.w_resid = nn.Parameter(torch.ones(dim)) if getattr(cfg, "scale_resids", False) else None

    def weight_blocks(self):
        """{name: row counts} of the 2-D weights that stack several matrices, one count per
        matrix in row order, as the Hugging Face layout keeps them apart: qkv_proj's
        q_proj, k_proj, v_proj; fc1's gate_proj and up_proj (--gated-ffn). An optimizer
        that treats each matrix whole (--optimizer muon) splits them so; any other 2-D
        weight is one matrix."""
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        blocks = {"qkv_proj.weight": (H * D, KV * D, KV * D)}
        if self.moe is not None:  # each expert's gate, up and down projections
            experts = self.moe.experts
            E, F, dim = experts.num_experts, experts.ffn, experts.fc2.shape[0] // experts.num_experts
            blocks["moe.experts.fc1"], blocks["moe.experts.fc2"] = (F,) * (2 * E), (dim,) * E
        elif self.gated:
            half = self.fc1.weight.shape[0] // 2
            blocks["fc1.weight"] = (half, half)
        return blocks

    def attention(self, x, cache=None, rope=None, mask=None, query_chunks=None):
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)
        # The heads this process holds, as the projection's width says: all of them, or under
        # tensor parallelism a share of the query heads with the key/value heads they read
        # (trainer/parallel/tensor_parallel.py orders qkv_proj's rows so). With fewer key/value
        # heads than processes, a process's queries read one key/value head, which it shares
        # with other processes: fewer than a whole group of query heads come with it.
        D = self.head_dim
        heads = qkv.shape[-1] // D
        group = self.num_heads // self.num_kv_heads  # query heads per key/value head
        KV = 1 if heads < group + 2 else heads // (group + 2)
        H = heads - 2 * KV
        q, k, v = qkv.view(B, T, heads, D).split((H, KV, KV), dim=2)
        if self.q_norm is not None:  # Qwen3: per head, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # Right padding only: a causal mask already keeps every real token off the pads.
        # Packed documents bring their block-causal mask instead (with a cache only under
        # context parallelism).
        causal = mask is None
        if cache is not None:
            k, v = cache(k, v)
        if cache is not None and query_chunks is None:
            # Incremental decoding: the new positions attend to every cached one and causally
            # among themselves. is_causal would align the mask top-left (wrong once the cache
            # holds anything), so say it explicitly; a single new token sees all: no mask.
            # A batch whose rows are at lengths of their own brings its mask (models/batch_cache.py).
            start = k.shape[2] - T
            if mask is None and T > 1:
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
            causal = False
        dropout_p = self.attention_dropout if self.training else 0.0
        if causal and query_chunks is not None:
            # Context parallelism: each of x's runs of the sequence attends to the keys up to
            # its end, and no mask of x's positions over the whole sequence is made.
            y = torch.cat(
                [causal_attention(q[:, :, a:b], k[:, :, :end], v[:, :, :end], dropout_p) for a, b, end in query_chunks],
                dim=2,
            )
        elif causal:
            y = causal_attention(q, k, v, dropout_p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=KV != H)
        y = self.out_proj(y.transpose(1, 2).reshape(B, T, H * D))
        if self.c_attn is not None:
            C, heads = y.shape[-1], self.num_heads  # all heads' scales: out_proj's output is whole
            y = (y.view(B, T, heads, C // heads) * self.c_attn[:, None]).view(B, T, C)
        return y if self.attn_ln is None else self.attn_ln(y)

    def feed_forward(self, x):
        if self.moe is not None:
            return self.moe(x)
        if self.gated:
            gate, up = self.fc1(x).chunk(2, dim=-1)
            x = dropout(self.activation_fn(gate) * up, self.activation_dropout, self.training)
        else:
            x = dropout(self.activation_fn(self.fc1(x)), self.activation_dropout, self.training)
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        return self.fc2(x)

    def forward(self, x, cache=None, rope=None, mask=None, query_chunks=None):
        """cache: a function of this layer's new keys and values giving all it attends to:
        `KVCache.append` in generation, the context's gather under context parallelism
        (TransformerLM.forward's `context`); None otherwise.
        rope: the (cos, sin) tables of x's positions (`rope_tables`), with --rope.
        mask: packed documents' B×1×T×T block-causal mask (models/documents.py), True where
        a query may attend a key; None: plain causal attention. With a cache: None, or a
        batch's B×1×T×L mask over its cached keys (models/batch_cache.py); under context
        parallelism, packed documents' B×1×T×L mask of x's positions over the sequence's.
        query_chunks: under context parallelism, the runs of x's positions that are runs of
        the sequence's, each (first, end) in x with the sequence's position after its last;
        the cache gives the sequence's keys and values, and without a mask each run attends
        causally to those before that position."""
        attention = partial(self.attention, cache=cache, rope=rope, mask=mask, query_chunks=query_chunks)
        for norm, sublayer, scale in (
            (self.self_attn_layer_norm, attention, None),
            (self.final_layer_norm, self.feed_forward, self.w_resid),
        ):
            h = sublayer(norm(x) if self.normalize_before else x)
            x = (x if scale is None else scale * x) + dropout(h, self.dropout, self.training)
            if not self.normalize_before:
                x = norm(x)
        return x
