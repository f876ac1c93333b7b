"""What a rank decides on a GPU host, tested on this CPU one (issue 47): each decision is a
small function of what the host has (GPU count, environment, /dev entries, an error's text),
called here with a GPU host's values; the one-line errors users see are checked through the
real entry points where one exists."""

import os

import pytest
from test_launch import fake_scontrol

from helpers import DUMMY, compose
from trainer.errors import UsageError
from trainer.host import runs_on_gpu, visible_gpu_count
from trainer.rendezvous import infer_rendezvous

ARGS = DUMMY + ["--batch-size", "2"]


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


def test_device_id_with_spawned_ranks_is_refused():
    cfg = compose(ARGS + ["--distributed-world-size", "2", "--device-id", "1"])
    with pytest.raises(UsageError, match="--device-id.*--distributed-no-spawn"):
        infer_rendezvous(cfg, environ={}, gpus=2)


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
