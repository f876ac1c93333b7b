"""One rank of the dry run, on its fake GPU with a fake process group, through the project's
own code: init_rank (device, process groups), build (model sharded as the job shards it,
optimizer, data), train_step twice, the second under torch's FSDPMemTracker.
"""

import contextlib
import time
import traceback

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import _redistribute
from torch.distributed.tensor.debug import _clear_python_sharding_prop_cache
from torch.nn.parallel import DistributedDataParallel

from data.iterator import grouped
from trainer.config.schema import uses_fsdp
from trainer.dryrun.device_checks import FakeDevices, run_random_ops_as_cuda
from trainer.dryrun.dry_inference import COMMANDS as INFERENCE
from trainer.dryrun.fake_cuda import CudaStandIn
from trainer.dryrun.fake_groups import FakeGroups
from trainer.dryrun.host_side import real_batches, unfaked_host_side
from trainer.errors import USER_ERRORS
from trainer.parallel.ranks import cuda_device_index, init_rank, teardown
from trainer.rendezvous import Rendezvous
from trainer.train.main import build


def run_job(job):
    """{"config": YAML, "rank", "world_size", "gpus_per_node", "command"} → a report dict."""
    cfg = OmegaConf.create(job["config"])
    started = time.perf_counter()
    report = {"rank": job["rank"], "command": job.get("command", "train")}
    try:
        report.update(DryRank(cfg, job).run())
    except USER_ERRORS as e:
        report["usage_error"] = str(e)
    except Exception as e:  # what a GPU would have refused: the dry run's finding
        report["failure"] = f"{type(e).__name__}: {e}".splitlines()[0]
        report["traceback"] = traceback.format_exc()
    report["seconds"] = round(time.perf_counter() - started, 2)
    return report


def bucket_all_reduce(state, bucket):
    """DDP's bucket all-reduce, as its default hook does it, through the checked collective:
    its C++ reducer would otherwise wait on a future the fake group leaves empty."""
    buffer = bucket.buffer()
    torch.distributed.all_reduce(buffer)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


@contextlib.contextmanager
def flash_attention():
    """scaled_dot_product_attention as a GPU runs it, while inside. torch's CPU build has no
    fused kernel for CUDA tensors, so SDPA of fake CUDA tensors takes its math path, which
    keeps every head's T×T probabilities for backward; a GPU takes flash attention wherever
    it applies (no mask, fp16 or bf16, a head of at most 256 channels), which keeps only its
    output and a row log-sum-exp. Its op has fake kernels for forward and backward, so the
    tracker counts what flash allocates (not its kernels' workspace, which no tensor holds).
    F's attribute is replaced, not a thread's function mode: a checkpointed layer's
    recomputation runs on autograd's device thread, and must take the same path."""
    sdpa = F.scaled_dot_product_attention

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        flash = (
            q.device.type == "cuda"
            and attn_mask is None
            and q.dim() == 4
            and q.dtype in (torch.float16, torch.bfloat16)
            and q.dtype == k.dtype == v.dtype
            and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0
            and (enable_gqa or k.shape[1] == q.shape[1])
        )
        if flash:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


class GradientTracker(FSDPMemTracker):
    """FSDPMemTracker, less one gradient it kept alive itself. Its wrapper of a group's
    post-backward labels the unsharded gradients in a loop whose variable still holds the
    group's last gradient while FSDP reduces them and frees the rest, so that gradient (for
    the root, a vocabulary table) counted into the reduction's peak after FSDP had let it
    go. Here the labelling returns before the reduction starts."""

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig_post_backward):
        label = super()._fsdp_param_group_post_backward(fsdp_mod, lambda *args, **kwargs: None)

        def post_backward(*args, **kwargs):
            label(*args, **kwargs)  # the unsharded gradients labelled; the state is post-backward
            orig_post_backward(*args, **kwargs)
            if group := fsdp_mod._get_fsdp_state()._fsdp_param_group:
                for fsdp_param in group.fsdp_params:
                    if fsdp_param.sharded_param.grad is not None:
                        self._update_and_maybe_create_winfos(fsdp_param.sharded_param.grad, _FSDPRefType.SHARDED_GRAD)

        return post_backward


for _tracker in (GradientTracker, MemTracker):  # the tracked update's modes
    run_random_ops_as_cuda(_tracker)


class _ClearOnThisThread(torch.autograd.Function):
    """Its backward clears DTensor's sharding cache of the thread that runs it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch._C._clear_DTensor_sharding_propagator_cache()
        return grad


def forget_meshes(device):
    """Drop what DTensor cached about this job's meshes (tensor parallelism's): the next job
    of this process (another row, the same rank) makes meshes equal to them (same shape, same
    ranks), and a cached sharding or redistribution would hand it back one of the old meshes,
    whose groups are destroyed ("Could not resolve the process group registered under the
    name …"). DTensor's C++ cache is kept per thread: the job's backward ran on autograd's
    thread for `device` (a fake CUDA device), which a backward on that device clears."""
    _clear_python_sharding_prop_cache()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    x = torch.zeros(1, device=device, requires_grad=True)
    _ClearOnThisThread.apply(x).sum().backward()


class DryRank:
    def __init__(self, cfg, job):
        self.cfg, self.job = cfg, job

    def run(self):
        cuda = CudaStandIn(self.job["gpus_per_node"])
        groups = FakeGroups(cuda)
        fake = FakeDevices()
        undo = [cuda.patch(), groups.patch(), unfaked_host_side(), real_batches(fake)]
        try:
            with fake:
                env = self.init_rank()
                fake.rank_device = env.device
                result = {"device": str(env.device), "local_rank": env.local_rank, "node_gpus": self.node_gpus()}
                command = self.job.get("command", "train")
                if command == "train":
                    result.update(self.train(env, fake))
                else:
                    result.update(INFERENCE[command](self.job, env, fake))
            result.update(
                groups=[list(g) for g in groups.groups],
                collectives=[list(c) for c in fake.collectives],
                # a value read on the host from host memory waits for nothing: the GPU's count
                host_reads=sum(device != "cpu" for device in fake.host_reads),
                pinned_copies=sum(1 for pinned, _ in fake.copies if pinned),
                pageable_copies=sum(1 for pinned, _ in fake.copies if not pinned),
                cuda_calls=sorted({c[0] for c in cuda.calls}),
            )
            return result
        finally:
            teardown()
            with fake:
                forget_meshes(cuda.current())
            for restore in reversed(undo):
                restore()

    def local_ranks(self):
        """(local rank, ranks on this rank's node): ranks fill nodes of gpus_per_node in order."""
        world, gpus, rank = self.job["world_size"], self.job["gpus_per_node"], self.job["rank"]
        return rank % gpus, min(gpus, world - rank // gpus * gpus)

    def node_gpus(self):
        """The GPU each local rank of this rank's node takes, as the job's ranks pick it."""

        _, local_world = self.local_ranks()
        return [cuda_device_index(i, local_world, self.job["gpus_per_node"], {}) for i in range(local_world)]

    def init_rank(self):

        local_rank, local_world = self.local_ranks()
        world, rank = self.job["world_size"], self.job["rank"]
        rdv = Rendezvous("tcp://dry-run:29500", world, rank=rank, local_rank=local_rank, local_world_size=local_world)
        return init_rank(self.cfg, rdv, needs_process_group=uses_fsdp(self.cfg) or world > 1)

    def train(self, env, fake):
        """Build the model, its optimizer and data, and run two updates (the second, with the
        optimizer state alive, under torch's FSDPMemTracker: the peak the CUDA caching
        allocator would count). DDP runs one, tracked: before its second forward its C++
        reducer rebuilds its buckets from indices broadcast as data, which fake tensors lack."""
        task, trainer, _ = build(self.cfg, env)
        ddp = isinstance(trainer.model, DistributedDataParallel)
        if ddp:
            trainer.model.register_comm_hook(None, bucket_all_reduce)
        batches = task.batch_iterator(self.cfg.dataset.train_subset, training=True).next_epoch_itr()
        samples = next(iter(grouped(batches, self.cfg.optimization.update_freq)))
        pinned = [fake.is_pinned(b["src_tokens"]) for b in samples]
        if not ddp:
            trainer.train_step(samples)
        if trainer.quantizer is not None:  # iPQ's first stage, and the quantized model's update after it
            trainer.quantizer.quantize(0, trainer, None)
        first = len(fake.collectives)
        peak = self.tracked_peak(trainer, lambda: trainer.train_step(samples), env)
        trainer.finish()
        return {"peak_bytes": peak, "batches_pinned": all(pinned), "update_collectives": len(fake.collectives) - first}

    def tracked_peak(self, trainer, step, env):
        """The device's peak over `step`, in bytes: FSDPMemTracker for a sharded model, else
        torch's MemTracker, which counts the same storages; attention runs as a GPU's flash
        kernel would (flash_attention). Both follow one forward per module per step: each
        micro-batch of --update-freq starts their per-module stats afresh (the peak they keep
        is the whole step's)."""
        model = trainer.model
        if isinstance(model, FSDPModule):
            tracker = GradientTracker(model, trainer.optimizer)
        else:
            tracker = MemTracker()
            tracker.track_external(model, trainer.optimizer)
        loss_sum = trainer.loss_sum

        def micro_batch(*args, **kwargs):
            tracker.reset_mod_stats()
            return loss_sum(*args, **kwargs)

        trainer.loss_sum = micro_batch
        try:
            with tracker, flash_attention():
                step()
        finally:
            del trainer.loss_sum
        peak = tracker.get_tracker_snapshot("peak").get(env.device, {})
        return next((v for k, v in peak.items() if str(getattr(k, "value", k)) == "Total"), 0)
