"""The model of a run that starts from another's: `--finetune-from-model HF_DIR` or a
fairseq-train `.pt` (--finetune-from-model or --restore-file).

The source decides the model, as a preset would, and more: a preset's keys may be changed
by flags, the source's may not, since its weights only fit the model it describes. A model
key the user set (flag, YAML key or override) that contradicts it is refused in one line;
the training-time keys it does not fix (dropout, activation checkpointing, FSDP wrapping,
...) take its values as defaults and stay the user's. What each format holds is read by its
room (trainer/formats/hf/config.py, trainer/formats/fairseq/checkpoint_file.py), torch-free
for Hugging Face: composing the config and the checks before any rank starts read it.
"""

import json
from pathlib import Path

from models.config import PRESETS
from trainer.config.flags import flag_name, iter_fields
from trainer.errors import UsageError
from trainer.formats.fairseq.checkpoint_file import fairseq_settings, is_fairseq_checkpoint
from trainer.formats.hf.config import CONFIG, HF_KEYS, family_of, hf_model_settings, is_hf_dir, read_hf_config


def hf_finetune_dir(cfg):
    """The HF model directory whose model the run fine-tunes, or None: --finetune-from-model
    HF_DIR, or a checkpoint of ours that was fine-tuned from one (its config.yaml names the
    directory), so that SFT's checkpoint starts DPO without the model's flags again."""
    path = cfg.checkpoint.get("finetune_from_model")
    if not path:
        return None
    if is_hf_dir(path):
        return Path(path)
    return hf_source(path)


def hf_source(checkpoint):
    """The HF model directory a checkpoint of ours was fine-tuned from, if its config.yaml
    names one that still exists (else None: its model then comes from the flags, as in fairseq)."""
    import yaml  # omegaconf's dependency; torch-free

    saved = Path(checkpoint) / "config.yaml"
    if not saved.is_file():
        return None
    try:
        name = (yaml.safe_load(saved.read_text()) or {}).get("model", {}).get("_name")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return None
    return Path(name) if isinstance(name, str) and is_hf_dir(name) else None


def hf_vocab_size(cfg):
    """The vocabulary the model is built with when the run fine-tunes an HF model (its
    config.json's vocab_size, which may exceed the tokenizer's), else None (the data's)."""
    path = hf_finetune_dir(cfg)
    return None if path is None else read_hf_config(path)[2]


def _shown(value):
    return str(value).lower() if isinstance(value, bool) else value


def apply_hf_model(cfg, given):
    """Set the model of --finetune-from-model HF_DIR on `cfg`, refusing the keys in `given`
    (set by the user) that contradict its config.json."""
    path = hf_finetune_dir(cfg)
    if path is None:
        return
    config, _, _, _ = read_hf_config(path)
    fixed, defaults = hf_model_settings(path)
    flags = {f.name: flag_name(f) for group, f in iter_fields() if group == "model"}
    where = path / CONFIG
    model_cfg = cfg.model
    if "model._name" in given and not _same_path(model_cfg._name, path):
        preset = PRESETS.get(model_cfg._name)
        differs = None if preset is None else next((k for k, v in preset.items() if k in fixed and fixed[k] != v), None)
        if preset is None or differs is not None:
            why = (
                ""
                if differs is None
                else f" (it sets {flags[differs]} {_shown(preset[differs])}, config.json {_shown(fixed[differs])})"
            )
            raise UsageError(
                f"--arch {model_cfg._name} contradicts {where}{why}: the model is the one config.json "
                "describes; drop --arch"
            )
    for key, value in fixed.items():
        if f"model.{key}" in given and model_cfg[key] != value:
            hf_key = HF_KEYS.get(key)
            source = (
                f"{where}'s {hf_key} {json.dumps(config.get(hf_key))}"
                if hf_key in config
                else f"{where} (model_type {config['model_type']!r} has {flags[key]} {_shown(value)})"
            )
            raise UsageError(f"{flags[key]} {_shown(model_cfg[key])} contradicts {source}; drop the flag")
    for key, value in fixed.items():
        model_cfg[key] = value
    for key, value in defaults.items():
        if f"model.{key}" not in given:
            model_cfg[key] = value
    model_cfg._name = str(path)  # where the model came from; composes again from a saved config.yaml
    why = family_of(config["model_type"]).incompatibility(model_cfg)
    if why:
        raise UsageError(
            f"--finetune-from-model {path}: with these flags the model is not the one config.json "
            f"describes ({why}); drop the flag that changes it"
        )
    if model_cfg.decoder_layers_to_keep:
        raise UsageError(
            f"--decoder-layers-to-keep prunes layers of a checkpoint of ours; {path}'s layers load "
            "as they are: drop it (or fine-tune first, then prune the checkpoint)"
        )


def _same_path(a, b):
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):
        return False


def fairseq_source(cfg):
    """The fairseq checkpoint a run starts from (--finetune-from-model X.pt, --restore-file X.pt
    as given or in --save-dir, or fairseq's checkpoint_last.pt in --save-dir), or None."""
    checkpoint_cfg = cfg.checkpoint
    finetune = checkpoint_cfg.get("finetune_from_model")
    if finetune and is_fairseq_checkpoint(finetune):
        return Path(finetune)
    save_dir, restore = Path(checkpoint_cfg.save_dir), Path(checkpoint_cfg.restore_file)
    if checkpoint_cfg.restore_file in ("checkpoint_last", "checkpoint_last.pt"):
        # the default is --save-dir's own: fairseq's checkpoint_last.pt there resumes its run
        candidates = [save_dir / "checkpoint_last.pt"]
    else:
        candidates = [restore, save_dir / restore]
    return next((c for c in candidates if is_fairseq_checkpoint(c)), None)


def apply_fairseq_model(cfg, given):
    """Set the model of the fairseq checkpoint the run starts from on `cfg`, refusing the
    model keys in `given` (set by the user) that contradict the checkpoint's config."""
    path = fairseq_source(cfg)
    if path is None:
        return
    arch, fixed, training, _, _ = fairseq_settings(path)
    model_cfg = cfg.model
    if "model._name" in given and model_cfg._name != arch:
        raise UsageError(f"--arch {model_cfg._name} contradicts {path}, a fairseq {arch} model; drop --arch")
    flags = {f.name: flag_name(f) for group, f in iter_fields() if group == "model"}
    for key, value in fixed.items():
        if f"model.{key}" in given and model_cfg[key] != value:
            raise UsageError(
                f"{flags[key]} {_shown(model_cfg[key])} contradicts {path} (its model has "
                f"{key}={_shown(value)}); drop the flag"
            )
    for key, value in fixed.items():
        model_cfg[key] = value
    for key, value in training.items():
        if f"model.{key}" not in given:
            model_cfg[key] = value
    model_cfg._name = arch if arch in PRESETS else "transformer_lm"
