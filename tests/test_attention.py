"""models/cpu_attention.py: the CPU's low-precision causal attention computes what SDPA
computes, forward and backward, in one chunk of heads or many, and DecoderLayer uses it
exactly where it should."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import models.chunks as chunks
from models.cpu_attention import causal_matmul_attention
from models.transformer_lm import DecoderLayer


def qkv(dtype, shape=(3, 4, 40, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def forward_backward(attention, q, k, v, seed=1):
    for t in (q, k, v):
        t.grad = None
    out = attention(q, k, v)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype))
    return [out.detach()] + [t.grad for t in (q, k, v)]


def sdpa(q, k, v):
    # q's positions are the last of the keys' (all of them but under context parallelism)
    T, S = q.shape[2], k.shape[2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(T, S, dtype=torch.bool).tril(S - T))


def relative_errors(results, reference):
    return [((r.double() - ref.double()).norm() / ref.double().norm()).item() for r, ref in zip(results, reference)]


@pytest.mark.parametrize("queries", [40, 24])
def test_same_as_sdpa_in_fp32(queries):
    """In fp32 the arithmetic is exact enough to compare with SDPA element by element: a
    wrong mask, scale or softmax gradient shows at once. 24 queries: the last 24 of the 40
    keys' positions (a context-parallel chunk), the mask aligned to the lower right."""

    def inputs():
        q, k, v = qkv(torch.float32)
        return q.detach()[:, :, -queries:].clone().requires_grad_(), k, v

    ours = forward_backward(causal_matmul_attention, *inputs())
    theirs = forward_backward(sdpa, *inputs())
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_as_accurate_as_sdpa():
    """bf16 scores and probabilities cost accuracy; no more than about SDPA's own bf16 error
    against a float64 reference."""
    exact = forward_backward(sdpa, *[t.detach().double().requires_grad_() for t in qkv(torch.bfloat16)])
    ours = relative_errors(forward_backward(causal_matmul_attention, *qkv(torch.bfloat16)), exact)
    theirs = relative_errors(forward_backward(sdpa, *qkv(torch.bfloat16)), exact)
    for mine, sdpa_error in zip(ours, theirs):
        assert mine < 2.5 * sdpa_error + 1e-3, (ours, theirs)
        assert mine < 1e-2


def test_chunks_of_heads_give_the_same_result(monkeypatch):
    whole = forward_backward(causal_matmul_attention, *qkv(torch.bfloat16))
    # 40×40 bf16 scores are 3,200 bytes a head: chunks of 2 heads, 6 chunks for 12 (b, h) pairs
    monkeypatch.setattr(chunks, "ATTENTION_SCORES_BYTES", 2 * 40 * 40 * 2)
    assert chunks.attention_heads_per_chunk(12, 40, 2) == 2
    chunked = forward_backward(causal_matmul_attention, *qkv(torch.bfloat16))
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


def _graph_names(tensor):
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize(
    "dtype, attention_dropout, autocast, expected",
    [
        (torch.bfloat16, 0.0, False, True),  # FSDP's bf16 param_dtype
        (torch.float32, 0.0, True, True),  # DDP's --bf16: autocast makes q, k, v bf16
        (torch.float32, 0.0, False, False),  # fp32: SDPA is as fast
        (torch.bfloat16, 0.1, False, False),  # attention dropout: SDPA applies it
    ],
)
def test_decoder_layer_uses_it_for_low_precision_on_cpu(dtype, attention_dropout, autocast, expected):
    cfg = OmegaConf.create(
        dict(
            decoder_embed_dim=32,
            decoder_ffn_embed_dim=64,
            decoder_attention_heads=4,
            decoder_normalize_before=True,
            activation_fn="gelu",
            dropout=0.0,
            attention_dropout=attention_dropout,
            activation_dropout=0.0,
        )
    )
    layer = DecoderLayer(cfg).to(dtype).train()
    x = torch.randn(2, 16, 32, dtype=dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    assert ("CausalMatmulAttentionBackward" in _graph_names(y)) == expected
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_fused_kernels_lower_right_bias_is_the_built_mask(kv_heads, monkeypatch):
    """Context parallelism's chunks (fewer queries than keys, the queries last) attend through
    CausalBias where CUDA's fused kernels take them: that branch, run here (SDPA builds the
    bias's mask on a CPU), gives what the mask built on a CPU gives."""
    from models import layer

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, kv_heads, 10, 8, generator=g), torch.randn(2, kv_heads, 10, 8, generator=g)
    built = layer.causal_attention(q, k, v, 0.0)
    monkeypatch.setattr(layer, "fused_attention_fits", lambda *args: True)
    assert torch.allclose(layer.causal_attention(q, k, v, 0.0), built, atol=1e-6)
    upper_left = torch.ones(6, 10, dtype=torch.bool).tril_()  # the wrong alignment differs
    wrong = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=upper_left, enable_gqa=kv_heads != 4)
    assert not torch.allclose(wrong, built, atol=1e-3)
