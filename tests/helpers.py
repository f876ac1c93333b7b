"""Shared by the training tests: tiny configs, in-process updates, subprocess runs, fairseq's
batching transcribed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from trainer.config.checks import check_config
from trainer.config.commands import COMMAND_GROUPS
from trainer.config.compose import compose_config
from trainer.config.flags import build_command_parser, build_parser, parse_command, parse_flags

TINY = [
    "--arch",
    "transformer_lm_gpt2_tiny",
    "--decoder-attention-heads",
    "2",
    "--decoder-ffn-embed-dim",
    "128",
    "--dropout",
    "0",
    "--attention-dropout",
    "0",
    "--tokens-per-sample",
    "32",
    "--no-save",
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
]
# dummy_lm validates as fairseq's does, on --dataset-size random samples: two batches
# exercise the path at a fraction of the cost.
DUMMY = TINY + ["--task", "dummy_lm", "--dict-size", "256", "--dataset-size", "512", "--max-valid-steps", "2"]


def compose(argv):
    ns, settings, overrides = parse_flags(build_parser(), argv)
    cfg = compose_config(settings, overrides, ns.config_dir, ns.config_name)
    check_config(cfg)
    return cfg


def preprocess_options(argv):
    """preprocess's options (a PreprocessConfig) from its command line, parsed as cli.py does;
    data.preprocess.preprocess takes them."""
    group, cls = COMMAND_GROUPS["preprocess"]
    return parse_command(build_command_parser("preprocess", group, cls, ""), group, cls, [str(a) for a in argv])


def update_losses(argv, n_updates, rdv=None, with_gnorm=False, merge=1):
    """Per-update mean token loss (nats) of the first n updates (and gnorm), run in this
    process through the same build and train_step that `train` uses. ``merge``: each
    ``merge`` consecutive batches of the epoch taken as one batch holding their sequences."""
    from trainer.parallel import ranks as distributed
    from trainer.parallel.parallelize import uses_fsdp
    from trainer.rendezvous import Rendezvous

    cfg = compose(argv)
    rdv = rdv or Rendezvous("", 1)
    env = distributed.init_rank(cfg, rdv, needs_process_group=uses_fsdp(cfg))
    try:
        return _updates(cfg, env, n_updates, with_gnorm, merge)
    finally:
        distributed.teardown()


def _merged(batches):
    import torch

    return {
        "src_tokens": torch.cat([b["src_tokens"] for b in batches]),
        "target": torch.cat([b["target"] for b in batches]),
        "ntokens": sum(b["ntokens"] for b in batches),
        "nsentences": sum(b["nsentences"] for b in batches),
    }


def _updates(cfg, env, n_updates, with_gnorm, merge=1):
    from data.iterator import grouped
    from trainer.train.main import build

    task, trainer, _ = build(cfg, env)
    itr = task.batch_iterator(cfg.dataset.train_subset, training=True)
    batches = itr.next_epoch_itr()
    if merge > 1:
        batches = map(_merged, grouped(batches, merge))
    losses, gnorms = [], []
    for samples in grouped(batches, cfg.optimization.update_freq):
        stats = trainer.train_step(samples).values()  # a host read per update: the test's, not train's
        losses.append(stats["loss_sum"] / stats["sample_size"])
        gnorms.append(stats["gnorm"])
        if len(losses) == n_updates:
            trainer.finish()
            return (losses, gnorms) if with_gnorm else losses
    raise AssertionError(f"only {len(losses)} updates in an epoch")


def _rank_worker(index, argv, world, port, n_updates, out):
    from trainer.rendezvous import Rendezvous

    rdv = Rendezvous(f"tcp://127.0.0.1:{port}", world, rank=index, local_rank=index, local_world_size=world)
    losses, gnorms = update_losses(argv, n_updates, rdv, with_gnorm=True)
    Path(f"{out}.{index}").write_text(json.dumps({"losses": losses, "gnorms": gnorms}))


_server_environment = None  # os.environ when the rank server now running was started


def run_ranks(fn, args, nprocs):
    """`fn(index, *args)` on `nprocs` real processes, forked as `train` forks its local ranks
    (trainer/launch/local_ranks.py). The server they are forked from is kept from one test to the
    next, so each test's ranks start with torch imported, and restarted when the environment
    has changed since it started (its forks inherit its environment, not this process's).
    Raises if a rank fails; its traceback is on stderr."""
    import tempfile

    from trainer.launch import local_ranks
    from trainer.launch.launcher import join_ranks

    global _server_environment
    environment = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's, per test
    if not local_ranks.rank_server_running() or _server_environment != environment:
        local_ranks.start_rank_server()
        _server_environment = environment
    with tempfile.TemporaryDirectory(prefix="shardlm-test-ranks-") as errors_dir:
        ranks = local_ranks.start_local_ranks(fn, args, nprocs, errors_dir)
        assert join_ranks(ranks, 0, "test", "", errors_dir) == 0, f"a rank of {fn.__name__} failed (its error is above)"


def multi_rank_losses(argv, world, n_updates, tmp_path):
    """(losses, gnorms) per update on `world` real processes over gloo; every rank must agree."""
    from trainer.rendezvous import free_port

    out = tmp_path / f"ranks-{free_port()}"
    run_ranks(_rank_worker, (argv, world, free_port(), n_updates, str(out)), world)
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    assert all(r == results[0] for r in results), "ranks disagree"
    return results[0]["losses"], results[0]["gnorms"]


def run_train(argv, cwd=None, check=True, env=None):
    """`train` as users run it, in a subprocess; returns (records by tag, completed process)."""
    cmd = [str(Path(sys.executable).with_name("train"))] + list(argv)
    full_env = {**os.environ, **(env or {})}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=full_env, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"train failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return parse_records(r.stdout), r


def train_here(argv, capfd, check=True):
    """`train` run in this process through its console script's entry point (cli.py): the same
    flags, records, exit code and stderr lines as `run_train`, without a fresh interpreter's
    seconds of imports. One rank only (spawned ranks write to their own streams). For the runs
    whose check is not about the process itself (signals, exit at once, what outlives it),
    such as a reference curve or the run that resumes. The signal handlers and logging that
    training installs are put back. Returns (records by tag, completed process)."""
    import logging
    import signal

    import cli
    from trainer.errors import STOP_SIGNALS

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    dispositions = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    capfd.readouterr()
    try:
        code = cli.COMMANDS["train"]([str(a) for a in argv]) or 0
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for sig, handler in dispositions.items():
            signal.signal(sig, handler)
    out, err = capfd.readouterr()
    r = subprocess.CompletedProcess(argv, code, out, err)
    if check and code != 0:
        raise AssertionError(f"train failed ({code}):\n{out[-3000:]}\n{err[-3000:]}")
    return parse_records(out), r


def parse_records(text):
    """json log lines → {tag: [record, …]}; the object runs from the first `{` to the line end."""
    records = {}
    for line in text.splitlines():
        if "{" in line and line.count(" | ") >= 3:
            tag = line.split(" | ")[2]
            records.setdefault(tag, []).append(json.loads(line[line.index("{") :]))
    return records


def _recording_rank(index, argv, world, port, out):
    """One rank of `train` run through trainer.main.run (the real loop, checkpoints and
    all), recording each update's exact loss: the log rounds it to 3 decimals."""
    from trainer.rendezvous import Rendezvous
    from trainer.train import main
    from trainer.train.trainer import Trainer

    step, updates = Trainer.train_step, []

    def recording(self, samples):
        update = step(self, samples)
        stats = update.values()  # a host read per update: the test's, not train's
        if not stats["bad"]:
            updates.append([self.num_updates, stats])
        return update

    Trainer.train_step = recording
    rdv = Rendezvous(
        f"tcp://127.0.0.1:{port}" if world > 1 else "", world, rank=index, local_rank=index, local_world_size=world
    )
    main.run(compose(argv), rdv)
    Path(f"{out}.{index}").write_text(json.dumps(updates))


def train_updates(argv, world, tmp_path):
    """{num_updates: (loss, gnorm)} of a `train` run on `world` real processes (gloo); the
    loss per sample (token, or dpo's pair), in nats."""
    return {
        n: (s["loss_sum"] / s["sample_size"], s["gnorm"]) for n, s in train_update_stats(argv, world, tmp_path).items()
    }


def assert_resumes_on_the_curve(saved, argv, world, tmp_path, first, whole):
    """`train ARGV` on `world` ranks resumed from a copy of checkpoint dir `saved` (after its
    updates `first`, {1..4: (loss, gnorm)}) through update 8: the curve `whole` of a run never
    stopped, no update run twice."""
    import shutil

    import pytest

    shutil.copytree(saved, tmp_path / "ckpt")
    second = train_updates(argv + ["--max-update", "8", "--save-dir", str(tmp_path / "ckpt")], world, tmp_path)
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [5, 6, 7, 8], "an update ran twice"
    for n, (loss, gnorm) in {**first, **second}.items():
        assert loss == pytest.approx(whole[n][0], rel=1e-5), f"update {n}"
        assert gnorm == pytest.approx(whole[n][1], rel=1e-4), f"update {n}"


def train_update_stats(argv, world, tmp_path):
    """{num_updates: every sum of the update (trainer.meters.STATUS and the task's extras)}
    of a `train` run on `world` real processes (gloo)."""
    from trainer.rendezvous import free_port

    out = tmp_path / f"updates-{free_port()}"
    run_ranks(_recording_rank, (argv, world, free_port(), str(out)), world)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    assert all(r == ranks[0] for r in ranks), "ranks disagree"
    return {n: stats for n, stats in ranks[0]}


def byte_level_tokenizer(lines, specials, bos=None, vocab_size=300):
    """A small byte-level BPE trained on `lines`, like Llama 3's and Qwen's: the base
    vocabulary, then the special tokens; the template puts `bos` before every text (Llama 3)
    or nothing (Qwen)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    steps = [processors.ByteLevel(trim_offsets=False)]
    if bos:
        steps.append(
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
            )
        )
    tok.post_processor = processors.Sequence(steps)
    return tok


def fairseq_batch_by_size_vec(indices, num_tokens_vec, max_tokens, max_sentences, bsz_mult):
    """fairseq/data/data_utils_fast.pyx batch_by_size_vec, line for line (-1: no limit)."""
    if len(indices) == 0:
        return []
    ends = np.zeros(len(indices), dtype=np.int64)
    count = batch_start = 0
    tail_max = batch_max = 0
    for pos in range(len(indices)):
        tail_max = max(tail_max, num_tokens_vec[pos])
        new_end = pos + 1
        new_max = max(batch_max, tail_max)
        sentences = new_end - batch_start
        overflow = (max_sentences > 0 and sentences > max_sentences) or (
            max_tokens > 0 and sentences * new_max > max_tokens
        )
        matches = sentences < bsz_mult or sentences % bsz_mult == 0
        if overflow:
            tail_tokens = tail_max * (new_end - ends[count])
            if max_tokens > 0 and tail_tokens > max_tokens:
                count += 1
                ends[count] = pos
                tail_max = num_tokens_vec[pos]
            batch_start = ends[count]
            count += 1
            new_max = tail_max
        if overflow or matches:
            ends[count] = new_end
            batch_max = new_max
            tail_max = 0
    if ends[count] != len(indices):
        count += 1
    return [b.tolist() for b in np.split(indices, ends[:count])]


def run_preprocess(*argv) -> Path:
    """preprocess in this process, its flags as strings; the data dir it wrote."""
    from data.preprocess import preprocess

    return preprocess(preprocess_options([str(a) for a in argv]))


def rows(prefix) -> list[list[int]]:
    """The token rows of a binarized split."""
    from data.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]
