"""The four ways into a multi-rank job (spawn, torchrun, SLURM, explicit tcp://); a dead
rank ending the job is tests/test_faults.py's."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DUMMY, compose, parse_records, run_train
from trainer.errors import UsageError
from trainer.rendezvous import free_port, infer_rendezvous

BIN = Path(sys.executable).parent
ARGS = DUMMY + ["--max-update", "3", "--log-format", "json", "--log-interval", "1"]


@pytest.fixture(scope="module")
def one_process_records():
    records, _ = run_train(ARGS + ["--batch-size", "4", "--update-freq", "2"])  # what 2 ranks of 4 read per update
    return [r["loss"] for r in records["train_inner"]]


def fake_scontrol(tmp_path, hosts):
    """A stand-in `scontrol` that records its argv and prints `hosts`."""
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.args\nprintf '{chr(10).join(hosts)}\\n'\n")
    script.chmod(0o755)
    return script.parent


def test_rendezvous_from_environment(tmp_path, monkeypatch):
    cfg = compose(DUMMY + ["--batch-size", "2", "--distributed-world-size", "2"])
    rdv = infer_rendezvous(cfg, environ={})
    assert (rdv.world_size, rdv.spawn, rdv.local_world_size) == (2, 2, 2)
    assert rdv.init_method.startswith("tcp://127.0.0.1:")
    torchrun = dict(
        RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="hostA", MASTER_PORT="2222"
    )
    rdv = infer_rendezvous(compose(DUMMY + ["--batch-size", "2"]), environ=torchrun)
    assert (rdv.init_method, rdv.rank, rdv.world_size, rdv.local_rank, rdv.spawn) == ("tcp://hostA:2222", 3, 4, 1, 0)
    monkeypatch.setenv("PATH", f"{fake_scontrol(tmp_path, ['gpu-a17', 'gpu-a18'])}:{os.environ['PATH']}")
    slurm = dict(
        SLURM_PROCID="5",
        SLURM_NTASKS="8",
        SLURM_LOCALID="1",
        SLURM_NNODES="2",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-a[17-18]",
        SLURM_NTASKS_PER_NODE="4(x2)",
    )
    rdv = infer_rendezvous(compose(DUMMY + ["--batch-size", "2"]), environ=slurm)
    assert (rdv.rank, rdv.world_size, rdv.local_rank, rdv.local_world_size) == (5, 8, 1, 4)
    assert rdv.init_method == f"tcp://gpu-a17:{10000 + 4242}"
    assert (tmp_path / "scontrol.args").read_text().split() == ["show", "hostnames", "gpu-a[17-18]"]
    rdv = infer_rendezvous(compose(DUMMY + ["--batch-size", "2", "--distributed-port", "3333"]), environ=slurm)
    assert rdv.init_method == "tcp://gpu-a17:3333"
    with pytest.raises(UsageError, match="disagrees with SLURM_NTASKS=8"):
        infer_rendezvous(compose(DUMMY + ["--batch-size", "2", "--distributed-world-size", "3"]), environ=slurm)
    # fairseq's other mode: one task per node spawns that node's share of the ranks
    per_node = dict(
        SLURM_PROCID="1",
        SLURM_NODEID="1",
        SLURM_NTASKS="2",
        SLURM_NNODES="2",
        SLURM_JOB_ID="7",
        SLURM_JOB_NODELIST="gpu-a[17-18]",
    )
    rdv = infer_rendezvous(compose(DUMMY + ["--batch-size", "2", "--distributed-world-size", "8"]), environ=per_node)
    assert (rdv.rank, rdv.world_size, rdv.spawn, rdv.local_world_size) == (4, 8, 4, 4)
    assert rdv.init_method == f"tcp://gpu-a17:{10000 + 7}"
    with pytest.raises(UsageError, match="not a multiple of the job's 2 nodes"):
        infer_rendezvous(compose(DUMMY + ["--batch-size", "2", "--distributed-world-size", "5"]), environ=per_node)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UsageError, match="scontrol"):
        infer_rendezvous(compose(DUMMY + ["--batch-size", "2"]), environ=slurm)


def test_spawn_logs_once_and_matches_one_process(one_process_records):
    records, r = run_train(
        ARGS + ["--batch-size", "4", "--distributed-world-size", "2", "--ddp-backend", "fully_sharded"]
    )
    assert [x["loss"] for x in records["train_inner"]] == one_process_records  # rank 0 alone logs
    assert "training on 2 rank(s)" in r.stdout and r.stdout.count("holds") == 1


def _write_mark(cfg, rdv):
    """Launch target: each rank writes down the mark it inherited from the launcher."""
    Path(f"mark.{rdv.rank}").write_text(os.environ.get("SHARDLM_TEST_MARK", ""))
    return 0


def test_local_ranks_inherit_each_jobs_environment_and_the_launcher_never_loads_torch(tmp_path):
    """Two jobs launched from one process (as a sweep does): the ranks of each see the
    environment of their own launch, not the first one's (their server is started per job),
    and the launcher itself never imports torch (its ranks are forked from a server that did)."""
    script = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from helpers import DUMMY, compose
from test_launch import _write_mark
from trainer.launch.launcher import launch
cfg = compose(DUMMY + ["--batch-size", "2", "--distributed-world-size", "2"])
for mark in ("first", "second"):
    os.environ["SHARDLM_TEST_MARK"] = mark
    assert launch(cfg, target=_write_mark) == 0
    print(mark, open("mark.0").read(), open("mark.1").read())
print("torch loaded:", "torch" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:3] == ["first first first", "second second second", "torch loaded: False"]


def test_torchrun(one_process_records):
    cmd = [BIN / "torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()), BIN / "train"]
    r = subprocess.run(
        cmd + ARGS + ["--batch-size", "4", "--ddp-backend", "fully_sharded"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["loss"] for x in parse_records(r.stdout)["train_inner"]] == one_process_records


def _run_ranks(envs, argv, timeout=300):
    procs = [
        subprocess.Popen(
            [BIN / "train"] + argv, env={**os.environ, **e}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for e in envs
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    return procs, outs


def test_srun_style_tasks_join(tmp_path, one_process_records):
    path = f"{fake_scontrol(tmp_path, ['127.0.0.1'])}:{os.environ['PATH']}"
    envs = [
        dict(
            PATH=path,
            SLURM_PROCID=str(i),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(i),
            SLURM_NNODES="1",
            SLURM_JOB_ID="77",
            SLURM_JOB_NODELIST="node[1]",
        )
        for i in range(2)
    ]
    procs, outs = _run_ranks(
        envs, ARGS + ["--batch-size", "4", "--ddp-backend", "fully_sharded", "--distributed-port", str(free_port())]
    )
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:]
    assert [x["loss"] for x in parse_records(outs[0][0])["train_inner"]] == one_process_records
    assert "train_inner" not in parse_records(outs[1][0])  # only rank 0 writes records


def test_explicit_init_method(one_process_records):
    port = free_port()
    argv = ARGS + [
        "--batch-size",
        "4",
        "--distributed-world-size",
        "2",
        "--distributed-no-spawn",
        "--distributed-init-method",
        f"tcp://127.0.0.1:{port}",
    ]
    procs = [
        subprocess.Popen(
            [BIN / "train"] + argv + ["--distributed-rank", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[1][1][-2000:]
    assert [x["loss"] for x in parse_records(outs[0][0])["train_inner"]] == one_process_records
