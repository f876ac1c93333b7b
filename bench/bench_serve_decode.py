"""serve's text, decoded incrementally against decoded whole for each token: the time of a
4,000-token echo (lm-evaluation-harness's loglikelihood: the prompt as token ids, echo,
logprobs 1, max_tokens 0), and of a 4,000-token streamed completion with a stop string.

Before data/incremental_decode.py, serve decoded every prefix of the prompt again for each
token's text_offset, and the whole continuation again for each streamed token: quadratic,
on the event loop. The old functions (trainer/serve/text.py before it) are kept
here and swapped into trainer/serve/app.py for the "old" runs, so both run in one
process on the same requests: the real Starlette app, driven in process through httpx's
ASGI transport, over an engine that hands back ready-made tokens at once (what is timed is
serve's own work, as it holds the event loop, not a model's). Each request's answer from
the old code and the new is checked to be the same, byte for byte (but its id and time).

Tokenizers: the embedded corpus's sentencepiece model (what `preprocess` trains), and a
byte-level BPE (Llama 3's kind) trained here on the same text. Old and new alternate within
each repetition; medians. Goal: the echo ≥ 10× faster (the old way grows with the square of
the tokens, the new linearly).

Usage: python bench/bench_serve_decode.py [--reps 5] [--tokens 4000] [--quick]
"""

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from benchlib import ROOT, goal, median, note, parser, report

sys.path.insert(0, str(ROOT))  # bench scripts run as files: the repository's modules come after this

import httpx  # noqa: E402
from old_serve_text import OldStopText, old_continuation_text, old_text_offsets  # noqa: E402

from data.embedded_corpus import prepare_embedded_corpus  # noqa: E402
from data.hf_tokenizer import HFTokenizer  # noqa: E402
from data.tokenizer import load_tokenizer  # noqa: E402
from trainer.serve import app as serve  # noqa: E402
from trainer.serve.batching import TokenEvent  # noqa: E402

NEW = {name: getattr(serve, name) for name in ("StopText", "ContinuationText", "IncrementalText", "text_offsets")}
OLD = {
    "StopText": OldStopText,
    "ContinuationText": lambda decode, context: lambda new: old_continuation_text(decode, context, new),
    "IncrementalText": lambda decode: decode,
    "text_offsets": old_text_offsets,
}


def use(names):
    for name, value in names.items():
        setattr(serve, name, value)


# ------------------------------------------------- an engine that has its tokens ready
class ReadyHandle:
    def __init__(self, request, new_ids):
        self.request, self.new_ids = request, new_ids
        self.finish_reason, self.stop_event = "length", None

    def cancel(self):
        pass

    async def __aiter__(self):
        k = self.request.logprobs
        scored = k is not None
        if self.request.echo:
            for i, t in enumerate(self.request.prompt_ids):
                yield TokenEvent(t, -1.5 if scored and i else None, {t: -1.5} if scored and i else {}, prompt=True)
        for t in self.new_ids[: self.request.max_tokens]:
            yield TokenEvent(t, -1.5 if scored else None, {t: -1.5} if scored else {})


class ReadyEngine:
    def __init__(self, tokenizer, new_ids):
        self.tokenizer, self.new_ids, self.max_positions = tokenizer, new_ids, 1 << 20

    def submit(self, request):
        return ReadyHandle(request, self.new_ids)

    def stats(self):
        return {"running": 0, "waiting": 0, "generated_tokens": 0}


# ------------------------------------------------- the requests
def tokenizers(tmp):
    """(name, tokenizer) of the two kinds, and the corpus text."""
    data = prepare_embedded_corpus()
    text = (data / "text" / "valid.txt").read_text(encoding="utf-8")
    made = [("sentencepiece (embedded corpus)", load_tokenizer(data))]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=8000, show_progress=False, initial_alphabet=alphabet, special_tokens=["<|end_of_text|>", "<|pad|>"]
    )
    tok.train_from_iterator(text.splitlines(), trainer)
    tok.save(str(Path(tmp) / "tokenizer.json"))
    config = {"eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}
    (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
    made.append(("byte-level BPE (Llama 3's kind)", HFTokenizer(tmp)))
    return made, text


async def timed(app, body):
    """(seconds, the answer without its id and time) of one request to /v1/completions."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:
        t = time.perf_counter()
        if body.get("stream"):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line]
        else:
            r = await client.post("/v1/completions", json=body)
            lines = [r.text]
        seconds = time.perf_counter() - t
    answer = []
    for line in lines:
        data = json.loads(line.removeprefix("data: ")) if line != "data: [DONE]" else None
        if isinstance(data, dict):
            data.pop("id", None), data.pop("created", None)
        answer.append(data)
    return seconds, answer


def main():
    p = parser(__doc__, reps=5)
    p.add_argument("--tokens", type=int, default=4000, help="tokens of the echoed prompt and of the completion")
    p.add_argument("--quick", action="store_true", help="one repetition of 1,000 tokens: a check that it runs")
    a = p.parse_args()
    reps, n = (1, 1000) if a.quick else (a.reps, a.tokens)
    rows, goals = [], []
    with tempfile.TemporaryDirectory() as tmp:
        made, text = tokenizers(tmp)
        for name, tok in made:
            ids = tok.encode(text)
            assert len(ids) >= 2 * n, f"the corpus has {len(ids)} tokens, fewer than {2 * n}"
            prompt, new = ids[:n], ids[n : 2 * n]
            app = serve.build_app(serve.Served(ReadyEngine(tok, new), "m", [tok.eos], [tok.eos]))
            requests = {
                "echo": dict(model="m", prompt=prompt, max_tokens=0, echo=True, logprobs=1),
                "stream": dict(model="m", prompt=prompt[:8], max_tokens=n, stream=True, stop=["\x00never\x00"]),
            }
            times = {(what, how): [] for what in requests for how in ("old", "new")}
            for rep in range(reps + 1):  # the first is a warm-up
                for what, body in requests.items():
                    answers = {}
                    for how, names in (("old", OLD), ("new", NEW)):
                        use(names)
                        try:
                            seconds, answers[how] = asyncio.run(timed(app, body))
                        finally:
                            use(NEW)
                        if rep:
                            times[what, how].append(seconds)
                    assert answers["old"] == answers["new"], f"{name}, {what}: the answers differ"
                if rep:
                    last = [f"{w} {h} {times[w, h][-1] * 1000:.0f} ms" for w in requests for h in ("old", "new")]
                    note(f"{name} rep {rep}: " + ", ".join(last))
            for what in requests:
                old, new = median(times[what, "old"]), median(times[what, "new"])
                rows.append((name, what, old, new))
            old, new = median(times["echo", "old"]), median(times["echo", "new"])
            goals.append(
                goal(
                    f"serve {n}-token echo with logprobs, {name}: decoded whole vs incrementally",
                    f"{old / new:.1f}× faster ({old * 1000:.0f} vs {new * 1000:.0f} ms)",
                    "≥ 10×" if n >= 4000 else "≥ 10× at 4,000 tokens (not run)",
                    old / new >= 10 if n >= 4000 else None,
                )
            )
    print(f"\nserve's own time for a request (an engine with its tokens ready), {reps} repetitions, medians\n")
    print("| tokenizer | request | decoded whole (old), ms | incrementally (new), ms | old / new |")
    print("|---|---|---|---|---|")
    what_is = {
        "echo": f"{n}-token prompt as ids, echo, logprobs 1, max_tokens 0",
        "stream": f"{n} tokens streamed, a stop string",
    }
    for name, what, old, new in rows:
        print(f"| {name} | {what_is[what]} | {old * 1000:.0f} | {new * 1000:.0f} | {old / new:.1f}× |")
    report(goals, a.results)


if __name__ == "__main__":
    main()
