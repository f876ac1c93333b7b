"""The language_modeling and dummy_lm tasks: vocabulary, datasets and batch iterators per split.

`train DATA` reads a directory written by `preprocess` or by fairseq-preprocess (both
in fairseq's MMIDIDX format), or several joined by os.pathsep (fairseq's sharded data:
epoch e trains on the ((e - 1) mod n)-th; the vocabulary and validation come from the
first); without DATA it prepares the embedded corpus once. As in fairseq, the training
split is read with its pieces (train, train1, train2, … of that directory), and a
validation split with them only under --combine-valid-subsets.
"""

import functools
import json
import logging
import re
import zlib
from pathlib import Path

import numpy as np

from data.conversations import check_task_data, collate_conversations, collate_preference_pairs, task_samples
from data.data_dir import data_dirs
from data.dummy_lm import DummyLMDataset
from data.embedded_corpus import prepare_embedded_corpus
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, exists
from data.iterator import EpochBatchIterator, collate
from data.mixture import Mixture, mixture_weights, parse_mixture, source_names
from data.mixture_batches import MixtureBatchIterator
from data.token_block import ConcatDataset, DocumentBlocks, TokenBlockDataset, collate_documents
from data.tokenizer import SPECIAL_IDS, load_tokenizer
from trainer.config.model_source import hf_vocab_size
from trainer.config.schema import vocabulary_data
from trainer.train.preemption import leave_stop_signals_to_the_rank

log = logging.getLogger("shardlm")


def embedded_loss_floor(data_dir):
    """Base-2 loss per valid token of the process that generated the embedded corpus."""
    meta = json.loads((Path(data_dir) / "metadata.json").read_text())
    floor = meta.get("embedded")
    if not floor:
        return None
    return floor["valid_bits_per_char"] * floor["valid_chars"] / meta["splits"]["valid"]["tokens"]


def valid_subsets(cfg):
    return [s for s in cfg.dataset.valid_subset.split(",") if s]


class LMTask:
    def __init__(self, cfg, env):
        self.cfg, self.env = cfg, env
        task_cfg = cfg.task
        self.pad, self.bos = SPECIAL_IDS["pad"], SPECIAL_IDS["bos"]
        self.valid_loss_floor = None
        self._datasets = {}  # (split, data dir) -> dataset; of the training split, the current shard's only
        self.sources = []  # --data-mixture's (name, weight, data dirs)
        self._mixture = None
        if task_cfg._name == "dummy_lm":
            self.data_dirs, self.data_dir, self.tokenizer, self.vocab_size = [], None, None, task_cfg.dict_size
        else:
            if task_cfg.data_mixture:
                pairs = parse_mixture(task_cfg.data_mixture)
                names = source_names([data for _, data in pairs])
                self.sources = [(name, weight, data_dirs(data)) for name, (weight, data) in zip(names, pairs)]
                self.data_dirs = self.sources[0][2]
            elif task_cfg.data:
                self.data_dirs = data_dirs(task_cfg.data)
            else:
                self.data_dirs = [prepare_embedded_corpus()]
                log.info(f"no DATA given: training on the embedded corpus in {self.data_dirs[0]}")
            self.data_dir = self.data_dirs[0]  # the vocabulary's, and validation's without a mixture
            for data_dir in self.data_dirs + [d for _, _, dirs in self.sources for d in dirs]:
                check_task_data(task_cfg._name, data_dir)
            self.tokenizer = load_tokenizer(self.data_dir)
            self.vocab_size = self.tokenizer.vocab_size
            self.pad, self.bos = self.tokenizer.pad, self.tokenizer.bos
            self.valid_loss_floor = None if vocabulary_data(task_cfg) else embedded_loss_floor(self.data_dir)
            if self.valid_loss_floor is not None:
                log.info(
                    f"embedded corpus: the true model's valid loss is {self.valid_loss_floor:.3f} "
                    f"(ppl {2**self.valid_loss_floor:.2f}); no model can do better"
                )
            if len(self.data_dirs) > 1 and not self.sources:
                log.info(
                    f"sharded data: epoch e trains on the ((e - 1) mod {len(self.data_dirs)})-th of "
                    f"{', '.join(map(str, self.data_dirs))}; validation reads {self.data_dir}"
                )
            self._warn_unused_valid_subsets()
        # The model's rows: the data's vocabulary, or a Hugging Face model's own (Qwen3 pads its
        # embedding past its tokenizer's ids; preflight saw that the data fits in it).
        self.model_vocab_size = hf_vocab_size(cfg) or self.vocab_size
        # Validation splits load now, as fairseq loads them before training: a bad one stops
        # the run before its first update, not at its first validation.
        if not cfg.dataset.disable_validation:
            for split in valid_subsets(cfg):
                self.valid_sets(split)

    def has_split(self, split):
        if self.cfg.task._name == "dummy_lm":
            return True  # fairseq's dummy_lm: any split name gives random data
        if self.sources:
            return any(exists(dirs[0] / split) for _, _, dirs in self.sources)
        return exists(self.data_dir / split)

    def valid_sets(self, split):
        """[(name, blocks)] to validate ``split`` on: each mixture source that has it (by its
        name), or DATA's (named None)."""
        if not self.sources:
            return [(None, self.dataset(split))] if self.has_split(split) else []
        return [
            (name, self.dataset(split, data_dir=dirs[0])) for name, _, dirs in self.sources if exists(dirs[0] / split)
        ]

    def dataset(self, split, epoch=1, data_dir=None):
        """The split's blocks; the training split's from the data dir of ``epoch``."""
        training = split == self.cfg.dataset.train_subset
        if data_dir is None:
            data_dir = (
                self.data_dirs[(epoch - 1) % len(self.data_dirs)] if training and self.data_dirs else self.data_dir
            )
        key = (split, data_dir)
        if key not in self._datasets:
            if training and not self.sources:  # one shard's blocks in memory at a time
                self._datasets = {k: v for k, v in self._datasets.items() if k[0] != split}
            self._datasets[key] = self._load(split, data_dir, training)
        return self._datasets[key]

    def mixture(self):
        """--data-mixture's training stream (data/mixture.py): each source's training blocks
        (all its directories' one after another), weighted."""
        if self._mixture is None:
            split = self.cfg.dataset.train_subset
            blocks = []
            for _, _, dirs in self.sources:
                parts = [self.dataset(split, data_dir=d) for d in dirs]
                blocks.append(parts[0] if len(parts) == 1 else ConcatDataset(parts))
            names = [name for name, _, _ in self.sources]
            self._mixture = Mixture(names, blocks, self.mixture_weights(blocks), self.cfg.common.seed)
        return self._mixture

    def mixture_weights(self, blocks=None):
        """The sources' shares, normalised (with --data-mixture-temperature, from their tokens)."""
        blocks = blocks or self.mixture().datasets
        tokens = [int(np.sum(b.sizes, dtype=np.int64)) - len(b) for b in blocks]
        weights = mixture_weights([w for _, w, _ in self.sources], tokens, self.cfg.task.data_mixture_temperature)
        if self.env.is_master and self._mixture is None:
            shares = ", ".join(f"{name} {w:.4f}" for (name, _, _), w in zip(self.sources, weights))
            log.info(f"data mixture: {shares} of the blocks drawn")
        return weights

    def _load(self, split, data_dir, training):
        task_cfg, dataset_cfg = self.cfg.task, self.cfg.dataset
        if task_cfg._name == "dummy_lm":
            stream = 0 if training else zlib.crc32(split.encode()) or 1
            return DummyLMDataset(
                task_cfg.dict_size,
                task_cfg.tokens_per_sample,
                task_cfg.dataset_size,
                seed=self.cfg.common.seed,
                stream=stream,
            )
        if not exists(data_dir / split):
            raise DataError(
                f"no split {split!r} in {data_dir} (expected {split}.bin and {split}.idx); "
                "check --train-subset/--valid-subset or re-run preprocess"
            )
        names = [split]
        if training or dataset_cfg.combine_valid_subsets:  # fairseq's load_indexed_dataset(combine=True)
            while exists(data_dir / f"{split}{len(names)}"):
                names.append(f"{split}{len(names)}")
            if len(names) > 1:
                log.info(f"{split}: {', '.join(names)} of {data_dir} read as one split")
        parts = [self._blocks(data_dir / name, training) for name in names]
        return parts[0] if len(parts) == 1 else ConcatDataset(parts)

    def _blocks(self, prefix, training):
        """fairseq drops samples longer than the model's positions from training with a
        warning, and refuses them in validation unless told to skip them."""
        task_cfg = self.cfg.task
        if task_cfg._name in ("sft", "dpo"):
            blocks = task_samples(
                task_cfg._name, prefix, task_cfg.tokens_per_sample, task_cfg.sample_break_mode, self.pad
            )
            what = "conversations" if task_cfg._name == "sft" else "pairs"
        else:
            blocks = TokenBlockDataset(
                IndexedDataset(str(prefix)),
                task_cfg.tokens_per_sample,
                task_cfg.sample_break_mode,
                pad=self.pad,
                eos=self.tokenizer.eos,
            )
            what = "sentences"
            if task_cfg.per_document_attention:
                blocks = DocumentBlocks(blocks)
        if len(blocks.too_long):
            first = int(blocks.too_long[0])
            size = f"{blocks.length_of(first)} tokens, more than --tokens-per-sample {task_cfg.tokens_per_sample}"
            if not training and not self.cfg.dataset.skip_invalid_size_inputs_valid_test:
                raise DataError(
                    f"{what[:-1]} #{first} of {prefix} has an invalid size ({size}; --sample-break-mode "
                    f"{task_cfg.sample_break_mode} cuts none): skip such {what} with "
                    "--skip-invalid-size-inputs-valid-test, or raise --tokens-per-sample"
                )
            if self.env.is_master:
                log.warning(
                    f"{len(blocks.too_long):,} {what} of {prefix} are longer than a sample and are "
                    f"skipped (the first: #{first}, {size})"
                )
        return blocks

    def _warn_unused_valid_subsets(self):
        """fairseq refuses to start when DATA has valid1, valid2, … that nothing validates on."""
        dataset_cfg = self.cfg.dataset
        if dataset_cfg.disable_validation or dataset_cfg.combine_valid_subsets or not self.env.is_master:
            return
        unused = sorted(
            {
                p.stem
                for p in self.data_dir.glob("valid*.idx")
                if re.fullmatch(r"valid\d+", p.stem) and exists(p.with_suffix(""))
            }
            - set(valid_subsets(self.cfg))
        )
        if unused:
            log.warning(
                f"{', '.join(unused)} in {self.data_dir} are not validated on: --combine-valid-subsets "
                "adds them to valid, or name them in --valid-subset"
            )

    def batch_iterator(self, split, training, dataset=None):
        """Batches of ``split`` (of ``dataset``, one of valid_sets', where given)."""
        dataset_cfg, task_cfg = self.cfg.dataset, self.cfg.task
        batch_size, max_tokens = dataset_cfg.batch_size, dataset_cfg.max_tokens
        if not training:
            batch_size = dataset_cfg.batch_size_valid or batch_size
            max_tokens = dataset_cfg.max_tokens_valid or max_tokens
        bos = self.bos if task_cfg.add_bos_token else None
        width = task_cfg.tokens_per_sample + (bos is not None) if task_cfg.pad_to_fixed_length else None
        if training and self.sources:
            return MixtureBatchIterator(
                self.mixture(),
                self.mixture_batch_size(),
                num_shards=self.env.data_size,
                shard_id=self.env.data_rank,
                collater=self.collater(bos, width),
                num_workers=dataset_cfg.num_workers,
                worker_init=leave_stop_signals_to_the_rank,
                pin_memory=self.env.device.type == "cuda",
            )
        # Training takes each epoch's dataset as the epoch starts (sharded data).
        if dataset is None:
            dataset = functools.partial(self.dataset, split) if training else self.dataset(split)
        return EpochBatchIterator(
            dataset,
            batch_size=batch_size,
            max_tokens=max_tokens,
            seed=self.cfg.common.seed,
            num_shards=self.env.data_size,
            shard_id=self.env.data_rank,
            shuffle=training,
            pad=self.pad,
            every_batch=not training,
            required_batch_size_multiple=dataset_cfg.required_batch_size_multiple,
            num_workers=dataset_cfg.num_workers,
            worker_init=leave_stop_signals_to_the_rank,
            collater=self.collater(bos, width),
            # A GPU rank copies its batches with non_blocking=True: asynchronous from pinned memory only.
            pin_memory=self.env.device.type == "cuda",
        )

    def mixture_batch_size(self):
        """A mixture's batches hold a fixed number of blocks (its position is then a slot on
        any layout): --batch-size, at most as many blocks of --tokens-per-sample as
        --max-tokens holds, cut to a multiple of --required-batch-size-multiple as fairseq cuts."""
        dataset_cfg, tokens = self.cfg.dataset, self.cfg.task.tokens_per_sample
        sizes = [x for x in (dataset_cfg.batch_size, dataset_cfg.max_tokens and dataset_cfg.max_tokens // tokens) if x]
        size, multiple = min(sizes), dataset_cfg.required_batch_size_multiple
        if size < 1:
            raise DataError(
                f"--max-tokens {dataset_cfg.max_tokens} holds no block of --tokens-per-sample {tokens}; raise it"
            )
        return size // multiple * multiple if size >= multiple else size

    def collater(self, bos, width):
        name = self.cfg.task._name
        if name == "sft":
            return functools.partial(collate_conversations, pad=self.pad, width=width)
        if name == "dpo":
            return functools.partial(collate_preference_pairs, pad=self.pad)
        if self.cfg.task.per_document_attention:
            return functools.partial(collate_documents, pad=self.pad, width=width)
        return functools.partial(collate, pad=self.pad, bos=bos, width=width)
