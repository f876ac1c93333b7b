"""A saved data position read on another layout: other ranks, another per-rank batch
(data/iterator.py's order). A mixture's position is a slot and needs none of this
(data/mixture_batches.py)."""

import logging

from data.iterator import ORDER

log = logging.getLogger("shardlm")


def convert_position(it, world_size, batch_size, max_tokens):
    """A saved data position ``it`` in the batches of a run on ``world_size`` ranks with this
    per-rank batch (data/iterator.py: fairseq's order); its ``split``: how many of this run's
    batches each batch of the saved order makes.

    An epoch's batches depend on the per-rank batch (--batch-size, --max-tokens) and the
    seed, not on the number of ranks, which take them in turn: after k steps of W ranks the
    first k * W are consumed, so W' ranks resume after k * W / W' steps, having consumed
    exactly those. A per-rank --batch-size that divides the saved order's (``batch_size``:
    the saved run's --batch-size times its split) keeps that order, each of its batches split
    in turn into as many of this run's: 2 ranks x --batch-size 4 resumed on 4 ranks x
    --batch-size 2 reads the same sequences for each update. Another per-rank batch cuts the
    epoch into other batches in another order: no position of this run consumed the same
    sequences, so it resumes after about as many sequences (as many batches with
    --max-tokens), with a warning; the epochs after it are whole."""
    steps, world, old_split = it["iterations_in_epoch"], it["world_size"], it.get("split", 1)
    order_size, old_tokens = it.get("batch_size"), it.get("max_tokens")
    if steps and it.get("order") != ORDER:
        log.warning(
            f"the checkpoint's data position was saved by an earlier shardlm, which read epochs in another "
            f"order: the rest of epoch {it['epoch']} is read in fairseq's, so some of its sequences are seen "
            "twice and others not at all; the epochs after it are whole"
        )
    if max_tokens is None is old_tokens and order_size and batch_size and order_size % batch_size == 0:
        # Our batches: the saved order's, each split in `split`; k steps of W ranks consumed
        # k * W of the saved run's, each old_split of the order's.
        split = order_size // batch_size
        consumed, per_step, unit = steps * world * split, world_size * old_split, f"batches of {batch_size}"
    elif (order_size, old_tokens) == (batch_size, max_tokens):
        split = 1
        consumed, per_step, unit = steps * world, world_size, "batches"
    else:
        if steps:
            log.warning(
                f"this run's batches (--batch-size {batch_size}, --max-tokens {max_tokens}) are not the "
                f"checkpoint's ({order_size and order_size // old_split}, {old_tokens}): the rest of epoch "
                f"{it['epoch']} starts after about as much data, not after the same sequences"
            )
        split, old_size = 1, order_size and order_size // old_split
        if old_size and batch_size:
            consumed, per_step, unit = steps * world * old_size, world_size * batch_size, "sequences"
        else:
            consumed, per_step, unit = steps * world, world_size, "batches"
        order_size = batch_size
    if consumed % per_step:
        log.warning(
            f"the checkpoint's data position ({consumed} {unit}) is not a whole number of this run's steps "
            f"of {per_step}: resuming at the nearest earlier one"
        )
    return {**it, "iterations_in_epoch": consumed // per_step, "batch_size": order_size, "split": split}
