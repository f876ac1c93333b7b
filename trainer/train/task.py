"""The language_modeling and dummy_lm tasks: vocabulary and batch iterators per split.

`train DATA` reads a directory written by `preprocess` or by fairseq-preprocess (both
in fairseq's MMIDIDX format); without DATA it prepares the embedded corpus once.
"""
import json
import logging
from pathlib import Path

from data.dummy_lm import DummyLMDataset
from data.embedded_corpus import prepare_embedded_corpus
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, exists
from data.iterator import EpochBatchIterator
from data.token_block import TokenBlockDataset
from data.tokenizer import load_tokenizer

log = logging.getLogger("shardlm")


def embedded_loss_floor(data_dir):
    """Base-2 loss per valid token of the process that generated the embedded corpus."""
    meta = json.loads((Path(data_dir) / "metadata.json").read_text())
    floor = meta.get("embedded")
    if not floor:
        return None
    return floor["valid_bits_per_char"] * floor["valid_chars"] / meta["splits"]["valid"]["tokens"]


class LMTask:
    def __init__(self, cfg, env):
        self.cfg, self.env = cfg, env
        t = cfg.task
        self.pad = 1
        self.valid_loss_floor = None
        if t._name == "dummy_lm":
            self.data_dir, self.tokenizer, self.vocab_size = None, None, t.dict_size
            return
        if t.data:
            self.data_dir = Path(t.data)
            if not self.data_dir.is_dir():
                raise DataError(f"data directory {t.data} does not exist; pass a directory written by "
                                "`preprocess` (or leave DATA out to use the embedded corpus)")
        else:
            self.data_dir = prepare_embedded_corpus()
            log.info(f"no DATA given: training on the embedded corpus in {self.data_dir}")
        self.tokenizer = load_tokenizer(self.data_dir)
        self.vocab_size = self.tokenizer.vocab_size
        self.pad = self.tokenizer.pad
        self.valid_loss_floor = None if t.data else embedded_loss_floor(self.data_dir)
        if self.valid_loss_floor is not None:
            log.info(f"embedded corpus: the true model's valid loss is {self.valid_loss_floor:.3f} "
                     f"(ppl {2 ** self.valid_loss_floor:.2f}); no model can do better")

    def dataset(self, split):
        t = self.cfg.task
        if t._name == "dummy_lm":
            return DummyLMDataset(t.dict_size, t.tokens_per_sample, t.dataset_size, seed=self.cfg.common.seed)
        prefix = self.data_dir / split
        if not self.has_split(split):
            raise DataError(f"no split {split!r} in {self.data_dir} (expected {split}.bin and {split}.idx); "
                            "check --train-subset/--valid-subset or re-run preprocess")
        return TokenBlockDataset(IndexedDataset(str(prefix)), t.tokens_per_sample, t.sample_break_mode,
                                 pad=self.pad, eos=self.tokenizer.eos)

    def has_split(self, split):
        if self.cfg.task._name == "dummy_lm":
            return split == self.cfg.dataset.train_subset  # random tokens: nothing to validate on
        return exists(self.data_dir / split)

    def batch_iterator(self, split, training):
        d = self.cfg.dataset
        batch_size, max_tokens = d.batch_size, d.max_tokens
        if not training:
            batch_size = d.batch_size_valid or batch_size
            max_tokens = d.max_tokens_valid or max_tokens
        return EpochBatchIterator(self.dataset(split), batch_size=batch_size, max_tokens=max_tokens,
                                  seed=self.cfg.common.seed, num_shards=self.env.world_size,
                                  shard_id=self.env.rank, shuffle=training, pad=self.pad,
                                  every_batch=not training)
