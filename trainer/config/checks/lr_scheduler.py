"""Checks of the lr_scheduler group: which schedule reads which option, each option's range,
and what each schedule needs of --max-update and --lr. Also what the config's text means
where a schedule and its check must agree on it: manual's dicts (parse_manual_lr) and the
length of wsd's decay (wsd_decay_updates), read by trainer/train/lr_schedule.py too."""

import ast
import math

from trainer.config.checks.optim import check_options_read
from trainer.config.checks.values import non_negative
from trainer.errors import UsageError

WARMUP_READERS = ("fixed", "inverse_sqrt", "polynomial_decay", "cosine", "reduce_lr_on_plateau", "step", "wsd")
TRI_STAGE = ("tri_stage",)

# Options read by some schedules only: set (away from its default) for another, each
# would be accepted and ignored. fixed and polynomial_decay warm up from 0 (fairseq's have
# no --warmup-init-lr).
SCHEDULE_READERS = {
    "lr_scheduler.warmup_updates": WARMUP_READERS,
    "lr_scheduler.warmup_init_lr": ("inverse_sqrt", "cosine", "reduce_lr_on_plateau", "step", "wsd"),
    "lr_scheduler.end_learning_rate": ("polynomial_decay",),
    "lr_scheduler.power": ("polynomial_decay",),
    "lr_scheduler.total_num_update": ("polynomial_decay",),
    "lr_scheduler.min_lr": ("cosine", "step", "wsd"),
    "lr_scheduler.t_mult": ("cosine",),
    "lr_scheduler.lr_period_updates": ("cosine", "triangular"),
    "lr_scheduler.lr_shrink": ("cosine", "reduce_lr_on_plateau", "triangular"),
    "lr_scheduler.lr_threshold": ("reduce_lr_on_plateau",),
    "lr_scheduler.lr_patience": ("reduce_lr_on_plateau",),
    "lr_scheduler.decay_updates": ("wsd",),
    "lr_scheduler.decay_ratio": ("wsd",),
    "lr_scheduler.decay_type": ("wsd",),
    "lr_scheduler.warmup_steps": TRI_STAGE,
    "lr_scheduler.hold_steps": TRI_STAGE,
    "lr_scheduler.decay_steps": TRI_STAGE,
    "lr_scheduler.phase_ratio": TRI_STAGE,
    "lr_scheduler.init_lr_scale": TRI_STAGE,
    "lr_scheduler.final_lr_scale": TRI_STAGE,
    "lr_scheduler.max_lr": ("triangular",),
    "lr_scheduler.shrink_min": ("triangular",),
    "lr_scheduler.lr_decay_period": ("step",),
    "lr_scheduler.lr_decay": ("step",),
    "lr_scheduler.epoch2lr": ("manual",),
    "lr_scheduler.update2lr": ("manual",),
}
# Where the option refused is another schedule's name for what the user meant.
HINTS = {
    "lr_scheduler.min_lr": "; to stop training at a low lr: --stop-min-lr",
    "lr_scheduler.warmup_updates": " (tri_stage's warmup is --warmup-steps)",
    "lr_scheduler.warmup_steps": " (the other schedules' warmup is --warmup-updates)",
    "lr_scheduler.decay_steps": " (wsd's decay is --decay-updates)",
}


def check_lr_scheduler(cfg):
    schedule, max_update = cfg.lr_scheduler, cfg.optimization.max_update
    non_negative(
        cfg,
        "lr_scheduler.warmup_updates",
        "lr_scheduler.power",
        "lr_scheduler.end_learning_rate",
        "lr_scheduler.min_lr",
    )
    if schedule.warmup_init_lr < 0 and schedule.warmup_init_lr != -1:
        raise UsageError(f"--warmup-init-lr must be >= 0 (or -1: start at 0), got {schedule.warmup_init_lr}")
    if schedule._name == "polynomial_decay" and not (schedule.total_num_update or max_update):
        raise UsageError("--lr-scheduler polynomial_decay needs --total-num-update or --max-update")
    if schedule._name == "pass_through":
        raise UsageError(
            "--lr-scheduler pass_through hands the lr to the optimizer's own schedule, which in fairseq "
            "only its composite optimizer has and no optimizer here does; pick another --lr-scheduler"
        )
    check_options_read(cfg, "lr_scheduler", SCHEDULE_READERS, HINTS)
    check = SCHEDULE_CHECKS.get(schedule._name)
    if check is not None:
        check(cfg)


def _check_cosine(cfg):
    schedule, max_update = cfg.lr_scheduler, cfg.optimization.max_update
    if schedule.t_mult <= 0:
        raise UsageError(
            f"--t-mult must be positive (each cosine cycle's length over the last's), got {schedule.t_mult}"
        )
    if schedule.lr_shrink <= 0:
        raise UsageError(
            f"--lr-shrink must be positive (each cosine cycle's lr over the last's), got {schedule.lr_shrink}"
        )
    if schedule.lr_period_updates != -1 and schedule.lr_period_updates <= 0:
        raise UsageError(
            f"--lr-period-updates must be positive (or -1: --max-update minus --warmup-updates), "
            f"got {schedule.lr_period_updates}"
        )
    if schedule.lr_period_updates == -1 and not max_update:
        raise UsageError("--lr-scheduler cosine needs --lr-period-updates or --max-update")
    warmup = schedule.warmup_updates
    period = schedule.lr_period_updates if schedule.lr_period_updates > 0 else max(max_update - warmup, 1)
    if schedule.t_mult < 1 and not (max_update and max_update - warmup < period / (1 - schedule.t_mult)):
        # fairseq's formula has no cycle past the sum of the shrinking cycles' lengths
        raise UsageError(
            f"--t-mult {schedule.t_mult} shrinks the cosine cycles to "
            f"{period / (1 - schedule.t_mult):g} updates in all, fewer than --max-update "
            f"{max_update or 'unlimited'} after warmup; use --t-mult 1 or more, or a longer "
            "--lr-period-updates"
        )


def _check_plateau(cfg):
    schedule = cfg.lr_scheduler
    if not 0 < schedule.lr_shrink < 1:
        raise UsageError(
            f"--lr-shrink must be in (0, 1) for reduce_lr_on_plateau (the lr's factor on a "
            f"plateau), got {schedule.lr_shrink}"
        )
    non_negative(cfg, "lr_scheduler.lr_threshold", "lr_scheduler.lr_patience")


def wsd_decay_updates(schedule, max_update):
    """The number of updates wsd decays over: --decay-updates, or --decay-ratio times
    --max-update rounded to the nearest update (torchtitan's round)."""
    if schedule.decay_ratio is not None:
        return round(schedule.decay_ratio * max_update)
    return schedule.decay_updates


def _check_wsd(cfg):
    schedule, max_update, lr = cfg.lr_scheduler, cfg.optimization.max_update, cfg.optimization.lr
    if (schedule.decay_updates is None) == (schedule.decay_ratio is None):
        raise UsageError(
            "--lr-scheduler wsd decays over --decay-updates N or --decay-ratio F (of --max-update): give one"
            + ("" if schedule.decay_updates is None else ", not both")
            + " (--decay-updates 0: no decay yet, branch one later from a checkpoint)"
        )
    if schedule.decay_ratio is not None and not 0 < schedule.decay_ratio <= 1:
        raise UsageError(
            f"--decay-ratio must be in (0, 1] (the decay's share of --max-update), got {schedule.decay_ratio}"
        )
    if schedule.decay_updates is not None and schedule.decay_updates < 0:
        raise UsageError(f"--decay-updates must be >= 0, got {schedule.decay_updates}")
    decay = wsd_decay_updates(schedule, max_update)
    if decay and not max_update:
        raise UsageError("--lr-scheduler wsd's decay ends at --max-update: set it (or --decay-updates 0, no decay)")
    if schedule.decay_ratio is not None and decay == 0:
        raise UsageError(
            f"--decay-ratio {schedule.decay_ratio} of --max-update {max_update} is 0 updates; "
            "use a larger ratio, or --decay-updates"
        )
    if schedule.warmup_updates + decay > max_update > 0:
        raise UsageError(
            f"wsd's warmup ({schedule.warmup_updates}) and decay ({decay}) updates are more than --max-update "
            f"{max_update}; shorten them or raise --max-update"
        )
    if schedule.min_lr > lr:
        raise UsageError(f"--min-lr {schedule.min_lr:g} is wsd's final lr: it must be at most --lr {lr:g}")


def _check_tri_stage(cfg):
    schedule, max_update = cfg.lr_scheduler, cfg.optimization.max_update
    steps = (schedule.warmup_steps, schedule.hold_steps, schedule.decay_steps)
    if schedule.phase_ratio:
        ratio = list(schedule.phase_ratio)
        if len(ratio) != 3 or any(r < 0 for r in ratio) or not math.isclose(sum(ratio), 1.0):
            raise UsageError(
                f'--phase-ratio needs three fractions >= 0 of --max-update adding up to 1 like "(0.1, 0.4, 0.5)", '
                f"got {ratio}"
            )
        if not max_update:
            raise UsageError("--phase-ratio is a share of --max-update: set it, or give --warmup-steps etc.")
        if any(steps):
            raise UsageError(
                "--phase-ratio sets tri_stage's --warmup-steps, --hold-steps and --decay-steps: drop those, or it"
            )
        steps = tuple(int(max_update * r) for r in ratio)
    if min(steps) < 0:
        raise UsageError(f"--warmup-steps, --hold-steps and --decay-steps must be >= 0, got {list(steps)}")
    if steps[2] == 0:  # fairseq divides by it
        raise UsageError("--lr-scheduler tri_stage needs a decay: --decay-steps N (or --phase-ratio's third) > 0")
    if schedule.init_lr_scale < 0:
        raise UsageError(f"--init-lr-scale must be >= 0, got {schedule.init_lr_scale}")
    if schedule.final_lr_scale <= 0:  # the decay's rate is its log
        raise UsageError(f"--final-lr-scale must be positive (the decay is exponential), got {schedule.final_lr_scale}")


def _check_triangular(cfg):
    schedule, lr = cfg.lr_scheduler, cfg.optimization.lr
    if schedule.max_lr is None or schedule.max_lr <= lr:
        raise UsageError(
            f"--lr-scheduler triangular cycles from --lr {lr:g} up to --max-lr: give a --max-lr above it"
            + ("" if schedule.max_lr is None else f" (got {schedule.max_lr:g})")
        )
    if schedule.lr_period_updates < 2:
        raise UsageError(
            f"--lr-period-updates must be at least 2 for triangular (half a cycle up, half down), "
            f"got {schedule.lr_period_updates}"
        )
    if schedule.lr_shrink <= 0:
        raise UsageError(f"--lr-shrink must be positive (each cycle's lr over the last's), got {schedule.lr_shrink}")


def _check_step(cfg):
    schedule, lr = cfg.lr_scheduler, cfg.optimization.lr
    if schedule.lr_decay_period <= 0:
        raise UsageError(f"--lr-decay-period must be positive, got {schedule.lr_decay_period}")
    if not 0 <= schedule.lr_decay <= 1:
        raise UsageError(f"--lr-decay must be in [0, 1] (the lr's factor each period), got {schedule.lr_decay}")
    if schedule.min_lr >= lr:
        raise UsageError(f"--min-lr {schedule.min_lr:g} is step's floor: it must be below --lr {lr:g}")


def parse_manual_lr(text, flag):
    """fairseq's parse_manuallr_args: a dict whose keys are a number, numbers joined by ','
    or a range 'a-b' (both ends in), each mapped to its lr: "{'1': 0.1, '2-3': 0.05}" ->
    {1: 0.1, 2: 0.05, 3: 0.05}. Spaces are dropped first, as fairseq does."""
    try:
        given = ast.literal_eval(text.replace(" ", ""))
    except (ValueError, SyntaxError):
        given = None
    if not isinstance(given, dict):
        raise UsageError(f"{flag} must be a dict like \"{{'1': 0.1, '2-4': 0.05, '5,7': 0.01}}\", got {text!r}")
    lrs = {}
    for key, value in given.items():
        key = str(key)
        try:
            if "," in key:
                numbers = [int(k) for k in key.split(",")]
            elif "-" in key:
                first, last = key.split("-")
                numbers = range(int(first), int(last) + 1)
            else:
                numbers = [int(key)]
            value = float(value)
        except (ValueError, TypeError):
            raise UsageError(f"{flag}: {key!r}: {value!r} is not N, N,M or N-M mapped to an lr") from None
        if not value >= 0:
            raise UsageError(f"{flag}: the lr of {key!r} must be >= 0, got {value}")
        lrs.update(dict.fromkeys(numbers, value))
    return lrs


def _check_manual(cfg):
    parse_manual_lr(cfg.lr_scheduler.epoch2lr, "--epoch2lr")
    parse_manual_lr(cfg.lr_scheduler.update2lr, "--update2lr")


SCHEDULE_CHECKS = {
    "cosine": _check_cosine,
    "reduce_lr_on_plateau": _check_plateau,
    "wsd": _check_wsd,
    "tri_stage": _check_tri_stage,
    "triangular": _check_triangular,
    "step": _check_step,
    "manual": _check_manual,
}
