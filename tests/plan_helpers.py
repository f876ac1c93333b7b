"""What the planner's tests share (tests/test_plan_*.py): a small model (4 layers of 256) over
4 FSDP ranks on a CPU, the bytes of one component at the predicted peak, `plan`'s JSON
answer, and a config composed from flags as `train` composes it."""

import json
import subprocess
import sys
from pathlib import Path

import cli
from trainer.config.compose import compose_config
from trainer.plan.ledger import ModelShape, Setup, simulate

SHAPE = ModelShape(
    layers=4,
    dim=256,
    ffn=1024,
    heads=4,
    vocab=5000,
    learned_positions=128,
    tied=True,
    norms_outside_layers=1,
    activation_fn="gelu",
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)


SETUP = Setup(
    device="cpu",
    world=4,
    ranks_per_host=4,
    backend="fully_sharded",
    shard=4,
    reshard_after_forward=True,
    checkpoint_activations=False,
    offload_activations=False,
    cpu_offload=False,
    defer_grad_sync=False,
    update_freq=1,
    sequences=4,
    seq_len=128,
    precision="fp32",
    fp32_reduce_scatter=False,
    optimizer_states=2,
)


def at_peak(shape, setup, component):
    """Bytes of `component` alive at the predicted peak (unrounded)."""
    return simulate(shape, setup)[0].at_peak.get(component, 0)


def plan_json(capsys, *argv):
    assert cli.plan_main(list(argv) + ["--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def cfg_of(*flags):
    from trainer.config.flags import build_parser, parse_flags

    _, settings, overrides = parse_flags(build_parser(), list(flags))
    return compose_config(settings, overrides)


def measured_peak_gb(model, updates, cwd):
    """The highest mem_gb of `train`'s train_inner records over `updates` updates of `model`
    (its flags), run as users run it (the console script), in `cwd`."""
    r = subprocess.run(
        [str(Path(sys.executable).parent / "train")]
        + model
        + ["--max-update", str(updates), "--no-save", "--disable-validation", "--log-format", "json"]
        + ["--log-interval", "1"],
        capture_output=True,
        text=True,
        cwd=cwd,
    )
    assert r.returncode == 0, r.stderr
    return max(
        json.loads(line[line.index("{") :])["mem_gb"] for line in r.stdout.splitlines() if "| train_inner |" in line
    )


def saved_for_backward_bytes(layer, *args, **kwargs):
    """The bytes `layer`'s forward on args saves for backward, its weights aside, each
    storage once (views of one tensor share theirs)."""
    import torch  # the measured layers' tests only: plan's own helpers are torch-free

    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(*args, **kwargs)
    return sum(saved.values())
