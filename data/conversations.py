"""Samples of --task sft and --task dpo: conversations and preference pairs, with their targets.

`preprocess --tokenizer HF_DIR` writes each conversation (or each side of a preference pair)
as one sequence of the chat template's tokens, and beside it a sequence of 0/1 flags of the
same length, 1 on the tokens the model is trained to produce (an assistant turn's content
and its end-of-turn token; a pair's completion). A sequence is scored as Hugging Face
scores it: ``input = tokens[:-1]``, ``target = tokens[1:]``, a target that is not flagged
is ``pad`` (ignored by the loss). Its first token (the template's <s>) is never a target
and nothing precedes it: no ``</s>`` context as in language_modeling's blocks.

* `ConversationSamples` (sft): ``--sample-break-mode complete`` packs consecutive
  conversations greedily into samples of at most ``--tokens-per-sample`` input positions
  (a conversation of n tokens takes n - 1); ``eos`` makes one sample per conversation.
  The collated batch carries ``segments``, each position's conversation, so that the model
  confines attention to it and counts its positions from 0: a packed sample and the same
  conversations padded one per row give the same loss and gradients.
* `PreferencePairs` (dpo): item i is the pair (sequence 2i, sequence 2i + 1), prompt +
  chosen and prompt + rejected; a batch of B pairs is 2B right-padded rows, the chosen
  ones first. Its ``sample_size`` is B: the DPO loss is averaged over pairs.

A conversation or pair longer than a sample fits nowhere: as language_modeling's blocks
do (fairseq's rule), it is left out and listed in ``too_long`` for the task to warn (in
training) or refuse (in validation, without --skip-invalid-size-inputs-valid-test).
"""

from __future__ import annotations

import numpy as np

from data.errors import DataError, checked_index
from data.indexed_dataset import IndexedDataset
from data.iterator import collate_pairs
from data.targets import data_kind, load_targets

SFT_BREAK_MODES = ("complete", "eos")
# What each task reads, by metadata.json's "kind" (absent: text)
TASK_DATA = {"sft": "conversations", "dpo": "preference_pairs"}
_WRITTEN_FROM = {
    "text": "text",
    "conversations": "conversations (rows with messages)",
    "preference_pairs": "preference pairs (rows with prompt, chosen and rejected)",
}


def check_task_data(task: str, data_dir) -> None:
    """--task sft reads conversations, --task dpo preference pairs: refuse the other kinds."""
    want, have = TASK_DATA.get(task), data_kind(data_dir)
    if want is not None and have != want:
        raise DataError(
            f"--task {task} trains on {_WRITTEN_FROM[want]}, and {data_dir} holds {_WRITTEN_FROM[have]}: "
            f"pass a data dir that `preprocess --tokenizer HF_DIR` wrote from {_WRITTEN_FROM[want]}"
            + (
                ""
                if have == "text"
                else f", or train this one with --task {next(k for k, v in TASK_DATA.items() if v == have)}"
            )
        )


def task_samples(task: str, prefix, tokens_per_sample: int, break_mode: str, pad: int):
    """The samples of --task sft or dpo in the token file ``prefix``."""
    tokens, targets = IndexedDataset(prefix), load_targets(prefix)
    if task == "dpo":
        return PreferencePairs(tokens, targets, tokens_per_sample, pad)
    return ConversationSamples(tokens, targets, tokens_per_sample, break_mode, pad)


def _sequence(tokens, targets, i, pad):
    """(input, target) of sequence i: target is pad where the token is not a target."""
    seq, flags = tokens[i].astype(np.int64), targets[i]
    return seq[:-1], np.where(flags[1:] != 0, seq[1:], pad)


class ConversationSamples:
    """Conversations packed (``complete``) or one per sample (``eos``), for --task sft."""

    def __init__(self, tokens: IndexedDataset, targets: IndexedDataset, tokens_per_sample: int, break_mode: str, pad):
        if break_mode not in SFT_BREAK_MODES:
            raise DataError(
                f"--task sft keeps conversations whole: --sample-break-mode {break_mode} cuts or joins them "
                "otherwise; use complete (packed, the default) or eos (one per row)"
            )
        self.tokens, self.targets, self.pad = tokens, targets, pad
        inputs = np.asarray(tokens.sizes, dtype=np.int64) - 1  # positions a conversation takes
        fits = inputs <= tokens_per_sample
        self.too_long = np.flatnonzero(~fits)
        kept = np.flatnonzero(fits & (inputs > 0))
        if break_mode == "eos":
            firsts = kept
        else:  # greedy, in file order: a sample ends before the conversation that would overflow it
            firsts, used = [], tokens_per_sample
            for i, n in zip(kept.tolist(), inputs[kept].tolist()):
                if used + n > tokens_per_sample:
                    firsts.append(i)
                    used = 0
                used += n
            firsts = np.asarray(firsts, dtype=np.int64)
        # sample k holds kept[bounds[k]:bounds[k + 1]]
        self._kept = kept
        self._bounds = np.append(np.searchsorted(kept, firsts), len(kept))
        per_sample = np.add.reduceat(inputs[kept], self._bounds[:-1]) if len(kept) else np.zeros(0, np.int64)
        self.sizes = (per_sample + 1).astype(np.int64)  # + 1: the iterator counts len(item) - 1 positions

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, k: int):
        k = checked_index(k, len(self.sizes), "sample")
        members = self._kept[self._bounds[k] : self._bounds[k + 1]]
        return [_sequence(self.tokens, self.targets, int(i), self.pad) for i in members]

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum() - len(self.sizes))

    def length_of(self, conversation: int) -> int:
        return int(self.tokens.sizes[conversation])


class PreferencePairs:
    """Pairs (prompt + chosen, prompt + rejected), for --task dpo."""

    def __init__(self, tokens: IndexedDataset, targets: IndexedDataset, tokens_per_sample: int, pad):
        if len(tokens) % 2:
            raise DataError(
                f"{tokens.prefix} holds {len(tokens)} sequences, not pairs: it was not written from preference "
                "pairs; re-run preprocess on rows with prompt, chosen and rejected"
            )
        self.tokens, self.targets, self.pad = tokens, targets, pad
        inputs = np.asarray(tokens.sizes, dtype=np.int64).reshape(-1, 2).max(axis=1) - 1
        fits = inputs <= tokens_per_sample
        self.too_long = np.flatnonzero(~fits)
        self._kept = np.flatnonzero(fits)
        self.sizes = (inputs[self._kept] + 1).astype(np.int64)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, k: int):
        i = int(self._kept[checked_index(k, len(self.sizes), "pair")])
        return [_sequence(self.tokens, self.targets, 2 * i + side, self.pad) for side in (0, 1)]

    @property
    def num_tokens(self) -> int:
        return int(2 * (self.sizes.sum() - len(self.sizes)))

    def length_of(self, pair: int) -> int:
        return int(self.tokens.sizes[2 * pair : 2 * pair + 2].max())


def collate_conversations(samples, pad: int, width: int | None = None) -> dict:
    """Samples of (input, target) sequences, one row each, right-padded. ``segments``
    numbers each row's sequences from 0; padding continues the last one (it follows every
    real position, so a causal mask keeps the real positions off it)."""
    import torch

    rows = [(np.concatenate([s for s, _ in seqs]), np.concatenate([t for _, t in seqs])) for seqs in samples]
    out = collate_pairs(rows, pad, width=width)
    segments = np.zeros(tuple(out["src_tokens"].shape), dtype=np.int64)
    for r, seqs in enumerate(samples):
        lengths = [len(x) for x, _ in seqs]
        segments[r, : sum(lengths)] = np.repeat(np.arange(len(seqs)), lengths)
        segments[r, sum(lengths) :] = max(len(seqs) - 1, 0)
    out["segments"] = torch.from_numpy(segments)
    out["nsentences"] = sum(len(seqs) for seqs in samples)
    return out


def collate_preference_pairs(pairs, pad: int) -> dict:
    """B pairs as 2B rows (the chosen sequences, then the rejected), right-padded; the loss
    is averaged over pairs (``sample_size``), the throughput counted in target tokens."""
    out = collate_pairs([pair[0] for pair in pairs] + [pair[1] for pair in pairs], pad)
    out["nsentences"] = out["sample_size"] = len(pairs)
    return out
