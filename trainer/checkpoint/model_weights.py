"""Weights only, from any model shardlm reads, into a model built for them."""

from trainer.checkpoint.foreign_weights import load_rows
from trainer.checkpoint.tensors import check_shapes, load_tensors, tensor_state
from trainer.errors import UsageError
from trainer.formats.registry import open_model
from trainer.formats.shardlm import checkpoint_dir
from trainer.parallel.tensor_parallel import row_orders


def load_model_weights(model, cfg, path):
    """The weights of `path` into `model` (sharded or not), nothing else: a checkpoint of
    train (any world size, any backend), or any other format trainer/formats/ reads (a
    Hugging Face dir, a fairseq-train .pt, an export). For --task dpo's frozen reference.
    Returns a description for the log."""
    found = checkpoint_dir.resolve(path)
    if found is None:
        try:
            reader = open_model(path)
        except UsageError as e:
            raise UsageError(f"--dpo-reference {e}") from None
        with reader:
            n = load_rows(model, reader)
            return f"{reader.describe()}, {n:,} parameters"
    state = tensor_state(model, None, with_optimizer=False)
    check_shapes(found, state["model"], cfg)
    load_tensors(found, state, row_orders(model))
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state["model"])
    return f"checkpoint {found}"
