"""Adaptive input embeddings (Baevski & Auli, 2018) and the adaptive softmax (Grave et al.,
2017), with fairseq's semantics (fairseq/modules/adaptive_input.py, adaptive_softmax.py,
criterions/adaptive_loss.py).

The vocabulary, sorted by frequency as fairseq's dictionaries are, is cut into bands at
the cutoffs. Band i has a table `dim // factor**i` wide, so rare tokens cost fewer
parameters. The adaptive input projects each band's vectors to the model's width. The
adaptive softmax scores the first band's words plus one "cluster" per later band (the
head); a token of band i>0 costs -log p(cluster) - log p(word | cluster), its second
term from that band's own narrow projection (a tail).

--tie-adaptive-weights reads the softmax's word tables from the adaptive input's tables,
and --tie-adaptive-proj its tail projections from the input's (transposed). Tied weights
stay registered in the adaptive input only: one parameter, one name in checkpoints and
one FSDP group (a parameter registered on two modules would be two entries of a
state dict). The softmax looks them up at each forward, after FSDP has gathered them.

Every band and every tail runs in every forward, on no rows when a batch has none of
its tokens, so each parameter takes part in each update. fairseq skips such tails and so
refuses PyTorch's DDP with adaptive_loss; here every backend trains these models.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import adaptive_bands
from models.quant_noise import noisy_linear


def _dropout(x, p, training):
    return F.dropout(x, p, training) if training and p > 0 else x


class AdaptiveInput(nn.Module):
    """Token ids → vectors of `output_dim`: band i's table is `initial_dim // factor**i` wide,
    followed by its own projection to output_dim (no bias), as fairseq's AdaptiveInput.
    The padding row (in band 0) starts at 0; fairseq also zeroes that row number of the
    other bands, whose tokens are not padding: not copied."""

    def __init__(self, vocab_size, padding_idx, initial_dim, factor, output_dim, cutoff, pq=0.0, block_size=8):
        super().__init__()
        self.bands = adaptive_bands(cutoff, vocab_size, initial_dim, factor)
        if padding_idx >= self.bands[0][1]:
            raise ValueError(f"the first adaptive input band must hold the padding id {padding_idx}")
        self.embedding_dim, self.padding_idx = output_dim, padding_idx
        # fairseq's layout and names: embeddings.{band}.0 is the table, .1 the projection,
        # which --quant-noise-pq (pq > 0) trains with noise, as fairseq's.
        self.embeddings = nn.ModuleList(
            nn.Sequential(
                nn.Embedding(end - start, width, padding_idx if i == 0 else None),
                noisy_linear(width, output_dim, False, pq, block_size),
            )
            for i, (start, end, width) in enumerate(self.bands)
        )

    def weights_for_band(self, band):
        """(table, projection weight) of a band, as FSDP has them now (gathered in forward)."""
        return self.embeddings[band][0].weight, self.embeddings[band][1].weight

    def forward(self, tokens):
        flat = tokens.reshape(-1)
        positions, vectors = [], []
        # Every band runs, on an empty selection if it has no token here (DDP's hooks expect
        # every parameter in every forward).
        for (start, end, _), band in zip(self.bands, self.embeddings):
            where = ((flat >= start) & (flat < end)).nonzero().squeeze(1)
            positions.append(where)
            vectors.append(band(flat[where] - start))
        # In the tables' dtype, as fairseq's buffer: under autocast the residual stream
        # stays fp32, as a plain embedding's output would.
        vectors = torch.cat(vectors).to(self.embeddings[0][0].weight.dtype)
        out = vectors.new_empty(flat.shape[0], self.embedding_dim).index_copy(0, torch.cat(positions), vectors)
        return out.view(*tokens.shape, self.embedding_dim)


class Tail(nn.Module):
    """One cluster of the adaptive softmax: input_dim → its band's width (dropout) → the
    band's words. A tied part has no module here: its weight is passed in."""

    def __init__(self, input_dim, width, size, dropout, own_proj, own_words):
        super().__init__()
        self.dropout, self.size = dropout, size
        # A tail the factor makes 0 wide (fairseq trains one in its own tests) scores its
        # words all 0, i.e. uniformly, as fairseq's empty matrices do. It has no parameters:
        # FSDP2 cannot shard an empty one.
        self.empty = width == 0
        self.proj = nn.Linear(input_dim, width, bias=False) if own_proj and not self.empty else None
        self.words = nn.Linear(width, size, bias=False) if own_words and not self.empty else None

    def forward(self, x, tied_table=None, tied_proj=None):
        if self.empty:
            return x.new_zeros(*x.shape[:-1], self.size)
        # tied_proj is the adaptive input's width → input_dim projection, used transposed.
        h = self.proj(x) if self.proj is not None else F.linear(x, tied_proj.t())
        h = _dropout(h, self.dropout, self.training)
        return self.words(h) if self.words is not None else F.linear(h, tied_table)


class AdaptiveSoftmax(nn.Module):
    """fairseq's AdaptiveSoftmax: a head over the first band's words and one cluster per
    later band, and a tail per later band. `loss` is fairseq's adaptive_loss criterion;
    `log_probs` its get_log_prob (full-vocabulary log-probabilities, for eval and sampling)."""

    def __init__(self, vocab_size, input_dim, cutoff, dropout, factor=4.0, adaptive_input=None, tie_proj=False):
        super().__init__()
        self.bands = adaptive_bands(cutoff, vocab_size, input_dim, factor)
        self.dropout, self.vocab_size = dropout, vocab_size
        tied = adaptive_input is not None
        # A plain attribute (not a submodule): the tied tables stay the adaptive input's own.
        self._tied_input = (adaptive_input,) if tied else ()
        self.head_words = self.bands[0][1]
        self.head_size = self.head_words + len(self.bands) - 1
        if tied:  # the first band's words are scored against the input's first table
            self.head = None
            self.class_proj = nn.Linear(input_dim, len(self.bands) - 1, bias=False)
        else:
            self.head = nn.Linear(input_dim, self.head_size, bias=False)
            self.class_proj = None
        self.tail = nn.ModuleList(
            Tail(input_dim, width, end - start, dropout, own_proj=not (tied and tie_proj), own_words=not tied)
            for start, end, width in self.bands[1:]
        )

    def _tied(self, band):
        return self._tied_input[0].weights_for_band(band) if self._tied_input else (None, None)

    def head_logits(self, x):
        if self.head is not None:
            return self.head(x)
        table, _ = self._tied(0)
        return torch.cat([F.linear(x, table), self.class_proj(x)], dim=-1)

    def tail_logits(self, i, x):
        return self.tail[i](x, *self._tied(i + 1))

    def loss(self, x, target, ignore_index):
        """Summed negative log-likelihood (nats, fp32) of `target` (B×T ids; ignore_index
        not scored) given the hidden states x (B×T×input_dim)."""
        target = target.reshape(-1)
        keep = (target != ignore_index).nonzero().squeeze(1)
        # Pads are dropped up front. fairseq applies ignore_index to each cluster's relative
        # ids as well, so it also leaves unscored the tail word whose offset in its band
        # equals the padding id; here only padding is unscored, and the loss is exactly
        # -log of log_probs' probability of each target.
        x, target = x.reshape(-1, x.shape[-1]).index_select(0, keep), target.index_select(0, keep)
        x = _dropout(x, self.dropout, self.training)
        head_target = target.clone()
        members = []
        for i, (start, end, _) in enumerate(self.bands[1:]):
            inside = (target >= start) & (target < end)
            head_target[inside] = self.head_words + i
            members.append(inside.nonzero().squeeze(1))
        loss = F.cross_entropy(self.head_logits(x).float(), head_target, reduction="sum")
        # Every tail runs, on no rows when its band has no target here (see AdaptiveInput).
        for i, rows in enumerate(members):
            logits = self.tail_logits(i, x.index_select(0, rows)).float()
            loss = loss + F.cross_entropy(logits, target.index_select(0, rows) - self.bands[i + 1][0], reduction="sum")
        return loss

    def log_probs(self, x):
        """fairseq's get_log_prob without a target: B×T×V log-probabilities (fp32)."""
        head = F.log_softmax(self.head_logits(x).float(), dim=-1)
        parts = [head[..., : self.head_words]]
        for i in range(len(self.tail)):
            prior = head[..., self.head_words + i, None]  # log p(cluster i)
            parts.append(F.log_softmax(self.tail_logits(i, x).float(), dim=-1) + prior)
        return torch.cat(parts, dim=-1)
