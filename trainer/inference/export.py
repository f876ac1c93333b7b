"""export-model: a checkpoint as one consolidated safetensors file with its config and
tokenizer, or as a Hugging Face directory (Llama/Qwen3 or GPT-2, with the tokenizer as
tokenizer.json), one tensor at a time."""

import os
import shutil
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from data.hf_convert import write_hf_tokenizer
from data.tokenizer import SPECIAL_IDS, has_tokenizer, load_tokenizer
from models.transformer_lm import build_model
from trainer.errors import UsageError
from trainer.formats.hf.config import family_for
from trainer.formats.hf.generation_config import id_list, model_generation_config, write_generation_config
from trainer.formats.hf.shards import DEFAULT_MAX_SHARD_SIZE, INDEX_FILE, parse_shard_size
from trainer.formats.registry import model_kind
from trainer.formats.safetensors_file import write_safetensors
from trainer.formats.shardlm.dequantized import DequantizedReader
from trainer.formats.shardlm.export_dir import EXPORT_FILE
from trainer.inference.load import SIDE_FILES, max_positions, open_run_model

# Files whose presence in --out means it already holds a model: ours, or a Hugging Face one.
_MODEL_FILES = (EXPORT_FILE, INDEX_FILE, "config.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype's names


def export_model(path, out, fmt="safetensors", dtype=None, max_shard_size=None, ema=False, compact=False):
    """Write `out/model.safetensors` (or a Hugging Face directory) from a checkpoint, one
    tensor at a time. Refuses to write into a directory that already holds a model, or over
    any file there. Everything is written in a temporary directory first, so a checkpoint
    that cannot be read leaves `out` as it was. dtype: a torch dtype or one of DTYPES' names;
    None keeps the saved one. ema: a checkpoint's moving average of the weights (--ema).
    A model iPQ quantized (train --quantization-config-path) is written with each layer's
    weight rebuilt from its centroids, or with compact (--pq-compact, safetensors only) as
    its checkpoint holds it: centroids, assignments and counts, as fairseq's PQ layers."""
    if compact and fmt == "hf":
        raise UsageError(
            "--pq-compact writes iPQ's centroids, which no Hugging Face model reads; drop it for --format hf"
        )
    dtype = DTYPES.get(dtype, dtype)
    if max_shard_size is not None and fmt != "hf":
        raise UsageError("--max-shard-size splits a --format hf export; --format safetensors writes one file")
    max_bytes = parse_shard_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    if model_kind(path)[0] == "hf":  # already the format an export is for
        raise UsageError(
            f"{path} is a Hugging Face model directory; this command needs a checkpoint directory "
            "(from --save-dir) or an export (from export-model)"
        )
    src = open_run_model(path, ema)
    if not compact and any(name.endswith(".centroids") for name in src.specs):  # iPQ's layers, rebuilt
        src = DequantizedReader(src, build_model(src.cfg.model, src.vocab_size(), max_positions(src), device="meta"))
    out = Path(out)
    _check_out(out)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=_nearest_existing(out)))
    try:
        if fmt == "hf":
            _write_hf(src, tmp, dtype, max_bytes)
        else:
            _write_export(src, tmp, dtype)
        taken = sorted(f.name for f in tmp.iterdir() if (out / f.name).exists())
        if taken:
            raise UsageError(f"{out} already holds {', '.join(taken)}; pass another --out (nothing was written)")
        out.mkdir(parents=True, exist_ok=True)
        # The files that make `out` a model last, config.json the very last: a move cut short
        # leaves no directory that looks complete.
        for f in sorted(tmp.iterdir(), key=lambda f: (f.name in _MODEL_FILES, f.name == "config.json")):
            os.replace(f, out / f.name)
    finally:
        src.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_out(out):
    held = next((out / name for name in _MODEL_FILES if (out / name).exists()), None)
    if held is not None:
        raise UsageError(f"{held} already exists; pass another --out (nothing was overwritten)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; pass a directory")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError(f"--out {out} cannot be created: {blocker} is a file; pass another --out")


def _nearest_existing(path):
    return next(p for p in (path, *path.parents) if p.exists())


def _write_export(src, out, dtype):
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    specs = [(n, shape, dtype or dt) for n, (shape, dt) in sorted(src.specs.items())]
    write_safetensors(
        out / EXPORT_FILE, specs, lambda n: cast(src.get(n)), metadata={"format": "pt", "producer": "shardlm"}
    )
    if src.kind in ("checkpoint", "export"):
        shutil.copyfile(src.path / "config.yaml", out / "config.yaml")
    else:  # another format's config, as ours; a fairseq .pt's dict.txt, if any, is beside it
        (out / "config.yaml").write_text(OmegaConf.to_yaml(src.cfg))
    for name in SIDE_FILES:
        if (src.files_dir / name).is_file():
            shutil.copyfile(src.files_dir / name, out / name)


def _write_hf(src, out, dtype, max_bytes):
    """The model as the first Hugging Face family that expresses it (trainer/formats/hf/config.py
    FAMILIES: a Llama-family model as LlamaForCausalLM/Qwen3ForCausalLM, a GPT-style one as
    GPT-2), and the tokenizer as tokenizer.json, so transformers needs nothing of ours."""
    cfg = src.cfg.model
    family, whys = family_for(cfg)
    if family is None:
        raise UsageError(
            "cannot export as a Hugging Face model: not "
            + " nor ".join(f"{what} ({why})" for what, why in whys.items())
        )
    our_specs = _model_specs(src)
    ids = _special_token_ids(src.files_dir)
    generation = _generation_config(src, ids)
    if generation is not None:
        ids["eos_token_id"] = generation["eos_token_id"]
    family.write_hf(
        out,
        src.get,
        our_specs,
        cfg,
        src.vocab_size(),
        max_positions(src),
        dtype,
        src.specs["embed_tokens.weight"][1] if "embed_tokens.weight" in src.specs else None,
        max_shard_size=max_bytes,
        **ids,
    )
    if has_tokenizer(src.files_dir):
        write_hf_tokenizer(src.files_dir, out)
    if generation is not None:
        write_generation_config(generation, out)


def _model_specs(src):
    """[(name, shape)] of the model the checkpoint's config builds, in its order, each checked
    against the checkpoint's tensor of that name."""
    model = build_model(src.cfg.model, src.vocab_size(), max_positions(src), device="meta")
    specs = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    for name, shape in specs:
        if name not in src.specs:
            raise UsageError(f"{src.path} has no tensor {name}; it is not a shardlm model of its config.yaml")
        if tuple(src.specs[name][0]) != shape:
            raise UsageError(f"{src.path}: {name} is {list(src.specs[name][0])}, its config.yaml implies {list(shape)}")
    return specs


def _generation_config(src, ids):
    """generation_config.json of the export: the eos ids the model carries (a chat model's
    end of turn among them; trainer/formats/hf/generation_config.py), the tokenizer's eos
    too, so transformers' generate stops where ours does; None when it carries none."""
    carried = model_generation_config(src.files_dir, src.cfg)
    if carried is None:
        return None
    eos = id_list(carried["eos_token_id"], src.files_dir)
    eos += [ids["eos_token_id"]] if ids["eos_token_id"] is not None and ids["eos_token_id"] not in eos else []
    own = {key: value for key, value in ids.items() if value is not None}
    return {**own, **carried, "eos_token_id": eos if len(eos) > 1 else eos[0]}


def _special_token_ids(path):
    """config.json's bos/eos/pad ids: the tokenizer's, or fairseq's (those of every data dir
    without one, e.g. dummy_lm's)."""
    ids = load_tokenizer(path).special_ids() if has_tokenizer(path) else SPECIAL_IDS
    return {f"{key}_token_id": ids.get(key) for key in ("bos", "eos", "pad")}
