"""A model written by another trainer (a Hugging Face directory, a fairseq-train checkpoint:
trainer/formats/) into the model of a run, plain, DDP-wrapped or sharded: each rank reads
the rows of its own shards only, through the format's reader, so no rank holds the model."""

import torch

from trainer.errors import UsageError
from trainer.parallel.parallelize import local_rows


@torch.no_grad()
def load_rows(model, reader):
    """Copy `reader`'s parameters into `model`; every one is checked (present, same shape)
    before any is read. Returns the number of parameters loaded."""
    model = getattr(model, "module", model)  # DDP
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name not in reader.specs:
            raise UsageError(f"{reader.path} has no tensor for our {name}; it is not a model of this config")
        if tuple(reader.specs[name][0]) != tuple(p.shape):
            raise UsageError(
                f"{reader.path}: {name} is {list(reader.specs[name][0])}, the run's model needs {list(p.shape)}"
            )
    for name, p in params.items():
        local, first = local_rows(p)
        if local.numel():
            local.copy_(reader.rows(name, first, first + local.shape[0], local.dtype))
    return sum(p.numel() for p in params.values())


def load_moments(model, optimizer, run):
    """The optimizer's state from another trainer's Adam (trainer/formats/reader.py
    ForeignRun): each parameter's exp_avg and exp_avg_sq, this rank's rows only, and its step."""
    model = getattr(model, "module", model)
    for name, p in model.named_parameters():
        local, first = local_rows(p)
        moments = run.moments(name, first, first + local.shape[0])
        if moments is None:
            continue
        state = {"step": torch.tensor(float(moments["step"]), dtype=torch.float32, device=p.device)}
        for key in ("exp_avg", "exp_avg_sq"):
            whole = torch.zeros_like(p)
            mine, _ = local_rows(whole)
            if mine.numel():
                mine.copy_(moments[key])
            state[key] = whole
        optimizer.state[p] = state
