"""The decoder's norms: LayerNorm (GPT-style) or RMSNorm (Llama family), whose backward is
written here for speed on a CPU."""

import torch
import torch.nn as nn


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
