"""--optimizer muon: torch.optim.Muon's step of every logical matrix (the Hugging Face
layout's q, k, v, o, gate, up, down), whole on its owner rank under FSDP and HSDP, so every
layout trains the same numbers; its momentum resumes on another number of ranks."""

import math
import zlib

import pytest
import torch

from helpers import DUMMY, compose, multi_rank_losses, run_ranks, train_updates, update_losses

UPDATES = 5
# Grouped-query attention (2 query heads of width 24, 1 key/value head) and a gated
# feed-forward: qkv_proj holds 3 matrices of 48, 24 and 24 rows, fc1 2 of 128.
LLAMA = ["--norm-type", "rmsnorm", "--gated-ffn", "--decoder-kv-heads", "1", "--decoder-head-dim", "24", "--rope"]
MUON = ["--optimizer", "muon", "--lr", "0.01", "--weight-decay", "0.01", "--clip-norm", "0.5"]
BASE = DUMMY + LLAMA + MUON
FSDP = ["--ddp-backend", "fully_sharded"]
LAYOUTS = {  # (ranks, flags, the one process that reads the same sequences per update)
    "ddp": (2, ["--batch-size", "4"], (["--batch-size", "4"], 2)),
    "fsdp": (2, ["--batch-size", "4"] + FSDP, (["--batch-size", "4"], 2)),
    "fsdp_update_freq": (
        2,
        ["--batch-size", "2", "--update-freq", "2"] + FSDP,
        (["--batch-size", "2", "--update-freq", "2"], 2),
    ),
    # each update's 4 batches of 2: the sequences of the one process above
    "hsdp_2x2": (
        4,
        ["--batch-size", "2", "--ddp-backend", "hybrid_shard", "--shard-group-size", "2"],
        (["--batch-size", "2", "--update-freq", "2"], 2),
    ),
}
HSDP = ["--ddp-backend", "hybrid_shard", "--shard-group-size", "2"]


def _stepped_weights(index, argv, world, port, out):
    """One rank: the model built as `train` builds it, 3 optimizer steps on gradients drawn
    whole from a seed per parameter and step (each rank keeps its shard), then rank 0 saves
    the whole weights."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from trainer.parallel import ranks
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    address = f"tcp://127.0.0.1:{port}" if world > 1 else ""
    rdv = Rendezvous(address, world, rank=index, local_rank=index, local_world_size=world)
    cfg = compose(argv)
    env = ranks.init_rank(cfg, rdv, needs_process_group=world > 1)
    try:
        _, trainer, _ = build(cfg, env)
        params = dict(trainer.model.named_parameters())
        for step in range(3):
            for name, p in params.items():
                full = torch.randn(
                    p.shape, generator=torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
                )
                is_sharded = isinstance(p, DTensor)
                p.grad = (
                    distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) if is_sharded else full
                )
            trainer.optimizer.step()
        whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()}
        if index == 0:
            torch.save(whole, out)
    finally:
        ranks.teardown()


def stepped_weights(argv, world, tmp_path):
    from trainer.rendezvous import free_port

    out = tmp_path / f"weights-{world}-{free_port()}.pt"
    run_ranks(_stepped_weights, (argv, world, free_port(), str(out)), world)
    return torch.load(out)


def test_sharded_step_is_the_whole_step(tmp_path):
    """Given the same gradients, Muon's step on row shards (each matrix whole on its owner in
    each shard group of 2, on 2 replicas) leaves exactly the weights one process's does: the
    bf16 Newton-Schulz sees the same matrices. Newton-Schulz on each rank's rows alone would
    not."""
    argv = BASE + ["--batch-size", "2"]
    out = tmp_path / "whole.pt"
    _stepped_weights(0, argv, 1, None, out)
    whole = torch.load(out)
    sharded = stepped_weights(argv + HSDP, 4, tmp_path)
    assert whole.keys() == sharded.keys()
    for name, w in whole.items():
        assert torch.equal(sharded[name], w), name


# a mixture of 4 experts of width 16: its router and each expert's gate, up and down
EXPERTS = ["--moe-expert-count", "4", "--moe-top-k", "2", "--moe-ffn-embed-dim", "16"]


@pytest.mark.parametrize("experts", [[], EXPERTS], ids=["dense", "mixture"])
def test_step_is_torch_muon_on_the_hugging_face_matrices(experts):
    """Muon's step of a model split as Hugging Face's Llama (or Qwen3-MoE) is (q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, each a parameter; a mixture's
    router and each expert's three) under torch.optim.Muon, on the same gradients, 3 steps
    (momentum, Nesterov, decoupled weight decay, the lr per shape): the same weights. Both
    run the same bf16 Newton-Schulz on the same matrices, so they agree to float32's rounding
    of the final add; orthogonalising qkv_proj, fc1 or the stacked experts as one matrix
    moves each weight by about lr (0.01)."""
    from models.transformer_lm import build_model
    from trainer.train.muon import build_muon

    cfg = compose(BASE + experts + ["--batch-size", "2", "--muon-adjust-lr-fn", "match_rms_adamw"])
    model = build_model(cfg.model, 256, 32, seed=1)
    layer = model.layers[0]
    H, KV, D, ffn = layer.num_heads, layer.num_kv_heads, layer.head_dim, cfg.model.decoder_ffn_embed_dim

    def hf_matrices(layer, grad=False):
        weight = (lambda p: p.grad) if grad else (lambda p: p)
        q, k, v = weight(layer.qkv_proj.weight).split((H * D, KV * D, KV * D))
        attention = [q, k, v, weight(layer.out_proj.weight)]
        if layer.moe is None:
            gate, up = weight(layer.fc1.weight).split((ffn, ffn))
            return attention + [gate, up, weight(layer.fc2.weight)]
        experts = layer.moe.experts
        fc1, fc2 = weight(experts.fc1).chunk(experts.num_experts), weight(experts.fc2).chunk(experts.num_experts)
        return attention + [weight(layer.moe.router.weight)] + [m for e in range(4) for m in (*fc1[e].chunk(2), fc2[e])]

    hf = [torch.nn.Parameter(w.detach().clone()) for lyr in model.layers for w in hf_matrices(lyr)]
    reference = torch.optim.Muon(hf, lr=0.01, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    optimizer = build_muon(model, cfg)
    for step in range(3):
        torch.manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        for p, g in zip(hf, (g for lyr in model.layers for g in hf_matrices(lyr, grad=True))):
            p.grad = g.clone()
        optimizer.step()
        reference.step()
    ours = [w for lyr in model.layers for w in hf_matrices(lyr)]
    assert len(ours) == len(hf) == len(model.layers) * (17 if experts else 7)
    for mine, theirs in zip(ours, hf):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6)


_one_process = {}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_as_one_process(layout, tmp_path):
    """Each matrix is orthogonalised whole (on its owner under FSDP), so the bf16 rounding of
    Newton-Schulz is the same everywhere: losses and gradient norms agree to 1e-5."""
    world, flags, (reference, merge) = LAYOUTS[layout]
    key = (tuple(reference), merge)
    if key not in _one_process:
        _one_process[key] = update_losses(BASE + reference, UPDATES, with_gnorm=True, merge=merge)
    ref_losses, ref_gnorms = _one_process[key]
    losses, gnorms = multi_rank_losses(BASE + flags, world, UPDATES, tmp_path)
    # Bitwise the same only for bitwise the same gradients (test_sharded_step_is_the_whole_step):
    # here the ranks' sums of gradients round differently in float32 from one process's, and
    # a last-bit change can flip the bf16 rounding of an element entering Newton-Schulz. On
    # this model that moves losses by up to 5e-6 and gnorms by 1.3e-5 relative; Newton-Schulz
    # on local shards moves them by 5e-5 and 1.5e-4.
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert gnorms == pytest.approx(ref_gnorms, rel=3e-5)
    assert ref_losses[-1] < ref_losses[0]


def test_momentum_resumes_on_other_numbers_of_ranks(tmp_path):
    """5 updates on 2 FSDP ranks, saved after 2, resumed from there in one process and on
    4 FSDP ranks: the owners are packed anew for each number of ranks, the momentum is
    resharded as the weights are, and updates 3-5 are the uninterrupted run's. Every run
    reads each update's 4 batches of 2."""
    common = [a for a in BASE if a != "--no-save"] + ["--batch-size", "2", "--max-update", "5", "--disable-validation"]
    saved = tmp_path / "a" / "checkpoint_1_2"
    whole = train_updates(
        common + FSDP + ["--update-freq", "2", "--save-interval-updates", "2", "--save-dir", str(tmp_path / "a")],
        2,
        tmp_path,
    )
    for world, flags in ((1, ["--update-freq", "4"]), (4, FSDP)):
        resumed = train_updates(
            common + flags + ["--save-dir", str(tmp_path / f"resumed{world}"), "--restore-file", str(saved)],
            world,
            tmp_path,
        )
        assert sorted(resumed) == [3, 4, 5], world
        for n, (loss, gnorm) in resumed.items():
            assert loss == pytest.approx(whole[n][0], rel=1e-5), (world, n)
            assert gnorm == pytest.approx(whole[n][1], rel=3e-5), (world, n)


@pytest.mark.parametrize("precision", [["--fp16", "--fp16-init-scale", "16384"], ["--bf16"]], ids=["fp16", "bf16"])
def test_mixed_precision_with_cpu_offload(precision, tmp_path):
    """On host shards (--cpu-offload) under --fp16 and --bf16 Muon trains. fp16 from a loss
    scale of 2**14 (times the update's summed loss, as fairseq's) overflows twice (a Nan/Inf
    gradient norm): both steps are skipped on every
    rank, so no Nan reaches the weights or the momentum, and the 3 steps after them are
    finite."""
    losses, gnorms = multi_rank_losses(
        BASE + precision + FSDP + ["--cpu-offload", "--batch-size", "4"], 2, UPDATES, tmp_path
    )
    assert all(map(math.isfinite, losses))
    if "--fp16" in precision:
        assert [math.isfinite(g) for g in gnorms] == [False, False, True, True, True]
    else:
        assert losses[-1] < losses[0]
