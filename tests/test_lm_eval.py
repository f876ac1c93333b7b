"""lm-evaluation-harness against serve: a log-likelihood multiple-choice task through
`local-completions` and a generate-until task through `local-chat-completions` score what
`--model hf` scores on the same exported model, served sharded over two ranks (the longest
path: tests/test_serve_sharded.py shows two ranks answer as one process does). Both tasks
are local (a YAML over a jsonl in the test's directory) and the tokenizer is the model's
directory: nothing from the hub."""

import json
import shutil
import signal

import pytest
from test_serve import _start, _wait_healthy, model_dir  # noqa: F401 (a fixture)
from test_serve_sharded import ranks_end_with

lm_eval = pytest.importorskip("lm_eval")

MC = [
    {"question": "the quick brown", "choices": [" fox", " tree", " house"], "answer": 0},
    {"question": "a lazy dog", "choices": [" runs", " sees", " jumps over"], "answer": 2},
    {"question": "the big", "choices": [" cat", " dog"], "answer": 1},
    {"question": "a fox jumps over the", "choices": [" lazy dog", " brown tree", " house"], "answer": 0},
]
GEN = [{"question": "the quick brown fox", "answer": "jumps"}, {"question": "a big tree", "answer": "house"}]


def _tasks(root):
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\n"
    (root / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (root / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: answer\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(root))


def _evaluate(model, model_args, task, tasks, **kw):
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task], task_manager=tasks, log_samples=True, **kw
    )
    samples = out["samples"][task]
    return out["results"][task], [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]


def _without_bos(source, root):
    """The model with a tokenizer that adds no <|begin_of_text|> to a text (GPT-2's way).
    With tokenized_requests=False lm-eval sends context + continuation as one text and takes
    the continuation's scores from position len(context tokens) on, counting the context as
    its tokenizer encodes it without special tokens: a server that starts a text with bos (as
    serve and vLLM do for Llama 3's tokenizer) gets every score shifted by one token."""
    path = root / "tiny-nobos"
    shutil.copytree(source, path)
    tok = json.loads((path / "tokenizer.json").read_text())
    tok["post_processor"] = tok["post_processor"]["processors"][0]  # ByteLevel only: no bos
    (path / "tokenizer.json").write_text(json.dumps(tok))
    return path


def test_lm_eval_through_two_serving_ranks_scores_as_hf(model_dir, tmp_path, monkeypatch):  # noqa: F811
    from trainer.rendezvous import free_port

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = _tasks(tmp_path)
    model_dir = _without_bos(model_dir, tmp_path)
    port = free_port()
    proc = _start(model_dir, port, "--distributed-world-size", "2")
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url)
        api = f"model=tiny-nobos,tokenizer={model_dir},tokenizer_backend=huggingface,tokenized_requests=False"
        served, served_resps = _evaluate("local-completions", f"{api},base_url={url}/v1/completions", "tiny_mc", tasks)
        hf, hf_resps = _evaluate("hf", f"pretrained={model_dir},device=cpu", "tiny_mc", tasks)
        assert served["acc,none"] == hf["acc,none"] and served["acc_norm,none"] == hf["acc_norm,none"]
        for got, want in zip(served_resps, hf_resps):  # each choice's log-likelihood
            assert [r[0][0] for r in got] == pytest.approx([r[0][0] for r in want], abs=1e-3)
        chat, chat_resps = _evaluate(
            "local-chat-completions",
            f"{api},base_url={url}/v1/chat/completions",
            "tiny_gen",
            tasks,
            apply_chat_template=True,
        )
        hf_chat, hf_chat_resps = _evaluate(
            "hf", f"pretrained={model_dir},device=cpu", "tiny_gen", tasks, apply_chat_template=True
        )
        assert chat_resps == hf_chat_resps and chat["exact_match,none"] == hf_chat["exact_match,none"]
        assert ranks_end_with(proc, signal.SIGTERM) == 0  # drained, and no rank outlives the launcher
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
