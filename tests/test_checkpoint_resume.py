"""A resumed run continues the same curve: stopped and resumed on the same ranks (DDP,
FSDP, --update-freq, fp16, --save-async), on other ranks and backends (FSDP on 2 ranks to
DDP on 1 or 2, FSDP on 3, hybrid sharding on 4, at the saved run's per-rank batch or one that
divides it), a DDP checkpoint under FSDP, and a
checkpoint of the previous format. tests/test_checkpoint.py holds the checkpoint
directories' names, retention, restore choices and refusals."""

import json
import shutil
from pathlib import Path

import pytest

from helpers import DUMMY, train_updates

# Batches of exactly --batch-size (none cut to fairseq's multiple of 8): one update of 12
# batches of one is 1 rank x 12 micro-batches or 2 x 6 (RESHARD).
SAVE = [a for a in DUMMY if a != "--no-save"] + ["--required-batch-size-multiple", "1"]


def _split_run(argv, world, save_dir, tmp_path, resume_argv=None, resume_world=None):
    """10 updates, stop, then resume to 20 (optionally with other flags / ranks)."""
    first = train_updates(argv + ["--max-update", "10", "--save-dir", str(save_dir)], world, tmp_path)
    second = train_updates(
        (resume_argv or argv) + ["--max-update", "20", "--save-dir", str(save_dir)], resume_world or world, tmp_path
    )
    assert sorted(first) == list(range(1, 11)) and sorted(second) == list(range(11, 21)), "an update ran twice"
    return {**first, **second}


EXACT = {
    # dropout on: the resumed run must also continue every rank's random stream
    "ddp": (2, ["--batch-size", "4", "--dropout", "0.1"]),
    "fsdp": (2, ["--batch-size", "4", "--ddp-backend", "fully_sharded"]),
    "fsdp_update_freq": (2, ["--batch-size", "2", "--update-freq", "2", "--ddp-backend", "fully_sharded"]),
    "fsdp_fp16": (2, ["--batch-size", "4", "--ddp-backend", "fully_sharded", "--fp16", "--fp16-init-scale", "4"]),
    # written in the background while training goes on, published when complete
    "fsdp_save_async": (
        2,
        ["--batch-size", "4", "--ddp-backend", "fully_sharded", "--save-async", "--save-interval-updates", "3"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXACT))
def test_resume_is_exact(name, tmp_path):
    world, extra = EXACT[name]
    argv = SAVE + extra + ["--clip-norm", "0.5"]
    whole = train_updates(argv + ["--max-update", "20", "--no-save"], world, tmp_path)
    split = _split_run(argv, world, tmp_path / "ckpt", tmp_path)
    assert sorted(split) == sorted(whole) == list(range(1, 21))
    for n in whole:
        assert split[n] == pytest.approx(whole[n], rel=1e-6, abs=1e-9), f"update {n}"
    assert whole[20][0] < whole[1][0]


# One update of 6 batches of two sequences each, dealt out to other ranks and micro-batches
# (an epoch's batches depend on the per-rank batch, not on the ranks): the curve must
# continue. At --batch-size 1 each saved batch of two is split in order (convert_position).
RESHARD = {
    "fsdp2_to_ddp1": (1, ["--batch-size", "2", "--update-freq", "6"]),
    "fsdp2_to_fsdp3_split": (3, ["--batch-size", "1", "--update-freq", "4", "--ddp-backend", "fully_sharded"]),
    "fsdp2_to_ddp2_split": (2, ["--batch-size", "1", "--update-freq", "6"]),
    "fsdp2_to_hybrid4_split": (
        4,
        ["--batch-size", "1", "--update-freq", "3", "--ddp-backend", "hybrid_shard", "--shard-group-size", "2"],
    ),
}


@pytest.fixture(scope="module")
def one_process_12(tmp_path_factory):
    return train_updates(
        SAVE + ["--batch-size", "2", "--update-freq", "6", "--max-update", "20", "--no-save"],
        1,
        tmp_path_factory.mktemp("ref"),
    )


@pytest.fixture(scope="module")
def saved_on_fsdp2(tmp_path_factory):
    """10 updates on 2 FSDP ranks of 3 micro-batches of 2 each, saved once for every resharding case."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    first = train_updates(
        SAVE
        + [
            "--batch-size",
            "2",
            "--update-freq",
            "3",
            "--ddp-backend",
            "fully_sharded",
            "--max-update",
            "10",
            "--save-dir",
            str(tmp / "ckpt"),
        ],
        2,
        tmp,
    )
    return first, tmp / "ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESHARD))
def test_resume_on_other_ranks_and_backends(name, one_process_12, saved_on_fsdp2, tmp_path):
    import shutil

    world, extra = RESHARD[name]
    first, saved = saved_on_fsdp2
    shutil.copytree(saved, tmp_path / "ckpt")
    second = train_updates(SAVE + extra + ["--max-update", "20", "--save-dir", str(tmp_path / "ckpt")], world, tmp_path)
    assert sorted(second) == list(range(11, 21)), "an update ran twice"
    split = {**first, **second}
    for n in range(1, 21):
        assert split[n][0] == pytest.approx(one_process_12[n][0], rel=1e-5), f"update {n}"


def test_ddp_checkpoint_resumes_under_fsdp(tmp_path):
    ref = train_updates(SAVE + ["--batch-size", "4", "--max-update", "20", "--no-save"], 2, tmp_path)
    split = _split_run(
        SAVE + ["--batch-size", "4"],
        2,
        tmp_path / "ckpt",
        tmp_path,
        resume_argv=SAVE + ["--batch-size", "4", "--ddp-backend", "fully_sharded"],
    )
    for n in range(1, 21):
        assert split[n][0] == pytest.approx(ref[n][0], rel=1e-5), f"update {n}"


# A checkpoint written by shardlm at ebbae74 (trainer_state.json format 1): 10 updates of this
# run on 2 FSDP ranks with fp16 and dropout, stopped mid-epoch after its validation. Its weights
# hold the data order and lr schedule they were trained with: it was written again by ebbae74's
# code with data/iterator.py of fairseq's order and LRSchedule.lr of fairseq's step_update
# (ebbae74's own code reproduces the first one bit for bit).
FORMAT_1 = Path(__file__).parent / "fixtures" / "checkpoint_ebbae74"
FORMAT_1_ARGV = [a for a in DUMMY if a != "--no-save"] + [
    "--decoder-layers",
    "1",
    "--decoder-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--dropout",
    "0.1",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "4",
    "--required-batch-size-multiple",
    "1",
    "--batch-size",
    "4",
    "--ddp-backend",
    "fully_sharded",
    "--fp16",
    "--fp16-init-scale",
    "4",
    "--clip-norm",
    "0.5",
]


def test_a_checkpoint_of_the_previous_format_resumes_exactly(tmp_path):
    """The data position, lr schedule, loss scale, meters, best loss and every rank's random
    stream of a format-1 checkpoint continue the run it was cut from, update for update."""
    save = tmp_path / "ckpt"
    save.mkdir()
    shutil.copytree(FORMAT_1, save / "checkpoint_last")
    assert json.loads((FORMAT_1 / "trainer_state.json").read_text())["format"] == 1
    resumed = train_updates(FORMAT_1_ARGV + ["--max-update", "13", "--save-dir", str(save)], 2, tmp_path)
    whole = train_updates(FORMAT_1_ARGV + ["--max-update", "13", "--no-save"], 2, tmp_path)
    assert sorted(resumed) == [11, 12, 13]
    # The fixture was cut from an fp16 run that divided the loss by the sample size before
    # backward; since 09bcce2 the gradients are divided after it (fairseq's order), so the
    # uninterrupted run now differs from the one it was cut from by fp16 rounding (1.5e-5).
    # A wrong data position or lr schedule moves the loss by orders of magnitude more.
    for n in resumed:
        assert resumed[n] == pytest.approx(whole[n], rel=1e-4, abs=1e-9), f"update {n}"
    state = json.loads((save / "checkpoint_last" / "trainer_state.json").read_text())
    assert state["format"] == 2 and state["num_updates"] == 13
    assert (
        state["state"]["loop"]["best_valid_loss"]
        <= json.loads((FORMAT_1 / "trainer_state.json").read_text())["best_valid_loss"]
    )
