"""Quant-Noise (Fan, Stock et al., 2020) as fairseq 0.12 trains a transformer LM with it:
noise in training that prepares the weights for quantization after it.

--quant-noise-pq P (fairseq/modules/quant_noise.py): in each training forward a wrapped
linear layer's weight loses random blocks of B consecutive input weights of each output
row, each block with probability P, and the rest is scaled by 1/(1-P). Evaluation uses the
weight as it is. fairseq wraps fc1, fc2, the adaptive input's projections and its own
`quant_noise` layer (models/transformer_lm.py). It wraps the attention projections too, but
their hooks never run: MultiheadAttention.forward hands their weights straight to
F.multi_head_attention_forward whenever there is no incremental state, in training and
validation alike, so attention trains without noise there, and here.

Two departures, each for the same reason: one process, DDP and FSDP ranks must compute
the same update. fairseq's pq hook writes the noised weight into the parameter
(`mod.weight.data = ...`), so a dropped block stays zero until gradients regrow it
(fairseq issue #3783), and under FSDP only the gathered copy, freed after forward, would
hold it; here the noise is in the weight this forward uses, and the gradient is fairseq's
(that of the noised weight, passed to every weight). And the draws come from a generator
seeded by the micro-batch's seed and the module's name, not from the global random
state: every rank draws the same blocks, and activation checkpointing's recompute
draws what the forward drew.
"""

import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F


def noise_seed(seed, name):
    """A module's 63-bit seed in the training forward of one micro-batch (`seed`)."""
    digest = hashlib.blake2b(f"quant_noise/{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def set_noise_seeds(modules, seed):
    """Before a training forward: each (name, module) of `modules` draws from its own seed,
    derived from the micro-batch's `seed` (None: one from the global random state). The
    seeds stay until the next forward, so a recompute in backward draws the same."""
    if seed is None:
        seed = int(torch.randint(2**62, ()))
    for name, module in modules:
        module.noise_seed = noise_seed(seed, name)


class _DropBlocks(torch.autograd.Function):
    """The weight with the masked elements zeroed and the rest scaled; the gradient reaches
    every weight unchanged, as fairseq's reaches the noised parameter."""

    @staticmethod
    def forward(ctx, weight, mask, scale):
        return weight.masked_fill(mask, 0) * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def pq_noise(weight, p, block_size, generator=None):
    """fairseq's quant_noise hook on a 2-D weight: one draw per block of `block_size`
    consecutive input weights of each row (flat, row by row), repeated over the block."""
    out_features, in_features = weight.shape
    mask = torch.zeros(in_features // block_size * out_features, device=weight.device)
    mask.bernoulli_(p, generator=generator)
    mask = mask.repeat_interleave(block_size, -1).view(-1, in_features).to(torch.bool)
    return _DropBlocks.apply(weight, mask, 1 / (1 - p))


def _generator(module, device):
    return torch.Generator(device=device).manual_seed(module.noise_seed) if module.noise_seed is not None else None


class NoisyLinear(nn.Linear):
    """An nn.Linear (the same parameters and names, so checkpoints and every wrapper see one)
    with --quant-noise-pq's noise in its training forward."""

    def __init__(self, in_features, out_features, bias=True, pq=0.0, block_size=8):
        super().__init__(in_features, out_features, bias)
        self.pq, self.block_size = pq, block_size
        self.noise_seed = None  # set_noise_seeds, before each training forward

    def forward(self, x):
        if not (self.training and self.pq > 0):
            return super().forward(x)
        return self._noisy_forward(x)

    @torch.compiler.disable  # a seeded draw: eager, between the compiled parts of a layer
    def _noisy_forward(self, x):
        weight = pq_noise(self.weight, self.pq, self.block_size, _generator(self, self.weight.device))
        return F.linear(x, weight, self.bias)

    def extra_repr(self):
        return super().extra_repr() + f", quant_noise_pq={self.pq}, block_size={self.block_size}"


def noisy_linear(in_features, out_features, bias, pq, block_size):
    """nn.Linear without noise (pq = 0), else a NoisyLinear."""
    if pq == 0:
        return nn.Linear(in_features, out_features, bias=bias)
    return NoisyLinear(in_features, out_features, bias, pq, block_size)


def linear(cfg, in_features, out_features, bias=True):
    """The linear layer of a model trained with the model config's --quant-noise-pq."""
    pq, block_size = getattr(cfg, "quant_noise_pq", 0.0), getattr(cfg, "quant_noise_pq_block_size", 8)
    return noisy_linear(in_features, out_features, bias, pq, block_size)


def noisy_modules(model):
    """[(name, module)] of the model's Quant-Noise modules, whose seeds set_noise_seeds sets."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, NoisyLinear)]
