"""The memory planner: each component's arithmetic, the published cases (fairseq's README,
the FSDP paper), the `plan` command, `train --auto-tune`, and one prediction against a
measured run. bench/bench_plan.py compares predictions with measurements on more."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import cli
from models import chunks
from models.chunks import loss_chunk_rows
from trainer.config.compose import compose_config
from trainer.plan.ledger import GB, ModelShape, Setup, comm_bytes, layer_activation_bytes, predict, simulate
from trainer.plan.search import model_shape

BIN = Path(sys.executable).parent
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


@pytest.mark.parametrize(
    "flags",
    [
        ["--arch", "transformer_lm_gpt2_tiny"],
        ["--decoder-learned-pos", "--share-decoder-input-output-embed", "--activation-fn", "gelu"],
        ["--no-token-positional-embeddings", "--layernorm-embedding", "--no-decoder-final-norm"],
        [
            "--decoder-layers",
            "3",
            "--decoder-embed-dim",
            "96",
            "--decoder-ffn-embed-dim",
            "200",
            "--decoder-attention-heads",
            "3",
            "--max-target-positions",
            "300",
            "--decoder-learned-pos",
        ],
        [
            "--scale-attn",
            "--scale-fc",
            "--scale-heads",
            "--scale-resids",
            "--decoder-input-dim",
            "48",
            "--decoder-output-dim",
            "80",
            "--decoder-layers",
            "3",
            "--decoder-layers-to-keep",
            "0,2",
        ],
        ["--share-decoder-input-output-embed", "--decoder-input-dim", "48", "--decoder-output-dim", "48"],
        ["--quant-noise-pq", "0.1"],  # fairseq's quant_noise layer on the embeddings
    ],
)
def test_parameter_count_is_the_models(flags):
    from models.transformer_lm import build_model, num_parameters

    cfg = cfg_of("--task", "dummy_lm", "--dict-size", "777", "--tokens-per-sample", "64", *flags)
    model = build_model(cfg.model, 777, cfg.model.max_target_positions or 64, device="meta")
    assert model_shape(cfg, 777).params == num_parameters(model)


def test_states_are_sharded_and_offloaded():
    P = SHAPE.params
    p = predict(SHAPE, SETUP)
    assert p.components["parameters"] == round(4 * P / 4 / GB, 3)
    assert p.components["optimizer_state"] == round(8 * P / 4 / GB, 3)
    sgd = predict(SHAPE, replace(SETUP, optimizer_states=0))
    assert sgd.components["optimizer_state"] == 0 and sgd.per_rank_gb < p.per_rank_gb
    # --cpu-offload on a GPU: parameters, gradients and optimizer state move to the host
    gpu = replace(SETUP, device="cuda", cpu_offload=True, ranks_per_host=2)
    q = predict(SHAPE, gpu)
    assert q.components["parameters"] == q.components["optimizer_state"] == q.components["gradients"] == 0
    host = 2 * (16 * P / 4 / GB + 3.0)  # two ranks' states + their processes' own memory
    assert q.host_gb == pytest.approx(host, abs=0.002)
    # on a CPU the device is the host: nothing moves
    assert predict(SHAPE, replace(SETUP, cpu_offload=True)).per_rank_gb == p.per_rank_gb


def test_ddp_keeps_gradients_twice():
    big = replace(SHAPE, layers=24)  # gradients outweigh the activations: the peak ends backward
    ddp = replace(SETUP, backend="pytorch_ddp", shard=1, world=2, sequences=1, seq_len=16)
    p = predict(big, ddp)
    # grads + buckets, and at the very end the embedding's own dense gradient of the tied
    # weight, before it is added into the one the loss made
    tied_grad = 4 * big.vocab * big.dim
    assert p.components["gradients"] == pytest.approx(round((8 * big.params + tied_grad) / GB, 3), abs=0.002)
    assert predict(big, replace(ddp, world=1)).components["gradients"] == pytest.approx(
        round((4 * big.params + tied_grad) / GB, 3), abs=0.002
    )
    untied = replace(big, tied=False)
    assert predict(untied, ddp).components["gradients"] == pytest.approx(round(8 * untied.params / GB, 3), abs=0.002)


def test_loss_arithmetic():
    """The loss keeps grad_x (compute dtype) and W's fp32 gradient, and for a moment holds one
    chunk of fp32 logits with, under mixed precision, their low-precision product and W's
    gradient in low precision (models/linear_cross_entropy.py; tests/test_loss.py measures it)."""
    n, V, d = SETUP.sequences * SETUP.seq_len, SHAPE.vocab, SHAPE.dim
    rows = min(n, loss_chunk_rows(V, "cpu"))
    fp32 = simulate(SHAPE, SETUP)[0].most["logits_and_loss"]
    assert fp32 == n * d * 4 + V * d * 4 + rows * V * 4
    bf16 = simulate(SHAPE, replace(SETUP, precision="bf16"))[0].most["logits_and_loss"]
    assert bf16 == n * d * 2 + V * d * 4 + rows * V * (4 + 2) + V * d * 2


def test_the_planner_follows_the_kernels_chunk_sizes(monkeypatch):
    """The loss's and a CPU attention's chunk sizes live in models/chunks.py, which the
    kernels and the planner both read: change one and the prediction moves with it, the
    loss's GPU size for a GPU's setup and its CPU size for a CPU's."""
    shape = replace(SHAPE, vocab=50_000)  # the loss takes several chunks of rows
    n, V, rows = SETUP.sequences * SETUP.seq_len, shape.vocab, loss_chunk_rows(shape.vocab, "cpu")
    assert rows < n
    before = simulate(shape, SETUP)[0].most["logits_and_loss"]
    monkeypatch.setattr(chunks, "LOSS_CHUNK_BYTES", chunks.LOSS_CHUNK_BYTES // 4)
    assert loss_chunk_rows(V, "cpu") == rows // 4
    assert before - simulate(shape, SETUP)[0].most["logits_and_loss"] == (rows - rows // 4) * V * 4
    # a GPU's chunk has a size of its own: all 512 rows here, then 100 when it is made smaller
    gpu, cpu = replace(SETUP, device="cuda"), simulate(shape, SETUP)[0].most["logits_and_loss"]
    assert loss_chunk_rows(V, "cuda") > n
    before = simulate(shape, gpu)[0].most["logits_and_loss"]
    monkeypatch.setattr(chunks, "LOSS_CHUNK_BYTES_GPU", 4 * V * 100)
    assert before - simulate(shape, gpu)[0].most["logits_and_loss"] == (n - 100) * V * 4
    assert simulate(shape, SETUP)[0].most["logits_and_loss"] == cpu
    # a CPU's bf16 attention, 4 sequences × 4 heads of 1024² scores: 4 heads a chunk, then all 16
    bf16 = replace(SETUP, precision="bf16", seq_len=1024)
    before = simulate(SHAPE, bf16)[0].most["activations"]
    monkeypatch.setattr(chunks, "ATTENTION_SCORES_BYTES", chunks.ATTENTION_SCORES_BYTES * 4)
    assert simulate(SHAPE, bf16)[0].most["activations"] - before == 3 * (16 - 4) * 1024**2 * 2


def test_the_planner_reads_checkpointing_as_composition_resolved_it():
    """One rule (trainer/config/implied.py) makes --offload-activations imply checkpointing:
    in the composed config the planner reads, and in every candidate its search builds."""
    from trainer.plan.search import flag_sets, flags_of, setup_of

    given = setup_of(cfg_of("--offload-activations", "--ddp-backend", "fully_sharded"), "cuda", 8)
    assert given.checkpoint_activations and given.offload_activations
    for label, s in flag_sets(replace(given, offload_activations=False, checkpoint_activations=False)):
        assert s.checkpoint_activations or not s.offload_activations, label
        if s.offload_activations:  # the flag the user adds implies the other
            assert "--checkpoint-activations" not in flags_of(s, SETUP), label
    assert "--checkpoint-activations" in flags_of(replace(SETUP, checkpoint_activations=True), SETUP)
    # --auto-tune writes its choice into the composed config: as resolved, the implied flag set
    from trainer.launch.auto_tune import apply_choice

    cfg = cfg_of("--ddp-backend", "fully_sharded")
    offload = next(s for label, s in flag_sets(setup_of(cfg, "cuda", 8)) if label == "+ offload activations")
    model = apply_choice(cfg, offload).model
    assert model.offload_activations and model.checkpoint_activations


def test_activation_arithmetic():
    n, d, f, h = 4 * 128, 256, 1024, 4
    assert layer_activation_bytes(SHAPE, SETUP) == n * (4 * (8 * d + 2 * f) + 16 + 4 * h)
    relu = replace(SHAPE, activation_fn="relu")  # relu's output is both its and fc2's saved tensor
    assert layer_activation_bytes(SHAPE, SETUP) - layer_activation_bytes(relu, SETUP) == n * f * 4
    bf16 = replace(SETUP, precision="bf16")
    # a CPU's bf16 attention (models/cpu_attention.py) keeps no log-sum-exp; CUDA's flash kernel does
    assert layer_activation_bytes(SHAPE, bf16) == n * (2 * (8 * d + 2 * f) + 16)
    assert layer_activation_bytes(SHAPE, replace(bf16, device="cuda")) == n * (2 * (8 * d + 2 * f) + 16 + 4 * h)
    full = at_peak(SHAPE, SETUP, "activations")
    ckpt = at_peak(SHAPE, replace(SETUP, checkpoint_activations=True), "activations")
    # checkpointing keeps each layer's input, plus one layer recomputed at a time and, at
    # its first backward node, the gradient coming in and the one fc2 makes
    assert ckpt <= SHAPE.layers * n * d * 4 + layer_activation_bytes(SHAPE, SETUP) - n * d * 4 + n * (d + f) * 4
    assert ckpt < full / 2


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"activation_fn": "relu"},
        {"dropout": 0.1},
        {"activation_dropout": 0.1},
        {"activation_fn": "relu", "activation_dropout": 0.1},
        {"attention_dropout": 0.1},
        {"precision": "bf16"},
        {"precision": "bf16", "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1},
        {"normalize_before": False},
        {"pq_noise": True},
        {"precision": "bf16", "pq_noise": True},
        {"scalar_noise": True, "activation_fn": "relu"},
        {"precision": "bf16", "pq_noise": True, "scalar_noise": True},
    ],
)
def test_activation_bytes_are_what_autograd_saves_on_the_real_layer(variant):
    """The planner's count of one layer's saved activations against the tensors autograd
    actually saves for backward on models/transformer_lm.py's DecoderLayer (its input
    included, parameters not; storages shared by views counted once)."""
    import torch
    from omegaconf import OmegaConf

    from models.transformer_lm import DecoderLayer

    v = dict(variant)
    precision, pre_ln = v.pop("precision", "fp32"), v.pop("normalize_before", True)
    shape = replace(SHAPE, **v)
    cfg = OmegaConf.create(
        dict(
            decoder_embed_dim=shape.dim,
            decoder_ffn_embed_dim=shape.ffn,
            decoder_attention_heads=shape.heads,
            decoder_normalize_before=pre_ln,
            activation_fn=shape.activation_fn,
            dropout=shape.dropout,
            attention_dropout=shape.attention_dropout,
            activation_dropout=shape.activation_dropout,
            quant_noise_pq=0.1 if shape.pq_noise else 0.0,
            quant_noise_pq_block_size=8,
            quant_noise_scalar=0.5 if shape.scalar_noise else 0.0,
        )
    )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layer = DecoderLayer(cfg).to(dtype).train()
    x = torch.randn(SETUP.sequences, SETUP.seq_len, shape.dim, dtype=dtype, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    # bf16 norms keep their mean and rstd in bf16, where the planner counts fp32: 8 bytes a token
    slack = 8 * SETUP.tokens if precision == "bf16" else 0
    assert sum(saved.values()) == pytest.approx(
        layer_activation_bytes(shape, replace(SETUP, precision=precision)), abs=slack
    )


def test_gathered_layers_and_prefetch():
    c = SETUP.compute_bytes
    reshard = at_peak(SHAPE, SETUP, "gathered_parameters")
    keep = at_peak(SHAPE, replace(SETUP, reshard_after_forward=False), "gathered_parameters")
    # resharding: the root and one layer; no resharding: the root and every layer by the end of forward
    assert reshard == pytest.approx((SHAPE.root_params + SHAPE.layer_params) * c, rel=1e-3)
    assert keep == pytest.approx((SHAPE.root_params + SHAPE.layers * SHAPE.layer_params) * c, rel=1e-3)
    gpu = simulate(SHAPE, replace(SETUP, device="cuda"))[0].most["gathered_parameters"]
    assert gpu == pytest.approx((SHAPE.root_params + 2 * SHAPE.layer_params) * c, rel=1e-3)  # + the prefetched one


def test_communication_bytes():
    P, Pl, L, c = SHAPE.params, SHAPE.layer_params, SHAPE.layers, 4
    comm = comm_bytes(SHAPE, SETUP)
    assert comm["all_gather"] == pytest.approx((P + (L - 1) * Pl) * c * 3 / 4)  # backward re-gathers all but the last
    assert comm["reduce_scatter"] == pytest.approx(P * c * 3 / 4)
    assert comm_bytes(SHAPE, replace(SETUP, reshard_after_forward=False))["all_gather"] == pytest.approx(P * c * 3 / 4)
    uf = replace(SETUP, update_freq=4)
    assert comm_bytes(SHAPE, uf)["reduce_scatter"] == pytest.approx(4 * P * c * 3 / 4)
    assert comm_bytes(SHAPE, replace(uf, defer_grad_sync=True))["reduce_scatter"] == pytest.approx(P * c * 3 / 4)
    ddp = comm_bytes(SHAPE, replace(SETUP, backend="pytorch_ddp", shard=1))
    all_reduce = pytest.approx(2 * P * 4 * 3 / 4)
    assert ddp == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": all_reduce, "all_to_all": 0}
    hybrid = comm_bytes(SHAPE, replace(SETUP, backend="hybrid_shard", shard=2))
    assert hybrid["all_reduce"] == pytest.approx(2 * (P / 2) * 4 * 1 / 2)
    assert sum(comm_bytes(SHAPE, replace(SETUP, world=1, shard=1)).values()) == 0


GPT3_13 = [
    "--task",
    "dummy_lm",
    "--dict-size",
    "50272",
    "--arch",
    "transformer_lm_gpt3_13",
    "--tokens-per-sample",
    "2048",
    "--fp16",
    "--ddp-backend",
    "fully_sharded",
]


def test_fairseq_readme_13b_on_8_v100s_fits_at_batch_1_with_checkpointing(capsys):
    """fairseq's FSDP README: transformer_lm_gpt3_13 on 8 x 32 GB V100 without offload fits at batch 1."""
    argv = GPT3_13 + [
        "--distributed-world-size",
        "8",
        "--device-memory-gb",
        "32",
        "--host-memory-gb",
        "512",
        "--batch-size",
        "1",
    ]
    ckpt = plan_json(capsys, *argv, "--checkpoint-activations")
    assert ckpt["fits"] and 24 < ckpt["per_rank_gb"] < 32  # fits, with little to spare
    # 16 bytes per parameter (fp32 shard, gradient, Adam's two moments) over 8 ranks: 24 GiB of 32
    assert ckpt["components"]["parameters"] + ckpt["components"]["optimizer_state"] == pytest.approx(
        12 * 12_853_463_040 / 8 / GB, abs=0.01
    )
    plain = plan_json(capsys, *argv)
    assert not plain["fits"] and plain["recommended"] == "--checkpoint-activations"
    assert not plan_json(capsys, *argv[:-1], "4", "--checkpoint-activations", "--distributed-world-size", "4")["fits"]


def test_fairseq_readme_13b_on_one_v100_needs_cpu_offload_and_256gb_host(capsys):
    argv = GPT3_13 + ["--checkpoint-activations", "--batch-size", "8", "--device-memory-gb", "32"]
    one = plan_json(capsys, *argv, "--host-memory-gb", "256")
    assert not one["fits"] and one["recommended"] == "--cpu-offload"
    offload = plan_json(capsys, *argv, "--host-memory-gb", "256", "--cpu-offload")
    assert offload["fits"] and 180 < offload["host_gb"] <= 256  # "about 256 GB of system RAM"
    assert plan_json(capsys, *argv, "--host-memory-gb", "128")["recommended"] is None  # nothing fits


def test_fsdp_paper_175b_on_128_a100s_full_shard_checkpointing_bf16(capsys):
    """FSDP paper (Zhao et al., 2023): GPT-175B on 128 x 80 GB A100, full sharding, checkpointing, bf16."""
    argv = [
        "--task",
        "dummy_lm",
        "--dict-size",
        "50272",
        "--arch",
        "transformer_lm_gpt3_175",
        "--tokens-per-sample",
        "2048",
        "--batch-size",
        "1",
        "--bf16",
        "--device-memory-gb",
        "80",
        "--host-memory-gb",
        "1024",
    ]
    fsdp = plan_json(capsys, *argv, "--ddp-backend", "fully_sharded", "--distributed-world-size", "128")
    assert not fsdp["fits"] and fsdp["recommended"] == "--checkpoint-activations"
    assert fsdp["candidates"][0]["flags"] == "--no-reshard-after-forward" and not fsdp["candidates"][0]["fits"]
    ddp = plan_json(capsys, *argv, "--distributed-world-size", "128")
    assert ddp["per_rank_gb"] > 2000 and ddp["recommended"] == "--ddp-backend fully_sharded --checkpoint-activations"
    eight = plan_json(capsys, *argv, "--ddp-backend", "fully_sharded", "--distributed-world-size", "8")
    assert eight["recommended"] is None  # 2.8 TB of states: not on one host of 1 TB


def test_planning_other_gpus_does_not_judge_their_host_by_this_ones_ram(capsys, monkeypatch):
    """--device-memory-gb plans a machine `plan` cannot see: without --host-memory-gb its host
    memory is reported, not checked against this machine's RAM (the 13B's offloaded states
    need ~230 GB on the GPUs' host, more than a laptop or CI runner has)."""
    import trainer.host

    argv = GPT3_13 + [
        "--distributed-world-size",
        "8",
        "--device-memory-gb",
        "80",
        "--batch-size",
        "1",
        "--checkpoint-activations",
        "--cpu-offload",
    ]
    answers = []
    for ram_here in (16.0, 4096.0):
        monkeypatch.setattr(trainer.host, "host_memory_gb", lambda ram_here=ram_here: ram_here)
        answers.append(plan_json(capsys, *argv))
    assert answers[0] == answers[1]  # the same answer whatever this host has
    p = answers[0]
    assert p["fits"] and p["host_gb"] > 200 and p["host_memory_gb"] is None and not p["host_memory_checked"]
    assert cli.plan_main(argv) == 0
    assert "host memory per host" in (text := capsys.readouterr().out) and "not checked" in text
    given = plan_json(capsys, *argv, "--host-memory-gb", "128")  # given, it is checked
    assert not given["fits"] and given["host_memory_checked"]


def test_plan_json_and_text(capsys):
    argv = [
        "--task",
        "dummy_lm",
        "--dict-size",
        "1000",
        "--arch",
        "transformer_lm_gpt2_tiny",
        "--batch-size",
        "4",
        "--tokens-per-sample",
        "64",
        "--cpu",
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
    ]
    p = plan_json(capsys, *argv)
    assert {"fits", "per_rank_gb", "host_gb", "components", "comm_gb_per_update", "recommended"} <= set(p)
    assert sum(p["components"].values()) == pytest.approx(p["per_rank_gb"], abs=0.01)
    assert p["host_gb"] == pytest.approx(2 * p["per_rank_gb"], abs=0.002)  # a CPU host holds its two ranks
    assert cli.plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "gathered layers" in text and "recommended:" in text and "all-gather" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device-memory-gb", "-1"], "must be a positive number"),
        (["--format", "yaml"], "invalid choice"),
        (["--decoder-layrs", "2"], "did you mean --decoder-layers"),
        (["/no/such/data", "--batch-size", "2"], "does not exist"),
    ],
)
def test_plan_bad_input_is_one_line(argv, message):
    r = subprocess.run([str(BIN / "plan"), "--cpu"] + argv, capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_train_auto_tune_picks_what_fits_and_trains_with_it(tmp_path, capsys):
    """A budget below the plan as given: train --auto-tune prints the flags `plan` recommends
    for that budget, saves a config that has them, and trains."""
    model = [
        "--task",
        "dummy_lm",
        "--dict-size",
        "2000",
        "--tokens-per-sample",
        "128",
        "--batch-size",
        "8",
        "--decoder-layers",
        "4",
        "--decoder-embed-dim",
        "128",
        "--decoder-ffn-embed-dim",
        "512",
        "--decoder-attention-heads",
        "4",
        "--dropout",
        "0",
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--cpu",
    ]
    p = plan_json(capsys, *model)
    plain, ckpt = (c["per_rank_gb"] for c in p["candidates"][1:3])
    budget = round((plain + ckpt) / 2, 3)
    expected = plan_json(capsys, *model, "--device-memory-gb", str(budget))
    assert not expected["fits"] and expected["recommended"] and expected["recommended_per_rank_gb"] <= budget
    r = subprocess.run(
        [str(BIN / "train")]
        + model
        + [
            "--auto-tune",
            "--memory-budget-gb",
            str(budget),
            "--max-update",
            "3",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--disable-validation",
            "--save-dir",
            str(tmp_path / "ck"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert (
        f"auto-tune: {expected['recommended']} (predicted {expected['recommended_per_rank_gb']:.2f} GB per rank "
        f"of a {budget:.2f} GB budget"
    ) in r.stderr
    saved = (tmp_path / "ck" / "config.yaml").read_text()
    rec = expected["recommended"]
    assert ("no_reshard_after_forward: true" in saved) == ("--no-reshard-after-forward" in rec)
    assert ("checkpoint_activations: true" in saved) == ("--checkpoint-activations" in rec)
    if "--batch-size" in rec:  # the global batch stays: 8 sequences per rank per update
        b, uf = int(rec.split("--batch-size ")[1].split()[0]), int(rec.split("--update-freq ")[1].split()[0])
        assert b * uf == 8 and f"batch_size: {b}" in saved and f"update_freq: {uf}" in saved
    assert '"num_updates": 3' in r.stdout + r.stderr


def test_prediction_matches_a_measured_run(tmp_path, capsys):
    """Predicted vs measured peak resident memory per rank (bench/bench_plan.py does more
    configurations): 2 FSDP ranks with checkpointing, activations larger than the model."""
    model = [
        "--task",
        "dummy_lm",
        "--dict-size",
        "8192",
        "--tokens-per-sample",
        "256",
        "--batch-size",
        "16",
        "--decoder-layers",
        "4",
        "--decoder-embed-dim",
        "384",
        "--decoder-ffn-embed-dim",
        "1536",
        "--decoder-attention-heads",
        "6",
        "--decoder-learned-pos",
        "--share-decoder-input-output-embed",
        "--activation-fn",
        "gelu",
        "--dropout",
        "0",
        "--ddp-backend",
        "fully_sharded",
        "--distributed-world-size",
        "2",
        "--checkpoint-activations",
    ]
    predicted = plan_json(capsys, *model, "--cpu")["per_rank_gb"]
    r = subprocess.run(
        [str(BIN / "train")]
        + model
        + ["--max-update", "3", "--no-save", "--disable-validation", "--log-format", "json", "--log-interval", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    measured = max(
        json.loads(line[line.index("{") :])["mem_gb"] for line in r.stdout.splitlines() if "| train_inner |" in line
    )
    assert predicted == pytest.approx(measured, rel=0.10)


def test_deferred_gradient_sync_keeps_every_unsharded_gradient():
    """--defer-grad-sync: no reduce-scatter before the last micro-batch, so every unit's
    unsharded gradient is alive at once (in the reduce dtype), and the sharded gradients
    appear only in the last micro-batch."""
    uf2 = replace(SETUP, update_freq=2)
    deferred = simulate(SHAPE, replace(uf2, defer_grad_sync=True))[0]
    assert deferred.most["unsharded_gradients"] >= SHAPE.params * 4
    assert simulate(SHAPE, uf2)[0].most["unsharded_gradients"] < SHAPE.params * 4
    bf16 = replace(uf2, defer_grad_sync=True, precision="bf16", fp32_reduce_scatter=True)
    assert simulate(SHAPE, bf16)[0].most["unsharded_gradients"] >= SHAPE.params * 4  # kept in fp32
    assert predict(SHAPE, replace(uf2, defer_grad_sync=True)).per_rank_gb > predict(SHAPE, uf2).per_rank_gb


def test_runtime_of_spawned_ranks_and_of_a_process_of_its_own():
    """Local ranks are forked by the launcher and start smaller than a process that imports
    torch itself (one rank, or --distributed-no-spawn)."""
    from trainer.plan.search import setup_of

    assert setup_of(cfg_of("--distributed-world-size", "2", "--batch-size", "4"), "cpu", 2).spawned
    assert not setup_of(cfg_of("--batch-size", "4"), "cpu", 1).spawned
    assert not setup_of(
        cfg_of(
            "--distributed-world-size",
            "2",
            "--distributed-no-spawn",
            "--distributed-init-method",
            "tcp://127.0.0.1:29500",
            "--batch-size",
            "4",
        ),
        "cpu",
        2,
    ).spawned
    own, spawned = predict(SHAPE, SETUP), predict(SHAPE, replace(SETUP, spawned=True))
    assert own.components["runtime"] - spawned.components["runtime"] == pytest.approx(0.045, abs=0.001)


@pytest.mark.parametrize("scores_bytes", [None, 4 * 128 * 128 * 2])  # default: one chunk; then 4 of 16 heads
def test_cpu_attention_backward_holds_what_plan_counts(monkeypatch, scores_bytes):
    """The T×T tensors alive at once in the backward of models/cpu_attention.py, tracked op
    by op (storages counted once), against plan's count for the same layer."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    import models.cpu_attention as cpu_attention
    import trainer.plan.ledger as memory_plan

    if scores_bytes:  # one number, read by the kernel and the planner alike
        monkeypatch.setattr(chunks, "ATTENTION_SCORES_BYTES", scores_bytes)
    B, H, T = SETUP.sequences, SHAPE.heads, SETUP.seq_len

    class SquareTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.peak = [], 0  # weak references (a WeakSet would compare tensors)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.live += [
                weakref.ref(t)
                for t in tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[-2:] == (T, T)
            ]
            alive = [t for t in (ref() for ref in self.live) if t is not None]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
            self.peak = max(self.peak, sum(storages.values()))
            return out

    q, k, v = [torch.randn(B, H, T, SHAPE.dim // H).to(torch.bfloat16).requires_grad_() for _ in range(3)]
    out = cpu_attention.causal_matmul_attention(q, k, v)
    grad = torch.randn_like(out)
    with SquareTensors() as tracked:
        out.backward(grad)
    bf16 = replace(SETUP, precision="bf16")
    assert tracked.peak == memory_plan.cpu_attention_backward_bytes(SHAPE, bf16) > 0
    assert memory_plan.cpu_attention_backward_bytes(SHAPE, replace(bf16, device="cuda")) == 0
    assert memory_plan.cpu_attention_backward_bytes(SHAPE, SETUP) == 0  # fp32: SDPA


# The Llama family's layer at test size: 4 query heads over 2 kv heads, RoPE, SwiGLU, no
# biases, RMSNorm; Qwen3's also with q/k norms and heads wider than dim / heads.
LLAMA_LAYER = [
    "--arch",
    "llama3_2_1b",
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
QWEN3_LAYER = [
    "--arch",
    "qwen3_0_6b",
    "--decoder-embed-dim",
    "256",
    "--decoder-ffn-embed-dim",
    "688",
    "--decoder-attention-heads",
    "4",
    "--decoder-kv-heads",
    "2",
    "--decoder-head-dim",
    "96",
]


@pytest.mark.parametrize(
    "flags",
    [
        LLAMA_LAYER,
        QWEN3_LAYER,
        ["--arch", "llama3_1_8b"],
        ["--arch", "qwen3_8b"],
        LLAMA_LAYER + ["--norm-type", "layernorm", "--scale-attn", "--scale-fc"],
        LLAMA_LAYER + ["--no-bias", "false", "--decoder-layers", "3"],
    ],
)
def test_parameter_count_of_the_llama_family_is_the_models(flags):
    from models.transformer_lm import build_model, num_parameters

    cfg = cfg_of("--task", "dummy_lm", "--dict-size", "777", "--tokens-per-sample", "64", *flags)
    model = build_model(cfg.model, 777, 64, device="meta")
    assert model_shape(cfg, 777).params == num_parameters(model)


@pytest.mark.parametrize("flags", [LLAMA_LAYER, QWEN3_LAYER])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
def test_llama_family_activation_bytes_are_what_autograd_saves_on_the_real_layer(flags, precision):
    """As above, on the Llama and Qwen3 layers: RMSNorm (a CPU's composite), GQA (SDPA with
    enable_gqa in fp32, the repeated kv heads of the CPU's bf16 attention), RoPE's tables and
    rotated q/k, Qwen3's q/k norms, the gated FFN, no biases; bf16 as FSDP runs it (the
    layer in bf16), autocast as DDP does (its weight copies are the planner's
    mixed_precision_copies, not activations)."""
    import torch

    from models.transformer_lm import DecoderLayer, rope_inverse_frequencies, rope_tables
    from trainer.plan.ledger import rope_table_bytes

    cfg = cfg_of("--task", "dummy_lm", "--dict-size", "777", "--tokens-per-sample", str(SETUP.seq_len), *flags)
    shape = model_shape(cfg, 777)
    autocast = precision == "autocast"
    setup = replace(
        SETUP,
        precision="fp32" if precision == "fp32" else "bf16",
        **(dict(backend="pytorch_ddp", shard=1) if autocast else {}),
    )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layer = DecoderLayer(cfg.model).to(dtype).train()
    x = torch.randn(setup.sequences, setup.seq_len, shape.dim, dtype=dtype, requires_grad=True)
    rope = rope_tables(rope_inverse_frequencies(cfg.model), 0, setup.seq_len, dtype)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    weight_copies = {tuple(p.shape[::-1]) for p in layer.parameters() if p.dim() == 2}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and not (autocast and tuple(t.shape) in weight_copies):
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        layer(x, rope=rope)
    # the rope tables are the model's, one pair for all layers: the ledger counts them once
    assert sum(saved.values()) == layer_activation_bytes(shape, setup) + rope_table_bytes(shape, setup)


def test_flops_per_token_is_the_count_of_the_matmuls_of_grouped_query_attention():
    """MFU's FLOPs (trainer/train/meters.py) on Qwen3's layer, 4 query heads of 96 over 2 kv
    heads (H·head_dim ≠ d): 3× the forward's matmul FLOPs, counted by torch as the model
    runs them (the CPU's bf16 attention is batched matmuls), plus the PaLM count's 6 per
    parameter outside a matmul (the norms)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from models.transformer_lm import build_model, num_parameters
    from trainer.train.meters import flops_per_token

    T, V = 64, 300
    cfg = cfg_of(
        "--task",
        "dummy_lm",
        "--dict-size",
        str(V),
        "--tokens-per-sample",
        str(T),
        *QWEN3_LAYER,
        "--decoder-layers",
        "2",
    )
    model = build_model(cfg.model, V, T).to(torch.bfloat16)
    with FlopCounterMode(display=False) as counted:
        model(torch.randint(0, V, (1, T)))
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    embed = model.embed_tokens.weight.numel()
    fpt = flops_per_token(cfg.model, num_parameters(model), V, embed, T)
    assert fpt == 3 * counted.get_total_flops() / T + 6 * vectors


LLAMA_8B_ON_8_H100 = [
    "--device-memory-gb",
    "80",
    "--distributed-world-size",
    "8",
    "--bf16",
    "--ddp-backend",
    "fully_sharded",
    "--tokens-per-sample",
    "8192",
    "--batch-size",
    "1",
]


def test_plan_answers_for_the_published_llama_shapes_with_their_vocabularies(capsys):
    """Without DATA, a Llama-family preset plans with its published vocabulary and says so;
    the parameter counts are the published checkpoints' (Llama 3.1 8B: 8,030,261,248;
    Qwen3-8B: 8.19 B with 151,936 tokens; Llama 3.1 70B: 70.55 B)."""
    p = plan_json(capsys, "--arch", "llama3_1_8b", *LLAMA_8B_ON_8_H100)
    assert (p["params"], p["vocab"]) == (8_030_261_248, 128256) and "published" in p["vocab_source"]
    assert p["fits"] and p["recommended"] is not None
    q = plan_json(capsys, "--arch", "qwen3_8b", *LLAMA_8B_ON_8_H100)
    assert (q["params"], q["vocab"]) == (8_190_735_360, 151936)
    # 70 B on one host of 8 x 80 GB: 16 bytes a parameter over 8 ranks is 141 GB; only --cpu-offload fits
    big = plan_json(capsys, "--arch", "llama3_1_70b", *LLAMA_8B_ON_8_H100)
    assert big["params"] == 70_553_706_496 and not big["fits"] and "--cpu-offload" in big["recommended"]
    assert cli.plan_main(["--arch", "llama3_1_8b", *LLAMA_8B_ON_8_H100]) == 0
    assert "vocabulary 128256: llama3_1_8b's published vocabulary (no DATA given)" in capsys.readouterr().out
    # DATA's (here dummy_lm's) vocabulary wins over the published one
    dummy = plan_json(
        capsys, "--arch", "llama3_1_8b", "--task", "dummy_lm", "--dict-size", "32000", *LLAMA_8B_ON_8_H100
    )
    assert (dummy["vocab"], dummy["vocab_source"]) == (32000, None)


def test_plan_path_plans_for_a_hugging_face_model_directory(tmp_path, capsys):
    """plan --path HF_DIR: the model of its config.json (transformers' own, saved by
    save_pretrained), with that model's parameter count; a directory that is not one gets
    a one-line error."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path / "qwen")
    with torch.device("meta"):
        hf_params = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    p = plan_json(capsys, "--path", str(tmp_path / "qwen"), "--cpu", "--batch-size", "2", "--tokens-per-sample", "64")
    assert (p["params"], p["vocab"], p["model"]) == (hf_params, 300, str(tmp_path / "qwen"))
    assert p["vocab_source"] == f"from {tmp_path / 'qwen' / 'config.json'}"
    # train --finetune-from-model HF_DIR plans with the model's embedding rows, not the data's
    tuned = plan_json(
        capsys,
        "--finetune-from-model",
        str(tmp_path / "qwen"),
        "--task",
        "dummy_lm",
        "--dict-size",
        "200",
        "--cpu",
        "--batch-size",
        "2",
        "--tokens-per-sample",
        "64",
    )
    assert (tuned["params"], tuned["vocab"]) == (hf_params, 300)
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    for name, message in (
        ("empty", "has no config.json"),
        ("bad", "config.json is not valid JSON"),
        ("gpt2", "model_type 'gpt2' is not supported"),
        ("missing", "no such directory"),
    ):
        assert cli.plan_main(["--path", str(tmp_path / name), "--cpu"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
