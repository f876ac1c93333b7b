"""shardlm reads a data-bin in fairseq 0.12's order: the blocks of --sample-break-mode none
and the batches of every epoch and rank are fairseq's, so a fairseq run resumed here sees
the batches fairseq would have seen.

tests/fixtures/fairseq/data-bin is a fairseq-preprocess data-bin (test.* is a copy of
valid.*). fairseq 0.12.2's numbers on it: fairseq-train --tokens-per-sample 64
--batch-size 8 --seed 3 logged "grouped total_num_itrs = 86", wpb 512 for updates 1-30 and
valid_bsz 7.9 / valid_wpb 501.2; fairseq-eval-lm --tokens-per-sample 64 --batch-size 8
logged "71 examples" and "Evaluated 4,511 tokens". The fairseq functions below are
transcribed from fairseq 0.12.2's source, independently of data/."""

import contextlib
import functools
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from data.context_window import ContextWindowDataset
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from data.iterator import EpochBatchIterator, collate_pairs
from data.token_block import TokenBlockDataset
from helpers import fairseq_batch_by_size_vec

DATA_BIN = Path(__file__).parent / "fixtures" / "fairseq" / "data-bin"
EOS, PAD = 2, 1


def blocks_of(split, T=64):
    return TokenBlockDataset(IndexedDataset(str(DATA_BIN / split)), T, "none", pad=PAD, eos=EOS)


# ---------------------------------------------------------------- fairseq, transcribed


class DatasetSearcher:
    """fairseq/data/token_block_utils_fast.pyx: a flat stream position -> (sequence, offset)."""

    def __init__(self, sizes):
        self.sizes = sizes
        self.current_i = self.current_index = self.current_offset = 0

    def step(self, i):
        if i < self.current_i:
            self.current_i = self.current_index = self.current_offset = 0
        if i > self.current_i:
            to_consume = i - self.current_i
            remaining = self.sizes[self.current_index] - self.current_offset
            if remaining > to_consume:
                self.current_offset += to_consume
                self.current_i += to_consume
            else:
                self.current_i += remaining
                self.current_index += 1
                self.current_offset = 0
                return True
        return False

    def seek(self, i):
        while self.step(i):
            pass
        assert self.current_i == i


def fairseq_token_blocks(sequences, block_size, eos):
    """TokenBlockDataset(break_mode="none", include_targets=True)[k] for every k: (source, target)."""
    sizes = [len(s) for s in sequences]
    total = sum(sizes)
    starts = [i * block_size for i in range(math.ceil(total / block_size))]  # _get_slice_indices_none_mode
    slice_indices = [(start, min(start + block_size, total)) for start in starts]
    ds = DatasetSearcher(sizes)
    out = []
    for s, e in slice_indices:  # _get_block_to_dataset_index_fast, then __getitem__
        ds.seek(s)
        start_ds_idx, start_offset = ds.current_index, ds.current_offset
        if e <= s:
            end_ds_idx = start_ds_idx
        else:
            ds.seek(e - 1)
            end_ds_idx = ds.current_index
        buffer = np.concatenate([sequences[idx] for idx in range(start_ds_idx, end_ds_idx + 1)])
        s_, e_ = start_offset, start_offset + (e - s)
        item = buffer[s_:e_]
        source = np.concatenate([[eos], buffer[0 : e_ - 1]]) if s_ == 0 else buffer[s_ - 1 : e_ - 1]
        out.append((source.tolist(), item.tolist()))
    return out


@contextlib.contextmanager
def numpy_seed(seed):
    """fairseq/data/data_utils.py numpy_seed: seeds numpy's global state, puts it back after."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def fairseq_epoch(sizes, seed, epoch, num_shards, shard_id, max_tokens=-1, batch_size=-1, multiple=1):
    """One rank's batches of one training epoch, as fairseq 0.12.2 makes them:
    FairseqTask.get_batch_iterator (MonolingualDataset.ordered_indices under numpy_seed(seed),
    batch_by_size), EpochBatchIterator.ordered_batches (numpy_seed(seed + epoch) then
    np.random.shuffle) and ShardedIterator (rank shard_id takes every num_shards-th batch,
    short shards filled with [])."""
    with numpy_seed(seed):
        indices = np.lexsort([np.random.permutation(len(sizes)), sizes])
    frozen = fairseq_batch_by_size_vec(indices, sizes[indices], max_tokens, batch_size, multiple)
    batches = list(frozen)
    with numpy_seed(seed + epoch):
        np.random.shuffle(batches)
    sharded_len = math.ceil(len(batches) / num_shards)
    mine = itertools.islice(batches, shard_id, len(batches), num_shards)
    return [list(b) for _, b in itertools.zip_longest(range(sharded_len), mine, fillvalue=[])]


# ---------------------------------------------------------------- shardlm's


class ItemIds:
    """A dataset's sizes; item i is [i], so a batch shows which items it holds."""

    def __init__(self, dataset):
        self.sizes = dataset.sizes

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return np.array([i])


def ids(items):
    return [int(item[0]) for item in items]


def shardlm_epochs(dataset, epochs, **kw):
    itr = EpochBatchIterator(ItemIds(dataset), collater=ids, **kw)
    return [list(itr.next_epoch_itr()) for _ in range(epochs)]


# ---------------------------------------------------------------- the tests


def test_the_fixture_gives_fairseqs_counts():
    train = blocks_of("train")
    itr = EpochBatchIterator(
        ItemIds(train), batch_size=8, max_tokens=None, seed=3, required_batch_size_multiple=8, collater=ids
    )
    assert len(itr) == 86  # fairseq-train: "grouped total_num_itrs = 86"
    targets = [int((train.sizes[np.array(b)] - 1).sum()) for b in itr.next_epoch_itr()]
    assert targets[:30] == [512] * 30  # fairseq-train's wpb of updates 1-30
    assert sum(targets) == train.num_tokens == len(train.indexed.tokens)

    test = blocks_of("test")
    assert len(test) == 71 and test.num_tokens == 4511  # fairseq-eval-lm: 71 examples, 4,511 tokens
    # eval-lm's own path (trainer/inference/eval_lm.py evaluate) scores every one of them ...
    evaluated = EpochBatchIterator(
        ContextWindowDataset(test, 0, PAD),
        batch_size=8,
        max_tokens=None,
        seed=1,
        shuffle=False,
        every_batch=True,
        collater=functools.partial(collate_pairs, pad=PAD),
    )
    batches = list(evaluated.next_epoch_itr())
    assert sum(b["ntokens"] for b in batches) == 4511 and sum(b["nsentences"] for b in batches) == 71
    # ... and validation's batches are fairseq-train's: 9 of them, valid_bsz 7.9, valid_wpb 501.2
    valid = shardlm_epochs(
        blocks_of("valid"), 1, batch_size=8, max_tokens=None, seed=3, shuffle=False, required_batch_size_multiple=8
    )[0]
    assert len(valid) == 9 and round(71 / 9, 1) == 7.9 and round(4511 / 9, 1) == 501.2


@pytest.mark.parametrize(
    "mode, T, batching",
    [
        ("none", 64, dict(batch_size=8, max_tokens=None, required_batch_size_multiple=8)),  # the fixture's run
        ("none", 64, dict(batch_size=5, max_tokens=None, required_batch_size_multiple=1)),  # 138 batches: uneven
        ("complete", 48, dict(batch_size=None, max_tokens=200, required_batch_size_multiple=8)),  # sizes differ
    ],
)
def test_epochs_and_shards_are_fairseqs(mode, T, batching):
    blocks = TokenBlockDataset(IndexedDataset(str(DATA_BIN / "train")), T, mode, pad=PAD, eos=EOS)
    fairseq_sizes = (blocks.sizes - 1).astype(np.uint16)  # fairseq's block sizes: their targets
    limits = dict(
        max_tokens=batching["max_tokens"] or -1,
        batch_size=batching["batch_size"] or -1,
        multiple=batching["required_batch_size_multiple"],
    )
    for num_shards in (1, 2):
        for shard_id in range(num_shards):
            np.random.seed(0)
            ours = shardlm_epochs(blocks, 2, seed=3, num_shards=num_shards, shard_id=shard_id, **batching)
            assert np.random.randint(1 << 30) == np.random.RandomState(0).randint(1 << 30)  # global state untouched
            for epoch, batches in enumerate(ours, 1):
                theirs = fairseq_epoch(fairseq_sizes, 3, epoch, num_shards, shard_id, **limits)
                # the same batches in the same order; where fairseq's shards are uneven, its last
                # batch of a longer shard is left out (every rank runs the same steps)
                assert batches == theirs[: len(batches)] and len(theirs) - len(batches) <= 1
    assert ours[0] != ours[1]  # each epoch shuffled anew


def write_sequences(prefix, seqs):
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for seq in seqs:
        builder.add_item(np.array(seq))
    builder.finalize()
    return IndexedDataset(str(prefix))


@pytest.mark.parametrize("T", [1, 7, 64])
def test_blocks_are_fairseqs(T, tmp_path):
    indexed = IndexedDataset(str(DATA_BIN / "test"))
    stream = indexed.tokens.astype(np.int64)
    ends = np.cumsum(indexed.sizes)
    # Sequences without a closing </s> too: there fairseq's eos context differs from the stream's.
    rng = np.random.default_rng(T)
    open_ended = [rng.integers(4, 50, size=int(rng.integers(1, 20))) for _ in range(40)]
    cases = [(indexed, np.split(stream, ends[:-1])), (write_sequences(tmp_path / "open", open_ended), open_ended)]
    for data, sequences in cases:
        blocks = TokenBlockDataset(data, T, "none", pad=PAD, eos=EOS)
        items = [blocks[k] for k in range(len(blocks))]
        assert [(item[:-1].tolist(), item[1:].tolist()) for item in items] == fairseq_token_blocks(sequences, T, EOS)
        whole = np.concatenate(sequences).tolist()
        assert [t for item in items for t in item[1:].tolist()] == whole  # every token a target once
        assert items[0][0] == EOS and items[0][1:].tolist() == whole[:T]


def test_a_saved_position_resumes_after_the_same_batches_on_other_ranks(caplog):
    """data/position.py convert_position: ranks take an epoch's batches in turn, so k
    steps of W ranks are its first k * W batches on any number of ranks."""
    from data.iterator import ORDER
    from data.position import convert_position

    blocks = blocks_of("train")
    kw = dict(batch_size=8, max_tokens=None, seed=3, required_batch_size_multiple=8)
    epoch = shardlm_epochs(blocks, 1, **kw)[0]
    two_ranks = [shardlm_epochs(blocks, 1, num_shards=2, shard_id=r, **kw)[0][:9] for r in (0, 1)]
    assert sorted(two_ranks[0] + two_ranks[1]) == sorted(epoch[:18])  # 9 steps of 2 ranks
    saved = {"epoch": 1, "iterations_in_epoch": 9, "world_size": 2, "batch_size": 8, "max_tokens": None, "order": ORDER}

    caplog.set_level("WARNING")
    assert convert_position(saved, 2, 8, None) == {**saved, "split": 1}
    one_rank = convert_position(saved, 1, 8, None)
    assert one_rank["iterations_in_epoch"] == 18 and not caplog.records
    resumed = EpochBatchIterator(ItemIds(blocks), collater=ids, **kw)
    resumed.load_state_dict(one_rank)
    assert list(resumed.next_epoch_itr()) == epoch[18:]  # the rest, none twice
    # 18 batches are not a whole number of steps of 4 ranks: the nearest earlier one
    assert convert_position(saved, 4, 8, None)["iterations_in_epoch"] == 4
    assert "not a whole number of this run's steps of 4" in caplog.text
    # another per-rank batch: other batches, no position consumed the same; as many sequences
    caplog.clear()
    assert convert_position(saved, 1, 16, None)["iterations_in_epoch"] == 9
    assert "not the checkpoint's (8, None)" in caplog.text
    # a position saved in shardlm's earlier order counts the same batches, with a warning
    caplog.clear()
    earlier = {k: v for k, v in saved.items() if k != "order"}
    assert convert_position(earlier, 2, 8, None) == {**earlier, "split": 1}
    assert "saved by an earlier shardlm" in caplog.text


def test_a_per_rank_batch_that_divides_the_saved_one_reads_the_saved_batches_split(caplog):
    """2 ranks x --batch-size 8 resumed on 4 ranks x --batch-size 4: each of the saved
    order's batches is split in two, in order, so every update after the resume is made of
    the sequences the uninterrupted run's would have been."""
    from data.iterator import ORDER
    from data.position import convert_position

    blocks = blocks_of("train")
    kw = dict(max_tokens=None, seed=3, required_batch_size_multiple=1)
    epoch = shardlm_epochs(blocks, 1, batch_size=8, **kw)[0]
    saved = {"epoch": 1, "iterations_in_epoch": 3, "world_size": 2, "batch_size": 8, "max_tokens": None, "order": ORDER}
    caplog.set_level("WARNING")
    position = convert_position(saved, 4, 4, None)
    assert position["split"] == 2 and position["batch_size"] == 8 and position["iterations_in_epoch"] == 3
    assert not caplog.records
    ranks = []
    for r in range(4):
        resumed = EpochBatchIterator(ItemIds(blocks), batch_size=4, num_shards=4, shard_id=r, collater=ids, **kw)
        resumed.split_batches(position["split"])
        resumed.load_state_dict(position)
        ranks.append(list(resumed.next_epoch_itr()))
    usable = len(epoch) // 2 * 2  # the uninterrupted run's epoch on 2 ranks
    for step, old in enumerate(range(6, usable, 2)):  # the saved run's steps after the 3rd
        assert sorted(sum((ranks[r][step] for r in range(4)), [])) == sorted(epoch[old] + epoch[old + 1])
    # a later resume of the split run counts its position in the same order
    again = convert_position({**position, "world_size": 4, "iterations_in_epoch": 5}, 1, 8, None)
    assert again["split"] == 1 and again["iterations_in_epoch"] == 10
