"""eval-lm (fairseq-eval-lm): the base-2 loss and perplexity of a trained model on a split.

Blocks are cut exactly as training's validation cuts them (same --tokens-per-sample and
--sample-break-mode) and start with <s> when the run trained with --add-bos-token (its
config.yaml says), so with --context-window 0 the result is training's valid loss.
A Hugging Face model directory (--path HF_DIR) scores the same blocks as
transformers would (default --tokens-per-sample: 1024, at most its max_position_embeddings);
its data must be made with its own tokenizer (preprocess --tokenizer HF_DIR).
Conversations (an sft data dir) are scored one per row on their target tokens only, the
assistant's, as --task sft's validation scores them.
--context-window K (fairseq's LMContextWindowDataset) shortens each block by K and
gives it the K tokens before it as unscored context: every token is predicted from at
least K tokens of history, at the cost of longer inputs.
"""

import functools
import logging
import math
import sys
import time

import torch

from data.context_window import ContextWindowDataset
from data.conversations import ConversationSamples, collate_conversations
from data.data_dir import check_token_ids, data_dirs
from data.embedded_corpus import prepare_embedded_corpus
from data.indexed_dataset import IndexedDataset, exists
from data.iterator import EpochBatchIterator, collate_pairs
from data.targets import data_kind, load_targets
from data.token_block import DocumentBlocks, TokenBlockDataset, collate_documents
from data.tokenizer import load_tokenizer
from trainer.errors import UsageError
from trainer.formats.fairseq.checkpoint_file import check_fairseq_dictionary, is_fairseq_checkpoint
from trainer.inference.load import load_model
from trainer.parallel.ranks import data_sum, init_rank, teardown

log = logging.getLogger("shardlm")


def evaluate(model, dataset, args, pad, bos, env):
    """(summed loss in nats, scored tokens) over this rank's share of the split's blocks."""
    if len(dataset) == 0:
        return 0.0, 0
    # Summed on the device and read once at the end: an `.item()` per batch would make the host
    # wait for the GPU every batch. float64, as the Python floats it replaces: the same sum.
    loss_sum, ntokens = torch.zeros((), dtype=torch.float64, device=env.device), 0
    itr = eval_batches(dataset, args, pad, bos, env)
    total = len(itr)
    # fairseq-eval-lm's progress bar, on rank 0 when stderr is a terminal (--no-progress-bar: none).
    show_progress = env.is_master and not getattr(args, "no_progress_bar", False) and sys.stderr.isatty()
    with torch.no_grad():
        for i, batch in enumerate(itr.next_epoch_itr(), 1):
            if show_progress:
                print(f"\reval-lm: batch {i}/{total}", end="" if i < total else "\n", file=sys.stderr, flush=True)
            if batch.get("dummy"):  # no collectives here: a rank with fewer batches just stops
                continue
            # The model's own loss (pad targets, the context's and <s>'s among them, are not
            # scored), a chunk of logits at a time as in training.
            segments = batch.get("segments") if isinstance(dataset, DocumentBlocks) else None
            loss_sum += model(
                batch["src_tokens"].to(env.device, non_blocking=True),
                target=batch["target"].to(env.device, non_blocking=True),
                softmax_batch=getattr(args, "softmax_batch", None),
                segments=None if segments is None else segments.to(env.device, non_blocking=True),
            ).double()
            ntokens += batch["ntokens"]
    return loss_sum.item(), ntokens


def eval_batches(dataset, args, pad, bos, env):
    """This rank's share of the split's batches, read through training's batch iterator by
    --num-workers processes, into pinned memory on a GPU rank (as training's)."""
    whole = isinstance(dataset, (ConversationSamples, DocumentBlocks))  # no context window: sequences kept apart
    return EpochBatchIterator(
        dataset if whole else ContextWindowDataset(dataset, args.context_window, pad),
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        seed=1,
        num_shards=env.data_size,  # a tensor-parallel group scores the same blocks
        shard_id=env.data_rank,
        shuffle=False,
        # fairseq-eval-lm's order: blocks by size (seed 1), or in order with a context window
        sort_by_size=args.context_window == 0,
        pad=pad,
        every_batch=True,
        num_workers=getattr(args, "num_workers", 1),
        collater=functools.partial(collate_conversations, pad=pad)
        if isinstance(dataset, ConversationSamples)
        else functools.partial(collate_documents, pad=pad)
        if isinstance(dataset, DocumentBlocks)
        else functools.partial(collate_pairs, pad=pad, bos=bos),
        # Copied with non_blocking=True: asynchronous from pinned memory only.
        pin_memory=env.device.type == "cuda",
    )


def eval_lm(args, env):
    """Load, evaluate, print fairseq's two lines (rank 0). Returns the base-2 loss."""
    data_dir = data_dirs(args.data)[0] if args.data else prepare_embedded_corpus()
    tok = load_tokenizer(data_dir)
    # The loss skips the targets the batches are padded with: the data's pad id (a Hugging
    # Face model has none of its own; config.json's pad_token_id is often its eos).
    model, cfg, model_tok = load_model(
        args.path, env.device, getattr(args, "model_overrides", None), pad=tok.pad, ema=args.ema, env=env
    )
    tokens_per_sample = args.tokens_per_sample or cfg.task.tokens_per_sample
    if args.context_window >= tokens_per_sample:
        raise UsageError(
            f"--context-window {args.context_window} must be smaller than --tokens-per-sample {tokens_per_sample}"
        )
    # A model trained with --add-bos-token reads <s> first (its saved config says so).
    add_bos = bool(cfg.task.get("add_bos_token", False))
    if tokens_per_sample + add_bos > model.max_positions:
        raise UsageError(
            f"--tokens-per-sample {tokens_per_sample}{' (+1 for <s>)' if add_bos else ''} exceeds the "
            f"model's {model.max_positions} positions; pass a smaller one"
        )
    if args.batch_size is None and args.max_tokens is None:
        args.max_tokens = 36000  # fairseq-eval-lm's default
    if args.max_tokens is not None and args.max_tokens < tokens_per_sample:
        raise UsageError(
            f"--max-tokens {args.max_tokens} is smaller than one block (--tokens-per-sample "
            f"{tokens_per_sample}); raise it or lower --tokens-per-sample"
        )
    if is_fairseq_checkpoint(args.path):
        check_fairseq_dictionary(args.path, data_dir, tok.vocab_size)
    check_same_tokenizer(data_dir, tok, model_tok, model.vocab_size)
    dataset = split_dataset(cfg, args, tokens_per_sample - args.context_window, data_dir, tok)
    start = time.perf_counter()
    loss_sum, ntokens = evaluate(model, dataset, args, tok.pad, tok.bos if add_bos else None, env)
    loss_sum, ntokens = data_sum([loss_sum, ntokens], env)
    elapsed = max(time.perf_counter() - start, 1e-9)
    loss = loss_sum / max(ntokens, 1) / math.log(2)
    if env.is_master:
        print(f"Evaluated {int(ntokens):,} tokens in {elapsed:.1f}s ({ntokens / elapsed:.2f} tokens/s)")
        print(f"Loss (base 2): {loss:.4f}, Perplexity: {2**loss:.2f}")
    return loss


def check_same_tokenizer(data_dir, tok, model_tok, vocab_size):
    """The data's tokenizer must be the model's: the same pieces when the model has its own
    (a checkpoint's copy, an HF dir's tokenizer.json), else ids within its embedding."""
    fix = "evaluate on data made with the model's tokenizer (preprocess --tokenizer for a Hugging Face model)"
    if model_tok is not None and model_tok.pieces() != tok.pieces():
        raise UsageError(
            f"{data_dir}'s tokenizer ({tok.vocab_size} tokens) is not the model's ({model_tok.vocab_size}): {fix}"
        )
    # A Hugging Face model's embedding may have more rows than its tokenizer has ids (Qwen3's).
    if tok.vocab_size > vocab_size:
        raise UsageError(f"{data_dir} has a vocabulary of {tok.vocab_size}, the model {vocab_size}: {fix}")


def split_dataset(cfg, args, tokens_per_sample, data_dir, tok):
    """The split's token blocks as training cut them. Of a sharded DATA the first directory
    is read, as fairseq-eval-lm does."""
    if not exists(data_dir / args.gen_subset):
        raise UsageError(
            f"no split {args.gen_subset!r} in {data_dir} (expected {args.gen_subset}.bin/.idx); "
            "pick one with --gen-subset"
        )
    tokens = IndexedDataset(str(data_dir / args.gen_subset))
    check_token_ids(tokens, tok.vocab_size)
    kind = data_kind(data_dir)
    if kind == "preference_pairs":
        raise UsageError(
            f"{data_dir} holds preference pairs: eval-lm scores text or conversations; a --task dpo run's "
            "validation reports the pairs' loss and rewards"
        )
    if kind == "conversations":
        if args.context_window:
            raise UsageError(f"{data_dir} holds conversations, each scored whole: drop --context-window")
        samples = ConversationSamples(
            tokens, load_targets(data_dir / args.gen_subset), tokens_per_sample, "eos", tok.pad
        )
        if len(samples.too_long):
            log.warning(
                f"{len(samples.too_long):,} conversations of {args.gen_subset} are longer than "
                f"{tokens_per_sample} tokens and are skipped"
            )
        return samples
    break_mode = args.sample_break_mode or cfg.task.sample_break_mode
    blocks = TokenBlockDataset(tokens, tokens_per_sample, break_mode, pad=tok.pad, eos=tok.eos)
    if len(blocks.too_long):  # fairseq-eval-lm skips samples longer than the model's positions
        log.warning(
            f"{len(blocks.too_long):,} sentences of {args.gen_subset} are longer than a block of "
            f"{tokens_per_sample} tokens and are skipped"
        )
    # A model trained with --per-document-attention is scored as it trained: each sequence of
    # a block attending to itself only (with --sample-break-mode none, which cuts them, it
    # never trained: config checks refuse that).
    if cfg.task.get("per_document_attention", False) and break_mode != "none":
        if args.context_window:
            raise UsageError(
                "the model attends to each sequence alone (--per-document-attention): drop --context-window"
            )
        return DocumentBlocks(blocks)
    return blocks


def run(args, cfg, rdv):
    """One rank of eval-lm (launched like train: spawned, torchrun or SLURM)."""
    env = init_rank(cfg, rdv, needs_process_group=False)
    try:
        eval_lm(args, env)
    finally:
        teardown()
    return 0
