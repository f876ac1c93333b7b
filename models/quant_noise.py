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

--quant-noise-scalar P (fairseq/modules/quantization/scalar/, which the task's build_model
applies to every model it builds, through quantization_utils.quantize_model_scalar: 8 bits,
ranges from a histogram, re-estimated every 1000 forwards of a module): each nn.Linear and
nn.Embedding whose forward runs becomes fairseq's IntLinear / IntEmbedding. In training,
each weight is replaced by its int8 value with probability P and the rest are clamped to
the int8 range, and the layer's output is clamped to its own int8 range (fairseq's
ActivationQuantizer, p=0); in evaluation, and so in eval-lm and generate, every weight and
output is its int8 value. Gradients pass straight through the rounding, not the clamps.
fairseq also swaps the attention projections, whose forwards never run (above).

Where fairseq's pq differs: its hook writes the noised weight into the parameter
(`mod.weight.data = ...`), so a dropped block stays zero until gradients regrow it
(fairseq issue #3783), and under FSDP only the gathered copy, freed after forward, would
hold it. Here the noise is in the weight this forward uses; the gradient is fairseq's,
that of the noised weight, given to every weight. And both noises draw from a generator
seeded by the micro-batch's seed and the module's name, not from the global random state:
every rank draws alike, and activation checkpointing's recompute draws what the forward
drew. Under pq noise alone, one process, DDP and FSDP ranks compute the same update; scalar
noise's output ranges come, as in fairseq, from each rank's own batch.
"""

import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization.observer import HistogramObserver

UPDATE_STEP = 1000  # forwards of a module between re-estimates of its int8 ranges
BITS = 8


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


def histogram_qparams(t):
    """(scale, zero point, lowest, highest value) of t's int8 range, picked as fairseq's
    emulate_int8_histogram picks them."""
    observer = HistogramObserver().to(t.device)
    observer(t.detach().float())
    scale, zero_point = (q.to(t.device).type_as(t) for q in observer.calculate_qparams())
    return scale, zero_point, (-scale * zero_point).item(), (scale * (2**BITS - 1 - zero_point)).item()


def scalar_noise(t, p, qparams, generator=None):
    """fairseq's IntLinear noise on t: each element its int8 value with probability p (p=1:
    all of them), the rest clamped to the int8 range; in fairseq's form,
    `clamp(t) + noise.detach()`, so the rounding passes the gradient and the clamp does not."""
    scale, zero_point, low, high = qparams
    clamped = torch.clamp(t, low, high)
    if p == 0:
        return clamped
    quantized = (torch.clamp(torch.round(t.detach() / scale + zero_point), 0, 2**BITS - 1) - zero_point) * scale
    noise = quantized - t.detach()
    if p < 1:
        keep = torch.zeros_like(t).bernoulli_(1 - p, generator=generator).to(torch.bool)
        noise = noise.masked_fill(keep, 0)
    return clamped + noise


class ScalarNoise:
    """One module's --quant-noise-scalar state: the int8 ranges of its weight and of its
    output, estimated afresh at every UPDATE_STEP-th forward. Training and evaluation
    forwards both count, as fairseq's counters do; activation checkpointing's recompute
    (a second training forward with the micro-batch's seed) does not, or its weights could
    differ from the forward's. Plain attributes, not buffers: fairseq saves none either,
    and a resumed run estimates them again."""

    def __init__(self, p):
        self.p, self.forwards, self.last_seed = p, 0, None
        self.weight_qparams = self.output_qparams = None

    def count(self, training, seed):
        if training and seed is not None and seed == self.last_seed:
            return
        self.last_seed = seed if training else None
        if self.forwards % UPDATE_STEP == 0:
            self.weight_qparams = self.output_qparams = None
        self.forwards += 1

    def weight(self, w, training, generator):
        if self.weight_qparams is None:
            self.weight_qparams = histogram_qparams(w)
        return scalar_noise(w, self.p if training else 1, self.weight_qparams, generator)

    def output(self, y, training):
        if self.output_qparams is None:
            self.output_qparams = histogram_qparams(y)
        return scalar_noise(y, 0 if training else 1, self.output_qparams)


def _generator(module):
    if not module.training or module.noise_seed is None:
        return None  # evaluation draws nothing; a module used on its own draws from the global state
    return torch.Generator(device=module.weight.device).manual_seed(module.noise_seed)


class NoisyLinear(nn.Linear):
    """An nn.Linear (the same parameters and names, so checkpoints and every wrapper see one)
    with pq noise (pq > 0, in training) and/or scalar noise (scalar > 0) in its forward."""

    def __init__(self, in_features, out_features, bias=True, pq=0.0, block_size=8, scalar=0.0):
        super().__init__(in_features, out_features, bias)
        self.pq, self.block_size = pq, block_size
        self.scalar = ScalarNoise(scalar) if scalar > 0 else None
        self.noise_seed = None  # set_noise_seeds, before each training forward

    def forward(self, x):
        if self.scalar is None and not (self.training and self.pq > 0):
            return super().forward(x)
        return self._noisy_forward(x)

    @torch.compiler.disable  # seeded draws, ranges read on the host: eager, between compiled parts
    def _noisy_forward(self, x):
        if self.scalar is not None:
            self.scalar.count(self.training, self.noise_seed)
        generator, weight = _generator(self), self.weight
        if self.training and self.pq > 0:
            weight = pq_noise(weight, self.pq, self.block_size, generator)
        if self.scalar is None:
            return F.linear(x, weight, self.bias)
        y = F.linear(x, self.scalar.weight(weight, self.training, generator), self.bias)
        return self.scalar.output(y, self.training)

    def extra_repr(self):
        pq = f", quant_noise_pq={self.pq}, block_size={self.block_size}" if self.pq > 0 else ""
        return super().extra_repr() + pq + (f", quant_noise_scalar={self.scalar.p}" if self.scalar else "")


class NoisyEmbedding(nn.Embedding):
    """An nn.Embedding with --quant-noise-scalar's noise (fairseq's IntEmbedding)."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, scalar=0.0):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.scalar, self.noise_seed = ScalarNoise(scalar), None

    @torch.compiler.disable
    def forward(self, ids):
        self.scalar.count(self.training, self.noise_seed)
        weight = self.scalar.weight(self.weight, self.training, _generator(self))
        return self.scalar.output(F.embedding(ids, weight, self.padding_idx), self.training)

    def extra_repr(self):
        return super().extra_repr() + f", quant_noise_scalar={self.scalar.p}"


def noisy_linear(in_features, out_features, bias, pq, block_size, scalar=0.0):
    """nn.Linear without noise, else a NoisyLinear."""
    if pq == 0 and scalar == 0:
        return nn.Linear(in_features, out_features, bias=bias)
    return NoisyLinear(in_features, out_features, bias, pq, block_size, scalar)


def linear(cfg, in_features, out_features, bias=True, pq=True):
    """A linear layer of a model with the model config's Quant-Noise. pq: whether fairseq
    wraps this one for --quant-noise-pq (scalar noise takes every linear layer that runs)."""
    p = getattr(cfg, "quant_noise_pq", 0.0) if pq else 0.0
    block_size, scalar = getattr(cfg, "quant_noise_pq_block_size", 8), getattr(cfg, "quant_noise_scalar", 0.0)
    return noisy_linear(in_features, out_features, bias, p, block_size, scalar)


def embedding(cfg, num_embeddings, embedding_dim, padding_idx=None):
    """An embedding table of a model with the model config's --quant-noise-scalar."""
    scalar = getattr(cfg, "quant_noise_scalar", 0.0)
    if scalar == 0:
        return nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
    return NoisyEmbedding(num_embeddings, embedding_dim, padding_idx, scalar)


def noisy_modules(model):
    """[(name, module)] of the model's Quant-Noise modules, whose seeds set_noise_seeds sets."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (NoisyLinear, NoisyEmbedding))]


def quantized_output(module):
    """Whether `module`'s output is int8 values in evaluation (--quant-noise-scalar)."""
    return getattr(module, "scalar", None) is not None
