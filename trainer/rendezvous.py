"""How this process finds the other ranks of its job, decided before torch is loaded.

One code path, four ways in (fairseq's `infer_init_method`):
1. `--distributed-world-size N` on one host spawns N local ranks itself;
2. under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) it joins;
3. under SLURM srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST) it joins;
   with one task per node each task spawns its node's ranks (by default one per GPU; a job of
   one task too, on 127.0.0.1);
4. `--distributed-init-method tcp://host:port` with `--distributed-rank` is explicit: this
   host spawns one rank per GPU (the whole world size on a CPU host), or with
   `--distributed-no-spawn` is one rank, on GPU `--device-id`. Under torchrun and srun's
   task per rank that flag is what happens anyway; alone with more than one rank it is refused.
GPUs are counted without torch (trainer/host.py).

Nothing here imports torch: a launcher that spawns local ranks never needs it (they are
forked from a server that has imported it, trainer/launch/local_ranks.py).
"""

import ipaddress
import os
import socket
import subprocess
from dataclasses import dataclass
from urllib.parse import urlsplit

from trainer.errors import UsageError
from trainer.host import visible_gpu_count


@dataclass
class Rendezvous:
    """How this process finds the others; `spawn` > 0 means start that many local ranks."""

    init_method: str
    world_size: int
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    spawn: int = 0


def infer_rendezvous(cfg, environ=None, gpus=None):
    """`gpus`: the GPUs a rank here may use (default: counted, trainer/host.py; 0 under --cpu)."""
    env = os.environ if environ is None else environ
    if gpus is None:
        gpus = 0 if cfg.common.cpu else visible_gpu_count(env)
    rdv = _infer(cfg.distributed_training, env, gpus)
    device_id = cfg.distributed_training.device_id
    if device_id is not None:
        if rdv.spawn > 1:
            raise UsageError(
                f"--device-id picks the GPU of a process that runs one rank; the {rdv.spawn} ranks spawned "
                "here each take their own: drop it, or start one process per rank with --distributed-no-spawn"
            )
        rdv.local_rank = device_id
    return rdv


def _infer(dist_cfg, env, gpus):
    if dist_cfg.distributed_init_method:
        if dist_cfg.distributed_no_spawn:  # fairseq: this process is rank --distributed-rank, on GPU --device-id
            return Rendezvous(
                dist_cfg.distributed_init_method,
                dist_cfg.distributed_world_size,
                rank=dist_cfg.distributed_rank,
                local_rank=int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0))),  # torchrun's, else srun's
            )
        # fairseq's call_main: this host starts one rank per GPU (all of the world size on a
        # CPU host), ranks --distributed-rank, --distributed-rank + 1, …
        local = min(gpus, dist_cfg.distributed_world_size) if gpus else dist_cfg.distributed_world_size
        return Rendezvous(
            dist_cfg.distributed_init_method,
            dist_cfg.distributed_world_size,
            rank=dist_cfg.distributed_rank,
            local_world_size=local,
            spawn=local,
        )
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return Rendezvous(
            f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
            int(env["WORLD_SIZE"]),
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        )
    world = dist_cfg.distributed_world_size
    if "SLURM_PROCID" in env:
        if int(env.get("SLURM_NTASKS", "1")) > 1:
            return slurm_rendezvous(dist_cfg, env, gpus)
        if world == 1 and gpus > 1 and not dist_cfg.distributed_no_spawn:
            world = gpus  # fairseq's one task per node, in a job of one task: a rank per GPU here
    if world > 1:
        if dist_cfg.distributed_no_spawn:  # fairseq would wait, rank 0 of N, on a random port
            raise UsageError(
                f"--distributed-no-spawn runs this process as one of {world} ranks, but nothing tells it where "
                "the others are: pass --distributed-init-method tcp://HOST:PORT with --distributed-rank, or "
                f"drop --distributed-no-spawn to spawn all {world} here"
            )
        port = dist_cfg.distributed_port if dist_cfg.distributed_port > 0 else free_port()
        return Rendezvous(f"tcp://127.0.0.1:{port}", world, local_world_size=world, spawn=world)
    return Rendezvous("", 1)


def slurm_rendezvous(d, env, gpus=0):
    """Master = first host of the job's node list. One task per rank: rank from
    SLURM_PROCID. Or fairseq's other mode: one task per node, each spawning its node's ranks:
    --distributed-world-size of them over all nodes, or without it one per GPU (`gpus` per node);
    --distributed-no-spawn keeps each task one rank."""
    ntasks, nnodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
    world = d.distributed_world_size
    if d.distributed_no_spawn and world not in (1, ntasks):  # each task is one rank, whatever the tasks per node
        raise UsageError(
            f"--distributed-no-spawn makes each of SLURM's {ntasks} tasks one rank, but "
            f"--distributed-world-size is {world}: launch {world} tasks, or drop --distributed-no-spawn"
        )
    task_per_node = ntasks == nnodes and not d.distributed_no_spawn
    if world == 1 and task_per_node and gpus > 1:
        world = nnodes * gpus  # fairseq's default: every visible GPU of every node
    per_node_spawn = world > ntasks and task_per_node
    if per_node_spawn and world % nnodes:
        raise UsageError(f"--distributed-world-size {world} is not a multiple of the job's {nnodes} nodes")
    if not per_node_spawn and world not in (1, ntasks):
        raise UsageError(
            f"--distributed-world-size {world} disagrees with SLURM_NTASKS={ntasks}; launch one "
            "task per rank, or one task per node with the total number of ranks, or drop the flag"
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise UsageError("SLURM_PROCID is set but SLURM_JOB_NODELIST is not; run under srun or sbatch")
    port = d.distributed_port if d.distributed_port > 0 else 10000 + int(env.get("SLURM_JOB_ID", "0")) % 50000
    init_method = f"tcp://{first_host(nodelist)}:{port}"
    if per_node_spawn:
        per_node = world // nnodes
        node = int(env.get("SLURM_NODEID", env["SLURM_PROCID"]))
        return Rendezvous(init_method, world, rank=node * per_node, local_world_size=per_node, spawn=per_node)
    return Rendezvous(
        init_method,
        ntasks,
        rank=int(env["SLURM_PROCID"]),
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        local_world_size=_tasks_per_node(env, ntasks, nnodes),
    )


def check_gloo_address(rdv, environ=None):
    """Refuse, before any rank starts, a job across hosts whose gloo groups could not connect."""
    problem = gloo_address_problem(rdv, os.environ if environ is None else environ, socket.gethostname(), _address)
    if problem:
        raise UsageError(problem)


def gloo_address_problem(rdv, environ, hostname, resolve):
    """Why gloo (the CPU groups every run makes, NCCL runs included) cannot reach this host
    from the others, or None. Unless GLOO_SOCKET_IFNAME names an interface, gloo binds to
    the address this host's name resolves to, and tells the other hosts to connect there:
    on a default Ubuntu /etc/hosts that is 127.0.1.1, their own loopback, and the job hangs
    or fails at its first collective. `resolve(name)`: the name's first address, or None."""
    if rdv.world_size <= rdv.local_world_size or environ.get("GLOO_SOCKET_IFNAME"):
        return None  # every rank is on this host
    master = urlsplit(rdv.init_method).hostname if rdv.init_method.startswith("tcp://") else None
    if master and master.split(".")[0] != hostname.split(".")[0] and _is_loopback(_resolved(master, resolve)):
        return None  # no other host could reach a loopback master: every rank is on this host
    address = _resolved(hostname, resolve)
    fix = (
        "set GLOO_SOCKET_IFNAME to the network interface the other hosts reach this host by "
        "(e.g. GLOO_SOCKET_IFNAME=eth0; `ip -brief address` lists them)"
    )
    spans = f"this job spans hosts, but this host's name {hostname}"
    if address is None:
        return f"{spans} does not resolve (gloo falls back to loopback); {fix}"
    if _is_loopback(address):
        return f"{spans} resolves to {address} (loopback), the address gloo would give the other hosts; {fix}"
    return None


def _resolved(name, resolve):
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return resolve(name)


def _address(name):
    """The first address `name` resolves to here (what gloo binds to), or None."""
    try:
        return socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError, IndexError):
        return None


def _is_loopback(address):
    try:
        return address is not None and ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def first_host(nodelist):
    """`scontrol show hostnames` expands SLURM's compressed list (node[01-04],gpu7); the list
    is passed as one argument, never through a shell."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True
        ).stdout
    except FileNotFoundError:
        raise UsageError(
            "SLURM variables are set but `scontrol` is not on PATH; pass --distributed-init-method tcp://HOST:PORT"
        ) from None
    except subprocess.CalledProcessError as e:
        raise UsageError(
            f"scontrol could not expand SLURM_JOB_NODELIST={nodelist!r}: {(e.stderr or '').strip()}"
        ) from None
    hosts = out.split()
    if not hosts:
        raise UsageError(f"scontrol expanded SLURM_JOB_NODELIST={nodelist!r} to no hosts")
    return hosts[0]


def _tasks_per_node(env, ntasks, nnodes):
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "2(x3)" → 2
    return int(per_node) if per_node.isdigit() else max(ntasks // max(nnodes, 1), 1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
