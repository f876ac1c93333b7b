"""Hugging Face tokenizers in the data pipeline: `preprocess --tokenizer HF_DIR` encodes with
a model's own tokenizer.json, and `write_hf_tokenizer` turns a data dir's sentencepiece
model (or fairseq dict.txt) into a tokenizer.json that `transformers` encodes exactly as
preprocess did."""

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
from data.preprocess import preprocess
from data.tokenizer import SentencePieceTokenizer, file_sha256, load_tokenizer, tokenizer_identity
from helpers import byte_level_tokenizer, preprocess_options

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


def run_preprocess(*argv: str) -> Path:
    return preprocess(preprocess_options([str(a) for a in argv]))


def rows(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


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


# ------------------------------------------------------- sentencepiece -> tokenizer.json

EDGE = [
    "",
    " ",
    "   ",
    "\n",
    "a",
    " leading",
    "trailing ",
    "  two  spaces  ",
    "inner\nnewline",
    "\nstarts",
    "ends\n",
    "a\n\nb",
    "a \n b",
    "tab\there",
    "unseen Q X 😀 characters",
    "unseen😀😀run",
    "▁literal",
    " ▁x",
    "<s> </s> <pad> <unk> literal specials",
]


@pytest.fixture(scope="module")
def unigram_dir(tmp_path_factory):
    """A unigram data dir written by preprocess from jsonl rows: trained on the embedded
    corpus's valid split (+ the characters of "<s>" and a tab), its valid split the edge
    cases (newlines inside documents included) and some of the corpus again.
    Returns (data dir, texts, the rows preprocess wrote for them)."""
    from data.embedded_corpus import prepare_embedded_corpus

    root = tmp_path_factory.mktemp("unigram")
    corpus = (prepare_embedded_corpus() / "text" / "valid.txt").read_text().splitlines()
    texts = {"train": corpus + ["if a<b and c>d or e/f: tab\there"], "valid": EDGE + corpus[:200]}
    for split, lines in texts.items():
        with open(root / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": text}) + "\n" for text in lines)
    out = run_preprocess(
        "--trainpref",
        root / "train.jsonl",
        "--validpref",
        root / "valid.jsonl",
        "--destdir",
        root / "bin",
        "--vocab-size",
        "300",
        "--spm-model-type",
        "unigram",
    )
    return out, texts["train"] + texts["valid"], rows(out / "train") + rows(out / "valid")


def hf_ids(hf_dir: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)(texts)["input_ids"]


def assert_same_ids(data_dir, texts, written, tmp_path):
    """transformers, given write_hf_tokenizer's files, encodes every text as preprocess did,
    and decodes ids without <unk> as shardlm does: back to the text (but for a literal "▁",
    which sentencepiece itself reads as a space)."""
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer
    out = write_hf_tokenizer(data_dir, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    got = tok(texts)["input_ids"]
    bad = [(text, a, b) for text, a, b in zip(texts, got, written) if a != b]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, e.g. {bad[:3]}"
    ours = load_tokenizer(data_dir)
    for text, ids in zip(texts, got):
        if ours.unk not in ids:
            decoded = tok.decode(ids, skip_special_tokens=True)
            assert decoded == ours.decode(ids)
            assert decoded == ("" if text.isspace() else text) or "\u2581" in text
    return out


def test_bpe_tokenizer_json_encodes_as_preprocess_did(tmp_path):
    """The embedded corpus's bpe data dir: every line of its three splits, as written in its
    token files, then the edge cases as its tokenizer encodes them."""
    from data.embedded_corpus import SPLITS, prepare_embedded_corpus

    data = prepare_embedded_corpus()
    texts, written = [], []
    for split in SPLITS:
        texts += (data / "text" / f"{split}.txt").read_text().splitlines()
        written += rows(data / split)
    spm = load_tokenizer(data)
    assert isinstance(spm, SentencePieceTokenizer) and len(texts) == len(written) > 20_000
    texts += EDGE
    written += spm.encode_batch(["" if t.isspace() else t for t in EDGE], add_eos=True)
    out = assert_same_ids(data, texts, written, tmp_path)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == "</s>"


def test_unigram_tokenizer_json_encodes_as_preprocess_did(unigram_dir, tmp_path):
    data, texts, written = unigram_dir
    assert "unseen😀😀run" in texts and load_tokenizer(data).unk in written[texts.index("unseen😀😀run")]
    assert_same_ids(data, texts, written, tmp_path)
    # And back: preprocess --tokenizer with the converted files writes the same token files.
    again = run_preprocess(
        "--tokenizer",
        tmp_path / "hf",
        "--trainpref",
        data.parent / "train.jsonl",
        "--validpref",
        data.parent / "valid.jsonl",
        "--destdir",
        tmp_path / "again",
    )
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx"):
        assert (again / name).read_bytes() == (data / name).read_bytes()
    assert load_tokenizer(again).special_ids() == load_tokenizer(data).special_ids()


def test_unigram_with_unseen_characters_in_literal_specials(tmp_path):
    """A literal "</s>" whose "<", "/" and ">" sentencepiece never saw: <unk> s <unk>, as
    preprocess writes it (a `tokenizers` Unigram would rather take the control piece)."""
    from data.embedded_corpus import prepare_embedded_corpus
    from data.tokenizer import train_sentencepiece

    pytest.importorskip("transformers")
    data = tmp_path / "data"
    data.mkdir()
    train_sentencepiece(prepare_embedded_corpus() / "text" / "valid.txt", data / "tokenizer", 300, "unigram")
    spm = load_tokenizer(data)
    texts = ["<s> </s> <pad> <unk>", "ka</s>", "<unk>😀", "😀<s>", "ka <pad>", *EDGE]
    written = spm.encode_batch(["" if t.isspace() else t for t in texts], add_eos=True)
    assert [spm.pieces()[i] for i in spm.encode("<s>")] == ["\u2581", "<unk>", "s", "<unk>"]
    out = assert_same_ids(data, texts, written, tmp_path)
    # Without cutting out the unseen characters, the control pieces win.
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = spec["pre_tokenizer"]["pretokenizers"][0]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    assert hf_ids(out, texts[:5]) != written[:5]


@pytest.mark.parametrize("breakage", ["no dummy prefix", "metaspace prefix", "no eos template", "control scores"])
def test_comparison_catches_a_wrong_tokenizer(unigram_dir, tmp_path, breakage):
    """The checks above fail for a tokenizer.json that is almost right."""
    data, texts, written = unigram_dir
    pytest.importorskip("transformers")
    out = write_hf_tokenizer(data, tmp_path / "hf")
    spec = json.loads((out / "tokenizer.json").read_text())
    steps = spec["normalizer"]["normalizers"]
    if breakage == "no eos template":
        spec["post_processor"] = None
    elif breakage == "control scores":  # the model's own 0: a literal "<s>" becomes the control piece
        spec["model"]["vocab"][:4] = [[piece, 0.0] for piece, _ in spec["model"]["vocab"][:4]]
    else:
        steps[:] = [s for s in steps if s["type"] != "Prepend"]
        if breakage == "metaspace prefix":  # skips the prefix for a text that starts with a space
            spec["pre_tokenizer"] = {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
                    spec["pre_tokenizer"],
                ],
            }
    (out / "tokenizer.json").write_text(json.dumps(spec))
    wrong = sum(a != b for a, b in zip(hf_ids(out, texts), written))
    assert wrong > (0 if breakage in ("metaspace prefix", "control scores") else len(texts) // 2)


def test_fairseq_dict_tokenizer_json(tmp_path):
    from data.dictionary import Dictionary

    (tmp_path / "dict.txt").write_text("hello 10\nworld 7\nof 3\ntokens 2\nworld 1 #fairseq:overwrite\n")
    dictionary = Dictionary.load(tmp_path / "dict.txt")
    texts = [
        "hello world",
        "",
        "  ",
        "world of tokens hello",
        "an unknown word",
        "a\x1cb hello\u3000world",
        " lead  two\n\nlines ",
        "<s> </s> hello",
    ]
    written = [[dictionary.index(w) for w in t.split()] + [dictionary.eos()] for t in texts]  # fairseq's binarizer
    pytest.importorskip("transformers")
    out = write_hf_tokenizer(tmp_path, tmp_path / "hf")
    assert hf_ids(out, texts) == written
    assert HFTokenizer(out).vocab_size == len(dictionary) == 9


def test_hf_data_dir_tokenizer_is_copied(hf_dirs, tmp_path):
    out = run_preprocess(
        "--tokenizer", hf_dirs / "qwen", "--validpref", hf_dirs / "text/valid.txt", "--destdir", tmp_path / "bin"
    )
    written = write_hf_tokenizer(out, tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (written / name).read_bytes() == (hf_dirs / "qwen" / name).read_bytes()
    ids = HFTokenizer(written).encode_batch(["the lazy fox"], add_eos=True)[0]
    assert np.array_equal(IndexedDataset(out / "valid")[0], ids)
