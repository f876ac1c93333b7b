"""FSDP trains the same model DDP does: per-update loss and gnorm on 2 (and 4) real gloo
ranks agree with one process holding the whole batch: the same sequences, the ranks'
batches of each micro-batch merged into one (an epoch's batches depend on the per-rank
--batch-size, fairseq's order, so a run of a larger batch reads other sequences). Plus the ways to launch."""

import json
from pathlib import Path

import pytest

from helpers import DUMMY, multi_rank_losses, update_losses

UPDATES = 5
# Clipping on, so the global norm over shards is checked where it acts.
BASE = DUMMY + ["--clip-norm", "0.5"]

FIDELITY = {
    "ddp": (2, ["--batch-size", "4"]),
    "legacy_ddp": (2, ["--batch-size", "4", "--ddp-backend", "legacy_ddp"]),
    "fsdp": (2, ["--batch-size", "4", "--ddp-backend", "fully_sharded"]),
    "fsdp_no_reshard": (2, ["--batch-size", "4", "--ddp-backend", "fully_sharded", "--no-reshard-after-forward"]),
    "fsdp_cpu_offload": (2, ["--batch-size", "4", "--ddp-backend", "fully_sharded", "--cpu-offload"]),
    "fsdp_checkpoint": (2, ["--batch-size", "4", "--ddp-backend", "fully_sharded", "--checkpoint-activations"]),
    "fsdp_update_freq": (2, ["--batch-size", "2", "--update-freq", "2", "--ddp-backend", "fully_sharded"]),
    "fsdp_update_freq_deferred": (
        2,
        ["--batch-size", "2", "--update-freq", "2", "--ddp-backend", "fully_sharded", "--defer-grad-sync"],
    ),
    "ddp_update_freq": (2, ["--batch-size", "2", "--update-freq", "2"]),
    "hybrid_shard_2x2": (4, ["--batch-size", "2", "--ddp-backend", "hybrid_shard", "--shard-group-size", "2"]),
}


_one_process = {}


def one_process(world, extra):
    """(losses, gnorms) of one process whose micro-batches hold what the `world` ranks run
    with `extra` read in theirs."""
    batch_size = extra[extra.index("--batch-size") + 1]
    update_freq = extra[extra.index("--update-freq") + 1] if "--update-freq" in extra else "1"
    key = (batch_size, update_freq, world)
    if key not in _one_process:
        argv = BASE + ["--batch-size", batch_size, "--update-freq", update_freq]
        _one_process[key] = update_losses(argv, UPDATES, with_gnorm=True, merge=world)
    return _one_process[key]


@pytest.mark.parametrize("model", [["--layernorm-embedding"], ["model.share_decoder_input_output_embed=false"]])
def test_fsdp_root_given_back_after_forward_trains_the_same(model, tmp_path):
    """FSDP gives the root's weights back after forward and does not gather them for
    backward (trainer/parallel/parallelize.py); the norms outside the layers, which backward reads,
    are units of their own. With an embedding norm, and with an untied output projection,
    the updates are one process's."""
    argv = BASE + model
    ref_losses, ref_gnorms = update_losses(argv + ["--batch-size", "4"], UPDATES, with_gnorm=True, merge=2)
    losses, gnorms = multi_rank_losses(
        argv + ["--batch-size", "4", "--ddp-backend", "fully_sharded"], 2, UPDATES, tmp_path
    )
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert gnorms == pytest.approx(ref_gnorms, rel=1e-4)


@pytest.mark.parametrize("name", list(FIDELITY))
def test_backend_matches_one_process(name, tmp_path):
    world, extra = FIDELITY[name]
    losses, gnorms = multi_rank_losses(BASE + extra, world, UPDATES, tmp_path)
    ref_losses, ref_gnorms = one_process(world, extra)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert gnorms == pytest.approx(ref_gnorms, rel=1e-5)
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_mixed_precision_fsdp_matches_ddp(precision, tmp_path):
    ddp, _ = multi_rank_losses(BASE + ["--batch-size", "4", precision], 2, UPDATES, tmp_path)
    fsdp, _ = multi_rank_losses(
        BASE + ["--batch-size", "4", precision, "--ddp-backend", "fully_sharded"], 2, UPDATES, tmp_path
    )
    assert fsdp == pytest.approx(ddp, rel=2e-2)
    assert fsdp[-1] < fsdp[0]


def _gather_initial_parameters(index, world, port, out):
    import torch

    from helpers import compose
    from trainer.parallel import ranks as distributed
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    cfg = compose(BASE + ["--batch-size", "4", "--ddp-backend", "fully_sharded", "--decoder-learned-pos"])
    rdv = Rendezvous(f"tcp://127.0.0.1:{port}", world, rank=index, local_rank=index, local_world_size=world)
    env = distributed.init_rank(cfg, rdv, needs_process_group=True)
    try:
        _, trainer, _ = build(cfg, env)
        full = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}
        local = sum(p.to_local().numel() for p in trainer.model.parameters())
        if index == 0:
            torch.save({"params": full, "local_numel": local}, out)
        del trainer
    finally:
        distributed.teardown()


def test_sharded_init_equals_one_process_exactly(tmp_path):
    import torch

    from helpers import compose, run_ranks
    from models.transformer_lm import build_model
    from trainer.rendezvous import free_port

    out = tmp_path / "params.pt"
    run_ranks(_gather_initial_parameters, (2, free_port(), str(out)), 2)
    sharded = torch.load(out)
    cfg = compose(BASE + ["--batch-size", "4", "--decoder-learned-pos"])
    whole = dict(build_model(cfg.model, 256, 32, seed=cfg.common.seed).named_parameters())
    assert sharded["params"].keys() == whole.keys()
    for name, p in whole.items():
        assert torch.equal(sharded["params"][name], p.detach()), name
    total = sum(p.numel() for p in whole.values())
    assert sharded["local_numel"] <= total // 2 + 1000  # each rank holds about half


def _pending_gathers_rank(index, world, port, out):
    """Which FSDP units have an all-gather in flight: after build, after DCP's optimizer-state
    init (it steps the optimizer), and after one update."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from data.iterator import grouped
    from helpers import compose
    from trainer.parallel import ranks as distributed
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    cfg = compose(BASE + ["--batch-size", "4", "--ddp-backend", "fully_sharded"])
    rdv = Rendezvous(f"tcp://127.0.0.1:{port}", world, rank=index, local_rank=index, local_world_size=world)
    env = distributed.init_rank(cfg, rdv, needs_process_group=True)
    try:
        task, trainer, _ = build(cfg, env)
        units = [trainer.model] + list(trainer.model.layers)

        def pending():  # FSDP2 keeps an unshard's result here until pre-forward waits for it
            return [unit._get_fsdp_state()._fsdp_param_group._all_gather_result is not None for unit in units]

        seen = {"built": pending()}
        get_optimizer_state_dict(trainer.model, trainer.optimizer)
        seen["checkpoint_api"] = pending()
        itr = task.batch_iterator(cfg.dataset.train_subset, training=True)
        trainer.train_step(next(grouped(itr.next_epoch_itr(), 1)))
        seen["updated"] = pending()
        trainer.finish()
        seen["finished"] = pending()
        Path(f"{out}.{index}").write_text(json.dumps(seen))
    finally:
        distributed.teardown()


def test_the_first_all_gathers_start_during_the_optimizer_step(tmp_path):
    """parallelize.EarlyGather: after an update, the root's and the first layer's
    all-gathers for the next forward are already in flight, and no other unit's. The
    optimizer step that torch's checkpoint API runs to create optimizer state gathers
    nothing: a load would then replace the parameters under it. `finish()` leaves none in
    flight for the process group's teardown."""
    from helpers import run_ranks
    from trainer.rendezvous import free_port

    out = tmp_path / "pending"
    run_ranks(_pending_gathers_rank, (2, free_port(), str(out)), 2)
    for rank in range(2):
        seen = json.loads(Path(f"{out}.{rank}").read_text())
        assert seen["built"] == [False, False, False] and seen["checkpoint_api"] == [False, False, False]
        assert seen["updated"] == [True, True, False]
        assert seen["finished"] == [False, False, False]  # nothing left in flight for teardown


def _bucket_cap_rank(index, world, port, out):
    """DDP's bucket size, and the lines each rank logs about --bucket-cap-mb, with DDP and
    then with FSDP, in one process group."""
    import logging

    from helpers import compose
    from trainer.parallel import ranks as distributed
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("shardlm").addHandler(handler)
    logging.getLogger("shardlm").setLevel(logging.INFO)
    ddp = compose(BASE + ["--batch-size", "4", "--bucket-cap-mb", "3"])
    rdv = Rendezvous(f"tcp://127.0.0.1:{port}", world, rank=index, local_rank=index, local_world_size=world)
    env = distributed.init_rank(ddp, rdv, needs_process_group=True)
    try:
        seen = {"bucket_bytes_cap": build(ddp, env)[1].model.bucket_bytes_cap}
        build(compose(BASE + ["--batch-size", "4", "--bucket-cap-mb", "3", "--ddp-backend", "fully_sharded"]), env)
        seen["notes"] = [line for line in lines if "--bucket-cap-mb" in line]
        Path(f"{out}.{index}").write_text(json.dumps(seen))
    finally:
        logging.getLogger("shardlm").removeHandler(handler)
        distributed.teardown()


def test_bucket_cap_mb_sizes_ddp_buckets_and_fsdp_says_it_has_none(tmp_path):
    """--bucket-cap-mb is DDP's bucket_cap_mb on every rank; FSDP2 has no buckets: rank 0
    says once that the flag does nothing there, and why."""
    from helpers import run_ranks
    from trainer.rendezvous import free_port

    out = tmp_path / "buckets"
    run_ranks(_bucket_cap_rank, (2, free_port(), str(out)), 2)
    seen = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    assert [s["bucket_bytes_cap"] for s in seen] == [3 * 1024 * 1024] * 2
    assert seen[1]["notes"] == []
    (note,) = seen[0]["notes"]
    assert note.startswith("--bucket-cap-mb 3 has no effect with --ddp-backend fully_sharded: FSDP2 reduce-scatters")
