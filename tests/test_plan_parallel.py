"""The planner under tensor and context parallelism (--model-parallel-size,
--context-parallel-size; trainer/plan/shapes.py tensor_parallel_share, ledger.py, comm.py,
layouts.py): a tensor-parallel rank's parameters and a layer's saved activations against the
real split layer on 2 gloo ranks, predicted against measured peaks of TP 2 and FSDP 2 × TP 2
runs, the collectives counted, and the layouts the search tries on GPUs."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from plan_helpers import SETUP, cfg_of, plan_json

from trainer.plan.ledger import layer_activation_bytes, rope_table_bytes
from trainer.plan.search import model_shape
from trainer.plan.shapes import tensor_parallel_share

BIN = Path(sys.executable).parent
# The Llama layer at test size: 4 query heads over 2 kv heads, RoPE, SwiGLU, RMSNorm.
LLAMA = [
    "--arch",
    "llama3_2_1b",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "256",
    "--decoder-ffn-embed-dim",
    "688",
    "--decoder-attention-heads",
    "4",
    "--decoder-kv-heads",
    "2",
    "--decoder-head-dim",
    "64",
]
VOCAB = 779  # odd: the vocabulary's rows split unevenly


def _split_layer_rank(index, port, out):
    """One rank of a TP 2 group: the model split as train splits it, its parameters' local
    elements, and the bytes the first layer's forward saves for backward (local storages,
    weights aside), in fp32 and in bf16."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from models.transformer_lm import build_model, rope_inverse_frequencies, rope_tables
    from trainer.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    cfg = cfg_of("--task", "dummy_lm", "--dict-size", str(VOCAB), "--tokens-per-sample", str(SETUP.seq_len), *LLAMA)
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = build_model(cfg.model, VOCAB, SETUP.seq_len).to(dtype)
        apply_tensor_parallel(model, mesh)
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        weights = {p.untyped_storage().data_ptr() for p in local}
        saved = {}

        def pack(t, weights=weights, saved=saved):
            t = t._local_tensor if isinstance(t, DTensor) else t
            if t.untyped_storage().data_ptr() not in weights:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(SETUP.sequences, SETUP.seq_len, cfg.model.decoder_embed_dim, dtype=dtype, requires_grad=True)
        rope = rope_tables(rope_inverse_frequencies(cfg.model), 0, SETUP.seq_len, dtype)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.layers[0](x, rope=rope)
        result[str(dtype)] = {"params": sum(p.numel() for p in local), "saved": sum(saved.values())}
    dist.destroy_process_group()
    Path(f"{out}.{index}").write_text(json.dumps(result))


def test_a_tensor_parallel_rank_holds_and_saves_what_plan_counts(tmp_path):
    """On the real split model (trainer/parallel/tensor_parallel.py, 2 gloo ranks): a rank's
    parameters are tensor_parallel_share's count (its heads, width and vocabulary rows; norms
    whole), and a layer's forward saves what the ledger counts: the norms' inputs and rstd on
    the rank's positions (sequence parallelism), the projections' inputs gathered over all
    positions, the attention and feed-forward on the rank's heads and width."""
    from helpers import run_ranks
    from trainer.rendezvous import free_port

    out = tmp_path / "ranks"
    run_ranks(_split_layer_rank, (free_port(), str(out)), 2)
    cfg = cfg_of("--task", "dummy_lm", "--dict-size", str(VOCAB), *LLAMA)
    shape = model_shape(cfg, VOCAB)
    share = tensor_parallel_share(shape, 2)
    for rank in range(2):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        for precision, dtype in (("fp32", "torch.float32"), ("bf16", "torch.bfloat16")):
            setup = replace(SETUP, world=2, shard=1, tp=2, precision=precision)
            if rank == 0:  # the uneven vocabulary: rank 0 holds the larger share, which plan counts
                assert got[dtype]["params"] == share.params
            counted = layer_activation_bytes(share, setup) + rope_table_bytes(share, setup)
            assert got[dtype]["saved"] == counted, (rank, precision)
    assert share.params < shape.params / 2 + shape.dim * 8  # about half: only norms are whole


# A model whose activations outweigh its runtime on 2 and 4 CPU ranks (tests/test_plan_cli.py's
# measured run, Llama-shaped): fp32, no checkpointing, so every split activation counts.
MEASURED = [
    "--arch",
    "llama3_2_1b",
    "--decoder-layers",
    "4",
    "--decoder-embed-dim",
    "384",
    "--decoder-ffn-embed-dim",
    "1024",
    "--decoder-attention-heads",
    "6",
    "--decoder-kv-heads",
    "2",
    "--decoder-head-dim",
    "64",
    "--task",
    "dummy_lm",
    "--dict-size",
    "8192",
    "--tokens-per-sample",
    "256",
    "--batch-size",
    "16",
    "--ddp-backend",
    "fully_sharded",
    "--model-parallel-size",
    "2",
]


@pytest.mark.parametrize("world", [2, 4], ids=["tp2", "fsdp2_tp2"])
def test_prediction_matches_a_measured_tensor_parallel_run(world, tmp_path, capsys):
    """Predicted vs measured peak resident memory per rank (mem_gb), TP 2 alone and FSDP 2 × TP 2."""
    model = MEASURED + ["--distributed-world-size", str(world)]
    predicted = plan_json(capsys, *model, "--cpu")["per_rank_gb"]
    r = subprocess.run(
        [str(BIN / "train")]
        + model
        + ["--max-update", "2", "--no-save", "--disable-validation", "--log-format", "json", "--log-interval", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    measured = max(
        json.loads(line[line.index("{") :])["mem_gb"] for line in r.stdout.splitlines() if "| train_inner |" in line
    )
    print(f"world {world}, TP 2: predicted {predicted} GB, measured {measured} GB")
    assert predicted == pytest.approx(measured, rel=0.10)
