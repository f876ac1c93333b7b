"""Process faults with real processes: a rank killed or hung ends the job with a line
naming it and the same command resumes; a save killed halfway or a full disk keeps the
previous checkpoint; one save directory takes one run; a save directory that cannot be
used, or a checkpoint of another model, is refused before anything is written.

The faults happen to real processes; a one-rank run that only resumes from what they left
(or writes a checkpoint for another to be refused against) runs in this process
(tests/helpers.py train_here: the same entry point, records and stderr)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import DUMMY, compose, parse_records, run_train, train_here
from trainer.launch.launcher import launch
from trainer.rendezvous import free_port

TRAIN = str(Path(sys.executable).with_name("train"))
SAVE = [a for a in DUMMY if a != "--no-save"] + ["--batch-size", "2", "--log-format", "json", "--log-interval", "1"]
FSDP2 = ["--ddp-backend", "fully_sharded"]


class Train:
    """`train` running in the background; its stdout lines are read as they come."""

    def __init__(self, argv, env=None, limit_s=300):
        self.proc = subprocess.Popen(
            [TRAIN] + argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.lines = []
        self.watchdog = threading.Timer(limit_s, self.kill)  # a hang fails the test, not the suite
        self.watchdog.daemon = True
        self.watchdog.start()

    def wait_for(self, text):
        """Read stdout until a line contains `text`; returns that line."""
        for line in self.proc.stdout:
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"train ended without printing {text!r}:\n{self.finish()[1][-3000:]}")

    def finish(self, timeout=300):
        out, err = self.proc.communicate(timeout=timeout)
        self.watchdog.cancel()
        return "".join(self.lines) + out, err

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def saved_updates(save_dir):
    return json.loads((Path(save_dir) / "checkpoint_last" / "trainer_state.json").read_text())["num_updates"]


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(path):
    """Every file under `path` with its size and modification time: equal means untouched."""
    path = Path(path)
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


def spawned_ranks(train):
    """The local ranks: children of the server `train` forks them from (trainer/launch/local_ranks.py)."""

    def children(pid):
        return [
            int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        ]

    servers = [c for c in children(train.proc.pid) if "forkserver" in Path(f"/proc/{c}/cmdline").read_text()]
    return sorted(rank for server in servers for rank in children(server))  # rank 0 is started first


def test_a_killed_spawned_rank_is_named_and_the_same_command_resumes(tmp_path):
    argv = (
        SAVE
        + FSDP2
        + [
            "--distributed-world-size",
            "2",
            "--max-update",
            "30",
            "--save-interval-updates",
            "10",
            "--save-dir",
            str(tmp_path / "ckpt"),
        ]
    )
    run = Train(argv)
    run.wait_for("Saved checkpoint")
    ranks = spawned_ranks(run)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    start = time.time()
    _, err = run.finish(timeout=60)
    assert run.proc.returncode != 0 and time.time() - start < 30, "the surviving rank hung"
    assert one_error_line(err) == (
        f"train: error: rank 1 (pid {ranks[1]}) was killed by SIGKILL; "
        "rerun the same command to resume from checkpoint_last"
    )
    saved = saved_updates(tmp_path / "ckpt")
    records, r = run_train(argv)
    assert f"@ {saved} updates" in r.stdout
    assert [x["num_updates"] for x in records["train_inner"]] == list(range(saved + 1, 31))


def test_a_launcher_killed_outright_takes_its_ranks_with_it(tmp_path):
    """SIGKILL to `train` alone (the OOM killer's choice, `kill -9`): the server its ranks are
    forked from, and so the ranks, end too instead of training on unwatched."""
    run = Train(SAVE + FSDP2 + ["--distributed-world-size", "2", "--max-update", "100000", "--no-save"])
    try:
        run.wait_for("train_inner")
        ranks = spawned_ranks(run)
        assert len(ranks) == 2
        os.kill(run.proc.pid, signal.SIGKILL)
        deadline = time.time() + 30
        while time.time() < deadline and any(alive(pid) for pid in ranks):
            time.sleep(0.2)
        assert not any(alive(pid) for pid in ranks), "a rank outlived its launcher"
    finally:
        run.kill()
        run.finish(timeout=60)


def alive(pid):
    """Running, not a zombie left for whoever reaps orphans."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _killed_then_survivor_aborts(cfg, rdv):
    """Launch target: rank 1 is killed; rank 0 outlives it by a second, then aborts, as a
    survivor that gloo aborts once its peer is gone."""
    if rdv.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1)
    os.abort()


def test_the_rank_named_is_the_first_to_die_not_a_survivor_that_died_after(capsys):
    cfg = compose(SAVE + ["--distributed-world-size", "2", "--save-dir", "/nonexistent-never-written"])
    assert launch(cfg, target=_killed_then_survivor_aborts) == 1
    err = capsys.readouterr().err
    assert one_error_line(err).startswith("train: error: rank 1 (pid "), err
    assert "was killed by SIGKILL" in err


@pytest.mark.parametrize("fault", ["hang", "death"])
def test_separately_started_ranks_end_within_the_heartbeat_timeout(fault, tmp_path):
    """Ranks joined by env:// as a cluster launcher starts them. A hung peer (SIGSTOP) ends the
    job after --heartbeat-timeout instead of 30 minutes; a dead one at once."""
    argv = (
        SAVE
        + FSDP2
        + [
            "--max-update",
            "100000",
            "--save-interval-updates",
            "10",
            "--keep-interval-updates",
            "1",
            "--heartbeat-timeout",
            "5",
            "--save-dir",
            str(tmp_path / "ckpt"),
        ]
    )
    port = str(free_port())
    env = [
        dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r))
        for r in range(2)
    ]
    ranks = [Train(argv, env[r]) for r in range(2)]
    try:
        ranks[0].wait_for("Saved checkpoint")
        os.kill(ranks[1].proc.pid, signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
        start = time.time()
        _, err = ranks[0].finish(timeout=120)
        took = time.time() - start
    finally:
        ranks[1].kill()
        ranks[1].finish()
    assert ranks[0].proc.returncode != 0
    if fault == "hang":
        assert 4 < took < 35, f"ended after {took:.0f} s with --heartbeat-timeout 5"
        assert one_error_line(err) == (
            "train: error: [rank 0] rank 1 did not answer for 5 s (--heartbeat-timeout): "
            "it died or hangs; rerun the same command to resume from checkpoint_last"
        )
    else:
        assert took < 30
        assert one_error_line(err) == (
            "train: error: [rank 0] lost rank 1: its connection closed (the process died "
            "or was killed); rerun the same command to resume from checkpoint_last"
        )
        return
    # the same command on both ranks resumes (the first new update follows the checkpoint)
    saved = saved_updates(tmp_path / "ckpt")
    port = str(free_port())
    argv[argv.index("100000")] = str(saved + 3)  # only to keep the test short
    again = [Train(argv, {**env[r], "MASTER_PORT": port}) for r in range(2)]
    outs = [r.finish() for r in again]
    assert [r.proc.returncode for r in again] == [0, 0], outs[0][1][-2000:]
    assert [x["num_updates"] for x in parse_records(outs[0][0])["train_inner"]] == [saved + 1, saved + 2, saved + 3]


def test_a_save_killed_halfway_leaves_the_previous_checkpoint_and_its_leftovers_go(tmp_path, capfd):
    """The process is frozen the moment a save's temporary directory has shards in it, then
    killed there: checkpoint_last is the previous save, the next run loads it and removes
    the unfinished directory, and the other checkpoints are left alone."""
    save = tmp_path / "ckpt"
    run = Train(SAVE + ["--max-update", "100000", "--save-interval-updates", "1", "--save-dir", str(save)])
    caught = None
    try:
        deadline = time.time() + 120
        while caught is None and time.time() < deadline:
            partial = list(save.glob(".tmp-*/*.distcp")) if (save / "checkpoint_last").exists() else []
            if partial:
                os.killpg(run.proc.pid, signal.SIGSTOP)
                caught = partial[0].parent if partial[0].parent.exists() else None
                if caught is None:
                    os.killpg(run.proc.pid, signal.SIGCONT)
            time.sleep(0.001)
    finally:
        run.kill()
        run.finish()
    assert caught is not None, "never caught a save in progress"
    before = saved_updates(save)
    older = [p.name for p in save.glob("checkpoint_*_*")]
    untouched = {name: snapshot(save / name) for name in older}
    records, r = train_here(SAVE + ["--max-update", str(before + 1), "--save-dir", str(save)], capfd)
    assert f"@ {before} updates" in r.stdout
    assert [x["num_updates"] for x in records["train_inner"]] == [before + 1]
    assert f"removed {caught.name}, left by a run that died while saving" in r.stdout
    assert not list(save.glob(".tmp-*"))
    assert {name: snapshot(save / name) for name in older} == untouched


@pytest.fixture
def small_disk(tmp_path):
    """A real 2.5 MB filesystem: one checkpoint of the tiny model (≈1.5 MB) fits, two do not."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root or CAP_SYS_ADMIN")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_disk_fails_that_save_and_keeps_the_previous_checkpoint(small_disk, tmp_path, capfd):
    save = small_disk / "ckpt"
    _, r = run_train(
        SAVE + ["--max-update", "30", "--save-interval-updates", "10", "--save-dir", str(save), "--disable-validation"],
        check=False,
    )  # no checkpoint_best beside them
    assert r.returncode != 0
    line = one_error_line(r.stderr)
    assert line.startswith(f"train: error: could not save checkpoint_1_20 in {save}: No space left on device")
    assert line.endswith("checkpoint_last still holds update 10; free space or point --save-dir elsewhere")
    assert sorted(p.name for p in save.iterdir()) == ["checkpoint_1_10", "checkpoint_last", "config.yaml"]
    # the kept checkpoint loads (read from a copy: this disk has no room for the next save)
    subprocess.run(["cp", "-a", str(save / "checkpoint_last"), str(tmp_path / "kept")], check=True)
    records, r = train_here(
        SAVE
        + ["--max-update", "11", "--restore-file", str(tmp_path / "kept"), "--save-dir", str(tmp_path / "elsewhere")],
        capfd,
    )
    assert "@ 10 updates" in r.stdout and [x["num_updates"] for x in records["train_inner"]] == [11]


def test_one_save_dir_takes_one_run(tmp_path, capfd):
    save = tmp_path / "ckpt"
    argv = SAVE + [
        "--max-update",
        "100000",
        "--save-interval-updates",
        "5",
        "--keep-interval-updates",
        "1",
        "--save-dir",
        str(save),
    ]
    first = Train(argv)
    try:
        first.wait_for("Saved checkpoint")
        second = Train(argv + FSDP2 + ["--distributed-world-size", "2"])  # both ranks must agree and stop
        no_save = Train(SAVE + ["--max-update", "2", "--no-save", "--save-dir", str(save)])
        _, err = second.finish(timeout=120)
        assert second.proc.returncode != 0
        assert one_error_line(err) == (
            f"train: error: [rank 0] {save} is in use by another train run (pid "
            f"{first.proc.pid} on host {os.uname().nodename}); wait for it or choose "
            "another --save-dir"
        )
        assert no_save.finish()[1] == "" and no_save.proc.returncode == 0  # --no-save takes no lock
        assert json.loads((save / ".lock").read_text())["pid"] == first.proc.pid  # the refused run wrote nothing
    finally:
        first.kill()
        first.finish()
    # the kernel dropped the dead run's lock: the same command goes on from its checkpoint
    saved = saved_updates(save)
    argv[argv.index("100000")] = str(saved + 1)
    records, r = train_here(argv, capfd)
    assert [x["num_updates"] for x in records["train_inner"]] == [saved + 1]


def test_a_save_dir_that_cannot_be_written_is_refused_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    _, r = run_train(SAVE + ["--max-update", "2", "--save-dir", str(blocker / "ckpt")], check=False)
    assert r.returncode != 0 and "train_inner" not in r.stdout
    # (the flag checks may find this one first; either way one line about --save-dir)
    assert one_error_line(r.stderr).startswith(f"train: error: --save-dir {blocker / 'ckpt'} ")
    assert blocker.read_text() == "not a directory\n"
    readonly = tmp_path / "ro"
    readonly.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)]).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here: needs root or CAP_SYS_ADMIN")
    try:
        _, r = run_train(SAVE + ["--max-update", "2", "--save-dir", str(readonly / "ckpt")], check=False)
        assert r.returncode != 0 and "train_inner" not in r.stdout
        assert "is not writable (Read-only file system)" in one_error_line(r.stderr)
    finally:
        subprocess.run(["umount", str(readonly)], check=True)


def test_a_checkpoint_of_another_model_is_refused_naming_the_flag_and_nothing_is_written(tmp_path, capfd):
    save = tmp_path / "ckpt"
    train_here(SAVE + ["--max-update", "2", "--save-dir", str(save)], capfd)
    before = snapshot(save)
    _, r = run_train(SAVE + ["--max-update", "4", "--save-dir", str(save), "--decoder-embed-dim", "32"], check=False)
    assert r.returncode != 0 and "train_inner" not in r.stdout
    assert one_error_line(r.stderr) == (
        f"train: error: checkpoint {save / 'checkpoint_last'} holds a different model: --decoder-embed-dim 64 in "
        "the checkpoint, 32 here (embed_tokens.weight is [256, 64] there and [256, 32] here); pass the model flags "
        "it was trained with, or another --save-dir"
    )
    assert snapshot(save) == before  # config.yaml too: it is written only once the restore succeeded
