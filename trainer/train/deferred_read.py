"""When the host reads an update's flags, and what a bad update does: one policy per run.

An update's flags (its loss or gradient norm not finite: `bad` in its status vector) are
computed on the device, and reading them on the host makes the host wait for the device.
So each mode reads them as late as its optimizer allows, and the loop settles them (reads
them now) only at the boundaries that need the update count exact: a log record,
validation, a save, a stop.

| mode             | used for                | flags read                 | a bad update                     |
|------------------|-------------------------|----------------------------|----------------------------------|
| loss_scale       | --fp16 (GradScaler)     | the update before's,       | skipped on the device, its scale |
|                  |                         | before this one steps      | halved; uncounted when read; at  |
|                  |                         |                            | --min-loss-scale the run stops   |
| skip_on_device   | a fused step taking     | the update before's, after | skipped on the device, and every |
|                  | found_inf (adam, adamw, | this one's step is queued  | step after it; the run stops     |
|                  | cpu_adam)               |                            | when read, weights of the one    |
|                  |                         |                            | before                           |
| read_before_step | any other optimizer     | this update's, before it   | never stepped; the run stops     |
|                  | (sgd, nag, …)           | steps                      |                                  |

Without fp16 a bad update stops the run with fairseq's messages; every rank decides on the
same summed values, so all stop at the same update.
"""

import logging
import math

import torch

from trainer.errors import RankStopped
from trainer.parallel.ranks import HostCopy
from trainer.train.meters import LN2

log = logging.getLogger("shardlm")
LOSS_SCALE, SKIP_ON_DEVICE, READ_BEFORE_STEP = "loss_scale", "skip_on_device", "read_before_step"
BACKOFF = 0.5  # fp16's loss scale is halved on an overflow (fairseq's, and GradScaler's default)


def numerical_fault(message, is_master):
    """The error to stop with: rank 0 says why, the others stop quietly under local spawn,
    so the job prints one line (each prints it when started on its own, as by torchrun)."""
    return FloatingPointError(message) if is_master else RankStopped(message)


class DeferredRead:
    def __init__(self, optimizer, scaler, min_loss_scale, is_master):
        self.optimizer, self.scaler = optimizer, scaler
        self.min_loss_scale, self.is_master = min_loss_scale, is_master
        if scaler is not None:
            self.mode = LOSS_SCALE
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            self.mode = SKIP_ON_DEVICE
        else:
            self.mode = READ_BEFORE_STEP
        self.pending = None  # the last UpdateStats whose flags the host has not read
        self.fault = None  # skip_on_device: 1 on the device from a bad update on; no step after it

    @property
    def settles_before_step(self):
        """Whether the update before must be settled before this one is numbered: under fp16 a
        skipped update is not counted, so it decides this one's number and lr (fairseq's).
        Its value is long computed by then: this update's forward and backward queued behind it."""
        return self.mode == LOSS_SCALE

    def before_step(self, update):
        """read_before_step: this update's flags, read now; a bad one stops before it steps."""
        if self.mode == READ_BEFORE_STEP:
            self.pending = update
            self.settle()

    def step(self, bad, **step_kwargs):
        """The optimizer step, skipped on the device where `bad` (a 0-d tensor) is 1."""
        if self.mode == LOSS_SCALE:
            # GradScaler's own flag is per rank (its shards only): every rank takes the one
            # summed over all of them, so all skip or none does.
            state = self.scaler._per_optimizer_states[id(self.optimizer)]
            for found_inf in state["found_inf_per_device"].values():
                found_inf.copy_(bad)
            self.scaler.step(self.optimizer, **step_kwargs)
            self.scaler.update()
        elif self.mode == SKIP_ON_DEVICE:
            # Without fp16 a bad update stops the run: every step from it on is skipped
            # until the host has read the flag and stopped.
            self.fault = torch.maximum(self.fault, bad.float()) if self.fault is not None else bad.float()
            self.optimizer.found_inf = self.fault
            try:
                self.optimizer.step(**step_kwargs)
            finally:
                del self.optimizer.found_inf
        else:
            self.optimizer.step(**step_kwargs)

    def after_step(self, update):
        """skip_on_device: the update before's flags, read now (its step was skipped on the
        device if they were bad). loss_scale and skip_on_device: this update's, copied to the
        host behind the work that computes them, for a later read."""
        if self.mode == SKIP_ON_DEVICE:
            self.settle()
        if self.mode != READ_BEFORE_STEP:
            update.copy = HostCopy(update.status)
            self.pending = update

    def settle(self):
        """Read the flags of the last update not yet read and act on them; returns whether
        that update counted (False only for an fp16 overflow, which the caller uncounts)."""
        update, self.pending = self.pending, None
        if update is None:
            return True
        loss_sum, _, _, gnorm, _, bad, sample_size = update.read()[:7]
        if not bad:
            return True
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_sum / max(sample_size, 1) / LN2
        if self.mode != LOSS_SCALE:
            what = "gradients are" if not math.isfinite(gnorm) else "loss is"
            raise numerical_fault(
                f"{what} Nan/Inf at update {update.number} (loss {loss:.4g}, gnorm {gnorm:.4g}); nothing was saved "
                "from it: lower --lr or set --clip-norm, and resume from the last checkpoint",
                self.is_master,
            )
        scale = self.scaler.get_scale()
        if scale <= self.min_loss_scale:  # fairseq's test and message
            raise numerical_fault(
                f"Minimum loss scale reached ({self.min_loss_scale}) at update {update.number}, where the loss "
                f"overflowed at scale {scale / BACKOFF}. Your loss is probably exploding. Try lowering the learning "
                "rate, using gradient clipping or increasing the batch size.",
                self.is_master,
            )
        log.info(f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {scale}")
        return False
