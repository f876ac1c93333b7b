"""One optimizer update over --update-freq micro-batches, and one validation step.

Gradients are those of the summed token loss divided by the update's token count over
all ranks and micro-batches (fairseq's sample_size), so --update-freq 2 --batch-size 4
gives the gradient of --batch-size 8. The division is folded into the loss before
backward: no extra pass over the gradients.
"""
import contextlib
import hashlib
import logging
import math
import time

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from trainer.config.schema import uses_fsdp
from trainer.errors import RankStopped
from trainer.parallel.parallelize import mixed_precision_dtype
from trainer.parallel.ranks import HostCopy, all_reduce_sum, on_device, on_device_sum
from trainer.train.meters import BAD, LN2, UpdateStats, update_status
from trainer.train.optim import CPU_ADAM, NAG, LRSchedule, ShardLocalAdamW, build_optimizer, local_shards

log = logging.getLogger("shardlm")
BACKOFF = 0.5  # fp16's loss scale is halved on an overflow (fairseq's, and GradScaler's default)


class Trainer:
    def __init__(self, cfg, model, env, pad, grad_sync):
        self.cfg, self.model, self.env, self.pad, self.grad_sync = cfg, model, env, pad, grad_sync
        self.optimizer = build_optimizer(model, cfg)
        if cfg.optimizer._name == "cpu_adam" and env.is_master:
            log.info(CPU_ADAM)
        # An update's step steps the parameters of the next forward's first all-gathers
        # first, then starts those gathers (EarlyGather); nothing to pass where none is.
        early = grad_sync.early_gather
        self.step_kwargs = {}
        if early is not None and isinstance(self.optimizer, (ShardLocalAdamW, NAG)):
            self.step_kwargs = dict(first=early.param_ids(), then=early.start)
        self.schedule = LRSchedule(cfg)
        # Fused Adam skips a step on the device when told found_inf (GradScaler's contract);
        # SGD and NAG cannot, and read each update's flags before stepping instead.
        self.skips_on_device = getattr(self.optimizer, "_step_supports_amp_scaling", False)
        self.pending = None  # the last UpdateStats whose flags the host has not read (settle)
        self.fault = None  # 1 on the device from a non-finite update on (fp32/bf16): no step after it
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
                                               growth_factor=2.0, backoff_factor=BACKOFF, growth_interval=window)
            if env.device.type == "cpu" and env.is_master:
                log.warning("--fp16 on a CPU: there are no fast fp16 kernels here, so it runs but slowly; "
                            "--bf16 is the fast mixed precision on CPUs")

    def next_lr(self):
        """The lr of the next update (fairseq's get_lr once lr_step_update has run)."""
        return self.schedule.lr(self.num_updates - self.lr_updates_offset)

    def lr_step(self, epoch_metric):
        """fairseq's lr_step at an epoch's end, with its validation metric (or None)."""
        self.schedule.step_epoch(epoch_metric, self.num_updates - self.lr_updates_offset)

    @property
    def loss_scale(self):
        return self.scaler.get_scale() if self.scaler is not None else None

    def loss_sum(self, batch, layers=None):
        """Summed cross-entropy (nats, fp32) over the batch's non-pad targets. The model
        computes it with its output projection, a chunk of logits at a time. layers: the
        decoder layers to run (LayerDrop's draw; None: all)."""
        with self.autocast:
            return self.model(batch["src_tokens"].to(self.env.device, non_blocking=True),
                              target=batch["target"].to(self.env.device, non_blocking=True), layers=layers)

    def train_step(self, samples):
        """Forward/backward every micro-batch, then clip and step. Returns the update's
        UpdateStats, whose values stay on the device: nothing here waits for the device to
        read a number (token counts, loss and gradient norm are summed over ranks there).
        A non-finite loss or gradient norm is found on the device too, and the optimizer's
        fused kernel skips the step there (found_inf, as GradScaler does for fp16); the host
        acts on it one update later (settle())."""
        start = time.perf_counter()
        self.model.train()
        counts = on_device_sum(on_device([sum(s["ntokens"] for s in samples),
                                          sum(s["nsentences"] for s in samples)], self.env), self.env)
        # Divide by the tokens of the whole update; DDP averages gradients over ranks,
        # which the weight undoes (FSDP sums them).
        loss_weight = ((self.env.world_size if self.grad_sync.averages else 1) / counts[0].clamp(min=1)).float()
        loss_total = torch.zeros((), dtype=torch.float64, device=self.env.device)
        lm = getattr(self.model, "module", self.model)  # the TransformerLM inside DDP
        for i, batch in enumerate(samples):
            # LayerDrop's draw for this micro-batch, from a seed every rank computes alike
            # (fairseq reseeds each update from --seed + num_updates; here per micro-batch too).
            layers = lm.layerdrop_layers(layerdrop_seed(self.cfg.common.seed, self.num_updates, i))
            with self.grad_sync.micro_batch(is_first=i == 0, is_last=i == len(samples) - 1, layers=layers):
                loss = self.loss_sum(batch, layers)
                loss_total += loss.detach()
                scaled = loss * loss_weight
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        self.grad_sync.after_backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        gnorm = self.clip_grad_norm()
        # Summed over ranks, so that every rank skips or stops at the same update.
        loss_total = on_device_sum(loss_total, self.env)
        status = update_status(loss_total, counts, gnorm.to(loss_total.device), self.cfg.optimization.clip_norm)
        if self.scaler is not None:
            # A skipped update is not counted: whether the last one was decides this one's
            # number and lr (fairseq's), so it is read before this step (its value is long
            # computed: this update's forward and backward are queued behind it).
            self.settle()
        update = UpdateStats(status, self.num_updates + 1)
        if not self.skips_on_device and self.scaler is None:
            # SGD and NAG have no fused step to skip on the device: this update's flags are
            # read before it steps (the one read per update these optimizers cost; under
            # fp16, GradScaler reads its own flag to skip their step).
            self.pending = update
            self.settle()
        self.lr = self.schedule.apply(self.optimizer, self.num_updates - self.lr_updates_offset)
        self.step(status[BAD])
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is None:
            self.settle()  # the last update's flags; this step was skipped on the device if they were bad
        self.num_updates += 1
        if self.skips_on_device or self.scaler is not None:
            update.copy = HostCopy(status)
            self.pending = update
        update.seconds = time.perf_counter() - start
        return update

    def step(self, bad):
        """The optimizer step, skipped on the device where `bad` (a 0-d tensor) is 1: fp16's
        GradScaler takes it as its found_inf, fused Adam as found_inf too. Without fp16 a bad
        update stops the run, so from then on every step is skipped (self.fault) until the
        host has read the flag and stopped. Only an update's own step gathers for the next
        forward: torch's checkpoint API also steps the optimizer (with zero gradients, to
        create its state before a load), and parameters gathered then would be stale once
        the load has replaced them."""
        try:
            if self.scaler is not None:
                # GradScaler's own flag is per rank (its shards only): every rank takes the
                # one summed over all of them, so all skip or none does.
                state = self.scaler._per_optimizer_states[id(self.optimizer)]
                for found_inf in state["found_inf_per_device"].values():
                    found_inf.copy_(bad)
                self.scaler.step(self.optimizer, **self.step_kwargs)
                self.scaler.update()
            elif self.skips_on_device:
                self.fault = torch.maximum(self.fault, bad.float()) if self.fault is not None else bad.float()
                self.optimizer.found_inf = self.fault
                try:
                    self.optimizer.step(**self.step_kwargs)
                finally:
                    del self.optimizer.found_inf
            else:
                self.optimizer.step(**self.step_kwargs)
        except RuntimeError as e:  # torch refuses a step size beyond float32's range (--lr ~1e38 and up)
            if "without overflow" not in str(e):
                raise
            raise self.numerical_fault(f"the optimizer step of update {self.num_updates + 1} overflows float32 "
                                       f"(--lr {self.lr:g}); lower --lr") from None

    def settle(self):
        """Read the flags of the last update not yet read and act on them: a non-finite loss
        or gradient norm stops fp32/bf16 at once (fairseq's messages, with that update; the
        device skipped its step, so the weights are those of the update before); under fp16
        the update was skipped and its scale halved on the device, and here it is uncounted,
        until --min-loss-scale. The loop calls it before anything that needs the update
        count exact (a log record, validation, a save, the last update). Returns whether
        that update counted."""
        update, self.pending = self.pending, None
        if update is None:
            return True
        loss_sum, ntokens, _, gnorm, _, bad = update.read()
        if not bad:
            return True
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_sum / max(ntokens, 1) / LN2
        if self.scaler is None:
            what = "gradients are" if not math.isfinite(gnorm) else "loss is"
            raise self.numerical_fault(
                f"{what} Nan/Inf at update {update.number} (loss {loss:.4g}, gnorm {gnorm:.4g}); nothing was saved "
                "from it: lower --lr or set --clip-norm, and resume from the last checkpoint")
        self.num_updates -= 1  # counted when it was stepped: under fp16 it is read one update later
        scale = self.scaler.get_scale()
        min_scale = self.cfg.common.min_loss_scale
        if scale <= min_scale:  # fairseq's test and message
            raise self.numerical_fault(
                f"Minimum loss scale reached ({min_scale}) at update {update.number}, where the loss overflowed at "
                f"scale {scale / BACKOFF}. Your loss is probably exploding. Try lowering the learning rate, using "
                "gradient clipping or increasing the batch size.")
        log.info(f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {scale}")
        return False

    def finish(self):
        """After the last update, before the process group goes: wait for the collectives
        an update leaves in flight for the next one (parallelize.EarlyGather)."""
        if self.grad_sync.early_gather is not None:
            self.grad_sync.early_gather.wait()

    def numerical_fault(self, message):
        """The error to stop with. Every rank decides on the same summed values and stops
        at the same update; rank 0 says why, the others stop quietly under local spawn, so
        the job prints one line (each prints it when started on its own, as by torchrun)."""
        return FloatingPointError(message) if self.env.is_master else RankStopped(message)

    def check_parameters_finite(self):
        """Before a save: refuse to write weights that are Nan/Inf (an update with a finite
        loss and gradients can still step them there, e.g. an enormous --lr)."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        bad = sum(float(not torch.isfinite(t).all()) for t in local if t.numel())
        (bad,) = all_reduce_sum([bad], self.env)
        if bad:
            raise self.numerical_fault(
                f"parameters are Nan/Inf after update {self.num_updates}; nothing was saved from them: "
                "lower --lr or set --clip-norm, and resume from the last checkpoint")

    def clip_grad_norm(self):
        """Global gradient norm over every shard, before clipping (what fairseq logs as gnorm),
        as a tensor on the device; with --clip-norm, gradients are scaled as torch's
        clip_grad_norm_ scales them, by a factor that stays on the device too."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = global_grad_norm(grads)
        clip = self.cfg.optimization.clip_norm
        if clip > 0:  # without it, only the norm: clipping by infinity would still rescale them
            local = local_shards(grads)
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(local, coef.to(local[0].device))
        return norm

    @torch.no_grad()
    def valid_step(self, batch):
        """(summed loss on the device, tokens, sentences) of a validation batch."""
        self.model.eval()
        loss = self.loss_sum(batch)  # a dummy batch runs too: sharded forwards are collective
        return (torch.zeros_like(loss) if batch.get("dummy") else loss), batch["ntokens"], batch["nsentences"]


def layerdrop_seed(seed, num_updates, micro_batch):
    """One 63-bit seed per (--seed, update, micro-batch): the same on every rank and in a
    resumed run, unrelated between neighbours."""
    key = f"{seed}/{num_updates}/{micro_batch}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def global_grad_norm(grads):
    """The L2 norm of all gradients together, as a plain tensor on every rank. FSDP2's
    gradients are DTensor shards: the norm of each rank's shards, squared, summed over the
    mesh dimensions the gradients are sharded on (replicas of HSDP hold the same values),
    in one collective, rather than one DTensor op per gradient, each paying DTensor's
    dispatch in Python."""
    local = local_shards(grads)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local))) if local else torch.zeros(())
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:
        return norm
    mesh, placements = sharded[0].device_mesh, sharded[0].placements
    if len(sharded) < len(grads) or any(g.device_mesh != mesh or g.placements != placements for g in sharded):
        return torch.nn.utils.get_total_norm(grads).full_tensor()  # not a layout parallelize() builds
    partial = [Partial("sum") if pl.is_shard() else Replicate() for pl in placements]
    # Under --cpu-offload the shards are on the host and the mesh is the GPUs': sum there.
    squared = (norm ** 2).to(mesh.device_type)
    return DTensor.from_local(squared, mesh, partial).full_tensor().sqrt()
