"""--compile: each decoder layer goes through torch.compile (inductor's C++ code on this
CPU) before sharding. The compiled model trains the same model the eager one does, on
FSDP ranks with activation checkpointing (the full checkpoint → compile → shard order),
and its checkpoints are those of the eager model: a run resumes with or without it."""

import json
from pathlib import Path

import pytest

from helpers import DUMMY, compose, train_updates, update_losses

UPDATES = 4
BASE = DUMMY + ["--clip-norm", "0.5"]
SAVE = [a for a in BASE if a != "--no-save"]
# Fused kernels sum in another order than eager ones: agreement to float32 rounding, not bits.
REL = 1e-4


def _compiled_rank(index, argv, world, port, out):
    """Losses of one rank, and how many graphs dynamo compiled in it (0 if --compile did nothing)."""
    from torch._dynamo.utils import counters

    from helpers import update_losses
    from trainer.rendezvous import Rendezvous

    rdv = Rendezvous(f"tcp://127.0.0.1:{port}", world, rank=index, local_rank=index, local_world_size=world)
    losses, gnorms = update_losses(argv, UPDATES, rdv, with_gnorm=True)
    Path(f"{out}.{index}").write_text(
        json.dumps({"losses": losses, "gnorms": gnorms, "graphs": counters["stats"]["unique_graphs"]})
    )


@pytest.fixture(scope="module")
def eager_one_process():
    """6 eager updates in this process, batch 8 holding what 2 FSDP ranks x 4 read: the curve
    both tests follow."""
    return update_losses(BASE + ["--batch-size", "4"], 6, with_gnorm=True, merge=2)


# FSDP 2; tensor parallelism 2 (the layers' DTensor hooks traced with them, each checkpointed
# eagerly around its compiled forward): 8 sequences an update
LAYOUTS = {
    "fsdp2": ["--batch-size", "4"],
    "tp2": ["--batch-size", "4", "--update-freq", "2", "--model-parallel-size", "2"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_fsdp_with_checkpointing_matches_eager(layout, eager_one_process, tmp_path):
    from helpers import run_ranks
    from trainer.rendezvous import free_port

    argv = BASE + LAYOUTS[layout] + ["--ddp-backend", "fully_sharded", "--checkpoint-activations", "--compile"]
    out = tmp_path / "ranks"
    run_ranks(_compiled_rank, (argv, 2, free_port(), str(out)), 2)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert all(r["graphs"] >= 1 for r in ranks), "no layer was compiled"
    assert ranks[0]["losses"] == ranks[1]["losses"]
    losses, gnorms = (x[:UPDATES] for x in eager_one_process)
    assert ranks[0]["losses"] == pytest.approx(losses, rel=REL)
    assert ranks[0]["gnorms"] == pytest.approx(gnorms, rel=REL)
    assert losses[-1] < losses[0]


def test_compiled_layers_keep_the_bare_state_dict_keys():
    import torch

    from trainer.parallel.ranks import DistEnv
    from trainer.train.main import build

    env = DistEnv(0, 1, 0, 1, torch.device("cpu"), None)
    eager = build(compose(BASE + ["--batch-size", "8"]), env)[1].model
    compiled = build(compose(BASE + ["--batch-size", "8", "--compile"]), env)[1].model
    assert all(layer._compiled_call_impl is not None for layer in compiled.layers)
    assert list(compiled.state_dict()) == list(eager.state_dict())


def test_checkpoint_of_compiled_run_resumes_eager(eager_one_process, tmp_path):
    argv = SAVE + ["--batch-size", "4", "--ddp-backend", "fully_sharded"]
    whole = {n: curve for n, curve in enumerate(zip(*eager_one_process), start=1)}  # {update: (loss, gnorm)}
    save = ["--save-dir", str(tmp_path / "ckpt")]
    first = train_updates(argv + ["--compile", "--max-update", "3"] + save, 2, tmp_path)
    second = train_updates(argv + ["--max-update", "6"] + save, 2, tmp_path)
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6], "an update ran twice"
    for n, (loss, gnorm) in {**first, **second}.items():
        assert loss == pytest.approx(whole[n][0], rel=REL), f"update {n}"
        assert gnorm == pytest.approx(whole[n][1], rel=REL), f"update {n}"


def test_compile_without_a_compiler_is_one_line(tmp_path, monkeypatch, capsys):
    import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHARDLM_DEBUG", raising=False)
    monkeypatch.setenv("CXX", "no-such-c++")
    code = cli.COMMANDS["train"](BASE + ["--batch-size", "8", "--compile", "--cpu"])
    lines = capsys.readouterr().err.splitlines()
    assert code not in (0, None)
    assert lines == [
        "train: error: --compile on a CPU needs a C++ compiler and no-such-c++ is not on PATH; "
        "install g++ (or set CXX to one), or drop --compile"
    ]
    assert list(tmp_path.iterdir()) == []
