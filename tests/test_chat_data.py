"""preprocess --tokenizer on conversations (SFT) and preference pairs (DPO): the ids are
transformers' apply_chat_template's, the targets its assistant mask (or our stated rule for
templates without generation markers), the pairs TRL's DPO tokenization; bad rows are
refused in one line naming the row, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data.chat_encode import ChatEncoder
from data.chat_template import model_eos_ids, read_chat_template, template_sha256, template_variables
from data.errors import DataError
from data.indexed_dataset import IndexedDataset
from data.preprocess import preprocess
from data.targets import data_kind, load_targets
from helpers import byte_level_tokenizer, preprocess_options

TEMPLATES = Path(pytest.importorskip("trl").__file__).parent / "chat_templates"
LINES = [
    "You are a helpful assistant. Answer briefly.",
    "What colour is the sky? Why is it blue?",
    "The sky is blue because of Rayleigh scattering.",
    "Tell me a joke about cats, please.",
    "<think>\nCats are funny.\n</think>\n\nA cat walks into a bar.",
]
LLAMA = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA += ["<|finetune_right_pad_id|>"]
QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|vision_pad|>"]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = [
    [SYSTEM, {"role": "user", "content": "What colour is the sky?"}, {"role": "assistant", "content": " Blue. "}],
    [
        SYSTEM,
        {"role": "user", "content": "Why is it blue?"},
        {"role": "assistant", "content": "Rayleigh scattering."},
        {"role": "user", "content": "Tell me a joke about cats."},
        {"role": "assistant", "content": "A cat walks into a bar."},
    ],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "<think>\nCats are funny.\n</think>\n\nA cat walks into a bar."},
    ],
]
PAIRS = [
    {
        "prompt": [SYSTEM, {"role": "user", "content": "What colour is the sky?"}],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Green, because of the cats."}],
    },
    {
        "prompt": [{"role": "user", "content": "Tell me a joke."}],
        "chosen": [{"role": "assistant", "content": "A cat walks into a bar."}],
        "rejected": [{"role": "assistant", "content": "No."}],
    },
]
TEXT_PAIRS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "Cats are", "chosen": " funny.<|end_of_text|>", "rejected": " a joke about the sky"},
]


def run_preprocess(*argv) -> Path:
    return preprocess(preprocess_options([str(a) for a in argv]))


def rows(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """llama3_1/, llama3_training/ (Llama 3.1's template, and TRL's with generation markers;
    eos <|end_of_text|>, config.json's eos_token_id lists <|eot_id|>), qwen3/, qwen3_training/
    (eos <|im_end|>, as Qwen3's instruct models), and conversations/pairs files."""
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("chat")
    families = {
        "llama3": (
            byte_level_tokenizer(LINES * 3, LLAMA, "<|begin_of_text|>"),
            dict(bos_token=LLAMA[0], eos_token=LLAMA[1]),
        ),
        "qwen3": (byte_level_tokenizer(LINES * 3, QWEN), dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
    }
    for name in ("llama3_1", "llama3_training", "qwen3", "qwen3_training"):
        tok, config = families["qwen3" if name.startswith("qwen") else "llama3"]
        template = (TEMPLATES / f"{name}.jinja").read_text()
        PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **config).save_pretrained(root / name)
        if name.startswith("llama"):
            eos_ids = [tok.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
            (root / name / "config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    write_jsonl(root / "conversations.jsonl", [{"messages": m} for m in CONVERSATIONS])
    write_jsonl(root / "pairs.jsonl", PAIRS)
    write_jsonl(root / "text_pairs.jsonl", TEXT_PAIRS)
    return root


def encoder(hf_dir: Path) -> ChatEncoder:
    template = read_chat_template(hf_dir)
    return ChatEncoder(str(hf_dir / "tokenizer.json"), template, template_variables(hf_dir), model_eos_ids(hf_dir))


@pytest.mark.parametrize("name", ["llama3_1", "llama3_training", "qwen3", "qwen3_training"])
def test_conversations_render_as_transformers_does(hf, name):
    from transformers import AutoTokenizer

    tok, ours = AutoTokenizer.from_pretrained(hf / name), encoder(hf / name)
    assert ours.markers == name.endswith("training")
    for messages in CONVERSATIONS:
        expected = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, targets = ours.conversation(messages)
        assert ids == expected["input_ids"]
        if ours.markers:
            assert targets == expected["assistant_masks"]
        prompt = tok.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)["input_ids"]
        assert ours.rendered_ids(messages[:-1], add_generation_prompt=True) == prompt


def test_target_rule_without_markers_equals_the_markers(hf):
    """llama3_1.jinja has no generation markers: the rule (content's first token through
    <|eot_id|>) picks the same tokens of each assistant turn as llama3_training.jinja's markers."""
    plain, marked = encoder(hf / "llama3_1"), encoder(hf / "llama3_training")
    for messages in CONVERSATIONS[:2]:
        (ids, targets), (marked_ids, marked_targets) = plain.conversation(messages), marked.conversation(messages)
        assert ids != marked_ids  # llama3_1 adds the date header: the rule is not reading the markers
        picked = [i for i, t in zip(ids, targets) if t]
        assert picked == [i for i, t in zip(marked_ids, marked_targets) if t]
        text = plain.tokenizer.decode(picked)
        assert text.replace("<|eot_id|>", "|") == "|".join(m["content"].strip() for m in messages[2::2]) + "|"
        assert not targets[-1] or ids[-1] == plain.tokenizer._tok.token_to_id("<|eot_id|>")


@pytest.fixture(scope="module")
def sft_dir(hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "bin"
    return run_preprocess(
        "--tokenizer", hf / "llama3_training", "--trainpref", hf / "conversations.jsonl", "--destdir", out
    )


def test_preprocess_writes_conversations_and_targets(hf, sft_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf / "llama3_training")
    meta = json.loads((sft_dir / "metadata.json").read_text())
    assert meta["kind"] == data_kind(sft_dir) == "conversations"
    assert meta["chat_template_sha256"] == template_sha256((hf / "llama3_training" / "chat_template.jinja").read_text())
    assert meta["splits"]["train"] | {"sources": None} == dict(
        rows_read=3, rows_written=3, rows_dropped=0, sequences=3, tokens=meta["splits"]["train"]["tokens"], sources=None
    )
    targets = load_targets(sft_dir / "train")
    assert targets.dtype == np.uint8
    for k, messages in enumerate(CONVERSATIONS):
        expected = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert rows(sft_dir / "train")[k] == expected["input_ids"]  # no eos appended
        assert targets[k].tolist() == expected["assistant_masks"]
    assert data_kind(Path(tok.name_or_path)) == "text"


def test_max_length_drops_and_counts(hf, tmp_path, capsys):
    lengths = [len(ids) for ids in rows_of(hf, "llama3_1")]
    limit = sorted(lengths)[1]
    out = run_preprocess(
        "--tokenizer", hf / "llama3_1", "--trainpref", hf / "conversations.jsonl", "--destdir", tmp_path / "bin",
        "--max-length", limit,
    )  # fmt: skip
    dropped = sum(n > limit for n in lengths)
    assert dropped == 1 and f"1 dropped (over --max-length {limit})" in capsys.readouterr().out
    split = json.loads((out / "metadata.json").read_text())["splits"]["train"]
    assert (split["rows_read"], split["rows_written"], split["rows_dropped"]) == (3, 2, 1)
    assert [len(r) for r in rows(out / "train")] == [n for n in lengths if n <= limit]
    assert list(load_targets(out / "train").sizes) == [n for n in lengths if n <= limit]


def rows_of(hf, name):
    return [encoder(hf / name).conversation(m)[0] for m in CONVERSATIONS]


def trl_dpo_tokenize(tok, example):
    """TRL 1.16 DPOTrainer._prepare_dataset's add_eos + tokenize_fn, line for line."""
    if isinstance(example["chosen"], list):
        p = tok.apply_chat_template(example["prompt"], tokenize=True, add_generation_prompt=True)["input_ids"]
        c = tok.apply_chat_template(example["prompt"] + example["chosen"], tokenize=True)["input_ids"]
        r = tok.apply_chat_template(example["prompt"] + example["rejected"], tokenize=True)["input_ids"]
    else:
        eos = tok.eos_token
        chosen = example["chosen"] if example["chosen"].endswith(eos) else example["chosen"] + eos
        rejected = example["rejected"] if example["rejected"].endswith(eos) else example["rejected"] + eos
        p, c, r = (
            tok(text=t)["input_ids"]
            for t in (example["prompt"], example["prompt"] + chosen, example["prompt"] + rejected)
        )

    def common(a, b):
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    n = min(common(p, c), common(p, r))
    return p[:n], c[n:], r[n:]


@pytest.mark.parametrize("name,data", [("qwen3", "pairs.jsonl"), ("llama3_1", "text_pairs.jsonl")])
def test_preference_pairs_tokenize_as_trl(hf, tmp_path, name, data):
    from transformers import AutoTokenizer

    out = run_preprocess("--tokenizer", hf / name, "--trainpref", hf / data, "--destdir", tmp_path / "bin")
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["kind"] == data_kind(out) == "preference_pairs" and meta["splits"]["train"]["sequences"] == 4
    tok = AutoTokenizer.from_pretrained(hf / name)
    written, targets = rows(out / "train"), load_targets(out / "train")
    examples = PAIRS if data == "pairs.jsonl" else TEXT_PAIRS
    for i, example in enumerate(examples):
        prompt, chosen, rejected = trl_dpo_tokenize(tok, example)
        assert written[2 * i] == prompt + chosen and written[2 * i + 1] == prompt + rejected
        assert targets[2 * i].tolist() == [0] * len(prompt) + [1] * len(chosen)
        assert targets[2 * i + 1].tolist() == [0] * len(prompt) + [1] * len(rejected)


BAD_ROWS = [
    ([{"messages": CONVERSATIONS[0]}, {"messages": None}], r"row 1 \(0-based\) of .*bad.jsonl: has no messages"),
    ([{"messages": CONVERSATIONS[0]}, {"other": 1}], r"row 1 \(0-based\) of .*: has no messages"),
    ([{"messages": [{"role": "robot", "content": "hi"}]}], r"row 0 .*: messages\[0\] has role 'robot'; the roles are"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], r"row 0 .*: has no assistant turn"),
    ([{"messages": CONVERSATIONS[1] + [{"role": "system", "content": "late"}]}], None),  # renders: not an error
    ([PAIRS[0], {**PAIRS[1], "chosen": []}], r"row 1 .*: has an empty chosen"),
    ([TEXT_PAIRS[0], {**TEXT_PAIRS[1], "rejected": ""}], r"row 1 .*: has an empty rejected"),
]


@pytest.mark.parametrize("records,match", BAD_ROWS)
def test_bad_rows_are_refused_in_one_line(hf, tmp_path, records, match):
    bad = write_jsonl(tmp_path / "bad.jsonl", records)
    args = ("--tokenizer", hf / "llama3_1", "--trainpref", bad, "--destdir", tmp_path / "out")
    if match is None:
        run_preprocess(*args)
        return
    with pytest.raises(DataError, match=match) as e:
        run_preprocess(*args)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_template_problems_are_refused(hf, tmp_path):
    def refused(match, *extra, tokenizer="llama3_1", data="conversations.jsonl"):
        with pytest.raises(DataError, match=match) as e:
            where = hf / tokenizer if tokenizer else ""
            run_preprocess("--tokenizer", where, "--trainpref", hf / data, "--destdir", tmp_path / "out", *extra)
        assert "\n" not in str(e.value) and not (tmp_path / "out").exists()

    raising = tmp_path / "raising.jinja"
    raising.write_text("{% if messages[0].role == 'system' %}{{ raise_exception('no system role here') }}{% endif %}x")
    refused(
        r"row 0 \(0-based\) of .*conversations.jsonl: the chat template failed .*no system role here",
        "--chat-template",
        raising,
    )
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    refused(r"the chat template of .*broken.jinja does not parse", "--chat-template", broken)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        config = json.loads((hf / "llama3_1" / name).read_text())
        config.pop("chat_template", None)
        (bare / name).write_text(json.dumps(config))
    refused(r"has no chat template .* pass --chat-template FILE", tokenizer=bare)
    refused(r"--tokenizer is empty", tokenizer="")
    refused(r"--chat-template is empty", "--chat-template", "")
    with pytest.raises(DataError, match=r"holds conversations .* pass --tokenizer HF_DIR \(sentencepiece has none\)"):
        run_preprocess("--trainpref", hf / "conversations.jsonl", "--destdir", tmp_path / "out")
    with pytest.raises(DataError, match=r"--spm-model is empty"):
        run_preprocess("--spm-model", "", "--validpref", hf / "conversations.jsonl", "--destdir", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_load_targets_refuses_text_data(hf, tmp_path):
    (tmp_path / "t.txt").write_text("\n".join(LINES) + "\n")
    out = run_preprocess(
        "--tokenizer", hf / "llama3_1", "--trainpref", tmp_path / "t.txt", "--destdir", tmp_path / "bin"
    )
    assert data_kind(out) == "text" and not (out / "train.targets.idx").exists()
    with pytest.raises(DataError, match=r"train.targets.idx/.bin are missing: .* re-run preprocess --tokenizer"):
        load_targets(out / "train")
    with pytest.raises(DataError, match=r"--max-length apply to conversation or preference-pair rows"):
        run_preprocess(
            "--tokenizer",
            hf / "llama3_1",
            "--trainpref",
            tmp_path / "t.txt",
            "--destdir",
            tmp_path / "b2",
            "--max-length",
            "5",
        )


def test_target_rule_runs_to_the_end_of_turn_token(hf):
    """Without markers the target runs past the content to the end-of-turn token (not the
    newline after it), and is the content alone where no such token ends the turn."""
    llama = hf / "llama3_1"
    suffixed = (
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
        "{{ m.content }} (end)<|eot_id|>\n{% endfor %}"
    )
    bare = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    for template, turn in ((suffixed, "{} (end)<|eot_id|>"), (bare, "{}")):
        ours = ChatEncoder(str(llama / "tokenizer.json"), template, template_variables(llama), model_eos_ids(llama))
        messages = CONVERSATIONS[1]
        ids, targets = ours.conversation(messages)
        runs, run = [], []
        for i, t in zip(ids, targets):
            if t:
                run.append(i)
            elif run:
                runs, run = runs + [run], []
        runs += [run] if run else []
        assert [ours.tokenizer.decode(r) for r in runs] == [turn.format(m["content"]) for m in messages[2::2]]


def test_pair_completion_starts_where_either_side_diverges(hf, tmp_path):
    """A generation prompt that the whole conversation renders otherwise ("Sure" prefilled):
    TRL's completion starts at the shorter common prefix, for both sides."""
    from transformers import AutoTokenizer

    template = tmp_path / "prefill.jinja"
    template.write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}assistant: Sure{% endif %}"
    )
    pair = {
        "prompt": [{"role": "user", "content": "Why is the sky blue?"}],
        "chosen": [{"role": "assistant", "content": "Sure, Rayleigh scattering."}],
        "rejected": [{"role": "assistant", "content": "No."}],
    }
    data = write_jsonl(tmp_path / "pairs.jsonl", [pair])
    out = run_preprocess(
        "--tokenizer", hf / "llama3_1", "--chat-template", template, "--trainpref", data, "--destdir", tmp_path / "b"
    )
    assert (out / "chat_template.jinja").read_text() == template.read_text()
    tok = AutoTokenizer.from_pretrained(hf / "llama3_1")
    tok.chat_template = template.read_text()
    prompt, chosen, rejected = trl_dpo_tokenize(tok, pair)
    targets = load_targets(out / "train")
    assert rows(out / "train") == [prompt + chosen, prompt + rejected]
    assert targets[0].tolist() == [0] * len(prompt) + [1] * len(chosen)
    assert targets[1].tolist() == [0] * len(prompt) + [1] * len(rejected)
