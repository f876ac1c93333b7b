"""Numerical faults, produced for real (a learning rate that diverges, an fp16 scale that
overflows every step): fp32 stops with fairseq's message naming the update, fp16 skips
updates until --min-loss-scale; the job ends non-zero with one line on stderr and the
checkpoints written before the fault are left exactly as they were.

The runs that fail are real `train` processes, but for three of one rank whose message is
checked in this process (tests/helpers.py train_here: the same entry point, exit code and
stderr); a run that only writes the checkpoints a failing one must leave alone is in this
process too."""

import hashlib
import json
from pathlib import Path

from helpers import DUMMY, run_train, train_here

# --no-save off, one checkpoint per update: any save after the fault would show (and no
# validation: no checkpoint_best beside them).
SAVING = [a for a in DUMMY if a != "--no-save"] + [
    "--batch-size",
    "4",
    "--save-interval-updates",
    "1",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--disable-validation",
]
FSDP2 = ["--ddp-backend", "fully_sharded", "--distributed-world-size", "2"]


def snapshot(save_dir):
    """Every file under save_dir with its content's hash (empty directories too)."""
    return {
        str(p.relative_to(save_dir)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(Path(save_dir).rglob("*"))
    }


def published(snap):
    """The checkpoints of a snapshot: not an unpublished .tmp- directory, nor config.yaml,
    which each run writes as it starts."""
    return {k: v for k, v in snap.items() if k.startswith("checkpoint")}


def fails_after_checkpoints(argv, good_updates, capfd, extra_second=()):
    """Train `good_updates` updates (saved; in this process), snapshot, run the same command
    further: it must fail, with one line on stderr, leaving the checkpoints byte-identical."""
    save = ["--save-dir", "ck"]
    train_here(argv + save + ["--max-update", str(good_updates)], capfd)
    before = snapshot("ck")
    assert f"checkpoint_1_{good_updates}/trainer_state.json" in before
    _, r = run_train(argv + save + list(extra_second) + ["--max-update", "8"], check=False)
    assert r.returncode != 0
    errors = r.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("train: error: "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert published(snapshot("ck")) == published(before)
    return errors[0], r.stdout


def test_nan_loss_stops_naming_the_update_and_saves_nothing(capfd):
    # Adam at lr 1e6 moves every weight by ~1e6: the next forward's loss is NaN.
    error, _ = fails_after_checkpoints(SAVING + ["--optimizer", "adam", "--lr", "1e6"], 1, capfd)
    assert "gradients are Nan/Inf at update 2 (loss nan" in error


def test_inf_gradients_with_a_finite_loss_stop_too(capfd):
    # SGD at lr 1e6: update 2's loss is huge but finite, its backward overflows. One run:
    # update 1 is saved, update 2 stops it, and checkpoint_last stays at update 1.
    _, r = train_here(
        SAVING + ["--optimizer", "sgd", "--lr", "1e6", "--save-dir", "ck", "--max-update", "8"], capfd, check=False
    )
    (error,) = r.stderr.strip().splitlines()
    assert r.returncode == 1 and error.startswith("train: error: gradients are Nan/Inf at update 2 (loss 2.")
    assert "gnorm nan" in error
    assert json.loads(Path("ck/checkpoint_last/trainer_state.json").read_text())["num_updates"] == 1
    assert sorted(p.name for p in Path("ck").glob("checkpoint*")) == ["checkpoint_1_1", "checkpoint_last"]


def test_weights_stepped_to_inf_are_never_saved(capfd):
    # An update with a finite loss and gradients can still step the weights to inf: the save
    # after it refuses, and no checkpoint appears at all.
    _, r = train_here(
        SAVING
        + ["--optimizer", "sgd", "--lr", "1e38", "--weight-decay", "10", "--save-dir", "ck", "--max-update", "4"],
        capfd,
        check=False,
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "train: error: parameters are Nan/Inf after update 1; nothing was saved from them: lower --lr or set "
        "--clip-norm, and resume from the last checkpoint"
    ]
    assert not any(p.name.startswith("checkpoint") for p in Path("ck").iterdir())


def test_a_learning_rate_beyond_float32_stops_in_one_line(capfd):
    _, r = train_here(
        SAVING + ["--optimizer", "sgd", "--lr", "1e300", "--save-dir", "ck", "--max-update", "2"], capfd, check=False
    )
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "train: error: the optimizer step of update 1 overflows float32 (--lr 1e+300); lower --lr"
    ]
    assert not any(Path("ck").glob("checkpoint*"))


def test_fp16_skips_overflows_then_stops_at_min_loss_scale(capfd):
    # --reset-optimizer takes the scale from --fp16-init-scale instead of the checkpoint:
    # 2**40 overflows every step; 2**39, 2**38, 2**37 are tried and skipped, 2**36 is the floor.
    argv = SAVING + ["--fp16"]
    error, stdout = fails_after_checkpoints(
        argv, 1, capfd, ["--reset-optimizer", "--fp16-init-scale", str(2**40), "--min-loss-scale", str(2**36)]
    )
    notes = [line.split("shardlm | ")[1] for line in stdout.splitlines() if "NOTE:" in line]
    assert notes == [
        f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {float(2**k)}"
        for k in (39, 38, 37)
    ]
    assert '"num_updates"' not in stdout  # nothing after the resumed update 1 was counted
    assert error.startswith(
        f"train: error: Minimum loss scale reached ({float(2**36)}) at update 2, where the "
        f"loss overflowed at scale {float(2**37)}. Your loss is probably exploding."
    )


def test_two_fsdp_ranks_stop_together_with_a_save_in_flight():
    # SGD at lr 1e3 diverges at update 3. Update 1's asynchronous save is published when
    # update 2's starts; update 2's is still in flight when update 3 fails and must stay
    # unpublished. Both ranks stop at once (a rank left waiting would hang the job).
    _, r = run_train(
        SAVING + FSDP2 + ["--optimizer", "sgd", "--lr", "1e3", "--save-async", "--save-dir", "ck", "--max-update", "8"],
        check=False,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    (error,) = r.stderr.strip().splitlines()
    assert error.startswith("train: error: [rank 0] gradients are Nan/Inf at update 3 (loss ")
    last = json.loads(Path("ck/checkpoint_last/trainer_state.json").read_text())
    assert last["num_updates"] == 1
    assert sorted(p.name for p in Path("ck").glob("checkpoint*")) == ["checkpoint_1_1", "checkpoint_last"]


def test_two_fsdp_ranks_agree_on_fp16_overflows():
    # The overflow is found on one rank's gradient shards; both must halve and skip together.
    _, r = run_train(
        SAVING
        + FSDP2
        + [
            "--fp16",
            "--fp16-init-scale",
            str(2**40),
            "--min-loss-scale",
            str(2**37),
            "--save-dir",
            "ck",
            "--max-update",
            "4",
        ],
        check=False,
    )
    assert r.returncode == 1 and r.stdout.count("NOTE: gradient overflow detected") == 2
    (error,) = r.stderr.strip().splitlines()
    assert error.startswith(f"train: error: [rank 0] Minimum loss scale reached ({float(2**37)}) at update 1, ")
    assert not any(Path("ck").glob("checkpoint*"))
