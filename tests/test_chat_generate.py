"""generate --chat: a chat model's replies through its own chat template, stopped at every
eos id its config lists, equal to transformers' greedy `generate` on the same conversation;
and a checkpoint fine-tuned from it exports with its template and eos ids intact.

The model is a tiny random Llama with Llama 3.1's real chat template and a small byte-level
tokenizer of its special tokens. config.json lists two eos ids, <|end_of_text|> (the
tokenizer's eos) and <|eot_id|>; the output rows of <|eot_id|> and of the token the greedy
path would pick a few steps in are swapped, so the reply ends at the second eos: a generate
that stopped at the first only would run to --max-new-tokens."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import byte_level_tokenizer, preprocess_options, train_updates

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# The template Llama 3.1 Instruct ships, as trl keeps it (found without importing trl).
TEMPLATE = (Path(importlib.util.find_spec("trl").origin).parent / "chat_templates" / "llama3_1.jinja").read_text()
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]
WORDS = "the a fox dog runs jumps over lazy quick brown cat sees big tree house user system hello".split()
SYSTEM, PROMPT = "You are terse.", "the quick fox"
MAX_NEW = 16


def _chat(messages):
    return [{"role": r, "content": c} for r, c in messages]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """hf/chat: the model, its template in tokenizer_config.json; hf/jinja: the same model,
    its template in chat_template.jinja (transformers 5's way); hf/plain: no template."""
    import random

    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(60)]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    tok = byte_level_tokenizer(lines, SPECIALS, bos="<|begin_of_text|>", vocab_size=300)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    path = root / "chat"
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=[ids["<|end_of_text|>"], ids["<|eot_id|>"]],
        pad_token_id=ids["<|pad|>"],
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.ndim > 1 else 1.0)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "pad_token": "<|pad|>",
                "chat_template": TEMPLATE,
            }
        )
    )
    # The greedy reply, unstopped; <|eot_id|> takes the place of its first new token from step 2 on.
    prompt = _prompt_ids(path, _chat([("system", SYSTEM), ("user", PROMPT)]))
    with torch.no_grad():
        path_ids = model.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)[
            0, prompt.shape[1] :
        ]
    path_ids = path_ids.tolist()
    step = next(k for k in range(2, MAX_NEW) if path_ids[k] not in path_ids[:k] and path_ids[k] not in ids.values())
    assert not set(ids.values()) & set(path_ids[:step])
    with torch.no_grad():
        rows = model.lm_head.weight
        a, b = path_ids[step], ids["<|eot_id|>"]
        rows[[a, b]] = rows[[b, a]]
    model.save_pretrained(path)
    shutil.copytree(path, root / "jinja")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (root / "jinja" / "chat_template.jinja").write_text(cfg.pop("chat_template"))
    (root / "jinja" / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.copytree(root / "jinja", root / "plain")
    (root / "plain" / "chat_template.jinja").unlink()
    return root


def _prompt_ids(path, messages):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    out = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return out["input_ids"]


def transformers_reply(path, messages):
    """(reply text, new token ids) of transformers' greedy generate, its eos ids config.json's."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _prompt_ids(path, messages)
    with torch.no_grad():
        new = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)[0, ids.shape[1] :].tolist()
    return tok.decode(new, skip_special_tokens=True), new


def run_generate(capsys, *argv, stdin=None, monkeypatch=None):
    import io

    import cli

    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    capsys.readouterr()
    code = cli.generate_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


GREEDY = ["--chat", "--temperature", "0", "--max-new-tokens", str(MAX_NEW)]


def test_chat_reply_is_transformers_and_stops_at_second_eos(hf, capsys, tmp_path):
    from trainer.inference.chat import render_chat, special_tokens

    messages = _chat([("system", SYSTEM), ("user", PROMPT)])
    text, new = transformers_reply(hf / "chat", messages)
    eot = transformers.AutoTokenizer.from_pretrained(hf / "chat").convert_tokens_to_ids("<|eot_id|>")
    assert new[-1] == eot and len(new) < MAX_NEW  # transformers stopped at the second eos
    code, out, err = run_generate(capsys, "--path", hf / "chat", "--system", SYSTEM, "--prompt", PROMPT, *GREEDY)
    assert (code, out, err) == (0, text + "\n", "")
    # --messages: the same conversation from a file, twice (a .jsonl of two conversations).
    (tmp_path / "c.jsonl").write_text((json.dumps(messages) + "\n") * 2)
    assert run_generate(capsys, "--path", hf / "chat", "--messages", tmp_path / "c.jsonl", *GREEDY)[1] == out * 2
    # The model split over 2 tensor-parallel ranks (2 query heads and half the key/value head
    # each), started by generate itself: rank 0 prints the same replies.
    split = subprocess.run(
        [str(Path(sys.executable).with_name("generate")), "--path", hf / "chat", "--messages", tmp_path / "c.jsonl"]
        + [*GREEDY, "--model-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (split.returncode, split.stdout) == (0, out * 2), split.stderr
    # The template renders as transformers renders it, multi-turn, both template locations.
    turns = messages + _chat([("assistant", "a dog"), ("user", "and then?")])
    for name in ("chat", "jinja"):
        tok = transformers.AutoTokenizer.from_pretrained(hf / name)
        theirs = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        assert render_chat(tok.chat_template, turns, True, special_tokens(hf / name)) == theirs


def test_chat_stops_at_end_of_turn_no_config_names(hf, capsys, tmp_path):
    """A model whose config names only <|end_of_text|> still ends its reply where its
    template ends an assistant turn (<|eot_id|>), as a chat model learned to."""
    only_end = tmp_path / "only-end"
    shutil.copytree(hf / "jinja", only_end)
    end = transformers.AutoTokenizer.from_pretrained(only_end).convert_tokens_to_ids("<|end_of_text|>")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((only_end / name).read_text())
        (only_end / name).write_text(json.dumps({**config, "eos_token_id": end}))
    text, new = transformers_reply(hf / "chat", _chat([("system", SYSTEM), ("user", PROMPT)]))
    assert len(new) < MAX_NEW and new[-1] != end
    code, out, _ = run_generate(capsys, "--path", only_end, "--system", SYSTEM, "--prompt", PROMPT, *GREEDY)
    assert (code, out) == (0, text + "\n")


def test_plain_generate_stops_at_every_eos_id(hf, capsys):
    """Without --chat too: the rendered conversation as a plain prompt stops at <|eot_id|>,
    which only config.json names (the tokenizer's eos is <|end_of_text|>)."""
    from data.hf_tokenizer import HFTokenizer

    messages = _chat([("system", SYSTEM), ("user", PROMPT)])
    _, new = transformers_reply(hf / "chat", messages)
    prompt = _prompt_ids(hf / "chat", messages)[0].tolist()
    tok = HFTokenizer(hf / "chat")
    assert prompt[0] == tok.bos and new[-1] != tok.eos  # plain generate puts bos before the prompt itself
    argv = ["--path", hf / "chat", "--prompt", tok.decode(prompt[1:]), "--temperature", "0"]
    code, out, err = run_generate(capsys, *argv, "--max-new-tokens", MAX_NEW)
    assert (code, out, err) == (0, tok.decode(prompt[1:] + new[:-1]) + "\n", "")


def test_stdin_is_one_multi_turn_conversation(hf, capsys, monkeypatch):
    lines = ["hello there", "the lazy dog"]
    messages, expected = [], ""
    for line in lines:
        messages.append({"role": "user", "content": line})
        reply, _ = transformers_reply(hf / "jinja", messages)
        messages.append({"role": "assistant", "content": reply})
        expected += reply + "\n"
    code, out, err = run_generate(
        capsys, "--path", hf / "jinja", *GREEDY, stdin="\n".join(lines) + "\n", monkeypatch=monkeypatch
    )
    assert (code, out, err) == (0, expected, "")


def test_refused_in_one_line(hf, capsys, tmp_path):
    for argv, why in (
        (["--path", hf / "plain", "--prompt", "hi", *GREEDY], "has no chat template"),
        (["--path", hf / "chat", "--system", "x", "--prompt", "hi"], "add --chat"),
        (["--path", hf / "chat", "--messages", tmp_path / "none.json", *GREEDY], "cannot read it"),
        # turns typed on stdin reach one process: a split model takes its conversations as files
        (["--path", hf / "chat", *GREEDY, "--model-parallel-size", "2"], "--messages FILE"),
    ):
        code, out, err = run_generate(capsys, *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and why in err, err


def test_export_keeps_template_and_eos_ids(hf, capsys, tmp_path):
    """HF dir (template in chat_template.jinja) → preprocess --tokenizer → train (lr 0) →
    export-model --format hf: transformers renders the template and stops where we do,
    with the HF directory gone (the checkpoint carries what generate needs)."""
    import cli
    from data.preprocess import preprocess

    source = tmp_path / "source"
    shutil.copytree(hf / "jinja", source)
    data = tmp_path / "data"
    preprocess(
        preprocess_options(["--trainpref", str(hf / "train.txt"), "--destdir", str(data), "--tokenizer", str(source)])
    )
    assert (data / "chat_template.jinja").read_text() == TEMPLATE
    save = tmp_path / "ck"
    run = [str(data), "--finetune-from-model", str(source), "--tokens-per-sample", "32", "--batch-size", "2"]
    run += ["--optimizer", "adam", "--lr", "0", "--max-update", "1", "--disable-validation", "--save-dir", str(save)]
    train_updates(run, 1, tmp_path)
    shutil.rmtree(source)
    ckpt, out = save / "checkpoint_last", tmp_path / "export"
    assert cli.export_model_main(["--path", str(ckpt), "--out", str(out), "--format", "hf"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(hf / "chat")
    end, eot = tok.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text())["eos_token_id"] == [end, eot]
    messages = _chat([("system", SYSTEM), ("user", PROMPT)])
    ours = transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    theirs = transformers.AutoTokenizer.from_pretrained(hf / "chat").apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert ours == theirs
    text, new = transformers_reply(out, messages)
    assert new[-1] == eot and len(new) < MAX_NEW
    code, printed, _ = run_generate(capsys, "--path", ckpt, "--system", SYSTEM, "--prompt", PROMPT, *GREEDY)
    assert (code, printed) == (0, text + "\n")
