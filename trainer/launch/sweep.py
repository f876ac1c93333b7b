"""`train -m …` (fairseq-hydra-train's multirun): Hydra expands sweeps (`optimization.lr=1e-3,3e-3`)
and hands each job to its launcher (`hydra/launcher=slurm`: submitit). Hydra is only the
sweep and launch engine here: each job composes its config from its own overrides with
the same code as a single `train`, so precedence and checks are identical.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from trainer.config.checks import check_config
from trainer.config.compose import KEY_ALIASES, compose_config
from trainer.config.schema import GROUP_OPTIONS, register_configs
from trainer.errors import UsageError
from trainer.launch.launcher import launch

# Hydra instantiates its launcher, sweeper and callbacks (and logging factories) from
# config. A sweep may choose among these launchers and set their keys; nothing may name a
# class, point Hydra at other config directories, or replace the other Hydra groups, so
# no config file or override reaches code outside shardlm and these launchers.
LAUNCHERS = ("basic", "slurm", "submitit_local", "submitit_slurm")
LOCKED = ("hydra.searchpath", "hydra.callbacks", "hydra.sweeper", "hydra.job_logging", "hydra.hydra_logging")


def _quote(value):
    """A flag's value as a Hydra override value: lists stay lists, strings are quoted (so a
    comma inside one is not read as a sweep)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_quote(v) for v in value) + "]"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def flags_as_overrides(flag_settings):
    """`--arch X --lr 0.1` → `model=X optimization.lr=0.1` (a selection stays a selection)."""
    out = []
    for key, value in flag_settings:
        group, _, name = key.partition(".")
        out.append(f"{group}={value}" if name == "_name" else f"{key}={_quote(value)}")
    return out


def _for_hydra(override):
    """An override in a form Hydra's own composition takes. Hydra composes the sweep's config
    only to expand the sweep (each job recomposes from its overrides with compose_config), and
    it knows neither fairseq's group paths (`model=transformer_lm/transformer_lm_gpt`: Hydra
    1.3 no longer reads those files' `# @package _group_`) nor fairseq's alias keys: a
    selection becomes `GROUP._name=OPTION`, which compose_config reads as the same selection,
    and an alias becomes its key."""
    key, sep, value = override.partition("=")
    if sep and key in GROUP_OPTIONS:
        return f"{key}._name={value}"
    if sep and key in KEY_ALIASES:
        return f"{KEY_ALIASES[key]}={value}"
    return override


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def _job(_hydra_cfg):
    """One job of the sweep, in the launcher's process (a SLURM task under submitit)."""
    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    if not any(o.split("=")[0].lstrip("+~") == "checkpoint.save_dir" for o in overrides):
        # Each job its own checkpoints (under the sweep's job directory): one shared
        # ./checkpoints would make every job resume from the previous one's.
        overrides.append(f"checkpoint.save_dir={_quote(str(Path(hc.runtime.output_dir) / 'checkpoints'))}")
    cfg = compose_config([], overrides)
    check_config(cfg)
    code = launch(cfg)
    if code:
        raise SystemExit(code)


def check_sweep_overrides(overrides):
    """Refuse, in one line, an override that would make Hydra instantiate something else."""
    for text in overrides:
        key, _, value = text.partition("=")
        key = key.lstrip("+~")
        if "_target_" in text or key.startswith(LOCKED):
            raise UsageError(
                f"override {text!r}: a sweep may not name classes or change Hydra's search path, "
                "callbacks, sweeper or logging; choose a launcher with "
                f"hydra/launcher={'|'.join(LAUNCHERS)}"
            )
        if key.startswith("hydra/") and (key != "hydra/launcher" or value not in LAUNCHERS):
            raise UsageError(
                f"override {text!r}: the only Hydra group a sweep selects is hydra/launcher={'|'.join(LAUNCHERS)}"
            )


def multirun(flag_settings, overrides):
    """Run the sweep; Hydra parses `-m`, `hydra/launcher=…` and `hydra.*` itself."""
    try:
        check_sweep_overrides(overrides)
    except UsageError as e:
        print(f"train: error: {e}", file=sys.stderr)
        return 2
    register_configs()
    sys.argv = ["train", "-m"] + [_for_hydra(o) for o in flags_as_overrides(flag_settings) + list(overrides)]
    _job()
    return 0
