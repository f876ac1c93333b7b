"""The planner on mixtures of experts (models/moe.py, trainer/parallel/experts.py;
trainer/plan/shapes.py's expert fields, activations.py's sparse layer, comm.py's
`expert_parallel`): the parameter count against the built model, what a sparse layer saves
for backward against autograd on the real layer, the exchanges counted, the EP degrees the
search tries on GPUs, predicted against measured peaks of an EP 2 and a TP 2 run, and the
parameters a rank holds under TP (× EP) against the real sharded model's."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from plan_helpers import SETUP, cfg_of, measured_peak_gb, plan_json, saved_for_backward_bytes
from test_plan_models import LLAMA_LAYER

import cli
from trainer.dryrun.command import planned_bytes
from trainer.plan.activations import layer_activation_bytes, rope_table_bytes
from trainer.plan.comm import comm_bytes
from trainer.plan.layouts import layouts
from trainer.plan.ledger import predict
from trainer.plan.search import model_shape

# The Llama layer at test size with 4 experts of width 128, 2 a token; --moe-freq 2 leaves
# the first of every two layers dense.
MOE = [*LLAMA_LAYER, "--moe-expert-count", "4", "--moe-top-k", "2", "--moe-ffn-embed-dim", "128"]
VOCAB = 777


def shape_of(*flags):
    return model_shape(cfg_of("--task", "dummy_lm", "--dict-size", str(VOCAB), *MOE, *flags), VOCAB)


@pytest.mark.parametrize("flags", [[], ["--decoder-layers", "4", "--moe-freq", "2", "--moe-norm-topk-prob"]])
def test_parameter_count_of_a_mixture_of_experts_is_the_models(flags):
    from models.transformer_lm import build_model, num_parameters

    cfg = cfg_of("--task", "dummy_lm", "--dict-size", str(VOCAB), "--tokens-per-sample", "64", *MOE, *flags)
    model = build_model(cfg.model, VOCAB, 64, device="meta")
    shape = model_shape(cfg, VOCAB)
    assert shape.params == num_parameters(model)
    assert shape.expert_params == 4 * 3 * 256 * 128


@pytest.mark.parametrize("norm_topk", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sparse_layer_saves_what_plan_counts(precision, norm_topk):
    """A sparse layer's forward on the real layer (one process: its own experts), the bytes
    autograd keeps (weights aside) against layer_activation_bytes(sparse=True): the router's
    fp32 probabilities, the index tensors, the sorted copies, the experts' hidden states and
    outputs. Dropless routing: N·k rows whichever experts are chosen."""
    import torch

    from models.transformer_lm import DecoderLayer, rope_inverse_frequencies, rope_tables

    flags = ["--tokens-per-sample", str(SETUP.seq_len)] + (["--moe-norm-topk-prob"] if norm_topk else [])
    cfg = cfg_of("--task", "dummy_lm", "--dict-size", str(VOCAB), *MOE, *flags)
    cfg.model.moe_norm_topk_prob = norm_topk
    shape = model_shape(cfg, VOCAB)
    setup = replace(SETUP, precision=precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    layer = DecoderLayer(cfg.model, sparse=True).to(dtype).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(setup.sequences, setup.seq_len, shape.dim, dtype=dtype, requires_grad=True)
    rope = rope_tables(rope_inverse_frequencies(cfg.model), 0, setup.seq_len, dtype)
    saved = saved_for_backward_bytes(layer, x, rope=rope)
    counted = layer_activation_bytes(shape, setup, sparse=True) + rope_table_bytes(shape, setup)
    # bf16 norms keep their mean and rstd in bf16, where the planner counts fp32: 8 bytes a token
    slack = 8 * setup.tokens if precision == "bf16" else 0
    assert saved == pytest.approx(counted, abs=slack)


# Two sparse layers whose activations outweigh the runtime (tests/test_plan_parallel.py's
# measured Llama, narrower): 8 experts of 512, 2 a token, fp32, no checkpointing.
MEASURED = (
    "--arch llama3_2_1b --decoder-layers 2 --decoder-embed-dim 384 --decoder-ffn-embed-dim 1024 "
    "--decoder-attention-heads 6 --decoder-kv-heads 2 --decoder-head-dim 64 --task dummy_lm --dict-size 8192 "
    "--tokens-per-sample 256 --batch-size 16 --moe-expert-count 8 --moe-top-k 2 --moe-ffn-embed-dim 512"
).split()


def test_prediction_matches_a_measured_expert_parallel_run(tmp_path, capsys):
    """Predicted vs measured peak resident memory per rank (mem_gb) at EP 2: each rank 4
    experts, the tokens exchanged; balanced routing is the prediction's, and a random
    router's is near it. (One process holding all the experts: by hand, docs/planning.md.)"""
    layout = ["--ddp-backend", "fully_sharded", "--distributed-world-size", "2", "--expert-parallel-size", "2"]
    model = MEASURED + layout
    predicted = plan_json(capsys, *model, "--cpu")["per_rank_gb"]
    measured = measured_peak_gb(model, 2, tmp_path)
    print(f"{' '.join(layout) or 'one process'}: predicted {predicted} GB, measured {measured} GB")
    assert predicted == pytest.approx(measured, rel=0.10)


def _held_rank(index, layouts, ports, out):
    """One of 2 ranks: for each layout, the model built and sharded as `train` builds it, and
    the elements of the parameters this rank holds."""
    from helpers import compose
    from trainer.parallel import ranks as distributed
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    held = []
    for argv, port in zip(layouts, ports):
        cfg = compose(argv)
        rdv = Rendezvous(f"tcp://127.0.0.1:{port}", 2, rank=index, local_rank=index, local_world_size=2)
        env = distributed.init_rank(cfg, rdv, needs_process_group=True)
        try:
            _, trainer, _ = build(cfg, env)
            local = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.model.parameters()]
            held.append(sum(p.numel() for p in local))
        finally:
            distributed.teardown()
    Path(f"{out}.{index}").write_text(json.dumps(held))


def test_a_rank_holds_the_parameters_plan_counts_under_tensor_parallelism(tmp_path):
    """The parameters rank 0 holds of the real sharded model (2 gloo ranks: its TP share of
    attention, norms and the odd vocabulary's rows; 1/2 of every router and expert, sharded
    over the TP ranks too), dense and sparse layers mixed, at TP 2 and at TP 2 × EP 2 (each
    rank 2 of the 4 experts), against plan's count (shapes.sharded_params)."""
    from helpers import run_ranks
    from trainer.plan.search import setup_of
    from trainer.plan.shapes import sharded_params, tensor_parallel_share
    from trainer.rendezvous import free_port

    model = ["--task", "dummy_lm", "--dict-size", str(VOCAB), "--tokens-per-sample", "64", "--batch-size", "2", *MOE]
    model += ["--decoder-layers", "4", "--moe-freq", "2", "--ddp-backend", "fully_sharded"]
    model += ["--distributed-world-size", "2", "--model-parallel-size", "2"]
    layouts = [model, model + ["--expert-parallel-size", "2"]]
    out = tmp_path / "held"
    run_ranks(_held_rank, (layouts, [free_port() for _ in layouts], str(out)), 2)
    held = json.loads(Path(f"{out}.0").read_text())
    for argv, got in zip(layouts, held):
        cfg = cfg_of(*argv)
        shape = model_shape(cfg, VOCAB)
        assert shape.sparse_layers == (1, 3)
        assert got == sharded_params(tensor_parallel_share(shape, 2), setup_of(cfg, "cpu", 2)), argv


def test_expert_parallel_exchanges_and_expert_units_are_counted():
    """Per sparse layer and micro-batch: 2 all-to-alls in forward (a checkpointed layer's
    forward runs twice) and 2 in backward, each the N·k×d rows' share leaving the rank; the
    experts' units gathered and reduced over shard / ep ranks, E/ep experts each, so FSDP's
    traffic falls and a rank's parameters stay 1/shard of the model."""
    shape = shape_of("--decoder-layers", "2")
    fsdp4 = replace(SETUP, update_freq=2)
    ep2 = replace(fsdp4, ep=2)
    rows = SETUP.tokens * 2 * shape.dim * 4
    assert comm_bytes(shape, ep2)["expert_parallel"] == pytest.approx(2 * 2 * 4 * rows / 2)
    ckpt = comm_bytes(shape, replace(ep2, checkpoint_activations=True))["expert_parallel"]
    assert ckpt == pytest.approx(2 * 2 * 6 * rows / 2)
    assert comm_bytes(shape, fsdp4)["expert_parallel"] == 0
    # per micro-batch (2): in their layers' units, 3 gathers of a layer's experts (layer 0
    # again in backward), over 4 ranks, 3/4 of E experts from the others; at EP 2, units of
    # their own, resharded after forward in the last layer too, 4 gathers over 2 ranks, 1/2 of E/2
    experts = 2 * shape.expert_params * 4
    saved = comm_bytes(shape, fsdp4)["all_gather"] - comm_bytes(shape, ep2)["all_gather"]
    assert saved == pytest.approx(experts * (3 * 3 / 4 - 4 * 1 / 4))
    assert predict(shape, ep2).components["parameters"] == predict(shape, fsdp4).components["parameters"]


def test_the_search_tries_expert_parallel_degrees_on_gpus(capsys):
    """On GPUs a mixture of experts' layouts are the TP degrees a dense model's are, each with
    the EP degrees that divide a node's GPUs, the experts and the ranks the mixture is sharded
    over (no CP); fewest TP ranks first, then fewest bytes received; the choice is written as
    --expert-parallel-size, and the report states the routing it assumes and the worst case.
    Every optimizer runs under EP: Adafactor's search tries the same degrees."""
    shape = shape_of("--decoder-layers", "2")
    gpus = replace(SETUP, device="cuda", world=16, ranks_per_host=8, shard=16, precision="bf16")
    got = layouts(shape, gpus)
    # TP 1, 2, 4 (4 heads; TP 8 does not divide them) × EP 1, 2, 4 (4 experts: 8 does not divide them)
    both = {(t, e) for t in (1, 2, 4) for e in (1, 2, 4)}
    assert {(o.tp, o.ep) for o in got} == both
    assert all(o.cp == 1 for o in got) and [o.tp for o in got] == sorted(o.tp for o in got)
    assert {(o.tp, o.ep) for o in layouts(shape, replace(gpus, optimizer="adafactor"))} == both
    assert {(o.tp, o.ep) for o in layouts(shape, replace(gpus, model_parallel_ok=False))} == {(1, 1), (1, 2), (1, 4)}
    assert [o.ep for o in layouts(shape, replace(gpus, device="cpu"))] == [1]
    # docs/planning.md's question: qwen3_moe_30b_a3b on 8 × 80 GB
    argv = ["--arch", "qwen3_moe_30b_a3b", "--bf16", "--ddp-backend", "fully_sharded", "--distributed-world-size", "8"]
    argv += ["--tokens-per-sample", "4096", "--batch-size", "1", "--device-memory-gb", "80"]
    plan = plan_json(capsys, *argv)
    assert plan["recommended"] == "--expert-parallel-size 8 --checkpoint-activations"
    assert not plan["fits"] and plan["recommended_per_rank_gb"] < 80
    assert plan["expert_rows"] == {"balanced": 4096 * 8, "worst_case": 4096 * 8}  # as given: EP 1
    assert cli.plan_main(argv + ["--expert-parallel-size", "4"]) == 0
    text = capsys.readouterr().out
    assert "predicted at balanced routing" in text and "at worst every token of the EP group" in text


def test_the_dry_run_prints_plans_prediction_for_a_mixture_of_experts():
    """The dry run's last line (trainer/dryrun/command.py planned_bytes): plan's ledger for
    the mixture on GPUs, EP 4 of 8 ranks, no longer a refusal; EP changes it (fewer experts
    gathered, the exchanges' buffers: at this size the buffers weigh more)."""

    argv = ["--task", "dummy_lm", "--dict-size", str(VOCAB), *MOE, "--bf16", "--batch-size", "2"]
    argv += ["--ddp-backend", "fully_sharded", "--distributed-world-size", "8"]
    ep4, _ = planned_bytes(cfg_of(*argv, "--expert-parallel-size", "4"))
    ep1, _ = planned_bytes(cfg_of(*argv))
    assert ep4 > ep1 > 0
