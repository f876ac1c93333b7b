"""--store-ema: an exponential moving average of the weights (fairseq's models/ema/ema.py).

fairseq's rule, after every update that counts (an fp16 overflow does not): with n the
update count after it, every --ema-update-freq-th such update

    decay = 0 if n < --ema-start-update else --ema-decay
    ema = decay * ema + (1 - decay) * weights

so before --ema-start-update the average is a copy of the weights. The average starts as
the weights the run starts from. fairseq counts --ema-update-freq with a counter that a
resumed run starts at 0; here the update count itself decides (n % freq == 0), which is the
same in an uninterrupted run and continues exactly across a resume.

Each rank keeps the average of the weights it holds: under FSDP/HSDP the local tensors of
its parameter shards (on the host under --cpu-offload, beside them), whole tensors under
DDP and in one process. Nothing is gathered and the host reads no device value: the decay
comes from the update count, and the update is one foreach lerp by that number (a 0-d
tensor would be read back to the host: the foreach ops take a scalar weight). Whether an
fp16 update overflowed is known on the host only when its flag is read, so the trainer
steps the average then (trainer/train/trainer.py settle), before the next step moves the
weights. The average is fp32 when the weights are (shardlm keeps fp32 weights under
--fp16/--bf16 too), else in their 16-bit compute dtype as fairseq's fp16 model copy is,
unless --ema-fp32.

Checkpoints hold it as `ema.<parameter name>`, sharded as the parameters are
(trainer/checkpoint/checkpointer.py); `eval-lm`, `generate`, `export-model` and `serve`
read it with --ema (trainer/formats/shardlm/reader.py).
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor

from trainer.parallel.parallelize import mixed_precision_dtype
from trainer.parallel.shard_sums import local_shards


def ema_dtype(cfg):
    """fp32 with --ema-fp32 or without --fp16/--bf16, else their 16-bit dtype."""
    low = mixed_precision_dtype(cfg.common)
    return torch.float32 if cfg.ema.ema_fp32 or low is None else low


class WeightsEMA:
    def __init__(self, cfg, model):
        ema = cfg.ema
        self.decay, self.start, self.freq = ema.ema_decay, ema.ema_start_update, ema.ema_update_freq
        self.dtype = ema_dtype(cfg)
        inner = getattr(model, "module", model)  # DDP's: the names are the bare model's, as checkpoints'
        # The sharded parameters under FSDP2 (the objects the optimizer steps): read when the
        # model is built, not later, when a gathered layer's module holds its unsharded ones.
        named = list(inner.named_parameters())
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.shadow = []
        self.reset_from_weights()

    @torch.no_grad()
    def reset_from_weights(self):
        """The average := the weights now (a fresh start; a checkpoint without an average)."""
        self.shadow = [t.detach().to(self.dtype, copy=True) for t in local_shards(self.params)]

    def local_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.shadow)

    def describe(self):
        return (
            f"moving average of the weights: decay {self.decay}, from update {self.start}, every "
            f"{self.freq} update(s), {str(self.dtype).removeprefix('torch.')}; this rank holds "
            f"{self.local_bytes() / 2**20:,.1f} MiB of it"
        )

    @torch.no_grad()
    def step(self, num_updates):
        """After update `num_updates` (counted from 1), which counted, has stepped the weights."""
        if num_updates % self.freq:
            return
        decay = 0.0 if num_updates < self.start else self.decay
        weights = local_shards(self.params)
        if not weights:
            return
        if weights[0].dtype != self.dtype:
            weights = [w.to(self.dtype) for w in weights]
        # lerp: ema + w * (weights - ema) = (1 - w) * ema + w * weights; w = 1 copies exactly.
        torch._foreach_lerp_(self.shadow, weights, 1.0 - decay)

    def state_dict(self):
        """{parameter name: the average}, each a DTensor laid out as its parameter under FSDP
        (the local tensor is this average's own, so a DCP load fills it in place)."""
        out = {}
        for name, p, t in zip(self.names, self.params, self.shadow):
            if isinstance(p, DTensor):
                mesh, placements = p.device_mesh, p.placements
                t = DTensor.from_local(t, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
            out[name] = t
        return out

    @contextlib.contextmanager
    def swapped_in(self):
        """The average in the parameters' place (their dtype) for the block, the weights back
        after it; the caller reshards FSDP's gathered layers around it."""
        with torch.no_grad():
            local = local_shards(self.params)
            saved = [t.clone() for t in local]
            torch._foreach_copy_(local, self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(local_shards(self.params), saved)
