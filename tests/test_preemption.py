"""SIGUSR1 / SIGTERM outside SLURM, and Ctrl-C: every rank finishes its update,
checkpoint_last is saved, the job exits cleanly (130 after Ctrl-C), and the same command
resumes the same curve; a second signal stops at once."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DUMMY, parse_records, run_train, train_here

ARGV = [a for a in DUMMY if a != "--no-save"] + [
    "--batch-size",
    "4",
    "--max-update",
    "40",
    "--log-format",
    "json",
    "--log-interval",
    "1",
]


def _signal_after(argv, sig, after_update, cwd, whole_group=False):
    """Start `train`, send `sig` once update `after_update` is logged, to `train` alone or
    to every process of the job (as SLURM and `kill -SIG -PGID` do); returns (rc, stdout,
    stderr)."""
    cmd = [str(Path(sys.executable).with_name("train"))] + argv
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=whole_group
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if '"num_updates": %d,' % after_update in line and "train_inner" in line:
            os.killpg(proc.pid, sig) if whole_group else proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=300)
    return proc.returncode, "".join(lines) + out, err


FSDP_2_RANKS = ["--ddp-backend", "fully_sharded", "--distributed-world-size", "2"]
_uninterrupted = {}


def same_command(argv, capfd):
    """`train` run again as the user would: one rank in this process (its start-up is not what
    these tests are about; the signalled run is always a real process), two as a real job."""
    return train_here(argv, capfd) if "--distributed-world-size" not in argv else run_train(argv)


def uninterrupted(extra, capfd):
    """train_inner records of the whole run, uninterrupted (shared by the cases with the same ranks)."""
    key = tuple(extra)
    if key not in _uninterrupted:
        _uninterrupted[key] = same_command(ARGV + extra + ["--no-save"], capfd)[0]["train_inner"]
    return _uninterrupted[key]


@pytest.mark.parametrize(
    "sig,extra,whole_group",
    [(signal.SIGUSR1, FSDP_2_RANKS, False), (signal.SIGTERM, FSDP_2_RANKS, True), (signal.SIGTERM, [], False)],
    ids=["usr1_fsdp_2_ranks", "term_fsdp_2_ranks_whole_group", "term_1_rank"],
)
def test_signal_saves_stops_and_the_same_command_resumes(sig, extra, whole_group, tmp_path, capfd):
    argv = ARGV + extra + ["--save-dir", str(tmp_path / "ckpt")]
    whole = uninterrupted(extra, capfd)
    rc, out, err = _signal_after(argv, sig, 5, tmp_path, whole_group)
    assert rc == 0, err
    first = parse_records(out)["train_inner"]
    stopped = json.loads((tmp_path / "ckpt" / "checkpoint_last" / "trainer_state.json").read_text())["num_updates"]
    assert 5 <= stopped < 40 and first[-1]["num_updates"] == stopped
    assert f"received {signal.Signals(sig).name}: stopping after update {stopped}" in out + err
    rest, _ = same_command(argv, capfd)
    updates = [r["num_updates"] for r in first + rest["train_inner"]]
    assert updates == list(range(1, 41)), "an update was lost or counted twice"
    assert [r["loss"] for r in first + rest["train_inner"]] == [r["loss"] for r in whole]


def test_signal_with_no_save_stops_without_writing(tmp_path):
    rc, out, err = _signal_after(
        ARGV + ["--no-save", "--save-dir", str(tmp_path / "ckpt")], signal.SIGTERM, 3, tmp_path
    )
    assert rc == 0, err
    assert "--no-save: nothing saved at update" in out + err and not (tmp_path / "ckpt").exists()


def test_a_second_sigterm_a_second_later_kills_at_once(tmp_path):
    """The cluster's second TERM (a second or more after the first, so not a copy of it)
    means no patience is left: the rank dies the default way instead of finishing its
    update and saving. The update here is 3,000 micro-batches long, so the rank is still
    inside it when the second signal comes."""
    from trainer.train.preemption import SAME_SIGNAL_S

    argv = [a for a in DUMMY if a != "--no-save"] + [
        "--batch-size",
        "4",
        "--dataset-size",
        "100000",
        "--update-freq",
        "3000",
        "--save-dir",
        str(tmp_path / "ckpt"),
    ]
    cmd = [str(Path(sys.executable).with_name("train"))] + argv
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        for line in proc.stdout:
            if "training on 1 rank(s)" in line:
                break
        time.sleep(1.0)  # the handlers are installed right after that line
        proc.send_signal(signal.SIGTERM)
        time.sleep(SAME_SIGNAL_S + 0.5)
        assert proc.poll() is None, "the first SIGTERM alone must not stop the update"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, out[-2000:]
    assert "received SIGTERM: stopping after update" not in out
    assert f"second SIGTERM: stopping at once, not waiting for a save; nothing was saved in {tmp_path / 'ckpt'}" in out
    assert not (tmp_path / "ckpt" / "checkpoint_last").exists()


def _job_processes(pgid):
    """Pids of the processes of process group `pgid` still running (zombies are dead)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            state, _, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(entry.name))
    return pids


class _Terminal:
    """`train` in its own process group, as a shell runs a foreground job; `ctrl_c()` is what
    a terminal does on Ctrl-C: SIGINT to every process of the group at once."""

    def __init__(self, argv, cwd):
        cmd = [str(Path(sys.executable).with_name("train"))] + argv
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True
        )
        self.out = []

    def wait_for(self, text):
        for line in self.proc.stdout:
            self.out.append(line)
            if text in line:
                return
        raise AssertionError(f"train ended before {text!r}:\n{''.join(self.out)[-3000:]}")

    def ctrl_c(self):
        os.killpg(self.proc.pid, signal.SIGINT)

    def finish(self, timeout):
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None or _job_processes(self.proc.pid):
                os.killpg(self.proc.pid, signal.SIGKILL)  # a hang fails this test, not the suite
        left = _job_processes(self.proc.pid)
        return self.proc.returncode, "".join(self.out) + out, err, left


@pytest.mark.parametrize("extra", [[], FSDP_2_RANKS], ids=["1_rank", "fsdp_2_ranks"])
def test_ctrl_c_saves_stops_with_130_and_the_same_command_resumes(extra, tmp_path, capfd):
    """Ctrl-C is SIGTERM's clean stop: the update finishes, checkpoint_last is saved, one line
    says how to resume, the exit status is 130 (an interrupted command's), and no process of
    the job (ranks, the server they are forked from) outlives `train`."""
    argv = ARGV + extra + ["--save-dir", str(tmp_path / "ckpt")]
    job = _Terminal(argv, tmp_path)
    job.wait_for('"num_updates": 3,')
    job.ctrl_c()
    rc, out, err, left = job.finish(timeout=120)
    assert rc == 130, out[-2000:] + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, err
    assert not left, f"processes {left} outlived train"
    stopped = json.loads((tmp_path / "ckpt" / "checkpoint_last" / "trainer_state.json").read_text())["num_updates"]
    assert f"received SIGINT: stopping after update {stopped}" in out
    assert f"stopped at update {stopped}; run the same command again to resume from checkpoint_last" in out
    records, r = same_command(argv + ["--max-update", str(stopped + 2)], capfd)  # the last --max-update counts
    assert f"@ {stopped} updates" in r.stdout
    assert [x["num_updates"] for x in records["train_inner"]] == [stopped + 1, stopped + 2]


def _stopped_at_once(job, start, save_dir):
    rc, out, err, left = job.finish(timeout=60)
    assert time.monotonic() - start < 20, "the second Ctrl-C did not stop the job at once"
    assert rc == 130, out[-2000:] + err
    # One line, which says what --save-dir holds.
    assert err.strip() == (
        f"train: interrupted again: stopped at once, not waiting for a save; nothing was saved in "
        f"{save_dir}; rerun the same command"
    )
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    assert not left, f"processes {left} outlived train"


def test_a_second_ctrl_c_stops_one_rank_at_once_in_one_line(tmp_path):
    """The update here is 3,000 micro-batches long: the first Ctrl-C waits for it, the second
    (more than SAME_SIGNAL_S later, so not a copy of the first) ends the job at once, unsaved."""
    from trainer.train.preemption import SAME_SIGNAL_S

    argv = [a for a in DUMMY if a != "--no-save"] + [
        "--batch-size",
        "4",
        "--dataset-size",
        "100000",
        "--update-freq",
        "3000",
        "--save-dir",
        str(tmp_path / "ckpt"),
    ]
    job = _Terminal(argv, tmp_path)
    job.wait_for("No existing checkpoint found")  # logged once training's handlers are in place
    job.ctrl_c()
    time.sleep(SAME_SIGNAL_S + 0.5)
    assert job.proc.poll() is None, "the first Ctrl-C alone must not stop the update"
    job.ctrl_c()
    _stopped_at_once(job, time.monotonic(), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "checkpoint_last").exists()


def test_a_second_ctrl_c_kills_the_ranks_at_once_in_one_line(tmp_path):
    """Two ranks: the launcher, which sees each Ctrl-C once, kills them on the second (the
    ranks take a signal this soon after the first for a copy of it). Each update is 60
    micro-batches (seconds). The ranks agree on a signal one update after it is posted
    (trainer/train/preemption.py): a Ctrl-C after update 1's record stops the job after
    update 2 at the earliest, a whole update after the second Ctrl-C, so nothing is saved."""
    argv = (
        [a for a in DUMMY if a != "--no-save"]
        + FSDP_2_RANKS
        + [
            "--batch-size",
            "4",
            "--dataset-size",
            "100000",
            "--update-freq",
            "60",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--save-dir",
            str(tmp_path / "ckpt"),
        ]
    )
    job = _Terminal(argv, tmp_path)
    job.wait_for('"num_updates": 1,')  # every rank is in the loop, with its handlers
    job.ctrl_c()
    time.sleep(0.3)
    job.ctrl_c()
    _stopped_at_once(job, time.monotonic(), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "checkpoint_last").exists()


@pytest.mark.parametrize("extra,whole_group", [([], False), (FSDP_2_RANKS, True)], ids=["1_rank", "fsdp_2_ranks"])
def test_a_signal_during_validation_ends_it_saves_and_exits(extra, whole_group, tmp_path):
    """dummy_lm validates on --dataset-size samples (fairseq's 100k): a run that reached
    --max-update and began validating stops at the next batch when signalled (no partial
    valid record), saves checkpoint_last at its last update and exits 0, in seconds."""
    cut = DUMMY.index("--max-valid-steps")
    argv = (
        [a for a in DUMMY[:cut] + DUMMY[cut + 2 :] if a != "--no-save"]
        + extra
        + [
            "--batch-size",
            "4",
            "--dataset-size",
            "100000",
            "--max-update",
            "3",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--save-dir",
            str(tmp_path / "ckpt"),
        ]
    )
    cmd = [str(Path(sys.executable).with_name("train"))] + argv
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Stopping training due to num_updates: 3" in line:
                break
        time.sleep(1.0)  # into the 25,000 batches of validation
        assert proc.poll() is None, "".join(lines)
        os.killpg(proc.pid, signal.SIGTERM) if whole_group else proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines) + out
    assert time.monotonic() - signalled < 20, "the signal waited for the validation to finish"
    assert proc.returncode == 0, out[-2000:] + err
    assert "stopped validating 'valid' after" in out and "received SIGTERM: stopping after update 3" in out
    assert "valid" not in parse_records(out), "a partial validation was logged as a result"
    state = json.loads((tmp_path / "ckpt" / "checkpoint_last" / "trainer_state.json").read_text())
    assert state["num_updates"] == 3
    assert "stopped at update" not in out  # the run was finished: nothing to resume
