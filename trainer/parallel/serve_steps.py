"""The serving engine's operations sent from rank 0 to the other ranks (serve with a model
sharded across ranks).

Under FSDP every forward all-gathers each layer's shards, a collective that every rank
must join with the same inputs' shapes. Rank 0 alone takes requests and decides each
step's batch (trainer/serve/engine.py); it broadcasts each operation — a row added or
removed, a forward's token ids and rows — before running it, and the other ranks run the
same one on their own KV cache (`follow_ops`), so their caches stay equal to rank 0's.
"""

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

# A server may wait days for its next request: the ranks that follow wait that long in the
# broadcast of rank 0's next op, so the ops travel on a group of their own that never times
# out in practice (the forwards' all-gathers keep the job's --heartbeat-timeout).
IDLE_TIMEOUT = timedelta(days=365)


def shard_for_serving(model, device):
    """Shard `model` (a TransformerLM) over every rank of the job, as training's FSDP does:
    each layer's weights are gathered for its forward and freed after it, so a rank holds
    1/world of the weights at rest plus one layer."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def op_group():
    """The group rank 0's ops are broadcast on: gloo (plain objects, no device copies, even
    when the forwards run on NCCL), with IDLE_TIMEOUT. Every rank must call it, in step."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def broadcast_op(op, group=None):
    """Send `op` (plain data: tuples, lists, ints) from rank 0 to every rank of `group`."""
    dist.broadcast_object_list([op], src=0, group=group)


def receive_op(group=None):
    """The next op broadcast by rank 0 (ranks other than 0)."""
    received = [None]
    dist.broadcast_object_list(received, src=0, group=group)
    return received[0]
