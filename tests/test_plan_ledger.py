"""The memory ledger's arithmetic (trainer/plan/ledger.py), component by component, on a
small model over 4 FSDP ranks (tests/plan_helpers.py): sharded and offloaded states, DDP's
gradients, the loss, activations with and without checkpointing, gathered layers,
communication, deferred gradient sync, the runtime of spawned ranks. tests/test_plan_models.py
checks the counts against the real models, test_plan_search.py the published cases,
test_plan_cli.py the commands."""

from dataclasses import replace

import pytest
from plan_helpers import SETUP, SHAPE, at_peak, cfg_of

from models import chunks
from models.chunks import loss_chunk_rows
from trainer.plan.ledger import GB, comm_bytes, layer_activation_bytes, predict, simulate


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
    assert ddp == {
        "all_gather": 0,
        "reduce_scatter": 0,
        "all_reduce": all_reduce,
        "all_to_all": 0,
        "tensor_parallel": 0,
        "context_parallel": 0,
        "expert_parallel": 0,
    }
    hybrid = comm_bytes(SHAPE, replace(SETUP, backend="hybrid_shard", shard=2))
    assert hybrid["all_reduce"] == pytest.approx(2 * (P / 2) * 4 * 1 / 2)
    assert sum(comm_bytes(SHAPE, replace(SETUP, world=1, shard=1)).values()) == 0


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


def test_ema_is_one_more_copy_of_the_weights_sharded_like_them():
    """--store-ema's average (trainer/train/ema.py): this rank's shards of every parameter, fp32
    with --ema-fp32 or fp32 training, else in the 16-bit dtype of --bf16/--fp16; on the host
    under --cpu-offload on a GPU."""
    from trainer.plan.search import setup_of

    def ema_bytes(*flags):
        return setup_of(cfg_of("--batch-size", "4", *flags), "cpu", 1).ema_bytes

    assert ema_bytes() == 0 and ema_bytes("--store-ema") == 4
    assert ema_bytes("--store-ema", "--bf16") == ema_bytes("--store-ema", "--fp16") == 2
    assert ema_bytes("--store-ema", "--bf16", "--ema-fp32") == 4
    P = SHAPE.params
    base, fp32 = predict(SHAPE, SETUP), predict(SHAPE, replace(SETUP, ema_bytes=4))
    assert base.components["ema"] == 0
    assert fp32.components["ema"] == round(4 * P / 4 / GB, 3)  # sharded over the 4 ranks
    assert fp32.per_rank_gb == pytest.approx(base.per_rank_gb + 4 * P / 4 / GB, abs=0.002)
    bf16 = predict(SHAPE, replace(SETUP, precision="bf16", ema_bytes=2))
    assert bf16.components["ema"] == round(2 * P / 4 / GB, 3)
    gpu = replace(SETUP, device="cuda", cpu_offload=True, ranks_per_host=2)
    on_host, without = predict(SHAPE, replace(gpu, ema_bytes=4)), predict(SHAPE, gpu)
    assert on_host.components["ema"] == 0
    assert on_host.host_gb == pytest.approx(without.host_gb + 2 * 4 * P / 4 / GB, abs=0.002)
