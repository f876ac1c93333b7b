"""serve with a model sharded across ranks: rank 0's Engine broadcasts each step's
operations, rank 1 runs the same forwards (FSDP gathers each layer in them), and the greedy
completions equal one process's `sample`."""

import json
from pathlib import Path

from test_engine import PROMPTS
from test_generate import tiny_model

from helpers import run_ranks
from models.generate import sample


def _serve_sharded(index, port, out):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from trainer.parallel.serve_steps import broadcast_op, receive_op
    from trainer.serve.engine import Engine, GenerationRequest, follow_ops

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=2)
    try:
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


def test_sharded_greedy_equals_one_process(tmp_path):
    from trainer.rendezvous import free_port

    out = tmp_path / "completions.json"
    run_ranks(_serve_sharded, (free_port(), str(out)), 2)
    model = tiny_model()
    assert json.loads(out.read_text()) == [sample(model, p, 10, temperature=0) for p in PROMPTS]
