"""Multi-node under a live SLURM cluster on this machine: two nodes emulated as network
namespaces with their own hostnames and addresses (tests/slurm/start_local_slurm.sh, from
shared/slurm). Needs root and apt to start the cluster; skipped, with the reason in the
report, where it cannot."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DUMMY, parse_records, run_train

HERE = Path(__file__).parent / "slurm"
TRAIN = str(Path(sys.executable).with_name("train"))
ARGS = [a for a in DUMMY if a != "--no-save"] + ["--log-format", "json", "--log-interval", "1"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("a local SLURM cluster needs root and apt-get")
    env = {**os.environ, "SLURM_MODE": "netns", "SLURM_NODES": "2"}
    r = subprocess.run(
        ["bash", str(HERE / "start_local_slurm.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    yield
    subprocess.run(["bash", str(HERE / "stop_local_slurm.sh")], capture_output=True, timeout=300)


def job_state(job):
    """(JobState, ExitCode) of a job slurmctld still knows (MinJobAge keeps ended ones 300 s)."""
    line = subprocess.run(
        ["slurm-node", "n1", "scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=60
    ).stdout
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    return fields.get("JobState"), fields.get("ExitCode")


def wait_for_job(job, timeout=900):
    """Block until the job ends; assert it completed with exit code 0, as `sbatch --wait`'s
    status does. (Polled here: sbatch --wait sleeps 2, 8, then 32 s between its own checks,
    so a job of 12 s was waited on for 42.)"""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state, code = job_state(job)
        if state not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"):
            assert (state, code) == ("COMPLETED", "0:0"), f"job {job} ended {state} with exit code {code}"
            return
        time.sleep(0.25)
    raise AssertionError(f"job {job} still not ended after {timeout} s")


def sbatch(script_dir, body, *options, wait=True):
    """Submit a batch job from inside node n1; returns its id (after it ends, with wait)."""
    script = script_dir / "job.sh"
    script.write_text("#!/bin/bash\n" + "".join(f"#SBATCH {o}\n" for o in options) + body + "\n")
    r = subprocess.run(
        ["slurm-node", "n1", "sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    if wait:
        wait_for_job(job)
    return job


def srun_train(argv, ntasks_per_node):
    return f"srun --ntasks-per-node={ntasks_per_node} --kill-on-bad-exit=1 {TRAIN} " + " ".join(argv)


def logged_losses(text):
    return [(r["num_updates"], r["loss"]) for r in parse_records(text)["train_inner"]]


@pytest.mark.parametrize(
    "per_node,extra,local",
    [
        (1, ["--ddp-backend", "fully_sharded", "--batch-size", "4"], ["--distributed-world-size", "2"]),
        # shard inside a node (its 2 ranks), replicate across the 2 nodes
        (
            2,
            ["--ddp-backend", "hybrid_shard", "--batch-size", "2"],
            ["--distributed-world-size", "4", "--shard-group-size", "2"],
        ),
    ],
    ids=["fsdp_2_nodes_x1", "hybrid_shard_2_nodes_x2"],
)
def test_multi_node_job_matches_a_local_run(cluster, per_node, extra, local, tmp_path):
    argv = ARGS + extra + ["--max-update", "5", "--no-save"]
    out = tmp_path / "out.txt"
    sbatch(tmp_path, srun_train(argv, per_node), "--nodes=2", f"--ntasks-per-node={per_node}", f"--output={out}")
    text = out.read_text()
    assert f"training on {2 * per_node} rank(s)" in text
    expected, _ = run_train(argv + local)
    assert logged_losses(text) == [(r["num_updates"], r["loss"]) for r in expected["train_inner"]]


def test_one_task_per_node_spawns_the_node_ranks(cluster, tmp_path):
    """fairseq's other mode: srun starts one task per node, each spawns 2 local ranks."""
    argv = ARGS + ["--ddp-backend", "hybrid_shard", "--batch-size", "2", "--max-update", "5", "--no-save"]
    out = tmp_path / "out.txt"
    sbatch(
        tmp_path,
        srun_train(argv + ["--distributed-world-size", "4"], 1),
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
        f"--output={out}",
    )
    text = out.read_text()
    assert "training on 4 rank(s)" in text
    expected, _ = run_train(argv + ["--distributed-world-size", "4", "--shard-group-size", "2"])
    assert logged_losses(text) == [(r["num_updates"], r["loss"]) for r in expected["train_inner"]]


def test_preempted_job_saves_requeues_and_resumes(cluster, tmp_path):
    save = tmp_path / "ckpt"
    argv = ARGS + ["--ddp-backend", "fully_sharded", "--batch-size", "4", "--max-update", "60", "--save-dir", str(save)]
    out = tmp_path / "out.txt"
    job = sbatch(
        tmp_path,
        srun_train(argv, 1),
        "--nodes=2",
        "--ntasks-per-node=1",
        "--requeue",
        "--open-mode=append",
        f"--output={out}",
        wait=False,
    )
    deadline = time.time() + 300
    while time.time() < deadline and not (out.exists() and '"num_updates": 5,' in out.read_text()):
        time.sleep(0.2)
    subprocess.run(["slurm-node", "n1", "scancel", "--signal=USR1", job], check=True)
    released = False
    while time.time() < deadline + 300:
        state = subprocess.run(
            ["slurm-node", "n1", "squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True
        ).stdout.strip()
        if state == "PENDING" and not released:
            # Requeued (by train itself: the job ran before the signal). slurmctld holds a requeued
            # job until MessageTimeout + 1 s have passed, then starts it at its next pass
            # (backfill every 5 s here): 15-30 s of waiting that is SLURM's, not the job's.
            subprocess.run(
                ["slurm-node", "n1", "scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True
            )
            released = True
        if not state and "done training" in out.read_text():
            break
        time.sleep(0.25)
    text = out.read_text()
    assert "received SIGUSR1: stopping after update" in text and f"requeued SLURM job {job}" in text
    updates = [n for n, _ in logged_losses(text)]
    assert updates == list(range(1, 61)), "an update was lost or counted twice"
    whole, _ = run_train(argv[:-2] + ["--no-save", "--distributed-world-size", "2"])
    assert logged_losses(text) == [(r["num_updates"], r["loss"]) for r in whole["train_inner"]]


def test_awkward_node_lists_expand_with_scontrol(cluster, tmp_path):
    from trainer.rendezvous import first_host

    assert first_host("n[1-3,7]") == "n1"
    assert first_host("gpu-a[01-02],gpu-b5") == "gpu-a01"
    assert first_host("gpu-b5,gpu-a[01-02]") == "gpu-b5"
    marker = tmp_path / "ran"
    first_host(f"node$(touch {marker});touch {marker}")  # one argument to scontrol, never a shell string
    assert not marker.exists()


def test_the_example_sbatch_runs_on_two_nodes(cluster, tmp_path):
    """examples/slurm/train.sbatch adapted to CPU nodes (no GPU line, debug partition, a tiny model)."""
    from data.embedded_corpus import prepare_embedded_corpus

    example = (Path(__file__).parents[1] / "examples" / "slurm" / "train.sbatch").read_text()
    script = tmp_path / "train.sbatch"
    script.write_text(
        "".join(line for line in example.splitlines(keepends=True) if "--gpus-per-task" not in line).replace(
            "srun --kill-on-bad-exit=1 train", f"srun --kill-on-bad-exit=1 {TRAIN}"
        )
    )
    out, save = tmp_path / "out.txt", tmp_path / "ckpt"
    env = f"--export=ALL,DATA={prepare_embedded_corpus()},SAVE={save}"
    tiny = [
        "--arch",
        "transformer_lm_gpt2_tiny",
        "--decoder-attention-heads",
        "2",
        "--tokens-per-sample",
        "64",
        "--max-update",
        "4",
        "--warmup-updates",
        "2",
        "--save-interval-updates",
        "2",
        "--log-interval",
        "1",
    ]
    r = subprocess.run(
        [
            "slurm-node",
            "n1",
            "sbatch",
            "--parsable",
            "--partition=debug",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            env,
            f"--output={out}",
            str(script),
        ]
        + tiny,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    try:
        wait_for_job(r.stdout.strip().split(";")[0])
    except AssertionError as e:
        raise AssertionError(f"{e}\n{out.read_text()[-3000:] if out.exists() else ''}") from None
    text = out.read_text()
    assert "training on 2 rank(s)" in text and [n for n, _ in logged_losses(text)] == [1, 2, 3, 4]
    assert (save / "checkpoint_last").is_dir() and (save / "checkpoint_1_2").is_dir()


def test_submitit_launcher_runs_a_two_job_sweep(cluster, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    argv = ARGS + [
        "--ddp-backend",
        "fully_sharded",
        "--batch-size",
        "4",
        "--max-update",
        "3",
        "optimization.lr=0.001,0.003",
        "hydra/launcher=slurm",
        "hydra.launcher.nodes=2",
        f"hydra.sweep.dir={sweep}",
    ]
    r = subprocess.run(
        ["slurm-node", "n1", TRAIN, "-m"] + argv, capture_output=True, text=True, cwd=tmp_path, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lrs = set()
    for job in ("0", "1"):
        state = json.loads((sweep / job / "checkpoints" / "checkpoint_last" / "trainer_state.json").read_text())
        assert state["num_updates"] == 3
        lrs.add(state["state"]["trainer"]["lr"])
    assert lrs == {0.001, 0.003}
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_0_log.out"))
    assert logs.count("training on 2 rank(s)") == 2  # each job: one rank on each of the 2 nodes
