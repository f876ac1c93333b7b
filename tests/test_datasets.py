"""data/ datasets: token blocks, dummy_lm, batch iterator (sharding, resume), embedded corpus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.dummy_lm import DummyLMDataset
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from data.iterator import EpochBatchIterator, collate
from data.token_block import TokenBlockDataset
from data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
    "jolly boxing judges, and (sometimes) 42 zebras cross the café's über-long road!"
).split()


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
            # Cut every T tokens from 0: every token a target once; the context is the token
            # before, or </s> where a sequence starts (the stream's first block included).
            assert len(blocks) == -(-len(stream) // T) and targets == stream
            seq_start = set(np.cumsum([0] + [len(s) for s in seqs]).tolist())
            for k, item in enumerate(items):
                assert item[1:].tolist() == stream[k * T : k * T + T]
                assert item[0] == (2 if k * T in seq_start else stream[k * T - 1])
            assert items[0].tolist() == [2] + stream[:T]
            continue
        # A sequence longer than T fits no block: left out and listed (fairseq filters it).
        too_long = [k for k, s in enumerate(seqs) if len(s) > T and not (mode == "complete_doc" and separator[k])]
        assert blocks.too_long.tolist() == too_long
        fits = [len(s) <= T for s in seqs]
        if mode == "complete_doc":
            # Every token of a sequence that fits, separators aside, is a target.
            assert targets == [t for t, s in zip(stream, seq_of) if fits[s] and not separator[s]]
        else:
            assert targets == [t for t, s in zip(stream, seq_of) if fits[s]]  # first tokens included
        seq_start = np.cumsum([0] + [len(s) for s in seqs])
        for k, (start, end) in enumerate(zip(blocks.target_starts.tolist(), blocks.target_ends.tolist())):
            # The item is the targets plus the token before them, a virtual </s> at 0.
            assert items[k].tolist() == ([2] + stream)[start : end + 1]
            # Blocks hold whole sequences, never a left-out one (nor, complete_doc, a separator).
            covered = range(seq_of[start], seq_of[end - 1] + 1)
            assert start == seq_start[seq_of[start]] and end == seq_start[seq_of[end - 1] + 1]
            assert all(fits[s] and not (mode == "complete_doc" and separator[s]) for s in covered)
            if mode == "eos":
                assert len(covered) == 1
        if mode == "complete":
            # Greedy: the next block's first sequence would not have fit.
            assert len(blocks) <= len(TokenBlockDataset(ds, T, "eos"))
            for k in range(len(blocks) - 1):
                nxt = seq_of[blocks.target_starts[k + 1]]
                if seq_of[blocks.target_ends[k] - 1] + 1 == nxt:  # nothing left out between them
                    assert blocks.sizes[k] - 1 + len(seqs[nxt]) > T


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
    # by size, ties in seed 1's order; at most 4 items, at most 40 tokens (2 of 19)
    order = np.lexsort([np.random.RandomState(1).permutation(12), ds.sizes]).tolist()
    assert epoch_ids(itr) == [order[0:4], order[4:8], order[8:10], order[10:12]]
    assert sorted(order[:10]) == list(range(10))
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


def test_validation_shards_cover_every_batch_with_dummies():
    ds = CountingDataset(np.arange(2, 9))  # 7 items of batch 2: 4 batches for 3 ranks
    shards = [
        EpochBatchIterator(
            ds, batch_size=2, max_tokens=None, seed=1, shuffle=False, num_shards=3, shard_id=r, every_batch=True
        )
        for r in range(3)
    ]
    per_rank = [list(s.next_epoch_itr()) for s in shards]
    assert [len(r) for r in per_rank] == [2, 2, 2]  # every rank runs the same number of forwards
    real = [b for r in per_rank for b in r if not b.get("dummy")]
    assert sum(b["nsentences"] for b in real) == 7 and sum(b["ntokens"] for b in real) == sum(range(1, 8))
    dummies = [b for r in per_rank for b in r if b.get("dummy")]
    assert len(dummies) == 2 and all(b["ntokens"] == 0 and b["nsentences"] == 0 for b in dummies)


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
    assert state == {"epoch": 1, "iterations_in_epoch": 4, "order": "fairseq-0.12"} and not run.end_of_epoch()

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


def test_embedded_corpus(tmp_path, capsys):
    import time

    from data.embedded_corpus import entropy_bits, make_language, prepare_embedded_corpus

    started = time.perf_counter()
    path = prepare_embedded_corpus(tmp_path)
    assert time.perf_counter() - started < 30
    # Its progress goes to stderr: stdout belongs to the command that asked for the corpus
    # (`plan --format json` prints one JSON object there).
    out, err = capsys.readouterr()
    assert out == "" and "preparing the embedded corpus" in err and "tokens/s" in err
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
