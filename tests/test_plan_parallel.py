"""The planner under tensor and context parallelism (--model-parallel-size,
--context-parallel-size; trainer/plan/shapes.py tensor_parallel_share, ledger.py, comm.py,
layouts.py): a tensor-parallel rank's parameters and a layer's saved activations (dense, and a
mixture of experts') against the real split layer on 2 gloo ranks, predicted against measured
peaks of TP 2, FSDP 2 × TP 2 and CP 2 runs, the collectives counted, and the layouts the
search tries on GPUs."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from plan_helpers import SETUP, cfg_of, measured_peak_gb, plan_json
from test_plan_models import LLAMA_LAYER

from trainer.plan.ledger import layer_activation_bytes, predict, rope_table_bytes
from trainer.plan.search import model_shape
from trainer.plan.shapes import tensor_parallel_share

# The Llama layer at test size (test_plan_models'), two of them.
LLAMA = ["--decoder-layers", "2", *LLAMA_LAYER]
# and as a mixture of experts (test_plan_moe's): each rank routes its own positions through whole experts
LLAMA_MOE = [*LLAMA, "--moe-expert-count", "4", "--moe-top-k", "2", "--moe-ffn-embed-dim", "128"]
VOCAB = 779  # odd: the vocabulary's rows split unevenly
MODELS = {"dense": LLAMA, "moe": LLAMA_MOE}


def _split_layer_rank(index, port, out):
    """One rank of a TP 2 group: the model (dense, and a mixture of experts) split as train
    splits it, its parameters' local elements, and the bytes the first layer's forward saves
    for backward (local storages, weights aside), in fp32 and in bf16."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from models.transformer_lm import build_model, rope_inverse_frequencies, rope_tables
    from trainer.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    result = {}
    for name, flags in MODELS.items():
        cfg = cfg_of("--task", "dummy_lm", "--dict-size", str(VOCAB), "--tokens-per-sample", str(SETUP.seq_len), *flags)
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

            shape = (SETUP.sequences, SETUP.seq_len, cfg.model.decoder_embed_dim)
            x = torch.randn(*shape, dtype=dtype, requires_grad=True)
            rope = rope_tables(rope_inverse_frequencies(cfg.model), 0, SETUP.seq_len, dtype)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model.layers[0](x, rope=rope)
            result[f"{name} {dtype}"] = {"params": sum(p.numel() for p in local), "saved": sum(saved.values())}
    # the embedding's backward (the model's last, fp32 here): the gradient it makes for this
    # rank's rows of the table
    model.embed_tokens(torch.randint(0, VOCAB, (2, 8))).sum().backward()
    result["embedding_grad_rows"] = model.embed_tokens.weight.grad.to_local().shape[0]
    dist.destroy_process_group()
    Path(f"{out}.{index}").write_text(json.dumps(result))


def test_a_tensor_parallel_rank_holds_and_saves_what_plan_counts(tmp_path):
    """On the real split model (trainer/parallel/tensor_parallel.py, 2 gloo ranks): a rank's
    parameters are tensor_parallel_share's count (its heads, width and vocabulary rows; norms
    whole), and a layer's forward saves what the ledger counts: the norms' inputs and rstd on
    the rank's positions (sequence parallelism), the projections' inputs gathered over all
    positions, the attention and feed-forward on the rank's heads and width; a mixture of
    experts' router and experts on the rank's own positions, its norm's output not gathered."""
    from helpers import run_ranks
    from trainer.rendezvous import free_port

    out = tmp_path / "ranks"
    run_ranks(_split_layer_rank, (free_port(), str(out)), 2)
    for name, flags in MODELS.items():
        cfg = cfg_of("--task", "dummy_lm", "--dict-size", str(VOCAB), *flags)
        shape = model_shape(cfg, VOCAB)
        share = tensor_parallel_share(shape, 2)
        for rank in range(2):
            got = json.loads(Path(f"{out}.{rank}").read_text())
            for precision, dtype in (("fp32", "torch.float32"), ("bf16", "torch.bfloat16")):
                setup = replace(SETUP, world=2, shard=1, tp=2, precision=precision)
                if rank == 0:  # the uneven vocabulary: rank 0 holds the larger share, which plan counts
                    assert got[f"{name} {dtype}"]["params"] == share.params
                sparse = shape.is_sparse(0)
                counted = layer_activation_bytes(share, setup, sparse=sparse) + rope_table_bytes(share, setup)
                assert got[f"{name} {dtype}"]["saved"] == counted, (name, rank, precision)
    cfg = cfg_of("--task", "dummy_lm", "--dict-size", str(VOCAB), *LLAMA)
    shape = model_shape(cfg, VOCAB)
    share = tensor_parallel_share(shape, 2)
    assert share.params < shape.params / 2 + shape.dim * 8  # about half: only norms are whole
    # the embedding's backward makes the gradient of the rank's own rows of the table only
    # (trainer/parallel/tensor_parallel.py's lookup; torch's RowwiseParallel made the whole
    # table's on every rank), the ledger's transient at the root's backward for a tied weight
    assert json.loads(Path(f"{out}.0").read_text())["embedding_grad_rows"] == share.vocab
    assert got["embedding_grad_rows"] == VOCAB - share.vocab


# A model whose activations outweigh its runtime on 2 and 4 CPU ranks (tests/test_plan_cli.py's
# measured run, Llama-shaped): fp32, no checkpointing, so every split activation counts.
MEASURED = (
    "--arch llama3_2_1b --decoder-layers 4 --decoder-embed-dim 384 --decoder-ffn-embed-dim 1024 "
    "--decoder-attention-heads 6 --decoder-kv-heads 2 --decoder-head-dim 64 --task dummy_lm --dict-size 8192 "
    "--tokens-per-sample 256 --batch-size 16 --ddp-backend fully_sharded"
).split()


@pytest.mark.parametrize(
    "world,layout",
    [(2, ["--model-parallel-size", "2"]), (4, ["--model-parallel-size", "2"]), (2, ["--context-parallel-size", "2"])],
    ids=["tp2", "fsdp2_tp2", "cp2"],
)
def test_prediction_matches_a_measured_tensor_parallel_run(world, layout, tmp_path, capsys):
    """Predicted vs measured peak resident memory per rank (mem_gb): TP 2 alone, FSDP 2 × TP 2,
    CP 2 (each rank half of every sequence, the keys and values gathered)."""
    model = MEASURED + layout + ["--distributed-world-size", str(world)]
    predicted = plan_json(capsys, *model, "--cpu")["per_rank_gb"]
    measured = measured_peak_gb(model, 2, tmp_path)
    print(f"world {world}, {' '.join(layout)}: predicted {predicted} GB, measured {measured} GB")
    assert predicted == pytest.approx(measured, rel=0.10)


def test_collectives_of_the_tensor_and_context_parallel_groups():
    """Per layer and micro-batch, TP's 2 all-gathers and 2 reduce-scatters of B×T×d in each
    forward (a checkpointed layer's forward runs twice) and their mirror in backward, with the
    embedding's all-reduce and the loss's gather and scatter; CP's gather of every position's
    K and V in each forward, and in backward again with their gradients' reduce-scatter.
    FSDP's traffic is of the rank's share of the model, over world / TP ranks."""
    from trainer.plan.comm import comm_bytes

    shape = model_shape(cfg_of("--task", "dummy_lm", "--dict-size", "1000", *LLAMA), 1000)
    tp2 = replace(SETUP, tp=2, shard=2, update_freq=2)
    share, hidden = tensor_parallel_share(shape, 2), SETUP.tokens * shape.dim * 4
    comm = comm_bytes(share, tp2)
    assert comm["tensor_parallel"] == pytest.approx(2 * (shape.layers * 8 * hidden + 4 * hidden) / 2)
    ckpt = comm_bytes(share, replace(tp2, checkpoint_activations=True))["tensor_parallel"]
    assert ckpt == pytest.approx(2 * (shape.layers * 12 * hidden + 4 * hidden) / 2)
    assert comm["all_gather"] == pytest.approx(2 * (share.params + share.layer_params) * 4 / 2)
    cp2 = replace(SETUP, cp=2)
    kv = 2 * SETUP.sequences * SETUP.seq_len * shape.kv * shape.hd * 4
    assert comm_bytes(shape, cp2)["context_parallel"] == pytest.approx(shape.layers * 3 * kv / 2)
    assert comm_bytes(shape, cp2)["tensor_parallel"] == comm_bytes(shape, SETUP)["context_parallel"] == 0
    # HSDP × TP: a shard group of 4 ranks holds 2 TP groups, so FSDP shards over 2, and 2 replicas all-reduce
    from trainer.plan.search import setup_of

    flags = ["--ddp-backend", "hybrid_shard", "--shard-group-size", "4", "--model-parallel-size", "2"]
    hsdp = setup_of(cfg_of(*LLAMA, "--distributed-world-size", "8", *flags), "cpu", 8)
    assert (hsdp.shard, hsdp.tp, hsdp.data_parallel) == (2, 2, 4)
    all_reduce = comm_bytes(share, hsdp)["all_reduce"]
    assert all_reduce == pytest.approx(2 * (share.params / 2) * 4 * 1 / 2)


def test_context_parallelism_splits_activations_not_states():
    """Each CP rank holds 1/cp of every sequence's positions: a layer saves half as much at
    cp 2; the parameters, replicated over CP, are sharded by FSDP over data × context ranks
    as before; the K/V gathers add a transient of every position's keys and values."""
    shape = model_shape(cfg_of("--task", "dummy_lm", "--dict-size", "1000", *LLAMA), 1000)
    cp2 = replace(SETUP, cp=2)
    assert layer_activation_bytes(shape, cp2) * 2 == layer_activation_bytes(shape, SETUP)
    one, two = predict(shape, SETUP), predict(shape, cp2)
    assert two.components["parameters"] == one.components["parameters"]
    assert two.components["activations"] < 0.6 * one.components["activations"]


def test_plan_takes_the_layout_flags_and_refuses_what_cannot_split(capsys):
    """plan --model-parallel-size / --context-parallel-size plan that layout; a degree that does
    not divide the world or the heads gets one line."""
    import cli

    run = ["--arch", "llama3_1_8b", "--bf16", "--ddp-backend", "fully_sharded", "--device-memory-gb", "80"]
    run += ["--distributed-world-size", "8", "--tokens-per-sample", "8192", "--batch-size", "1"]
    alone = plan_json(capsys, *run)
    tp = plan_json(capsys, *run, "--model-parallel-size", "2")
    cp = plan_json(capsys, *run, "--context-parallel-size", "2")
    assert tp["components"]["parameters"] == pytest.approx(alone["components"]["parameters"], rel=0.01)
    assert tp["components"]["activations"] < alone["components"]["activations"] / 1.5
    assert cp["components"]["activations"] < alone["components"]["activations"] / 1.9
    assert tp["comm_gb"]["tensor_parallel"] > 0 and cp["comm_gb"]["context_parallel"] > 0
    for flags, message in (
        (["--context-parallel-size", "3"], "must divide --distributed-world-size 8"),
        (["--model-parallel-size", "3"], "must divide --distributed-world-size 8"),
        # one key/value head over 8 ranks, 12 rows each of k and v: no equal shares
        (["--model-parallel-size", "8", "--decoder-kv-heads", "1", "--decoder-head-dim", "12"], "key/value heads"),
    ):
        assert cli.plan_main(run + flags) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


LLAMA_70B_ON_64 = ["--arch", "llama3_1_70b", "--bf16", "--ddp-backend", "fully_sharded", "--tokens-per-sample", "8192"]
LLAMA_70B_ON_64 += ["--distributed-world-size", "64", "--batch-size", "1"]


def test_the_search_tries_layouts_on_gpus_only_when_no_flag_set_fits_a_smaller_one(capsys):
    """On GPUs the search goes on to a larger tensor- or context-parallel group only when no
    flag set fits the smaller one, keeps the global batch (--update-freq rises as the
    data-parallel ranks fall), tries TP degrees that divide a node's 8 GPUs and the heads, and
    stops at the layout it chose."""
    from trainer.plan.search import choose, setup_of

    fits_alone = plan_json(capsys, *LLAMA_70B_ON_64, "--device-memory-gb", "80", "--host-memory-gb", "2048")
    assert fits_alone["recommended"] == "--checkpoint-activations"  # FSDP 64 fits: no layout tried
    assert not any("parallel-size" in c["flags"] for c in fits_alone["candidates"])
    p = plan_json(capsys, *LLAMA_70B_ON_64, "--device-memory-gb", "24", "--host-memory-gb", "2048")
    rec = p["recommended"].split()
    tp = int(rec[rec.index("--model-parallel-size") + 1]) if "--model-parallel-size" in rec else 1
    cp = int(rec[rec.index("--context-parallel-size") + 1]) if "--context-parallel-size" in rec else 1
    assert p["recommended_per_rank_gb"] <= 24 and tp * cp > 1 and 8 % tp == 0
    assert int(rec[rec.index("--update-freq") + 1]) * int(rec[rec.index("--batch-size") + 1]) == tp * cp
    smaller = [c for c in p["candidates"] if c["flags"].count("parallel-size") == 0]
    assert smaller and not any(c["fits"] for c in smaller)
    cfg = cfg_of("--task", "dummy_lm", "--dict-size", "128256", *LLAMA_70B_ON_64)
    shape = model_shape(cfg, 128256)
    cpu, _ = choose(shape, setup_of(cfg, "cpu", 64), 24, 2048)
    assert {(s.tp, s.cp) for _, s, _, _ in cpu} == {(1, 1)}  # CPU ranks keep the layout given
