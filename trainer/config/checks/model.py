"""Checks of the model group: its sizes, attention's shape (heads, grouped-query,
rotary embeddings, norms), LayerDrop and pruning, the embedding and output widths, the
adaptive input and softmax (with the criterion that trains one), Quant-Noise, and fairseq
options shardlm does not build; eval-lm's --model-overrides."""

import ast
import difflib
from dataclasses import fields

from models.config import (
    TransformerLMConfig,
    adaptive_bands,
    head_dim,
    layers_to_keep,
    moe_layers,
    num_layers,
    parse_cutoffs,
    parse_layer_ids,
)
from trainer.config.checks.values import in_unit_interval, non_negative, positive
from trainer.errors import UsageError


def check_model(cfg):
    model = cfg.model
    positive(
        cfg,
        "model.decoder_layers",
        "model.decoder_embed_dim",
        "model.decoder_ffn_embed_dim",
        "model.decoder_attention_heads",
    )
    positive(cfg, "model.max_target_positions", optional=True)
    non_negative(cfg, "model.min_params_to_wrap")
    in_unit_interval(cfg, "model.dropout", "model.attention_dropout", "model.activation_dropout")
    _check_attention_shape(cfg)
    _check_unsupported_model_keys(model)
    _check_adaptive(cfg)
    _check_model_features(cfg)
    _check_quant_noise(cfg)
    _check_experts(cfg)


def _check_experts(cfg):
    """A mixture of experts (--moe-expert-count, models/moe.py): its routing and what it is
    not built with yet."""
    model = cfg.model
    non_negative(
        cfg, "model.moe_expert_count", "model.moe_freq", "model.moe_aux_loss_coef", "model.moe_router_bias_update_rate"
    )
    positive(cfg, "model.moe_top_k")
    positive(cfg, "model.moe_ffn_embed_dim", optional=True)
    try:
        dense = parse_layer_ids(model.moe_dense_layers)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not moe_layers(model):
        if model.moe_router_bias_update_rate > 0:
            raise UsageError("--moe-router-bias-update-rate balances a mixture of experts: add --moe-expert-count")
        return
    if model.moe_top_k > model.moe_expert_count:
        raise UsageError(
            f"--moe-top-k {model.moe_top_k} routes each token to more experts than the {model.moe_expert_count} "
            "of --moe-expert-count"
        )
    if max(dense, default=0) >= num_layers(model):
        raise UsageError(f"--moe-dense-layers names layer {max(dense)}; the model has {num_layers(model)}")
    if model.scale_fc or model.quant_noise_pq > 0 or model.quant_noise_scalar > 0:
        raise UsageError(
            "--scale-fc and Quant-Noise act on a dense feed-forward's layers, which a mixture of experts' layers "
            "have not: drop them or --moe-expert-count"
        )


def _check_unsupported_model_keys(m):
    """fairseq model options that shardlm does not build; their keys load at their do-nothing
    values (fairseq's own model YAML files list them all)."""
    if m.character_embeddings:
        raise UsageError(
            "--character-embeddings (fairseq's character-CNN input) is not supported: shardlm's models "
            "embed tokens (see --adaptive-input for smaller tables); drop it"
        )


def parse_model_overrides(text):
    """eval-lm's --model-overrides, fairseq's Python dict literal of model keys → {key: value}."""
    try:
        overrides = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        overrides = None
    if not isinstance(overrides, dict):
        raise UsageError(
            f"--model-overrides {text!r} is not a dict; write it as fairseq does, e.g. "
            "\"{'decoder_layers_to_keep':'0,2,4'}\""
        )
    known = {f.name for f in fields(TransformerLMConfig)} - {"_name"}
    for key in overrides:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {near[0]}?" if near else "see `train --help`, group model"
            raise UsageError(f"--model-overrides: {key!r} is not a model key ({hint})")
    return overrides


def _check_adaptive(cfg):
    """Adaptive input and softmax: fairseq's asserts, and the options that would do nothing."""
    m, criterion = cfg.model, cfg.criterion._name
    softmax = m.adaptive_softmax_cutoff is not None
    if softmax and criterion != "adaptive_loss":
        raise UsageError("--adaptive-softmax-cutoff is trained by its own loss: add --criterion adaptive_loss")
    if criterion == "adaptive_loss" and not softmax:
        raise UsageError(
            "--criterion adaptive_loss needs an adaptive softmax: set --adaptive-softmax-cutoff "
            "(e.g. 20000,60000) or use --criterion cross_entropy"
        )
    if m.adaptive_input and m.adaptive_input_cutoff is None:
        raise UsageError("--adaptive-input needs --adaptive-input-cutoff (e.g. 20000,60000)")
    if m.share_decoder_input_output_embed and (m.adaptive_input or softmax):
        raise UsageError(
            "--share-decoder-input-output-embed ties one full table to a full output projection; with "
            "--adaptive-input / --adaptive-softmax-cutoff use --tie-adaptive-weights instead"
        )
    for flag, value, unset, needs, on in (
        ("--adaptive-input-cutoff", m.adaptive_input_cutoff, None, "--adaptive-input", m.adaptive_input),
        ("--adaptive-input-factor", m.adaptive_input_factor, 4.0, "--adaptive-input", m.adaptive_input),
        ("--adaptive-softmax-dropout", m.adaptive_softmax_dropout, 0.0, "--adaptive-softmax-cutoff", softmax),
        ("--adaptive-softmax-factor", m.adaptive_softmax_factor, 4.0, "--adaptive-softmax-cutoff", softmax),
        (
            "--tie-adaptive-weights",
            m.tie_adaptive_weights,
            False,
            "--adaptive-input and --adaptive-softmax-cutoff",
            m.adaptive_input and softmax,
        ),
        ("--tie-adaptive-proj", m.tie_adaptive_proj, False, "--tie-adaptive-weights", m.tie_adaptive_weights),
    ):
        if value != unset and not on:
            raise UsageError(f"{flag} {value} does nothing without {needs}; add {needs} or drop {flag}")
    for flag, value in (
        ("--adaptive-input-factor", m.adaptive_input_factor),
        ("--adaptive-softmax-factor", m.adaptive_softmax_factor),
    ):
        if value <= 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    if not 0.0 <= m.adaptive_softmax_dropout < 1.0:
        raise UsageError(f"--adaptive-softmax-dropout must be in [0, 1), got {m.adaptive_softmax_dropout}")
    cutoffs = {}
    for flag, text in (
        ("--adaptive-input-cutoff", m.adaptive_input_cutoff),
        ("--adaptive-softmax-cutoff", m.adaptive_softmax_cutoff),
    ):
        if text is not None:
            try:
                cutoffs[flag] = parse_cutoffs(text)
            except ValueError as e:
                raise UsageError(f"{flag} {text!r} {e}") from None
    if m.tie_adaptive_weights:  # fairseq's asserts in TransformerLanguageModel.build_model
        if m.adaptive_input_factor != m.adaptive_softmax_factor:
            raise UsageError(
                f"--tie-adaptive-weights needs --adaptive-input-factor {m.adaptive_input_factor} equal to "
                f"--adaptive-softmax-factor {m.adaptive_softmax_factor}"
            )
        if cutoffs["--adaptive-input-cutoff"] != cutoffs["--adaptive-softmax-cutoff"]:
            raise UsageError(
                f"--tie-adaptive-weights needs --adaptive-input-cutoff {m.adaptive_input_cutoff} equal to "
                f"--adaptive-softmax-cutoff {m.adaptive_softmax_cutoff}"
            )
        dim = m.decoder_embed_dim
        if (m.decoder_input_dim or dim) != dim or (m.decoder_output_dim or dim) != dim:
            raise UsageError(
                "--tie-adaptive-weights needs --decoder-input-dim and --decoder-output-dim equal to "
                f"--decoder-embed-dim {dim} (the tied tables serve both ends)"
            )


def check_adaptive_vocab(m, vocab_size, padding_idx=1):
    """The adaptive cutoffs against the vocabulary (fairseq asserts none is larger), and
    each adaptive input band at least 1 wide."""
    width = m.decoder_embed_dim
    for on, flag, text, dim_flag, dim, factor_flag, factor in (
        (
            m.adaptive_input,
            "--adaptive-input-cutoff",
            m.adaptive_input_cutoff,
            "--decoder-input-dim",
            m.decoder_input_dim or width,
            "--adaptive-input-factor",
            m.adaptive_input_factor,
        ),
        (
            m.adaptive_softmax_cutoff is not None,
            "--adaptive-softmax-cutoff",
            m.adaptive_softmax_cutoff,
            "--decoder-output-dim",
            m.decoder_output_dim or width,
            "--adaptive-softmax-factor",
            m.adaptive_softmax_factor,
        ),
    ):
        if not on:
            continue
        try:
            bands = adaptive_bands(text, vocab_size, dim, factor)
        except ValueError as e:
            fix = (
                "smaller --adaptive-input-cutoff and --adaptive-softmax-cutoff (equal, as --tie-adaptive-weights needs)"
                if m.tie_adaptive_weights
                else f"a smaller {flag}"
            )
            raise UsageError(f"{flag} {text} {e}: pass {fix}, every cutoff at most {vocab_size}") from None
        if flag != "--adaptive-input-cutoff":
            # A softmax tail 0 wide scores its words uniformly (its projections are empty
            # matrices), as in fairseq, whose own tests train one.
            continue
        if bands[0][1] <= padding_idx:
            raise UsageError(
                f"{flag} {text}: the first band must hold the padding id {padding_idx}; "
                f"start the cutoffs above {padding_idx}"
            )
        narrow = next(((i, w) for i, (_, _, w) in enumerate(bands) if w < 1), None)
        if narrow is not None:  # fairseq fails initializing such a table (std = width^-0.5)
            raise UsageError(
                f"{factor_flag} {factor} leaves band {narrow[0]} of {flag} {text} {narrow[1]} wide "
                f"from {dim_flag} {dim}; lower the factor or pass fewer cutoffs"
            )
        block = m.quant_noise_pq_block_size
        odd = next(((i, w) for i, (_, _, w) in enumerate(bands) if w % block), None)
        if m.quant_noise_pq and odd is not None:  # each band's projection is noised
            raise UsageError(
                f"--quant-noise-pq-block-size {block} does not divide band {odd[0]}'s width {odd[1]} "
                f"({dim_flag} {dim}, {factor_flag} {factor}): each noised projection's inputs must be whole blocks"
            )


def _check_attention_shape(cfg):
    """Heads, their width, grouped-query attention, rotary embeddings and norms."""
    model_cfg = cfg.model
    positive(cfg, "model.decoder_kv_heads", "model.decoder_head_dim", optional=True)
    positive(cfg, "model.norm_eps", "model.rope_theta")
    if model_cfg.decoder_head_dim is None and model_cfg.decoder_embed_dim % model_cfg.decoder_attention_heads:
        raise UsageError(
            f"--decoder-attention-heads {model_cfg.decoder_attention_heads} does not divide "
            f"--decoder-embed-dim {model_cfg.decoder_embed_dim}; pick heads that divide it "
            "(or set --decoder-head-dim)"
        )
    if model_cfg.decoder_kv_heads is not None and model_cfg.decoder_attention_heads % model_cfg.decoder_kv_heads:
        raise UsageError(
            f"--decoder-kv-heads {model_cfg.decoder_kv_heads} does not divide --decoder-attention-heads "
            f"{model_cfg.decoder_attention_heads}: each key/value head serves a whole group of query heads"
        )
    if model_cfg.rope:
        if head_dim(model_cfg) % 2:
            raise UsageError(f"--rope rotates pairs of channels: the head width {head_dim(model_cfg)} must be even")
        if model_cfg.decoder_learned_pos:
            raise UsageError("--rope and --decoder-learned-pos are two position encodings; drop one")
        if model_cfg.rope_scaling == "llama3" and not (
            model_cfg.rope_scaling_factor > 0
            and 0 < model_cfg.rope_low_freq_factor < model_cfg.rope_high_freq_factor
            and model_cfg.rope_original_max_positions > 0
        ):
            raise UsageError(
                "--rope-scaling llama3 needs --rope-scaling-factor > 0, 0 < --rope-low-freq-factor < "
                "--rope-high-freq-factor and --rope-original-max-positions > 0"
            )
    elif model_cfg.rope_scaling is not None:
        raise UsageError(f"--rope-scaling {model_cfg.rope_scaling} scales rotary embeddings: add --rope")


def _check_model_features(cfg):
    """LayerDrop, pruning to --decoder-layers-to-keep, and the embedding/output widths."""
    model_cfg = cfg.model
    if not 0.0 <= model_cfg.decoder_layerdrop < 1.0:
        raise UsageError(
            "--decoder-layerdrop must be in [0, 1) (each layer's chance to be skipped), "
            f"got {model_cfg.decoder_layerdrop}"
        )
    try:
        layers_to_keep(model_cfg)
    except ValueError as e:
        raise UsageError(
            f"--decoder-layers-to-keep {model_cfg.decoder_layers_to_keep!r} {e}; give distinct ids "
            f"from 0 to {model_cfg.decoder_layers - 1}, e.g. 0,2"
        ) from None
    positive(cfg, "model.decoder_input_dim", "model.decoder_output_dim", optional=True)
    dim = model_cfg.decoder_embed_dim
    width_in, width_out = model_cfg.decoder_input_dim or dim, model_cfg.decoder_output_dim or dim
    if model_cfg.share_decoder_input_output_embed and not model_cfg.adaptive_input and width_in != width_out:
        raise UsageError(
            f"--share-decoder-input-output-embed uses the embedding table as the output projection: "
            f"--decoder-input-dim {width_in} and --decoder-output-dim {width_out} must be equal"
        )


def _check_quant_noise(cfg):
    """Quant-Noise's probabilities, and --quant-noise-pq's blocks: fairseq's quant_noise
    asserts that each noised layer's input width is a whole number of blocks (the adaptive
    input's bands are checked with the vocabulary, in check_adaptive_vocab)."""
    m = cfg.model
    if not 0.0 <= m.quant_noise_scalar <= 1.0:
        raise UsageError(
            f"--quant-noise-scalar must be in [0, 1] (a weight's chance to be int8), got {m.quant_noise_scalar}"
        )
    if m.quant_noise_scalar and (m.adaptive_input or m.adaptive_softmax_cutoff is not None):
        raise UsageError(
            "--quant-noise-scalar with an adaptive input or softmax is not built: their bands' tables and "
            "projections (some tied) have no int8 noise here; drop one of them"
        )
    if not 0.0 <= m.quant_noise_pq < 1.0:
        raise UsageError(f"--quant-noise-pq must be in [0, 1) (a block's chance to be dropped), got {m.quant_noise_pq}")
    block = m.quant_noise_pq_block_size
    if block < 1:
        raise UsageError(f"--quant-noise-pq-block-size must be at least 1, got {block}")
    if m.quant_noise_pq == 0 or m.adaptive_input:
        return
    dim, width_in = m.decoder_embed_dim, m.decoder_input_dim or m.decoder_embed_dim
    if width_in != dim:
        raise UsageError(
            f"--quant-noise-pq adds fairseq's --decoder-embed-dim ({dim}) wide quant_noise layer on the embeddings, "
            f"before they are projected: --decoder-input-dim {width_in} must equal it (fairseq fails there)"
        )
    for flag, width in (("--decoder-embed-dim", dim), ("--decoder-ffn-embed-dim", m.decoder_ffn_embed_dim)):
        if width % block:
            raise UsageError(
                f"--quant-noise-pq-block-size {block} does not divide {flag} {width}: each noised layer's "
                "inputs must be whole blocks; pick a block size that divides it"
            )
