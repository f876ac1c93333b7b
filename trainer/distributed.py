"""Where each rank runs once it is started: device, threads, process groups, and what a
failed collective means. How a process finds its job's ranks (the four ways in) is
trainer/rendezvous.py's. CUDA + NCCL where a GPU exists, CPU + gloo otherwise.
"""
import gc
import logging
import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer import host_allocator
from trainer.config import SHARDED_BACKENDS
from trainer.launch import RankStopped, resume_hint
from trainer.rendezvous import free_port

RENDEZVOUS_TIMEOUT = timedelta(minutes=30)
logger = logging.getLogger("shardlm")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    init_method: str = ""

    @property
    def is_master(self):
        return self.rank == 0


def select_device(cfg, local_rank=0):
    if torch.cuda.is_available() and not cfg.common.cpu:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_rank(cfg, rdv, needs_process_group):
    """Join the job as rank `rdv.rank`. One rank joins a (one-rank) group only when its
    backend needs one: FSDP2 shards on a one-rank mesh with the same code."""
    device = select_device(cfg, rdv.local_rank)
    use_host_allocator(cfg, device, rdv.rank)
    if device.type == "cpu" and rdv.local_world_size > 1:
        # Ranks on one host share its cores; without a split they fight over them.
        torch.set_num_threads(max(cpu_count() // rdv.local_world_size, 1))
    env = DistEnv(rdv.rank, rdv.world_size, rdv.local_rank, rdv.local_world_size, device, rdv.init_method)
    if rdv.world_size > 1 or (needs_process_group and not dist.is_initialized()):
        init_method = rdv.init_method or f"tcp://127.0.0.1:{free_port()}"
        # The store keeps the long timeout: ranks of a cluster job start minutes apart, and
        # only collectives should give up after --heartbeat-timeout.
        store, _, _ = next(dist.rendezvous(init_method, rdv.rank, rdv.world_size, timeout=RENDEZVOUS_TIMEOUT))
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", store=store,
                                rank=rdv.rank, world_size=rdv.world_size, timeout=collective_timeout(cfg))
    return env


def collective_timeout(cfg):
    """How long a collective waits for the other ranks: --heartbeat-timeout seconds, else
    30 minutes. A rank that died or hangs ends the job after that, not never."""
    seconds = cfg.distributed_training.heartbeat_timeout
    return timedelta(seconds=seconds) if seconds > 0 else RENDEZVOUS_TIMEOUT


# What gloo says when the other end of a collective died (the kernel closed its sockets)
# or stopped answering for longer than the collective timeout.
CLOSED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")
TIMED_OUT = ("Timed out", "timed out", "timeout", "Timeout")


def peer_lost(error, cfg, env):
    """A RankStopped naming the lost rank when `error` is a collective failing because
    another rank died or hangs; None for any other error."""
    collective_error = isinstance(error, (RuntimeError, OSError)) or \
        type(error).__name__ == "CheckpointException"  # DCP wraps a failed save or load in it
    if env.world_size < 2 or not collective_error:
        return None
    text, hint = str(error), resume_hint(cfg, "train")
    peer = f"rank {1 - env.rank}" if env.world_size == 2 else "a peer rank"
    address = re.search(r"\[([^\]]+)\]:(\d+)", text)
    at = f" at {address.group(1)}" if address and env.world_size > 2 else ""
    if any(m in text for m in CLOSED):
        return RankStopped(f"lost {peer}{at}: its connection closed (the process died or was killed); "
                           f"{hint}")
    if any(m in text for m in TIMED_OUT):
        seconds = collective_timeout(cfg).total_seconds()
        return RankStopped(f"{peer}{at} did not answer for {seconds:g} s (--heartbeat-timeout): it died or "
                           f"hangs; {hint}")
    return None


def use_host_allocator(cfg, device, rank):
    """Install `--host-allocator caching` (trainer/host_allocator.py) in this rank; where it
    cannot be built, or with `--host-allocator glibc`, tune glibc for this kind of rank."""
    if cfg.common.host_allocator == "caching":
        try:
            host_allocator.install()
            return
        except host_allocator.Unavailable as e:
            if rank == 0:
                logger.warning("--host-allocator caching is not available (%s): using glibc's", e)
    if device.type == "cpu":
        if cfg.distributed_training.ddp_backend in SHARDED_BACKENDS:
            return_large_frees_to_os()
        else:
            keep_freed_memory()


def _mallopt(**settings):
    """Tune glibc's allocator, unless the user already did through the environment."""
    if any(k.startswith("MALLOC_") for k in os.environ) or "malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except (OSError, AttributeError):
        return  # not glibc: nothing to tune
    for name, value in settings.items():
        libc.mallopt({"M_TRIM_THRESHOLD": -1, "M_MMAP_THRESHOLD": -3}[name], value)


def keep_freed_memory(mmap_threshold=64 << 20, trim_threshold=1 << 30):
    """Keep what a step frees in the heap for the next step, as a GPU's caching allocator does.

    An unsharded rank allocates and frees the same tensors every step. glibc's defaults map
    every block of 32 MiB or more afresh and give the heap's top back to the OS once 64 MiB
    of it is free, so each step faults those pages in again, zeroed by the kernel. On
    bench_mfu's model (13.9 M, bf16, 2,048 tokens per step) that was 38-45 k page faults
    and 60 ms of system time per 420 ms step; with blocks up to 64 MiB served from the heap
    and up to 1 GiB of free top kept, none, and steps of 345-380 ms, at the same peak
    resident set (823-845 MB both ways, interleaved, 2026-11-25); DDP on bench_fsdp's 2 ranks
    (109 M, fp32): 261-271 tokens/s against 230-237, at 2.65-2.68 GB per rank both ways.
    FSDP ranks do the opposite (return_large_frees_to_os): kept, their freed blocks held
    2.12 GB per rank instead of 1.50, for 250 tokens/s instead of 212. Setting either value
    turns off glibc's own adjustment of both, so both are set; MALLOC_* in the environment
    (or GLIBC_TUNABLES) overrides all of this."""
    _mallopt(M_MMAP_THRESHOLD=mmap_threshold, M_TRIM_THRESHOLD=trim_threshold)


def return_large_frees_to_os(threshold=1 << 20):
    """Serve allocations above 1 MiB by mmap, so freeing them returns the pages at once.

    On CPU, tensors live in glibc's heap. Its default mmap threshold grows to the size of
    any large block freed, after which FSDP's per-layer gather buffers (allocated and
    freed every layer) are recycled inside the heap and the process keeps its high-water
    mark. The fresh pages are not free. On bench_fsdp's model (2 ranks, 109 M), FSDP
    peaks at 1.50 GB per rank with this threshold against 1.98-2.05 GB with glibc's
    default, and does 178-190 tokens/s against 191-194 (DDP: 192-196; interleaved,
    2026-11-24), with 3 s more system time per run; reusing the layers' all-gather and
    reduce-scatter buffers (trainer/gloo_comms.LayerBufferPool) wins back most of that
    on several ranks. Unsharded runs do the opposite (keep_freed_memory): there the fresh
    pages cost more (fp32 tokens/s fell to 0.81x on the single-process benchmark) and
    there is no sharding for the memory to show."""
    _mallopt(M_MMAP_THRESHOLD=threshold)


def teardown():
    if dist.is_available() and dist.is_initialized():
        # DDP's reducer must go before its process group, or its destructor aborts the
        # process at exit; the model is unreachable by now but may sit in a cycle.
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(values, env):
    """Sum a list of numbers over ranks (one collective); the identity on one rank."""
    if env.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
