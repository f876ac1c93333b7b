"""FSDP2's all-gather and reduce-scatter built from gloo's faster collectives (CPU).

gloo's collectives are not equally fast: its all_gather_into_tensor is slower than an
all-reduce of a zero-padded buffer, which is slower than one broadcast per rank, and its
reduce_scatter_tensor is slower than an all-reduce. So:
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
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class BroadcastAllGather(AllGather):
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        n, rank, world = input_tensor.numel(), dist.get_rank(group), dist.get_world_size(group)
        if input_tensor.data_ptr() != output_tensor[rank * n].data_ptr():
            output_tensor[rank * n : (rank + 1) * n].copy_(input_tensor)
        works = [
            dist.broadcast(output_tensor[src * n : (src + 1) * n], group=group, group_src=src, async_op=True)
            for src in range(world)
        ]
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
    rank sends and receives (W-1)/W of the buffer, half an all-reduce's bytes, and takes
    less time than one. The transfers run in gloo's threads from here on; `finish()` waits
    for them and adds this rank's own part."""

    def __init__(self, output_tensor, input_tensor, group):
        n, rank, world = output_tensor.numel(), dist.get_rank(group), dist.get_world_size(group)
        slot = lambda r: input_tensor[r * n : (r + 1) * n].view_as(output_tensor)  # noqa: E731
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

    def __init__(self, can_ever_defer):
        # False where FSDP reads the reduced gradient at once: it casts it to another
        # dtype (reduce dtype != parameter dtype), or all-reduces it again across
        # replicas (hybrid_shard).
        self.can_ever_defer = can_ever_defer
        self.may_defer = can_ever_defer
        self.pending = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        # FSDP may add this output into a gradient an earlier sum still fills; the earlier
        # ones' bytes crossed while this layer's backward ran. Finishing them now keeps
        # one gradient buffer alive at a time, as a synchronous reduce-scatter would.
        self.wait()
        if op != dist.ReduceOp.SUM:
            n, rank = output_tensor.numel(), dist.get_rank(group)
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor[rank * n : (rank + 1) * n].view_as(output_tensor))
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


def use_gloo_fast_comms(root, layers, can_defer_reduction):
    """Give every FSDP unit the gloo collectives above; returns the shared reduce-scatter,
    whose `wait()` must run before gradients are read."""
    reduce_scatter = ReduceScatterInBackground(can_defer_reduction)
    for unit in [root] + list(layers):
        unit.set_custom_all_gather(BroadcastAllGather())
        unit.set_custom_reduce_scatter(reduce_scatter)
    return reduce_scatter


def prefetch_in_background(root, units):
    """Overlap each layer's all-gather with the compute before it. On a GPU FSDP2 does so
    with its own CUDA streams; a CPU has none, so every gather would stall the layer that
    needs it. Instead each unit prefetches the next in forward (the root the first layer),
    and unshards are asynchronous: the broadcasts run in gloo's thread while the current
    layer computes, forward and backward (FSDP2's implicit backward prefetch). One more
    layer is gathered at a time, as on a GPU."""
    chain_forward_prefetch(root, units)
    root._set_unshard_async_op(True)  # private in torch 2.13; applies to every unit below the root


def chain_forward_prefetch(root, units):
    """The root prefetches the first of `units` in forward, each unit the next, the last
    none. LayerDrop re-chains before each micro-batch over the layers it runs, so that no
    skipped layer is gathered (FSDP2 would drop that gather unused at the end of backward)."""
    chain = [root] + list(units)
    for unit, following in zip(chain, chain[1:] + [None]):
        unit.set_modules_to_forward_prefetch([] if following is None else [following])
