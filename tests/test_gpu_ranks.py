"""What a rank decides on a GPU host, tested on this CPU one (issue 47): each decision is a
small function of what the host has (GPU count, environment, /dev entries, an error's text),
called here with a GPU host's values; the one-line errors users see are checked through the
real entry points where one exists."""

import faulthandler
import multiprocessing
import os
import socket

import pytest
import torch
from test_launch import fake_scontrol
from torch.distributed import DistBackendError
from torch.distributed.distributed_c10d import BackendConfig

from helpers import DUMMY, compose
from trainer.errors import UsageError
from trainer.host import runs_on_gpu, visible_gpu_count
from trainer.launch.launcher import join_ranks, launch
from trainer.parallel.lost_peer import peer_lost
from trainer.parallel.ranks import DistEnv, cuda_device_index, host_threads, nccl_error_handling, process_group_backend
from trainer.rendezvous import Rendezvous, gloo_address_problem, infer_rendezvous

ARGS = DUMMY + ["--batch-size", "2"]


# 1. The default process group of a CUDA rank also has a CPU backend -----------------------


def test_a_cuda_rank_groups_nccl_for_cuda_tensors_and_gloo_for_cpu_ones():
    # GradScaler's DTensor unscale under --cpu-offload all-reduces a CPU found_inf on this group
    assert BackendConfig(process_group_backend(torch.device("cuda", 3))).get_device_backend_map() == {
        "cuda": "nccl",
        "cpu": "gloo",
    }
    assert process_group_backend(torch.device("cpu")) == "gloo"


# 5. --distributed-init-method spawns this host's GPUs, not the whole world --------------------


def _init_method(*extra):
    return compose(ARGS + ["--distributed-init-method", "tcp://node1:9999", *extra])


def test_an_init_method_spawns_one_rank_per_gpu_of_this_host_from_its_first_rank():
    # fairseq's call_main: nprocs = min(device_count, world size), ranks start_rank + i
    cfg = _init_method("--distributed-world-size", "16", "--distributed-rank", "8")
    rdv = infer_rendezvous(cfg, environ={}, gpus=4)
    assert (rdv.init_method, rdv.world_size, rdv.rank, rdv.spawn, rdv.local_world_size) == (
        "tcp://node1:9999",
        16,
        8,
        4,
        4,
    )
    assert infer_rendezvous(_init_method("--distributed-world-size", "2"), environ={}, gpus=8).spawn == 2
    # a CPU host (or --cpu) spawns the world size here, as before
    rdv = infer_rendezvous(cfg, environ={}, gpus=0)
    assert (rdv.spawn, rdv.local_world_size) == (16, 16)


def test_no_spawn_takes_its_gpu_from_device_id_or_local_rank():
    cfg = _init_method("--distributed-world-size", "16", "--distributed-rank", "5", "--distributed-no-spawn")
    rdv = infer_rendezvous(cfg, environ={}, gpus=8)
    assert (rdv.rank, rdv.spawn, rdv.local_rank) == (5, 0, 0)
    assert infer_rendezvous(cfg, environ={"LOCAL_RANK": "5"}, gpus=8).local_rank == 5
    with_id = _init_method(
        "--distributed-world-size", "16", "--distributed-rank", "5", "--distributed-no-spawn", "--device-id", "3"
    )
    assert infer_rendezvous(with_id, environ={"LOCAL_RANK": "5"}, gpus=8).local_rank == 3
    assert infer_rendezvous(compose(ARGS + ["--device-id", "2"]), environ={}, gpus=8).local_rank == 2  # one process


def test_no_spawn_under_srun_takes_its_gpu_from_slurm_localid():
    # the help's default: $LOCAL_RANK (torchrun's), else $SLURM_LOCALID (srun's), else 0
    cfg = _init_method("--distributed-world-size", "16", "--distributed-rank", "11", "--distributed-no-spawn")
    srun = dict(SLURM_PROCID="11", SLURM_LOCALID="3", SLURM_NTASKS="16", SLURM_NNODES="2")
    assert infer_rendezvous(cfg, environ=srun, gpus=8).local_rank == 3
    assert infer_rendezvous(cfg, environ={**srun, "LOCAL_RANK": "5"}, gpus=8).local_rank == 5


def test_device_id_takes_each_spelling_a_launcher_passes():
    # torch.distributed.launch passes --local-rank since torch 2.0, --local_rank before
    for argv in (["--device-id", "3"], ["--local_rank", "3"], ["--local-rank", "3"], ["--local-rank=3"]):
        assert compose(ARGS + argv).distributed_training.device_id == 3, argv


def test_no_spawn_without_an_init_method_is_refused_unless_the_environment_starts_the_ranks(tmp_path, monkeypatch):
    # fairseq would pick a random localhost port for rank 0 of 2 and wait there for a rank that
    # could never find it: refused, naming the fix, instead of spawning 2 ranks regardless
    no_spawn = compose(ARGS + ["--distributed-world-size", "2", "--distributed-no-spawn"])
    with pytest.raises(
        UsageError, match=r"--distributed-no-spawn.*--distributed-init-method tcp://HOST:PORT.*--distributed-rank"
    ):
        infer_rendezvous(no_spawn, environ={}, gpus=2)
    assert infer_rendezvous(compose(ARGS + ["--distributed-no-spawn"]), environ={}, gpus=8).spawn == 0  # one rank
    # torchrun and srun's task per rank start every rank: the flag says what they do
    torchrun = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="node1", MASTER_PORT="29500")
    rdv = infer_rendezvous(compose(ARGS + ["--distributed-no-spawn"]), environ=torchrun, gpus=8)
    assert (rdv.rank, rdv.world_size, rdv.spawn) == (1, 2, 0)
    # one srun task per node: each task is one rank, not its node's spawner
    monkeypatch.setenv("PATH", f"{fake_scontrol(tmp_path, ['gpu-a17', 'gpu-a18'])}:{os.environ['PATH']}")
    slurm = dict(
        SLURM_PROCID="1", SLURM_NODEID="1", SLURM_NTASKS="2", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu-a[17-18]"
    )
    rdv = infer_rendezvous(compose(ARGS + ["--distributed-no-spawn"]), environ=slurm, gpus=8)
    assert (rdv.world_size, rdv.rank, rdv.spawn) == (2, 1, 0)
    with pytest.raises(UsageError, match="--distributed-no-spawn"):
        infer_rendezvous(
            compose(ARGS + ["--distributed-no-spawn", "--distributed-world-size", "16"]), environ=slurm, gpus=8
        )


def test_device_id_with_spawned_ranks_is_refused():
    cfg = compose(ARGS + ["--distributed-world-size", "2", "--device-id", "1"])
    with pytest.raises(UsageError, match="--device-id.*--distributed-no-spawn"):
        infer_rendezvous(cfg, environ={}, gpus=2)


# 6. Never two ranks on one GPU without a word ----------------------------------------------


def test_a_rank_gets_its_own_gpu_or_a_one_line_refusal():
    assert [cuda_device_index(i, 4, 4, {}) for i in range(4)] == [0, 1, 2, 3]
    with pytest.raises(UsageError, match=r"^8 ranks on this node but 4 visible GPU\(s\).*at most 4 .*--cpu"):
        cuda_device_index(5, 8, 4, {})
    with pytest.raises(UsageError, match=r"--device-id 5.*4 visible GPU\(s\)"):
        cuda_device_index(5, 1, 4, {})
    # a scheduler that binds each task to one GPU (srun --gpus-per-task=1) shows it as device 0
    assert cuda_device_index(3, 8, 1, {"CUDA_VISIBLE_DEVICES": "3"}) == 0
    with pytest.raises(UsageError, match="2 ranks on this node but 1 visible GPU"):
        cuda_device_index(1, 2, 1, {})


# 7. SLURM, one task per node, no --distributed-world-size: every GPU of every node --------------


def test_one_slurm_task_per_node_spawns_every_visible_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_scontrol(tmp_path, ['gpu-a17', 'gpu-a18'])}:{os.environ['PATH']}")
    env = dict(
        SLURM_PROCID="1",
        SLURM_NODEID="1",
        SLURM_LOCALID="0",
        SLURM_NTASKS="2",
        SLURM_NNODES="2",
        SLURM_JOB_ID="7",
        SLURM_JOB_NODELIST="gpu-a[17-18]",
    )
    rdv = infer_rendezvous(compose(ARGS), environ=env, gpus=8)
    assert (rdv.world_size, rdv.rank, rdv.spawn, rdv.local_world_size) == (16, 8, 8, 8)
    assert rdv.init_method == "tcp://gpu-a17:10007"
    rdv = infer_rendezvous(compose(ARGS), environ=env, gpus=0)  # CPU nodes: one rank per task, as before
    assert (rdv.world_size, rdv.rank, rdv.spawn) == (2, 1, 0)


def test_one_slurm_task_on_a_gpu_node_spawns_its_gpus(monkeypatch):
    # fairseq's SLURM init, one task per node: a job of one task is no exception
    monkeypatch.setenv("PATH", "/nonexistent")  # every rank is on this node: no scontrol needed
    one_task = dict(
        SLURM_PROCID="0",
        SLURM_NODEID="0",
        SLURM_LOCALID="0",
        SLURM_NTASKS="1",
        SLURM_NNODES="1",
        SLURM_JOB_ID="7",
        SLURM_JOB_NODELIST="gpu-a17",
    )
    rdv = infer_rendezvous(compose(ARGS), environ=one_task, gpus=8)
    assert (rdv.world_size, rdv.rank, rdv.spawn, rdv.local_world_size) == (8, 0, 8, 8)
    assert rdv.init_method.startswith("tcp://127.0.0.1:")
    for gpus in (0, 1):  # a CPU node, or one GPU: one rank, as before
        assert (infer_rendezvous(compose(ARGS), environ=one_task, gpus=gpus).spawn, gpus) == (0, gpus)
    given = infer_rendezvous(compose(ARGS + ["--distributed-world-size", "2"]), environ=one_task, gpus=8)
    assert (given.world_size, given.spawn) == (2, 2)
    assert infer_rendezvous(compose(ARGS + ["--distributed-no-spawn"]), environ=one_task, gpus=8).spawn == 0
    # no SLURM: `train` on an 8-GPU host is one rank unless --distributed-world-size says more
    rdv = infer_rendezvous(compose(ARGS), environ={}, gpus=8)
    assert (rdv.world_size, rdv.spawn) == (1, 0)


# 8. Threads for the host's share of the work -----------------------------------------------


def test_a_gpu_rank_with_cpu_offload_gets_its_share_of_the_cores():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert host_threads(cpu, False, local_world_size=4, cores=32) == 8
    assert host_threads(cuda, True, local_world_size=4, cores=32) == 8  # the CPU Adam step
    assert host_threads(cuda, False, local_world_size=4, cores=32) is None  # nothing big on the host
    assert host_threads(cuda, True, local_world_size=1, cores=32) is None  # torch's default: every core
    assert host_threads(cpu, False, local_world_size=8, cores=4) == 1


# 9. A GPU is any /dev/nvidia<N> ------------------------------------------------------------


def test_gpus_are_counted_from_any_nvidia_device_node_and_cuda_visible_devices():
    container = ["nvidia3", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "null"]
    assert visible_gpu_count({}, container) == 1
    assert visible_gpu_count({}, ["nvidiactl", "nvidia-uvm", "nvidia-caps"]) == 0
    eight = [f"nvidia{i}" for i in range(8)] + ["nvidiactl"]
    assert visible_gpu_count({}, eight) == 8
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "2,5"}, eight) == 2
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-8f2c1e4a"}, eight) == 1
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,-1,3"}, eight) == 1  # CUDA stops at an invalid entry
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, eight) == 0
    assert runs_on_gpu(compose(ARGS), {}, container)
    assert not runs_on_gpu(compose(ARGS + ["--cpu"]), {}, container)


# 12. Gloo across hosts needs a routable address ----------------------------------------------


def _resolver(table):
    return lambda name: table.get(name)


def test_gloo_across_hosts_refuses_a_hostname_that_resolves_to_loopback():
    two_nodes = Rendezvous("tcp://node1:29500", 16, rank=8, local_rank=0, local_world_size=8)
    ubuntu = _resolver({"node1": "10.0.0.1", "node2": "127.0.1.1"})
    problem = gloo_address_problem(two_nodes, {}, "node2", ubuntu)
    assert "node2 resolves to 127.0.1.1" in problem and "GLOO_SOCKET_IFNAME" in problem
    assert gloo_address_problem(two_nodes, {"GLOO_SOCKET_IFNAME": "eth0"}, "node2", ubuntu) is None
    assert gloo_address_problem(two_nodes, {}, "node2", _resolver({"node2": "10.0.0.2"})) is None
    assert "does not resolve" in gloo_address_problem(two_nodes, {}, "node2", _resolver({}))
    # the master node itself: its own name resolves to 127.0.1.1 there, and the job still spans hosts
    master = Rendezvous("tcp://node1:29500", 16, rank=0, local_world_size=8)
    assert "node1 resolves to 127.0.1.1" in gloo_address_problem(master, {}, "node1", _resolver({"node1": "127.0.1.1"}))
    # one host: every rank here, or a loopback master no other host could reach
    one_host = Rendezvous("tcp://127.0.0.1:29500", 8, local_world_size=8)
    assert gloo_address_problem(one_host, {}, "node2", ubuntu) is None
    no_spawn = Rendezvous("tcp://127.0.0.1:29500", 2, rank=1, local_world_size=1)
    assert gloo_address_problem(no_spawn, {}, "node2", ubuntu) is None


def _must_not_run(cfg, rdv):
    raise AssertionError("a rank started")


def test_the_launcher_refuses_a_loopback_hostname_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")  # resolves to loopback everywhere
    torchrun = dict(RANK="2", LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.9.9.9")
    for key, value in {**torchrun, "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert launch(compose(ARGS), target=_must_not_run) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("train: error: this job spans hosts, but this host's name localhost resolves to 127.")
    assert "GLOO_SOCKET_IFNAME" in err and len(err.splitlines()) == 1


# 13. NCCL failures are a lost rank, in one line -----------------------------------------------


def test_nccl_errors_surface_as_exceptions_unless_the_user_chose():
    assert nccl_error_handling({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # abort the communicator, raise
    assert nccl_error_handling({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}) == {}
    assert nccl_error_handling({"TORCH_NCCL_BLOCKING_WAIT": "1"}) == {}


# Texts as torch 2.x and NCCL 2.18-2.28 print them (pytorch's ProcessGroupNCCL.cpp and NCCLUtils,
# and users' reports in NVIDIA/nccl issues 1141, 1514, 1928, 2076).
REMOTE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, remote process exited or there "
    "was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or "
    "a remote process exiting prematurely.\nLast error:\nNET/IB : Got completion from peer 10.0.0.2<39138> with "
    "error 12, opcode 0, len 0, vendor err 129"
)
CLOSED_REMOTE = (
    "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, internal error, NCCL version "
    "2.14.3\nncclInternalError: Internal check failed.\nLast error:\nNet : Connection closed by remote peer "
    "node2<50260>"
)
WATCHDOG = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, "
    "OpType=_REDUCE_SCATTER_BASE, NumelIn=131072, NumelOut=65536, Timeout(ms)=600000) ran for 600081 "
    "milliseconds before timing out."
)
ABORTED = "NCCL communicator was aborted on rank 0. "
SHM = (
    "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, unhandled system error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclSystemError: System call (e.g. socket, malloc) or "
    "external library call failed or device error. \nLast error:\nError while creating shared memory segment "
    "/dev/shm/nccl-EoOvZr (size 7340384)"
)


@pytest.mark.parametrize(
    "text, line",
    [
        (REMOTE, "lost rank 1: its connection closed (the process died or was killed)"),
        (CLOSED_REMOTE, "lost rank 1: its connection closed (the process died or was killed)"),
        (WATCHDOG, "rank 1 did not answer for 1800 s (--heartbeat-timeout): it died or hangs"),
        (ABORTED + "Original reason for failure was: " + WATCHDOG, "rank 1 did not answer for 1800 s"),
        (ABORTED, "lost rank 1: NCCL aborted the collectives on this rank"),
    ],
)
def test_nccl_failures_name_the_lost_rank(text, line):
    cfg = compose(ARGS)
    env = DistEnv(0, 2, 0, 2, torch.device("cpu"))
    lost = peer_lost(DistBackendError(text), cfg, env)
    assert lost is not None and str(lost).startswith(line), lost
    assert "\n" not in str(lost)


def test_an_nccl_error_of_this_host_is_not_a_lost_rank():
    env = DistEnv(0, 2, 0, 2, torch.device("cpu"))
    assert peer_lost(DistBackendError(SHM), compose(ARGS), env) is None  # /dev/shm is full: its own message


def _abort():
    faulthandler.disable()  # its report of the abort is noise here
    os.abort()


def test_a_rank_the_watchdog_aborts_is_named_with_the_likely_cause(tmp_path, capsys):
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=int), ctx.Process(target=_abort)]  # rank 0 ends cleanly
    for p in ranks:
        p.start()
    assert join_ranks(ranks, 0, "train", "rerun the same command", str(tmp_path)) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"train: error: rank 1 (pid {ranks[1].pid}) was killed by SIGABRT (")
    assert "NCCL's watchdog" in line and line.endswith("; rerun the same command") and "\n" not in line
