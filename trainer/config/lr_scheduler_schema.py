"""The lr_scheduler group of the config schema (trainer/config/schema.py): one field per option
of every schedule, fairseq's names and defaults, each read by the schedules named in
trainer/config/checks/lr_scheduler.py's SCHEDULE_READERS and refused for the others."""

from dataclasses import dataclass
from typing import List, Optional

from trainer.config.option_field import option as _f

SCHEDULES = (
    "fixed",
    "inverse_sqrt",
    "polynomial_decay",
    "cosine",
    "reduce_lr_on_plateau",
    "wsd",
    "tri_stage",
    "triangular",
    "step",
    "manual",
    "pass_through",
)
DECAY_TYPES = ("linear", "cosine", "1-sqrt")


@dataclass
class LRSchedulerConfig:
    """trainer/train/lr_schedule.py: LRSchedule."""

    _name: str = _f("fixed", "learning-rate schedule", flag="--lr-scheduler", choices=SCHEDULES)
    warmup_updates: int = _f(0, "linear warmup over N updates")
    warmup_init_lr: float = _f(-1.0, "lr at the start of warmup (-1: 0; cosine's and step's: --min-lr)")
    end_learning_rate: float = _f(0.0, "polynomial_decay: final lr")
    power: float = _f(1.0, "polynomial_decay: power")
    total_num_update: Optional[int] = _f(None, "polynomial_decay: updates to decay over (default: --max-update)")
    min_lr: float = _f(
        0.0, "cosine: lr at the end of each cycle; step: the lr's floor; wsd: lr at the end of the decay"
    )
    lr_period_updates: int = _f(
        -1,
        "cosine: first cycle's length in updates (-1: --max-update minus warmup); "
        "triangular: each cycle's length (5000 unless set, fairseq's)",
    )
    t_mult: float = _f(1.0, "cosine: each cycle is this many times longer than the one before")
    lr_shrink: float = _f(
        0.1,
        "cosine, triangular: each cycle's peak lr is the previous one's times this; "
        "reduce_lr_on_plateau: the lr's factor on a plateau",
    )
    lr_threshold: float = _f(1e-4, "reduce_lr_on_plateau: a relative improvement smaller than this is a plateau")
    lr_patience: int = _f(0, "reduce_lr_on_plateau: validations without improvement before the lr shrinks")
    # wsd: warmup (--warmup-updates), stable at --lr, decay to --min-lr ending at --max-update
    decay_updates: Optional[int] = _f(
        None,
        "wsd: decay over the last N updates before --max-update (0: no decay; branch one later "
        "from a checkpoint); or --decay-ratio",
    )
    decay_ratio: Optional[float] = _f(
        None, "wsd: decay over this fraction of --max-update, in (0, 1] (torchtitan's decay_ratio); or --decay-updates"
    )
    decay_type: str = _f("linear", "wsd: the decay's shape", choices=DECAY_TYPES)
    # tri_stage (fairseq's, from the SpecAugment paper)
    warmup_steps: int = _f(0, "tri_stage: warm up linearly from --init-lr-scale times --lr over N updates")
    hold_steps: int = _f(0, "tri_stage: hold --lr for N updates")
    decay_steps: int = _f(0, "tri_stage: decay exponentially to --final-lr-scale times --lr over N updates")
    phase_ratio: List[float] = _f(
        [],
        'tri_stage: warmup, hold and decay as fractions of --max-update, adding up to 1, like "(0.1, 0.4, 0.5)" '
        "(instead of the three step counts; empty: the counts)",
    )
    init_lr_scale: float = _f(0.01, "tri_stage: the warmup's first lr over --lr")
    final_lr_scale: float = _f(0.01, "tri_stage: the final lr over --lr")
    # triangular (fairseq's cyclical lr): from --lr up to --max-lr and back, each cycle
    max_lr: Optional[float] = _f(None, "triangular: the top of each cycle, above --lr (required there)")
    shrink_min: bool = _f(False, "triangular: --lr-shrink shrinks the bottom of each cycle too")
    # step
    lr_decay_period: int = _f(
        25000, "step: multiply the lr by --lr-decay every N updates after warmup", alias="--lr-deacy-period"
    )
    lr_decay: float = _f(0.5, "step: the lr's factor every --lr-decay-period updates")
    # manual
    epoch2lr: str = _f(
        "{}",
        "manual: the lr from each epoch on, a dict like \"{'1': 0.1, '2-4': 0.05, '5,7': 0.01}\"",
    )
    update2lr: str = _f(
        "{}",
        "manual: the lr from each update on, a dict like epoch2lr's; once one applies it wins over --epoch2lr",
    )
