"""FSDP's CPU collectives (trainer/gloo_comms.py) against gloo's own, on 3 real ranks and a
2-rank subgroup: the point-to-point reduce-scatter sums exactly what reduce_scatter_tensor
and all_reduce do, deferred or not."""
import json
from pathlib import Path


def _reduce_scatter_rank(index, world, port, out):
    import torch
    import torch.distributed as dist
    from trainer.gloo_comms import ReduceScatterInBackground

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
            results["pair"] = torch.equal(o, summed[me * n:(me + 1) * n])  # bit for bit: a + b == b + a
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


def _pooled_buffers_rank(index, world, port, out):
    import time

    import torch
    import torch.distributed as dist
    from trainer.gloo_comms import BroadcastAllGather, LayerBufferPool, ReduceScatterInBackground

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
    try:
        n, group, seen = 1000, dist.group.WORLD, {}
        pool = LayerBufferPool()
        gather, reduce_scatter = BroadcastAllGather(pool), ReduceScatterInBackground(True, pool)

        def all_gather(value):
            out = gather.allocate((world * n,), dtype=torch.float32, device=torch.device("cpu"))
            out[index * n:(index + 1) * n].fill_(value + index)  # FSDP's copy-in
            gather(out, out[index * n:(index + 1) * n], group)
            return out

        def released():
            """gloo's threads drop their hold on a finished transfer's tensors a moment after
            wait() returns (until then the pool rightly hands out a fresh buffer): wait for it."""
            (kept,) = pool.kept.values()
            deadline = time.monotonic() + 10
            while torch._C._storage_Use_Count(kept.untyped_storage()._cdata) > 2 and time.monotonic() < deadline:
                time.sleep(0.001)

        first = all_gather(1.0)
        seen["first"] = first.tolist() == [1.0 + r for r in range(world) for _ in range(n)]
        address = first.data_ptr()
        # Still held: a second layer's gather must get a buffer of its own.
        held = all_gather(10.0)
        seen["held_not_shared"] = held.data_ptr() != address
        del first, held
        released()
        # Released: the next gather reuses it, and every slot is written anew.
        again = all_gather(20.0)
        seen["reused"] = again.data_ptr() == address
        seen["again"] = again.tolist() == [20.0 + r for r in range(world) for _ in range(n)]
        del again
        released()
        # A layer's reduce-scatter input has the gathered size: it reuses the buffer too.
        grads = reduce_scatter.allocate((world * n,), dtype=torch.float32, device=torch.device("cpu"))
        seen["reduce_reuses"] = grads.data_ptr() == address
        grads.copy_(torch.arange(world * n, dtype=torch.float32))
        shard = torch.empty(n)
        reduce_scatter(shard, grads, group, dist.ReduceOp.SUM)
        reduce_scatter.wait()
        seen["sum"] = torch.equal(shard, world * torch.arange(index * n, (index + 1) * n, dtype=torch.float32))
        # The root's gradients (a size no layer gathers) are never kept.
        root = torch.zeros(world * 3 * n)
        reduce_scatter(torch.empty(3 * n), root, group, dist.ReduceOp.SUM)
        reduce_scatter.wait()
        seen["root_kept"] = any(t.data_ptr() == root.data_ptr() for t in pool.kept.values())
        Path(f"{out}.{index}").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


def test_layer_buffers_are_reused_only_once_released(tmp_path):
    """LayerBufferPool on 2 real gloo ranks: a layer's all-gather buffer is handed to the
    next gather or reduce-scatter only once nothing holds it, and what comes out of the
    reused buffer is exactly what a fresh one gives."""
    from helpers import run_ranks
    from trainer.rendezvous import free_port

    out = tmp_path / "ranks"
    run_ranks(_pooled_buffers_rank, (2, free_port(), str(out)), 2)
    for rank in range(2):
        seen = json.loads(Path(f"{out}.{rank}").read_text())
        assert seen == {"first": True, "held_not_shared": True, "reused": True, "again": True,
                        "reduce_reuses": True, "sum": True, "root_kept": False}, seen
