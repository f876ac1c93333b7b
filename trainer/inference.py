"""One process, no torch.distributed: load a trained model from a sharded checkpoint or
an export, and export a checkpoint as one consolidated safetensors file (or HF GPT-2).

A sharded checkpoint is read tensor by tensor through DCP, which stitches each tensor
from the shards of every rank that wrote it, so no process ever holds more than one
whole parameter beside what it is building. An export is a directory with
`model.safetensors`, `config.yaml` and the tokenizer.
"""
import logging
import shutil
import warnings
from pathlib import Path

import torch
from omegaconf import OmegaConf

from trainer import checkpoint_files as files
from trainer.flags import UsageError

log = logging.getLogger("shardlm")
EXPORT_FILE = "model.safetensors"
SIDE_FILES = ("config.yaml", "tokenizer.model", "dict.txt", "metadata.json")


def _kind(path):
    path = Path(path)
    if (path / EXPORT_FILE).is_file() and (path / "config.yaml").is_file():
        return "export", path
    found = files.resolve(path)
    if found is not None:
        return "checkpoint", found
    raise UsageError(f"{path} is neither a checkpoint directory (from --save-dir) nor an export "
                     f"(from export-model); pass one with --path")


class CheckpointTensors:
    """Our parameters by name, one at a time, from a checkpoint or an export."""

    def __init__(self, path):
        self.kind, self.path = _kind(path)
        if self.kind == "checkpoint":
            self.specs = files.tensor_specs(self.path)
        else:
            from trainer.safetensors_file import safetensors_specs
            self.specs = safetensors_specs(self.path / EXPORT_FILE)
        self.cfg = OmegaConf.load(self.path / "config.yaml")

    def get(self, name):
        shape, dtype = self.specs[name]
        if self.kind == "export":
            from trainer.safetensors_file import read_safetensors
            return read_safetensors(self.path / EXPORT_FILE, names=[name])[0][name]
        import torch.distributed.checkpoint as dcp

        from trainer.checkpoint import NoBytesLoadPlanner
        out = {"model": {name: torch.empty(shape, dtype=dtype)}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=files.safe_reader(self.path), planner=NoBytesLoadPlanner(), no_dist=True)
        return out["model"][name]

    def vocab_size(self):
        return self.specs["embed_tokens.weight"][0][0]

    def max_positions(self):
        m = self.cfg.model
        return m.max_target_positions or self.cfg.task.tokens_per_sample


def load_model(path, device="cpu"):
    """(model in eval mode, config, tokenizer or None) from a checkpoint or an export."""
    from models.transformer_lm import build_model

    src = CheckpointTensors(path)
    model = build_model(src.cfg.model, src.vocab_size(), src.max_positions(), device="meta",
                        padding_idx=src.cfg.get("padding_idx", 1))
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(src.specs))
    if missing:
        raise UsageError(f"{src.path} has no tensor {missing[0]}; it is not a shardlm model of this config")
    with torch.no_grad():
        for name, p in params.items():
            t = src.get(name)
            if tuple(t.shape) != tuple(p.shape):
                raise UsageError(f"{src.path}: {name} is {list(t.shape)}, its config.yaml implies {list(p.shape)}")
            p.copy_(t)
    model.eval()
    return model, src.cfg, tokenizer_of(src.path)


def tokenizer_of(path):
    from data.tokenizer import load_tokenizer
    path = Path(path)
    if (path / "tokenizer.model").is_file() or (path / "dict.txt").is_file():
        return load_tokenizer(path)
    return None


def export_model(path, out, fmt="safetensors", dtype=None):
    """Write `out/model.safetensors` (or an HF GPT-2 directory) from a checkpoint, one tensor
    at a time. Refuses to write into a directory that already holds a model."""
    src = CheckpointTensors(path)
    out = Path(out)
    if (out / EXPORT_FILE).exists():
        raise UsageError(f"{out / EXPORT_FILE} already exists; pass another --out (nothing was overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    if fmt == "hf":
        from trainer.hf_gpt2 import check_hf_compatible, write_hf_gpt2
        check_hf_compatible(src.cfg.model)
        write_hf_gpt2(out, src.get, src.cfg.model, src.vocab_size(), src.max_positions(),
                      dtype=dtype or torch.float32, bos_token_id=0, pad_token_id=1, eos_token_id=2)
    else:
        from trainer.safetensors_file import write_safetensors
        specs = [(n, shape, dtype or dt) for n, (shape, dt) in sorted(src.specs.items())]
        write_safetensors(out / EXPORT_FILE, specs, lambda n: cast(src.get(n)),
                          metadata={"format": "pt", "producer": "shardlm"})
        shutil.copyfile(src.path / "config.yaml", out / "config.yaml")
    for name in SIDE_FILES[1:]:
        if (src.path / name).is_file():
            shutil.copyfile(src.path / name, out / name)
    return out
