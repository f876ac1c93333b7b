"""Training with nag, cpu_adam, reduce_lr_on_plateau and --stop-min-lr: on 2 FSDP ranks as
in one process, and through a checkpoint as without one (real `train` loops over gloo)."""

import json
from pathlib import Path

import pytest

from helpers import DUMMY, compose, multi_rank_losses, run_ranks, train_updates, update_losses

UPDATES = 5
BASE = DUMMY + ["--clip-norm", "0.5"]
SAVE = [a for a in DUMMY if a != "--no-save"] + ["--clip-norm", "0.5"]
FSDP = ["--ddp-backend", "fully_sharded"]
CPU_ADAM = FSDP + ["--optimizer", "cpu_adam", "--cpu-offload"]


@pytest.mark.parametrize(
    "optimizer,reference",
    [
        (
            ["--optimizer", "nag", "--weight-decay", "0.01", "--lr", "1.0"],
            ["--optimizer", "nag", "--weight-decay", "0.01", "--lr", "1.0"],
        ),
        # cpu_adam is adam stepped on the host: the same numbers as adam in one process
        (["--optimizer", "cpu_adam", "--cpu-offload", "--weight-decay", "0.01"], ["--weight-decay", "0.01"]),
    ],
)
def test_two_fsdp_ranks_match_one_process(optimizer, reference, tmp_path):
    # one process, each batch holding what the 2 ranks read
    ref_losses, ref_gnorms = update_losses(BASE + reference + ["--batch-size", "4"], UPDATES, with_gnorm=True, merge=2)
    losses, gnorms = multi_rank_losses(BASE + optimizer + FSDP + ["--batch-size", "4"], 2, UPDATES, tmp_path)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert gnorms == pytest.approx(ref_gnorms, rel=1e-5)
    assert ref_losses[-1] < ref_losses[0]


def test_cpu_adam_checkpoint_resumes_with_adam_and_back(tmp_path):
    """Their state is the same: 6 updates with cpu_adam (saved every 2) = updates 1-2 with
    cpu_adam, 3-4 resumed with adam (no offload), 5-6 resumed with cpu_adam again."""
    common = SAVE + ["--batch-size", "8", "--save-interval-updates", "2", "--disable-validation"]
    whole = train_updates(common + CPU_ADAM + ["--max-update", "6", "--save-dir", str(tmp_path / "a")], 1, tmp_path)
    adam = train_updates(
        common
        + FSDP
        + [
            "--optimizer",
            "adam",
            "--max-update",
            "4",
            "--save-dir",
            str(tmp_path / "b"),
            "--restore-file",
            str(tmp_path / "a" / "checkpoint_1_2"),
        ],
        1,
        tmp_path,
    )
    back = train_updates(
        common
        + CPU_ADAM
        + [
            "--max-update",
            "6",
            "--save-dir",
            str(tmp_path / "c"),
            "--restore-file",
            str(tmp_path / "b" / "checkpoint_1_4"),
        ],
        1,
        tmp_path,
    )
    assert sorted(adam) == [3, 4] and sorted(back) == [5, 6]
    for n, (loss, gnorm) in {**adam, **back}.items():
        assert (loss, gnorm) == pytest.approx(whole[n], rel=1e-6), f"update {n}"


def test_nag_resumes_on_another_number_of_ranks(tmp_path):
    """NAG's momentum buffers (and the lr of the step before the save, which rescales them
    while the lr changes) are saved sharded on 2 FSDP ranks and loaded by one process."""
    common = SAVE + [
        "--optimizer",
        "nag",
        "--lr",
        "0.5",
        "--lr-scheduler",
        "cosine",
        "--warmup-updates",
        "2",
        "--max-update",
        "5",
        "--disable-validation",
    ]
    whole = train_updates(
        common + FSDP + ["--batch-size", "4", "--save-interval-updates", "3", "--save-dir", str(tmp_path / "a")],
        2,
        tmp_path,
    )
    resumed = train_updates(
        common
        + [
            "--batch-size",
            "4",
            "--update-freq",  # the 2 ranks' batches (an epoch's batches depend on the per-rank batch)
            "2",
            "--save-dir",
            str(tmp_path / "b"),
            "--restore-file",
            str(tmp_path / "a" / "checkpoint_1_3"),
        ],
        1,
        tmp_path,
    )
    assert sorted(resumed) == [4, 5]
    for n, (loss, gnorm) in resumed.items():
        assert (loss, gnorm) == pytest.approx(whole[n], rel=1e-5), f"update {n}"


def _lr_recording_rank(index, argv, out):
    """One process of `train` (trainer.main.run: the loop, validation, checkpoints), recording
    each update's lr and exact loss."""
    from trainer.rendezvous import Rendezvous
    from trainer.train import main
    from trainer.train.trainer import Trainer

    step, updates = Trainer.train_step, []

    def recording(self, samples):
        update = step(self, samples)
        stats = update.values()
        updates.append([self.num_updates, self.lr, stats["loss_sum"] / stats["ntokens"]])
        return update

    Trainer.train_step = recording
    main.run(compose(argv), Rendezvous("", 1))
    Path(out).write_text(json.dumps(updates))


def lr_updates(argv, tmp_path, name):
    """{num_updates: (lr, loss)} of a one-process `train` run, and its log."""
    out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    run_ranks(_lr_recording_rank, (argv + ["--log-file", str(log)], str(out)), 1)
    return {n: (lr, loss) for n, lr, loss in json.loads(out.read_text())}, log.read_text()


STOP_LINE = (
    "stopping training because current learning rate ({}) is smaller than or equal to minimum "
    "learning rate (--stop-min-lr=5e-05)"
)


def test_plateau_shrinks_the_lr_survives_a_resume_and_stop_min_lr_stops(tmp_path):
    """4 updates an epoch, validated on the training split. The loss never halves, so with
    --lr-threshold 0.5 every epoch after the first is a plateau: the lr is 0.003 for epochs
    1-2, 0.0003 for epoch 3, then 3e-5 <= --stop-min-lr, and training stops before epoch 4
    (fairseq's test, before each epoch) with fairseq's line. Resumed from the end of epoch
    2, a run continues the same lr and losses; with --reset-lr-scheduler it starts at --lr."""
    argv = SAVE + [
        "--batch-size",
        "8",
        "--dataset-size",
        "32",
        "--valid-subset",
        "train",
        "--log-format",
        "json",
        "--lr-scheduler",
        "reduce_lr_on_plateau",
        "--lr-shrink",
        "0.1",
        "--lr-threshold",
        "0.5",
        "--stop-min-lr",
        "5e-5",
        "--max-epoch",
        "6",
        "--save-interval",
        "2",
    ]  # saves after epoch 2
    whole, log = lr_updates(argv + ["--save-dir", str(tmp_path / "a")], tmp_path, "whole")
    assert sorted(whole) == list(range(1, 13))
    assert [whole[n][0] for n in (1, 8, 9, 12)] == pytest.approx([0.003, 0.003, 0.0003, 0.0003])
    assert STOP_LINE.format(0.003 * 0.1 * 0.1) in log

    epoch2 = ["--restore-file", str(tmp_path / "a" / "checkpoint2")]
    resumed, log = lr_updates(argv + epoch2 + ["--save-dir", str(tmp_path / "b")], tmp_path, "resumed")
    assert sorted(resumed) == list(range(9, 13))
    for n, (lr, loss) in resumed.items():
        assert lr == pytest.approx(whole[n][0]) and loss == pytest.approx(whole[n][1], rel=1e-6), f"update {n}"
    assert STOP_LINE.format(0.003 * 0.1 * 0.1) in log

    reset, _ = lr_updates(
        argv + epoch2 + ["--max-epoch", "3", "--reset-lr-scheduler", "--save-dir", str(tmp_path / "c")],
        tmp_path,
        "reset",
    )
    assert sorted(reset) == list(range(9, 13)) and {lr for lr, _ in reset.values()} == {0.003}
