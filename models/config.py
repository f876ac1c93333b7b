"""The transformer LM's options (fairseq's names and defaults) and its presets.

Torch-free on purpose: `train --help` builds its flags from this dataclass and
must answer before torch is imported.
"""

from dataclasses import dataclass, field
from typing import Optional

# fairseq's utils.get_activation_fn names (gelu_fast is its old name of gelu_accurate).
ACTIVATIONS = ("relu", "relu_squared", "gelu", "gelu_fast", "gelu_accurate", "tanh", "linear", "swish")
NORMS = ("layernorm", "rmsnorm")
ROPE_SCALINGS = ("llama3",)


@dataclass
class TransformerLMConfig:
    _name: str = field(
        default="transformer_lm",
        metadata={"help": "model preset (fairseq --arch); also `model=NAME`", "flag": "--arch", "short": "-a"},
    )
    decoder_embed_dim: int = field(default=512, metadata={"help": "decoder embedding dimension"})
    decoder_ffn_embed_dim: int = field(default=2048, metadata={"help": "decoder feed-forward dimension"})
    decoder_layers: int = field(default=6, metadata={"help": "number of decoder layers"})
    decoder_attention_heads: int = field(default=8, metadata={"help": "number of attention heads"})
    decoder_normalize_before: bool = field(
        default=True, metadata={"help": "pre-LN: normalize before each sublayer (fairseq forces it on for LMs)"}
    )
    no_decoder_final_norm: bool = field(default=False, metadata={"help": "drop the final layer norm"})
    decoder_learned_pos: bool = field(
        default=False, metadata={"help": "learned positional embeddings (default: sinusoidal)"}
    )
    no_token_positional_embeddings: bool = field(default=False, metadata={"help": "no positional embeddings at all"})
    positions_offset: int = field(
        default=0,
        metadata={
            "help": "the position the first token has in the positional table: fairseq's models count "
            "from padding_idx + 1, so a fairseq checkpoint loads with 2 (set from the checkpoint)"
        },
    )
    share_decoder_input_output_embed: bool = field(
        default=False, metadata={"help": "tie the input embedding and the output projection"}
    )
    no_scale_embedding: bool = field(
        default=False, metadata={"help": "do not scale token embeddings by sqrt(embed_dim)"}
    )
    layernorm_embedding: bool = field(default=False, metadata={"help": "layer norm after the embeddings"})
    activation_fn: str = field(default="relu", metadata={"help": "activation function", "choices": ACTIVATIONS})
    dropout: float = field(default=0.1, metadata={"help": "dropout probability"})
    attention_dropout: float = field(default=0.0, metadata={"help": "dropout on attention weights"})
    activation_dropout: float = field(
        default=0.0, metadata={"help": "dropout after the FFN activation", "alias": "--relu-dropout"}
    )
    max_target_positions: Optional[int] = field(
        default=None, metadata={"help": "longest sequence the model accepts (default: --tokens-per-sample)"}
    )
    checkpoint_activations: bool = field(
        default=False, metadata={"help": "recompute each layer's activations in backward instead of storing them"}
    )
    offload_activations: bool = field(
        default=False, metadata={"help": "keep checkpointed activations on the CPU; implies --checkpoint-activations"}
    )
    decoder_input_dim: Optional[int] = field(
        default=None,
        metadata={
            "help": "width of the token embeddings, projected to --decoder-embed-dim when different "
            "(default: --decoder-embed-dim)"
        },
    )
    decoder_output_dim: Optional[int] = field(
        default=None,
        metadata={
            "help": "width fed to the output projection, projected from --decoder-embed-dim when different "
            "(default: --decoder-embed-dim)"
        },
    )
    decoder_layerdrop: float = field(
        default=0.0,
        metadata={
            "help": "LayerDrop: skip each decoder layer with this probability in training, drawn anew "
            "for every micro-batch, the same on every rank (Fan et al., 2019); evaluation runs all"
        },
    )
    decoder_layers_to_keep: Optional[str] = field(
        default=None,
        metadata={
            "help": 'keep only these of the --decoder-layers layers, comma-separated ids (e.g. "0,2,4"), '
            "renumbered 0, 1, …: prunes a LayerDrop-trained checkpoint of all of them, typically "
            "with eval-lm --model-overrides"
        },
    )
    scale_attn: bool = field(
        default=False,
        metadata={"help": "NormFormer: layer norm on the attention block's output (after its projection, as fairseq)"},
    )
    scale_fc: bool = field(default=False, metadata={"help": "NormFormer: layer norm after the feed-forward activation"})
    scale_heads: bool = field(
        default=False,
        metadata={"help": "NormFormer: a learned scale per attention head of the attention block's output"},
    )
    scale_resids: bool = field(
        default=False, metadata={"help": "NormFormer: a learned per-channel scale of the feed-forward block's residual"}
    )
    adaptive_input: bool = field(
        default=False,
        metadata={"help": "adaptive input embeddings (Baevski & Auli, 2018): narrower tables for rarer tokens"},
    )
    adaptive_input_factor: float = field(
        default=4.0, metadata={"help": "adaptive input: each band's width is the previous one's divided by this"}
    )
    adaptive_input_cutoff: Optional[str] = field(
        default=None, metadata={"help": 'adaptive input: comma-separated vocabulary cutoffs, e.g. "20000,60000"'}
    )
    adaptive_softmax_cutoff: Optional[str] = field(
        default=None,
        metadata={"help": "adaptive softmax: comma-separated vocabulary cutoffs (with --criterion adaptive_loss)"},
    )
    adaptive_softmax_dropout: float = field(
        default=0.0, metadata={"help": "adaptive softmax: dropout in the tail projections"}
    )
    adaptive_softmax_factor: float = field(
        default=4.0, metadata={"help": "adaptive softmax: each tail's width is the previous one's divided by this"}
    )
    tie_adaptive_weights: bool = field(
        default=False, metadata={"help": "tie the adaptive input's and adaptive softmax's embedding tables"}
    )
    tie_adaptive_proj: bool = field(
        default=False, metadata={"help": "also tie their projections (with --tie-adaptive-weights)"}
    )
    character_embeddings: bool = field(
        default=False, metadata={"help": "fairseq's character-CNN token embeddings: not supported (refused)"}
    )
    character_filters: str = field(
        default="[(1, 64), (2, 128), (3, 192), (4, 256), (5, 256), (6, 256), (7, 256)]",
        metadata={"help": "character CNN filters (only with --character-embeddings)"},
    )
    character_embedding_dim: int = field(
        default=4, metadata={"help": "character embedding size (only with --character-embeddings)"}
    )
    char_embedder_highway_layers: int = field(
        default=2, metadata={"help": "character embedder highway layers (only with --character-embeddings)"}
    )
    quant_noise_pq: float = field(
        default=0.0,
        metadata={
            "help": "Quant-Noise for product quantization (Fan et al., 2020): in training, drop each block of "
            "input weights of fc1, fc2 and the adaptive input's projections with this probability, the rest "
            "scaled by 1/(1-p), and add fairseq's dim×dim quant_noise layer on the embeddings; attention is "
            "not noised, as in fairseq (models/quant_noise.py)"
        },
    )
    quant_noise_pq_block_size: int = field(
        default=8,
        metadata={"help": "--quant-noise-pq: input weights dropped together; must divide each noised layer's inputs"},
    )
    quant_noise_scalar: float = field(
        default=0.0,
        metadata={
            "help": "Quant-Noise for int8 (fairseq's quantize_model_scalar): in training each weight of every "
            "linear layer and table that runs, attention's aside, is its int8 value with this probability and "
            "outputs are clamped to their int8 range; evaluation makes all of them int8 values"
        },
    )
    # The Llama family's pieces (Llama 3, Qwen3): each one a field, off by default, so the
    # GPT-style models and their checkpoints are unchanged.
    norm_type: str = field(
        default="layernorm",
        metadata={"help": "the decoder's norms: layernorm, or rmsnorm (Llama, Qwen3)", "choices": NORMS},
    )
    norm_eps: float = field(default=1e-5, metadata={"help": "epsilon of every norm (Llama 1e-5, Qwen3 1e-6)"})
    gated_ffn: bool = field(
        default=False,
        metadata={
            "help": "gated feed-forward, fc2(act(gate(x)) * up(x)): with --activation-fn swish it is SwiGLU (Llama)"
        },
    )
    decoder_kv_heads: Optional[int] = field(
        default=None,
        metadata={
            "help": "key/value heads, fewer than the query heads for grouped-query attention "
            "(default: --decoder-attention-heads)"
        },
    )
    decoder_head_dim: Optional[int] = field(
        default=None,
        metadata={
            "help": "width of each attention head (default: --decoder-embed-dim / --decoder-attention-heads; "
            "Qwen3 sets 128)"
        },
    )
    no_bias: bool = field(default=False, metadata={"help": "no bias in any linear layer or norm (Llama, Qwen3)"})
    qk_norm: bool = field(
        default=False,
        metadata={"help": "an RMSNorm on each head's queries and keys before the rotary embedding (Qwen3)"},
    )
    rope: bool = field(
        default=False,
        metadata={
            "help": "rotary position embeddings on queries and keys (rotating halves, as Llama) instead of "
            "positions added to the embeddings"
        },
    )
    rope_theta: float = field(default=10000.0, metadata={"help": "rotary embeddings' base (Llama 3 500000)"})
    rope_scaling: Optional[str] = field(
        default=None,
        metadata={
            "help": "rotary frequency scaling: llama3 (Llama 3.1's long-context scaling)",
            "choices": ROPE_SCALINGS,
        },
    )
    rope_scaling_factor: float = field(default=8.0, metadata={"help": "llama3 rope scaling: factor"})
    rope_low_freq_factor: float = field(default=1.0, metadata={"help": "llama3 rope scaling: low_freq_factor"})
    rope_high_freq_factor: float = field(default=4.0, metadata={"help": "llama3 rope scaling: high_freq_factor"})
    rope_original_max_positions: int = field(
        default=8192, metadata={"help": "llama3 rope scaling: original_max_position_embeddings"}
    )
    # Mixtures of experts (models/moe.py): Qwen3-MoE's and Mixtral's sparse feed-forward.
    moe_expert_count: int = field(
        default=0,
        metadata={"help": "experts of each mixture-of-experts layer (fairseq's --moe-expert-count; 0: dense)"},
    )
    moe_freq: int = field(
        default=1,
        metadata={
            "help": "with --moe-expert-count, every Nth layer is a mixture of experts, the others dense "
            "(Qwen3-MoE's decoder_sparse_step; fairseq's --moe-freq, which has no default)"
        },
    )
    moe_dense_layers: str = field(
        default="",
        metadata={"help": "comma-separated ids of layers kept dense among them (Qwen3-MoE's mlp_only_layers)"},
    )
    moe_top_k: int = field(default=2, metadata={"help": "experts each token is routed to"})
    moe_ffn_embed_dim: Optional[int] = field(
        default=None, metadata={"help": "each expert's feed-forward width (default: --decoder-ffn-embed-dim)"}
    )
    moe_norm_topk_prob: bool = field(
        default=False,
        metadata={
            "help": "renormalize a token's top-k router probabilities to sum to 1 (Mixtral always; Qwen3-MoE's "
            "norm_topk_prob)"
        },
    )
    moe_aux_loss_coef: float = field(
        default=0.0,
        metadata={
            "help": "weight of the router's load-balancing loss added to the training loss (transformers' "
            "router_aux_loss_coef)",
            "alias": "--moe-gate-loss-wt",
        },
    )
    moe_router_bias_update_rate: float = field(
        default=0.0,
        metadata={
            "help": "auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the router's "
            "probabilities when choosing the top-k (not when weighting), moved by this much after each update "
            "toward the experts that got fewer tokens than the mean; 0: off"
        },
    )
    min_params_to_wrap: int = field(
        default=0,
        metadata={
            "help": "FSDP: a decoder layer with at least this many parameters is its own shard unit "
            "(fairseq's 1e8 left most layers unwrapped; 0 wraps every layer)"
        },
    )


def parse_cutoffs(text):
    """An adaptive cutoff option as fairseq's options.eval_str_list reads it: "20000,60000"
    (or "[20000, 60000]", or one number) → [20000, 60000]. ValueError if it is not that."""
    items = [x.strip() for x in str(text).strip().strip("[]()").split(",")]
    try:
        cutoffs = [int(x) for x in items if x]
    except ValueError:
        raise ValueError("is not a comma-separated list of token ids like 20000,60000") from None
    if not cutoffs or cutoffs[0] <= 0 or any(b <= a for a, b in zip(cutoffs, cutoffs[1:])):
        raise ValueError("must be increasing positive token ids, like 20000,60000")
    return cutoffs


def adaptive_bands(cutoff, vocab_size, dim, factor):
    """The bands of an adaptive input or softmax: [(first id, end id, width)]. The cutoffs
    are extended by the vocabulary size (fairseq's `cutoff + [vocab_size]`, unless the last
    one is that already); band i is `dim // factor**i` wide. The adaptive softmax's head is
    band 0 and its tail i band i+1. ValueError when the cutoffs do not fit the vocabulary."""
    cutoffs = parse_cutoffs(cutoff)
    if cutoffs[-1] > vocab_size:
        raise ValueError(f"reaches past the vocabulary of {vocab_size} tokens")
    if cutoffs[-1] < vocab_size:
        cutoffs.append(vocab_size)
    starts = [0] + cutoffs[:-1]
    return [(start, end, int(dim // factor**i)) for i, (start, end) in enumerate(zip(starts, cutoffs))]


def layers_to_keep(model_cfg):
    """decoder_layers_to_keep as sorted layer ids (fairseq sorts them too), or None when
    unset. ValueError saying why when they are not distinct ids below decoder_layers."""
    text = getattr(model_cfg, "decoder_layers_to_keep", None)  # None in configs saved before it existed
    if text is None or str(text).strip() == "":
        return None
    try:
        ids = sorted(int(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError("is not a comma-separated list of layer ids like 0,2,4") from None
    if len(set(ids)) < len(ids):
        raise ValueError("names a layer twice")
    if ids[0] < 0 or ids[-1] >= model_cfg.decoder_layers:
        raise ValueError(
            f"names a layer outside 0-{model_cfg.decoder_layers - 1} (--decoder-layers {model_cfg.decoder_layers})"
        )
    return ids


def num_layers(model_cfg):
    """The layers the model is built with: decoder_layers, or those it keeps."""
    keep = layers_to_keep(model_cfg)
    return model_cfg.decoder_layers if keep is None else len(keep)


def _gpt3(layers, dim, heads):
    # fairseq's base_gpt3_architecture: learned positions, tied embeddings, gelu, no dropout.
    return dict(
        decoder_layers=layers,
        decoder_embed_dim=dim,
        decoder_ffn_embed_dim=4 * dim,
        decoder_attention_heads=heads,
        decoder_learned_pos=True,
        share_decoder_input_output_embed=True,
        activation_fn="gelu",
        dropout=0.0,
        attention_dropout=0.0,
    )


def _gpt2(layers, dim, ffn, heads):
    # fairseq's transformer_lm_gpt2_*: gelu, dropout 0.1, attention dropout 0.1.
    return dict(
        decoder_layers=layers,
        decoder_embed_dim=dim,
        decoder_ffn_embed_dim=ffn,
        decoder_attention_heads=heads,
        activation_fn="gelu",
        dropout=0.1,
        attention_dropout=0.1,
    )


def moe_layers(model_cfg):
    """The ids of the layers that are mixtures of experts (models/moe.py): every --moe-freq-th
    (Qwen3-MoE's (i + 1) % decoder_sparse_step == 0) but --moe-dense-layers; none without
    experts. A saved config may predate the options: it reads as dense."""
    experts, freq = getattr(model_cfg, "moe_expert_count", 0), getattr(model_cfg, "moe_freq", 1)
    if not experts or not freq:
        return set()
    dense = parse_layer_ids(getattr(model_cfg, "moe_dense_layers", "") or "")
    return {i for i in range(num_layers(model_cfg)) if (i + 1) % freq == 0 and i not in dense}


def parse_layer_ids(text):
    """'0,3' → {0, 3}; ValueError naming the bad part."""
    ids = set()
    for part in str(text).replace(" ", "").split(","):
        if part:
            if not part.isdigit():
                raise ValueError(f"--moe-dense-layers takes comma-separated layer ids, got {part!r}")
            ids.add(int(part))
    return ids


def moe_ffn(model_cfg):
    return getattr(model_cfg, "moe_ffn_embed_dim", None) or model_cfg.decoder_ffn_embed_dim


def head_dim(model_cfg):
    return (
        getattr(model_cfg, "decoder_head_dim", None) or model_cfg.decoder_embed_dim // model_cfg.decoder_attention_heads
    )


def kv_heads(model_cfg):
    return getattr(model_cfg, "decoder_kv_heads", None) or model_cfg.decoder_attention_heads


def _llama(layers, dim, ffn, heads, kv, tied, scaling, head=None, theta=500000.0):
    # Llama 3.x (Meta's published config.json files): RMSNorm, SwiGLU, GQA, RoPE with
    # llama3 scaling, no biases, unscaled embeddings, no dropout.
    return dict(
        decoder_layers=layers,
        decoder_embed_dim=dim,
        decoder_ffn_embed_dim=ffn,
        decoder_attention_heads=heads,
        decoder_kv_heads=kv,
        decoder_head_dim=head or dim // heads,
        norm_type="rmsnorm",
        norm_eps=1e-5,
        gated_ffn=True,
        activation_fn="swish",
        no_bias=True,
        qk_norm=False,
        rope=True,
        rope_theta=theta,
        rope_scaling="llama3",
        rope_scaling_factor=scaling,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_positions=8192,
        no_scale_embedding=True,
        share_decoder_input_output_embed=tied,
        decoder_learned_pos=False,
        no_token_positional_embeddings=True,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )


def _qwen3(layers, dim, ffn, heads, tied):
    # Qwen3 dense models: Llama's pieces with q/k RMSNorm, 128-wide heads, 8 kv heads,
    # rope_theta 1e6 without scaling, RMSNorm eps 1e-6.
    return {
        **_llama(layers, dim, ffn, heads, 8, tied, 1.0, head=128, theta=1000000.0),
        "norm_eps": 1e-6,
        "qk_norm": True,
        "rope_scaling": None,
    }


def _qwen3_moe(layers, dim, heads, experts_ffn, dense_ffn):
    # Qwen3-MoE: Qwen3's attention (4 kv heads), 128 experts a layer, 8 a token, renormalized,
    # every layer sparse; published with router_aux_loss_coef 0.001.
    return {
        **_qwen3(layers, dim, dense_ffn, heads, False),
        "decoder_kv_heads": 4,
        "moe_expert_count": 128,
        "moe_top_k": 8,
        "moe_ffn_embed_dim": experts_ffn,
        "moe_norm_topk_prob": True,
        "moe_aux_loss_coef": 0.001,
    }


def _mixtral(layers, dim, ffn, heads, kv, experts, top_k):
    # Mixtral: Llama's layer (no rope scaling, theta 1e6) with 8 experts a layer, 2 a token.
    return {
        **_llama(layers, dim, ffn, heads, kv, False, 1.0, theta=1000000.0),
        "rope_scaling": None,
        "moe_expert_count": experts,
        "moe_top_k": top_k,
        "moe_norm_topk_prob": True,
        "moe_aux_loss_coef": 0.02,
    }


# The published shapes. Their vocabularies (Llama 3 128256, Qwen3 151936) come with the
# data (`preprocess --tokenizer HF_DIR`) or a Hugging Face model directory.
LLAMA_PRESETS = {
    "llama3_2_1b": _llama(16, 2048, 8192, 32, 8, True, 32.0),
    "llama3_2_3b": _llama(28, 3072, 8192, 24, 8, True, 32.0),
    "llama3_1_8b": _llama(32, 4096, 14336, 32, 8, False, 8.0),
    "llama3_1_70b": _llama(80, 8192, 28672, 64, 8, False, 8.0),
    "llama3_1_405b": _llama(126, 16384, 53248, 128, 8, False, 8.0),
    "qwen3_0_6b": _qwen3(28, 1024, 3072, 16, True),
    "qwen3_1_7b": _qwen3(28, 2048, 6144, 16, True),
    "qwen3_4b": _qwen3(36, 2560, 9728, 32, True),
    "qwen3_8b": _qwen3(36, 4096, 12288, 32, False),
    "qwen3_moe_30b_a3b": _qwen3_moe(48, 2048, 32, 768, 6144),
    "qwen3_moe_235b_a22b": _qwen3_moe(94, 4096, 64, 1536, 12288),
    "mixtral_8x7b": _mixtral(32, 4096, 14336, 32, 8, 8, 2),
}
# Their tokenizers' vocabularies (the embedding rows of the published checkpoints), for what
# needs one before there is data: `plan --arch llama3_1_8b` without DATA.
PUBLISHED_VOCABS = {
    name: 128256 if name.startswith("llama3") else 32000 if name.startswith("mixtral") else 151936
    for name in LLAMA_PRESETS
}


# transformer_lm_baevski_wiki103 and _gbw, each followed by transformer_lm_big, whose
# getattr defaults leave the keys already set (16 layers and 8 heads stay).
_BIG = dict(decoder_layers=12, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096, decoder_attention_heads=16)
WIKI103 = {
    **_BIG,
    **dict(
        decoder_layers=16,
        decoder_attention_heads=8,
        dropout=0.3,
        adaptive_input=True,
        tie_adaptive_weights=True,
        adaptive_input_cutoff="20000,60000",
        adaptive_softmax_cutoff="20000,60000",
        adaptive_softmax_dropout=0.2,
        attention_dropout=0.1,
        activation_dropout=0.1,
        no_decoder_final_norm=True,
        tie_adaptive_proj=True,
    ),
}
GBW = {**_BIG, **dict(decoder_embed_dim=512, dropout=0.1, attention_dropout=0.1, no_decoder_final_norm=True)}

# fairseq/models/transformer_lm.py architectures: only the keys each one sets.
# Selecting a preset sets these keys; every other key keeps its current value.
PRESETS = {
    "transformer_lm": dict(
        decoder_layers=6,
        decoder_embed_dim=512,
        decoder_ffn_embed_dim=2048,
        decoder_attention_heads=8,
        activation_fn="relu",
    ),
    "transformer_lm_big": dict(
        decoder_layers=12, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096, decoder_attention_heads=16
    ),
    "transformer_lm_wiki103": WIKI103,  # Baevski & Auli (2018): adaptive input + softmax, tied
    "transformer_lm_baevski_wiki103": WIKI103,
    "transformer_lm_gbw": GBW,
    "transformer_lm_baevski_gbw": GBW,
    "transformer_lm_gpt": _gpt2(12, 768, 3072, 12),
    "transformer_lm_gpt2_tiny": _gpt2(2, 64, 64, 1),
    "transformer_lm_gpt2_small": _gpt2(24, 1024, 4096, 16),
    "transformer_lm_gpt2_medium": _gpt2(36, 1280, 5120, 20),
    "transformer_lm_gpt2_big": _gpt2(48, 1600, 6400, 25),
    "transformer_lm_gpt3_small": _gpt3(12, 768, 12),
    "transformer_lm_gpt3_medium": _gpt3(24, 1024, 16),
    "transformer_lm_gpt3_large": _gpt3(24, 1536, 16),
    "transformer_lm_gpt3_xl": _gpt3(24, 2048, 32),
    "transformer_lm_gpt3_2_7": _gpt3(32, 2560, 32),
    "transformer_lm_gpt3_6_7": _gpt3(32, 4096, 32),
    "transformer_lm_gpt3_13": _gpt3(40, 5120, 40),
    "transformer_lm_gpt3_175": _gpt3(96, 12288, 96),
    **LLAMA_PRESETS,
}
