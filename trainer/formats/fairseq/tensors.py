"""A fairseq-train checkpoint's tensors as ours: the weights, Adam's state and the training
state (update count, lr schedule, data position, best metric) that `train --restore-file X.pt`
resumes fairseq's run from.

The file is memory-mapped (trainer/formats/fairseq/checkpoint_file.py reads it safely); each of our
parameters is built from its fairseq tensors (trainer/formats/fairseq/model.py: q, k and v stacked by
rows into our qkv_proj) and a rank copies only the rows of its own shard.

fairseq's optimizer state is keyed by the position of a parameter in its model's
`parameters()`: the state dict's order, less buffers and tied duplicates. Its fp16 optimizer
keeps one flat fp32 copy of them all, whose state is cut back into parameters by their sizes.
fairseq's adam is AdamW (decoupled weight decay); its exp_avg and exp_avg_sq are torch's.
An FSDP checkpoint's (trainer/formats/fairseq/fsdp_shards.py) is keyed in its fsdp_metadata's order.
"""

import logging
import math

import torch

from data.iterator import ORDER
from trainer.errors import UsageError
from trainer.formats.fairseq.checkpoint_file import read_fairseq_checkpoint
from trainer.formats.fairseq.fsdp_shards import fsdp_parameter_order
from trainer.formats.fairseq.model import fairseq_parts, is_buffer

log = logging.getLogger("shardlm")


class FairseqTensors:
    """Our parameters by name from a fairseq checkpoint, for a model config built from it."""

    def __init__(self, path, model_cfg):
        self.path, self.model_cfg = path, model_cfg
        self.state = read_fairseq_checkpoint(path)
        self.tensors = self.state["model"]

    def parts(self, name):
        return fairseq_parts(name, self.model_cfg, self.tensors)

    def check(self, shapes):
        """Every tensor our parameters need is there with the rows they imply, before any is read."""
        for name, shape in shapes.items():
            parts = self.parts(name)
            missing = next((p for p in parts if p not in self.tensors), None)
            if missing is not None:
                raise UsageError(
                    f"{self.path} has no tensor {missing} (for our {name}); its config and weights disagree, "
                    "or the model uses a fairseq feature shardlm does not load"
                )
            got = [sum(self.tensors[p].shape[0] for p in parts), *self.tensors[parts[0]].shape[1:]]
            if got != list(shape) or not all(self.tensors[p].is_floating_point() for p in parts):
                raise UsageError(
                    f"{self.path}: {' + '.join(parts)} is {got} {self.tensors[parts[0]].dtype}, our {name} "
                    f"needs {list(shape)} floats; the checkpoint's config and weights disagree"
                )

    def get(self, name):
        parts = [self.tensors[p] for p in self.parts(name)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def rows(self, name, first, last, dtype):
        """Rows first..last-1 of our parameter `name`, read from the memory-mapped parts."""
        return stacked_rows([self.tensors[part] for part in self.parts(name)], first, last).to(dtype)


def stacked_rows(tensors, first, last):
    """Rows first..last-1 of `tensors` stacked by rows, slicing only the ones they fall in."""
    out, start = [], 0
    for tensor in tensors:
        lo, hi = max(first - start, 0), min(last - start, tensor.shape[0])
        if lo < hi:
            out.append(tensor[lo:hi])
        start += tensor.shape[0]
    if not out:  # no rows: a rank whose shard of this parameter is empty
        return tensors[0][:0]
    return torch.cat(out) if len(out) > 1 else out[0]


def _parameter_order(tensors):
    """fairseq's `model.parameters()` order: the state dict's keys, less buffers and the
    second name of a tied tensor (the same storage and shape)."""
    seen, order = set(), []
    for name, tensor in tensors.items():
        if is_buffer(name):
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            order.append(name)
    return order


def fairseq_adam_state(src):
    """{fairseq tensor name: {step, exp_avg, exp_avg_sq}} of the checkpoint's Adam; UsageError
    when its state does not match the model's parameters."""
    history = src.state.get("optimizer_history") or [{}]
    name = history[-1].get("optimizer_name", "")
    optimizer_state = src.state.get("last_optimizer_state")
    if "adam" not in name.lower() or not isinstance(optimizer_state, dict):
        raise UsageError(
            f"{src.path} holds no Adam state (its optimizer: {name or 'none saved'}); resume it with "
            "--reset-optimizer, or fine-tune with --finetune-from-model"
        )
    fsdp_order = fsdp_parameter_order(src.state)
    if fsdp_order is not None:  # fairscale's gathered state (or the shards' un-flattened)
        if any(not 0 <= i < len(fsdp_order) for i in optimizer_state["state"]):
            raise UsageError(
                f"{src.path}: optimizer states beyond its {len(fsdp_order)} parameters; resume with --reset-optimizer"
            )
        return {fsdp_order[i]: state for i, state in optimizer_state["state"].items()}
    order = _parameter_order(src.tensors)
    states = [optimizer_state["state"][i] for i in sorted(optimizer_state["state"])]
    numels = [src.tensors[n].numel() for n in order]
    if len(states) == 1 and len(order) > 1 and states[0]["exp_avg"].numel() == sum(numels):
        # fairseq's FP16Optimizer: one flat fp32 parameter; cut its state by parameter sizes
        flat = states[0]
        pieces = {k: flat[k].split(numels) for k in ("exp_avg", "exp_avg_sq")}
        states = [
            {"step": flat["step"], **{k: pieces[k][i].view(src.tensors[n].shape) for k in pieces}}
            for i, n in enumerate(order)
        ]
    if len(states) != len(order):
        raise UsageError(
            f"{src.path}: {len(states)} optimizer states for {len(order)} parameters; resume with --reset-optimizer"
        )
    return dict(zip(order, states))


def fairseq_pieces(src):
    """The states of our registered pieces (trainer, loop, checkpointer, loss scaler) that
    continue fairseq's run: its update count and schedule, its data position (in batches of
    its own world size and batch size), its best validation metric and fp16 loss scale."""
    extra = src.state.get("extra_state") or {}
    history = (src.state.get("optimizer_history") or [{}])[-1]
    num_updates = int(history.get("num_updates", 0))
    fairseq_cfg = src.state.get("cfg") or {}
    args = vars(src.state["args"]) if src.state.get("args") is not None else {}  # fairseq < 0.10
    dataset = fairseq_cfg.get("dataset") or args
    world = (fairseq_cfg.get("distributed_training") or args).get("distributed_world_size", 1)
    position = extra.get("train_iterator") or {}
    best = extra.get("best")
    pieces = {
        "trainer": {"num_updates": num_updates, "lr_updates_offset": 0},
        "loop": {
            "iterator": {
                "epoch": int(position.get("epoch", 1)),
                "iterations_in_epoch": int(position.get("iterations_in_epoch", 0)),
                "order": ORDER,  # fairseq's own, which data/iterator.py reads
                "world_size": int(world or 1),
                "batch_size": dataset.get("batch_size") or dataset.get("max_sentences"),
                "max_tokens": dataset.get("max_tokens"),
            },
            "best_valid_loss": best if isinstance(best, float) and math.isfinite(best) else None,
        },
        "checkpointer": {"best": best},
    }
    scale = (src.state.get("last_optimizer_state") or {}).get("loss_scale")
    if scale is not None:
        pieces["loss_scaler"] = {"scale": float(scale)}
    return pieces, num_updates, int(position.get("epoch", 1))
