"""Hugging Face tokenizers in the data pipeline: `preprocess --tokenizer HF_DIR` encodes with
a model's own tokenizer.json, and `write_hf_tokenizer` turns a data dir's sentencepiece
model (or fairseq dict.txt) into a tokenizer.json that `transformers` encodes exactly as
preprocess did (the conversion's cases: tests/test_hf_tokenizer_convert.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.errors import DataError
from data.hf_convert import write_hf_tokenizer
from data.hf_tokenizer import HFTokenizer
from data.indexed_dataset import IndexedDataset
from data.tokenizer import file_sha256, load_tokenizer, tokenizer_identity
from helpers import byte_level_tokenizer, rows, run_preprocess

BIN = Path(sys.executable).parent
LINES = [
    "the quick brown fox jumps over the lazy dog",
    "  two leading spaces, and  a double one ",
    "café über naïve — ünïcödé",
    "",
    "numbers 1234 and (brackets) [too]!",
    "   ",
    "the end",
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """llama/: BOS template, no pad_token, a <|finetune_right_pad_id|> (Llama 3.1); llama30/:
    reserved special tokens only (Llama 3.0); qwen/: no BOS, pad_token = eos = <|endoftext|>
    with <|vision_pad|> (Qwen3 base); bare/: pad = eos and nothing else to fall back to."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    llama = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_3|>",
        "<|eot_id|>",
    ]
    made = {
        "llama": (llama, "<|begin_of_text|>", dict(bos_token=llama[0], eos_token=llama[1])),
        "llama30": (
            [t for t in llama if "pad" not in t],
            "<|begin_of_text|>",
            dict(bos_token=llama[0], eos_token=llama[1]),
        ),
        "qwen": (
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_pad|>", "<|image_pad|>"],
            None,
            dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>"),
        ),
        "bare": (["<|endoftext|>", "<|im_start|>"], None, dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")),
    }
    for name, (specials, bos, config) in made.items():
        tok = byte_level_tokenizer(LINES * 5, specials, bos, vocab_size=320)
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **config).save_pretrained(root / name)
    # Qwen's repositories also ship special_tokens_map.json, whose entries win over tokenizer_config.json's.
    (root / "qwen" / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "<|endoftext|>", "special": True}, "pad_token": "<|endoftext|>"})
    )
    text = root / "text"
    text.mkdir()
    (text / "train.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    (text / "valid.txt").write_text("the lazy fox\n\nover  über\n", encoding="utf-8")
    return root


def test_preprocess_with_llama3_like_tokenizer(hf_dirs, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    src = hf_dirs / "llama"
    out = run_preprocess(
        "--tokenizer",
        src,
        "--trainpref",
        hf_dirs / "text/train.txt",
        "--validpref",
        hf_dirs / "text/valid.txt",
        "--destdir",
        tmp_path / "bin",
    )
    own, hf = Tokenizer.from_file(str(src / "tokenizer.json")), AutoTokenizer.from_pretrained(src)
    bos, eos, pad = (own.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"))
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["tokenizer"] == "tokenizer.json" and meta["tokenizer_kind"] == "hf"
    assert meta["tokenizer_sha256"] == file_sha256(src / "tokenizer.json") == file_sha256(out / "tokenizer.json")
    assert meta["vocab_size"] == own.get_vocab_size(with_added_tokens=True) and meta["dtype"] == "uint16"
    assert meta["special_ids"] == dict(bos=bos, pad=pad, eos=eos, unk=None)
    assert (out / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    assert not (out / "tokenizer.model").exists()
    valid = ["the lazy fox", "", "over  über"]
    for split, lines in (("train", LINES), ("valid", valid)):
        written = rows(out / split)
        assert len(written) == len(lines) == meta["splits"][split]["documents"]
        for line, ids in zip(lines, written):
            if not line.strip():  # a blank line is a document boundary: just eos, no BOS
                assert ids == [eos]
                continue
            assert ids == own.encode(line).ids + [eos] == hf(line)["input_ids"] + [eos]
            assert ids[0] == bos
    tok = load_tokenizer(out)
    assert isinstance(tok, HFTokenizer) and tok.special_ids() == meta["special_ids"]
    assert tok.encode(LINES[0]) == rows(out / "train")[0][:-1]
    assert [tok.decode(ids) for ids in rows(out / "train")] == [line if line.strip() else "" for line in LINES]
    assert (
        tokenizer_identity(out)
        == tokenizer_identity(src)
        == dict(kind="hf", sha256=meta["tokenizer_sha256"], vocab_size=meta["vocab_size"])
    )
    # Several workers write the same bytes (each worker loads the copied tokenizer.json).
    again = run_preprocess(
        "--tokenizer",
        src / "tokenizer.json",
        "--trainpref",
        hf_dirs / "text/train.txt",
        "--validpref",
        hf_dirs / "text/valid.txt",
        "--destdir",
        tmp_path / "bin2",
        "--workers",
        "2",
    )
    for name in ("train.bin", "train.idx", "valid.bin", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (out / name).read_bytes()


def test_pad_rule(hf_dirs, tmp_path):
    """pad is never eos or bos: the tokenizer's pad_token, else a special token named for
    padding, else the last reserved one, else a one-line refusal."""
    from tokenizers import Tokenizer

    def pad_of(path):
        return HFTokenizer(path).special_tokens()["pad"]

    assert pad_of(hf_dirs / "llama") == "<|finetune_right_pad_id|>"
    assert pad_of(hf_dirs / "llama30") == "<|reserved_special_token_3|>"
    qwen = HFTokenizer(hf_dirs / "qwen")
    assert qwen.bos is None and qwen.special_tokens() == dict(pad="<|vision_pad|>", eos="<|endoftext|>")
    assert pad_of(hf_dirs / "qwen") == "<|vision_pad|>"
    out = run_preprocess(
        "--tokenizer", hf_dirs / "qwen", "--validpref", hf_dirs / "text/valid.txt", "--destdir", tmp_path / "qwen"
    )
    assert (out / "special_tokens_map.json").is_file()
    # Qwen's template adds nothing: the rows are the text's ids and eos.
    own = Tokenizer.from_file(str(hf_dirs / "qwen" / "tokenizer.json"))
    assert rows(out / "valid")[0] == own.encode("the lazy fox").ids + [qwen.eos]
    with pytest.raises(
        DataError,
        match=r"has no pad token \(its pad_token '<\|endoftext\|>' is its eos or bos\).*"
        r'add "pad_token"',
    ) as e:
        run_preprocess(
            "--tokenizer", hf_dirs / "bare", "--validpref", hf_dirs / "text/valid.txt", "--destdir", tmp_path / "bare"
        )
    assert "\n" not in str(e.value) and not (tmp_path / "bare").exists()
    # The fix the message names works.
    config = json.loads((hf_dirs / "bare" / "tokenizer_config.json").read_text())
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    (fixed / "tokenizer.json").write_bytes((hf_dirs / "bare" / "tokenizer.json").read_bytes())
    (fixed / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<|im_start|>"}))
    assert pad_of(fixed) == "<|im_start|>"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--vocab-size", "100"], "leave out --spm-model, --vocab-size, --spm-model-type and --seed"),
        (["--spm-model-type", "unigram"], "leave out --spm-model"),
        (["--seed", "3"], "leave out --spm-model"),
        (["--spm-model", "x.model"], "leave out --spm-model"),
    ],
)
def test_tokenizer_excludes_sentencepiece_flags(hf_dirs, tmp_path, extra, message):
    with pytest.raises(DataError, match=message):
        run_preprocess(
            "--tokenizer",
            hf_dirs / "llama",
            "--validpref",
            hf_dirs / "text/valid.txt",
            "--destdir",
            tmp_path / "out",
            *extra,
        )
    assert not (tmp_path / "out").exists()


def test_bad_tokenizer_dirs_are_refused(hf_dirs, tmp_path):
    def refused(path, match):
        with pytest.raises(DataError, match=match) as e:
            run_preprocess(
                "--tokenizer", path, "--validpref", hf_dirs / "text/valid.txt", "--destdir", tmp_path / "out"
            )
        assert "\n" not in str(e.value) and not (tmp_path / "out").exists()

    refused(tmp_path / "missing", r"missing does not exist; pass a Hugging Face model or tokenizer directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", r"empty has no tokenizer\.json")
    (tmp_path / "garbage.json").write_text("{not json")
    refused(tmp_path / "garbage.json", r"is not a tokenizers tokenizer\.json")
    noeos = tmp_path / "noeos"
    noeos.mkdir()
    (noeos / "tokenizer.json").write_bytes((hf_dirs / "llama" / "tokenizer.json").read_bytes())
    refused(noeos / "tokenizer.json", r'no eos_token \(no tokenizer_config\.json beside .*add "eos_token"')
    (noeos / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    refused(noeos, r"eos_token '</s>' \(tokenizer_config\.json\) is not in .* vocabulary")


def test_cli_refusal_is_one_line(hf_dirs, tmp_path):
    r = subprocess.run(
        [
            BIN / "preprocess",
            "--tokenizer",
            hf_dirs / "bare",
            "--validpref",
            hf_dirs / "text/valid.txt",
            "--destdir",
            tmp_path / "out",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr.startswith("preprocess: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_checkpoints_and_exports_carry_the_tokenizer_files(hf_dirs, tmp_path):
    from trainer.inference.load import SIDE_FILES, tokenizer_of

    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(SIDE_FILES)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_dirs / "llama" / name).read_bytes())
    assert isinstance(tokenizer_of(tmp_path), HFTokenizer)


def test_hf_data_dir_tokenizer_is_copied(hf_dirs, tmp_path):
    out = run_preprocess(
        "--tokenizer", hf_dirs / "qwen", "--validpref", hf_dirs / "text/valid.txt", "--destdir", tmp_path / "bin"
    )
    written = write_hf_tokenizer(out, tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (written / name).read_bytes() == (hf_dirs / "qwen" / name).read_bytes()
    ids = HFTokenizer(written).encode_batch(["the lazy fox"], add_eos=True)[0]
    assert np.array_equal(IndexedDataset(out / "valid")[0], ids)
