"""Checks of a composed config, before anything is built or written.

Each problem is one UsageError line that names the fix. Runs on the config, so a bad
value is caught the same way whether it came from a flag, a file or an override. One
check per config group, in the module of its kind: run.py (common, distributed_training,
checkpoint, ema), parallel_dims.py (--model-parallel-size, --context-parallel-size),
optim.py (optimization, optimizer), lr_scheduler.py, model.py, data.py (task, dataset);
values.py holds the range checks they share. A check that compares two groups sits with
the group it limits, after the group it reads is checked.
"""

from trainer.config.checks.data import check_dataset, check_task
from trainer.config.checks.lr_scheduler import check_lr_scheduler
from trainer.config.checks.model import _check_model_features, check_adaptive_vocab, check_model, parse_model_overrides
from trainer.config.checks.optim import check_optimization, check_optimizer
from trainer.config.checks.parallel_dims import check_parallel_dims
from trainer.config.checks.run import (
    check_checkpoint,
    check_common,
    check_distributed,
    check_ema,
    check_quantization,
)
from trainer.config.checks.values import check_fields

# Imported from here by cli.py, trainer/launch/sweep.py, trainer/plan/search.py,
# trainer/train/main.py and trainer/inference/load.py (_check_model_features).
__all__ = ["check_config", "check_adaptive_vocab", "parse_model_overrides", "_check_model_features"]

# Each group's check, in the order they run: the model before the task, whose samples its
# positions limit; the optimization before the schedule, which reads --max-update.
GROUP_CHECKS = (
    check_common,
    check_distributed,
    check_checkpoint,
    check_optimization,
    check_optimizer,
    check_lr_scheduler,
    check_model,
    check_task,
    check_dataset,
    check_ema,
    check_parallel_dims,
    check_quantization,
)


def check_config(cfg):
    check_fields(cfg)
    for check in GROUP_CHECKS:
        check(cfg)
