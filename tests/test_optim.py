"""fairseq's learning-rate schedules (expected values worked out from fairseq's code), its
NAG against a hand-written step, the option checks, the weight-decay parameter groups, and
AdamW and the gradient norm on FSDP2's shards (2 real gloo ranks). Training with them:
test_optim_train.py."""

import json
import math
from pathlib import Path

import pytest

from helpers import compose


def schedule(*argv):
    from trainer.train.lr_schedule import LRSchedule

    return LRSchedule(compose(["--batch-size", "1"] + list(argv)))


def test_inverse_sqrt_warms_up_then_decays_as_one_over_sqrt():
    s = schedule("--lr-scheduler", "inverse_sqrt", "--lr", "0.01", "--warmup-updates", "100")
    # fairseq's step_update(k), the lr of update k + 1: the first update's is --warmup-init-lr (0)
    assert s.lr(0) == 0 and s.lr(99) == pytest.approx(0.01 * 99 / 100) and s.lr(100) == pytest.approx(0.01)
    assert s.lr(400) == pytest.approx(0.01 * math.sqrt(100 / 400))
    fixed = schedule("--lr", "0.01", "--warmup-updates", "4")  # fixed's warmup counts from 1/4
    assert [fixed.lr(k) for k in range(5)] == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01])


def test_polynomial_decay_reaches_end_lr():
    s = schedule(
        "--lr-scheduler",
        "polynomial_decay",
        "--lr",
        "0.01",
        "--warmup-updates",
        "10",
        "--max-update",
        "110",
        "--end-learning-rate",
        "0.001",
    )
    assert s.lr(10) == pytest.approx(0.01) and s.lr(60) == pytest.approx(0.0055)
    assert s.lr(110) == pytest.approx(0.001) and s.lr(500) == pytest.approx(0.001)


def test_cosine_and_fixed():
    s = schedule("--lr-scheduler", "cosine", "--lr", "0.01", "--min-lr", "0.001", "--max-update", "100")
    assert s.lr(0) == pytest.approx(0.01) and s.lr(50) == pytest.approx(0.0055) and s.lr(100) == pytest.approx(0.001)
    assert schedule("--lr", "0.3").lr(12345) == 0.3


def test_cosine_cycles_grow_by_t_mult_and_shrink_by_lr_shrink_after_warmup():
    """fairseq's cosine step_update. Warmup from --min-lr (its --warmup-init-lr default) by
    (0.01 - 0.001) / 5 per update; then cycles of 10, 20, 40 updates whose max and min lr
    are halved each cycle."""
    s = schedule(
        "--lr-scheduler",
        "cosine",
        "--lr",
        "0.01",
        "--min-lr",
        "0.001",
        "--warmup-updates",
        "5",
        "--lr-period-updates",
        "10",
        "--t-mult",
        "2",
        "--lr-shrink",
        "0.5",
        "--max-update",
        "200",
    )
    assert s.lr(0) == pytest.approx(0.001) and s.lr(3) == pytest.approx(0.001 + 3 * 0.0018)
    assert s.lr(5) == pytest.approx(0.01)  # cycle 0 starts at --lr
    assert s.lr(10) == pytest.approx(0.001 + 0.5 * 0.009)  # halfway through cycle 0 (10 updates)
    assert s.lr(15) == pytest.approx(0.005)  # cycle 1 (20 updates) starts at 0.01 * 0.5
    assert s.lr(25) == pytest.approx(0.0005 + 0.5 * 0.0045)  # halfway through cycle 1
    # 40 updates past warmup: 10 into cycle 2 (40 updates, lr between 0.0025 and 0.00025)
    assert s.lr(45) == pytest.approx(0.00025 + 0.5 * 0.00225 * (1 + math.cos(math.pi / 4)))


def test_cosine_restarts_each_period_with_t_mult_1():
    s = schedule(
        "--lr-scheduler",
        "cosine",
        "--lr",
        "0.01",
        "--lr-period-updates",
        "10",
        "--lr-shrink",
        "0.1",
        "--max-update",
        "100",
    )
    assert [s.lr(n) for n in (0, 5, 10, 15, 25)] == pytest.approx([0.01, 0.005, 0.001, 0.0005, 0.00005])
    # without --lr-period-updates the one cycle is --max-update minus warmup
    s = schedule(
        "--lr-scheduler", "cosine", "--lr", "0.01", "--min-lr", "0.001", "--warmup-updates", "5", "--max-update", "25"
    )
    assert s.lr(15) == pytest.approx(0.0055) and s.lr(25) == pytest.approx(0.01 * 0.1)


def plateau(*argv):
    return schedule("--lr-scheduler", "reduce_lr_on_plateau", "--lr", "0.01", *argv)


def test_reduce_lr_on_plateau_shrinks_after_patience_and_its_state_restores():
    """torch's ReduceLROnPlateau as fairseq drives it: a metric is better when below
    best * (1 - threshold); after more than --lr-patience bad epochs the lr is multiplied by
    --lr-shrink and the count starts again."""
    s = plateau("--lr-shrink", "0.5", "--lr-threshold", "0.1", "--lr-patience", "1")
    lrs = []
    for metric in (10, 9.5, 9.5, 8.9, 8.5):  # best 10; 2 bad (9.5 >= 9); 8.9 < 9: best; 1 bad
        s.step_epoch(metric, 100)
        lrs.append(s.lr(100))
    s.step_epoch(None, 100)  # an epoch that did not validate changes nothing
    assert lrs == pytest.approx([0.01, 0.01, 0.005, 0.005, 0.005]) and s.lr(100) == pytest.approx(0.005)
    state = json.loads(json.dumps(s.state_dict()))  # as trainer_state.json holds it
    resumed = plateau("--lr-shrink", "0.5", "--lr-threshold", "0.1", "--lr-patience", "1")
    resumed.load_state_dict(state)
    for sched in (s, resumed):
        sched.step_epoch(8.5, 101)  # the second bad epoch since 8.9: shrink
    assert s.lr(101) == resumed.lr(101) == pytest.approx(0.0025)
    fresh = plateau("--lr-shrink", "0.5", "--lr-threshold", "0.1", "--lr-patience", "1")
    fresh.load_state_dict({"name": "cosine"})  # another schedule's state: ignored
    assert fresh.lr(0) == 0.01


def test_reduce_lr_on_plateau_warmup_maximize_and_smallest_step():
    s = plateau("--warmup-updates", "4")
    assert [s.lr(n) for n in (0, 2, 4, 9)] == pytest.approx([0.0, 0.005, 0.01, 0.01])
    s.step_epoch(10.0, 4)  # warmup not over (fairseq: after update 4): not stepped
    s.step_epoch(10.0, 5)
    s.step_epoch(10.0, 6)
    assert s.lr(6) == pytest.approx(0.001)  # one best, one bad epoch: patience 0, shrink 0.1
    s = plateau("--maximize-best-checkpoint-metric")
    s.step_epoch(1.0, 1)
    s.step_epoch(1.5, 2)  # higher is better
    assert s.lr(2) == 0.01
    s.step_epoch(1.5, 3)
    assert s.lr(3) == pytest.approx(0.001)
    s = schedule("--lr-scheduler", "reduce_lr_on_plateau", "--lr", "1e-8", "--lr-shrink", "0.5")
    s.step_epoch(1.0, 1)
    s.step_epoch(1.0, 2)
    assert s.lr(2) == 1e-8  # torch's eps: a change under 1e-8 is not made


def nag_reference(p, g, buf, lr, lr_old, momentum, weight_decay):
    """fairseq/optim/nag.py's step for one parameter, element by element."""
    lr_correct = lr / lr_old if lr_old > 0 else lr
    new_p = [
        x * (1 - lr * weight_decay) + momentum * momentum * lr_correct * b - (1 + momentum) * lr * d
        for x, b, d in zip(p, buf, g)
    ]
    new_buf = [momentum * lr_correct * b - lr * d for b, d in zip(buf, g)]
    return new_p, new_buf


def test_nag_step_is_fairseqs():
    import torch

    from trainer.train.optim import NAG

    torch.manual_seed(0)
    decayed, plain = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    opt = NAG(
        [{"params": [decayed], "weight_decay": 0.01}, {"params": [plain], "weight_decay": 0.0}], lr=0.1, momentum=0.9
    )
    ref = {id(t): (t.flatten().tolist(), [0.0] * t.numel()) for t in (decayed, plain)}
    lr_old = 0.1
    for lr in (0.1, 0.05, 0.05, 0.2):  # lr changes: the buffer is rescaled by lr / lr_old
        for t in (decayed, plain):
            t.grad = torch.randn_like(t)
        for group in opt.param_groups:
            group["lr"] = lr
            for t in group["params"]:
                p, buf = ref[id(t)]
                ref[id(t)] = nag_reference(p, t.grad.flatten().tolist(), buf, lr, lr_old, 0.9, group["weight_decay"])
        opt.step()
        lr_old = lr
    for t in (decayed, plain):
        assert t.flatten().tolist() == pytest.approx(ref[id(t)][0], rel=1e-12)
        assert opt.state[t]["momentum_buffer"].flatten().tolist() == pytest.approx(ref[id(t)][1], rel=1e-12)


def test_nag_momentum_default_and_checkpoint_api_step_changes_nothing():
    """fairseq's nag has momentum 0.99. torch's checkpoint API steps an optimizer without
    state with lr 0 to create it (before a load): that must not move a weight."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from trainer.train.optim import NAG, build_optimizer

    cfg = compose(["--batch-size", "1", "--optimizer", "nag", "--weight-decay", "0.1"])
    assert cfg.optimizer.momentum == 0.99
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, NAG) and opt.param_groups[0]["momentum"] == 0.99
    before = [p.detach().clone() for p in model.parameters()]
    state = get_optimizer_state_dict(model, opt)["state"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert {k for v in state.values() for k in v} == {"momentum_buffer", "lr_old"}
    # The lr of the last step comes back exactly (torch would cast a tensor to float32).
    for group in opt.param_groups:
        group["lr"] = 1 / 3
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    again = build_optimizer(model, cfg)
    again.load_state_dict(opt.state_dict())
    assert [float(s["lr_old"]) for s in again.state.values()] == [1 / 3] * 2
    assert [type(s["lr_old"]) for s in opt.state.values()] == [float] * 2  # state_dict() left them floats


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--optimizer", "cpu_adam"], "add --cpu-offload"),
        (["--optimizer", "adam", "--momentum", "0.9"], "--momentum is read by --optimizer sgd or nag only"),
        (["--optimizer", "nag", "--adam-betas", "(0.9, 0.98)"], "--adam-betas is read by --optimizer adam"),
        (["--lr-scheduler", "inverse_sqrt", "--min-lr", "1e-9"], "--stop-min-lr"),
        (["--lr-scheduler", "fixed", "--lr-patience", "2"], "reduce_lr_on_plateau only"),
        (["--lr-scheduler", "fixed", "--t-mult", "2"], "--t-mult is read by --lr-scheduler cosine only"),
        (["--lr-scheduler", "cosine", "--max-update", "10", "--t-mult", "0"], "--t-mult must be positive"),
        (
            ["--lr-scheduler", "cosine", "--max-update", "100", "--t-mult", "0.5", "--lr-period-updates", "10"],
            "shrinks the cosine cycles to 20 updates",
        ),
        (["--lr-scheduler", "cosine"], "needs --lr-period-updates or --max-update"),
        (["--lr-scheduler", "cosine", "--max-update", "10", "--lr-period-updates", "0"], "--lr-period-updates must"),
        (["--lr-scheduler", "cosine", "--max-update", "10", "--lr-shrink", "0"], "--lr-shrink must be positive"),
        (["--lr-scheduler", "reduce_lr_on_plateau", "--lr-shrink", "1"], r"--lr-shrink must be in \(0, 1\)"),
        (["--lr-scheduler", "reduce_lr_on_plateau", "--lr-patience", "-1"], "lr_patience must be >= 0"),
    ],
)
def test_optimizer_and_schedule_options_are_checked(argv, message):
    from trainer.errors import UsageError

    with pytest.raises(UsageError, match=message):
        compose(["--batch-size", "1"] + argv)


def test_optimizer_and_schedule_options_in_their_pairings_are_accepted():
    compose(["--batch-size", "1", "--optimizer", "cpu_adam", "--cpu-offload", "--ddp-backend", "fully_sharded"])
    compose(
        [
            "--batch-size",
            "1",
            "--optimizer",
            "nag",
            "--momentum",
            "0.9",
            "--lr-scheduler",
            "cosine",
            "--max-update",
            "100",
            "--t-mult",
            "0.5",
            "--lr-period-updates",
            "60",
            "--lr-shrink",
            "0.5",
        ]
    )
    compose(
        [
            "--batch-size",
            "1",
            "--lr-scheduler",
            "reduce_lr_on_plateau",
            "--lr-shrink",
            "0.5",
            "--lr-patience",
            "2",
            "--lr-threshold",
            "0.01",
            "--stop-min-lr",
            "1e-6",
        ]
    )


def test_no_weight_decay_on_biases_norms_and_embeddings():
    from models.transformer_lm import build_model
    from trainer.train.optim import param_groups

    cfg = compose(["--batch-size", "1", "--arch", "transformer_lm_gpt2_tiny", "--decoder-learned-pos"])
    model = build_model(cfg.model, 100, 16)
    decay, rest = param_groups(model, 0.1)
    decayed = {id(p) for p in decay["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert names and all(
        n.endswith(("qkv_proj.weight", "out_proj.weight", "fc1.weight", "fc2.weight", "output_projection.weight"))
        for n in names
    )
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0


def _shard_local_rank(index, world, port, out):
    """One rank: the same sharded model stepped by torch's AdamW (through DTensor's dispatch),
    by ShardLocalAdamW, and by ShardLocalAdamW stepping the first layer's parameters first
    (parallelize.EarlyGather's order), with clipping by global_grad_norm; returns every value
    as lists, and, for the split step, which parameters had moved when the callback ran."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from trainer.train.optim import ShardLocalAdamW
    from trainer.train.trainer import global_grad_norm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
    try:
        results = {}
        for name in ("AdamW", "ShardLocalAdamW", "first"):
            cls = torch.optim.AdamW if name == "AdamW" else ShardLocalAdamW
            torch.manual_seed(0)
            # 5 rows: uneven shards over 2 ranks, one rank's last shard shorter
            model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            opt = cls(model.parameters(), lr=0.01, weight_decay=0.1, fused=True)
            moved_at_callback = []
            if name == "first":
                params = list(model.parameters())

                # Reads this iteration's `before`, assigned below, when the step calls it.
                def callback():
                    moved = [not torch.equal(p.to_local(), b) for p, b in zip(params, before)]  # noqa: B023
                    moved_at_callback.append(moved)  # noqa: B023

                step_kwargs = dict(first={id(p) for p in model[0].parameters()}, then=callback)
            else:
                step_kwargs = {}
            norms = []
            for step in range(3):
                torch.manual_seed(100 + step)
                model(torch.randn(4, 8)).square().sum().backward()
                grads = [p.grad for p in model.parameters()]
                norm = global_grad_norm(grads)
                reference = torch.nn.utils.get_total_norm(grads).full_tensor()
                norms.append([norm.item(), reference.item()])
                torch._foreach_mul_([g.to_local() for g in grads], torch.clamp(0.5 / (norm + 1e-6), max=1.0))
                before = [p.to_local().clone() for p in model.parameters()]
                opt.step(**step_kwargs)
                opt.zero_grad()
            state = opt.state[next(iter(model.parameters()))]
            results[name] = {
                "params": [p.full_tensor().flatten().tolist() for p in model.parameters()],
                "exp_avg_sq": state["exp_avg_sq"].full_tensor().flatten().tolist(),
                "state_is_dtensor": isinstance(state["exp_avg"], DTensor),
                "norms": norms,
                "moved_at_callback": moved_at_callback,
            }
        Path(f"{out}.{index}").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_shard_local_adamw_and_grad_norm_match_torch_on_fsdp_shards(tmp_path):
    from helpers import run_ranks
    from trainer.rendezvous import free_port

    out = tmp_path / "ranks"
    run_ranks(_shard_local_rank, (2, free_port(), str(out)), 2)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    torch_path, local_path = ranks[0]["AdamW"], ranks[0]["ShardLocalAdamW"]
    assert local_path["params"] == torch_path["params"]  # bit for bit: the same kernel on the same elements
    assert local_path["exp_avg_sq"] == torch_path["exp_avg_sq"]
    assert local_path["state_is_dtensor"] and torch_path["state_is_dtensor"]  # checkpoints unchanged
    for norm, reference in local_path["norms"] + torch_path["norms"]:
        assert norm == pytest.approx(reference, rel=1e-6)
    assert local_path["norms"][0][0] > 0.5  # clipping acted
    # Stepping some parameters first changes no value, and the callback runs between the two:
    # the first layer's weight and bias have moved, the other four parameters not yet.
    split = ranks[0]["first"]
    assert split["params"] == torch_path["params"] and split["exp_avg_sq"] == torch_path["exp_avg_sq"]
    assert split["moved_at_callback"] == [[True, True, False, False, False, False]] * 3


CLIP = 0.05  # far below the tiny model's first gradient norm: the step is scaled


def _clipping_rank(index, world, ports, out):
    """One update of SGD (no momentum) from the same weights and batch, without and with
    --clip-norm CLIP: each rank's shard of every parameter moved by -lr*g, and by -lr*g
    scaled by CLIP / (|g| + 1e-6), |g| the norm of the whole gradient over all ranks."""
    import torch

    from data.iterator import grouped
    from helpers import DUMMY
    from trainer.parallel import ranks
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    fsdp = ["--ddp-backend", "fully_sharded", "--distributed-world-size", str(world)] if world > 1 else []
    moves, gnorms = [], []
    # A port per run: the first run's store may still be closing when the second one meets.
    for clip, port in zip(("0", str(CLIP)), ports):
        rdv = Rendezvous(
            f"tcp://127.0.0.1:{port}" if world > 1 else "", world, rank=index, local_rank=index, local_world_size=world
        )
        cfg = compose(DUMMY + fsdp + ["--optimizer", "sgd", "--lr", "0.5", "--batch-size", "4", "--clip-norm", clip])
        env = ranks.init_rank(cfg, rdv, needs_process_group=world > 1)
        try:
            task, trainer, _ = build(cfg, env)
            local = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.model.parameters()]
            before = [t.detach().clone() for t in local]
            samples = next(grouped(task.batch_iterator(cfg.dataset.train_subset, training=True).next_epoch_itr(), 1))
            gnorms.append(trainer.train_step(samples).values()["gnorm"])
            trainer.finish()
            moves.append(torch.cat([(t.detach() - b).flatten() for t, b in zip(local, before)]))
        finally:
            ranks.teardown()
    Path(f"{out}.{index}").write_text(
        json.dumps({"gnorms": gnorms, "free": moves[0].tolist(), "clipped": moves[1].tolist()})
    )


@pytest.mark.parametrize("world", [1, 2], ids=["1_process", "fsdp_2_ranks"])
def test_clip_norm_scales_the_step_by_clip_over_the_norm(world, tmp_path):
    import torch

    from helpers import run_ranks
    from trainer.rendezvous import free_port

    out = tmp_path / "moves"
    first = free_port()
    second = next(port for port in iter(free_port, None) if port != first)
    run_ranks(_clipping_rank, (world, [first, second], str(out)), world)
    for rank in range(world):
        r = json.loads(Path(f"{out}.{rank}").read_text())
        norm, clipped_norm = r["gnorms"]
        assert clipped_norm == pytest.approx(norm, rel=1e-6)  # gnorm is logged before clipping
        assert norm > 10 * CLIP
        free, clipped = torch.tensor(r["free"]), torch.tensor(r["clipped"])
        expected = free * (CLIP / (norm + 1e-6))
        assert expected.abs().max() > 1e-4
        # A move is read off fp32 weights: within their rounding (|w| < 1), of 6e-8.
        torch.testing.assert_close(clipped, expected, rtol=1e-4, atol=1.2e-7)
