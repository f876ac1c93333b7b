"""One optimizer update over --update-freq micro-batches, and one validation step.

Gradients are those of the summed token loss divided by the update's token count over
all ranks and micro-batches (fairseq's sample_size), so --update-freq 2 --batch-size 4
gives the gradient of --batch-size 8. The division is folded into the loss before
backward: no extra pass over the gradients.
"""
import contextlib
import logging
import time

import torch

from trainer.distributed import all_reduce_sum
from trainer.optim import LRSchedule, build_optimizer
from trainer.parallelize import mixed_precision_dtype, uses_fsdp

log = logging.getLogger("shardlm")


class Trainer:
    def __init__(self, cfg, model, env, pad, grad_sync):
        self.cfg, self.model, self.env, self.pad, self.grad_sync = cfg, model, env, pad, grad_sync
        self.optimizer = build_optimizer(model, cfg)
        self.schedule = LRSchedule(cfg)
        self.num_updates = 0
        # --reset-lr-scheduler on resume: the schedule counts updates from this one.
        self.lr_updates_offset = 0
        self.lr = self.schedule.apply(self.optimizer, 0)
        dtype = mixed_precision_dtype(cfg)
        # FSDP2 casts parameters itself (MixedPrecisionPolicy); elsewhere autocast does.
        self.autocast = (torch.autocast(env.device.type, dtype=dtype) if dtype is not None and not uses_fsdp(cfg)
                         else contextlib.nullcontext())
        self.scaler = None
        if cfg.common.fp16:
            c = cfg.common
            window = c.fp16_scale_window or max(int(2 ** 14 / env.world_size / cfg.optimization.update_freq), 1)
            self.scaler = torch.amp.GradScaler(env.device.type, init_scale=c.fp16_init_scale,
                                               growth_factor=2.0, backoff_factor=0.5, growth_interval=window)
            if env.device.type == "cpu" and env.is_master:
                log.warning("--fp16 on a CPU: there are no fast fp16 kernels here, so it runs but slowly; "
                            "--bf16 is the fast mixed precision on CPUs")

    @property
    def loss_scale(self):
        return self.scaler.get_scale() if self.scaler is not None else None

    def loss_sum(self, batch):
        """Summed cross-entropy (nats, fp32) over the batch's non-pad targets. The model
        computes it with its output projection, a chunk of logits at a time."""
        with self.autocast:
            return self.model(batch["src_tokens"].to(self.env.device, non_blocking=True),
                              target=batch["target"].to(self.env.device, non_blocking=True))

    def train_step(self, samples):
        """Forward/backward every micro-batch, then clip and step. Returns the update's stats,
        or None when an fp16 overflow skipped it (not counted in num_updates)."""
        start = time.perf_counter()
        self.model.train()
        ntokens = sum(s["ntokens"] for s in samples)
        nsentences = sum(s["nsentences"] for s in samples)
        total_tokens, total_sentences = all_reduce_sum([ntokens, nsentences], self.env)
        # Divide by the tokens of the whole update; DDP averages gradients over ranks,
        # which the weight undoes (FSDP sums them).
        loss_weight = (self.env.world_size if self.grad_sync.averages else 1) / max(total_tokens, 1)
        loss_total = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for i, batch in enumerate(samples):
            with self.grad_sync.micro_batch(is_first=i == 0, is_last=i == len(samples) - 1):
                loss = self.loss_sum(batch)
                loss_total += loss.detach()
                scaled = loss * loss_weight
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        self.grad_sync.after_backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        gnorm = self.clip_grad_norm()
        if not torch.isfinite(torch.tensor(gnorm)):
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is None:
                raise FloatingPointError(f"gradients are Nan/Inf at update {self.num_updates + 1}")
            self.scaler.update()  # halves the scale: unscale_ recorded the inf
            scale = self.scaler.get_scale()
            if scale < self.cfg.common.min_loss_scale:
                raise FloatingPointError(
                    f"Minimum loss scale reached ({self.cfg.common.min_loss_scale}). Your loss is probably "
                    "exploding. Try lowering the learning rate, using gradient clipping or increasing the batch size.")
            log.info(f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {scale}")
            return None
        self.lr = self.schedule.apply(self.optimizer, self.num_updates - self.lr_updates_offset)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_updates += 1
        (loss_sum,) = all_reduce_sum([loss_total.item()], self.env)
        clip = self.cfg.optimization.clip_norm
        return dict(loss_sum=loss_sum, ntokens=total_tokens, nsentences=total_sentences, gnorm=gnorm,
                    clipped=float(clip > 0 and gnorm > clip), seconds=time.perf_counter() - start)

    def clip_grad_norm(self):
        """Global gradient norm over every shard, before clipping (what fairseq logs as gnorm)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.optimization.clip_norm
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:  # the norm alone: clipping by infinity would still rescale every gradient
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        return norm.item()

    @torch.no_grad()
    def valid_step(self, batch):
        self.model.eval()
        loss = self.loss_sum(batch).item()  # a dummy batch runs too: sharded forwards are collective
        return (0.0 if batch.get("dummy") else loss), batch["ntokens"], batch["nsentences"]
