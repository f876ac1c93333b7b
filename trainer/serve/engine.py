"""The batched generation engine behind `serve`: requests share forward passes.

Requests are submitted from any thread (an HTTP handler's); one background thread owns the
model. Between two decoding steps it retires the rows that finished or were cancelled and
prefills waiting requests into the free rows (continuous batching); each step then runs
every active row over its next token in one forward, each row at its own position in a
BatchKVCache (models/batch_cache.py). A row's tokens are picked by `next_token` from its
own logits with its own generator, so what a request gets does not depend on the requests
it is batched with: greedy decoding gives `models.generate.sample`'s tokens, and a seeded
request the tokens `sample` gives with that seed.

Log-probabilities are natural logs of the model's own distribution (before temperature,
top-p or banned ids), as OpenAI reports them and as eval-lm scores a token.
"""

import collections
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from models.batch_cache import BatchKVCache
from models.generate import next_token


@dataclass
class GenerationRequest:
    """One completion. max_tokens None: until an eos id, a stop, or the model's last
    position. temperature 0: greedy. stop: strings, the completion ends once its text
    contains one (Completion.text stops before it); stop_ids: token ids ending it as the
    engine's eos ids do (neither is returned). seed None: a random one. logprobs: None, or
    k ≥ 0: each token's log-probability and its k most likely alternatives. echo: the
    prompt's tokens' log-probabilities too (with max_tokens 0: score the prompt)."""

    prompt_ids: list
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple = ()
    stop_ids: tuple = ()
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False


@dataclass
class Token:
    """A token id, its log-probability (None where there is none: a prompt's first token,
    or logprobs not asked) and its most likely alternatives [(id, log-probability)]."""

    id: int
    logprob: float | None = None
    top: list = field(default_factory=list)


@dataclass
class Completion:
    tokens: list  # [Token] generated
    finish_reason: str  # "stop" (eos id or stop), "length" (max_tokens or positions), "cancelled"
    prompt: list | None = None  # [Token] of the prompt, with echo
    text: str | None = None  # the tokens decoded (with a tokenizer), cut before a stop string
    stop_token: Token | None = None  # with logprobs, the eos or stop id that ended it (not in tokens)


_END = object()  # the last item of a handle's stream


class GenerationHandle:
    """A submitted request: iterate it for its tokens as they are made, `result()` for the
    whole completion, `cancel()` to free its row (a client gone). listener: called on the
    engine's thread as listener(handle, Token) for each token, then listener(handle, None)
    at the end, for a caller that cannot block on the stream (serve's event loop)."""

    def __init__(self, request, tokenizer, listener=None):
        self.request, self._tokenizer, self._listener = request, tokenizer, listener
        self.tokens, self.prompt, self.finish_reason, self.stop_token = [], None, None, None
        self._stream, self._done, self.error = queue.Queue(), threading.Event(), None
        self.cancelled = False

    def __iter__(self):
        while (item := self._stream.get()) is not _END:
            yield item
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True  # the engine's loop retires the row before its next step

    def done(self):
        return self._done.is_set()

    def result(self, timeout=None):
        if not self._done.wait(timeout):
            raise TimeoutError(f"the completion did not finish in {timeout} s")
        if self.error is not None:
            raise self.error
        return Completion(self.tokens, self.finish_reason, self.prompt, self._text(), self.stop_token)

    def _text(self):
        if self._tokenizer is None:
            return None
        text = self._tokenizer.decode([t.id for t in self.tokens])
        cuts = [text.find(s) for s in self.request.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def _emit(self, token):
        self.tokens.append(token)
        self._stream.put(token)
        if self._listener is not None:
            self._listener(self, token)

    def _finish(self, reason, error=None):
        self.finish_reason, self.error = reason, error
        self._done.set()
        self._stream.put(_END)
        if self._listener is not None:
            self._listener(self, None)


class _Row:
    """The engine's state of a request in the batch: its handle, its generator, the last
    token picked (fed at the next step) and whether it is finished."""

    def __init__(self, handle, device):
        seed = handle.request.seed
        self.handle, self.ids, self.pending, self.finished = handle, [], None, None
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)


class Engine:
    """Continuous batching over `model` (a TransformerLM in eval mode). eos_ids: the ids that
    end every completion (not returned); bos: what an empty prompt starts from; banned: ids
    never picked (fairseq's <pad>); max_batch: rows decoded together; max_len: positions per
    row (default: the model's). broadcast: with a model sharded across ranks, a callable
    sending each cache operation and forward (`apply_op`'s ops) to the other ranks, which
    run them too (`follow_ops`): every rank must run the same forwards."""

    def __init__(
        self, model, tokenizer=None, eos_ids=(), max_batch=16, max_len=None, bos=None, banned=(), broadcast=None
    ):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.eos_ids, self.bos, self.banned = set(eos_ids), bos, list(banned)
        self.device = next(model.parameters()).device
        self.cache = BatchKVCache(model, max_batch, min(max_len or model.max_positions, model.max_positions))
        self._broadcast = broadcast
        self._rows = []  # the requests in the batch, row i of the cache being _rows[i]'s
        self._waiting = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="shardlm-engine", daemon=True)
        self._thread.start()

    def submit(self, request, listener=None):
        """Queue `request` (a GenerationRequest); returns its GenerationHandle at once.
        A request the engine cannot serve raises ValueError here, not in its stream.
        listener: see GenerationHandle."""
        self._check(request)
        handle = GenerationHandle(request, self.tokenizer, listener)
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(handle)
            self._cond.notify()
        return handle

    def score(self, prompt_ids, logprobs=None):
        """[Token] of the prompt: each token's log-probability given the ones before it
        (None for the first), with its `logprobs` most likely alternatives."""
        return self.submit(GenerationRequest(prompt_ids, max_tokens=0, echo=True, logprobs=logprobs)).result().prompt

    def stats(self):
        """Requests decoding now and requests waiting for a row (read without the lock: a
        snapshot for /health)."""
        return {"running": len(self._rows), "waiting": len(self._waiting)}

    def close(self):
        """Stop the loop; requests not finished end "cancelled"."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check(self, r):
        ids = list(r.prompt_ids) or ([] if self.bos is None else [self.bos])
        if not ids:
            raise ValueError("empty prompt, and the engine has no bos id to start from")
        if len(ids) > self.cache.max_len:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the model's {self.cache.max_len} positions")
        if min(ids) < 0 or max(ids) >= self.model.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.model.vocab_size})")
        if r.max_tokens is not None and r.max_tokens < 0:
            raise ValueError(f"max_tokens must be ≥ 0, not {r.max_tokens}")
        if r.temperature < 0 or not 0 < r.top_p <= 1:
            raise ValueError(f"temperature must be ≥ 0 and top_p in (0, 1]; got {r.temperature}, {r.top_p}")
        if r.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass stop_ids")

    def _loop(self):
        while True:
            with self._cond:
                while not (self._closed or self._waiting or self._rows):
                    self._cond.wait()
                if self._closed:
                    break
                free = self.cache.max_batch - len(self._rows)
                admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            try:
                with torch.no_grad():
                    for row in self._rows:
                        if row.handle.cancelled:
                            row.finished = "cancelled"
                    self._retire_finished()
                    for handle in admitted:
                        self._prefill(handle)
                    self._retire_finished()
                    if self._rows:
                        self._step()
                        self._retire_finished()
            except Exception as e:  # the model failed: every request in flight gets the error
                for row in self._rows:
                    row.handle._finish("error", e)
                while self._rows:
                    self._retire(len(self._rows) - 1)
        if self._broadcast is not None:
            self._broadcast(("close",))
        with self._cond:
            ending = [row.handle for row in self._rows] + list(self._waiting)
        for handle in ending:
            handle._finish("cancelled")

    def _prefill(self, handle):
        """Run the prompt into a new row; pick its first token from the last position."""
        if handle.cancelled:
            return handle._finish("cancelled")
        request = handle.request
        ids = list(request.prompt_ids) or [self.bos]
        i = self._run(("add_row",))
        row = _Row(handle, self.device)
        self._rows.append(row)
        logits = self._run(("forward", [ids], i, i + 1))[0]
        if request.echo:
            logp = F.log_softmax(logits[:-1].float(), dim=-1)
            handle.prompt = [Token(ids[0])] + [
                self._token(logp[t], ids[t + 1], request.logprobs or 0) for t in range(len(ids) - 1)
            ]
        if request.max_tokens == 0:
            row.finished = "length"
        else:
            self._take(row, logits[-1], len(ids))

    def _step(self):
        """One forward over every row's pending token, and each row's next pick."""
        logits = self._run(("forward", [[row.pending] for row in self._rows], 0, len(self._rows)))[:, -1]
        for i, row in enumerate(self._rows):
            self._take(row, logits[i], self.cache.lengths[i])

    def _take(self, row, logits, length):
        """Pick the row's next token from its logits (V); `length`: the positions it holds."""
        request = row.handle.request
        picked = logits
        if self.banned:
            picked = logits.clone()
            picked[self.banned] = float("-inf")
        token = next_token(picked, request.temperature, request.top_k, request.top_p, row.generator)
        if token in self.eos_ids or token in request.stop_ids:
            # Not a token of the completion or its text; with logprobs its score is kept all
            # the same, as OpenAI's API and vLLM list it: lm-evaluation-harness scores a text
            # with max_tokens 1 and drops the last entry, counting on it being the new token.
            if request.logprobs is not None:
                row.handle.stop_token = self._token(F.log_softmax(logits.float(), dim=-1), token, request.logprobs)
            row.finished = "stop"
            return
        if request.logprobs is None:
            row.handle._emit(Token(token))
        else:
            row.handle._emit(self._token(F.log_softmax(logits.float(), dim=-1), token, request.logprobs))
        row.ids.append(token)
        if request.stop and any(s in self.tokenizer.decode(row.ids) for s in request.stop):
            row.finished = "stop"
        elif len(row.ids) == request.max_tokens or length >= self.cache.max_len:
            row.finished = "length"  # asked for no more, or no position left to feed it at
        else:
            row.pending = token

    def _run(self, op):
        if self._broadcast is not None:
            self._broadcast(op)
        return apply_op(self.model, self.cache, op)

    @staticmethod
    def _token(logp, token, k):
        top = []
        if k > 0:
            values, ids = logp.topk(min(k, logp.numel()))
            top = list(zip(ids.tolist(), values.tolist()))
        return Token(token, float(logp[token]), top)

    def _retire_finished(self):
        for i in reversed(range(len(self._rows))):
            row = self._rows[i]
            if row.finished:
                row.handle._finish(row.finished)
                self._retire(i)

    def _retire(self, i):
        # The cache moves its last row into row i: the list moves the same way.
        self._run(("remove_row", i))
        self._rows[i] = self._rows[-1]
        self._rows.pop()


def apply_op(model, cache, op):
    """Run one of the engine's operations on a BatchKVCache: ("add_row",) → the new row's
    index; ("remove_row", i); ("forward", token ids (a list per row), first row, stop row)
    → the rows' logits. Plain data, so that rank 0 can send them to the ranks that follow."""
    if op[0] == "add_row":
        return cache.add_row()
    if op[0] == "remove_row":
        return cache.remove_row(op[1])
    _, tokens, start, stop = op
    return model(torch.tensor(tokens, device=next(model.parameters()).device), cache.rows(start, stop))


def follow_ops(model, receive, max_batch=16, max_len=None):
    """What a rank other than 0 runs while rank 0's Engine serves: the same operations, in
    the same order, on a cache of its own, so that a model sharded across the ranks (FSDP
    gathers each layer in its forward, a collective every rank must join) runs the same
    forwards everywhere. receive: a callable returning rank 0's next op; ("close",) ends it."""
    model.eval()
    cache = BatchKVCache(model, max_batch, min(max_len or model.max_positions, model.max_positions))
    with torch.no_grad():
        while (op := receive())[0] != "close":
            apply_op(model, cache, op)
