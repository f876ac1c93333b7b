"""serve: the real `openai` client against the real server on localhost.

The model is a tiny random Llama (a Hugging Face directory) with Llama 3.1's chat template
and a small byte-level tokenizer, as tests/test_chat_generate.py builds it. Two servers run
as subprocesses of the command itself: one for what a user asks, one with --max-queue 1 and
--api-key for the limits, which a SIGTERM then stops."""

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import byte_level_tokenizer

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = (Path(importlib.util.find_spec("trl").origin).parent / "chat_templates" / "llama3_1.jinja").read_text()
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]
WORDS = "the a fox dog runs jumps over lazy quick brown cat sees big tree house".split()
KEY = "sk-test"
POSITIONS = 512
LIMIT = 300  # the second server's --max-positions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import random

    root = tmp_path_factory.mktemp("serve")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(60)]
    tok = byte_level_tokenizer(lines, SPECIALS, bos="<|begin_of_text|>", vocab_size=300)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,  # one key/value head: shared by the 2 ranks of the tensor-parallel server
        max_position_embeddings=POSITIONS,
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=[ids["<|end_of_text|>"], ids["<|eot_id|>"]],
        pad_token_id=ids["<|pad|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.ndim > 1 else 1.0)
        # No special token is ever likely: greedy text runs to max_tokens, so a request lasts as asked.
        model.lm_head.weight[list(ids.values())] = 0.0
    path = root / "tiny-chat"
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>"}
    tokenizer_config.update(eos_token="<|end_of_text|>", pad_token="<|pad|>", chat_template=TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def _start(path, port, *flags):
    code = "import sys, cli; sys.exit(cli.serve_main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "--path", str(path), "--port", str(port), "--cpu", *flags]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_healthy(proc, url):
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("serve did not answer /health in 60 s")


@pytest.fixture(scope="module")
def servers(model_dir):
    from trainer.rendezvous import free_port

    ports = free_port(), free_port()
    procs = [
        _start(model_dir, ports[0]),
        _start(
            model_dir,
            ports[1],
            "--max-batch",
            "1",
            "--max-queue",
            "1",
            "--api-key",
            KEY,
            "--bf16",
            "--max-positions",
            str(LIMIT),
        ),
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for proc, url in zip(procs, urls):
            _wait_healthy(proc, url)
        yield list(zip(urls, procs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers[0][0] + "/v1", api_key="unused", max_retries=0)


def test_completion_greedy_is_generate(client, model_dir, capsys):
    import cli

    prompt = "the quick brown fox"
    capsys.readouterr()
    assert (
        cli.generate_main(
            ["--path", str(model_dir), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]
        )
        == 0
    )
    expected = capsys.readouterr().out.rstrip("\n")
    assert client.models.list().data[0].id == "tiny-chat"
    out = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0, echo=True)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    # Without echo: the continuation alone; as token ids: the same tokens.
    plain = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0)
    assert prompt + plain.choices[0].text == expected


def test_logprobs_echo_score_the_prompt_as_lm_eval_asks(client, model_dir):
    """lm-evaluation-harness's loglikelihood: token ids, echo, max_tokens 0, logprobs 1."""
    from data.hf_tokenizer import HFTokenizer
    from trainer.inference.load import load_model

    tok = HFTokenizer(model_dir)
    ids = tok.encode("the lazy dog sees a cat")
    out = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids)
    model = load_model(str(model_dir))[0]
    with torch.no_grad():
        scores = torch.log_softmax(model(torch.tensor([ids]))[0, :-1].float(), -1)
    expected = [float(scores[i, t]) for i, t in enumerate(ids[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    text = out.choices[0].text
    assert [text[o:] for o in lp.text_offset] == [tok.decode(ids[i:]) for i in range(len(ids))]


def test_stop_seed_and_n(client):
    kw = dict(model="tiny-chat", prompt="a big tree", max_tokens=20, seed=7, n=2)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text  # each choice draws its own tokens
    word = first.choices[0].text.split()[1]
    stopped = client.completions.create(**kw, stop=[word])
    assert stopped.choices[0].text == first.choices[0].text.split(word)[0]
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_and_its_stream(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the quick fox"}]
    reply = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, temperature=0)
    text = reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens == 10 and text
    stream = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = client.completions.create(model="tiny-chat", prompt="a dog", max_tokens=8, temperature=0, stream=True)
    whole = client.completions.create(model="tiny-chat", prompt="a dog", max_tokens=8, temperature=0)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


@pytest.mark.parametrize(
    "body,status,param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"model": "tiny-chat", "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "tiny-chat", "prompt": "hi", "temperature": True}, 400, "temperature"),
        ({"model": "tiny-chat", "prompt": 5}, 400, "prompt"),
        ({"model": "tiny-chat", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "tiny-chat", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny-chat", "prompt": [7] * (POSITIONS + 1), "max_tokens": 1}, 400, "prompt"),
        ({"model": "tiny-chat", "prompt": [10**6]}, 400, "prompt"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors_and_serving_goes_on(servers, client, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(servers[0][0] + "/v1/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and "Traceback" not in r.text
    assert client.completions.create(model="tiny-chat", prompt="hi", max_tokens=1).choices[0].text is not None


def test_the_client_sees_its_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny-chat", prompt="the " * 300, max_tokens=400)


def test_disconnect_frees_the_slot(servers, client):
    health = lambda: httpx.get(servers[0][0] + "/health").json()
    before = health()["generated_tokens"]
    stream = client.completions.create(model="tiny-chat", prompt="a", max_tokens=500, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    while health()["running"]:
        time.sleep(0.01)
    assert health()["generated_tokens"] - before < 400  # it stopped soon after the client left


def test_bf16_and_max_positions(servers, model_dir):
    """--bf16: the weights are cast as they are read; greedy text is the bf16 model's own.
    --max-positions: requests are bounded by it, not by the model's positions."""
    from models.generate import sample
    from trainer.inference.load import load_model

    url = servers[1][0]
    assert [httpx.get(u + "/health").json()["dtype"] for u, _ in servers] == ["float32", "bfloat16"]
    model, _, tok = load_model(str(model_dir), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompt = "the quick brown fox"
    ids = tok.encode(prompt)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0, echo=True)
    assert out.choices[0].text == tok.decode(ids + sample(model, ids, 12, temperature=0))
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {LIMIT} tokens"):
        client.completions.create(model="tiny-chat", prompt=ids, max_tokens=LIMIT - len(ids) + 1)


def test_a_cache_too_big_for_the_host_is_refused_in_one_line(model_dir, capsys):
    import cli

    assert cli.serve_main(["--path", str(model_dir), "--cpu", "--max-batch", str(10**8), "--port", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"serve: error: the KV cache of --max-batch {10**8} rows x 512 "), err
    assert err[0].endswith("GB free: lower --max-positions (or --max-batch)"), err


def test_api_key_full_queue_then_sigterm(servers, model_dir):
    url, proc = servers[1]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    long = dict(model="tiny-chat", prompt="a", max_tokens=LIMIT - 2, temperature=0)
    running = client.completions.create(**long, stream=True)
    next(iter(running))  # the engine runs it now
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(client.completions.create(**long)))
    waiting.start()
    while httpx.get(url + "/health").json()["waiting"] < 1:
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(**long)
    assert httpx.get(url + "/health").status_code == 200
    # SIGTERM while requests are in flight: they finish, then the server exits 0.
    proc.send_signal(signal.SIGTERM)
    text = "".join(c.choices[0].text for c in running)
    waiting.join(60)
    assert proc.wait(60) == 0
    assert text and answers[0].choices[0].finish_reason == "length"


def test_a_completion_ended_by_eos_lists_it_for_lm_eval(model_dir):
    """lm-evaluation-harness scores a text with echo, max_tokens 1 and logprobs, and sums
    token_logprobs[len(context):-1]: the last entry must be the new token's, also when the
    model's next token is an eos (a trained LM after a sentence). serve lists it, as OpenAI's
    API and vLLM do; the text leaves it out. In process, with that token made an eos id."""
    from starlette.testclient import TestClient

    from data.hf_tokenizer import HFTokenizer
    from trainer.inference.load import load_model
    from trainer.serve.app import Served, build_app
    from trainer.serve.batching import BatchedEngine

    model, _, tok = load_model(str(model_dir))
    ids = HFTokenizer(model_dir).encode("the lazy dog sees a cat")
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
    eos = int(logp[-1].argmax())  # the greedy next token, served as an eos id
    engine = BatchedEngine(model, tok, max_batch=2)
    try:
        app = build_app(Served(engine, "m", start_ids=[], stop_ids=[eos]))
        with TestClient(app) as http:
            body = dict(model="m", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
            choice = http.post("/v1/completions", json=body).json()["choices"][0]
    finally:
        engine.close()
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "stop" and choice["text"] == tok.decode(ids)
    assert len(lp["token_logprobs"]) == len(ids) + 1 and len(lp["text_offset"]) == len(ids) + 1
    expected = [float(logp[i, t]) for i, t in enumerate(ids[1:] + [eos])]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    assert lp["text_offset"][-1] == len(choice["text"])
