"""Checkpoints users can trust: retention keeps what it says; --restore-file and fairseq's
names find the checkpoint meant, and a typo is refused before it could overwrite one; a save
killed halfway leaves the previous one loadable; --finetune-from-model takes the weights
only; a checkpoint of another model, a pickle that would run code and a damaged shard are
refused in one line. tests/test_checkpoint_resume.py: a resumed run continues the same curve.

One-rank runs that set up or resume run in this process (helpers.train_here); each refusal
is a real `train` process (its exit status and one stderr line)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DUMMY, run_train, train_here

# Batches of exactly --batch-size (none cut to fairseq's multiple of 8), as
# tests/test_checkpoint_resume.py's runs have them.
SAVE = [a for a in DUMMY if a != "--no-save"] + ["--required-batch-size-multiple", "1"]


def test_names_and_retention(tmp_path, capfd):
    save = tmp_path / "ckpt"
    train_here(
        SAVE
        + [
            "--batch-size",
            "32",
            "--dataset-size",
            "128",
            "--max-update",
            "10",
            "--save-dir",
            str(save),
            "--save-interval-updates",
            "3",
            "--keep-interval-updates",
            "2",
            "--keep-last-epochs",
            "1",
            "--log-format",
            "json",
        ],
        capfd,
    )
    # 4 updates per epoch: epochs end at 4 and 8; update checkpoints at 3, 6, 9 (kept: 6, 9).
    names = sorted(p.name for p in save.iterdir() if p.is_dir())
    assert names == ["checkpoint2", "checkpoint_2_6", "checkpoint_3_9", "checkpoint_best", "checkpoint_last"]
    state = json.loads((save / "checkpoint_last" / "trainer_state.json").read_text())
    assert state["num_updates"] == 10 and state["epoch"] == state["state"]["loop"]["iterator"]["epoch"] == 3
    # checkpoint_last is a second name of the same files when both are written at once
    train_here(
        SAVE
        + [
            "--batch-size",
            "32",
            "--dataset-size",
            "128",
            "--max-update",
            "12",
            "--save-dir",
            str(save),
            "--save-interval-updates",
            "3",
            "--log-format",
            "json",
        ],
        capfd,
    )
    assert os.path.samefile(save / "checkpoint3" / ".metadata", save / "checkpoint_last" / ".metadata")
    assert not any(p.name.startswith(".tmp") for p in save.iterdir())


_saved_2 = {}


@pytest.fixture
def saved_2(tmp_path_factory, tmp_path, capfd):
    """tmp_path/ckpt: a copy of the save dir of one 2-update run (SAVE, batch 4), trained once
    for the tests that damage or refuse it."""
    if "dir" not in _saved_2:
        source = tmp_path_factory.mktemp("saved-2") / "ckpt"
        train_here(SAVE + ["--batch-size", "4", "--max-update", "2", "--save-dir", str(source)], capfd)
        _saved_2["dir"] = source
    return Path(shutil.copytree(_saved_2["dir"], tmp_path / "ckpt", symlinks=True))


def test_a_different_model_is_refused_in_one_line(saved_2):
    save = saved_2
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (save / "checkpoint_last").iterdir())
    _, r = run_train(
        SAVE + ["--batch-size", "4", "--max-update", "4", "--save-dir", str(save), "--decoder-ffn-embed-dim", "96"],
        check=False,
    )
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "layers.0.fc1.weight is [128, 64] there and [96, 64] here" in err[0]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (save / "checkpoint_last").iterdir()) == before


def test_a_restore_file_that_does_not_exist_starts_afresh_only_in_an_empty_save_dir(tmp_path, capfd):
    """fairseq's job scripts pass the same --restore-file on every launch of a requeued job.
    With nothing saved yet the run starts afresh (fairseq's line); once --save-dir holds
    checkpoints, a name that does not exist is a typo, refused before it could overwrite them.
    fairseq's `.pt` names find shardlm's directories: the run continues at update 3 with the
    loss the first run had there."""
    save = tmp_path / "ckpt"
    argv = SAVE + [
        "--batch-size",
        "4",
        "--save-dir",
        str(save),
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--save-interval-updates",
        "2",
    ]
    first, r = train_here(argv + ["--max-update", "3", "--restore-file", "x.pt"], capfd)
    assert f"No existing checkpoint found {save / 'x.pt'}" in r.stdout
    assert [x["num_updates"] for x in first["train_inner"]] == [1, 2, 3]
    before = sorted((p.relative_to(save), p.stat().st_mtime_ns) for p in save.rglob("*"))
    _, r = run_train(argv + ["--max-update", "3", "--restore-file", "x.pt"], check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"train: error: --restore-file x.pt does not exist, and --save-dir {save} holds checkpoint_last: "
        "fix the path, or drop --restore-file to resume from checkpoint_last"
    ]
    assert sorted((p.relative_to(save), p.stat().st_mtime_ns) for p in save.rglob("*")) == before
    resumed, r = train_here(argv + ["--max-update", "3", "--restore-file", str(save / "checkpoint_1_2.pt")], capfd)
    assert f"loaded checkpoint {save / 'checkpoint_1_2'} (epoch 1 @ 2 updates)" in r.stdout
    assert resumed["train_inner"] == [
        dict(
            first["train_inner"][2],
            wps=x["wps"],
            ups=x["ups"],
            wall=x["wall"],
            train_wall=x["train_wall"],
            mem_gb=x["mem_gb"],
            tflops=x["tflops"],
        )
        for x in resumed["train_inner"]
    ]


def test_fairseq_checkpoint_names_and_restore_choices(tmp_path, monkeypatch):
    """One resolver for every command line that names a checkpoint: `checkpoint_last.pt` is
    `checkpoint_last` when only that exists, for --restore-file, --finetune-from-model and
    eval-lm / generate / export-model's --path."""
    from types import SimpleNamespace

    from trainer.checkpoint.files import restore_choice
    from trainer.errors import UsageError
    from trainer.formats.registry import model_kind as _kind

    save = tmp_path / "ckpt"
    for name in ("checkpoint_last", "checkpoint_1_2"):
        (save / name).mkdir(parents=True)
        (save / name / "trainer_state.json").write_text("{}")
        (save / name / ".metadata").write_bytes(b"")

    def choice(restore_file="checkpoint_last", finetune=None, save_dir=save, continue_once=None):
        return restore_choice(
            SimpleNamespace(
                save_dir=str(save_dir),
                restore_file=restore_file,
                finetune_from_model=finetune,
                continue_once=continue_once,
            )
        )

    assert choice()[:2] == (save / "checkpoint_last", False)
    assert choice("checkpoint_last.pt")[:2] == (save / "checkpoint_last", False)
    assert choice("checkpoint_1_2.pt")[:2] == (save / "checkpoint_1_2", False)  # a name in --save-dir
    assert choice(str(save / "checkpoint_1_2.pt"))[:2] == (save / "checkpoint_1_2", False)
    monkeypatch.chdir(save)  # the default is --save-dir's checkpoint_last, not one where train started
    assert choice(save_dir=tmp_path / "fresh") == (None, False, tmp_path / "fresh" / "checkpoint_last")
    assert choice(finetune=str(save / "checkpoint_1_2.pt"), save_dir=tmp_path / "fresh")[:2] == (
        save / "checkpoint_1_2",
        True,
    )
    with pytest.raises(UsageError, match="--finetune-from-model and --restore-file name two checkpoints"):
        choice("checkpoint_1_2.pt", finetune=str(save / "checkpoint_1_2"))
    # --continue-once: the first launch of a branch resumes that run, a requeue its own checkpoint_last
    branch = tmp_path / "branch"
    assert choice(save_dir=branch, continue_once=str(save / "checkpoint_1_2"))[:2] == (save / "checkpoint_1_2", False)
    (branch / "checkpoint_last").mkdir(parents=True)
    (branch / "checkpoint_last" / "trainer_state.json").write_text("{}")
    (branch / "checkpoint_last" / ".metadata").write_bytes(b"")
    assert choice(save_dir=branch, continue_once=str(save / "checkpoint_1_2"))[:2] == (
        branch / "checkpoint_last",
        False,
    )
    with pytest.raises(UsageError, match="--continue-once typo is not a checkpoint"):
        choice(save_dir=tmp_path / "fresh", continue_once="typo")
    with pytest.raises(UsageError, match="--continue-once and --restore-file name two checkpoints"):
        choice("checkpoint_1_2", continue_once=str(save / "checkpoint_1_2"))
    (tmp_path / "model.pt").write_bytes(b"a fairseq checkpoint")
    with pytest.raises(UsageError, match="is a file"):
        choice(str(tmp_path / "model.pt"))
    shutil.rmtree(save / "checkpoint_last")  # a run of --no-last-checkpoints
    with pytest.raises(UsageError, match=r"holds checkpoint_1_2: fix the path \(e.g. --restore-file checkpoint_1_2\)"):
        choice("typo.pt")
    assert _kind(save / "checkpoint_1_2.pt") == ("checkpoint", save / "checkpoint_1_2")


@pytest.mark.slow
def test_sigkill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, capfd):
    """Saves every update of a ~12 M-parameter model (≈150 MB per checkpoint); SIGKILL
    lands while the next one is being written; the previous checkpoint_last resumes (one
    rank, in this process)."""
    save = tmp_path / "ckpt"
    big = [
        "--dict-size",
        "32768",
        "--decoder-embed-dim",
        "256",
        "--decoder-ffn-embed-dim",
        "1024",
        "--decoder-attention-heads",
        "4",
        "--decoder-layers",
        "4",
        "--batch-size",
        "2",
    ]
    cmd = (
        [str(Path(sys.executable).with_name("train"))]
        + SAVE
        + big
        + [
            "--max-update",
            "200",
            "--save-dir",
            str(save),
            "--save-interval-updates",
            "1",
            "--keep-interval-updates",
            "1",
            "--ddp-backend",
            "fully_sharded",
            "--distributed-world-size",
            "2",
            "--log-format",
            "json",
        ]
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    tmp = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline and tmp is None:
            partial = [p for p in save.glob(".tmp-*/*.distcp")] if (save / "checkpoint_last").exists() else []
            tmp = partial[0].parent if partial else None
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert tmp is not None, "never caught a save in progress"
    # Resumed once the killed job is gone, ranks too (rank 0 holds the save dir's lock until
    # it has exited; the resume below starts at once, without a fresh process's start-up).
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    before = json.loads((save / "checkpoint_last" / "trainer_state.json").read_text())["num_updates"]
    records, r = train_here(
        SAVE
        + big
        + [
            "--max-update",
            str(before + 1),
            "--save-dir",
            str(save),
            "--ddp-backend",
            "fully_sharded",
            "--log-format",
            "json",
            "--log-interval",
            "1",
        ],
        capfd,
    )
    assert f"@ {before} updates" in r.stdout + r.stderr
    assert [rec["num_updates"] for rec in records["train_inner"]] == [before + 1]


def test_finetune_from_model_takes_weights_only(tmp_path, capfd):
    train_here(SAVE + ["--batch-size", "4", "--max-update", "10", "--save-dir", str(tmp_path / "pre")], capfd)
    records, r = train_here(
        SAVE
        + [
            "--batch-size",
            "4",
            "--max-update",
            "3",
            "--save-dir",
            str(tmp_path / "ft"),
            "--finetune-from-model",
            str(tmp_path / "pre" / "checkpoint_last"),
            "--log-format",
            "json",
            "--log-interval",
            "1",
        ],
        capfd,
    )
    assert [rec["num_updates"] for rec in records["train_inner"]] == [1, 2, 3]
    fresh, _ = train_here(
        SAVE + ["--batch-size", "4", "--max-update", "1", "--log-format", "json", "--log-interval", "1"], capfd
    )
    assert records["train_inner"][0]["loss"] < fresh["train_inner"][0]["loss"] - 0.1  # it starts trained
    _, r = run_train(
        SAVE
        + [
            "--batch-size",
            "4",
            "--max-update",
            "3",
            "--save-dir",
            str(tmp_path / "ft2"),
            "--finetune-from-model",
            str(tmp_path / "pre" / "checkpoint_last"),
            "--reset-optimizer",
        ],
        check=False,
    )
    assert r.returncode != 0 and "--finetune-from-model" in r.stderr and "Traceback" not in r.stderr


def test_loading_never_runs_pickled_code(saved_2, tmp_path):
    """A .metadata that would call a function when unpickled is refused before it runs."""
    import pickle

    save = saved_2
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (save / "checkpoint_last" / ".metadata").write_bytes(pickle.dumps(Evil()))
    _, r = run_train(SAVE + ["--batch-size", "4", "--max-update", "4", "--save-dir", str(save)], check=False)
    assert r.returncode != 0 and not marker.exists()
    assert "not allowed" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_damaged_shard_is_reported_in_one_line(saved_2):
    save = saved_2
    shard = next((save / "checkpoint_last").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    _, r = run_train(SAVE + ["--batch-size", "4", "--max-update", "4", "--save-dir", str(save)], check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        line for line in r.stderr.strip().splitlines() if "could not be read" in line
    ], r.stderr
