"""OpenAI's API as `serve` speaks it: request checks, error bodies, and the legacy logprobs.

Torch-free. Every refusal is an ApiError, which the server turns into OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with its HTTP status, so a client library
raises its usual exception (openai.BadRequestError, …) and the server keeps serving.
Fields OpenAI defines that change nothing here are accepted when they ask for nothing
(presence_penalty 0, no logit_bias); asking for more than serve does is refused, not ignored.
"""

import json


class ApiError(Exception):
    def __init__(self, status, message, param=None, code=None, type="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_body(raw):
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _typed(body, name, kinds, default, what, check=None, why=""):
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int to Python; to JSON it is not a number.
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {what}, not {json.dumps(value)[:40]}", param=name, code="invalid_type")
    if check is not None and not check(value):
        raise ApiError(400, f"'{name}' must be {what}{why}, not {value}", param=name, code="invalid_value")
    return value


def sampling(body, served_model):
    """The fields completions and chat share, checked: model, n, temperature, top_p, seed,
    stop, stream."""
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required: the served model's name (GET /v1/models)", param="model")
    if model != served_model:
        raise ApiError(
            404, f"The model '{model}' does not exist; this server serves '{served_model}'", "model", "model_not_found"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if _typed(body, name, (int, float), 0, "a number") != 0:
            raise ApiError(400, f"'{name}' is not supported by this server: leave it 0", param=name)
    if _typed(body, "logit_bias", (dict,), {}, "an object"):
        raise ApiError(400, "'logit_bias' is not supported by this server", param="logit_bias")
    stop = _typed(body, "stop", (str, list), [], "a string or a list of up to 4 strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    return {
        "n": _typed(body, "n", (int,), 1, "an integer", lambda v: 1 <= v <= 16, " from 1 to 16"),
        "temperature": float(
            _typed(body, "temperature", (int, float), 1.0, "a number", lambda v: 0 <= v <= 2, " from 0 to 2")
        ),
        "top_p": float(_typed(body, "top_p", (int, float), 1.0, "a number", lambda v: 0 < v <= 1, " in (0, 1]")),
        "seed": _typed(body, "seed", (int,), None, "an integer"),
        "stop": stop,
        "stream": _typed(body, "stream", (bool,), False, "a boolean"),
    }


def max_tokens(body, name, default, echo=False):
    """max_tokens ≥ 1; 0 only with echo (lm-evaluation-harness scores a text that way)."""
    least = 0 if echo else 1
    return _typed(body, name, (int,), default, "an integer", lambda v: v >= least, f" >= {least}")


def completion_prompts(body):
    """`prompt`: a string, a list of token ids, or a list of either (one completion each)."""
    prompt = body.get("prompt")

    def is_ids(p):
        return isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(prompt, str) or is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of either", param="prompt")


def completion_options(body):
    echo = _typed(body, "echo", (bool,), False, "a boolean")
    logprobs = _typed(body, "logprobs", (int,), None, "an integer", lambda v: 0 <= v <= 5, " from 0 to 5")
    if body.get("suffix") is not None:
        raise ApiError(400, "'suffix' (insertion) is not supported by this server", param="suffix")
    best_of = _typed(body, "best_of", (int,), None, "an integer")
    if best_of not in (None, 1, body.get("n", 1)):
        raise ApiError(400, "'best_of' is not supported by this server: leave it out", param="best_of")
    return {"echo": echo, "logprobs": logprobs, "max_tokens": max_tokens(body, "max_tokens", 16, echo)}


def chat_messages(body):
    """`messages`: [{role, content}], content a string or a list of text parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(str(p.get("text", "")) for p in content)
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)):
            raise ApiError(
                400, f"messages[{i}] must be {{role: string, content: string or text parts}}", f"messages[{i}]"
            )
        out.append({"role": m["role"], "content": content})
    return out


def chat_options(body):
    logprobs = _typed(body, "logprobs", (bool,), False, "a boolean")
    top = _typed(body, "top_logprobs", (int,), 0, "an integer", lambda v: 0 <= v <= 20, " from 0 to 20")
    limit = max_tokens(body, "max_completion_tokens", None)
    return {"logprobs": top if logprobs else None, "max_tokens": max_tokens(body, "max_tokens", limit)}


def check_length(prompt_len, new_tokens, max_positions, param):
    if prompt_len + new_tokens > max_positions:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_positions} tokens; the request has {prompt_len} "
            f"prompt tokens and asks for {new_tokens} more: shorten the prompt or lower max_tokens",
            param=param,
            code="context_length_exceeded",
        )


def legacy_logprobs(events, offsets, piece):
    """Completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset; `piece`
    names a token id as text."""
    return {
        "tokens": [piece(e.token_id) for e in events],
        "token_logprobs": [e.logprob for e in events],
        "top_logprobs": [
            None if e.logprob is None else {piece(t): lp for t, lp in e.top_logprobs.items()} for e in events
        ],
        "text_offset": offsets,
    }


def chat_logprobs(events, piece):
    """Chat's logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def entry(token_id, lp):
        text = piece(token_id)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top_logprobs.items()]}
            for e in events
        ]
    }
