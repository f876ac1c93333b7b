"""SIGUSR1 / SIGTERM outside SLURM: every rank finishes its update, checkpoint_last is
saved, the job exits cleanly, and the same command resumes the same curve."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DUMMY, parse_records, run_train

ARGV = [a for a in DUMMY if a != "--no-save"] + ["--batch-size", "4", "--max-update", "40", "--log-format", "json",
                                                 "--log-interval", "1"]


def _signal_after(argv, sig, after_update, cwd, whole_group=False):
    """Start `train`, send `sig` once update `after_update` is logged, to `train` alone or
    to every process of the job (as SLURM and `kill -SIG -PGID` do); returns (rc, stdout,
    stderr)."""
    cmd = [str(Path(sys.executable).with_name("train"))] + argv
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            start_new_session=whole_group)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if '"num_updates": %d,' % after_update in line and "train_inner" in line:
            os.killpg(proc.pid, sig) if whole_group else proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=300)
    return proc.returncode, "".join(lines) + out, err


FSDP_2_RANKS = ["--ddp-backend", "fully_sharded", "--distributed-world-size", "2"]


@pytest.mark.parametrize("sig,extra,whole_group", [(signal.SIGUSR1, FSDP_2_RANKS, False),
                                                   (signal.SIGTERM, FSDP_2_RANKS, True),
                                                   (signal.SIGTERM, [], False)],
                         ids=["usr1_fsdp_2_ranks", "term_fsdp_2_ranks_whole_group", "term_1_rank"])
def test_signal_saves_stops_and_the_same_command_resumes(sig, extra, whole_group, tmp_path):
    argv = ARGV + extra + ["--save-dir", str(tmp_path / "ckpt")]
    whole, _ = run_train(ARGV + extra + ["--no-save"])
    rc, out, err = _signal_after(argv, sig, 5, tmp_path, whole_group)
    assert rc == 0, err
    first = parse_records(out)["train_inner"]
    stopped = json.loads((tmp_path / "ckpt" / "checkpoint_last" / "trainer_state.json").read_text())["num_updates"]
    assert 5 <= stopped < 40 and first[-1]["num_updates"] == stopped
    assert f"received {signal.Signals(sig).name}: stopping after update {stopped}" in out + err
    rest, _ = run_train(argv)
    updates = [r["num_updates"] for r in first + rest["train_inner"]]
    assert updates == list(range(1, 41)), "an update was lost or counted twice"
    assert [r["loss"] for r in first + rest["train_inner"]] == [r["loss"] for r in whole["train_inner"]]


def test_signal_with_no_save_stops_without_writing(tmp_path):
    rc, out, err = _signal_after(ARGV + ["--no-save", "--save-dir", str(tmp_path / "ckpt")], signal.SIGTERM, 3, tmp_path)
    assert rc == 0, err
    assert "--no-save: nothing saved at update" in out + err and not (tmp_path / "ckpt").exists()


def test_a_second_sigterm_a_second_later_kills_at_once(tmp_path):
    """The cluster's second TERM (a second or more after the first, so not a copy of it)
    means no patience is left: the rank dies the default way instead of finishing its
    update and saving. The update here is 3,000 micro-batches long, so the rank is still
    inside it when the second signal comes."""
    from trainer.train.preemption import SAME_SIGNAL_S

    argv = [a for a in DUMMY if a != "--no-save"] + ["--batch-size", "4", "--dataset-size", "100000",
                                                   "--update-freq", "3000", "--save-dir", str(tmp_path / "ckpt")]
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
    assert not (tmp_path / "ckpt" / "checkpoint_last").exists()
