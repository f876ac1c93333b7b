"""FSDP's CPU collectives (trainer/cpu/gloo_comms.py) against gloo's own, on 3 real ranks and a
2-rank subgroup: the point-to-point reduce-scatter sums exactly what reduce_scatter_tensor
and all_reduce do, deferred or not."""

import json
from pathlib import Path


def _reduce_scatter_rank(index, world, port, out):
    import torch
    import torch.distributed as dist

    from trainer.cpu.gloo_comms import ReduceScatterInBackground

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
    try:
        results = {}
        n = 1000
        # Integer values: every order of summing 3 of them gives the same float.
        torch.manual_seed(index)
        inputs = [torch.randint(-1000, 1000, (world * n,)).float() for _ in range(3)]
        expected = []
        for x in inputs:
            ref = torch.empty(n)
            dist.reduce_scatter_tensor(ref, x.clone(), group=dist.group.WORLD)
            expected.append(ref)
        rs = ReduceScatterInBackground(can_ever_defer=True)
        outputs = [torch.full((n,), float("nan")) for _ in inputs]
        for x, o in zip(inputs[:2], outputs):  # two deferred, as backward issues them
            rs(o, x.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
        rs.wait()
        rs.may_defer = False  # summed before the call returns
        rs(outputs[2], inputs[2].clone(), dist.group.WORLD, dist.ReduceOp.SUM)
        results["world"] = all(torch.equal(o, e) for o, e in zip(outputs, expected))
        # A subgroup (hybrid_shard's shard group): ranks are the group's, not the world's.
        pair = dist.new_group([0, 2])
        if index in (0, 2):
            torch.manual_seed(10 + index)
            x = torch.randn(2 * n)
            summed = x.clone()
            dist.all_reduce(summed, group=pair)
            me = dist.get_rank(pair)
            o = torch.empty(n)
            rs = ReduceScatterInBackground(can_ever_defer=True)
            rs(o, x, pair, dist.ReduceOp.SUM)
            rs.wait()
            results["pair"] = torch.equal(o, summed[me * n : (me + 1) * n])  # bit for bit: a + b == b + a
        Path(f"{out}.{index}").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_point_to_point_reduce_scatter_sums_as_gloo_does(tmp_path):
    from helpers import run_ranks
    from trainer.rendezvous import free_port

    out = tmp_path / "ranks"
    run_ranks(_reduce_scatter_rank, (3, free_port(), str(out)), 3)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(3)]
    assert [r["world"] for r in ranks] == [True] * 3
    assert [ranks[0]["pair"], ranks[2]["pair"]] == [True, True] and "pair" not in ranks[1]
