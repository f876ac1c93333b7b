"""One process, no torch.distributed: load a trained model from a sharded checkpoint or
an export (trainer/inference/export.py writes those).

A sharded checkpoint is read tensor by tensor through DCP, which stitches each tensor
from the shards of every rank that wrote it, so no process ever holds more than one
whole parameter beside what it is building. An export is a directory with
`model.safetensors`, `config.yaml` and the tokenizer.
"""
import logging
import warnings
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.tokenizer import load_tokenizer
from models.config import TransformerLMConfig
from models.transformer_lm import build_model
from trainer.checkpoint import files
from trainer.checkpoint.checkpointer import NoBytesLoadPlanner, renumber_layers, saved_layer_ids
from trainer.config.checks import _check_model_features
from trainer.config.schema import model_positions
from trainer.errors import UsageError
from trainer.inference.safetensors_file import read_safetensors, safetensors_specs

log = logging.getLogger("shardlm")
EXPORT_FILE = "model.safetensors"
SIDE_FILES = ("config.yaml", "tokenizer.model", "dict.txt", "metadata.json")


def _kind(path):
    path = files.fairseq_path(path)  # `--path DIR/checkpoint_best.pt`, as fairseq's commands are given
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
        if not self.band_tables() and "embed_tokens.weight" not in self.specs:
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

    def band_tables(self):
        """An adaptive input's tables (models/adaptive.py), band by band; [] for a plain embedding."""
        tables, band = [], 0
        while f"embed_tokens.embeddings.{band}.0.weight" in self.specs:
            tables.append(f"embed_tokens.embeddings.{band}.0.weight")
            band += 1
        return tables

    def vocab_size(self):
        if "embed_tokens.weight" in self.specs:
            return self.specs["embed_tokens.weight"][0][0]
        return sum(self.specs[name][0][0] for name in self.band_tables())  # the bands cover the vocabulary

    def max_positions(self):
        return model_positions(self.cfg)


def _load_run_config(path):
    """The config.yaml saved beside the weights; it must have the model and task groups."""
    import yaml
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


def load_model(path, device="cpu", model_overrides=None):
    """(model in eval mode, config, tokenizer or None) from a checkpoint or an export.
    model_overrides: model keys to change first (eval-lm's --model-overrides)."""
    src = CheckpointTensors(path)
    if model_overrides:
        src.cfg.model = _overridden(src.cfg.model, model_overrides)
        _check_model_features(src.cfg)  # e.g. --decoder-layers-to-keep; train checked the saved config
    model = build_model(src.cfg.model, src.vocab_size(), src.max_positions(), device="meta",
                        padding_idx=src.cfg.get("padding_idx", 1))
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    # A model pruned by --decoder-layers-to-keep reads the layers it keeps, renumbered.
    renamed = renumber_layers({name: name for name in params}, saved_layer_ids(src.cfg.model, src.specs))
    saved_name = {ours: saved for saved, ours in renamed.items()}
    missing = sorted(saved_name[name] for name in params if saved_name[name] not in src.specs)
    if missing:
        raise UsageError(f"{src.path} has no tensor {missing[0]}; it is not a shardlm model of this config")
    with torch.no_grad():
        for name, p in params.items():
            t = src.get(saved_name[name])
            if tuple(t.shape) != tuple(p.shape):
                raise UsageError(f"{src.path}: {name} is {list(t.shape)}, its config.yaml implies {list(p.shape)}")
            p.copy_(t)
    model.eval()
    return model, src.cfg, tokenizer_of(src.path)


def _overridden(model_cfg, overrides):
    """The saved model config with `overrides`, typed by the model's dataclass."""
    try:
        return OmegaConf.merge(OmegaConf.structured(TransformerLMConfig), model_cfg, overrides)
    except OmegaConfBaseException as e:
        raise UsageError(f"--model-overrides {overrides}: {str(e).splitlines()[0]}") from None


def tokenizer_of(path):
    path = Path(path)
    if (path / "tokenizer.model").is_file() or (path / "dict.txt").is_file():
        return load_tokenizer(path)
    return None
