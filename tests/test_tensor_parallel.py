"""Tensor parallelism (--model-parallel-size) trains the model one process trains: per-update
loss and gradient norm on real gloo ranks, alone (TP 2) and composed with FSDP and HSDP,
equal one process reading the same sequences, for a Llama with grouped-query attention,
a Qwen3 (per-head norms) and fairseq's transformer_lm, stepped by Adam, Muon, Adafactor and
LAMB (whose statistics span the split matrices)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import _rank_worker, assert_resumes_on_the_curve, multi_rank_losses, train_updates, update_losses
from trainer.parallel.context_parallel import ContextSplit

UPDATES = 3
SMALL = "--decoder-layers 2 --decoder-embed-dim 64 --decoder-ffn-embed-dim 96 --decoder-attention-heads 4".split()
LLAMA = ["--arch", "llama3_2_1b", *SMALL, "--decoder-kv-heads", "2", "--decoder-head-dim", "16"]
QWEN3 = ["--arch", "qwen3_0_6b", *SMALL, "--decoder-kv-heads", "2", "--decoder-head-dim", "16"]
GPT = ["--arch", "transformer_lm", *SMALL, "--dropout", "0", "--attention-dropout", "0", "--decoder-learned-pos"]
RUN = [
    "--task",
    "dummy_lm",
    "--dict-size",
    "250",
    "--dataset-size",
    "256",
    "--tokens-per-sample",
    "32",
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
    "--clip-norm",
    "0.5",
    "--no-save",
    "--max-valid-steps",
    "2",
]

ADAFACTOR = "--optimizer adafactor --lr 0.3 --scale-parameter --beta1 0.9 --weight-decay 0.01".split()
LAMB = ["--optimizer", "lamb", "--lr", "0.02", "--weight-decay", "0.1", "--clip-norm", "0"]

# (ranks, model, flags): each run's tensor-parallel degree is --model-parallel-size.
LAYOUTS = {
    "llama_tp2": (2, LLAMA, ["--batch-size", "2", "--update-freq", "2", "--ddp-backend", "fully_sharded"]),
    "qwen3_fsdp2_tp2": (4, QWEN3, ["--batch-size", "2", "--ddp-backend", "fully_sharded"]),
    "gpt_tp2_bf16_checkpointed": (
        2,
        GPT,
        ["--batch-size", "2", "--ddp-backend", "fully_sharded", "--bf16", "--checkpoint-activations"],
    ),
    # Muon: each matrix (q, k, v, gate, up whole) orthogonalised by one owner among the 4 ranks;
    # one key/value head for 2 TP ranks: each holds half its rows, both attend with all of it
    "qwen3_fsdp2_tp2_muon_one_kv_head": (
        4,
        [*QWEN3, "--decoder-kv-heads", "1"],
        ["--batch-size", "2", "--ddp-backend", "fully_sharded", "--optimizer", "muon", "--lr", "0.01"],
    ),
    # LayerDrop at 0.5 of 2 layers: some updates run none, and the final norm splits the positions
    "llama_tp2_layerdrop": (
        2,
        LLAMA,
        ["--batch-size", "2", "--ddp-backend", "fully_sharded", "--decoder-layerdrop", "0.5"],
    ),
    # fairseq's FSDP line: fp16 with its loss scale, parameters offloaded, layers recomputed
    "llama_tp2_fp16_offload": (
        2,
        LLAMA,
        ["--batch-size", "2", "--ddp-backend", "fully_sharded", "--fp16", "--cpu-offload", "--checkpoint-activations"],
    ),
    # two replicas, each one rank of FSDP shards (the fourth dimension's smallest case) × TP 2
    "llama_hsdp2_tp2": (4, LLAMA, ["--batch-size", "2", "--ddp-backend", "hybrid_shard", "--shard-group-size", "2"]),
    # Adafactor's factored second moment: rows of out_proj and fc2 summed over tp's columns,
    # columns of qkv_proj (reordered q, k, v) over tp's and FSDP's rows, its update clipped
    # by each logical tensor's RMS, its step scaled by the parameter's RMS
    "llama_fsdp2_tp2_adafactor": (4, LLAMA, ["--batch-size", "2", "--ddp-backend", "fully_sharded", *ADAFACTOR]),
    # LAMB's trust ratio per logical tensor (q, k, v; gate, up) over both replicas' shards
    "qwen3_hsdp2_tp2_lamb": (
        4,
        QWEN3,
        ["--batch-size", "2", "--ddp-backend", "hybrid_shard", "--shard-group-size", "2", *LAMB],
    ),
}


def tp_losses(name, tmp_path, tp=2):
    world, model, flags = LAYOUTS[name]
    argv = model + RUN + flags
    # one process holds one shard: no replicas, no shard groups
    alone = " ".join(argv).replace("hybrid_shard --shard-group-size 2", "fully_sharded").split()
    ref = update_losses(alone, UPDATES, with_gnorm=True, merge=world // tp)
    got = multi_rank_losses(argv + ["--model-parallel-size", str(tp)], world, UPDATES, tmp_path)
    return ref, got


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_parallel_equals_one_process(name, tmp_path):
    (ref_loss, ref_gnorm), (loss, gnorm) = tp_losses(name, tmp_path)
    # Muon's Newton-Schulz runs in bf16: the split's other summation order shows at 1e-5
    tol = {"bf16": 2e-2, "fp16": 1e-3, "muon": 3e-5}.get(
        next((p for p in ("bf16", "fp16", "muon") if p in name), None), 1e-5
    )
    assert loss == pytest.approx(ref_loss, rel=tol, abs=tol)
    assert gnorm == pytest.approx(ref_gnorm, rel=tol, abs=tol)


def _broken_rank(index, argv, world, port, n_updates, out, broken):
    """A rank of the run with one of tensor parallelism's reductions taken out."""
    import torch.distributed as dist

    from trainer.parallel import ranks, tensor_parallel

    if broken == "vocab_shards":  # each rank's loss over its own rows of the vocabulary only
        tensor_parallel.VocabShard.sum_ = lambda self, t: t
        tensor_parallel.VocabShard.max_ = lambda self, t: t
    elif broken == "token_counts":  # counted on every rank of a tensor-parallel group, as if other batches

        def world_sum(tensor, env):
            dist.all_reduce(tensor)
            return tensor

        ranks.on_device_sum = world_sum
        import trainer.train.trainer

        trainer.train.trainer.on_device_sum = world_sum
    elif broken == "kv_gradients":  # each rank keeps its own queries' gradient of its keys/values only
        from trainer.parallel import context_parallel

        def own_share(ctx, grad):
            return grad.index_select(2, ctx.split.local.to(grad.device)), None, None

        context_parallel.GatherKeysValues.backward = staticmethod(own_share)
    _rank_worker(index, argv, world, port, n_updates, out)


@pytest.mark.parametrize("broken", ["vocab_shards", "token_counts", "kv_gradients"])
def test_a_missing_reduction_fails(broken, tmp_path):
    """The equalities here fail when a reduction tensor or context parallelism needs is taken out."""
    import json

    from helpers import run_ranks
    from trainer.rendezvous import free_port

    world, model, flags = LAYOUTS["llama_tp2"]
    argv = model + RUN + flags
    ref_loss, ref_gnorm = update_losses(argv, UPDATES, with_gnorm=True)
    out = tmp_path / "ranks"
    parallel = ["--context-parallel-size" if broken == "kv_gradients" else "--model-parallel-size", "2"]
    run_ranks(_broken_rank, (argv + parallel, world, free_port(), UPDATES, str(out), broken), 2)
    got = json.loads(Path(f"{out}.0").read_text())
    assert got["gnorms"] != pytest.approx(ref_gnorm, rel=1e-3) or got["losses"] != pytest.approx(ref_loss, rel=1e-3)


# 4 sequences an update on every layout: TP 2 × FSDP 2 at 2 a rank, FSDP 4 at 1, one
# process at 2 × --update-freq 2, TP 2 alone the same.
RESUMED_ON = {
    "fsdp4": (4, ["--batch-size", "1", "--ddp-backend", "fully_sharded"]),
    "one_process": (1, ["--batch-size", "2", "--update-freq", "2"]),
    "tp2": (
        2,
        ["--batch-size", "2", "--update-freq", "2", "--ddp-backend", "fully_sharded", "--model-parallel-size", "2"],
    ),
    "cp2": (
        2,
        ["--batch-size", "2", "--update-freq", "2", "--ddp-backend", "fully_sharded", "--context-parallel-size", "2"],
    ),
}
SAVED = LLAMA + [a for a in RUN if a != "--no-save"] + ["--required-batch-size-multiple", "1"]


@pytest.fixture(scope="module")
def saved_on_tp2_fsdp2(tmp_path_factory):
    """4 updates on TP 2 × FSDP 2, saved; and 8 updates of one process, not stopped."""
    tmp = tmp_path_factory.mktemp("tp2_fsdp2")
    flags = ["--batch-size", "2", "--ddp-backend", "fully_sharded", "--model-parallel-size", "2"]
    first = train_updates(SAVED + flags + ["--max-update", "4", "--save-dir", str(tmp / "ckpt")], 4, tmp)
    whole = train_updates(SAVED + RESUMED_ON["one_process"][1] + ["--max-update", "8", "--no-save"], 1, tmp)
    return first, whole, tmp / "ckpt"


@pytest.mark.parametrize("layout", list(RESUMED_ON))
def test_a_tensor_parallel_checkpoint_resumes_on_any_layout(layout, saved_on_tp2_fsdp2, tmp_path):
    """Saved at TP 2 × FSDP 2, resumed at FSDP 4, one process, TP 2 and CP 2: the same curve as a
    run never stopped (the checkpoint holds the model's own rows, and the data position)."""
    first, whole, saved = saved_on_tp2_fsdp2
    world, flags = RESUMED_ON[layout]
    assert_resumes_on_the_curve(saved, SAVED + flags, world, tmp_path, first, whole)


def test_adafactor_state_resumes_across_tensor_parallelism(tmp_path):
    """Adafactor's factored state saved at TP 2 × FSDP 2 (qkv_proj's row statistics in the
    ranks' row order, out_proj's and fc2's whole, the columns replicated) continues on one
    process, and one process's at TP 2 × FSDP 2: the curve of a run never stopped."""
    flags = SAVED + ADAFACTOR
    one = RESUMED_ON["one_process"][1]
    tp = ["--batch-size", "2", "--ddp-backend", "fully_sharded", "--model-parallel-size", "2"]
    whole = train_updates(
        flags + one + ["--max-update", "4", "--save-interval-updates", "2", "--save-dir", str(tmp_path / "one")],
        1,
        tmp_path,
    )
    first = train_updates(flags + tp + ["--max-update", "2", "--save-dir", str(tmp_path / "tp")], 4, tmp_path)
    on_one = train_updates(flags + one + ["--max-update", "4", "--save-dir", str(tmp_path / "tp")], 1, tmp_path)
    saved_on_one = ["--restore-file", str(tmp_path / "one" / "checkpoint_1_2")]
    on_tp = train_updates(
        flags + tp + saved_on_one + ["--max-update", "4", "--save-dir", str(tmp_path / "b")], 4, tmp_path
    )
    assert sorted(first) == [1, 2] and sorted(on_one) == sorted(on_tp) == [3, 4], "an update ran twice"
    for n, (loss, gnorm) in {**first, **on_one}.items():
        assert loss == pytest.approx(whole[n][0], rel=1e-6), f"update {n}, saved at TP 2 × FSDP 2"
        assert gnorm == pytest.approx(whole[n][1], rel=1e-5), f"update {n}, saved at TP 2 × FSDP 2"
    for n, (loss, gnorm) in on_tp.items():
        assert loss == pytest.approx(whole[n][0], rel=1e-6), f"update {n}, resumed at TP 2 × FSDP 2"
        assert gnorm == pytest.approx(whole[n][1], rel=1e-5), f"update {n}, resumed at TP 2 × FSDP 2"


# Context parallelism: each of the ranks of a context group holds two chunks of every sequence.
CONTEXT = {
    "llama_cp2": (2, LLAMA, ["--batch-size", "2", "--update-freq", "2", "--ddp-backend", "fully_sharded"], 2, 1),
    "gpt_cp2_tp2": (4, GPT, ["--batch-size", "2", "--ddp-backend", "fully_sharded"], 2, 2),
    "qwen3_hsdp2_cp2": (
        4,
        QWEN3,
        ["--batch-size", "2", "--ddp-backend", "hybrid_shard", "--shard-group-size", "2"],
        2,
        1,
    ),
}


@pytest.mark.parametrize("name", CONTEXT)
def test_context_parallel_equals_one_process(name, tmp_path):
    world, model, flags, cp, tp = CONTEXT[name]
    argv = model + RUN + flags
    alone = " ".join(argv).replace("hybrid_shard --shard-group-size 2", "fully_sharded").split()
    ref_loss, ref_gnorm = update_losses(alone, UPDATES, with_gnorm=True, merge=world // (cp * tp))
    parallel = ["--context-parallel-size", str(cp), "--model-parallel-size", str(tp)]
    loss, gnorm = multi_rank_losses(argv + parallel, world, UPDATES, tmp_path)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
    assert gnorm == pytest.approx(ref_gnorm, rel=1e-5, abs=1e-5)


def test_a_context_rank_masks_only_packed_documents():
    """Plain sequences reach attention as the rank's two chunks, each seeing the keys up to its
    end, with no mask of the rank's queries over the whole sequence (B × T²/N bytes, which a
    long sequence cannot afford); packed documents bring theirs."""
    env = SimpleNamespace(cp=2, cp_rank=1, cp_group=None, device=torch.device("cpu"))
    tokens = torch.arange(20).view(2, 10)
    batch = {"src_tokens": tokens, "target": tokens, "nsentences": 2, "segments": torch.zeros(2, 10, dtype=torch.long)}
    plain = ContextSplit(env, per_document=False, pad=-1)(batch)["context"]
    assert plain.mask is None
    assert plain.query_chunks == [(0, 3, 6), (3, 5, 8)]  # positions 3-5 and 6-7 of 10
    packed = ContextSplit(env, per_document=True, pad=-1)(batch)["context"]
    assert packed.mask.shape == (2, 1, 5, 10)
