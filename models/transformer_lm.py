"""A decoder-only transformer language model with fairseq's transformer_lm options.

Reads top to bottom: embeddings → N decoder layers → final norm → output projection.
It holds no parallelism: sharding, activation checkpointing and mixed precision are
applied from the outside by trainer/parallel/parallelize.py, one `DecoderLayer` at a time.
Generation passes a `KVCache` so each new token runs each layer over one position only.

Its pieces: the layer (models/layer.py), the norms (models/norms.py), positions and
rotary embeddings (models/positions.py), the KV cache (models/kv_cache.py), the adaptive
input and softmax (models/adaptive.py), the loss (models/linear_cross_entropy.py).
"""

import math
import zlib
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.adaptive import AdaptiveInput, AdaptiveSoftmax
from models.config import moe_layers, num_layers
from models.documents import block_causal_mask, document_positions
from models.kv_cache import KVCache
from models.layer import ACTIVATION_FNS, DecoderLayer, dropout
from models.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_per_row
from models.norms import RMSNorm, _RMSNormFunction, make_norm
from models.positions import apply_rope, rope_inverse_frequencies, rope_tables, sinusoidal_positions
from models.pq import PQEmbedding, PQLinear, StackedLinear, apply_quantized
from models.quant_noise import embedding, linear, noisy_linear, noisy_modules, quantized_output, set_noise_seeds

# Names other modules (trainer/, tests/, bench/) import from here, as before the model's
# pieces had files of their own.
__all__ = [
    "ACTIVATION_FNS",
    "DecoderLayer",
    "KVCache",
    "RMSNorm",
    "TransformerLM",
    "_RMSNormFunction",
    "apply_rope",
    "build_model",
    "make_norm",
    "num_parameters",
    "rope_inverse_frequencies",
    "rope_tables",
    "sinusoidal_positions",
]


class TransformerLM(nn.Module):
    def __init__(self, cfg, vocab_size, max_positions, padding_idx=1):
        super().__init__()
        dim = cfg.decoder_embed_dim
        self.vocab_size, self.max_positions, self.padding_idx = vocab_size, max_positions, padding_idx
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(dim)
        self.dropout = cfg.dropout
        # --rope rotates queries and keys inside attention: nothing is added to the embeddings.
        self.rope = cfg if getattr(cfg, "rope", False) else None
        self._inv_freq = None  # computed on first use, on the activations' device (not a buffer: FSDP builds on meta)
        self.positions = (
            None
            if cfg.no_token_positional_embeddings or self.rope is not None
            else ("learned" if cfg.decoder_learned_pos else "sinusoidal")
        )
        if cfg.adaptive_input:  # narrower tables for rarer tokens, each projected to dim (models/adaptive.py)
            self.embed_tokens = AdaptiveInput(
                vocab_size,
                padding_idx,
                cfg.decoder_input_dim or dim,
                cfg.adaptive_input_factor,
                dim,
                cfg.adaptive_input_cutoff,
                getattr(cfg, "quant_noise_pq", 0.0),
                getattr(cfg, "quant_noise_pq_block_size", 8),
            )
        else:
            # A pad id past the table (data made with a tokenizer that has none, as GPT-2's,
            # gets one after its last id) is the loss's ignore index only: no row to keep zero.
            row = padding_idx if padding_idx is not None and padding_idx < vocab_size else None
            self.embed_tokens = embedding(cfg, vocab_size, cfg.decoder_input_dim or dim, row)
        # fairseq's project_in_dim / project_out_dim: embeddings (--decoder-input-dim) and the
        # output projection's input (--decoder-output-dim) of another width than the layers.
        width_in = self.embed_tokens.embedding_dim
        # fairseq's TransformerDecoder adds a learned dim×dim layer on the scaled embeddings
        # when it trains with --quant-noise-pq without an adaptive input (which has its own
        # noisy projections); kept in evaluation, its noise only in training.
        pq, block_size = getattr(cfg, "quant_noise_pq", 0.0), getattr(cfg, "quant_noise_pq_block_size", 8)
        self.quant_noise = (
            noisy_linear(dim, dim, False, pq, block_size, getattr(cfg, "quant_noise_scalar", 0.0))
            if pq > 0 and not cfg.adaptive_input
            else None
        )
        # --quant-noise-scalar takes every linear layer and table below (fairseq's
        # quantize_model_ takes every nn.Linear and nn.Embedding), pq noise none of them.
        self.project_in_dim = linear(cfg, width_in, dim, bias=False, pq=False) if width_in != dim else None
        # fairseq's tables count positions from padding_idx + 1 (--positions-offset 2): they
        # have that many more rows, read from there.
        self.positions_offset = getattr(cfg, "positions_offset", 0)  # 0 in configs saved before it existed
        self.embed_positions = (
            embedding(cfg, max_positions + self.positions_offset, dim) if self.positions == "learned" else None
        )
        self.layernorm_embedding = make_norm(cfg, dim) if cfg.layernorm_embedding else None
        # --decoder-layers-to-keep builds only those (renumbered from 0), as fairseq does.
        sparse, self._experts = moe_layers(cfg), getattr(cfg, "moe_expert_count", 0)
        self.layers = nn.ModuleList(DecoderLayer(cfg, sparse=i in sparse) for i in range(num_layers(cfg)))
        self.layerdrop = cfg.decoder_layerdrop
        final_norm = cfg.decoder_normalize_before and not cfg.no_decoder_final_norm
        self.layer_norm = make_norm(cfg, dim) if final_norm else None
        width_out = cfg.decoder_output_dim or dim
        # fairseq: a tied adaptive softmax takes the layers' width (no projection).
        self.project_out_dim = (
            linear(cfg, dim, width_out, bias=False, pq=False)
            if width_out != dim and not cfg.tie_adaptive_weights
            else None
        )
        self.adaptive_softmax = None
        if cfg.adaptive_softmax_cutoff is not None:  # replaces the output projection
            self.adaptive_softmax = AdaptiveSoftmax(
                vocab_size,
                cfg.decoder_output_dim or dim,
                cfg.adaptive_softmax_cutoff,
                cfg.adaptive_softmax_dropout,
                cfg.adaptive_softmax_factor,
                self.embed_tokens if cfg.tie_adaptive_weights else None,
                cfg.tie_adaptive_proj,
            )
        self.output_projection = (
            None
            if cfg.share_decoder_input_output_embed or self.adaptive_softmax is not None
            else linear(cfg, width_out, vocab_size, bias=False, pq=False)
        )
        self._param_kinds = self._kinds()
        self._noisy = noisy_modules(self)  # [(name, module)] drawing Quant-Noise, seeded per micro-batch

    @torch.no_grad()
    def init_parameter(self, name, tensor, seed):
        """Fill `tensor` with parameter `name`'s initial value (fairseq's init).

        Each parameter draws from its own generator, seeded by (seed, name), so its
        value does not depend on which other parameters were initialized before it —
        a rank holding only shards can recreate exactly what one process would."""
        g = torch.Generator(device=tensor.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        kind = self._param_kinds[name]
        if kind == "embedding":  # N(0, width^-0.5): tokens, learned positions, output projection
            tensor.normal_(0.0, tensor.shape[1] ** -0.5, generator=g)
            if name == "embed_tokens.weight":
                tensor[self.padding_idx].zero_()
        elif kind == "adaptive_embedding":  # fairseq's AdaptiveInput: N(0, width^-0.5), the pad row 0
            tensor.normal_(0.0, tensor.shape[1] ** -0.5, generator=g)
            if name == "embed_tokens.embeddings.0.0.weight":
                tensor[self.padding_idx].zero_()
        elif kind == "linear":
            nn.init.xavier_uniform_(tensor, generator=g)
        elif kind == "experts":  # each expert's matrix as a linear layer's, in one draw order
            E = self._experts
            for matrix in tensor.view(E, tensor.shape[0] // E, tensor.shape[1]):
                nn.init.xavier_uniform_(matrix, generator=g)
        elif kind == "torch_linear":  # nn.Linear's own init, which fairseq leaves its quant_noise layer
            nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=g)
        elif kind in ("norm_weight", "scale"):  # NormFormer's scales start at 1, as fairseq's
            tensor.fill_(1.0)
        elif kind == "quantized":  # iPQ's centroids: k-means or a checkpoint gives their values
            tensor.zero_()
        else:  # biases
            tensor.zero_()

    def quantize_structure(self, specs, device):
        """iPQ (models/pq.py): the modules `specs` names become PQ modules of those shapes,
        uninitialized (a checkpoint's or k-means' values load into them); the attention's
        qkv_proj, quantized by parts, stacks fairseq's q_proj, k_proj and v_proj."""
        apply_quantized(self, specs, self.stacked_rows, device)
        self._param_kinds = self._kinds()

    def stacked_rows(self, owner):
        """{part: rows} of a weight that stacks several of fairseq's (a layer's qkv_proj)."""
        layer = self.layers[int(owner.split(".")[1])]
        q, k, v = layer.weight_blocks()["qkv_proj.weight"]
        return {"q": q, "k": k, "v": v}

    @torch.no_grad()
    def init_buffers(self, device=None):
        """The buffers' initial values (auxiliary-loss-free balancing's router biases: 0), on
        `device` (where the forward runs; default where they are)."""
        for module in self.modules():  # iPQ's assignments and counts: a checkpoint's values load into them
            if isinstance(module, (PQLinear, PQEmbedding)):
                module.assignments = torch.zeros(module.assignments.shape, dtype=torch.long, device=device)
                module.counts = torch.zeros(module.counts.shape, device=device)
        for layer in self.sparse_layers:
            for name in ("router_bias", "update_load"):
                buffer = getattr(layer.moe, name)
                if buffer is not None:
                    setattr(layer.moe, name, torch.zeros(buffer.shape, device=device or buffer.device))

    def init_weights(self, seed=1):
        for name, p in self.named_parameters():
            self.init_parameter(name, p.data, seed)

    def _kinds(self):
        kinds = {"embed_tokens.weight": "embedding"}
        if self.embed_positions is not None:
            kinds["embed_positions.weight"] = "embedding"
        if self.output_projection is not None:
            kinds["output_projection.weight"] = "embedding"  # N(0, d^-0.5), like the tied table
        if isinstance(self.embed_tokens, AdaptiveInput):  # its tables; its projections are Linear (below)
            for i in range(len(self.embed_tokens.bands)):
                kinds[f"embed_tokens.embeddings.{i}.0.weight"] = "adaptive_embedding"
        for mname, module in self.named_modules():
            prefix = mname + "." if mname else ""
            if isinstance(module, DecoderLayer):
                kinds[prefix + "c_attn"] = kinds[prefix + "w_resid"] = "scale"
                kinds[prefix + "moe.experts.fc1"] = kinds[prefix + "moe.experts.fc2"] = "experts"
            if isinstance(module, (PQLinear, PQEmbedding, StackedLinear)):  # iPQ: values from k-means
                kinds[prefix + "centroids"], kinds[prefix + "bias"] = "quantized", "bias"
            if isinstance(module, nn.Linear) and module is not self.output_projection:
                kinds[prefix + "weight"], kinds[prefix + "bias"] = "linear", "bias"
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                kinds[prefix + "weight"], kinds[prefix + "bias"] = "norm_weight", "bias"
        if self.quant_noise is not None:
            kinds["quant_noise.weight"] = "torch_linear"
        return kinds

    def embed(self, tokens, start=0, positions=None, span=None):
        """start: the first token's position (the cache's length when decoding incrementally).
        positions: B×T, each token's own position counted from start (packed documents, or
        rows of a batch each at its own length); None: start, start+1, …
        span: how many positions from start the tokens may use (default T; more when rows
        of a batch are at other lengths), so that the tables are made that long."""
        T = tokens.shape[1]
        span = T if span is None else span
        if start + span > self.max_positions:
            raise ValueError(f"sequence of {start + span} tokens exceeds the model's {self.max_positions} positions")
        x = self.embed_scale * self.embed_tokens(tokens)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        first = start + self.positions_offset
        if self.positions == "learned":
            rows = torch.arange(first, first + T, device=tokens.device) if positions is None else positions + first
            x = x + self.embed_positions(rows)
        elif self.positions == "sinusoidal":
            table = sinusoidal_positions(span, x.shape[-1], x.device, x.dtype, first)
            x = x + (table if positions is None else table[positions])
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return dropout(x, self.dropout, self.training)

    def rope_tables(self, start, length, x, positions=None):
        """(cos, sin) for positions start … start+length-1 with --rope, else None; each
        length × head_dim, or with `positions` (B×T, counted from start: packed documents, a
        batch's rows) the rows of those positions, B×1×T×head_dim, to broadcast over the heads."""
        if self.rope is None:
            return None
        if self._inv_freq is None or self._inv_freq.device != x.device:
            self._inv_freq = rope_inverse_frequencies(self.rope, x.device)
        cos, sin = rope_tables(self._inv_freq, start, length, x.dtype)
        if positions is None:
            return cos, sin
        return cos[positions][:, None], sin[positions][:, None]

    def layerdrop_layers(self, seed):
        """LayerDrop (fairseq's LayerDropModuleList): the ids of the layers one training
        forward runs, each kept when its uniform draw exceeds --decoder-layerdrop. The draws
        come from a generator seeded with `seed` alone, so every rank given the same seed
        runs the same layers: sharded and replicated runs, and one process, compute the
        same update, and no rank waits in a collective for a layer its peers skip.
        None when nothing is dropped."""
        if self.layerdrop == 0:
            return None
        draws = torch.rand(len(self.layers), generator=torch.Generator().manual_seed(seed), device="cpu")
        return [i for i, u in enumerate(draws.tolist()) if u > self.layerdrop]

    def forward(
        self,
        tokens,
        cache=None,
        target=None,
        layers=None,
        softmax_batch=None,
        noise_seed=None,
        segments=None,
        per_row=False,
        context=None,
    ):
        """tokens: B×T token ids → B×T×V logits. With a `KVCache`, tokens are the next T
        positions after those cached: they are appended to it and attend to all of them.
        With `target` (B×T ids; padding_idx is ignored), the summed cross-entropy in nats
        instead, computed without ever holding the B×T×V logits (training).
        layers: in training, the ids of the layers to run (`layerdrop_layers`); None, and
        always in eval mode, runs them all. softmax_batch: with `target`, score at most this
        many tokens' output distributions at a time (eval-lm's --softmax-batch; all at once
        when --quant-noise-scalar makes them int8 values, from the whole logits). noise_seed:
        in training, the micro-batch's seed of Quant-Noise's draws (None: a random one).
        segments: B×T integers, packed documents (models/documents.py): a run of equal
        values is one document, attending only to itself, its positions counted from 0;
        right padding may carry the last document's value or -1. None: one sequence a row.
        per_row: with `target`, a float32 vector of B summed cross-entropies (nats), one per
        row (sequence log-likelihoods, e.g. DPO's), instead of their total.
        context: under context parallelism, tokens are some positions of each sequence and
        `context` (trainer/parallel/context_parallel.py) brings their global `positions`
        (B×T), the sequence's length `span`, `query_chunks` (the runs of the tokens that are
        runs of the sequence: DecoderLayer.forward's), with packed documents the `mask` of
        these queries over all its keys (None otherwise: causal attention over each run's
        keys), and `keys_values(k, v)`, which gives attention the whole sequence's."""
        counted = None if self.padding_idx is None else (tokens != self.padding_idx).reshape(-1)
        for layer in self.sparse_layers:  # what a layer LayerDrop skips routed no token
            layer.moe.routing, layer.moe.counted = None, counted
        if segments is not None and cache is not None:
            raise ValueError("segments (packed documents) cannot be decoded with a KV cache: pass one or the other")
        if per_row and (target is None or softmax_batch or self.adaptive_softmax is not None):
            raise ValueError("per_row needs a target, and works without softmax_batch or an adaptive softmax")
        if self.training and self._noisy:
            set_noise_seeds(self._noisy, noise_seed)
        # The positions and mask are made once here and read by every layer: the documents'
        # with segments, the cache's rows' with a cache (a batch's rows at lengths of their own).
        start, positions, span, mask, query_chunks = 0, None, tokens.shape[1], None, None
        if context is not None:
            positions, span, mask, query_chunks = context.positions, context.span, context.mask, context.query_chunks
        elif segments is not None:
            positions, mask = document_positions(segments), block_causal_mask(segments)
        elif cache is not None:
            start, positions, span, mask = cache.next_positions(tokens.shape[1], tokens.device)
        x = self.embed(tokens, start, positions, span)
        rope = self.rope_tables(start, span, x, positions)
        if cache is None:  # training, and generation without a cache
            keys_values = None if context is None else context.keys_values
            for i in range(len(self.layers)) if layers is None or not self.training else layers:
                x = self.layers[i](x, cache=keys_values, rope=rope, mask=mask, query_chunks=query_chunks)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, cache=partial(cache.append, i), rope=rope, mask=mask)
            cache.advance(tokens.shape[1])
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        if target is not None and softmax_batch and not quantized_output(self.output_projection):
            x, target = x.reshape(-1, x.shape[-1]), target.reshape(-1)
            return sum(
                self.output_loss(x[i : i + softmax_batch], target[i : i + softmax_batch])
                for i in range(0, len(target), softmax_batch)
            )
        if per_row:
            return self.row_losses(x, target)
        if target is not None:
            return self.output_loss(x, target)
        return self.logits(x)

    @property
    def sparse_layers(self):
        return [layer for layer in self.layers if layer.moe is not None]

    def router_stats(self):
        """models/moe.py RouterStats of each mixture-of-experts layer the last forward ran."""
        return [layer.moe.routing for layer in self.sparse_layers if layer.moe.routing is not None]

    def update_router_biases(self):
        """Auxiliary-loss-free balancing's step (models/moe.py), after an optimizer update."""
        for layer in self.sparse_layers:
            if layer.moe.router_bias is not None:
                layer.moe.update_bias()

    def sparse_layer_ids(self, stats):
        """The layer ids of router_stats' entries."""
        ids = {id(layer.moe.routing): i for i, layer in enumerate(self.layers) if layer.moe is not None}
        return [ids[id(s)] for s in stats]

    def logits(self, x):
        """B×T×V logits of hidden states x (the adaptive softmax's log-probabilities)."""
        if self.adaptive_softmax is not None:  # log-probabilities serve as logits
            return self.adaptive_softmax.log_probs(x)
        if self.output_projection is not None:
            return self.output_projection(x)
        return F.linear(x, self.embed_tokens.weight)

    def output_loss(self, x, target):
        """Summed cross-entropy (nats) of the output layer on hidden states x."""
        if self.adaptive_softmax is not None:  # its loss; without a target, log-probabilities serve as logits
            return self.adaptive_softmax.loss(x, target, self.padding_idx)
        if quantized_output(self.output_projection):
            # --quant-noise-scalar clamps (in training) or rounds (in evaluation) the logits to
            # their int8 range: they are made whole, once per forward, as fairseq makes them.
            logits = self.output_projection(x).float()
            return F.cross_entropy(
                logits.view(-1, logits.shape[-1]), target.reshape(-1), ignore_index=self.padding_idx, reduction="sum"
            )
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        return self.loss(x, weight, target)

    def row_losses(self, x, target):
        """Each row's summed cross-entropy (nats, float32 B) on hidden states x (B×T×d)."""
        if quantized_output(self.output_projection):  # whole logits, as output_loss makes them
            logits = self.output_projection(x).float()
            losses = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=self.padding_idx, reduction="none")
            return losses.sum(dim=1)
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        return self.loss(x, weight, target, per_row=True)

    def loss(self, x, weight, target, per_row=False, shard=None):
        """shard: with weight a shard of the vocabulary's rows (tensor parallelism), how the
        shards join (models/linear_cross_entropy.py)."""
        device = x.device.type
        if torch.is_autocast_enabled(device):  # the op runs outside autocast: cast as it would
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
        with torch.autocast(device, enabled=False):
            if per_row:
                return linear_cross_entropy_per_row(x, weight, target, ignore_index=self.padding_idx, shard=shard)
            return linear_cross_entropy(x, weight, target, ignore_index=self.padding_idx, shard=shard)


def build_model(cfg, vocab_size, max_positions, device=None, padding_idx=1, seed=1):
    """Build and initialize on `device`; device="meta" allocates nothing and initializes
    nothing (to count, or to shard first and initialize each shard after)."""
    with torch.device(device or "cpu"):
        model = TransformerLM(cfg, vocab_size, max_positions, padding_idx)
    if torch.device(device or "cpu").type != "meta":
        model.init_weights(seed)
    return model


def num_parameters(model):
    # Tied weights are one Parameter, so counting unique parameters counts them once.
    return sum(p.numel() for p in model.parameters())
