"""`train -m …` (fairseq-hydra-train's multirun): Hydra expands sweeps (`optimization.lr=1e-3,3e-3`)
and hands each job to its launcher (`hydra/launcher=slurm`: submitit). Hydra is only the
sweep and launch engine here: each job composes its config from its own overrides with
the same code as a single `train`, so precedence and checks are identical.
"""
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig


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


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _job(_hydra_cfg):
    """One job of the sweep, in the launcher's process (a SLURM task under submitit)."""
    from trainer.checks import check_config
    from trainer.compose import compose_config
    from trainer.launch import launch

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


def multirun(flag_settings, overrides):
    """Run the sweep; Hydra parses `-m`, `hydra/launcher=…` and `hydra.*` itself."""
    from trainer.config import register_configs

    register_configs()
    sys.argv = ["train", "-m"] + flags_as_overrides(flag_settings) + list(overrides)
    _job()
    return 0
