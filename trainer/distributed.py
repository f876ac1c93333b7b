"""Where this process runs: device, rank, world size, process group.

The only place (with parallelize.py) that decides devices and process groups. CUDA +
NCCL where a GPU exists, CPU + gloo otherwise — one code path with different devices.
"""
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_master(self):
        return self.rank == 0

    @property
    def initialized(self):
        return dist.is_available() and dist.is_initialized()


def select_device(cfg, local_rank=0):
    if torch.cuda.is_available() and not cfg.common.cpu:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(cfg, needs_process_group):
    """Start this rank. A single rank joins a process group only when its backend needs
    one (FSDP2's fully_shard works on a one-rank mesh, so the sharded path is the same
    code at every world size)."""
    device = select_device(cfg)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=device)
    if needs_process_group and not env.initialized:
        port = cfg.distributed_training.distributed_port
        store = dist.TCPStore("127.0.0.1", port if port > 0 else free_port(), 1, is_master=True)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                store=store, rank=0, world_size=1)
    return env


def teardown():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_sum(values, env):
    """Sum a list of floats over ranks (one collective); the identity on one rank."""
    if env.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
