"""Causal self-attention in bf16/fp16 on a CPU, as batched matmuls (what SDPA does on a GPU
with its fused kernels, this does on a CPU with oneDNN's).

SDPA's CPU flash kernel reaches a small fraction of a bf16 matmul's FLOP/s on a CPU with
bf16 matmul units (AVX512-BF16): its tiles are too small for the matmul units, and it
keeps its softmax in fp32. Here the scores and probabilities are whole T×T matmul results
per head, in the input dtype (softmax accumulates in fp32 inside), which is what fairseq's
and Hugging Face's eager attentions compute under mixed precision, and forward and
backward together take less time than the flash kernel's.

The queries may be the last of the keys' positions (fewer queries than keys): the causal
mask is then aligned to the lower right, each query seeing every key up to its own
position, as context parallelism's chunks of a sequence attend to the keys before them.

Memory stays that of a flash kernel: forward saves only q (pre-scaled), k and v, and
backward recomputes each head's probabilities before using them. The scores exist
only for a chunk of heads at a time (models/chunks.py's ATTENTION_SCORES_BYTES of them,
a size trainer/plan/ledger.py reads too), so long sequences do not allocate
batch×heads×T² at once.
"""

import torch

from models import chunks


def _joined(chunks):
    """The chunks' results as one tensor (no copy when there is one chunk)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _causal_probs(q_scaled, k, above_diagonal):
    scores = torch.bmm(q_scaled, k.transpose(1, 2))
    return torch.softmax(scores.masked_fill_(above_diagonal, float("-inf")), -1)


def _above_diagonal(queries, keys, device):
    """queries × keys bool, True where a query may not attend: the keys after its position,
    the queries being the last `queries` of the keys' positions (lower-right aligned)."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).triu_(keys - queries + 1)


class CausalMatmulAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, D = q.shape
        S = k.shape[2]
        q_scaled = (q * D**-0.5).reshape(B * H, T, D)  # scaling T×D, not T×S
        k, v = k.reshape(B * H, S, D), v.reshape(B * H, S, D)
        above_diagonal = _above_diagonal(T, S, q.device)
        step = chunks.attention_heads_per_chunk(B * H, T, q.element_size(), keys=S)
        out = [
            torch.bmm(_causal_probs(q_scaled[i : i + step], k[i : i + step], above_diagonal), v[i : i + step])
            for i in range(0, B * H, step)
        ]
        ctx.save_for_backward(q_scaled, k, v)
        ctx.shape = (B, H, T, S, D)
        return _joined(out).view(B, H, T, D)

    @staticmethod
    def backward(ctx, grad_out):
        q_scaled, k, v = ctx.saved_tensors
        B, H, T, S, D = ctx.shape
        grad_out = grad_out.reshape(B * H, T, D)
        above_diagonal = _above_diagonal(T, S, k.device)
        step = chunks.attention_heads_per_chunk(B * H, T, k.element_size(), keys=S)
        parts = [
            _chunk_backward(
                q_scaled[i : i + step], k[i : i + step], v[i : i + step], grad_out[i : i + step], above_diagonal
            )
            for i in range(0, B * H, step)
        ]
        dq, dk, dv = (_joined(p) for p in zip(*parts))
        return (dq.mul_(D**-0.5).view(B, H, T, D), dk.view(B, H, S, D), dv.view(B, H, S, D))


def _chunk_backward(q_scaled, k, v, grad_out, above_diagonal):
    """(dq·√d, dk, dv) of one chunk of heads. Its T×S tensors (probabilities and two
    gradients, three at once at most) are freed on return, before the next chunk's."""
    probs = _causal_probs(q_scaled, k, above_diagonal)
    dv = torch.bmm(probs.transpose(1, 2), grad_out)
    grad_probs = torch.bmm(grad_out, v.transpose(1, 2))
    # softmax's backward in one fused pass: probs * (grad - rowsum(probs * grad)); the
    # masked positions have probability 0, so their score gradient is 0 too.
    grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
    return torch.bmm(grad_scores, k), torch.bmm(grad_scores.transpose(1, 2), q_scaled), dv


def use_matmul_attention(q, dropout_p):
    """Whether causal attention over q goes through CausalMatmulAttention: low precision on
    a CPU, without attention dropout (SDPA applies that; fp32 SDPA is as fast as this)."""
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0


def causal_matmul_attention(q, k, v):
    """softmax(q·kᵀ/√d, causal) · v for q of shape (batch, heads, T, head_dim) and k, v of
    (batch, heads, S, head_dim), S ≥ T: q's positions are the last T of the keys'."""
    return CausalMatmulAttention.apply(q, k, v)
