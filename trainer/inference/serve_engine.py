"""What `serve` needs from an engine, and the simplest engine that provides it.

The HTTP side (trainer/inference/serve.py) only ever calls:

    handle = engine.submit(GenerationRequest(...))   # from the event loop; raises QueueFull
    async for event in handle: ...                   # TokenEvent, prompt tokens first with echo
    handle.cancel()                                  # from the event loop; frees the slot soon
    handle.finish_reason                             # "stop" | "length" | "cancelled", after the loop
    engine.tokenizer, engine.max_positions, engine.close()
    engine.stats()                                   # {"running", "waiting", "generated_tokens"}: /health

so a batched engine (continuous batching) replaces SequentialEngine by providing the same.
SequentialEngine runs one request at a time on one worker thread, through the same
KV-cached loop and sampler as `generate` (models/generate.py), so greedy text equals it.
"""

import asyncio
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from models.generate import next_token
from models.kv_cache import KVCache


class QueueFull(Exception):
    """No room for another waiting request: the server answers 429."""


@dataclass
class GenerationRequest:
    prompt_ids: list  # scored and continued as given: the caller adds any start token
    max_tokens: int  # new tokens at most; 0 only scores the prompt (echo)
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0  # the same seed gives the same tokens, whatever else runs
    stop_ids: tuple = ()  # ids that end the sequence; not emitted
    logprobs: int = None  # None: no log-probabilities; k >= 0: the chosen token's and the k best
    echo: bool = False  # emit the prompt's tokens (with their log-probabilities) first


@dataclass
class TokenEvent:
    token_id: int
    logprob: float = None  # log p(token | tokens before it) under the model (no temperature): None for
    top_logprobs: dict = field(default_factory=dict)  # the first prompt token, or without logprobs
    prompt: bool = False  # an echoed prompt token


_DONE = object()


class Handle:
    """One submitted request: an async iterator of its TokenEvents, fed by the engine's thread."""

    def __init__(self, request, loop):
        self.request = request
        self.finish_reason = None
        self._loop = loop
        self._events = asyncio.Queue()
        self._cancelled = threading.Event()

    def cancel(self):
        self._cancelled.set()

    @property
    def cancelled(self):
        return self._cancelled.is_set()

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

    # The engine's side, from its own thread.
    def _push(self, item):
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel()

    def emit(self, event):
        self._push(event)

    def finish(self, reason, error=None):
        self.finish_reason = reason
        self._push(error if error is not None else _DONE)


class SequentialEngine:
    """One request at a time on a worker thread; at most `max_queue` requests wait."""

    def __init__(self, model, tokenizer, banned=(), max_queue=64):
        self.model = model
        self.tokenizer = tokenizer
        self.max_positions = model.max_positions
        self.banned = list(banned)  # fairseq's generator never emits <pad>
        self._waiting = queue.Queue(maxsize=max_queue) if max_queue > 0 else None
        self._running = 0
        self._generated = 0  # tokens sampled since start: /health shows the engine's progress
        self._thread = threading.Thread(target=self._work, name="serve-engine", daemon=True)
        self._thread.start()

    def submit(self, request):
        """Queue a request; call from the event loop that will iterate the handle."""
        handle = Handle(request, asyncio.get_running_loop())
        if self._waiting is None:
            raise QueueFull("the server takes no waiting requests (--max-queue 0)")
        try:
            self._waiting.put_nowait(handle)
        except queue.Full:
            raise QueueFull(f"{self._waiting.maxsize} requests are already waiting") from None
        return handle

    def stats(self):
        waiting = self._waiting.qsize() if self._waiting else 0
        return {"running": self._running, "waiting": waiting, "generated_tokens": self._generated}

    def close(self, timeout=5.0):
        """Stop the worker after the request it runs (which its caller should have cancelled)."""
        if self._waiting is not None:
            while True:  # what still waits will never run: end it so no one waits on it
                try:
                    self._waiting.get_nowait().finish("cancelled")
                except queue.Empty:
                    break
            self._waiting.put(None)
        self._thread.join(timeout)

    def _work(self):
        while True:
            handle = self._waiting.get()
            if handle is None:
                return
            if handle.cancelled:  # its client left while it waited
                handle.finish("cancelled")
                continue
            self._running = 1
            try:
                handle.finish(self._run(handle))
            except Exception as e:  # one bad request must not stop the worker: its client hears of it
                handle.finish("error", error=RuntimeError(f"{type(e).__name__}: {e}"))
            finally:
                self._running = 0

    @torch.no_grad()
    def _run(self, handle):
        req, model = handle.request, self.model
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(req.seed)
        ids = list(req.prompt_ids)
        cache = KVCache(model, 1, len(ids) + req.max_tokens)
        logits = model(torch.tensor([ids], device=device), cache)[0]
        if req.echo:
            scores = F.log_softmax(logits[:-1].float(), dim=-1) if req.logprobs is not None else None
            for i, token in enumerate(ids):
                prompt_scored = scores is not None and i > 0
                event = self._event(token, scores[i - 1] if prompt_scored else None, req.logprobs)
                event.prompt = True
                handle.emit(event)
        last = logits[-1]
        for step in range(req.max_tokens):
            if handle.cancelled:
                return "cancelled"
            if self.banned:
                last[self.banned] = float("-inf")
            token = next_token(last, req.temperature, 0, req.top_p, generator)
            if token in req.stop_ids:
                return "stop"
            scores = F.log_softmax(last.float(), dim=-1) if req.logprobs is not None else None
            handle.emit(self._event(token, scores, req.logprobs))
            self._generated += 1
            if step + 1 < req.max_tokens:
                last = model(torch.tensor([[token]], device=device), cache)[0, -1]
        return "length"

    @staticmethod
    def _event(token, scores, k):
        if scores is None:
            return TokenEvent(token)
        top = {}
        if k:
            values, indices = torch.topk(scores, min(k, scores.numel()))
            top = {int(i): float(v) for v, i in zip(values, indices)}
        return TokenEvent(token, float(scores[token]), top)
