"""fairseq's FSDP checkpoints (fairseq-train --ddp-backend fully_sharded, fairscale 0.4.13's
FullyShardedDataParallel) read as the model and Adam state they hold, by every command that
takes a fairseq .pt.

tests/fixtures/fairseq-fsdp/sharded is a real 2-rank --use-sharded-state run (its README).
fairseq cannot run here, so the other layouts are written from tests/fixtures/fairseq/lm's
weights and Adam state as fairscale writes them (fairscale_files: FlattenParamsWrapper's
order, FullyShardedDataParallel._get_shard's chunks and padding, local_metadata_dict's and
gather_full_optim_state_dict's layouts), on 3 ranks so that the chunks are padded."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cli
from helpers import compose, run_ranks

FIXTURES = Path(__file__).parent / "fixtures"
SHARDED = FIXTURES / "fairseq-fsdp" / "sharded"
LM = FIXTURES / "fairseq" / "lm"
DATA = FIXTURES / "fairseq" / "data-bin"


def _logged_loss(log):
    return float(re.search(r"Loss \(base 2\): ([\d.]+)", log.read_text())[1])


def _in_process(capsys, cmd, *args):
    capsys.readouterr()
    code = cli.COMMANDS[cmd]([str(a) for a in args])
    out, err = capsys.readouterr()
    return code or 0, out, err


def _load(path):
    from trainer.formats.fairseq.checkpoint_file import _allowed_globals

    with torch.serialization.safe_globals(_allowed_globals()):
        return torch.load(path, weights_only=True)


# ------------------------------------------------------------------ fairscale's layout
def fairscale_files(state, world, wrap_layers, sharded=True):
    """What fairseq-train --ddp-backend fully_sharded on `world` ranks saves of `state` (an
    unsharded transformer_lm checkpoint): with --use-sharded-state each rank's file, else rank
    0's one file. --min-params-to-wrap (wrap_layers) makes each layer an FSDP unit of its own."""
    model = state["model"]
    names, seen, shared = [], {}, []
    for name, t in model.items():  # FlattenParamsWrapper: a tied tensor flattened once
        if name.endswith((".version", "._float_tensor")):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            shared.append((seen[key], name))
        else:
            seen[key] = name
            names.append(name)
    adam = dict(zip(names, (state["last_optimizer_state"]["state"][i] for i in range(len(names)))))
    layers = [f"decoder.layers.{i}" for i in range(state["cfg"]["model"]["decoder_layers"])] if wrap_layers else []
    units = [""] + layers  # named_modules order: the root first

    def unit_of(name):
        return next((p for p in layers if name.startswith(p + ".")), "")

    def shard(flat, rank):  # FullyShardedDataParallel._get_shard
        chunks = list(flat.chunk(world))
        chunks += [flat.new_empty(0)] * (world - len(chunks))
        padding = chunks[0].numel() - chunks[rank].numel()
        return F.pad(chunks[rank], [0, padding]), padding

    ranks = [{"model": {}, "optim": {}, "meta": []} for _ in range(world)]
    for u, path in enumerate(units):
        mine = [n for n in names if unit_of(n) == path]
        relative = [n[len(path) + 1 :] if path else n for n in mine]
        flat = {"w": torch.cat([model[n].reshape(-1) for n in mine])}  # FlatParameter
        flat.update({k: torch.cat([adam[n][k].reshape(-1) for n in mine]) for k in ("exp_avg", "exp_avg_sq")})
        for r in range(world):
            weights, padding = shard(flat["w"], r)
            ranks[r]["model"][f"{path}.flat_param_0" if path else "flat_param_0"] = weights
            ranks[r]["optim"][u] = {"step": adam[mine[0]]["step"]}
            ranks[r]["optim"][u].update({k: shard(flat[k], r)[0] for k in ("exp_avg", "exp_avg_sq")})
            params = {
                "names": relative,
                "shapes": [model[n].shape for n in mine],
                "numels": [model[n].numel() for n in mine],
            }
            ranks[r]["meta"].append(
                {
                    "fsdp_path": path,
                    "params": {"flat_param_0": {**params, "padding": padding}},
                    "no_broadcast_optim_state": False,
                    "shared_param_info": [(s, d) for s, d in shared if unit_of(s) == path],
                }
            )
            if u == 0:  # local_state_dict's order: the root's flat parameter, its buffers, the layers'
                ranks[r]["model"].update({n: t for n, t in model.items() if n.endswith((".version", "._float_tensor"))})
    buffers = [n for n in model if n.endswith((".version", "._float_tensor"))]
    group = {**state["last_optimizer_state"]["param_groups"][0]}

    def checkpoint(rank, model_state, optim):
        cfg = json.loads(json.dumps(state["cfg"]))
        dist = cfg["distributed_training"]
        dist.update(distributed_world_size=world, distributed_rank=rank, device_id=rank, ddp_backend="fully_sharded")
        dist["use_sharded_state"] = sharded
        return {
            **{k: v for k, v in state.items() if k not in ("model", "last_optimizer_state")},
            "cfg": cfg,
            "model": model_state,
            "last_optimizer_state": optim,
            "fsdp_metadata": {"param_metadata": ranks[rank]["meta"], "buffer_names": buffers},
        }

    if sharded:
        return [
            checkpoint(
                r,
                ranks[r]["model"],
                {"state": ranks[r]["optim"], "param_groups": [{**group, "params": list(range(len(units)))}]},
            )
            for r in range(world)
        ]
    # gather_full_optim_state_dict: one state per parameter, in the units' order
    order = [n for path in units for n in names if unit_of(n) == path]
    gathered = {
        "state": {i: adam[n] for i, n in enumerate(order)},
        "param_groups": [{**group, "params": list(range(len(order)))}],
        "param_id_map": {i: units.index(unit_of(n)) for i, n in enumerate(order)},
        "uncollected_local_ids": [],
    }
    return [checkpoint(0, dict(model), gathered)]


@pytest.fixture(scope="module")
def lm_state():
    return _load(LM / "checkpoint_last.pt")


def _write(tmp_path, lm_state, layout):
    """(path to pass, the files) of lm's checkpoint in `layout`."""
    world, wrap, sharded = {"3-ranks": (3, False, True), "3-ranks-per-layer": (3, True, True)}.get(
        layout, (3, True, False)
    )
    files = fairscale_files(lm_state, world, wrap, sharded)
    if not sharded:
        torch.save(files[0], tmp_path / "checkpoint_last.pt")
        return tmp_path / "checkpoint_last.pt", files
    for r, f in enumerate(files):
        torch.save(f, tmp_path / f"checkpoint_last-shard{r}.pt")
    return tmp_path / "checkpoint_last.pt", files


# ------------------------------------------------------------------ eval-lm, weights, Adam
@pytest.mark.parametrize(
    "layout", ["real-2-ranks", "real-shard1", "3-ranks", "3-ranks-per-layer", "per-layer-one-file"]
)
def test_eval_lm_of_an_fsdp_checkpoint_gives_fairseq_eval_lms_loss(layout, lm_state, tmp_path, capsys):
    """fairseq-eval-lm --tokens-per-sample 64 --batch-size 8: the real run's eval_last.log
    (7.9570; fairseq's own eval consolidated its shards), lm's eval.log (8.3805). The weights
    and Adam state read are the unsharded ones, exactly."""
    from trainer.formats.fairseq.tensors import FairseqTensors, fairseq_adam_state

    if layout.startswith("real"):
        path = SHARDED / ("checkpoint_last.pt" if layout == "real-2-ranks" else "checkpoint_last-shard1.pt")
        theirs = _logged_loss(SHARDED / "eval_last.log")
    else:
        path, files = _write(tmp_path, lm_state, layout)
        theirs = _logged_loss(LM / "eval.log")
        paddings = [u["params"]["flat_param_0"]["padding"] for f in files for u in f["fsdp_metadata"]["param_metadata"]]
        assert layout == "per-layer-one-file" or any(paddings)  # 3 ranks: uneven chunks
        src = FairseqTensors(path, None)
        unsharded = lm_state["model"]
        assert set(src.tensors) == set(unsharded)
        assert all(torch.equal(src.tensors[n], t) for n, t in unsharded.items() if not n.endswith("_float_tensor"))
        adam, order = fairseq_adam_state(src), [n for n in unsharded if n in fairseq_adam_state(src)]
        assert len(adam) == 35  # the tied output projection is stepped as the embedding
        for i, name in enumerate(order):
            expected = lm_state["last_optimizer_state"]["state"][i]
            assert adam[name]["step"] == expected["step"]
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(adam[name][key], expected[key]), (name, key)
    code, out, err = _in_process(capsys, "eval-lm", DATA, "--path", path, "--tokens-per-sample", 64, "--batch-size", 8)
    assert code == 0, err
    assert "Evaluated 4,511 tokens" in out
    assert f"Loss (base 2): {theirs:.4f}," in out, out


# ------------------------------------------------------------------ train --restore-file
# fairseq's run (sharded/cmd.txt) after update 20, without dropout so that ranks compare.
RESUME = (
    "--task language_modeling --tokens-per-sample 64 --max-tokens 512 --optimizer adam --lr 0.001 --cpu "
    "--seed 1 --dropout 0 --max-update 21 --ddp-backend fully_sharded"
).split()


def _resumed_rank(index, argv, world, port, out):
    """One rank of `train` (trainer.main.run) recording the optimizer's state right after the
    restore, gathered whole, and each update's sums."""
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.rendezvous import Rendezvous
    from trainer.train import main
    from trainer.train.trainer import Trainer

    restore, step, seen = Checkpointer.restore, Trainer.train_step, {"updates": []}

    def restoring(self):
        path = restore(self)
        seen["num_updates"] = self.pieces["trainer"].num_updates
        seen["state"] = {
            name: {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                for k, v in self.optimizer.state[p].items()
            }
            for name, p in self.model.named_parameters()
        }
        return path

    def recording(self, samples):
        update = step(self, samples)
        seen["updates"].append((self.num_updates, update.values()))
        return update

    Checkpointer.restore, Trainer.train_step = restoring, recording
    rdv = Rendezvous(
        f"tcp://127.0.0.1:{port}" if world > 1 else "", world, rank=index, local_rank=index, local_world_size=world
    )
    main.run(compose(argv), rdv)
    if index == 0:
        torch.save(seen, out)


def _shards_unflattened():
    """fairseq name -> {exp_avg, exp_avg_sq} of the real shards, un-flattened here on their own:
    padding off, chunks joined, cut by the metadata's numels."""
    shards = [_load(SHARDED / f"checkpoint_last-shard{r}.pt") for r in range(2)]
    flat = shards[0]["fsdp_metadata"]["param_metadata"][0]["params"]["flat_param_0"]
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        chunks = []
        for s in shards:
            pad = s["fsdp_metadata"]["param_metadata"][0]["params"]["flat_param_0"]["padding"]
            t = s["last_optimizer_state"]["state"][0][key]
            chunks.append(t[: t.numel() - pad])
        for name, t, shape in zip(flat["names"], torch.cat(chunks).split(flat["numels"]), flat["shapes"]):
            out.setdefault(name, {})[key] = t.view(shape)
    return out, shards[0]["last_optimizer_state"]["state"][0]["step"]


@pytest.mark.parametrize("start,world", [("restore", 1), ("restore", 2), ("finetune", 1)])
def test_restore_file_resumes_a_sharded_fairseq_run_under_our_fsdp(start, world, tmp_path):
    """The real 2-rank run's shards resume on 1 and on 2 ranks of our FSDP: update count 20,
    Adam's state the shards' un-flattened (our qkv_proj's is q's, k's and v's stacked), and
    update 21 takes fairseq's next global batch (2 x 512 tokens) at fairseq's loss level
    (its update 20: 8.022; a fresh model starts near 10). --finetune-from-model starts from
    its weights, with a fresh optimizer and update count."""
    from trainer.formats.fairseq.model import fairseq_parts
    from trainer.rendezvous import free_port

    argv = [str(DATA), *RESUME, "--distributed-world-size", str(world), "--save-dir", str(tmp_path / "ck")]
    argv += [f"--{start}-{'file' if start == 'restore' else 'from-model'}", str(SHARDED / "checkpoint_last.pt")]
    argv += ["--update-freq", str(3 - world)]
    out = tmp_path / "seen.pt"
    run_ranks(_resumed_rank, (argv, world, free_port(), str(out)), world)
    seen = torch.load(out, weights_only=False)
    if start == "finetune":
        (n, stats), *_ = seen["updates"]
        assert seen["num_updates"] == 0 and not any(seen["state"].values()) and n == 1
        assert stats["loss_sum"] / stats["sample_size"] / math.log(2) < 8.1
        return
    assert seen["num_updates"] == 20
    theirs, step = _shards_unflattened()
    cfg = compose(argv).model
    assert len(seen["state"]) == len(theirs) - 2 * 4  # k's and v's weights and biases are in our qkv_proj
    for name, state in seen["state"].items():
        assert float(state["step"]) == step == 20
        for key in ("exp_avg", "exp_avg_sq"):
            expected = torch.cat([theirs[part][key] for part in fairseq_parts(name, cfg, theirs)])
            assert torch.equal(state[key], expected), (name, key)
            assert state[key].abs().sum() > 0
    (n, stats), *_ = seen["updates"]
    assert n == 21 and stats["sample_size"] == 1024
    assert 7.6 < stats["loss_sum"] / stats["sample_size"] / math.log(2) < 8.1


# ------------------------------------------------------------------ the other commands, bad sets
def test_plan_export_and_generate_take_the_name_fairseq_users_type(tmp_path, capsys):
    path = SHARDED / "checkpoint_last.pt"
    code, out, err = _in_process(capsys, "plan", "--path", path, "--tokens-per-sample", 64, "--batch-size", 8, "--cpu")
    assert code == 0 and "1,074,560 parameters" in out, err  # the flat parameter's 1,074,560 values
    code, _, err = _in_process(capsys, "export-model", "--path", path, "--out", tmp_path / "ours")
    assert code == 0, err
    code, out, err = _in_process(
        capsys, "eval-lm", DATA, "--path", tmp_path / "ours", "--tokens-per-sample", 64, "--batch-size", 8
    )
    assert f"Loss (base 2): {_logged_loss(SHARDED / 'eval_last.log'):.4f}," in out, err
    argv = [DATA, "--path", SHARDED / "checkpoint_last-shard0.pt", "--temperature", 0, "--max-new-tokens", 4]
    code, out, err = _in_process(capsys, "generate", *argv, "--prompt", "kavo")
    assert code == 0 and out.startswith("kavo"), err


@pytest.mark.parametrize(
    "case,message",
    [
        ("shard1-alone", "checkpoint_last-shard0.pt is not in"),
        ("name-shard1-alone", "checkpoint_last-shard0.pt is not in"),
        ("another-update", "their update count (num_updates) differ (10 vs 20)"),
        ("another-config", "their config (model.decoder_ffn_embed_dim) differ (256 vs 128)"),
        ("another-layout", "their FSDP layout (fsdp_metadata) differ"),
        ("another-world", "holds rank 0's shard of 3, not rank 0's of 2"),
    ],
)
def test_missing_or_mismatched_shards_get_one_line(case, message, tmp_path, capsys):
    """eval-lm --path checkpoint_last-shard1.pt once ended in an AssertionError of the
    embedding's ("Padding_idx must be within num_embeddings")."""
    shutil.copy(SHARDED / "checkpoint_last-shard1.pt", tmp_path)
    if not case.endswith("alone"):
        other = _load(SHARDED / "checkpoint_last-shard0.pt")
        if case == "another-update":
            other["optimizer_history"][-1]["num_updates"] = 10
        elif case == "another-config":
            other["cfg"]["model"]["decoder_ffn_embed_dim"] = 256
        elif case == "another-layout":
            other["fsdp_metadata"]["param_metadata"][0]["params"]["flat_param_0"]["names"][0] = "decoder.embed"
        else:
            other["cfg"]["distributed_training"]["distributed_world_size"] = 3
        torch.save(other, tmp_path / "checkpoint_last-shard0.pt")
    named_shard = case in ("shard1-alone", "another-world")
    path = tmp_path / ("checkpoint_last-shard1.pt" if named_shard else "checkpoint_last.pt")
    code, _, err = _in_process(capsys, "eval-lm", DATA, "--path", path, "--tokens-per-sample", 64)
    assert code != 0 and err.count("\n") == 1 and message in err, err
