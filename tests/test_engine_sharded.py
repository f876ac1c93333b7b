"""serve with a model sharded across ranks: rank 0's Engine broadcasts each step's
operations, rank 1 runs the same forwards (FSDP gathers each layer in them), and the greedy
completions equal one process's `sample`."""

import json
from pathlib import Path

import pytest
from test_engine import PROMPTS
from test_generate import MAX_POSITIONS, VOCAB, tiny_config, tiny_model

from helpers import run_ranks
from models.generate import sample


def _serve_sharded(index, port, out, tensor_parallel=False):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from models.transformer_lm import build_model
    from trainer.parallel.parallelize import materialize_shards
    from trainer.parallel.serve_steps import broadcast_op, receive_op
    from trainer.parallel.tensor_parallel import apply_tensor_parallel
    from trainer.serve.engine import Engine, GenerationRequest, follow_ops

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=2)
    try:
        if tensor_parallel:  # half of every layer's heads and width, and of the vocabulary, a rank
            model = build_model(tiny_config(), VOCAB, MAX_POSITIONS, device="meta")
            apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
            materialize_shards(model, "cpu", "cpu", seed=3)
            model.eval()
        else:
            model = tiny_model()
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
        if index == 0:
            with Engine(model, max_batch=3, broadcast=broadcast_op) as engine:
                handles = [engine.submit(GenerationRequest(p, max_tokens=10, temperature=0)) for p in PROMPTS]
                got = [[t.id for t in h.result(timeout=60).tokens] for h in handles]
            Path(out).write_text(json.dumps(got))
        else:
            follow_ops(model, receive_op, max_batch=3)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_sharded_greedy_equals_one_process(tmp_path, tensor_parallel):
    """FSDP: each layer gathered for its forward; tensor parallelism (serve
    --model-parallel-size): each rank its heads, width and vocabulary rows, the logits gathered."""
    from trainer.rendezvous import free_port

    out = tmp_path / "completions.json"
    run_ranks(_serve_sharded, (free_port(), str(out), tensor_parallel), 2)
    model = tiny_model()
    assert json.loads(out.read_text()) == [sample(model, p, 10, temperature=0) for p in PROMPTS]
