"""serve under load: tokens/s of 16 concurrent clients against 1, and one request's latency
against `generate`'s sampler on the same model and prompt.

The model: `train --arch transformer_lm` (fairseq's base LM: 6 layers of 512, FFN 2048; the
table gives its parameter count) for a few updates on the embedded corpus (its weights
barely matter, so long as they are a trained run's; its shape and tokenizer are what a user
serves). --arch transformer_lm_gpt2_tiny (≈0.4 ms a token) measures serving's own overhead
instead: there HTTP and JSON cost more than the model. `serve --cpu` runs it
with OMP_NUM_THREADS=1, and this process times models.generate.sample (what `generate`
runs) with one thread too, so both compute alike. Clients are the `openai` package's, each
asking /v1/completions for --tokens tokens, greedy, with a stop string that never appears
(the request then ends at max_tokens); each of the 16 has its own prompt.
Runs alternate (1 client, 16 clients, one request, sample, …); medians. Goals: 16 clients
≥ 5× the tokens/s of 1 (the batched engine shares each forward among them); one request
≤ 1.2× sample's time (serving's HTTP and scheduling overhead is small).

--stream: every request streams, and the table adds the time to first token (the median
over the requests of a run) of 1 client and of --clients. --device cuda serves on the GPU
(the model trained there for its 3 updates), --bf16 in bfloat16: the GPU check is
`--device cuda --bf16 --arch llama3_2_1b --clients 32 --tokens 128 --stream`.

Usage: python bench/bench_serve.py [--arch transformer_lm] [--reps 3] [--tokens 64] [--quick]
                                   [--clients 16] [--stream] [--device cpu|cuda] [--bf16]
"""

import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import torch

from benchlib import BIN, ROOT, goal, median, note, parser, report

PROMPT = "The quick brown fox"


def train_model(save_dir, a):
    """A checkpoint of `a.arch` after 3 updates, with room for the prompt and a.tokens."""
    positions = max(128, a.tokens + 64)
    args = ["--arch", a.arch, "--batch-size", "8", "--tokens-per-sample", str(positions)]
    args += ["--max-update", "3", "--save-dir", save_dir, "--log-format", "none"]
    args += ["--cpu"] if a.device == "cpu" else ["--bf16"] if a.bf16 else []
    subprocess.run([str(BIN / "train"), *args], check=True, capture_output=True, cwd=ROOT)
    return os.path.join(save_dir, "checkpoint_last")


def start_server(path, port, a):
    code = "import sys, cli; sys.exit(cli.serve_main(sys.argv[1:]))"
    argv = [
        sys.executable,
        "-c",
        code,
        "--path",
        path,
        "--port",
        str(port),
        "--max-batch",
        str(a.clients),
        "--model-name",
        "m",
    ]
    argv += (["--cpu"] if a.device == "cpu" else []) + (["--bf16"] if a.bf16 else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("serve did not answer /health in 120 s")


def complete(client, prompt, tokens, stream=False):
    """(seconds, seconds to the first token or None, tokens generated) of one request."""
    kw = dict(model="m", prompt=prompt, max_tokens=tokens, temperature=0, stop=["\x00never\x00"])
    t = time.perf_counter()
    if not stream:
        r = client.completions.create(**kw)
        return time.perf_counter() - t, None, r.usage.completion_tokens
    first, made = None, 0
    for chunk in client.completions.create(**kw, stream=True):
        if chunk.choices[0].finish_reason is None:  # serve sends a chunk a token, then the last
            first = first or time.perf_counter() - t
            made += 1
    return time.perf_counter() - t, first, made


def tokens_per_s(client, clients, tokens, stream=False):
    """(tokens/s of `clients` concurrent requests, their median time to first token or None)."""
    prompts = [f"{PROMPT} {i}" for i in range(clients)]
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda p: complete(client, p, tokens, stream), prompts))
    seconds = time.perf_counter() - t
    return sum(n for _, _, n in runs) / seconds, median([f for _, f, _ in runs]) if stream else None


def main():
    p = parser(__doc__, reps=3)
    p.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    p.add_argument("--arch", default="transformer_lm", help="the model preset served (train's --arch)")
    p.add_argument("--quick", action="store_true", help="one repetition of 16 tokens: a check that it runs")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (serve's --max-batch)")
    p.add_argument("--stream", action="store_true", help="stream every request; report the time to first token")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where serve and the sampler run")
    p.add_argument("--bf16", action="store_true", help="serve --bf16 (and the sampler's model in bfloat16)")
    a = p.parse_args()
    reps, tokens = (1, 16) if a.quick else (a.reps, a.tokens)
    sys.path.insert(0, str(ROOT))  # bench scripts run as files: the repository's modules come after this
    from models.generate import sample
    from trainer.inference.load import load_model
    from trainer.rendezvous import free_port

    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if a.device == "cuda" else lambda: None
    with tempfile.TemporaryDirectory() as tmp:
        path = train_model(os.path.join(tmp, "ckpt"), a)
        model, _, tokenizer = load_model(path, a.device, dtype=torch.bfloat16 if a.bf16 else None)
        params = sum(p.numel() for p in model.parameters())
        ids = [tokenizer.eos] + tokenizer.encode(PROMPT)  # as serve reads a text prompt
        port = free_port()
        proc = start_server(path, port, a)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=600)
            complete(client, PROMPT, tokens)  # warm-up, both sides
            sample(model, ids, tokens, temperature=0)
            one, many, first_one, first_many, latency, direct = [], [], [], [], [], []
            for rep in range(reps):
                rate, first = tokens_per_s(client, 1, tokens, a.stream)
                one.append(rate)
                first_one.append(first)
                rate, first = tokens_per_s(client, a.clients, tokens, a.stream)
                many.append(rate)
                first_many.append(first)
                seconds, _, made = complete(client, PROMPT, tokens)
                latency.append(seconds)
                sync()
                t = time.perf_counter()
                with torch.no_grad():
                    out = sample(model, ids, tokens, temperature=0)
                sync()
                direct.append(time.perf_counter() - t)
                note(
                    f"rep {rep + 1}: 1 client {one[-1]:.0f} tok/s, {a.clients} clients {many[-1]:.0f} tok/s, "
                    f"one request {seconds:.3f} s ({made} tokens), sample {direct[-1]:.3f} s ({len(out)} ids)"
                )
        finally:
            proc.terminate()
            proc.wait(60)
    o, m, lat, d = median(one), median(many), median(latency), median(direct)
    where = "--cpu" if a.device == "cpu" else a.device
    flags = f"{where}{' --bf16' if a.bf16 else ''} --max-batch {a.clients}"
    threads = ", OMP_NUM_THREADS=1," if a.device == "cpu" else ","
    print(f"\n`serve {flags}` on {a.arch} ({params / 1e6:.1f} M parameters, 3 updates){threads}")
    streamed = ", streamed" if a.stream else ""
    print(f"{tokens} greedy tokens per request{streamed}, {reps} alternating repetitions, medians\n")
    print("| measurement | value |")
    print("|---|---|")
    print(f"| 1 client: tokens/s | {o:.0f} |")
    print(f"| {a.clients} concurrent clients: tokens/s | {m:.0f} |")
    if a.stream:
        print(f"| 1 client: time to first token, ms | {1000 * median(first_one):.1f} |")
        print(f"| {a.clients} concurrent clients: time to first token, ms | {1000 * median(first_many):.1f} |")
    print(f"| one request through serve: s | {lat:.3f} |")
    print(f"| models.generate.sample in process: s | {d:.3f} |")
    report(
        [
            goal(
                f"serve {a.arch}: {a.clients} clients vs 1, tokens/s",
                f"{m / o:.2f}× ({m:.0f} vs {o:.0f})",
                "≥ 5×",
                m / o >= 5,
            ),
            goal(
                f"serve {a.arch}: one request vs generate's sampler, latency",
                f"{lat / d:.2f}× ({lat:.3f} vs {d:.3f} s)",
                "≤ 1.2×",
                lat / d <= 1.2,
            ),
        ],
        a.results,
    )


if __name__ == "__main__":
    main()
