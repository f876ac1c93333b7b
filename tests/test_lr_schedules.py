"""The schedules of issue 49 item 4: warmup-stable-decay (wsd) and fairseq's tri_stage,
triangular, step and manual. Each is checked at every update (and epoch boundary, for
manual) against a reference written here from fairseq's code (fairseq/optim/lr_scheduler/*.py
and the calls its trainer makes: step_update(0) once built, step_begin_epoch(e) then
step_update(n) at each epoch's start, step_update(n) after each update, step(e) then
step_update(n) at each epoch's end), or for wsd from its formula and torchtitan's lambda;
never by calling ours. Then a real `train` run branches a decay from a stable-phase
checkpoint, and the refusals. Older schedules: test_optim.py."""

import json
import math

import pytest

from helpers import DUMMY, compose, run_train, train_here
from trainer.errors import UsageError

UPDATES = 40  # every update checked, past each schedule's last phase


def schedule(*argv):
    from trainer.train.lr_schedule import LRSchedule

    return LRSchedule(compose(["--batch-size", "1", "--lr", "0.01", *argv]))


def lrs(s, n=UPDATES):
    return [s.lr(k) for k in range(n)]


# --------------------------------------------------------------------------- wsd
def wsd_reference(n, lr, warmup, init, max_update, decay, final, shape):
    """The docstring's formula, written out: warmup, then --lr, then the decay's last
    `decay` updates ending at max_update."""
    if n < warmup:
        return init + (lr - init) * n / warmup
    start = max_update - decay
    if n < start:
        return lr
    p = min(1.0, (n - start) / decay)
    f = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "1-sqrt": 1 - math.sqrt(p)}[shape]
    return final + (lr - final) * f


def torchtitan_wsd_factor(step, total, decay_steps, decay_type, min_lr_factor):
    """torchtitan's linear_warmup_stable_decay (components/optimizer/lr_scheduler.py) with no
    warmup: the factor of training step `step` (0-indexed), a virtual last step included."""
    stable = total + 1 - decay_steps
    if step < stable:
        return 1.0
    progress = (step + 1 - stable) / decay_steps
    f = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress), "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}
    return min_lr_factor + (1 - min_lr_factor) * f[decay_type]


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_warms_up_holds_and_decays_to_min_lr_at_max_update(shape):
    argv = ["--lr-scheduler", "wsd", "--warmup-updates", "5", "--max-update", "30", "--decay-type", shape]
    by_updates = schedule(*argv, "--decay-updates", "12", "--min-lr", "0.001")
    expected = [wsd_reference(n, 0.01, 5, 0.0, 30, 12, 0.001, shape) for n in range(UPDATES)]
    assert lrs(by_updates) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert by_updates.lr(17) == 0.01 and by_updates.lr(18) == pytest.approx(0.01)  # the decay's first runs at --lr
    assert by_updates.lr(30) == pytest.approx(0.001) and by_updates.lr(39) == pytest.approx(0.001)
    # --decay-ratio 0.4 of 30 updates: the same 12; 0.25 of 30 = 7.5 rounds to 8 (round half to even)
    by_ratio = schedule(*argv, "--decay-ratio", "0.4", "--min-lr", "0.001", "--warmup-init-lr", "0.002")
    expected = [wsd_reference(n, 0.01, 5, 0.002, 30, 12, 0.001, shape) for n in range(UPDATES)]
    assert lrs(by_ratio) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    quarter = schedule(*argv, "--decay-ratio", "0.25")
    assert lrs(quarter) == pytest.approx(
        [wsd_reference(n, 0.01, 5, 0.0, 30, 8, 0.0, shape) for n in range(UPDATES)], rel=1e-12, abs=1e-15
    )


@pytest.mark.parametrize("shape,titan", [("linear", "linear"), ("cosine", "cosine"), ("1-sqrt", "sqrt")])
def test_wsd_without_warmup_is_torchtitans_decay(shape, titan):
    """torchtitan's factor of step s is the lr of update s + 1, ours after s updates."""
    s = schedule("--lr-scheduler", "wsd", "--max-update", "20", "--decay-ratio", "0.3", "--decay-type", shape)
    s_min = schedule(
        "--lr-scheduler",
        "wsd",
        "--max-update",
        "20",
        "--decay-updates",
        "6",
        "--decay-type",
        shape,
        "--min-lr",
        "0.002",
    )
    assert lrs(s, 20) == pytest.approx([0.01 * torchtitan_wsd_factor(k, 20, 6, titan, 0.0) for k in range(20)])
    assert lrs(s_min, 20) == pytest.approx([0.01 * torchtitan_wsd_factor(k, 20, 6, titan, 0.2) for k in range(20)])


def test_wsd_decay_updates_0_is_a_stable_run_with_no_end():
    s = schedule("--lr-scheduler", "wsd", "--warmup-updates", "4", "--decay-updates", "0")
    assert lrs(s, 8) == pytest.approx([0, 0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01, 0.01])
    assert s.lr(10**9) == 0.01


# --------------------------------------------------------------------- tri_stage
class FairseqTriStage:
    """fairseq's TriStageLRSchedule.step_update."""

    def __init__(self, lr, warmup, hold, decay, init_lr_scale=0.01, final_lr_scale=0.01):
        self.peak_lr, self.init_lr, self.final_lr = lr, init_lr_scale * lr, final_lr_scale * lr
        self.warmup_steps, self.hold_steps, self.decay_steps = warmup, hold, decay
        self.warmup_rate = (self.peak_lr - self.init_lr) / self.warmup_steps if self.warmup_steps != 0 else 0
        self.decay_factor = -math.log(final_lr_scale) / self.decay_steps

    def _decide_stage(self, update_step):
        if update_step < self.warmup_steps:
            return 0, update_step
        offset = self.warmup_steps
        if update_step < offset + self.hold_steps:
            return 1, update_step - offset
        offset += self.hold_steps
        if update_step <= offset + self.decay_steps:
            return 2, update_step - offset
        offset += self.decay_steps
        return 3, update_step - offset

    def step_update(self, num_updates):
        stage, steps_in_stage = self._decide_stage(num_updates)
        if stage == 0:
            return self.init_lr + self.warmup_rate * steps_in_stage
        if stage == 1:
            return self.peak_lr
        if stage == 2:
            return self.peak_lr * math.exp(-self.decay_factor * steps_in_stage)
        return self.final_lr


def test_tri_stage_is_fairseqs_by_steps_and_by_phase_ratio():
    s = schedule("--lr-scheduler", "tri_stage", "--warmup-steps", "6", "--hold-steps", "9", "--decay-steps", "12")
    ref = FairseqTriStage(0.01, 6, 9, 12)
    assert lrs(s) == pytest.approx([ref.step_update(n) for n in range(UPDATES)], rel=1e-12)
    s = schedule(
        "--lr-scheduler",
        "tri_stage",
        "--phase-ratio",
        "(0.1, 0.4, 0.5)",
        "--max-update",
        "35",
        "--init-lr-scale",
        "0.05",
        "--final-lr-scale",
        "0.2",
    )
    ref = FairseqTriStage(0.01, int(35 * 0.1), int(35 * 0.4), int(35 * 0.5), 0.05, 0.2)  # 3, 14, 17
    assert lrs(s) == pytest.approx([ref.step_update(n) for n in range(UPDATES)], rel=1e-12)
    no_warmup = schedule("--lr-scheduler", "tri_stage", "--hold-steps", "2", "--decay-steps", "3")
    ref = FairseqTriStage(0.01, 0, 2, 3)
    assert lrs(no_warmup, 8) == pytest.approx([ref.step_update(n) for n in range(8)], rel=1e-12)


# -------------------------------------------------------------------- triangular
def fairseq_triangular(num_updates, lr, max_lr, lr_period_updates, lr_shrink, shrink_min):
    """fairseq's TriangularLRSchedule.step_update."""
    stepsize = lr_period_updates // 2
    cycle = math.floor(num_updates / (2 * stepsize))
    shrink = lr_shrink**cycle
    top = max_lr * shrink
    bottom = lr * shrink if shrink_min else lr
    x = abs(num_updates / stepsize - 2 * (cycle + 1) + 1)
    return bottom + (top - bottom) * max(0, (1 - x))


@pytest.mark.parametrize("shrink_min", [False, True])
def test_triangular_is_fairseqs_with_and_without_shrink_min(shrink_min):
    argv = ["--lr-scheduler", "triangular", "--max-lr", "0.05", "--lr-period-updates", "9", "--lr-shrink", "0.5"]
    s = schedule(*argv, *(["--shrink-min"] if shrink_min else []))
    assert lrs(s) == pytest.approx(
        [fairseq_triangular(n, 0.01, 0.05, 9, 0.5, shrink_min) for n in range(UPDATES)], rel=1e-12
    )
    assert s.lr(4) == pytest.approx(0.05)  # the first cycle's top, 9 // 2 updates in
    # fairseq's cycle length when none is given: 5000
    s = schedule("--lr-scheduler", "triangular", "--max-lr", "0.05")
    assert s.lr(2500) == pytest.approx(0.05) and s.lr(5000) == pytest.approx(0.01)


# -------------------------------------------------------------------------- step
class FairseqStep:
    """fairseq's StepLRSchedule (its step_update)."""

    def __init__(self, lr, min_lr, period, decay, warmup_updates, warmup_init_lr):
        self.max_lr, self.min_lr, self.period, self.decay = lr, min_lr, period, decay
        self.warmup_updates = warmup_updates
        self.warmup_init_lr = warmup_init_lr if warmup_init_lr >= 0 else self.min_lr
        self.warmup_lr_step = (self.max_lr - self.warmup_init_lr) / warmup_updates if warmup_updates > 0 else 1

    def step_update(self, num_updates):
        if num_updates < self.warmup_updates:
            return self.warmup_init_lr + num_updates * self.warmup_lr_step
        curr_updates = num_updates - self.warmup_updates
        return max(self.max_lr * self.decay ** (curr_updates // self.period), self.min_lr)


def test_step_is_fairseqs_and_takes_its_misspelt_flag():
    s = schedule("--lr-scheduler", "step", "--lr-decay-period", "7", "--lr-decay", "0.5", "--min-lr", "0.0015")
    ref = FairseqStep(0.01, 0.0015, 7, 0.5, 0, -1)
    assert lrs(s) == pytest.approx([ref.step_update(n) for n in range(UPDATES)], rel=1e-12)
    assert s.lr(39) == 0.0015  # the floor
    s = schedule("--lr-scheduler", "step", "--lr-deacy-period", "4", "--warmup-updates", "5", "--min-lr", "0.001")
    ref = FairseqStep(0.01, 0.001, 4, 0.5, 5, -1)  # warmup from --min-lr
    assert lrs(s) == pytest.approx([ref.step_update(n) for n in range(UPDATES)], rel=1e-12)
    s = schedule("--lr-scheduler", "step", "--lr-decay-period", "4", "--warmup-updates", "5", "--warmup-init-lr", "0")
    ref = FairseqStep(0.01, 0.0, 4, 0.5, 5, 0)
    assert lrs(s) == pytest.approx([ref.step_update(n) for n in range(UPDATES)], rel=1e-12)


# ------------------------------------------------------------------------ manual
class FairseqManual:
    """fairseq's ManualSchedule over an optimizer's lr: step_begin_epoch sets --epoch2lr's
    (or leaves the lr), step_update sets --update2lr's (or leaves it); step(epoch) is the
    base class's, which changes no lr. The dicts are given parsed."""

    def __init__(self, epoch2lr, update2lr, lr):
        self.epoch2lr, self.update2lr = epoch2lr, update2lr
        self.optimizer_lr = epoch2lr[1] if 1 in epoch2lr else update2lr[1] if 1 in update2lr else lr

    def step_begin_epoch(self, epoch):
        keys = [k for k in self.epoch2lr if k <= epoch]
        if keys:
            self.optimizer_lr = self.epoch2lr[max(keys)]

    def step_update(self, num_updates):
        keys = [k for k in self.update2lr if k <= num_updates]
        if keys:
            self.optimizer_lr = self.update2lr[max(keys)]
        return self.optimizer_lr


def drive_epochs(ours, ref, epochs, updates_per_epoch):
    """fairseq's trainer calls, made on both: [(event, ours' lr, fairseq's lr)] at build, each
    epoch's start, after each update and at each epoch's end."""
    seen, n = [("built", ours.lr(0), ref.step_update(0))], 0
    for epoch in range(1, epochs + 1):
        ours.begin_epoch(epoch)
        ref.step_begin_epoch(epoch)
        seen.append((f"begin {epoch}", ours.lr(n), ref.step_update(n)))
        for _ in range(updates_per_epoch):
            n += 1
            seen.append((f"update {n}", ours.lr(n), ref.step_update(n)))
        ours.step_epoch(None, n)
        seen.append((f"end {epoch}", ours.lr(n), ref.step_update(n)))
    return seen


def test_manual_follows_epoch2lr_at_each_epochs_start_and_update2lr_once_it_applies():
    epoch2lr = "{'1': 0.1, '2-3': 0.05, '5,7': 0.02}"
    parsed = {1: 0.1, 2: 0.05, 3: 0.05, 5: 0.02, 7: 0.02}
    s = schedule("--lr-scheduler", "manual", "--epoch2lr", epoch2lr)
    seen = drive_epochs(s, FairseqManual(parsed, {}, 0.01), epochs=7, updates_per_epoch=3)
    assert [ours for _, ours, _ in seen] == [ref for _, _, ref in seen]
    assert dict((e, ours) for e, ours, _ in seen)["update 12"] == 0.05  # epoch 4 keeps epoch 3's
    # update2lr wins from its first key on; before it, epoch2lr (epoch 1 not in it: --lr)
    s = schedule("--lr-scheduler", "manual", "--epoch2lr", "{'2': 0.05}", "--update2lr", "{'7': 0.003, '10': 0.001}")
    seen = drive_epochs(s, FairseqManual({2: 0.05}, {7: 0.003, 10: 0.001}, 0.01), epochs=4, updates_per_epoch=3)
    assert [ours for _, ours, _ in seen] == [ref for _, _, ref in seen]
    assert [ours for e, ours, _ in seen if e in ("built", "update 4", "update 7", "update 10")] == [
        0.01,
        0.05,
        0.003,
        0.001,
    ]
    s = schedule("--lr-scheduler", "manual", "--update2lr", "{'1': 0.2, '3': 0.1}")  # update2lr's key 1 comes first
    seen = drive_epochs(s, FairseqManual({}, {1: 0.2, 3: 0.1}, 0.01), epochs=2, updates_per_epoch=2)
    assert [ours for _, ours, _ in seen] == [ref for _, _, ref in seen] and seen[0][1] == 0.2


def test_manual_resumes_at_its_saved_epoch():
    argv = ("--lr-scheduler", "manual", "--epoch2lr", "{'1': 0.1, '3': 0.01}")
    s = schedule(*argv)
    s.begin_epoch(3)
    resumed = schedule(*argv)
    assert resumed.lr(9) == 0.1  # no epoch begun yet: epoch 1's
    resumed.load_state_dict(json.loads(json.dumps(s.state_dict())))  # as trainer_state.json holds it
    assert resumed.lr(9) == s.lr(9) == 0.01


# ---------------------------------------------------------------- branching a decay
def run(argv, capfd):
    records, _ = train_here(argv, capfd)
    return records["train_inner"]


def test_a_decay_branched_from_a_stable_checkpoint_continues_its_curve(tmp_path, capfd):
    """The run with the decay from the start (8 updates, the last 4 a cosine decay), the stable
    run that stops at update 4 with its checkpoint (--decay-updates 0), and the branch from
    that checkpoint with --max-update 8 --decay-updates 4: the branch logs the decay's lr and
    the first run's losses, update by update."""
    common = [a for a in DUMMY if a != "--no-save"] + [
        "--required-batch-size-multiple",
        "1",
        "--batch-size",
        "4",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--disable-validation",
        "--lr-scheduler",
        "wsd",
        "--warmup-updates",
        "2",
        "--min-lr",
        "0.0003",
    ]
    decay = ["--max-update", "8", "--decay-updates", "4", "--decay-type", "cosine"]
    whole = run(common + decay + ["--no-save"], capfd)
    stable = run(common + ["--max-update", "4", "--decay-updates", "0", "--save-dir", tmp_path / "stable"], capfd)
    branch_argv = common + decay + ["--continue-once", tmp_path / "stable" / "checkpoint_last"]
    records, r = train_here(branch_argv + ["--save-dir", tmp_path / "branch"], capfd)
    branch = records["train_inner"]
    assert [r["num_updates"] for r in branch] == [5, 6, 7, 8] and "changes at once" not in r.stdout
    # requeued, the same command resumes the branch's own checkpoint_last: nothing left to do
    records, r = train_here(branch_argv + ["--save-dir", tmp_path / "branch"], capfd)
    assert "train_inner" not in records and "num_updates: 8 >= max_update: 8" in r.stdout
    # a branch whose decay began before its checkpoint: the lr jumps, and the log says so
    late = common + [
        "--max-update",
        "6",
        "--decay-updates",
        "3",
        "--continue-once",
        tmp_path / "stable" / "checkpoint_last",
    ]
    _, r = train_here(late + ["--save-dir", tmp_path / "late"], capfd)
    assert "the lr of update 5 is" in r.stdout and "0.003 under the checkpoint's: it changes at once" in r.stdout
    # the lr logged after update n is the schedule's at n: the decay's, ending at --min-lr
    expected = [wsd_reference(n, 0.003, 2, 0.0, 8, 4, 0.0003, "cosine") for n in range(1, 9)]
    assert [r["lr"] for r in whole] == pytest.approx(expected, rel=1e-5)
    assert [r["lr"] for r in branch] == pytest.approx(expected[4:], rel=1e-5) and branch[-1]["lr"] == pytest.approx(
        0.0003
    )
    assert [r["lr"] for r in stable] == pytest.approx([0.0015, 0.003, 0.003, 0.003])
    assert [r["loss"] for r in stable] == [r["loss"] for r in whole[:4]]
    assert [r["loss"] for r in branch] == [r["loss"] for r in whole[4:]]


def test_train_sets_manuals_epoch_lr_at_each_epochs_start(capfd):
    """4 updates an epoch: --epoch2lr's lr from epoch 2's first update on, as fairseq's
    trainer sets it (begin_epoch), and --update2lr's from update 7."""
    argv = DUMMY + ["--batch-size", "4", "--dataset-size", "16", "--required-batch-size-multiple", "1"]
    records = run(
        argv
        + ["--max-update", "8", "--log-format", "json", "--log-interval", "1", "--disable-validation"]
        + ["--lr-scheduler", "manual", "--epoch2lr", "{'1': 0.002, '2': 0.001}", "--update2lr", "{'7': 0.0005}"],
        capfd,
    )
    # the lr logged after update n is the next update's: epoch 1's until its end, then epoch 2's
    assert [(r["epoch"], r["num_updates"], r["lr"]) for r in records] == [
        (1, 1, 0.002),
        (1, 2, 0.002),
        (1, 3, 0.002),
        (1, 4, 0.002),
        (2, 5, 0.001),
        (2, 6, 0.001),
        (2, 7, 0.0005),
        (2, 8, 0.0005),
    ]


# --------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--decay-updates", "4", "--decay-ratio", "0.2", "--max-update", "20"],
            "--lr-scheduler wsd decays over --decay-updates N or --decay-ratio F (of --max-update): give one, not both",
        ),
        ([], "give one (--decay-updates 0: no decay yet"),
        (
            ["--decay-updates", "18", "--max-update", "20", "--warmup-updates", "5"],
            "wsd's warmup (5) and decay (18) updates are more than --max-update 20",
        ),
        (["--decay-updates", "4"], "wsd's decay ends at --max-update: set it"),
        (["--decay-ratio", "1.5", "--max-update", "20"], "--decay-ratio must be in (0, 1]"),
        (["--decay-ratio", "0.01", "--max-update", "20"], "--decay-ratio 0.01 of --max-update 20 is 0 updates"),
        (["--decay-updates", "4", "--max-update", "20", "--min-lr", "1"], "--min-lr 1 is wsd's final lr"),
        (["--decay-updates", "4", "--max-update", "20", "--decay-steps", "4"], "wsd's decay is --decay-updates"),
    ],
)
def test_wsd_refusals_are_one_line(argv, message):
    with pytest.raises(UsageError) as e:
        schedule("--lr-scheduler", "wsd", *argv)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--lr-scheduler", "pass_through"], "only its composite optimizer has and no optimizer here does"),
        (["--lr-scheduler", "tri_stage"], "tri_stage needs a decay: --decay-steps N"),
        (["--lr-scheduler", "tri_stage", "--decay-steps", "3", "--warmup-updates", "2"], "is --warmup-steps"),
        (["--lr-scheduler", "tri_stage", "--phase-ratio", "0.5,0.2,0.2", "--max-update", "9"], "adding up to 1"),
        (
            ["--lr-scheduler", "tri_stage", "--phase-ratio", "0.5,0.2,0.3", "--max-update", "9", "--hold-steps", "1"],
            "--phase-ratio sets tri_stage's --warmup-steps, --hold-steps and --decay-steps",
        ),
        (["--lr-scheduler", "triangular"], "up to --max-lr: give a --max-lr above it"),
        (["--lr-scheduler", "triangular", "--max-lr", "0.005"], "give a --max-lr above it (got 0.005)"),
        (["--lr-scheduler", "step", "--min-lr", "0.01"], "--min-lr 0.01 is step's floor"),
        (["--lr-scheduler", "step", "--lr-decay", "2"], "--lr-decay must be in [0, 1]"),
        (["--lr-scheduler", "manual", "--epoch2lr", "[0.1]"], "--epoch2lr must be a dict like"),
        (["--lr-scheduler", "manual", "--update2lr", "{'1-x': 0.1}"], "'1-x': 0.1 is not N, N,M or N-M"),
        (["--lr-scheduler", "cosine", "--shrink-min"], "--shrink-min is read by --lr-scheduler triangular only"),
        (["--warmup-init-lr", "0.001"], "--warmup-init-lr is read by --lr-scheduler inverse_sqrt, cosine"),
    ],
)
def test_fairseq_schedule_refusals_are_one_line(argv, message):
    with pytest.raises(UsageError) as e:
        schedule(*argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_train_refuses_both_decay_lengths_in_one_line_before_it_starts():
    # a tiny model: were the refusal gone, the run would take seconds
    argv = DUMMY + ["--batch-size", "4", "--lr-scheduler", "wsd", "--max-update", "20"]
    _, r = run_train(argv + ["--decay-updates", "4", "--decay-ratio", "0.2"], check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "train: error: --lr-scheduler wsd decays over --decay-updates N or --decay-ratio F (of --max-update): "
        "give one, not both (--decay-updates 0: no decay yet, branch one later from a checkpoint)"
    ]
