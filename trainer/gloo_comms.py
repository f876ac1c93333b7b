"""FSDP2's all-gather and reduce-scatter built from gloo's faster collectives (CPU).

gloo's collectives are not equally fast. Measured here on 2 ranks, 218 MB: all-gather
0.245 s by all_gather_into_tensor, 0.18 s by all-reduce of a zero-padded buffer, 0.09 s
as one broadcast per rank; reduce-scatter 0.33 s by reduce_scatter_tensor, 0.21 s by
all-reduce. So:
- all-gather: each rank broadcasts its slot of the output buffer (FSDP has already
  copied its shard there) to the others;
- reduce-scatter: each rank sends the others their slots of its gradient buffer and
  sums what it receives into its own (point to point; gloo's reduce_scatter_tensor and
  all-reduce move twice the bytes).
Both are exact copies/sums of the same values, so numerics do not change.

On a CPU FSDP2 runs every collective synchronously: backward would stop at each layer
until its gradients are summed. Where nothing reads the reduced gradient before the
optimizer (see `ReduceScatterInBackground.may_defer`), a layer's transfers run in
gloo's threads while the backward of the layer below goes on, as DDP's buckets do; the
sum is taken at the next reduce-scatter, or at `wait()` before the gradients are used.
NCCL's own collectives stay in use on GPUs.

Under --host-allocator glibc the decoder layers' all-gather and reduce-scatter buffers are
reused from layer to layer (`LayerBufferPool`), as CUDA's caching allocator reuses them on
a GPU; the caching host allocator (trainer/host_allocator.py) reuses their pages itself.
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class LayerBufferPool:
    """The decoder layers' all-gather outputs and reduce-scatter inputs, kept for reuse.

    Every layer gathers and reduces buffers of one size, one after the other. Under FSDP
    on a CPU glibc serves each one with freshly mapped pages (`return_large_frees_to_os`
    in trainer/distributed.py), and faulting those in costs tokens/s. On bench_fsdp's
    model (2 ranks, 109 M; 4 interleaved repetitions, 2026-11-24) reusing them did
    182 against 175 tokens/s, faster in every repetition (DDP: 186). One buffer per
    size is kept, about half the gathers and reduce-scatters find it free, and it adds
    one layer's buffer at the peak: 1.535 against 1.505 GB per rank. The root's buffers
    (the tied embedding, a third of that model) are never kept: no layer has their size.

    A kept buffer is handed out again only when nothing else holds its storage: FSDP
    keeps views of both buffers after the collective (until the copy-out, and until the
    next reduce-scatter), and gloo's transfers hold them while they run."""

    def __init__(self):
        # (numel, dtype) -> the pool's own alias of a buffer: everyone given the buffer gets
        # another (`view`), so the storage's use count tells whether any of them lives.
        self.kept = {}
        self.gather_sizes = set()  # (numel, dtype) of the layers' all-gather outputs

    def take(self, size, dtype, device):
        buffer = self.kept.get((size[0], dtype)) if len(size) == 1 else None
        # Our reference and the temporary storage object's: nobody else holds it. The same
        # check as torch._inductor's CUDA-graph trees make before reusing an output.
        if buffer is not None and torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) == 2:
            return buffer.view(size)
        return torch.empty(*size, dtype=dtype, device=device)

    def keep_gather_output(self, buffer):
        key = (buffer.numel(), buffer.dtype)
        self.gather_sizes.add(key)
        self._keep(key, buffer)

    def keep_reduce_input(self, buffer):
        """Kept only in a size some layer's all-gather output has: the root's gradients
        are not."""
        key = (buffer.numel(), buffer.dtype)
        if key in self.gather_sizes:
            self._keep(key, buffer)

    def _keep(self, key, buffer):
        if key not in self.kept:  # called every collective: no alias made once one is kept
            self.kept[key] = buffer.detach()


class BroadcastAllGather(AllGather):
    """`pool`: the decoder layers' shared `LayerBufferPool`; None for the root."""

    def __init__(self, pool=None):
        self.pool = pool

    def allocate(self, size, *, dtype, device):
        if self.pool is None:
            return torch.empty(*size, dtype=dtype, device=device)
        return self.pool.take(size, dtype, device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if self.pool is not None:
            self.pool.keep_gather_output(output_tensor)
        n, rank, world = input_tensor.numel(), dist.get_rank(group), dist.get_world_size(group)
        if input_tensor.data_ptr() != output_tensor[rank * n].data_ptr():
            output_tensor[rank * n:(rank + 1) * n].copy_(input_tensor)
        works = [dist.broadcast(output_tensor[src * n:(src + 1) * n], group=group, group_src=src, async_op=True)
                 for src in range(world)]
        if not async_op:
            for w in works:
                w.wait()
            return None
        # One Work for FSDP to wait on, done when every broadcast is.
        done = torch.futures.collect_all([w.get_future() for w in works])
        return torch._C._distributed_c10d._create_work_from_future(done)


class SlotSum:
    """One reduce-scatter by point-to-point transfers: this rank sends every other rank
    its slot of the gradient buffer and receives theirs of its own slot, then sums. Each
    rank sends and receives (W-1)/W of the buffer, half an all-reduce's bytes (2 ranks,
    50 MB: 0.026 s against 0.050 s). The transfers run in gloo's threads from here on;
    `finish()` waits for them and adds this rank's own part."""

    def __init__(self, output_tensor, input_tensor, group):
        n, rank, world = output_tensor.numel(), dist.get_rank(group), dist.get_world_size(group)
        slot = lambda r: input_tensor[r * n:(r + 1) * n].view_as(output_tensor)  # noqa: E731
        self.output, self.mine = output_tensor, slot(rank)
        peers = [r for r in range(world) if r != rank]
        # The first peer's part lands in the output itself: with 2 ranks, no extra memory.
        self.received = [output_tensor] + [torch.empty_like(output_tensor) for _ in peers[1:]]
        self.works = [dist.isend(slot(r), group=group, group_dst=r) for r in peers]
        self.works += [dist.irecv(buf, group=group, group_src=r) for buf, r in zip(self.received, peers)]

    def finish(self):
        for w in self.works:
            w.wait()
        for buf in self.received[1:]:
            self.output.add_(buf)
        self.output.add_(self.mine)
        self.works = self.received = self.mine = None  # frees the gradient buffer


class ReduceScatterInBackground(ReduceScatter):
    """Point-to-point reduce-scatters (`SlotSum`) that may finish later. Shared by every
    FSDP unit of a model, so that `wait()` finds all the sums still open."""

    def __init__(self, can_ever_defer, pool=None):
        self.pool = pool  # None: every buffer is a new tensor
        # False where FSDP reads the reduced gradient at once: it casts it to another
        # dtype (reduce dtype != parameter dtype), or all-reduces it again across
        # replicas (hybrid_shard).
        self.can_ever_defer = can_ever_defer
        self.may_defer = can_ever_defer
        self.pending = []

    def allocate(self, size, *, dtype, device):
        if self.pool is None:
            return torch.empty(*size, dtype=dtype, device=device)
        # Safe for the reduce-scatter output too (the sharded gradient, which lives on):
        # a kept buffer is only handed out when nothing holds it.
        return self.pool.take(size, dtype, device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self.pool is not None:
            self.pool.keep_reduce_input(input_tensor)
        # FSDP may add this output into a gradient an earlier sum still fills; the earlier
        # ones' bytes crossed while this layer's backward ran. Finishing them now keeps
        # one gradient buffer alive at a time, as a synchronous reduce-scatter would.
        self.wait()
        if op != dist.ReduceOp.SUM:
            n, rank = output_tensor.numel(), dist.get_rank(group)
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor[rank * n:(rank + 1) * n].view_as(output_tensor))
            return None
        reduction = SlotSum(output_tensor, input_tensor, group)
        if self.may_defer:
            self.pending.append(reduction)  # FSDP keeps input_tensor alive only while it runs
        else:
            reduction.finish()
        return None

    def wait(self):
        pending, self.pending = self.pending, []
        for reduction in pending:
            reduction.finish()


def use_gloo_fast_comms(root, layers, can_defer_reduction, reuse_buffers):
    """Give every FSDP unit the gloo collectives above; returns the shared reduce-scatter,
    whose `wait()` must run before gradients are read. `reuse_buffers`: keep the layers'
    buffers in a `LayerBufferPool`; not wanted under the caching host allocator, which
    reuses their pages anyway, and where the kept buffer would only add to the peak (one
    layer's all-gather output, 48 MB per rank on bench_fsdp's model, alive at the end of
    forward)."""
    pool = LayerBufferPool() if reuse_buffers else None
    reduce_scatter = ReduceScatterInBackground(can_defer_reduction, pool)
    root.set_custom_all_gather(BroadcastAllGather(pool=None))
    for layer in layers:
        layer.set_custom_all_gather(BroadcastAllGather(pool))
    for unit in [root] + list(layers):
        unit.set_custom_reduce_scatter(reduce_scatter)
    return reduce_scatter


def prefetch_in_background(root, units):
    """Overlap each layer's all-gather with the compute before it. On a GPU FSDP2 does so
    with its own CUDA streams; a CPU has none, so every gather would stall the layer that
    needs it. Instead each unit prefetches the next in forward (the root the first layer),
    and unshards are asynchronous: the broadcasts run in gloo's thread while the current
    layer computes, forward and backward (FSDP2's implicit backward prefetch). One more
    layer is gathered at a time, as on a GPU."""
    chain = [root] + list(units)
    for unit, following in zip(chain, chain[1:]):
        unit.set_modules_to_forward_prefetch([following])
    root._set_unshard_async_op(True)  # private in torch 2.13; applies to every unit below the root
