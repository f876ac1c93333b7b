"""One optimizer update over --update-freq micro-batches, and one validation step.

Gradients are those of the summed token loss divided by the update's token count over
all ranks and micro-batches (fairseq's sample_size), so --update-freq 2 --batch-size 4
gives the gradient of --batch-size 8. As in fairseq, backward runs on the (loss-scaled)
summed loss and the gradients are divided after it, by a factor on the device, in the
pass that clips them: folded into the loss, 1/sample_size would start fp16's backward at
loss_scale/sample_size (about 1e-4 at a million tokens) and flush small gradients to zero.
"""

import contextlib
import hashlib
import logging
import math
import time

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate

from trainer.config.schema import uses_fsdp
from trainer.parallel.context_parallel import ContextSplit
from trainer.parallel.parallelize import mixed_precision_dtype
from trainer.parallel.ranks import all_reduce_sum, on_device, on_device_sum
from trainer.train.deferred_read import BACKOFF, LOSS_SCALE, DeferredRead, numerical_fault
from trainer.train.ema import WeightsEMA
from trainer.train.lr_schedule import LRSchedule
from trainer.train.meters import BAD, UpdateStats, update_status
from trainer.train.muon import build_muon
from trainer.train.objectives import build_objective
from trainer.train.optim import CPU_ADAM, NAG, ShardLocalAdamW, build_optimizer, local_shards

log = logging.getLogger("shardlm")


class Trainer:
    """The model, its optimizer and lr schedule, and one update at a time. Its checkpointed
    state (state_dict) is the update count, the lr schedule's position and state; the loss
    scaler is saved with the optimizer's state (trainer/train/main.py registers both)."""

    def __init__(self, cfg, model, env, pad, grad_sync, objective=None):
        self.cfg, self.model, self.env, self.pad, self.grad_sync = cfg, model, env, pad, grad_sync
        self.objective = objective or build_objective(cfg)
        # auxiliary-loss-free balancing: the routers' biases move after each update (models/moe.py)
        self.balances_routers = cfg.model.get("moe_router_bias_update_rate", 0) > 0
        # --context-parallel-size: each batch cut to this rank's positions before it is counted
        per_document = getattr(self.objective, "per_document", False)
        self.context = ContextSplit(env, per_document, pad) if env.cp > 1 else None
        self.schedule = LRSchedule(cfg)
        self.num_updates = 0
        # --reset-lr-scheduler on resume: the schedule counts updates from this one.
        self.lr_updates_offset = 0
        dtype = mixed_precision_dtype(cfg.common)
        # FSDP2 casts parameters itself (MixedPrecisionPolicy); elsewhere autocast does.
        self.autocast = (
            torch.autocast(env.device.type, dtype=dtype)
            if dtype is not None and not uses_fsdp(cfg)
            else contextlib.nullcontext()
        )
        self.build_optimizer()
        # --store-ema: from the weights built; a checkpoint restored replaces it (checkpointer.py).
        self.ema = WeightsEMA(cfg, model) if cfg.ema.store_ema else None
        self.ema_pending = None  # --fp16: the update whose average waits for its overflow flag
        self.quantizer = None  # --quantization-config-path's (trainer/train/ipq.py; build sets it)
        if self.ema is not None and env.is_master:
            log.info(self.ema.describe())

    def build_optimizer(self):
        """The optimizer of self.model, fp16's loss scaler and the lr of the schedule's first
        update: at the start, and after iPQ replaced the model (replace_model)."""
        cfg, env, model = self.cfg, self.env, self.model
        self.optimizer = build_muon(model, cfg) if cfg.optimizer._name == "muon" else build_optimizer(model, cfg)
        if cfg.optimizer._name == "cpu_adam" and env.is_master:
            log.info(CPU_ADAM)
        if cfg.optimizer._name == "muon" and env.is_master:
            log.info(self.optimizer.describe())
        # An update's step steps the parameters of the next forward's first all-gathers
        # first, then starts those gathers (EarlyGather); nothing to pass where none is.
        early = self.grad_sync.early_gather
        self.step_kwargs = {}
        if early is not None and isinstance(self.optimizer, (ShardLocalAdamW, NAG)):
            self.step_kwargs = dict(first=early.param_ids(), then=early.start)
        self.lr = self.schedule.apply(self.optimizer, 0)
        self.scaler = loss_scaler(cfg, env) if cfg.common.fp16 else None
        self.deferred = DeferredRead(self.optimizer, self.scaler, cfg.common.min_loss_scale, env.is_master)

    def replace_model(self, model, grad_sync):
        """iPQ's stage (trainer/train/ipq.py): go on training `model` (the model with more
        layers quantized) as fairseq's trainer.reinitialize does: a new optimizer, its state
        empty for every parameter, fp16's loss scale at its start, and the next update at the
        lr scheduler's first lr (fairseq builds a new scheduler, stepped to update 0); the
        update count goes on."""
        self.settle()
        self.finish()
        self.model, self.grad_sync = model, grad_sync
        self.build_optimizer()

    def state_dict(self):
        return {
            "num_updates": self.num_updates,
            "lr_updates_offset": self.lr_updates_offset,
            "lr_scheduler": self.schedule.state_dict(),
            "lr": self.lr,
        }

    def load_state_dict(self, state):
        """A resumed run's count and schedule; --reset-lr-scheduler starts the schedule over
        from the saved update (reduce_lr_on_plateau's lr, best metric and bad epochs too)."""
        self.num_updates = state["num_updates"]
        reset = self.cfg.checkpoint.reset_lr_scheduler
        self.lr_updates_offset = self.num_updates if reset else state.get("lr_updates_offset", 0)
        if not reset:
            self.schedule.load_state_dict(state.get("lr_scheduler"))
        self.lr = self.schedule.apply(self.optimizer, self.num_updates - self.lr_updates_offset)
        saved_lr = state.get("lr")
        if not reset and saved_lr is not None and not math.isclose(self.lr, saved_lr, rel_tol=1e-6):
            # Allowed (a WSD decay branches this way), but a jump of the lr should not go unseen.
            if self.env.is_master:
                log.warning(
                    f"the lr of update {self.num_updates + 1} is {self.lr:.6g} under this run's schedule, "
                    f"{saved_lr:.6g} under the checkpoint's: it changes at once (a decay branched after its "
                    "start, or another --lr or schedule)"
                )

    def next_lr(self):
        """The lr of the next update (fairseq's get_lr once lr_step_update has run)."""
        return self.schedule.lr(self.num_updates - self.lr_updates_offset)

    def begin_epoch(self, epoch):
        """fairseq's lr_step_begin_epoch at each epoch's start (a resumed epoch's too)."""
        self.schedule.begin_epoch(epoch)

    def lr_step(self, epoch_metric):
        """fairseq's lr_step at an epoch's end, with its validation metric (or None)."""
        self.schedule.step_epoch(epoch_metric, self.num_updates - self.lr_updates_offset)

    @property
    def loss_scale(self):
        return self.scaler.get_scale() if self.scaler is not None else None

    def loss_sum(self, batch, layers=None, noise_seed=None):
        """The task's summed loss (fp32) over the batch (trainer/train/objectives.py), and its
        extra sums (None for token losses). The model computes the cross-entropy with its
        output projection, a chunk of logits at a time. layers: the decoder layers to run
        (LayerDrop's draw; None: all); noise_seed: Quant-Noise's."""
        with self.autocast:
            return self.objective(self.model, batch, self.env.device, layers=layers, noise_seed=noise_seed)

    def train_step(self, samples):
        """Forward/backward every micro-batch, then clip and step. Returns the update's
        UpdateStats, whose values stay on the device: nothing here waits for the device to
        read a number (token counts, loss and gradient norm are summed over ranks there).
        A non-finite loss or gradient norm is found on the device too, and the optimizer's
        fused kernel skips the step there (found_inf, as GradScaler does for fp16); the host
        acts on it when the run's DeferredRead reads it (settle())."""
        start = time.perf_counter()
        self.model.train()
        if self.context is not None:
            samples = [self.context(batch) for batch in samples]
        counts = on_device_sum(on_device(sample_counts(samples), self.env), self.env)
        # Gradients are divided by the sample size (tokens; dpo's pairs) of the whole update
        # after backward; DDP averages gradients over ranks, which the factor undoes (FSDP
        # sums them).
        grad_factor = ((self.env.world_size if self.grad_sync.averages else 1) / counts[2].clamp(min=1)).float()
        loss_total = torch.zeros((), dtype=torch.float64, device=self.env.device)
        extras_total = torch.zeros(len(self.objective.extras), dtype=torch.float64, device=self.env.device)
        lm = getattr(self.model, "module", self.model)  # the TransformerLM inside DDP
        for i, batch in enumerate(samples):
            # LayerDrop's and Quant-Noise's draws for this micro-batch, from a seed every rank
            # computes alike (fairseq reseeds each update from --seed + num_updates; here per
            # micro-batch too).
            seed = micro_batch_seed(self.cfg.common.seed, self.num_updates, i)
            layers = lm.layerdrop_layers(seed)
            with self.grad_sync.micro_batch(is_first=i == 0, is_last=i == len(samples) - 1, layers=layers):
                loss, extras = self.loss_sum(batch, layers, noise_seed=seed)
                loss_total += loss.detach()
                if extras is not None:
                    extras_total += extras
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self.grad_sync.after_backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        gnorm = self.clip_grad_norm(grad_factor)
        # Summed over ranks, so that every rank skips or stops at the same update.
        loss_total = on_device_sum(loss_total, self.env)
        extras_total = on_device_sum(extras_total, self.env) if len(extras_total) else None
        status = update_status(
            loss_total, counts, gnorm.to(loss_total.device), self.cfg.optimization.clip_norm, extras_total
        )
        if self.deferred.settles_before_step:
            self.settle()
        update = UpdateStats(status, self.num_updates + 1, self.objective.extras)
        self.deferred.before_step(update)
        self.lr = self.schedule.apply(self.optimizer, self.num_updates - self.lr_updates_offset)
        self.step(status[BAD])
        if self.balances_routers:
            lm.update_router_biases()
        if self.ema is not None:
            # Under fp16 an overflow skips the step and is no update of the average either
            # (fairseq's), but its flag is read later (settle): the average follows then,
            # before the next step moves the weights. Elsewhere a bad update stops the run
            # unsaved, so the average follows at once.
            if self.deferred.mode == LOSS_SCALE:
                self.ema_pending = self.num_updates + 1
            else:
                self.ema.step(self.num_updates + 1)
        self.optimizer.zero_grad(set_to_none=True)
        self.deferred.after_step(update)
        self.num_updates += 1
        update.seconds = time.perf_counter() - start
        return update

    def step(self, bad):
        """The optimizer step as the run's DeferredRead takes it (skipped on the device where
        `bad`, a 0-d tensor, is 1). Only an update's own step gathers for the next forward:
        torch's checkpoint API also steps the optimizer (with zero gradients, to create its
        state before a load), and parameters gathered then would be stale once the load has
        replaced them."""
        try:
            self.deferred.step(bad, **self.step_kwargs)
        except RuntimeError as e:  # torch refuses a step size beyond float32's range (--lr ~1e38 and up)
            if "without overflow" not in str(e):
                raise
            raise numerical_fault(
                f"the optimizer step of update {self.num_updates + 1} overflows float32 (--lr {self.lr:g}); lower --lr",
                self.env.is_master,
            ) from None

    def settle(self):
        """Read the flags of the last update not yet read (trainer/train/deferred_read.py):
        a bad update stops the run there, except under fp16, where it was skipped and is
        uncounted here, the one place the count goes down. The loop calls it at the
        boundaries that need the count exact: a log record, validation, a save, a stop.
        Under fp16, --store-ema's average follows that update here if it counted. Returns
        whether that update counted."""
        counted = self.deferred.settle()
        if not counted:
            self.num_updates -= 1
        n, self.ema_pending = self.ema_pending, None
        if n is not None and counted:
            self.ema.step(n)
        return counted

    def finish(self):
        """After the last update, before the process group goes: wait for the collectives
        an update leaves in flight for the next one (parallelize.EarlyGather)."""
        if self.grad_sync.early_gather is not None:
            self.grad_sync.early_gather.wait()

    @contextlib.contextmanager
    def ema_weights(self):
        """--validate-with-ema: the moving average in the weights' place for the block. FSDP's
        units gathered now hold the weights, and those a forward without backward leaves
        gathered (the last layer, the norms outside the layers, every layer under
        --no-reshard-after-forward) would hold the average after it: each unit is resharded
        before the swap and after it, so every forward gathers what the shards hold. Before
        the swap also waits for the next forward's gathers started during the step."""
        self.finish()
        self.reshard()
        with self.ema.swapped_in():
            try:
                yield
            finally:
                self.reshard()

    def reshard(self):
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def check_parameters_finite(self):
        """Before a save: refuse to write weights that are Nan/Inf (an update with a finite
        loss and gradients can still step them there, e.g. an enormous --lr)."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        bad = sum(float(not torch.isfinite(t).all()) for t in local if t.numel())
        (bad,) = all_reduce_sum([bad], self.env)
        if bad:
            raise numerical_fault(
                f"parameters are Nan/Inf after update {self.num_updates}; nothing was saved from them: "
                "lower --lr or set --clip-norm, and resume from the last checkpoint",
                self.env.is_master,
            )

    def clip_grad_norm(self, grad_factor):
        """Multiplies the gradients by `grad_factor` (a 0-d tensor on the device: 1/sample
        size, fairseq's multiply_grads) and returns the global norm of the result over every
        shard, before clipping (what fairseq logs as gnorm), as a tensor on the device; with
        --clip-norm, gradients are scaled as torch's clip_grad_norm_ scales them. Both in one
        pass over the gradients, by a factor that stays on the device."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        raw = global_grad_norm(grads)
        factor = grad_factor.to(raw.device)
        norm = raw * factor
        clip = self.cfg.optimization.clip_norm
        if clip > 0:  # without it, no clip factor: clipping by infinity would still rescale them
            factor = factor * torch.clamp(clip / (norm + 1e-6), max=1.0)
        local = local_shards(grads)
        if local:
            torch._foreach_mul_(local, factor.to(local[0].device))
        return norm

    @torch.no_grad()
    def valid_step(self, batch):
        """(summed loss on the device, its extra sums or None, [tokens, sentences, sample
        size]) of a validation batch."""
        self.model.eval()
        if self.context is not None:
            batch = self.context(batch)
        loss, extras = self.loss_sum(batch)  # a dummy batch runs too: sharded forwards are collective
        if batch.get("dummy"):
            loss, extras = torch.zeros_like(loss), None if extras is None else torch.zeros_like(extras)
        return loss, extras, sample_counts([batch])


def sample_counts(batches):
    """[target tokens, sentences, sample size] of batches: the sample size divides the gradients
    (after backward) and the logged loss, the target tokens (fairseq's), or dpo's pairs."""
    return [
        sum(b["ntokens"] for b in batches),
        sum(b["nsentences"] for b in batches),
        sum(b.get("sample_size", b["ntokens"]) for b in batches),
    ]


def loss_scaler(cfg, env):
    """fp16's dynamic loss scale (fairseq's flags, on torch's GradScaler)."""
    common = cfg.common
    window = common.fp16_scale_window or max(int(2**14 / env.data_size / cfg.optimization.update_freq), 1)
    if env.device.type == "cpu" and env.is_master:
        log.warning(
            "--fp16 on a CPU: there are no fast fp16 kernels here, so it runs but slowly; "
            "--bf16 is the fast mixed precision on CPUs"
        )
    return torch.amp.GradScaler(
        env.device.type,
        init_scale=common.fp16_init_scale,
        growth_factor=2.0,
        backoff_factor=BACKOFF,
        growth_interval=window,
    )


def micro_batch_seed(seed, num_updates, micro_batch):
    """One 63-bit seed per (--seed, update, micro-batch): the same on every rank and in a
    resumed run, unrelated between neighbours."""
    key = f"{seed}/{num_updates}/{micro_batch}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def global_grad_norm(grads):
    """The L2 norm of all gradients together, as a plain tensor on every rank. FSDP2's
    gradients are DTensor shards: the norm of each rank's shards, squared, summed over the
    mesh dimensions the gradients are sharded on (replicas of HSDP hold the same values,
    and so do a tensor-parallel group's for the parameters it replicates), in one
    collective per layout, rather than one DTensor op per gradient, each paying DTensor's
    dispatch in Python."""
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:
        local = local_shards(grads)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local))) if local else torch.zeros(())
    if len(sharded) < len(grads):
        return torch.nn.utils.get_total_norm(grads).full_tensor()  # not a layout parallelize() builds
    layouts = {}
    for g in sharded:
        layouts.setdefault((g.device_mesh, g.placements), []).append(g)
    total = None
    for (mesh, placements), group in layouts.items():
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local_shards(group))))
        partial = [Replicate() if pl.is_replicate() else Partial("sum") for pl in placements]  # _StridedShard too
        # Under --cpu-offload the shards are on the host and the mesh is the GPUs': sum there.
        squared = DTensor.from_local((norm**2).to(mesh.device_type), mesh, partial).full_tensor()
        total = squared if total is None else total + squared
    return total.sqrt()
