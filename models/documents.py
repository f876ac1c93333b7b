"""Packed documents: several documents in one row, told apart by a B×T `segments` tensor.

Consecutive positions of a row with equal segment values are one document. A document is
a run, not a value: two runs of the same value separated by another are two documents, so
a caller never has to number documents uniquely across a row, only make neighbours differ.

Each position attends only to the earlier positions of its own document (block-causal), and
its position (rotary angles, learned or sinusoidal table row) counts from that document's
first token, so a document scores in a packed row as it would alone at the start of one.

Right padding after the last document may carry any value: the last document's (the pads
join it, after every real position, which causality keeps them from influencing) or one of
its own such as -1 (the pads form a document of their own). Either leaves every real
position's output unchanged; the pads' own outputs differ and are meant to be ignored.
"""

import torch


def document_starts(segments):
    """B×T bool: True at each document's first position (always at position 0)."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return starts


def document_positions(segments):
    """B×T int64: each position's distance from its document's first position."""
    T = segments.shape[1]
    index = torch.arange(T, device=segments.device).expand_as(segments)
    # The latest start at or before each position is its document's first position.
    first = torch.where(document_starts(segments), index, 0).cummax(dim=1).values
    return index - first


def block_causal_mask(segments):
    """B×1×T×T bool for scaled_dot_product_attention: True where query i may attend key j,
    i.e. j ≤ i and both in one document. Built once per forward and shared by every layer
    (B·T² bytes: 8 MiB for 8 rows of 1024)."""
    documents = document_starts(segments).cumsum(dim=1)
    same = documents[:, :, None] == documents[:, None, :]
    T = segments.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril_()
    return (same & causal)[:, None]
