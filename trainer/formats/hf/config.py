"""A Hugging Face model directory's config.json as our model fields: which directory is one,
the fields and vocabulary it fixes, and the training-time defaults it gives. Torch-free:
`train` composes its config from it before torch is imported (trainer/config/model_source.py
decides what the user's flags may change). Each family maps its own keys
(trainer/formats/hf/llama.py, gpt2.py).
"""

import json
from pathlib import Path

from trainer.errors import UsageError
from trainer.formats.hf import gpt2, llama
from trainer.formats.hf.llama import HFConfigError

CONFIG = "config.json"

# config.json's model_type → the module of its family: its keys both ways and its tensors'
# names (model_from_hf_config, incompatibility, hf_parts, transposed, write_hf, DESCRIBED).
# A new family is one module and one line here; export-model writes a model as the first
# family in this order that can express it.
FAMILIES = {"llama": llama, "qwen3": llama, "qwen3_moe": llama, "mixtral": llama, "gpt2": gpt2}


def family_for(model_cfg):
    """(the family module export-model writes `model_cfg` as, or None, and why each family
    cannot when none can)."""
    whys = {}
    for family in dict.fromkeys(FAMILIES.values()):
        why = family.incompatibility(model_cfg)
        if why is None:
            return family, {}
        whys[family.DESCRIBED] = why
    return None, whys


def family_of(model_type):
    """The family module of config.json's model_type; HFConfigError when none builds it."""
    if model_type not in FAMILIES:
        raise HFConfigError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


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
        fields, vocab_size, max_positions = family_of(config.get("model_type")).model_from_hf_config(config)
    except HFConfigError as e:
        raise UsageError(f"{path / CONFIG}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path / CONFIG}: missing or invalid key {e}; pass a complete Hugging Face config") from None
    return config, fields, vocab_size, max_positions


def hf_model_settings(path):
    """(the model keys config.json fixes, the training keys it gives defaults for) of an HF dir."""
    _, fields, _, max_positions = read_hf_config(path)
    fixed = {**fields, "max_target_positions": max_positions}
    defaults = {**TRAINING_DEFAULTS, "attention_dropout": fixed.pop("attention_dropout")}
    if "moe_aux_loss_coef" in fixed:  # a weight of the training loss, not of the model
        defaults["moe_aux_loss_coef"] = fixed.pop("moe_aux_loss_coef")
    return fixed, defaults
