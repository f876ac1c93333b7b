"""How gradients cross ranks in an update (GradSync), and the next forward's first
all-gathers started during the optimizer step (EarlyGather)."""

import contextlib

import torch.distributed as dist

from trainer.cpu.gloo_comms import chain_forward_prefetch


class GradSync:
    """When gradients cross ranks during --update-freq micro-batches.

    FSDP: reduce-scatter after every micro-batch by default (fairseq's choice: sharded
    gradients, less memory); --defer-grad-sync keeps them unsharded until the last one.
    DDP: all-reduce only on the last micro-batch (no_sync). legacy_ddp: one plain
    all-reduce per parameter after the last backward."""

    def __init__(
        self, model, env, backend, sharded, defer, background_reduce=None, early_gather=None, prefetch_units=None
    ):
        """backend: --ddp-backend by its first name; sharded: an FSDP backend; defer:
        --defer-grad-sync."""
        self.model, self.env, self.background = model, env, background_reduce
        self.early_gather = early_gather  # EarlyGather, for the optimizer step
        # {layer id: its FSDP unit} of the layers chained for forward prefetch (CPU ranks), or None.
        self.prefetch_units = prefetch_units
        self.backend, self.sharded, self.defer = backend, sharded, defer
        self.world = env.world_size
        # FSDP sums gradients across ranks; the DDP backends average them.
        self.averages = not sharded

    def micro_batch(self, is_first, is_last, layers=None):
        """layers: the ids of the decoder layers this micro-batch runs (LayerDrop), None: all."""
        if self.world == 1:
            return contextlib.nullcontext()
        if self.sharded:
            if layers is not None and self.prefetch_units is not None:
                # Prefetch only the layers that will run: LayerDrop saves their gathers too.
                chain_forward_prefetch(self.model, [self.prefetch_units[i] for i in layers if i in self.prefetch_units])
            if self.defer:
                self.model.set_requires_gradient_sync(is_last, recurse=True)
            if self.background is not None:
                # A later micro-batch's reduction is added into the sharded gradient
                # at once, so only the first (or the only, deferred) one may run behind.
                self.background.may_defer = self.background.can_ever_defer and (is_first or self.defer)
            return contextlib.nullcontext()
        if self.backend == "pytorch_ddp" and not is_last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def after_backward(self):
        if self.background is not None:
            self.background.wait()
        if self.world > 1 and self.backend == "legacy_ddp":
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(self.world)


class EarlyGather:
    """Start the next forward's first all-gathers during the optimizer step.

    Nothing runs before the root's forward, so its all-gather (the tied embedding, a large
    share of a small model) and the first layer's, which the root prefetches, would be
    waited for with nothing to overlap. The trainer steps their parameters first and then
    calls `start` (`ShardLocalAdamW.step(first=param_ids(), then=start)`: AdamW updates
    each element on its own, so the order changes no value); both all-gathers run,
    asynchronously, while the rest of the model is stepped; the next forward's pre-forward hooks wait for them (FSDP2's
    documented use of `unshard(async_op=True)`). Memory: the root (held gathered through
    forward anyway) and the first layer come during the step, when the activations are
    gone and the gradients are all that backward left (plan's ledger counts both there)."""

    def __init__(self, model, units):
        self.model, self.units = model, list(units)
        self.modules = [model] + self.units[:1]
        self.handles = []

    def param_ids(self):
        """The ids of the parameters now registered in the root's own unit and the first
        layer's (read when the optimizer is built: the same objects it holds)."""
        inner = {id(p) for unit in self.units[1:] for p in unit.parameters()}
        return {id(p) for p in self.model.parameters() if id(p) not in inner}

    def start(self):
        self.handles = [module.unshard(async_op=True) for module in self.modules]

    def wait(self):
        """Let the gathers still in flight finish (a no-op for those a forward has waited
        for). After the last update nothing else waits for them, and a process group
        destroyed under them aborts the process ("terminate called without an active
        exception"), seen when one rank finished before its peer had posted its part."""
        for handle in self.handles:
            handle.wait()
        self.handles = []
