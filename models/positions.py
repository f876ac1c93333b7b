"""Where a token is: rotary embeddings (--rope, Llama's rotate-half layout, with Llama 3.1's
scaling) and fairseq's sinusoidal table. Learned positions are a plain nn.Embedding in
models/transformer_lm.py."""

import math

import torch
import torch.nn.functional as F

from models.config import head_dim


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
