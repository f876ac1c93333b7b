"""One process, no torch.distributed: load a trained model from a sharded checkpoint or
an export, and export a checkpoint as one consolidated safetensors file (or HF GPT-2).

A sharded checkpoint is read tensor by tensor through DCP, which stitches each tensor
from the shards of every rank that wrote it, so no process ever holds more than one
whole parameter beside what it is building. An export is a directory with
`model.safetensors`, `config.yaml` and the tokenizer.
"""
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from data.tokenizer import load_tokenizer
from models.transformer_lm import build_model
from trainer.checkpoint import files
from trainer.checkpoint.checkpointer import NoBytesLoadPlanner
from trainer.errors import UsageError
from trainer.inference.hf_gpt2 import check_hf_compatible, write_hf_gpt2
from trainer.inference.safetensors_file import read_safetensors, safetensors_specs, write_safetensors

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
    if (path / "checkpoint_last").is_dir():
        raise UsageError(f"{path} is a --save-dir, not one checkpoint; pass one of its checkpoints, "
                         f"e.g. --path {path / 'checkpoint_last'}")
    raise UsageError(f"{path} is neither a checkpoint directory (from --save-dir) nor an export "
                     f"(from export-model); pass one with --path")


class CheckpointTensors:
    """Our parameters by name, one at a time, from a checkpoint or an export."""

    def __init__(self, path):
        self.kind, self.path = _kind(path)
        if self.kind == "checkpoint":
            self.specs = files.tensor_specs(self.path)
        else:
            try:
                self.specs = safetensors_specs(self.path / EXPORT_FILE)
            except ValueError as e:  # the reader's own "not a valid safetensors file: why"
                raise UsageError(f"{e}; export the checkpoint again") from None
        if "embed_tokens.weight" not in self.specs:
            raise UsageError(f"{self.path} holds no shardlm model (no embed_tokens.weight); pass a checkpoint "
                             "written by train or an export-model output")
        self.cfg = _load_run_config(self.path / "config.yaml")

    def get(self, name):
        shape, dtype = self.specs[name]
        if self.kind == "export":
            try:
                return read_safetensors(self.path / EXPORT_FILE, names=[name])[0][name]
            except ValueError as e:
                raise UsageError(f"{e}; export the checkpoint again") from None
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        out = {"model": {name: torch.empty(shape, dtype=dtype)}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(out, storage_reader=files.safe_reader(self.path), planner=NoBytesLoadPlanner(),
                         no_dist=True)
            # A shard file that is missing, cut short or not a torch archive.
            except (OSError, RuntimeError, CheckpointException) as e:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise UsageError(f"cannot read {name} from {self.path}: {reason[:200]}; the checkpoint is damaged "
                                 "or incomplete: pass another one (e.g. an earlier checkpoint)") from None
        return out["model"][name]

    def vocab_size(self):
        return self.specs["embed_tokens.weight"][0][0]

    def max_positions(self):
        m = self.cfg.model
        return m.max_target_positions or self.cfg.task.tokens_per_sample


def _load_run_config(path):
    """The config.yaml saved beside the weights; it must have the model and task groups."""
    import yaml
    from omegaconf.errors import OmegaConfBaseException
    if not path.is_file():
        raise UsageError(f"missing {path}: the model's config is saved there; pass a complete checkpoint or export")
    try:
        cfg = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not valid YAML ({str(e).splitlines()[0]}); pass a complete checkpoint "
                         "or export") from None
    if not (isinstance(cfg, DictConfig) and isinstance(cfg.get("model"), DictConfig)
            and isinstance(cfg.get("task"), DictConfig)):
        raise UsageError(f"{path} is not a shardlm run config (no model and task sections); pass a checkpoint "
                         "written by train or an export-model output")
    return cfg


def load_model(path, device="cpu"):
    """(model in eval mode, config, tokenizer or None) from a checkpoint or an export."""
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
    path = Path(path)
    if (path / "tokenizer.model").is_file() or (path / "dict.txt").is_file():
        return load_tokenizer(path)
    return None


def export_model(path, out, fmt="safetensors", dtype=None):
    """Write `out/model.safetensors` (or an HF GPT-2 directory) from a checkpoint, one tensor
    at a time. Refuses to write into a directory that already holds a model. Everything is
    written in a temporary directory first, so a checkpoint that cannot be read leaves `out`
    as it was."""
    src = CheckpointTensors(path)
    out = Path(out)
    _check_out(out)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=_nearest_existing(out)))
    try:
        _write_export(src, tmp, fmt, dtype)
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == EXPORT_FILE):  # the model file last
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_out(out):
    if (out / EXPORT_FILE).exists():
        raise UsageError(f"{out / EXPORT_FILE} already exists; pass another --out (nothing was overwritten)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; pass a directory")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError(f"--out {out} cannot be created: {blocker} is a file; pass another --out")


def _nearest_existing(path):
    return next(p for p in (path, *path.parents) if p.exists())


def _write_export(src, out, fmt, dtype):
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    if fmt == "hf":
        check_hf_compatible(src.cfg.model)
        write_hf_gpt2(out, src.get, src.cfg.model, src.vocab_size(), src.max_positions(),
                      dtype=dtype or torch.float32, bos_token_id=0, pad_token_id=1, eos_token_id=2)
    else:
        specs = [(n, shape, dtype or dt) for n, (shape, dt) in sorted(src.specs.items())]
        write_safetensors(out / EXPORT_FILE, specs, lambda n: cast(src.get(n)),
                          metadata={"format": "pt", "producer": "shardlm"})
        shutil.copyfile(src.path / "config.yaml", out / "config.yaml")
    for name in SIDE_FILES[1:]:
        if (src.path / name).is_file():
            shutil.copyfile(src.path / name, out / name)
