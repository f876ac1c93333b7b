"""serve with the model sharded across ranks (--distributed-world-size N, torchrun, SLURM).

Every rank loads the model and shards it with FSDP (trainer/parallel/serve_steps.py): each
layer is gathered for its forward, a collective all ranks join. Rank 0 runs the HTTP server
over the batched Engine, which broadcasts each cache operation and forward before running
it; the other ranks run the same ones (`follow_ops`) until rank 0 sends ("close",).

Stopping: the launcher (or torchrun, or SLURM) passes SIGINT/SIGTERM to every rank. Rank 0's
server drains and closes its engine, which sends ("close",); the others ignore the signals
and end on that op, so none is left in a collective. A rank that dies ends the job through
the launcher (its ranks also die with it: trainer/launch/local_ranks.py).
"""

import asyncio
import functools
import signal
import threading

from trainer.errors import UsageError
from trainer.inference import serve_command
from trainer.inference.engine import Engine, follow_ops
from trainer.inference.engine import GenerationRequest as EngineRequest
from trainer.inference.load import load_model
from trainer.inference.serve_engine import Handle, QueueFull, TokenEvent
from trainer.parallel.ranks import init_rank, teardown
from trainer.parallel.serve_steps import broadcast_op, op_group, receive_op, shard_for_serving

MAX_BATCH = 16  # rows decoded together: rank 0's Engine and the followers' caches must agree


class BroadcastingEngine:
    """serve's engine interface (trainer/inference/serve_engine.py) over the batched Engine
    with a broadcast hook: each request's tokens are relayed to its async Handle by a
    thread of its own."""

    def __init__(self, model, tokenizer, banned, max_queue, broadcast):
        self.tokenizer, self.max_positions = tokenizer, model.max_positions
        self.max_queue = max_queue
        self._engine = Engine(model, tokenizer, max_batch=MAX_BATCH, banned=banned, broadcast=broadcast)
        self._lock = threading.Lock()
        self._in_flight, self._generated = 0, 0

    def submit(self, request):
        with self._lock:
            if self._in_flight >= MAX_BATCH + self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting")
            self._in_flight += 1
        handle = Handle(request, asyncio.get_running_loop())
        try:
            job = self._engine.submit(
                EngineRequest(
                    list(request.prompt_ids),
                    max_tokens=request.max_tokens,
                    temperature=request.temperature,
                    top_p=request.top_p,
                    stop_ids=tuple(request.stop_ids),
                    seed=request.seed,
                    logprobs=request.logprobs,
                    echo=request.echo,
                )
            )
        except Exception:
            with self._lock:
                self._in_flight -= 1
            raise
        threading.Thread(target=self._relay, args=(handle, job), daemon=True).start()
        return handle

    def _relay(self, handle, job):
        scored = handle.request.logprobs is not None
        echoed = not handle.request.echo
        try:
            for token in job:
                if handle.cancelled:
                    job.cancel()
                if not echoed:  # the prompt is scored before the first token is picked
                    self._echo(handle, job.prompt, scored)
                    echoed = True
                handle.emit(TokenEvent(token.id, token.logprob, dict(token.top)))
                self._generated += 1
            if not echoed and job.prompt is not None:
                self._echo(handle, job.prompt, scored)
            handle.finish(job.finish_reason)
        except Exception as e:  # the model failed: this request's client hears of it
            handle.finish("error", error=RuntimeError(f"{type(e).__name__}: {e}"))
        finally:
            with self._lock:
                self._in_flight -= 1

    @staticmethod
    def _echo(handle, prompt, scored):
        for token in prompt:
            event = TokenEvent(token.id, token.logprob if scored else None, dict(token.top) if scored else {})
            event.prompt = True
            handle.emit(event)

    def stats(self):
        with self._lock:
            in_flight = self._in_flight
        running = min(in_flight, MAX_BATCH)
        return {"running": running, "waiting": in_flight - running, "generated_tokens": self._generated}

    def close(self, timeout=5.0):
        self._engine.close()  # requests not finished end "cancelled"; the other ranks get ("close",)


def run(args, cfg, rdv):
    """One rank of a sharded serve (launched like eval-lm: spawned, torchrun or SLURM)."""
    env = init_rank(cfg, rdv, needs_process_group=True)
    try:
        model, model_cfg, tokenizer = load_model(args.path, env.device)
        if tokenizer is None:
            raise UsageError(f"{args.path} has no tokenizer: serve reads and writes text, so it needs the model's own")
        shard_for_serving(model.eval(), env.device)
        group = op_group()
        if env.rank == 0:
            broadcast = functools.partial(broadcast_op, group=group)
            make_engine = functools.partial(BroadcastingEngine, broadcast=broadcast)
            return serve_command.serve(args, loaded=(model, model_cfg, tokenizer), make_engine=make_engine)
        # Rank 0 decides when the job stops and tells us with ("close",): a signal here would
        # leave it alone in the next all-gather.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        follow_ops(model, functools.partial(receive_op, group=group), max_batch=MAX_BATCH)
        return 0
    finally:
        teardown()
