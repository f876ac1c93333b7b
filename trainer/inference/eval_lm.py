"""eval-lm (fairseq-eval-lm): the base-2 loss and perplexity of a trained model on a split.

Blocks are cut exactly as training's validation cuts them (same --tokens-per-sample and
--sample-break-mode), so with --context-window 0 the result is training's valid loss.
--context-window K (fairseq's LMContextWindowDataset) shortens each block by K and
gives it the K tokens before it as unscored context: every token is predicted from at
least K tokens of history, at the cost of longer inputs.
"""
import logging
import math
import time

import numpy as np
import torch

from data.data_dir import check_token_ids
from data.embedded_corpus import prepare_embedded_corpus
from data.indexed_dataset import IndexedDataset, exists
from data.iterator import batch_by_size, collate_pairs
from data.token_block import TokenBlockDataset
from data.tokenizer import load_tokenizer
from trainer.errors import UsageError
from trainer.inference.load import load_model
from trainer.parallel.ranks import all_reduce_sum, init_rank, teardown

log = logging.getLogger("shardlm")


def windows(dataset, context_window, pad):
    """(input, target) per block in order; the first K targets of a block with context are pad."""
    history = np.zeros(0, dtype=np.int64)
    for i in range(len(dataset)):
        item = np.asarray(dataset[i], dtype=np.int64)
        src, tgt = item[:-1], item[1:]
        ctx = history[len(history) - context_window:] if context_window else history[:0]
        yield np.concatenate([ctx, src]), np.concatenate([np.full(len(ctx), pad), tgt])
        if context_window:
            history = np.concatenate([history, src])[-context_window:]


def evaluate(model, dataset, args, pad, env):
    """(summed loss in nats, scored tokens) over this rank's share of the split's blocks."""
    pairs = list(windows(dataset, args.context_window, pad))
    sizes = np.array([len(s) for s, _ in pairs])
    batches = batch_by_size(np.arange(len(pairs)), sizes, args.batch_size, args.max_tokens)
    loss_sum, ntokens = 0.0, 0
    with torch.no_grad():
        for batch in batches[env.rank::env.world_size]:
            src, tgt = collate_pairs([pairs[i] for i in batch], pad)
            # The model's own loss (pad targets, the context's among them, are not scored),
            # a chunk of logits at a time as in training.
            loss_sum += model(src.to(env.device), target=tgt.to(env.device)).item()
            ntokens += int((tgt != pad).sum())
    return loss_sum, ntokens


def eval_lm(args, env):
    """Load, evaluate, print fairseq's two lines (rank 0). Returns the base-2 loss."""
    model, cfg, _ = load_model(args.path, env.device)
    tokens_per_sample = args.tokens_per_sample or cfg.task.tokens_per_sample
    if args.context_window >= tokens_per_sample:
        raise UsageError(f"--context-window {args.context_window} must be smaller than --tokens-per-sample "
                         f"{tokens_per_sample}")
    if tokens_per_sample > model.max_positions:
        raise UsageError(f"--tokens-per-sample {tokens_per_sample} exceeds the model's {model.max_positions} "
                         "positions; pass a smaller one")
    if args.batch_size is None and args.max_tokens is None:
        args.max_tokens = 36000  # fairseq-eval-lm's default
    if args.max_tokens is not None and args.max_tokens < tokens_per_sample:
        raise UsageError(f"--max-tokens {args.max_tokens} is smaller than one block (--tokens-per-sample "
                         f"{tokens_per_sample}); raise it or lower --tokens-per-sample")
    dataset, pad = split_dataset(cfg, args, tokens_per_sample - args.context_window, model.vocab_size)
    start = time.perf_counter()
    loss_sum, ntokens = evaluate(model, dataset, args, pad, env)
    loss_sum, ntokens = all_reduce_sum([loss_sum, ntokens], env)
    elapsed = max(time.perf_counter() - start, 1e-9)
    loss = loss_sum / max(ntokens, 1) / math.log(2)
    if env.is_master:
        print(f"Evaluated {int(ntokens):,} tokens in {elapsed:.1f}s ({ntokens / elapsed:.2f} tokens/s)")
        print(f"Loss (base 2): {loss:.4f}, Perplexity: {2 ** loss:.2f}")
    return loss


def split_dataset(cfg, args, tokens_per_sample, vocab_size):
    """The split's token blocks as training cut them; the data's tokenizer must be the model's."""
    from pathlib import Path


    if args.data:
        data_dir = Path(args.data)
    else:
        data_dir = prepare_embedded_corpus()
    if not exists(data_dir / args.gen_subset):
        raise UsageError(f"no split {args.gen_subset!r} in {data_dir} (expected {args.gen_subset}.bin/.idx); "
                         "pick one with --gen-subset")
    tok = load_tokenizer(data_dir)
    if tok.vocab_size != vocab_size:
        raise UsageError(f"{data_dir} has a vocabulary of {tok.vocab_size}, the model {vocab_size}: "
                         "evaluate on data made with the model's tokenizer")
    tokens = IndexedDataset(str(data_dir / args.gen_subset))
    check_token_ids(tokens, vocab_size)
    break_mode = args.sample_break_mode or cfg.task.sample_break_mode
    return TokenBlockDataset(tokens, tokens_per_sample, break_mode, pad=tok.pad, eos=tok.eos), tok.pad


def run(args, cfg, rdv):
    """One rank of eval-lm (launched like train: spawned, torchrun or SLURM)."""
    env = init_rank(cfg, rdv, needs_process_group=False)
    try:
        eval_lm(args, env)
    finally:
        teardown()
    return 0
