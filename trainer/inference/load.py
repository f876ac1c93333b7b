"""One process, no torch.distributed: a trained model in eval mode, from any format
trainer/formats/ reads (a checkpoint of train, an export, a Hugging Face directory, a
fairseq-train checkpoint), one parameter at a time, each cast as it is read: no process
ever holds more than one whole parameter beside the model it is building.
"""

import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.tokenizer import TOKENIZER_FILES, has_tokenizer, load_tokenizer
from models.config import TransformerLMConfig
from models.pq import quantized_specs
from models.transformer_lm import build_model
from trainer.checkpoint.tensors import renumber_layers, saved_layer_ids
from trainer.config.checks import _check_model_features
from trainer.config.checks.parallel_dims import check_model_splits
from trainer.config.schema import TaskConfig, model_positions
from trainer.errors import UsageError
from trainer.formats.hf.generation_config import GENERATION_CONFIG
from trainer.formats.registry import open_model
from trainer.parallel.tensor_parallel import apply_tensor_parallel, local_pieces, row_orders, tensor_parallel_mesh

log = logging.getLogger("shardlm")
SIDE_FILES = (*TOKENIZER_FILES, "metadata.json", GENERATION_CONFIG)


def open_run_model(path, ema=False):
    """The reader of the model at `path` (trainer/formats/reader.py), its config completed
    with the task schema's defaults where the format carries none, so it is a run config.
    ema: a checkpoint's moving average of the weights in place of its weights (--ema)."""
    reader = open_model(path, ema)
    reader.cfg.task = OmegaConf.merge(OmegaConf.structured(TaskConfig), reader.cfg.task)
    return reader


def max_positions(reader):
    return model_positions(reader.cfg)


def load_model(path, device="cpu", model_overrides=None, pad=None, dtype=None, ema=False, env=None):
    """(model in eval mode, config, tokenizer or None) from a checkpoint, an export or a
    Hugging Face model directory. model_overrides: model keys to change first (eval-lm's
    --model-overrides). pad: the pad id of the data the model will score, whose targets its
    loss skips (default: the one it was trained with; config.json's pad_token_id); it
    changes no logit (an embedding's padding_idx only zeroes that row's gradient).
    dtype: the weights' dtype (default fp32, whatever they were saved in); each tensor is
    cast as it is read, so no fp32 copy of the whole model is ever made. ema: the moving
    average of the weights a checkpoint of train --store-ema holds, in place of its weights.
    env: a rank of several whose tensor-parallel groups (env.tp > 1) split the model, each
    rank reading its own rows and columns of each weight (trainer/parallel/tensor_parallel.py)."""
    src = open_run_model(path, ema)
    try:
        if model_overrides:
            src.cfg.model = _overridden(src.cfg.model, model_overrides)
            _check_model_features(src.cfg)  # e.g. --decoder-layers-to-keep; train checked the saved config
        model = build_model(
            src.cfg.model,
            src.vocab_size(),
            max_positions(src),
            device="meta",
            padding_idx=pad if pad is not None else src.cfg.get("padding_idx", 1),
        )
        quantized = quantized_specs({name: spec[0] for name, spec in src.specs.items()})
        if quantized:  # iPQ's layers (models/pq.py): centroids and assignments in their weights' place
            model.quantize_structure(quantized, "meta")
        split = env is not None and env.tp > 1
        if split:
            check_model_splits(src.cfg.model, env.tp, f"--model-parallel-size {env.tp}")
            apply_tensor_parallel(model, tensor_parallel_mesh(env))
        model.to_empty(device=device)
        if dtype is not None:
            model.to(dtype)
        orders = row_orders(model)
        params = model.state_dict(keep_vars=True)  # the parameters and the buffers checkpoints hold
        # A model pruned by --decoder-layers-to-keep reads the layers it keeps, renumbered.
        renamed = renumber_layers({name: name for name in params}, saved_layer_ids(src.cfg.model, src.specs))
        saved_name = {ours: saved for saved, ours in renamed.items()}
        missing = sorted(saved_name[name] for name in params if saved_name[name] not in src.specs)
        if missing:
            raise UsageError(f"{src.path} has no tensor {missing[0]}; it is not a shardlm model of this config")
        with torch.no_grad():
            for name, p in params.items():
                shape = tuple(src.specs[saved_name[name]][0])
                if shape != tuple(p.shape):
                    raise UsageError(f"{src.path}: {name} is {list(shape)}, its config implies {list(p.shape)}")
                if not split:
                    p.copy_(src.get(saved_name[name]))
                    continue
                for local, first, count, cols in local_pieces(p, orders.get(name)):
                    rows = src.rows(saved_name[name], first, first + count, local.dtype)
                    local.copy_(rows if cols is None else rows[:, cols])
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
