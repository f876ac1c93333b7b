"""What `serve` needs from an engine: the batched Engine (trainer/serve/engine.py) seen
from an asyncio event loop.

The HTTP side (trainer/serve/app.py) only ever calls:

    handle = engine.submit(GenerationRequest(...))   # from the event loop; raises QueueFull
    async for event in handle: ...                   # TokenEvent, prompt tokens first with echo
    handle.cancel()                                  # from the event loop; frees the row soon
    handle.finish_reason                             # "stop" | "length" | "cancelled", after the loop
    engine.tokenizer, engine.max_positions, engine.close()
    engine.stats()                                   # {"running", "waiting", "generated_tokens"}: /health

Engine's handles are fed on its own thread and read by blocking; an event loop must not
block, so each handle here gets the engine's tokens through a listener that hands them to
the loop (call_soon_threadsafe). Engine's waiting list has no bound; this one refuses a
request once `max_queue` wait (429), so a burst cannot queue unbounded work.
"""

import asyncio
from dataclasses import dataclass, field

from trainer.serve.engine import Engine, GenerationRequest

__all__ = ["BatchedEngine", "GenerationRequest", "Handle", "QueueFull", "TokenEvent"]


class QueueFull(Exception):
    """No room for another waiting request: the server answers 429."""


@dataclass
class TokenEvent:
    token_id: int
    logprob: float = None  # log p(token | tokens before it) under the model (no temperature): None for
    top_logprobs: dict = field(default_factory=dict)  # the first prompt token, or without logprobs
    prompt: bool = False  # an echoed prompt token


_DONE = object()


class Handle:
    """One submitted request: an async iterator of its TokenEvents."""

    def __init__(self, request, loop, on_token):
        self.request = request
        self.finish_reason = None
        self.stop_event = None  # with logprobs, the eos or stop id that ended it (a TokenEvent)
        self.generation = None  # the Engine's GenerationHandle, once submitted
        self._loop, self._on_token = loop, on_token
        self._events = asyncio.Queue()
        self._prompt_sent = False

    def cancel(self):
        self.generation.cancel()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            item = await self._events.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    # The engine's side, on its thread.
    def listen(self, gen, token):
        """Engine's listener (gen: its GenerationHandle): the echoed prompt first (Engine scores
        it at prefill, before the first token or the end), then each token, then the end."""
        if not self._prompt_sent and gen.prompt is not None and self.request.echo:
            self._prompt_sent = True
            for t in gen.prompt:
                self._push(_event(t, self.request.logprobs, prompt=True))
        if token is not None:
            self._on_token()
            self._push(_event(token, self.request.logprobs))
            return
        self.finish_reason = gen.finish_reason
        if gen.stop_token is not None:
            self.stop_event = _event(gen.stop_token, self.request.logprobs)
        error = gen.error
        self._push(_DONE if error is None else RuntimeError(f"{type(error).__name__}: {error}"))

    def _push(self, item):
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel()


def _event(token, k, prompt=False):
    if k is None:  # Engine scores echoed prompts anyway; the API shows scores only when asked
        return TokenEvent(token.id, prompt=prompt)
    return TokenEvent(token.id, token.logprob, dict(token.top), prompt)


class BatchedEngine:
    """Engine (continuous batching, `max_batch` rows) behind serve's interface; at most
    `max_queue` requests wait for a row."""

    def __init__(self, model, tokenizer, banned=(), max_batch=16, max_queue=64, max_len=None, broadcast=None):
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        # serve passes each request's stop ids and checks prompts itself: no eos ids or bos here.
        # broadcast: a sharded serve's rank 0 sends each cache operation and forward to the
        # ranks that follow it (trainer/serve/sharded.py)
        self._engine = Engine(
            model, tokenizer, max_batch=max_batch, max_len=max_len, banned=banned, broadcast=broadcast
        )
        self.max_positions = self._engine.cache.max_len
        self._generated = 0  # tokens made since start: /health shows the engine's progress

    def submit(self, request):
        """Queue a request; call from the event loop that will iterate the handle."""
        stats, rows = self._engine.stats(), self._engine.cache.max_batch
        if stats["running"] + stats["waiting"] >= rows + self.max_queue:
            raise QueueFull(f"{rows} requests are running and {self.max_queue} waiting")
        handle = Handle(request, asyncio.get_running_loop(), self._count)
        handle.generation = self._engine.submit(request, listener=handle.listen)
        return handle

    def _count(self):
        self._generated += 1

    def stats(self):
        return {**self._engine.stats(), "generated_tokens": self._generated}

    def close(self):
        """Stop the engine; what still runs or waits ends "cancelled"."""
        self._engine.close()
