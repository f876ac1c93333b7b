"""data/: preprocess, the MMIDIDX format, fairseq dirs, token blocks, batches, embedded corpus."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.dictionary import Dictionary
from data.dummy_lm import DummyLMDataset
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_fitting_dtype, exists
from data.iterator import EpochBatchIterator, collate
from data.preprocess import build_parser, preprocess
from data.token_block import TokenBlockDataset
from data.tokenizer import DictionaryTokenizer, SentencePieceTokenizer, load_tokenizer

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
    return preprocess(build_parser().parse_args(list(argv)))


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
        "--trainpref", str(root / "train.txt"), "--validpref", str(root / "valid.txt"),
        "--destdir", str(root / "bin1"), "--vocab-size", "120",
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
        "--trainpref", str(root / "train.txt"), "--validpref", str(root / "valid.txt"),
        "--destdir", str(root / "bin2"), "--vocab-size", "120", "--workers", "2",
    )
    # tokenizer.model included: sentencepiece training is deterministic too.
    assert dir_bytes(out2) == dir_bytes(out)


def test_jsonl_round_trip_and_splits(tmp_path):
    docs = ["first doc\nwith two lines", "", "second   doc, spaced", "third ü doc"]
    with open(tmp_path / "train.jsonl", "w", encoding="utf-8") as f:
        for k, doc in enumerate(docs * 20):
            f.write(json.dumps({"id": k, "body": doc}) + "\n")
    for name in ("v0.jsonl", "v1.jsonl"):
        (tmp_path / name).write_text(json.dumps({"id": 0, "body": docs[0]}) + "\n", encoding="utf-8")
    out = run_preprocess(
        "--trainpref", str(tmp_path / "train.jsonl"),
        "--validpref", f"{tmp_path / 'v0.jsonl'},{tmp_path / 'v1.jsonl'}",
        "--text-column", "body", "--destdir", str(tmp_path / "bin"), "--vocab-size", "60",
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
        "--trainpref", str(tmp_path / "part-*.parquet"), "--destdir", str(tmp_path / "bin"), "--vocab-size", "100",
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
        "--trainpref", f"{tmp_path / 'a.csv'},{tmp_path / 'saved'}", "--destdir", str(tmp_path / "bin"),
        "--vocab-size", "40",
    )
    tokenizer = load_tokenizer(out)
    decoded = [tokenizer.decode(ids) for ids in sequences(out / "train")]
    assert decoded == ["hello there", "", "quoted, text", "saved row", "another saved row"]


def test_spm_model_reuse(text_corpus, tmp_path):
    root, out, _, valid = text_corpus
    reused = run_preprocess(
        "--validpref", str(root / "valid.txt"), "--spm-model", str(out / "tokenizer.model"),
        "--destdir", str(tmp_path / "bin"),
    )
    assert (reused / "tokenizer.model").read_bytes() == (out / "tokenizer.model").read_bytes()
    assert (reused / "valid.bin").read_bytes() == (out / "valid.bin").read_bytes()
    with pytest.raises(DataError, match="leave them out with --spm-model"):
        run_preprocess(
            "--validpref", str(root / "valid.txt"), "--spm-model", str(out / "tokenizer.model"),
            "--vocab-size", "100", "--destdir", str(tmp_path / "bin2"),
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
    (tmp_path / "dict.txt").write_text(
        "hello 10\nworld 7\nof 3\ntokens 2\nan 1\nhere 1\nworld 1 #fairseq:overwrite\n"
    )
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


def write_sequences(prefix: Path, seqs: list[list[int]]) -> IndexedDataset:
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for seq in seqs:
        builder.add_item(np.array(seq))
    builder.finalize()
    return IndexedDataset(prefix)


def random_sequences(seed: int, n: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(n):
        if rng.random() < 0.15:
            seqs.append([2])  # a blank line: document boundary
        else:
            seqs.append(rng.integers(4, 50, size=int(rng.integers(0, 25))).tolist() + [2])
    return seqs


@pytest.mark.parametrize("T", [1, 3, 8, 30])
def test_token_blocks_every_mode(tmp_path, T):
    seqs = random_sequences(T)
    ds = write_sequences(tmp_path / "d", seqs)
    stream = [t for s in seqs for t in s]
    seq_of = np.repeat(np.arange(len(seqs)), [len(s) for s in seqs])  # stream pos -> sequence
    separator = [s == [2] for s in seqs]

    for mode in ("none", "complete", "complete_doc", "eos"):
        blocks = TokenBlockDataset(ds, T, mode)
        items = [blocks[i] for i in range(len(blocks))]
        assert all(item.dtype == np.int64 and 2 <= len(item) <= T + 1 for item in items)
        assert blocks.sizes.tolist() == [len(item) for item in items]
        targets = [t for item in items for t in item[1:].tolist()]
        assert blocks.num_tokens == len(targets)
        if mode == "none":
            assert targets == stream[1:]
            assert all(np.array_equal(items[k][-1:], items[k + 1][:1]) for k in range(len(items) - 1))
            assert items[0].tolist() == stream[: T + 1]
            continue
        ranges = zip(blocks.target_starts.tolist(), blocks.target_ends.tolist())
        if mode == "complete_doc":
            # Every non-separator token is a target; no block holds or crosses a separator.
            kept = [t for t, s in zip(stream, seq_of) if not separator[s]]
            assert targets == kept
            for start, end in ranges:
                covered = seq_of[start:end]
                assert not any(separator[s] for s in range(covered[0], covered[-1] + 1))
        else:
            assert targets == stream  # the first token of each sequence is a target too
        seq_start = np.cumsum([0] + [len(s) for s in seqs])
        for k, (start, end) in enumerate(zip(blocks.target_starts.tolist(), blocks.target_ends.tolist())):
            # The item is the targets plus the token before them, a virtual </s> at 0.
            assert items[k].tolist() == ([2] + stream)[start : end + 1]
            # Blocks start at a sequence start, or every T tokens inside a long sequence.
            assert (start - seq_start[seq_of[start]]) % T == 0
            if mode == "eos":
                assert seq_of[end - 1] == seq_of[start]
        if mode == "complete":
            # Greedy: the next block's first sequence piece would not have fit.
            assert len(blocks) <= len(TokenBlockDataset(ds, T, "eos"))


def test_token_blocks_pickle_by_path(tmp_path):
    import pickle

    blocks = TokenBlockDataset(write_sequences(tmp_path / "d", random_sequences(0, 200)), 16, "complete")
    data = pickle.dumps(blocks)
    assert len(data) < 20_000  # ranges only: the token file is re-mapped, not copied
    copy = pickle.loads(data)
    assert all(np.array_equal(copy[i], blocks[i]) for i in range(len(blocks)))


def test_token_block_errors(tmp_path):
    ds = write_sequences(tmp_path / "d", [[5, 2]])
    with pytest.raises(DataError, match="unknown --sample-break-mode 'sentence'"):
        TokenBlockDataset(ds, 8, "sentence")
    with pytest.raises(DataError, match="--tokens-per-sample must be at least 1"):
        TokenBlockDataset(ds, 0, "none")
    assert len(TokenBlockDataset(write_sequences(tmp_path / "e", []), 8, "none")) == 0


def test_dummy_lm_is_deterministic():
    a, b = DummyLMDataset(100, 16, num_items=50, seed=3), DummyLMDataset(100, 16, num_items=50, seed=3)
    assert all(np.array_equal(a[i], b[i]) for i in range(50))
    assert not np.array_equal(a[0], DummyLMDataset(100, 16, num_items=50, seed=4)[0])
    assert len(a) == 50 and a.sizes.tolist() == [17] * 50
    values = np.concatenate([a[i] for i in range(50)])
    assert values.min() >= 4 and values.max() < 100


# ---------------------------------------------------------------- batches


class CountingDataset:
    """Item i is [i, i, ...] of a chosen length, so batches show which items they hold."""

    def __init__(self, sizes):
        self.sizes = np.asarray(sizes)

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return np.full(int(self.sizes[i]), i + 10, dtype=np.int64)


def item_ids(batch) -> list[int]:
    return (batch["src_tokens"][:, 0] - 10).tolist()


def epoch_ids(itr) -> list[list[int]]:
    return [item_ids(b) for b in itr.next_epoch_itr()]


def test_collate_pads_right():
    batch = collate([np.array([5, 6, 7, 8]), np.array([9, 10])], pad=1)
    assert batch["src_tokens"].tolist() == [[5, 6, 7], [9, 1, 1]]
    assert batch["target"].tolist() == [[6, 7, 8], [10, 1, 1]]
    assert batch["ntokens"] == 4 and batch["nsentences"] == 2


def test_batching_caps():
    ds = CountingDataset([5] * 10 + [20] * 2)
    itr = EpochBatchIterator(ds, batch_size=4, max_tokens=40, seed=1, shuffle=False)
    assert epoch_ids(itr) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11]]
    with pytest.raises(DataError, match="set --batch-size or --max-tokens"):
        EpochBatchIterator(ds, batch_size=None, max_tokens=None, seed=1)
    with pytest.raises(DataError, match="only 3 batches for 4 ranks"):
        len(EpochBatchIterator(ds, batch_size=5, max_tokens=None, seed=1, num_shards=4))


def test_shards_are_disjoint_and_cover_the_epoch():
    ds = CountingDataset(np.random.default_rng(0).integers(2, 12, size=101))
    full = EpochBatchIterator(ds, batch_size=None, max_tokens=40, seed=7)
    all_batches = epoch_ids(full)
    shards = [EpochBatchIterator(ds, batch_size=None, max_tokens=40, seed=7, num_shards=2, shard_id=r) for r in (0, 1)]
    per_rank = [epoch_ids(s) for s in shards]
    assert len(per_rank[0]) == len(per_rank[1]) == len(all_batches) // 2 == len(shards[0])
    usable = all_batches[: len(all_batches) // 2 * 2]
    assert per_rank[0] == usable[0::2] and per_rank[1] == usable[1::2]
    flat = [i for rank in per_rank for b in rank for i in b]
    assert len(flat) == len(set(flat))


def test_epochs_are_reproducible_and_differ():
    ds = DummyLMDataset(50, 4, num_items=64)
    a = EpochBatchIterator(ds, batch_size=8, max_tokens=None, seed=3)
    b = EpochBatchIterator(ds, batch_size=8, max_tokens=None, seed=3)
    a1, a2 = [[b_["src_tokens"].tolist() for b_ in a.next_epoch_itr()] for _ in range(2)]
    b1 = [b_["src_tokens"].tolist() for b_ in b.next_epoch_itr()]
    assert a1 == b1 and a1 != a2 and a.epoch == 2
    c = EpochBatchIterator(ds, batch_size=8, max_tokens=None, seed=4)
    assert [b_["src_tokens"].tolist() for b_ in c.next_epoch_itr()] != a1


def test_resume_yields_exactly_the_remaining_batches():
    ds = CountingDataset([3] * 40)
    ref = EpochBatchIterator(ds, batch_size=3, max_tokens=None, seed=5, num_shards=2, shard_id=1)
    epoch1, epoch2 = epoch_ids(ref), epoch_ids(ref)

    run = EpochBatchIterator(ds, batch_size=3, max_tokens=None, seed=5, num_shards=2, shard_id=1)
    itr = run.next_epoch_itr()
    seen = [item_ids(next(itr)) for _ in range(4)]
    state = run.state_dict()
    assert state == {"epoch": 1, "iterations_in_epoch": 4} and not run.end_of_epoch()

    resumed = EpochBatchIterator(ds, batch_size=3, max_tokens=None, seed=5, num_shards=2, shard_id=1)
    resumed.load_state_dict(state)
    rest = [item_ids(b) for b in resumed.next_epoch_itr()]
    assert seen + rest == epoch1 and resumed.end_of_epoch()
    assert epoch_ids(resumed) == epoch2 and resumed.epoch == 2

    # A checkpoint taken at the end of an epoch resumes with the next epoch.
    at_end = EpochBatchIterator(ds, batch_size=3, max_tokens=None, seed=5, num_shards=2, shard_id=1)
    at_end.load_state_dict({"epoch": 1, "iterations_in_epoch": len(epoch1)})
    assert epoch_ids(at_end) == epoch2


# ---------------------------------------------------------------- embedded corpus


def test_embedded_corpus(tmp_path):
    import time

    from data.embedded_corpus import entropy_bits, make_language, prepare_embedded_corpus

    started = time.perf_counter()
    path = prepare_embedded_corpus(tmp_path)
    assert time.perf_counter() - started < 30
    meta = json.loads((path / "metadata.json").read_text())
    assert set(meta["splits"]) == {"train", "valid", "test"}
    assert meta["vocab_size"] <= 1024 and meta["dtype"] == "uint16"
    valid_text = (path / "text" / "valid.txt").read_text()
    assert meta["embedded"]["valid_chars"] == len(valid_text)
    assert 0.1 < meta["embedded"]["valid_bits_per_char"] < 1.5
    bits_per_word = meta["embedded"]["valid_bits_per_char"] * len(valid_text) / len(valid_text.split())
    assert 1 < bits_per_word < 3
    assert 1.5e6 < len((path / "text" / "train.txt").read_text()) < 2.5e6

    tokenizer = load_tokenizer(path)
    lines = valid_text.splitlines()
    valid = IndexedDataset(path / "valid")
    assert [tokenizer.decode(valid[i]) for i in (0, len(valid) - 1)] == [lines[0], lines[-1]]

    # The floor's arithmetic on a one-word line: start word, then the newline.
    language = make_language()
    assert entropy_bits(language, [[int(language.start_words[0])]]) == pytest.approx(4 + np.log2(12))

    stamp = (path / "metadata.json").stat().st_mtime_ns
    assert prepare_embedded_corpus(tmp_path) == path
    assert (path / "metadata.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["embedded-v1"]


def test_import_costs_and_direction():
    code = (
        "import sys, data.preprocess, data.token_block, data.iterator, data.embedded_corpus, "
        "data.tokenizer, data.dummy_lm, data.sources, data.encode; "
        "bad = [m for m in ('trainer', 'torch', 'datasets', 'torch.distributed') if m in sys.modules]; "
        "print(bad)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
