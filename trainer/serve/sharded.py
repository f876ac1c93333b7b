"""serve with the model sharded across ranks (--distributed-world-size N, torchrun, SLURM).

Every rank loads the model and shards it with FSDP (trainer/parallel/serve_steps.py): each
layer is gathered for its forward, a collective all ranks join; or, with --model-parallel-size
N (the world size), splits it by heads, width and vocabulary as training's tensor
parallelism does, each rank reading only its share (every forward's collectives are the
layers' own). Rank 0 runs the HTTP server
over the batched Engine, which broadcasts each cache operation and forward before running
it; the other ranks run the same ones (`follow_ops`) until rank 0 sends ("close",).

Stopping: the launcher (or torchrun, or SLURM) passes SIGINT/SIGTERM to every rank. Rank 0's
server drains and closes its engine, which sends ("close",); the others ignore the signals
and end on that op, so none is left in a collective. A rank that dies ends the job through
the launcher (its ranks also die with it: trainer/launch/local_ranks.py).
"""

import functools
import signal

from trainer.errors import UsageError
from trainer.inference.load import load_model, weights_dtype
from trainer.parallel.ranks import init_rank, teardown
from trainer.parallel.serve_steps import broadcast_op, op_group, receive_op, shard_for_serving
from trainer.serve import command as serve_command
from trainer.serve.engine import follow_ops


def run(args, cfg, rdv):
    """One rank of a sharded serve (launched like eval-lm: spawned, torchrun or SLURM)."""
    env = init_rank(cfg, rdv, needs_process_group=True)
    try:
        if env.tp not in (1, env.world_size):
            raise UsageError(
                f"serve --model-parallel-size {env.tp}: split the model over all {env.world_size} ranks "
                "(--model-parallel-size equal to the world size) or shard it with FSDP (1)"
            )
        model, model_cfg, tokenizer = load_model(
            args.path, env.device, dtype=weights_dtype(args), ema=args.ema, env=env
        )
        if tokenizer is None:
            raise UsageError(f"{args.path} has no tokenizer: serve reads and writes text, so it needs the model's own")
        if env.tp == 1:
            shard_for_serving(model.eval(), env.device)
        # every rank holds its cache (under tensor parallelism its heads' share): each checks
        # its own, so that none is left waiting
        serve_command.check_cache_fits(model, args, ranks_here=env.local_world_size, heads_share=env.tp)
        group = op_group()
        if env.rank == 0:
            broadcast = functools.partial(broadcast_op, group=group)
            return serve_command.serve(args, loaded=(model, model_cfg, tokenizer), broadcast=broadcast)
        # Rank 0 decides when the job stops and tells us with ("close",): a signal here would
        # leave it alone in the next all-gather.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        # the same rows as rank 0's engine: both caches must agree
        follow_ops(
            model, functools.partial(receive_op, group=group), max_batch=args.max_batch, max_len=args.max_positions
        )
        return 0
    finally:
        teardown()
