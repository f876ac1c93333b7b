"""fairseq's data options, each against fairseq's semantics on small fairseq-format data
dirs: --required-batch-size-multiple (batch_by_size_vec), sharded DATA (a:b: epoch e
trains on the ((e - 1) mod n)-th, resumable), --add-bos-token (eval-lm reads it from the
checkpoint), --pad-to-fixed-length, --skip-invalid-size-inputs-valid-test, --num-workers,
--combine-valid-subsets, and dummy_lm's validation."""

import functools
import json
import logging
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.data_dir import check_data_dir
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from data.iterator import EpochBatchIterator, batch_by_size, collate
from data.token_block import TokenBlockDataset
from helpers import DUMMY, TINY, compose, fairseq_batch_by_size_vec, parse_records, run_ranks, update_losses
from trainer.parallel.ranks import DistEnv

T = 32
ONE_RANK = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def write_bin(path, splits, symbols=40, seed=0):
    """A fairseq-preprocess data dir: dict.txt (ids 4…) and MMIDIDX splits. ``splits`` maps
    a split to (sentences, lowest word id, highest + 1) or to a list of sentences."""
    path.mkdir(parents=True, exist_ok=True)
    if symbols:
        (path / "dict.txt").write_text("".join(f"w{i} {1000 - i}\n" for i in range(symbols)))
    rng = np.random.default_rng(seed)
    for split, spec in splits.items():
        if isinstance(spec, tuple):
            n, low, high = spec
            spec = [rng.integers(low, high, size=rng.integers(3, 12)).tolist() for _ in range(n)]
        builder = IndexedDatasetBuilder(path / split, dtype=np.uint16)
        for sentence in spec:
            builder.add_item(np.array(list(sentence) + [2]))  # each sentence ends in </s>
        builder.finalize()
    return path


# ---------------------------------------------------------------- --required-batch-size-multiple


def test_batch_by_size_is_fairseqs():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 60))
        sizes = rng.integers(1, 20, size=n)
        order = rng.permutation(n)
        batch_size = int(rng.choice([0, 1, 3, 4, 8, 12, 17]))
        max_tokens = int(rng.choice([0, 20, 45, 64, 100]))
        if not batch_size and not max_tokens:
            batch_size = 5
        mult = int(rng.choice([1, 2, 3, 8]))
        ours = batch_by_size(order, sizes, batch_size or None, max_tokens or None, mult)
        # fairseq 0.12 keeps a last batch that is not a multiple, as shardlm does (later
        # releases drop it: issue #5036).
        assert ours == fairseq_batch_by_size_vec(order, sizes[order], max_tokens or -1, batch_size or -1, mult)
    # The cut of the issue: a full batch keeps max(N * (len // N), len % N) items.
    cut = batch_by_size(np.arange(30), np.ones(30, dtype=int), 12, None, 8)
    assert [len(b) for b in cut] == [8, 8, 8, 6]
    assert [len(b) for b in batch_by_size(np.arange(10), np.ones(10, dtype=int), 4, None, 8)] == [4, 4, 2]


def test_required_batch_size_multiple_reaches_the_batches():
    def sizes(argv):
        task = _task(DUMMY + ["--dataset-size", "40"] + argv)
        return [b["nsentences"] for b in task.batch_iterator("train", training=True).next_epoch_itr()]

    assert sizes(["--batch-size", "12"]) == [8] * 5  # fairseq's default multiple, 8
    shuffled = [12, 12, 12, 4]  # fairseq shuffles the batches of epoch 1 by numpy_seed(seed + 1)
    np.random.RandomState(1 + 1).shuffle(shuffled)
    assert shuffled != [12, 12, 12, 4]
    assert sizes(["--batch-size", "12", "--required-batch-size-multiple", "1"]) == shuffled


# ---------------------------------------------------------------- sharded DATA


def _recording_train(index, argv, out):
    """One process of `train` (trainer.main.run, the real loop): each update's tokens and
    first column, each validation's scored tokens and loss."""
    from trainer.rendezvous import Rendezvous
    from trainer.train import main
    from trainer.train.loop import TrainLoop
    from trainer.train.trainer import Trainer

    step, valid_step, validate = Trainer.train_step, Trainer.valid_step, TrainLoop.validate
    rec = {"updates": [], "first": [], "valid_tokens": [], "valid_loss": []}

    def train_step(self, samples):
        # the words of the batch (special symbols aside)
        rec["updates"].append(sorted({int(t) for s in samples for t in s["src_tokens"].flatten().tolist() if t >= 4}))
        rec["first"].append(
            sorted(
                {(int(s["src_tokens"][r, 0]), int(s["target"][r, 0])) for s in samples for r in range(len(s["target"]))}
            )
        )
        return step(self, samples)

    def valid(self, batch):
        rec["valid_tokens"][-1] += batch["ntokens"]
        return valid_step(self, batch)

    def validating(self, epoch):
        rec["valid_tokens"].append(0)
        metric = validate(self, epoch)
        rec["valid_loss"].append(metric)
        return metric

    Trainer.train_step, Trainer.valid_step, TrainLoop.validate = train_step, valid, validating
    main.run(compose(argv), Rendezvous("", 1, rank=0, local_rank=0, local_world_size=1))
    Path(out).write_text(json.dumps(rec))


def recorded_train(argv, tmp_path, name):
    out = tmp_path / f"{name}.json"
    run_ranks(_recording_train, (argv + ["--log-format", "none"], str(out)), 1)
    return json.loads(out.read_text())


def num_targets(prefix, mode="none"):
    return TokenBlockDataset(IndexedDataset(prefix), T, mode).num_tokens


def test_sharded_data_trains_shard_by_epoch_and_resumes_on_the_right_one(tmp_path):
    # Shard a's train words are w0-w19 (ids 4-23), shard b's w20-w39; b has no dict.txt and
    # no valid split: the vocabulary and validation come from the first dir, as in fairseq.
    a = write_bin(tmp_path / "a", {"train": (30, 4, 24), "valid": (12, 4, 44), "valid1": (9, 4, 44)})
    b = write_bin(tmp_path / "b", {"train": (50, 24, 44)}, symbols=0, seed=1)
    data = f"{a}{os.pathsep}{b}"
    argv = [data] + TINY + ["--batch-size", "4"]
    whole = recorded_train(argv + ["--max-epoch", "3"], tmp_path, "whole")
    shard = ["a" if max(u) < 24 else "b" for u in whole["updates"]]
    assert all(min(u) >= 24 or max(u) < 24 for u in whole["updates"])  # no batch mixes shards
    na, nb = shard.index("b"), shard.count("b")
    assert shard == ["a"] * na + ["b"] * nb + ["a"] * na and na != nb
    assert whole["valid_tokens"] == [num_targets(a / "valid")] * 3  # valid of a, valid1 not combined

    # Stopped two updates into epoch 2 (shard b), resumed: the same batches, shard b first.
    first = recorded_train(
        [x for x in argv if x != "--no-save"]
        + ["--max-update", str(na + 2), "--save-dir", str(tmp_path / "ck"), "--combine-val"],
        tmp_path,
        "first",
    )
    rest = recorded_train(
        [x for x in argv if x != "--no-save"]
        + ["--max-epoch", "3", "--save-dir", str(tmp_path / "ck"), "--combine-val"],
        tmp_path,
        "rest",
    )
    assert first["updates"] + rest["updates"] == whole["updates"]
    assert min(rest["updates"][0]) >= 24  # the rest of epoch 2: shard b
    # --combine-val: valid and valid1 of a are one split
    assert set(rest["valid_tokens"]) == {num_targets(a / "valid") + num_targets(a / "valid1")}


def test_sharded_data_is_checked_dir_by_dir(tmp_path, capsys):
    import cli

    a = write_bin(tmp_path / "a", {"train": (20, 4, 44), "valid": (5, 4, 44)})
    other = write_bin(tmp_path / "other", {"train": (20, 4, 30)}, symbols=26)
    assert check_data_dir(f"{a}{os.pathsep}{a}", [], train_split="train").vocab_size == 44
    with pytest.raises(DataError, match=f"^{re.escape(str(other))} has another vocabulary than {re.escape(str(a))}; "):
        check_data_dir(f"{a}{os.pathsep}{other}", [], train_split="train")
    code = cli.COMMANDS["train"]([f"{a}{os.pathsep}{tmp_path / 'nodir'}"] + TINY + ["--batch-size", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1
    assert f"data directory {tmp_path / 'nodir'} (shard 2 of 2 in DATA) does not exist" in err[0]


# ---------------------------------------------------------------- --add-bos-token


def _eval_lm(index, path, data, out):

    from trainer.inference.eval_lm import eval_lm
    from trainer.parallel.ranks import init_rank, teardown
    from trainer.rendezvous import Rendezvous

    env = init_rank(
        compose(DUMMY + ["--batch-size", "1"]), Rendezvous("", 1, rank=0, local_rank=0, local_world_size=1), False
    )
    losses = []
    try:
        for workers in (0, 2):
            args = SimpleNamespace(
                path=path,
                data=data,
                gen_subset="valid",
                tokens_per_sample=None,
                context_window=0,
                sample_break_mode=None,
                batch_size=8,
                max_tokens=None,
                num_workers=workers,
                ema=False,
            )
            losses.append(eval_lm(args, env))
    finally:
        teardown()
    Path(out).write_text(json.dumps(losses))


def test_add_bos_token_trains_and_eval_lm_scores_as_training_validated(tmp_path):
    data = write_bin(tmp_path / "bin", {"train": (80, 4, 44), "valid": (20, 4, 44)})
    argv = (
        [str(data)]
        + [x for x in TINY if x != "--no-save"]
        + [
            "--batch-size",
            "4",
            "--max-update",
            "6",
            "--add-bos-token",
            "--decoder-learned-pos",
            "--save-dir",
            str(tmp_path / "ck"),
        ]
    )
    rec = recorded_train(argv, tmp_path, "bos")
    # Every row starts with <s> (0) and its target there is pad (1): not scored.
    assert all(first == [[0, 1]] for first in rec["first"])
    out = tmp_path / "eval.json"
    run_ranks(_eval_lm, (str(tmp_path / "ck" / "checkpoint_last"), str(data), str(out)), 1)
    by_workers = json.loads(out.read_text())
    assert by_workers[0] == pytest.approx(rec["valid_loss"][-1], rel=1e-5)
    assert by_workers[1] == by_workers[0]  # --num-workers: the same batches


def test_add_bos_and_fixed_length_collate():
    item = np.array([2, 5, 6, 7])
    plain = collate([item], pad=1)
    bos = collate([item], pad=1, bos=0)
    assert bos["src_tokens"].tolist() == [[0, 2, 5, 6]] and bos["target"].tolist() == [[1, 5, 6, 7]]
    assert bos["ntokens"] == plain["ntokens"] == 3
    fixed = collate([item, item[:2]], pad=1, bos=0, width=9)
    assert fixed["src_tokens"].tolist() == [[0, 2, 5, 6, 1, 1, 1, 1, 1], [0, 2, 1, 1, 1, 1, 1, 1, 1]]
    assert fixed["target"].tolist() == [[1, 5, 6, 7, 1, 1, 1, 1, 1], [1, 5, 1, 1, 1, 1, 1, 1, 1]]
    assert fixed["ntokens"] == 4


def test_add_bos_token_needs_a_position_for_it():
    from trainer.errors import UsageError

    with pytest.raises(UsageError, match="--add-bos-token makes samples of --tokens-per-sample \\+ 1 = 33"):
        compose(DUMMY + ["--batch-size", "4", "--add-bos-token", "--max-target-positions", "32"])
    from trainer.config.schema import model_positions

    assert model_positions(compose(DUMMY + ["--batch-size", "4", "--add-bos-token"])) == T + 1


# ---------------------------------------------------------------- --pad-to-fixed-length


def test_pad_to_fixed_length_pads_every_batch_and_changes_no_loss(tmp_path):
    data = write_bin(tmp_path / "bin", {"train": (60, 4, 44)})
    argv = [str(data)] + TINY + ["--batch-size", "4", "--sample-break-mode", "eos", "--disable-validation"]
    widths = {
        b["src_tokens"].shape[1]
        for b in _task(argv + ["--pad-to-fixed-length"]).batch_iterator("train", training=True).next_epoch_itr()
    }
    assert widths == {T}
    widths = {
        b["src_tokens"].shape[1]
        for b in _task(argv + ["--pad-to-fixed-length", "--add-bos-token"])
        .batch_iterator("train", training=True)
        .next_epoch_itr()
    }
    assert widths == {T + 1}
    assert max(b["src_tokens"].shape[1] for b in _task(argv).batch_iterator("train", True).next_epoch_itr()) < T
    assert update_losses(argv + ["--pad-to-fixed-length"], 3) == pytest.approx(update_losses(argv, 3), rel=1e-5)


# ---------------------------------------------------------------- --skip-invalid-size-inputs-valid-test


def _task(argv):
    from trainer.train.task import LMTask

    return LMTask(compose(argv), ONE_RANK)


def test_sentences_longer_than_a_sample(tmp_path, caplog):
    long = list(range(4, 4 + T + 3))  # 35 words + </s>: no block of 32 holds it
    short = [[5, 6, 7], [8, 9]]
    data = write_bin(tmp_path / "bin", {"train": short + [long] + short, "valid": short + [long, long] + short})
    argv = [str(data)] + TINY + ["--batch-size", "4", "--sample-break-mode", "eos"]
    with pytest.raises(DataError) as error:
        _task(argv)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"sentence #2 of {data / 'valid'} has an invalid size (36 tokens")
    assert message.endswith(
        "skip such sentences with --skip-invalid-size-inputs-valid-test, or raise --tokens-per-sample"
    )
    with caplog.at_level(logging.WARNING, logger="shardlm"):
        task = _task(argv + ["--skip-invalid-size-inputs-valid-test"])
        train = task.dataset("train")
    assert (
        f"2 sentences of {data / 'valid'} are longer than a sample and are skipped (the first: #2, 36 tokens"
        in caplog.text
    )
    assert task.dataset("valid").num_tokens == 2 * (4 + 3)  # the four short ones, each with its </s>
    # Training skips them with a warning, flag or not (fairseq's train iterator does too).
    assert f"1 sentences of {data / 'train'} are longer than a sample" in caplog.text
    assert train.num_tokens == 2 * (4 + 3)


# ---------------------------------------------------------------- --num-workers


def _with_pid(items, pad):
    return {**collate(items, pad), "pid": os.getpid()}


def test_num_workers_give_the_same_batches_and_resume(tmp_path):
    data = write_bin(tmp_path / "bin", {"train": (300, 4, 44)})
    blocks = TokenBlockDataset(IndexedDataset(data / "train"), 8, "complete")

    def itr(workers, **kw):
        return EpochBatchIterator(
            blocks,
            batch_size=None,
            max_tokens=40,
            seed=3,
            num_shards=2,
            shard_id=1,
            required_batch_size_multiple=8,
            num_workers=workers,
            collater=functools.partial(_with_pid, pad=1),
            **kw,
        )

    def tokens(batches):
        return [(b["src_tokens"].tolist(), b["target"].tolist(), b["ntokens"]) for b in batches]

    started = time.perf_counter()
    loaders = {w: itr(w) for w in (0, 1, 2)}
    epochs = {w: [list(i.next_epoch_itr()) for _ in range(2)] for w, i in loaders.items()}
    assert time.perf_counter() - started < 20  # two forks per epoch; no pickling of the data
    for w in (1, 2):
        assert [tokens(e) for e in epochs[w]] == [tokens(e) for e in epochs[0]]
        assert {b["pid"] for e in epochs[w] for b in e} != {os.getpid()}  # read by worker processes
    assert {b["pid"] for e in epochs[0] for b in e} == {os.getpid()}
    # Resume after 3 batches of epoch 2 with 2 workers: the loop's count, not the workers' read-ahead.
    run = itr(2)
    list(run.next_epoch_itr())
    second = run.next_epoch_itr()
    seen = [next(second) for _ in range(3)]
    state = run.state_dict()
    assert state == {"epoch": 2, "iterations_in_epoch": 3, "order": "fairseq-0.12"}
    resumed = itr(2)
    resumed.load_state_dict(state)
    assert tokens(seen) + tokens(resumed.next_epoch_itr()) == tokens(epochs[0][1])


def test_num_workers_train_the_same(tmp_path):
    data = write_bin(tmp_path / "bin", {"train": (60, 4, 44)})
    argv = [str(data)] + TINY + ["--batch-size", "4", "--disable-validation"]
    assert update_losses(argv + ["--num-workers", "2"], 3) == update_losses(argv + ["--num-workers", "0"], 3)


# ---------------------------------------------------------------- --combine-valid-subsets


def test_combine_valid_subsets(tmp_path, caplog):
    data = write_bin(
        tmp_path / "bin",
        {"train": (40, 4, 44), "valid": (10, 4, 44), "valid1": (7, 4, 44), "valid2": (5, 4, 44), "valid4": (3, 4, 44)},
    )
    argv = [str(data)] + TINY + ["--batch-size", "4"]
    with caplog.at_level(logging.WARNING, logger="shardlm"):
        alone = _task(argv).dataset("valid")
    assert alone.num_tokens == num_targets(data / "valid")
    assert f"valid1, valid2, valid4 in {data} are not validated on: --combine-valid-subsets" in caplog.text
    # valid, valid1, valid2: fairseq stops at the first missing one (valid3)
    combined = _task(argv + ["--combine-val"]).dataset("valid")
    assert combined.num_tokens == sum(num_targets(data / s) for s in ("valid", "valid1", "valid2"))
    assert [x.tolist() for x in combined] == [
        x.tolist()
        for s in ("valid", "valid1", "valid2")
        for x in TokenBlockDataset(IndexedDataset(data / s), T, "none")
    ]


# ---------------------------------------------------------------- dummy_lm's validation


def test_dummy_lm_validates_and_logs_it(tmp_path):
    log, tb = tmp_path / "train.log", tmp_path / "tb"
    run_ranks(
        _recording_train,
        (
            DUMMY
            + [
                "--batch-size",
                "4",
                "--max-update",
                "2",
                "--log-format",
                "json",
                "--log-file",
                str(log),
                "--tensorboard-logdir",
                str(tb),
            ],
            str(tmp_path / "rec.json"),
        ),
        1,
    )
    records = parse_records(log.read_text())
    assert records["valid"][-1]["valid_num_updates"] == 2 and records["valid"][-1]["valid_loss"] > 6
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb / "valid"))
    acc.Reload()
    assert "loss" in acc.Tags()["scalars"]
    # Another split name, other random data (fairseq: any split name gives data).
    task = _task(DUMMY + ["--batch-size", "4"])
    assert task.has_split("test") and not np.array_equal(task.dataset("test")[0], task.dataset("valid")[0])
    assert not np.array_equal(task.dataset("valid")[0], task.dataset("train")[0])
