"""What every config group's check uses: one field by its dotted key, the range checks, and
the pass over every field (its choices, a finite number)."""

import math

from trainer.config.flags import flag_name, iter_fields
from trainer.errors import UsageError


def check_fields(cfg):
    """Every field of every group: a value among its choices, a number that is finite."""
    for group, f in iter_fields():
        value = cfg[group][f.name]
        choices = f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise UsageError(f"{flag_name(f)} {value!r} is not one of: {', '.join(choices)}")
        # nan passes every comparison below, and no setting means anything at inf.
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag_name(f)} must be a finite number, got {value}")


def get(cfg, key):
    group, name = key.split(".")
    return cfg[group][name]


def positive(cfg, *keys, optional=False):
    for key in keys:
        v = get(cfg, key)
        if v is None and optional:
            continue
        if v is None or v <= 0:
            raise UsageError(f"{key} must be positive, got {v}")


def non_negative(cfg, *keys):
    for key in keys:
        if get(cfg, key) < 0:
            raise UsageError(f"{key} must be >= 0, got {get(cfg, key)}")


def in_unit_interval(cfg, *keys):
    """Each a probability of dropping: in [0, 1)."""
    for key in keys:
        if not 0.0 <= get(cfg, key) < 1.0:
            raise UsageError(f"{key} must be in [0, 1), got {get(cfg, key)}")
