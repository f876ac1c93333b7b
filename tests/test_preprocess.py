"""data/ preprocessing: round trips, formats, workers, refusals, fairseq dirs, corrupt files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from data.dictionary import Dictionary
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_fitting_dtype, exists
from data.preprocess import preprocess
from data.tokenizer import DictionaryTokenizer, SentencePieceTokenizer, load_tokenizer
from helpers import preprocess_options

REPO = Path(__file__).resolve().parents[1]

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
    "jolly boxing judges, and (sometimes) 42 zebras cross the café's über-long road!"
).split()


def make_lines(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        count = int(rng.integers(0, 15))
        lines.append(" ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), size=count)))
    return lines


def run_preprocess(*argv: str) -> Path:
    return preprocess(preprocess_options(list(argv)))


def sequences(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    train, valid = make_lines(600, 0), make_lines(50, 1)
    train[10] = "   "  # whitespace-only: a document boundary, like an empty line
    (root / "train.txt").write_text("\n".join(train) + "\n", encoding="utf-8")
    (root / "valid.txt").write_text("\n".join(valid) + "\n", encoding="utf-8")
    out = run_preprocess(
        "--trainpref",
        str(root / "train.txt"),
        "--validpref",
        str(root / "valid.txt"),
        "--destdir",
        str(root / "bin1"),
        "--vocab-size",
        "120",
    )
    return root, out, train, valid


# ---------------------------------------------------------------- preprocess


def test_text_round_trip_and_metadata(text_corpus):
    _, out, train, valid = text_corpus
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["format"] == "shardlm-mmidx-1"
    assert meta["dtype"] == "uint16" and meta["special_ids"] == dict(bos=0, pad=1, eos=2, unk=3)
    tokenizer = load_tokenizer(out)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert tokenizer.vocab_size == meta["vocab_size"] <= 120
    for split, lines in (("train", train), ("valid", valid)):
        ds = IndexedDataset(out / split)
        assert ds.dtype == np.uint16
        assert len(ds) == meta["splits"][split]["documents"] == len(lines)
        assert ds.num_tokens == meta["splits"][split]["tokens"] == int(ds.sizes.sum())
        for i, line in enumerate(lines):
            ids = ds[i].tolist()
            assert ids[-1] == 2 and 2 not in ids[:-1]
            assert tokenizer.decode(ids) == ("" if line.isspace() else line)
    assert IndexedDataset(out / "train")[10].tolist() == [2]  # the whitespace-only line
    assert IndexedDataset(out / "train")[0].tolist()[:-1] == tokenizer.encode(train[0])


def test_workers_give_identical_files(text_corpus):
    root, out, _, _ = text_corpus
    out2 = run_preprocess(
        "--trainpref",
        str(root / "train.txt"),
        "--validpref",
        str(root / "valid.txt"),
        "--destdir",
        str(root / "bin2"),
        "--vocab-size",
        "120",
        "--workers",
        "2",
    )
    # tokenizer.model included: sentencepiece training is deterministic too.
    assert dir_bytes(out2) == dir_bytes(out)


def test_text_rows_are_datasets_text_rows(tmp_path):
    """Plain text is read without datasets; the rows must be exactly its "text" builder's."""
    from data.sources import load_text_dataset, resolve_sources
    from data.text_rows import TextFileRows

    (tmp_path / "a.txt").write_bytes(
        "\ufefffirst\r\nsecond\rthird\n\n  \nform\x0cfeed and \u2028 sep, café\n\n".encode()
    )
    (tmp_path / "b.txt").write_bytes(b"no final newline\n\nlast")
    sources = resolve_sources(f"{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}")
    expected = load_text_dataset(sources, "text", tmp_path / "cache")["text"]
    rows = TextFileRows([source.path for source in sources])
    assert len(rows) == len(expected) == 10
    for size in (1, 3, 100):
        assert [text for batch in rows.batches(size) for text in batch] == expected


def test_text_and_gzipped_text_give_identical_files(text_corpus, tmp_path):
    import gzip

    root, out, _, _ = text_corpus
    (tmp_path / "train.txt.gz").write_bytes(gzip.compress((root / "train.txt").read_bytes()))
    model = str(out / "tokenizer.model")
    plain = run_preprocess(
        "--trainpref", str(root / "train.txt"), "--spm-model", model, "--destdir", str(tmp_path / "a")
    )
    gzipped = run_preprocess(  # read through datasets, which decompresses
        "--trainpref",
        str(tmp_path / "train.txt.gz"),
        "--spm-model",
        model,
        "--destdir",
        str(tmp_path / "b"),
    )
    assert (
        (plain / "train.bin").read_bytes() == (gzipped / "train.bin").read_bytes() == (out / "train.bin").read_bytes()
    )
    assert (plain / "train.idx").read_bytes() == (gzipped / "train.idx").read_bytes()


def test_bad_utf8_text_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.txt").write_bytes(b"fine line\nbad \xff byte\n")
    with pytest.raises(DataError, match=r"could not read .*train\.txt as text: .*codec can't decode.*--input-format"):
        run_preprocess("--trainpref", "train.txt", "--destdir", "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.txt"]


def test_jsonl_round_trip_and_splits(tmp_path):
    docs = ["first doc\nwith two lines", "", "second   doc, spaced", "third ü doc"]
    with open(tmp_path / "train.jsonl", "w", encoding="utf-8") as f:
        for k, doc in enumerate(docs * 20):
            f.write(json.dumps({"id": k, "body": doc}) + "\n")
    for name in ("v0.jsonl", "v1.jsonl"):
        (tmp_path / name).write_text(json.dumps({"id": 0, "body": docs[0]}) + "\n", encoding="utf-8")
    out = run_preprocess(
        "--trainpref",
        str(tmp_path / "train.jsonl"),
        "--validpref",
        f"{tmp_path / 'v0.jsonl'},{tmp_path / 'v1.jsonl'}",
        "--text-column",
        "body",
        "--destdir",
        str(tmp_path / "bin"),
        "--vocab-size",
        "60",
    )
    tokenizer = load_tokenizer(out)
    assert [tokenizer.decode(ids) for ids in sequences(out / "train")] == docs * 20
    meta = json.loads((out / "metadata.json").read_text())
    assert set(meta["splits"]) == {"train", "valid", "valid1"}
    assert meta["splits"]["valid1"]["sources"] == [str(tmp_path / "v1.jsonl")]


def test_missing_column_lists_columns(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"no column 'text'; its columns are body"):
        run_preprocess("--trainpref", str(tmp_path / "train.jsonl"), "--destdir", str(tmp_path / "bin"))
    assert not (tmp_path / "bin").exists()


def test_parquet_glob_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = make_lines(200, 2)
    pq.write_table(pa.table({"text": texts[:120]}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"text": texts[120:]}), tmp_path / "part-1.parquet")
    out = run_preprocess(
        "--trainpref",
        str(tmp_path / "part-*.parquet"),
        "--destdir",
        str(tmp_path / "bin"),
        "--vocab-size",
        "100",
    )
    tokenizer = load_tokenizer(out)
    assert [tokenizer.decode(ids) for ids in sequences(out / "train")] == texts
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["splits"]["train"]["tokens"] == IndexedDataset(out / "train").num_tokens


def test_csv_and_saved_dataset_together(tmp_path):
    import datasets

    (tmp_path / "a.csv").write_text('id,text\n1,hello there\n2,\n3,"quoted, text"\n', encoding="utf-8")
    datasets.Dataset.from_dict({"text": ["saved row", "another saved row"]}).save_to_disk(str(tmp_path / "saved"))
    out = run_preprocess(
        "--trainpref",
        f"{tmp_path / 'a.csv'},{tmp_path / 'saved'}",
        "--destdir",
        str(tmp_path / "bin"),
        "--vocab-size",
        "40",
    )
    tokenizer = load_tokenizer(out)
    decoded = [tokenizer.decode(ids) for ids in sequences(out / "train")]
    assert decoded == ["hello there", "", "quoted, text", "saved row", "another saved row"]


def test_spm_model_reuse(text_corpus, tmp_path):
    root, out, _, valid = text_corpus
    reused = run_preprocess(
        "--validpref",
        str(root / "valid.txt"),
        "--spm-model",
        str(out / "tokenizer.model"),
        "--destdir",
        str(tmp_path / "bin"),
    )
    assert (reused / "tokenizer.model").read_bytes() == (out / "tokenizer.model").read_bytes()
    assert (reused / "valid.bin").read_bytes() == (out / "valid.bin").read_bytes()
    with pytest.raises(DataError, match="leave them out with --spm-model"):
        run_preprocess(
            "--validpref",
            str(root / "valid.txt"),
            "--spm-model",
            str(out / "tokenizer.model"),
            "--vocab-size",
            "100",
            "--destdir",
            str(tmp_path / "bin2"),
        )


def test_refuses_to_overwrite(text_corpus):
    root, out, _, _ = text_corpus
    before = dir_bytes(out)
    with pytest.raises(DataError, match="already exists; choose another --destdir or delete it"):
        run_preprocess("--trainpref", str(root / "train.txt"), "--destdir", str(out), "--vocab-size", "120")
    assert dir_bytes(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_missing_input_and_hub_name_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.txt").write_text("hello\n")
    with pytest.raises(DataError, match=r"no local file or saved dataset at wikitext; .*local files only"):
        run_preprocess("--trainpref", "wikitext", "--destdir", "out")
    with pytest.raises(DataError, match="no local file or saved dataset at missing.txt"):
        run_preprocess("--trainpref", "train.txt", "--validpref", "missing.txt", "--destdir", "out")
    with pytest.raises(DataError, match="matched no files"):
        run_preprocess("--trainpref", "nothing-*.txt", "--destdir", "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.txt"]


# ------------------------------------------------------ format and fairseq dirs


def test_fairseq_data_dir(tmp_path):
    lines = ["hello world", "", "world of tokens hello", "an unknownword here"]
    (tmp_path / "dict.txt").write_text("hello 10\nworld 7\nof 3\ntokens 2\nan 1\nhere 1\nworld 1 #fairseq:overwrite\n")
    d = Dictionary.load(tmp_path / "dict.txt")
    assert len(d) == 11 and d.index("hello") == 4 and d.index("world") == 10 and d.index("zzz") == 3
    builder = IndexedDatasetBuilder(tmp_path / "train", best_fitting_dtype(len(d)))
    for line in lines:  # fairseq's binarizer: split, look up, append </s>
        builder.add_item(np.array([d.index(w) for w in line.split()] + [d.eos()], dtype=np.int32))
    builder.finalize()

    raw = (tmp_path / "train.idx").read_bytes()
    magic, version, code, count = struct.unpack("<9sQBQ", raw[:26])
    assert (magic, version, code, count) == (b"MMIDIDX\x00\x00", 1, 8, 4)
    sizes = np.frombuffer(raw, dtype="<i4", count=4, offset=26)
    pointers = np.frombuffer(raw, dtype="<i8", count=4, offset=26 + 16)
    assert sizes.tolist() == [3, 1, 5, 4] and pointers.tolist() == [0, 6, 8, 18]
    assert len(raw) == 26 + 4 * 12 and (tmp_path / "train.bin").stat().st_size == 13 * 2

    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, DictionaryTokenizer)
    ds = IndexedDataset(tmp_path / "train")
    decoded = [tokenizer.decode(ds[i]) for i in range(len(ds))]
    assert decoded == ["hello world", "", "world of tokens hello", "an <unk> here"]
    assert tokenizer.encode("hello there") == [4, 3]
    assert exists(tmp_path / "train") and not exists(tmp_path / "valid")


def test_corrupt_files_are_reported(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "train", np.uint16)
    builder.add_item(np.arange(10))
    builder.add_item(np.arange(5))
    builder.finalize()
    assert not list(tmp_path.glob("*.tmp*"))
    bin_file, idx_file = tmp_path / "train.bin", tmp_path / "train.idx"
    good_bin, good_idx = bin_file.read_bytes(), idx_file.read_bytes()

    bin_file.write_bytes(good_bin[:20])
    with pytest.raises(DataError, match=r"train\.bin is truncated.*re-run preprocess"):
        IndexedDataset(tmp_path / "train")
    bin_file.write_bytes(good_bin)
    idx_file.write_bytes(good_idx[:-4])
    with pytest.raises(DataError, match=r"train\.idx is truncated"):
        IndexedDataset(tmp_path / "train")
    idx_file.write_bytes(b"TNTIDX\x00\x00" + good_idx[8:])
    with pytest.raises(DataError, match="bad magic"):
        IndexedDataset(tmp_path / "train")
    idx_file.write_bytes(good_idx[:9] + struct.pack("<Q", 2) + good_idx[17:])
    with pytest.raises(DataError, match="version 2"):
        IndexedDataset(tmp_path / "train")
    idx_file.unlink()
    with pytest.raises(DataError, match=r"missing .*train\.idx"):
        IndexedDataset(tmp_path / "train")


def test_builder_merge_and_pickle(tmp_path):
    import pickle

    parts = [[np.arange(3), np.arange(7)], [], [np.arange(2)]]
    for k, part in enumerate(parts):
        b = IndexedDatasetBuilder(tmp_path / f"shard{k}", np.uint16)
        for item in part:
            b.add_item(item)
        b.finalize()
    merged = IndexedDatasetBuilder(tmp_path / "merged", np.uint16)
    for k in range(len(parts)):
        merged.merge_file(tmp_path / f"shard{k}")
    merged.finalize()
    direct = IndexedDatasetBuilder(tmp_path / "direct", np.uint16)
    for item in [a for part in parts for a in part]:
        direct.add_item(item)
    direct.finalize()
    for ext in ("bin", "idx"):
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"direct.{ext}").read_bytes()
    ds = pickle.loads(pickle.dumps(IndexedDataset(tmp_path / "merged")))
    assert [ds[i].tolist() for i in range(len(ds))] == [[0, 1, 2], list(range(7)), [0, 1]]
    assert len(IndexedDataset(tmp_path / "shard1")) == 0


# ---------------------------------------------------------------- token blocks
