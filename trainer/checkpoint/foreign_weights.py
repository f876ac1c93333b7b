"""A model written by another trainer (a Hugging Face directory, a fairseq-train checkpoint:
trainer/formats/) into the model of a run, plain, DDP-wrapped or sharded (FSDP, tensor
parallelism): each rank reads the rows of its own shards only, through the format's reader,
so no rank holds the model."""

import torch

from trainer.errors import UsageError
from trainer.parallel.tensor_parallel import local_pieces, row_orders


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
    orders = row_orders(model)
    for name, p in params.items():
        for local, first, count, cols in local_pieces(p, orders.get(name)):
            if local.numel():
                rows = reader.rows(name, first, first + count, local.dtype)
                local.copy_(rows if cols is None else rows[:, cols])
    return sum(p.numel() for p in params.values())


def load_moments(model, optimizer, run):
    """The optimizer's state from another trainer's Adam (trainer/formats/reader.py
    ForeignRun): each parameter's exp_avg and exp_avg_sq, this rank's rows only, and its step."""
    model = getattr(model, "module", model)
    orders = row_orders(model)
    for name, p in model.named_parameters():
        state = {key: torch.zeros_like(p) for key in ("exp_avg", "exp_avg_sq")}
        # this rank's pieces of the parameter and of each moment, alike
        pieces = zip(*(local_pieces(t, orders.get(name)) for t in [p, *state.values()]))
        for (_, first, count, cols), *mine in pieces:
            moments = run.moments(name, first, first + count)
            if moments is None:
                break
            state["step"] = torch.tensor(float(moments["step"]), dtype=torch.float32, device=p.device)
            for key, (local, *_) in zip(("exp_avg", "exp_avg_sq"), mine):
                if local.numel():
                    local.copy_(moments[key] if cols is None else moments[key][:, cols])
        if "step" in state:
            optimizer.state[p] = state
