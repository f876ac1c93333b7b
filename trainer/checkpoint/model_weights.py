"""Weights only, from any checkpoint kind shardlm reads, into a model built for them."""

from models.hf_llama import hf_model_type
from trainer.checkpoint import files
from trainer.checkpoint.fairseq_checkpoint import load_fairseq_weights
from trainer.checkpoint.hf_dir import is_hf_dir, load_hf_weights
from trainer.checkpoint.tensors import check_shapes, load_tensors, tensor_state
from trainer.config.fairseq_model import is_fairseq_checkpoint
from trainer.errors import UsageError


def load_model_weights(model, cfg, path):
    """The weights of `path` into `model` (sharded or not), nothing else: a Hugging Face dir,
    a fairseq-train .pt, or a checkpoint of train (any world size, any backend). For --task
    dpo's frozen reference. Returns a description for the log."""
    if is_hf_dir(path):
        n = load_hf_weights(model, cfg.model, path)
        return f"Hugging Face {hf_model_type(cfg.model)}, {n:,} parameters"
    if is_fairseq_checkpoint(path):
        _, n = load_fairseq_weights(model, cfg.model, path)
        return f"fairseq {cfg.model._name}, {n:,} parameters"
    found = files.resolve(files.fairseq_path(path))
    if found is None:
        raise UsageError(
            f"--dpo-reference {path} is not a model: pass a Hugging Face model dir, a checkpoint dir written by "
            "train, or a fairseq-train .pt"
        )
    state = tensor_state(model, None, with_optimizer=False)
    check_shapes(found, state["model"], cfg)
    load_tensors(found, state)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state["model"])
    return f"checkpoint {found}"
