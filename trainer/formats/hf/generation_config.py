"""The ids a model's generation stops at, as a Hugging Face model directory records them.

config.json's `eos_token_id` and generation_config.json's may each be one id or a list
(Llama 3.1 Instruct: [128001, 128008, 128009], its end of text, of a tool call and of a
turn), and transformers' `generate` stops at any of them. A chat model whose tokenizer
names only one eos would otherwise run past the end of its turn.

A checkpoint fine-tuned from such a directory carries the list in its own
generation_config.json (the checkpointer writes it), so generate and export-model still
have it when the directory has moved; torch-free, as the checkpointer and the commands
beside train read it.
"""

import json
from pathlib import Path

from omegaconf import OmegaConf

from trainer.errors import UsageError
from trainer.formats.hf.config import is_hf_dir

GENERATION_CONFIG = "generation_config.json"
_SOURCES = ("config.json", GENERATION_CONFIG)


def _read_json(path):
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path} is not valid JSON ({str(e).splitlines()[0]}); fix it or remove it") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} is not a JSON object; fix it or remove it")
    return data


def id_list(value, where):
    """`eos_token_id` as a list: an int, a list of ints, or null (none)."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise UsageError(f"{where}: eos_token_id {value!r} is not a token id or a list of them; fix it")
    return list(values)


def eos_ids(path):
    """Every eos id config.json and generation_config.json in `path` name, in their order,
    without repeats; [] when neither names one (or neither exists)."""
    found = []
    for name in _SOURCES:
        file = Path(path) / name
        if file.is_file():
            found += [i for i in id_list(_read_json(file).get("eos_token_id"), file) if i not in found]
    return found


def generation_config(path):
    """generation_config.json for a copy of the model in `path`: its own (sampling defaults
    and all), with `eos_token_id` every eos id of the directory; None when it names none."""
    ids = eos_ids(path)
    if not ids:
        return None
    file = Path(path) / GENERATION_CONFIG
    config = _read_json(file) if file.is_file() else {}
    config["eos_token_id"] = ids if len(ids) > 1 else ids[0]
    return config


def model_generation_config(files_dir, cfg):
    """The generation config of a model: from the files beside its weights (an HF directory's,
    or the generation_config.json a checkpoint or export carries), else (a checkpoint saved
    before they were carried) from the HF directory its config.yaml says it was fine-tuned
    from, if that is still there; None when neither names an eos id."""
    config = generation_config(files_dir)
    source = OmegaConf.select(cfg, "checkpoint.finetune_from_model", default=None) if cfg is not None else None
    if config is None and source and is_hf_dir(source):
        config = generation_config(source)
    return config


def write_generation_config(config, out):
    (Path(out) / GENERATION_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
