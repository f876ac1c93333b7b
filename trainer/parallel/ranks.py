"""Where each rank runs once it is started: device, threads, process group. How a process
finds its job's ranks (the four ways in) is trainer/rendezvous.py's. CUDA + NCCL (and
gloo for CPU tensors) where a GPU exists, one GPU per rank; CPU + gloo otherwise.
"""

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.cpu.rank import prepare_cpu_rank
from trainer.errors import UsageError
from trainer.host import usable_cores

RENDEZVOUS_TIMEOUT = timedelta(minutes=30)


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    init_method: str = ""
    # Ranks are ordered data × context × tensor: --model-parallel-size consecutive ranks
    # split one model replica (tensor parallelism), --context-parallel-size groups of them
    # split each sequence's positions; all of these read the same batches.
    tp: int = 1
    cp: int = 1
    # The ranks whose tokens are other than this one's, with it (all but its tensor-parallel
    # copies): token counts, losses and validation sums run over them. None: all ranks.
    data_group: object = None
    cp_group: object = None  # this rank's context group (None without one)

    @property
    def is_master(self):
        return self.rank == 0

    @property
    def data_rank(self):
        """Which share of the batches this rank reads."""
        return self.rank // (self.tp * self.cp)

    @property
    def data_size(self):
        """How many shares the batches are split into."""
        return self.world_size // (self.tp * self.cp)

    @property
    def cp_rank(self):
        """Which of its context group's shares of each sequence this rank holds."""
        return self.rank // self.tp % self.cp

    @property
    def token_ranks(self):
        """How many ranks hold tokens of their own (data × context)."""
        return self.world_size // self.tp


def select_device(cfg, local_rank=0, local_world_size=1):
    if torch.cuda.is_available() and not cfg.common.cpu:
        torch.cuda.set_device(cuda_device_index(local_rank, local_world_size, torch.cuda.device_count(), os.environ))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cuda_device_index(local_rank, local_world_size, device_count, environ):
    """The GPU of local rank `local_rank`: its own, never one another rank of the node has.
    A process shown one GPU by CUDA_VISIBLE_DEVICES (a scheduler's per-task binding, srun
    --gpus-per-task=1) uses that one, whatever its local rank."""
    if local_rank < device_count:
        return local_rank
    visible = environ.get("CUDA_VISIBLE_DEVICES", "")
    if device_count == 1 and visible.strip() and "," not in visible:
        return 0
    if local_world_size > device_count:
        raise UsageError(
            f"{local_world_size} ranks on this node but {device_count} visible GPU(s): two ranks would share one; "
            f"start at most {device_count} ranks per node (--distributed-world-size, torchrun --nproc-per-node, "
            "srun --ntasks-per-node), or pass --cpu"
        )
    raise UsageError(
        f"--device-id {local_rank} (this process's local rank): this node has {device_count} visible GPU(s), "
        f"numbered from 0; pass --device-id below {device_count}, or --cpu"
    )


def process_group_backend(device):
    """The default group's backends: a CUDA rank's group also has gloo for CPU tensors (GradScaler
    all-reduces a CPU found_inf under --cpu-offload; NCCL has no CPU side), as torchtitan's does."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def host_threads(device, cpu_offload, local_world_size, cores):
    """Threads a rank computes with on the host, or None for torch's default (every core, or
    torchrun's OMP_NUM_THREADS=1): ranks on one host share its cores, or they fight over them.
    A CPU rank computes there; a GPU rank does under --cpu-offload (the optimizer step)."""
    if local_world_size < 2 or (device.type != "cpu" and not cpu_offload):
        return None
    return max(cores // local_world_size, 1)


def nccl_error_handling(environ):
    """The environment a CUDA rank's NCCL groups are made with, unless the user chose: a failed
    or timed-out collective aborts its communicator and the rank's next collective raises
    ("NCCL communicator was aborted"), which trainer/parallel/lost_peer.py turns into one line;
    torch's default (3) has the watchdog take the process down with SIGABRT instead."""
    chosen = ("ASYNC_ERROR_HANDLING", "BLOCKING_WAIT")  # TORCH_NCCL_…, or NCCL_… (the old names)
    if any(f"{prefix}{knob}" in environ for prefix in ("TORCH_NCCL_", "NCCL_") for knob in chosen):
        return {}
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def init_rank(cfg, rdv, needs_process_group):
    """Join the job as rank `rdv.rank`. One rank joins a (one-rank) group only when its
    backend needs one: FSDP2 shards on a one-rank mesh with the same code."""
    device = select_device(cfg, rdv.local_rank, rdv.local_world_size)
    if device.type == "cpu":
        prepare_cpu_rank(cfg, rdv)
    threads = host_threads(device, cfg.distributed_training.cpu_offload, rdv.local_world_size, usable_cores())
    if threads is not None:
        torch.set_num_threads(threads)
    tp, cp = cfg.common.model_parallel_size, cfg.common.context_parallel_size
    if rdv.world_size % (tp * cp):
        raise UsageError(
            f"--model-parallel-size {tp} × --context-parallel-size {cp} must divide the world size {rdv.world_size}"
        )
    env = DistEnv(rdv.rank, rdv.world_size, rdv.local_rank, rdv.local_world_size, device, rdv.init_method, tp, cp)
    if rdv.world_size > 1 or (needs_process_group and not dist.is_initialized()):
        if rdv.init_method:
            # The store keeps the long timeout: ranks of a cluster job start minutes apart,
            # and only collectives should give up after --heartbeat-timeout.
            store, _, _ = next(dist.rendezvous(rdv.init_method, rdv.rank, rdv.world_size, timeout=RENDEZVOUS_TIMEOUT))
        else:  # one rank alone: nobody to meet
            store = dist.HashStore()
        if device.type == "cuda":
            os.environ.update(nccl_error_handling(os.environ))  # read when the NCCL group is made
        dist.init_process_group(
            backend=process_group_backend(device),
            store=store,
            rank=rdv.rank,
            world_size=rdv.world_size,
            timeout=collective_timeout(cfg),
        )
    world = rdv.world_size
    if tp > 1:
        env.data_group, _ = dist.new_subgroups_by_enumeration([list(range(t, world, tp)) for t in range(tp)])
    if cp > 1:
        env.cp_group, _ = dist.new_subgroups_by_enumeration(
            [[base + c * tp for c in range(cp)] for base in range(world) if base // tp % cp == 0]
        )
    return env


def collective_timeout(cfg):
    """How long a collective waits for the other ranks: --heartbeat-timeout seconds, else
    30 minutes. A rank that died or hangs ends the job after that, not never."""
    seconds = cfg.distributed_training.heartbeat_timeout
    return timedelta(seconds=seconds) if seconds > 0 else RENDEZVOUS_TIMEOUT


def teardown():
    if dist.is_available() and dist.is_initialized():
        # DDP's reducer must go before its process group, or its destructor aborts the
        # process at exit; the model is unreachable by now but may sit in a cycle.
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(values, env):
    """Sum a list of numbers over ranks (one collective) and read the sums on the host: the
    caller waits for the device. Not for what an update does every time (see on_device_sum)."""
    if env.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def data_sum(values, env):
    """all_reduce_sum over the ranks whose tokens are their own (env.data_group): the ranks
    of one tensor-parallel group saw the same ones (token counts, validation sums)."""
    if env.token_ranks == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, group=env.data_group)
    return t.tolist()


def on_device(values, env):
    """Host numbers as a float64 tensor on the rank's device, copied without waiting for it:
    from pinned memory, queued (a plain copy, or one from pageable memory, may wait for the
    device's queue to drain first)."""
    if env.device.type != "cuda":
        return torch.tensor(values, dtype=torch.float64, device=env.device)
    return torch.tensor(values, dtype=torch.float64, pin_memory=True).to(env.device, non_blocking=True)


def on_device_sum(tensor, env):
    """`tensor` summed over the ranks whose tokens are their own (all but tensor
    parallelism's copies), in place, left on the device: the host goes on at once (NCCL queues the sum
    behind the work that computes it; gloo's is done on return)."""
    if env.token_ranks > 1:
        dist.all_reduce(tensor, group=env.data_group)
    return tensor


class HostCopy:
    """A small device tensor brought to the host without stopping the device: the copy is
    queued behind the work that computes it (pinned memory, an event), and `read()` is called
    later, once the host has queued more work behind it, so the device never runs dry
    waiting for the host. On a CPU the tensor already is on the host."""

    def __init__(self, tensor):
        self.event = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor.detach()

    def read(self):
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class AsyncHostSum:
    """Sums of host numbers over ranks that the caller never waits for: `post()` starts one
    on a gloo group of its own (host values never touch the GPU, nor queue behind its
    collectives), `result()` returns the one posted before, finished by then. Every rank
    must post and read at the same points."""

    def __init__(self, env, timeout):
        self.group = dist.new_group(backend="gloo", timeout=timeout) if env.world_size > 1 else None
        self.posted = self.work = None

    def post(self, values):
        self.posted = torch.tensor(values, dtype=torch.float64)
        if self.group is not None:
            self.work = dist.all_reduce(self.posted, group=self.group, async_op=True)

    def result(self):
        """The sums last posted (None if nothing is), waiting for them if they are not in yet."""
        if self.posted is None:
            return None
        if self.work is not None:
            self.work.wait()
        sums, self.posted, self.work = self.posted.tolist(), None, None
        return sums
