"""Checks of what a run will read and where it will write, after the config checks and
before any rank starts: the data directory, the batches it gives the ranks, the paths of
--save-dir and --log-file. A problem is one line and nothing has been written yet.
Torch-free, like trainer/config/checks.py.
"""

import os
import shutil
from pathlib import Path

from data.conversations import check_task_data, task_samples
from data.data_dir import check_data_dir, check_mixture, check_token_ids, data_dirs
from data.embedded_corpus import SPLITS
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, exists
from data.iterator import EpochBatchIterator
from data.mixture import parse_mixture
from data.token_block import TokenBlockDataset
from data.tokenizer import has_tokenizer, tokenizer_identity
from trainer.checkpoint.files import restore_choice
from trainer.config.model_source import fairseq_source, hf_finetune_dir, hf_vocab_size
from trainer.config.schema import uses_fsdp, vocabulary_data
from trainer.errors import UsageError
from trainer.formats.fairseq.checkpoint_file import check_fairseq_dictionary
from trainer.host import host_memory_gb, runs_on_gpu
from trainer.plan.search import model_shape, sequences_per_batch
from trainer.rendezvous import infer_rendezvous

DEFAULT_VALID_SUBSET = "valid"


def check_inputs(cfg, environ=None):
    environ = os.environ if environ is None else environ
    _check_paths(cfg)
    world_size = infer_rendezvous(cfg, environ).world_size
    vocab = cfg.task.dict_size if cfg.task._name == "dummy_lm" else 0
    if cfg.task._name in ("language_modeling", "sft", "dpo") and vocabulary_data(cfg.task):
        vocab = _check_data(cfg, world_size)
    elif cfg.task._name == "language_modeling":
        _check_embedded_splits(cfg.dataset)
    if hf_finetune_dir(cfg) is not None:
        vocab = _check_hf_vocabulary(cfg, vocab)
    if fairseq_source(cfg) is not None:
        _check_fairseq_dictionary(cfg, vocab)
    _check_fits_host(cfg, vocab, world_size)
    _check_compiler(cfg, environ)


def _check_hf_vocabulary(cfg, data_vocab):
    """A Hugging Face model reads ids of its own tokenizer: the data must have been made by
    it (`preprocess --tokenizer HF_DIR`), or the embeddings it learned mean other tokens.
    Returns the model's vocabulary (config.json's vocab_size, which may exceed the data's)."""
    path, t = hf_finetune_dir(cfg), cfg.task
    model_vocab = hf_vocab_size(cfg)
    fix = f"preprocess with --tokenizer {path}"
    if t._name == "dummy_lm":
        if t.dict_size > model_vocab:
            raise UsageError(f"--dict-size {t.dict_size} exceeds {path}'s vocabulary of {model_vocab}; lower it")
        return model_vocab
    if not vocabulary_data(t):
        raise UsageError(
            f"the embedded corpus (no DATA) was made by sentencepiece; the model's vocabulary is "
            f"{path}'s ({model_vocab}): {fix} and pass that DATA"
        )
    data = data_dirs(vocabulary_data(t))[0]
    ours = tokenizer_identity(data)
    if ours["kind"] != "hf":
        made_by = "sentencepiece" if ours["kind"] == "sentencepiece" else "a fairseq dict.txt"
        raise UsageError(
            f"DATA {data} was made by {made_by} (vocabulary {data_vocab}); the model's vocabulary is "
            f"{model_vocab}: {fix}"
        )
    if has_tokenizer(path):
        theirs = tokenizer_identity(path)
        if theirs["kind"] == "hf" and theirs["sha256"] != ours["sha256"]:
            raise UsageError(
                f"DATA {data} was made by another tokenizer than {path}'s (tokenizer.json sha256 "
                f"{ours['sha256'][:12]}…, {path}'s {theirs['sha256'][:12]}…): {fix}"
            )
    if data_vocab > model_vocab:
        raise UsageError(
            f"DATA {data} has a vocabulary of {data_vocab}, more than the model's {model_vocab} "
            f"({path}/config.json's vocab_size): {fix}"
        )
    return model_vocab


def _check_fairseq_dictionary(cfg, data_vocab):
    """A fairseq checkpoint's embedding rows are its data-bin's dict.txt, in that order."""
    path = fairseq_source(cfg)
    if cfg.task._name != "language_modeling" or not vocabulary_data(cfg.task):
        raise UsageError(
            f"{path} is a fairseq model: its vocabulary is its data-bin's dict.txt; pass that data-bin as DATA"
        )
    check_fairseq_dictionary(path, data_dirs(vocabulary_data(cfg.task))[0], data_vocab)


def _check_compiler(cfg, environ):
    """--compile on a CPU builds inductor's C++ kernels with $CXX (default g++); without
    that compiler every rank would fail deep inside the first forward."""
    if not cfg.common.compile or runs_on_gpu(cfg):
        return
    cxx = environ.get("CXX") or "g++"
    if shutil.which(cxx, path=environ.get("PATH")) is None:
        raise UsageError(
            f"--compile on a CPU needs a C++ compiler and {cxx} is not on PATH; "
            "install g++ (or set CXX to one), or drop --compile"
        )


def _check_fits_host(cfg, vocab, world_size):
    """A CPU run whose fp32 weights and first activations alone exceed this host's memory
    would die allocating them; say so instead. A lower bound: no false refusals."""
    if cfg.distributed_training.auto_tune or runs_on_gpu(cfg):
        return  # the plan's domain: --auto-tune picks (or refuses) flags that fit, `plan` knows GPUs
    host_gb = host_memory_gb()
    if host_gb is None:
        return
    ranks = min(world_size, int(cfg.distributed_training.distributed_world_size) or 1) or 1
    copies = 1 if uses_fsdp(cfg) else ranks
    shape = model_shape(cfg, vocab)
    embedded_tokens = sequences_per_batch(cfg) * cfg.task.tokens_per_sample * shape.dim
    need_gb = (4 * shape.params * copies + 4 * embedded_tokens * ranks) / 2**30
    if need_gb > host_gb:
        raise UsageError(
            f"this run needs at least {need_gb:,.1f} GB for its fp32 weights and first activations "
            f"on this host ({ranks} rank(s)), which has {host_gb:.1f} GB; use a smaller model, "
            "--tokens-per-sample or batch, or more hosts (run `plan` to see what fits)"
        )


def _check_embedded_splits(ds):
    """Without DATA the embedded corpus is read; its splits are known before it is built."""
    named = [("--train-subset", ds.train_subset)]
    if not ds.disable_validation:
        named += [("--valid-subset", s) for s in ds.valid_subset.split(",") if s]
    for flag, split in named:
        if split not in SPLITS:
            raise DataError(
                f"no split {split!r} in the embedded corpus (it has {', '.join(SPLITS)}); check {flag}, or pass DATA"
            )


def _check_data(cfg, world_size):

    dataset_cfg = cfg.dataset
    if cfg.task.data_mixture:
        sources = [data for _, data in parse_mixture(cfg.task.data_mixture)]
        valid = [] if dataset_cfg.disable_validation else list(filter(None, dataset_cfg.valid_subset.split(",")))
        tokenizer = check_mixture(sources, valid, dataset_cfg.train_subset)
        for data in sources:
            for path in data_dirs(data):
                check_task_data(cfg.task._name, path)
        return tokenizer.vocab_size
    # Every directory of a sharded DATA trains; validation reads the first.
    tokenizer = check_data_dir(cfg.task.data, [], train_split=dataset_cfg.train_subset)
    dirs = data_dirs(cfg.task.data)
    data = dirs[0]
    for path in dirs:
        check_task_data(cfg.task._name, path)
    if not dataset_cfg.disable_validation:
        for subset in filter(None, dataset_cfg.valid_subset.split(",")):
            if exists(data / subset):
                check_token_ids(IndexedDataset(data / subset), tokenizer.vocab_size)
            elif subset != DEFAULT_VALID_SUBSET:  # the default may be absent: then nothing is validated
                raise DataError(
                    f"no split {subset!r} in {data} (expected {subset}.bin and {subset}.idx); "
                    "check --valid-subset, or pass --disable-validation"
                )
    for path in dirs:
        _check_batches_per_rank(cfg, path / dataset_cfg.train_subset, tokenizer, world_size)
    return tokenizer.vocab_size


def _check_batches_per_rank(cfg, prefix, tokenizer, world_size):
    """Every rank needs a batch of the epoch; the iterator's own count decides (epoch 1)."""
    if world_size < 2:
        return

    task_cfg, dataset_cfg = cfg.task, cfg.dataset
    tokens = IndexedDataset(prefix)
    # Blocks hold at most tokens_per_sample targets and a batch at most this many blocks:
    # when even that leaves a batch for every rank, skip the exact count (big corpora).
    most_per_batch = min(x for x in (dataset_cfg.batch_size, dataset_cfg.max_tokens) if x is not None)
    if tokens.num_tokens // task_cfg.tokens_per_sample >= most_per_batch * world_size:
        return
    if task_cfg._name in ("sft", "dpo"):
        blocks = task_samples(
            task_cfg._name, prefix, task_cfg.tokens_per_sample, task_cfg.sample_break_mode, tokenizer.pad
        )
    else:
        blocks = TokenBlockDataset(
            tokens, task_cfg.tokens_per_sample, task_cfg.sample_break_mode, pad=tokenizer.pad, eos=tokenizer.eos
        )
    batches = EpochBatchIterator(
        blocks,
        batch_size=dataset_cfg.batch_size,
        max_tokens=dataset_cfg.max_tokens,
        seed=cfg.common.seed,
        num_shards=world_size,
        shard_id=0,
        shuffle=True,
        pad=tokenizer.pad,
        required_batch_size_multiple=dataset_cfg.required_batch_size_multiple,
    )
    len(batches)  # raises DataError("only N batches for W ranks; …")


def _check_paths(cfg):
    checkpoint_cfg = cfg.checkpoint
    restore_choice(checkpoint_cfg)  # a --restore-file or --finetune-from-model it refuses, refused before torch loads
    if not checkpoint_cfg.no_save:
        save_dir = Path(checkpoint_cfg.save_dir)
        if save_dir.exists() and not save_dir.is_dir():
            raise UsageError(f"--save-dir {save_dir} is a file; choose a directory")
        _check_creatable(save_dir, "--save-dir")
    tensorboard = cfg.common.tensorboard_logdir
    if tensorboard:
        if Path(tensorboard).exists() and not Path(tensorboard).is_dir():
            raise UsageError(f"--tensorboard-logdir {tensorboard} is a file; choose a directory")
        _check_creatable(Path(tensorboard), "--tensorboard-logdir")
    if cfg.common.log_file:
        parent = Path(cfg.common.log_file).parent
        if not parent.is_dir():
            raise UsageError(
                f"--log-file {cfg.common.log_file}: directory {parent} does not exist; create it or choose another path"
            )


def _check_creatable(path, flag):
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError(f"{flag} {path} cannot be created: {blocker} is a file; choose another {flag}")
