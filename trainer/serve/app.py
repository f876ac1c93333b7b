"""serve: an OpenAI-compatible HTTP server over a model (/v1/completions, /v1/chat/completions,
/v1/models, /health).

Starlette + uvicorn: an ASGI app streams server-sent events from an async generator, and
Starlette cancels that generator when the client hangs up, which cancels its request in the
engine; uvicorn drains the requests in flight on SIGTERM/Ctrl-C up to a deadline. Requests
are checked by trainer/serve/openai_api.py; tokens come from an engine
(trainer/serve/batching.py describes the interface).
"""

import json
import secrets
import sys
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from data.incremental_decode import IncrementalText
from trainer.errors import UsageError
from trainer.inference.chat import render_chat
from trainer.serve import openai_api as api
from trainer.serve.batching import GenerationRequest, QueueFull
from trainer.serve.text import ContinuationText, StopText, text_offsets


class Served:
    """What the routes need: the engine, the model's name, and how it reads and writes text."""

    def __init__(self, engine, name, start_ids, stop_ids, chat=None, api_key=None, dtype="float32"):
        self.engine, self.name, self.api_key, self.dtype = engine, name, api_key, dtype
        self.tokenizer = engine.tokenizer
        self.start_ids = start_ids  # put before a text prompt (a fairseq LM's eos); HF: none
        self.stop_ids = tuple(stop_ids)
        self.chat = chat  # (template, specials, end-of-turn id) of a chat model, else None

    def piece(self, token_id):
        return self.tokenizer.decode([token_id])


def build_app(served):
    def route(path, fn, methods):
        async def endpoint(request):
            try:
                if path.startswith("/v1/") and served.api_key is not None:
                    _check_key(request, served.api_key)
                return await fn(request, served)
            except api.ApiError as e:
                return JSONResponse(e.body(), status_code=e.status)

        return Route(path, endpoint, methods=methods)

    async def http_error(request, exc):
        return JSONResponse(
            api.ApiError(exc.status_code, str(exc.detail), type="invalid_request_error").body(), exc.status_code
        )

    async def server_error(request, exc):  # logged by uvicorn; the client gets OpenAI's body, not a traceback
        return JSONResponse(api.ApiError(500, f"internal error: {type(exc).__name__}", type="server_error").body(), 500)

    routes = [
        route("/v1/completions", completions, ["POST"]),
        route("/v1/chat/completions", chat_completions, ["POST"]),
        route("/v1/models", models, ["GET"]),
        route("/health", health, ["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


def _check_key(request, key):
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise api.ApiError(
            401,
            "Incorrect API key provided: send 'Authorization: Bearer KEY' with serve's --api-key",
            code="invalid_api_key",
        )


async def health(request, served):
    return JSONResponse({"status": "ok", "model": served.name, "dtype": served.dtype, **served.engine.stats()})


async def models(request, served):
    return JSONResponse(
        {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "shardlm"}]}
    )


async def completions(request, served):
    body = api.parse_body(await request.body())
    common, opts = api.sampling(body, served.name), api.completion_options(body)
    jobs = []  # (ids the model reads, how many of them are the start served.start_ids added)
    for prompt in api.completion_prompts(body):
        ids = served.start_ids + served.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        start = len(served.start_ids) if isinstance(prompt, str) else 0
        _check_ids(ids, served, "prompt")
        api.check_length(len(ids), opts["max_tokens"], served.engine.max_positions, "prompt")
        jobs.append((ids, start))
    handles = _submit(served, common, opts, [ids for ids, _ in jobs])
    n = common["n"]
    choices = [(i, jobs[i // n], h) for i, h in enumerate(handles)]
    created, cid = int(time.time()), "cmpl-" + secrets.token_hex(12)
    decode = served.tokenizer.decode

    def new_text(ids, start):
        return StopText(ContinuationText(decode, ids[start:]), common["stop"])

    if common["stream"]:

        async def chunks():
            for index, (ids, start), handle in choices:
                text = new_text(ids, start)
                if opts["echo"]:
                    yield _completion_chunk(cid, created, served, index, decode(ids[start:]))
                async for event in _new_tokens(handle, text):
                    yield _completion_chunk(cid, created, served, index, text.push(event.token_id))
                rest = text.flush()
                yield _completion_chunk(cid, created, served, index, rest, _finish(handle, text))

        return _sse(chunks(), handles)
    out, usage = [], [0, 0]
    try:
        for index, (ids, start), handle in choices:
            text = new_text(ids, start)
            events = []
            async for e in _new_tokens(handle, text, keep_prompt=True):
                events.append(e)
                if not e.prompt:
                    text.push(e.token_id)
            prompt_events = [e for e in events if e.prompt][start:]
            new_events = [e for e in events if not e.prompt]
            shown = ids[start:]
            offsets = text_offsets(decode, shown, [e.token_id for e in new_events])
            kept = text.kept_tokens(len(decode(shown)), offsets[len(shown) :])
            logprobs = None
            if opts["logprobs"] is not None:
                listed = prompt_events + new_events[:kept]
                first = 0 if opts["echo"] else len(shown)
                listed_offsets = offsets[first : len(shown) + kept]
                if handle.stop_event is not None and not text.stopped:  # the eos that ended it, after the text
                    listed.append(handle.stop_event)
                    listed_offsets.append(len(decode(shown)) + len(text.text))
                logprobs = api.legacy_logprobs(listed[first:], listed_offsets, served.piece)
            prefix = decode(shown) if opts["echo"] else ""
            out.append(
                {
                    "index": index,
                    "text": prefix + text.text,
                    "logprobs": logprobs,
                    "finish_reason": _finish(handle, text),
                }
            )
            usage[0], usage[1] = usage[0] + len(ids), usage[1] + kept
    finally:
        for h in handles:
            h.cancel()
    return JSONResponse(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": served.name,
            "choices": out,
            "usage": _usage(*usage),
        }
    )


async def chat_completions(request, served):
    body = api.parse_body(await request.body())
    common, opts = api.sampling(body, served.name), api.chat_options(body)
    messages = api.chat_messages(body)
    if served.chat is None:
        raise api.ApiError(400, f"'{served.name}' has no chat template: use /v1/completions", param="messages")
    template, specials, end_of_turn = served.chat
    try:
        ids = served.tokenizer.encode_rendered(render_chat(template, messages, True, specials))
    except UsageError as e:
        raise api.ApiError(400, str(e), param="messages") from None
    room = served.engine.max_positions - len(ids)
    opts["max_tokens"] = opts["max_tokens"] if opts["max_tokens"] is not None else max(room, 1)
    api.check_length(len(ids), opts["max_tokens"], served.engine.max_positions, "messages")
    stops = served.stop_ids + ((end_of_turn,) if end_of_turn is not None else ())
    handles = _submit(served, common, {**opts, "echo": False}, [ids], stops)
    created, cid = int(time.time()), "chatcmpl-" + secrets.token_hex(12)
    decode = served.tokenizer.decode_without_specials

    if common["stream"]:

        async def chunks():
            for index, handle in enumerate(handles):
                text = StopText(IncrementalText(decode), common["stop"])
                yield _chat_chunk(cid, created, served, index, {"role": "assistant", "content": ""})
                async for event in _new_tokens(handle, text):
                    delta = text.push(event.token_id)
                    lp = api.chat_logprobs([event], served.piece) if opts["logprobs"] is not None else None
                    if delta or lp:
                        yield _chat_chunk(cid, created, served, index, {"content": delta}, logprobs=lp)
                rest = text.flush()
                yield _chat_chunk(cid, created, served, index, {"content": rest} if rest else {}, _finish(handle, text))

        return _sse(chunks(), handles)
    out, completion_tokens = [], 0
    try:
        for index, handle in enumerate(handles):
            text = StopText(IncrementalText(decode), common["stop"])
            events = []
            async for e in _new_tokens(handle, text):
                events.append(e)
                text.push(e.token_id)
            logprobs = (
                api.chat_logprobs(events[: len(text.ids)], served.piece) if opts["logprobs"] is not None else None
            )
            message = {"role": "assistant", "content": text.text}
            out.append(
                {"index": index, "message": message, "logprobs": logprobs, "finish_reason": _finish(handle, text)}
            )
            completion_tokens += len(text.ids)
    finally:
        for h in handles:
            h.cancel()
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": served.name,
            "choices": out,
            "usage": _usage(len(ids) * len(handles), completion_tokens),
        }
    )


def _check_ids(ids, served, param):
    vocab = len(served.tokenizer.pieces())
    if not ids:
        raise api.ApiError(400, "the prompt is empty: this model has no start token to begin from", param=param)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise api.ApiError(400, f"token id {bad} is outside the model's vocabulary of {vocab}", param=param)


def _submit(served, common, opts, prompts, stops=None):
    """n requests per prompt; all or none (429), so a full queue never half-answers."""
    seed = common["seed"] if common["seed"] is not None else secrets.randbits(62)
    handles = []
    try:
        for ids in prompts:
            for j in range(common["n"]):
                request = GenerationRequest(
                    prompt_ids=ids,
                    max_tokens=opts["max_tokens"],
                    temperature=common["temperature"],
                    top_p=common["top_p"],
                    seed=seed + j,
                    stop_ids=served.stop_ids if stops is None else stops,
                    logprobs=opts["logprobs"],
                    echo=opts["echo"],
                )
                handles.append(served.engine.submit(request))
    except QueueFull as e:
        for h in handles:
            h.cancel()
        raise api.ApiError(
            429, f"The server is busy ({e}): retry later", code="rate_limit_exceeded", type="requests"
        ) from None
    except ValueError as e:  # the engine's own checks (the API's should have caught it first)
        for h in handles:
            h.cancel()
        raise api.ApiError(400, str(e)) from None
    return handles


async def _new_tokens(handle, text, keep_prompt=False):
    """The handle's events until it ends or the text meets a stop string (then it is cancelled)."""
    try:
        async for event in handle:
            if event.prompt and not keep_prompt:
                continue
            yield event
            if text.stopped:
                handle.cancel()
                return
    except RuntimeError as e:  # the engine failed this request (and keeps serving others)
        raise api.ApiError(500, f"generation failed: {e}", type="server_error") from None


def _finish(handle, text):
    return "stop" if text.stopped or handle.finish_reason == "stop" else "length"


def _usage(prompt, completion):
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_chunk(cid, created, served, index, text, finish=None):
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": cid, "object": "text_completion", "created": created, "model": served.name, "choices": [choice]}


def _chat_chunk(cid, created, served, index, delta, finish=None, logprobs=None):
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": served.name, "choices": [choice]}


def _sse(chunks, handles):
    """Server-sent events: `data: {json}` per chunk, then `data: [DONE]`. Starlette cancels
    this generator when the client disconnects; `finally` then frees the engine's slots."""

    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except api.ApiError as e:  # the status line is sent already: the error is the last event
            yield f"data: {json.dumps(e.body())}\n\n"
            print(f"serve: a stream ended early: {e.message}", file=sys.stderr)
        finally:
            for h in handles:
                h.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
