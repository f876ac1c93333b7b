"""`write_hf_tokenizer`: a data dir's sentencepiece model (bpe, unigram) or fairseq dict.txt
as a tokenizer.json that `transformers` encodes exactly as preprocess did, edge cases
included, and a comparison that catches a wrong conversion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.hf_convert import write_hf_tokenizer
from data.hf_tokenizer import HFTokenizer
from data.tokenizer import SentencePieceTokenizer, load_tokenizer
from helpers import rows, run_preprocess

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
