"""fairseq's learning-rate schedules, the weight-decay parameter groups, and AdamW and the
gradient norm on FSDP2's shards (2 real gloo ranks)."""
import json
import math
from pathlib import Path

import pytest

from helpers import compose


def schedule(*argv):
    from trainer.train.optim import LRSchedule
    return LRSchedule(compose(["--batch-size", "1"] + list(argv)))


def test_inverse_sqrt_warms_up_then_decays_as_one_over_sqrt():
    s = schedule("--lr-scheduler", "inverse_sqrt", "--lr", "0.01", "--warmup-updates", "100")
    assert s.lr(0) == pytest.approx(0.01 / 100) and s.lr(99) == pytest.approx(0.01)
    assert s.lr(400) == pytest.approx(0.01 * math.sqrt(100 / 400))


def test_polynomial_decay_reaches_end_lr():
    s = schedule("--lr-scheduler", "polynomial_decay", "--lr", "0.01", "--warmup-updates", "10",
                 "--max-update", "110", "--end-learning-rate", "0.001")
    assert s.lr(10) == pytest.approx(0.01) and s.lr(60) == pytest.approx(0.0055)
    assert s.lr(110) == pytest.approx(0.001) and s.lr(500) == pytest.approx(0.001)


def test_cosine_and_fixed():
    s = schedule("--lr-scheduler", "cosine", "--lr", "0.01", "--min-lr", "0.001", "--max-update", "100")
    assert s.lr(0) == pytest.approx(0.01) and s.lr(50) == pytest.approx(0.0055) and s.lr(100) == pytest.approx(0.001)
    assert schedule("--lr", "0.3").lr(12345) == 0.3


def test_no_weight_decay_on_biases_norms_and_embeddings():
    from models.transformer_lm import build_model
    from trainer.train.optim import param_groups
    cfg = compose(["--batch-size", "1", "--arch", "transformer_lm_gpt2_tiny", "--decoder-learned-pos"])
    model = build_model(cfg.model, 100, 16)
    decay, rest = param_groups(model, 0.1)
    decayed = {id(p) for p in decay["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert names and all(n.endswith(("qkv_proj.weight", "out_proj.weight", "fc1.weight", "fc2.weight",
                                      "output_projection.weight")) for n in names)
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
    from trainer.train.step import global_grad_norm

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

                def callback():
                    moved_at_callback.append([not torch.equal(p.to_local(), b) for p, b in zip(params, before)])

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
                "state_is_dtensor": isinstance(state["exp_avg"], DTensor), "norms": norms,
                "moved_at_callback": moved_at_callback}
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
