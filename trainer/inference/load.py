"""One process, no torch.distributed: load a trained model from a sharded checkpoint, an
export (trainer/inference/export.py writes those) or a Hugging Face model directory.

A sharded checkpoint is read tensor by tensor through DCP, which stitches each tensor
from the shards of every rank that wrote it, so no process ever holds more than one
whole parameter beside what it is building. An export is a directory with
`model.safetensors`, `config.yaml` and the tokenizer. A Hugging Face directory
(LlamaForCausalLM or Qwen3ForCausalLM: config.json, safetensors, tokenizer.json) is
read through trainer/checkpoint/hf_dir.py, one of our parameters at a time.
"""

import copy
import logging
import warnings
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.tokenizer import TOKENIZER_FILES, has_tokenizer, load_tokenizer
from models.config import TransformerLMConfig
from models.fairseq_lm import PADDING_IDX
from models.hf_llama import hf_parts
from models.transformer_lm import build_model
from trainer.checkpoint import files
from trainer.checkpoint.fairseq_checkpoint import FairseqTensors
from trainer.checkpoint.generation_config import GENERATION_CONFIG
from trainer.checkpoint.hf_dir import FLOAT_DTYPES, HFWeights, is_hf_dir, read_hf_config
from trainer.checkpoint.tensors import NoBytesLoadPlanner, renumber_layers, saved_layer_ids
from trainer.config.checks import _check_model_features
from trainer.config.fairseq_model import fairseq_settings, is_fairseq_checkpoint
from trainer.config.schema import TaskConfig, model_positions
from trainer.errors import UsageError
from trainer.inference.safetensors_file import read_safetensors, safetensors_specs

log = logging.getLogger("shardlm")
EXPORT_FILE = "model.safetensors"
SIDE_FILES = ("config.yaml", *TOKENIZER_FILES, "metadata.json", GENERATION_CONFIG)


def _kind(path, hf=False):
    path = files.fairseq_path(path)  # `--path DIR/checkpoint_best.pt`, as fairseq's commands are given
    if (path / EXPORT_FILE).is_file() and (path / "config.yaml").is_file():
        return "export", path
    found = files.resolve(path)
    if found is not None:
        return "checkpoint", found
    if (path / "checkpoint_last").is_dir():
        raise UsageError(
            f"{path} is a --save-dir, not one checkpoint; pass one of its checkpoints, "
            f"e.g. --path {path / 'checkpoint_last'}"
        )
    if is_hf_dir(path):
        if not hf:
            raise UsageError(
                f"{path} is a Hugging Face model directory; this command needs a checkpoint "
                "directory (from --save-dir) or an export (from export-model)"
            )
        return "hf", path
    if is_fairseq_checkpoint(path):
        return "fairseq", path
    also = ", nor a Hugging Face model directory (config.json and safetensors)" if hf else ""
    raise UsageError(
        f"{path} is neither a checkpoint directory (from --save-dir) nor an export "
        f"(from export-model){also}; pass one with --path"
    )


def model_files_dir(path):
    """Where the tokenizer and side files of the model at `path` are (a fairseq checkpoint's
    are beside it), found without reading a tensor."""
    kind, path = _kind(path, hf=True)
    return path.parent if kind == "fairseq" else path


class CheckpointTensors:
    """Our parameters by name, one at a time, from a checkpoint or an export, or (hf=True)
    a Hugging Face model directory, whose tensors are named and stacked as ours here."""

    def __init__(self, path, hf=False):
        self.kind, self.path = _kind(path, hf)
        # where the tokenizer and side files are: a fairseq checkpoint's dict.txt is beside it
        self.files_dir = self.path.parent if self.kind == "fairseq" else self.path
        if self.kind == "hf":
            self._init_hf()
            return
        if self.kind == "fairseq":
            self._init_fairseq()
            return
        if self.kind == "checkpoint":
            self.specs = files.tensor_specs(self.path)
        else:
            try:
                self.specs = safetensors_specs(self.path / EXPORT_FILE)
            except ValueError as e:  # the reader's own "not a valid safetensors file: why"
                raise UsageError(f"{e}; export the checkpoint again") from None
        if not self.band_tables() and "embed_tokens.weight" not in self.specs:
            raise UsageError(
                f"{self.path} holds no shardlm model (no embed_tokens.weight); pass a checkpoint "
                "written by train or an export-model output"
            )
        self.cfg = _load_run_config(self.path / "config.yaml")

    def _init_hf(self):
        """config.json as a run config; every tensor checked (present, of the shape config.json
        implies, a float type) before any is read, so a bad directory costs one line."""
        config, fields, vocab_size, max_positions = read_hf_config(self.path)
        self.cfg = hf_run_config(fields, max_positions, config.get("pad_token_id"), vocab_size)
        # Read by its own shapes whatever --model-overrides changes later (a copy: OmegaConf
        # may change the node in place).
        self._hf_model = copy.deepcopy(self.cfg.model)
        shapes = {
            name: tuple(p.shape)
            for name, p in build_model(self.cfg.model, vocab_size, max_positions, device="meta").named_parameters()
        }
        self._hf = HFWeights(self.path)
        self._hf.check(shapes, self._hf_model)
        self.specs = {
            name: (shape, FLOAT_DTYPES[self._hf.specs[hf_parts(name, self._hf_model)[0][0]][1]])
            for name, shape in shapes.items()
        }

    def _init_fairseq(self):
        """A fairseq-train checkpoint: its config as a run config, every tensor checked first."""
        arch, fixed, training, task, vocab_size = fairseq_settings(self.path)
        model = OmegaConf.merge(OmegaConf.structured(TransformerLMConfig), {**fixed, **training})
        model._name = arch
        task_cfg = OmegaConf.structured(TaskConfig)
        for key in ("tokens_per_sample", "sample_break_mode", "add_bos_token"):
            if task.get(key) is not None:
                task_cfg[key] = task[key]
        self.cfg = OmegaConf.create({"model": model, "task": task_cfg, "padding_idx": PADDING_IDX})
        meta = build_model(model, vocab_size, model_positions(self.cfg), device="meta")
        self._fairseq = FairseqTensors(self.path, copy.deepcopy(model))
        shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
        self._fairseq.check(shapes)
        self.specs = {
            name: (shape, self._fairseq.tensors[self._fairseq.parts(name)[0]].dtype) for name, shape in shapes.items()
        }

    def close(self):
        """Let go of the files a Hugging Face directory is memory-mapped from."""
        if self.kind == "hf":
            self._hf.__exit__(None, None, None)

    def get(self, name):
        shape, dtype = self.specs[name]
        if self.kind == "hf":
            return self._hf.rows(name, self._hf_model, 0, shape[0], dtype)
        if self.kind == "fairseq":
            return self._fairseq.get(name).to(dtype)
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
                dcp.load(out, storage_reader=files.safe_reader(self.path), planner=NoBytesLoadPlanner(), no_dist=True)
            # A shard file that is missing, cut short or not a torch archive.
            except (OSError, RuntimeError, CheckpointException) as e:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise UsageError(
                    f"cannot read {name} from {self.path}: {reason[:200]}; the checkpoint is damaged "
                    "or incomplete: pass another one (e.g. an earlier checkpoint)"
                ) from None
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
        raise UsageError(
            f"{path} is not valid YAML ({str(e).splitlines()[0]}); pass a complete checkpoint or export"
        ) from None
    if not (
        isinstance(cfg, DictConfig)
        and isinstance(cfg.get("model"), DictConfig)
        and isinstance(cfg.get("task"), DictConfig)
    ):
        raise UsageError(
            f"{path} is not a shardlm run config (no model and task sections); pass a checkpoint "
            "written by train or an export-model output"
        )
    return cfg


def hf_run_config(fields, max_positions, pad_token_id, vocab_size):
    """The run config (model and task groups) of a Hugging Face model: its fields over our
    model schema's defaults, the task schema's defaults otherwise."""
    model = OmegaConf.merge(OmegaConf.structured(TransformerLMConfig), fields, {"max_target_positions": max_positions})
    # eval-lm's default block is the task's (fairseq's 1024), not the model's positions
    # (Llama 3.1's 131072): one block would hold a whole split, its attention quadratic in
    # it. --tokens-per-sample takes it up to max_position_embeddings.
    task = OmegaConf.structured(TaskConfig(tokens_per_sample=min(max_positions, TaskConfig.tokens_per_sample)))
    pad = pad_token_id if isinstance(pad_token_id, int) and 0 <= pad_token_id < vocab_size else None
    return OmegaConf.create({"model": model, "task": task, "padding_idx": pad})


def load_model(path, device="cpu", model_overrides=None, pad=None, dtype=None):
    """(model in eval mode, config, tokenizer or None) from a checkpoint, an export or a
    Hugging Face model directory. model_overrides: model keys to change first (eval-lm's
    --model-overrides). pad: the pad id of the data the model will score, whose targets its
    loss skips (default: the one it was trained with; config.json's pad_token_id); it
    changes no logit (an embedding's padding_idx only zeroes that row's gradient).
    dtype: the weights' dtype (default fp32, whatever they were saved in); each tensor is
    cast as it is read, so no fp32 copy of the whole model is ever made."""
    src = CheckpointTensors(path, hf=True)
    try:
        if model_overrides:
            src.cfg.model = _overridden(src.cfg.model, model_overrides)
            _check_model_features(src.cfg)  # e.g. --decoder-layers-to-keep; train checked the saved config
        model = build_model(
            src.cfg.model,
            src.vocab_size(),
            src.max_positions(),
            device="meta",
            padding_idx=pad if pad is not None else src.cfg.get("padding_idx", 1),
        )
        model.to_empty(device=device)
        if dtype is not None:
            model.to(dtype)
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
                    raise UsageError(f"{src.path}: {name} is {list(t.shape)}, its config implies {list(p.shape)}")
                p.copy_(t)
    finally:
        src.close()
    model.eval()
    return model, src.cfg, tokenizer_of(src.files_dir)


def _overridden(model_cfg, overrides):
    """The saved model config with `overrides`, typed by the model's dataclass."""
    try:
        return OmegaConf.merge(OmegaConf.structured(TransformerLMConfig), model_cfg, overrides)
    except OmegaConfBaseException as e:
        raise UsageError(f"--model-overrides {overrides}: {str(e).splitlines()[0]}") from None


def tokenizer_of(path):
    path = Path(path)
    if has_tokenizer(path):
        return load_tokenizer(path)
    return None


def weights_dtype(args):
    """The dtype --fp16 / --bf16 ask for (None: fp32)."""
    if args.fp16 and args.bf16:
        raise UsageError("--fp16 and --bf16 both given: pick one")
    return torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else None
