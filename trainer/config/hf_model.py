"""A Hugging Face model directory as the model of a run: `train DATA --finetune-from-model HF_DIR`.

Its config.json decides the model, as a preset would (models/hf_llama.py maps it to our
fields), and more: a preset's keys may be changed by flags, config.json's may not, since
the weights only fit the model it describes. A model key the user set (flag, YAML key or
override) that contradicts it is refused in one line; the training-time keys it does not
fix (dropout, activation checkpointing, FSDP wrapping, ...) stay the user's. Torch-free:
composing the config and the checks before any rank starts read it.
"""

import json
from pathlib import Path

from models.config import PRESETS
from models.hf_llama import HFConfigError, llama_incompatibility, model_from_hf_config
from trainer.config.flags import flag_name, iter_fields
from trainer.errors import UsageError

CONFIG = "config.json"

# Our field → the config.json key it comes from, for the refusal's message; the fields
# missing here follow from model_type (Llama's layout: RMSNorm, SwiGLU, RoPE, no biases).
HF_KEYS = {
    "decoder_layers": "num_hidden_layers",
    "decoder_embed_dim": "hidden_size",
    "decoder_ffn_embed_dim": "intermediate_size",
    "decoder_attention_heads": "num_attention_heads",
    "decoder_kv_heads": "num_key_value_heads",
    "decoder_head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "activation_fn": "hidden_act",
    "share_decoder_input_output_embed": "tie_word_embeddings",
    "max_target_positions": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "rope_scaling_factor": "rope_scaling",
    "rope_low_freq_factor": "rope_scaling",
    "rope_high_freq_factor": "rope_scaling",
    "rope_original_max_positions": "rope_scaling",
}
# Training-time choices config.json has values for (or that its model has none of): its
# values are the defaults, and a flag may change them. Dropout is off in the published
# models, as in our Llama presets, and fine-tuning keeps it so unless asked.
TRAINING_DEFAULTS = {"dropout": 0.0, "activation_dropout": 0.0}


def is_hf_dir(path):
    """A Hugging Face model directory (its config.json), not one of our checkpoints or exports."""
    path = Path(path)
    return (
        (path / CONFIG).is_file() and not (path / "trainer_state.json").exists() and not (path / "config.yaml").exists()
    )


def read_hf_config(path):
    """(config.json as a dict, our model fields, vocab size, max positions) of an HF dir."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(
            f"{path / CONFIG} is not valid JSON ({str(e).splitlines()[0]}); pass a Hugging Face "
            "model directory as save_pretrained writes it"
        ) from None
    if not isinstance(config, dict):
        raise UsageError(f"{path / CONFIG} is not a JSON object; pass a Hugging Face model directory")
    try:
        fields, vocab_size, max_positions = model_from_hf_config(config)
    except HFConfigError as e:
        raise UsageError(f"{path / CONFIG}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path / CONFIG}: missing or invalid key {e}; pass a complete Hugging Face config") from None
    return config, fields, vocab_size, max_positions


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


def hf_model_settings(path):
    """(the model keys config.json fixes, the training keys it gives defaults for) of an HF dir."""
    _, fields, _, max_positions = read_hf_config(path)
    fixed = {**fields, "max_target_positions": max_positions}
    defaults = {**TRAINING_DEFAULTS, "attention_dropout": fixed.pop("attention_dropout")}
    return fixed, defaults


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
    why = llama_incompatibility(model_cfg)
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
