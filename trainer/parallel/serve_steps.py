"""The serving engine's operations sent from rank 0 to the other ranks (serve with a model
sharded across ranks).

Under FSDP every forward all-gathers each layer's shards, a collective that every rank
must join with the same inputs' shapes. Rank 0 alone takes requests and decides each
step's batch (trainer/inference/engine.py); it broadcasts each operation — a row added or
removed, a forward's token ids and rows — before running it, and the other ranks run the
same one on their own KV cache (`follow_ops`), so their caches stay equal to rank 0's.
"""

import torch.distributed as dist


def broadcast_op(op, group=None):
    """Send `op` (plain data: tuples, lists, ints) from rank 0 to every rank of `group`."""
    dist.broadcast_object_list([op], src=0, group=group)


def receive_op(group=None):
    """The next op broadcast by rank 0 (ranks other than 0)."""
    received = [None]
    dist.broadcast_object_list(received, src=0, group=group)
    return received[0]
