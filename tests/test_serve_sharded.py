"""serve on two ranks started by torchrun: the model sharded across two gloo ranks (FSDP),
rank 0 serving HTTP. The real `openai` client gets the greedy completions and the prompt
scores one process gives; a SIGTERM to torchrun ends every rank. (tests/test_lm_eval.py
serves with --distributed-world-size 2, whose own launcher exits 0 and leaves no rank.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_serve import _start, _wait_healthy, model_dir  # noqa: F401 (a fixture)

openai = pytest.importorskip("openai")

PROMPTS = ["the quick brown fox", "a big tree", "house", "the lazy dog sees a cat and"]


def _torchrun(path, port, *extra):
    bin_dir = Path(sys.executable).parent
    argv = [bin_dir / "torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()), bin_dir / "serve"]
    argv += ["--path", str(path), "--port", str(port), "--cpu", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def free_port():
    from trainer.rendezvous import free_port

    return free_port()


def ranks_end_with(proc, signum=signal.SIGTERM, seconds=10):
    """Signal `proc` (a launcher); return its exit status once it and every process below it
    have ended, or fail naming a rank that outlived it."""
    ranks = _descendants(proc.pid)
    assert len(ranks) >= 2, ranks
    proc.send_signal(signum)
    code = proc.wait(60)
    deadline = time.time() + seconds
    while any(map(_alive, ranks)) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, ranks)), "a rank outlived the launcher"
    return code


def _descendants(pid):
    """Every process below `pid` (the ranks, the rank server), from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _answers(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    texts = [
        client.completions.create(model="tiny-chat", prompt=p, max_tokens=12, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    scored = client.completions.create(
        model="tiny-chat", prompt=PROMPTS[-1], max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    chat = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "a fox"}], max_tokens=8, temperature=0
    )
    return texts, scored.choices[0].logprobs.token_logprobs, chat.choices[0].message.content


@pytest.mark.parametrize("split", [[], ["--model-parallel-size", "2"]], ids=["fsdp", "tensor_parallel"])
def test_two_torchrun_ranks_serve_as_one_process_and_stop_together(model_dir, split):  # noqa: F811
    """FSDP (each layer gathered for its forward) or tensor parallelism (each rank its share
    of every layer's heads and width, and of the vocabulary, read from the checkpoint)."""
    one, two = free_port(), free_port()
    procs = [_start(model_dir, one), _torchrun(model_dir, two, *split)]
    try:
        for proc, port in zip(procs, (one, two)):
            _wait_healthy(proc, f"http://127.0.0.1:{port}")
        expected = _answers(f"http://127.0.0.1:{one}")
        texts, logprobs, chat = _answers(f"http://127.0.0.1:{two}")
        assert texts == expected[0] and chat == expected[2]
        assert logprobs[0] is None and logprobs[1:] == pytest.approx(expected[1][1:], abs=1e-4)
        # torchrun passes SIGTERM to both ranks, which drain and end; torchrun then reports
        # the signal itself and exits 1, as it does for train.
        ranks_end_with(procs[1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
