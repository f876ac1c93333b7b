"""fairseq's language models (fairseq-train's `transformer_lm*` checkpoints) in our terms:
their model config as our fields, and which of their tensors make each of our parameters.
Torch-free: `train` composes its config from a checkpoint's before torch is imported.

Our model was written with fairseq's names, so most tensors are theirs without the
`decoder.` prefix. Three differ: our qkv_proj is their q_proj, k_proj and v_proj stacked by
rows (or, before fairseq 0.9, their fused in_proj); our out_proj is their self_attn.out_proj;
their adaptive softmax keeps its projections in Sequential slots (tail.{i}.0 and .2). Every
mapping stacks whole tensors by rows, so a row slice of ours is row slices of theirs.
"""

from dataclasses import fields

from models.config import ACTIVATIONS, PRESETS, TransformerLMConfig, layers_to_keep

PADDING_IDX = 1  # fairseq's Dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3


class FairseqConfigError(ValueError):
    """The checkpoint's model is one we cannot build exactly; the message names the feature."""


# fairseq's keys that are ours under the same name and meaning (everything but _name).
OUR_KEYS = {f.name for f in fields(TransformerLMConfig)} - {"_name"}
# Training-time choices: the checkpoint's values are defaults a flag may change. How the run
# is sharded and checkpointed (min_params_to_wrap, checkpoint_activations, ...) stays ours.
TRAINING_KEYS = (
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "decoder_layerdrop",
    "quant_noise_pq",
    "quant_noise_pq_block_size",
    "quant_noise_scalar",
)
_RUN_KEYS = ("min_params_to_wrap", "checkpoint_activations", "offload_activations")
# fairseq's base_lm_architecture defaults, for checkpoints whose `args` predate a key
# (fairseq fills them the same way when it loads one). `decoder_normalize_before` is forced
# on there ("Model training is not stable without this"), for every arch of that era.
_BASE_LM = dict(
    decoder_embed_dim=512,
    decoder_ffn_embed_dim=2048,
    decoder_layers=6,
    decoder_attention_heads=8,
    activation_fn="relu",
    dropout=0.1,
    attention_dropout=0.0,
    activation_dropout=0.0,
    decoder_layerdrop=0.0,
    decoder_learned_pos=False,
    no_token_positional_embeddings=False,
    share_decoder_input_output_embed=False,
    character_embeddings=False,
    no_decoder_final_norm=False,
    adaptive_input=False,
    adaptive_input_factor=4.0,
    adaptive_input_cutoff=None,
    adaptive_softmax_cutoff=None,
    adaptive_softmax_dropout=0.0,
    adaptive_softmax_factor=4.0,
    tie_adaptive_weights=False,
    tie_adaptive_proj=False,
    no_scale_embedding=False,
    layernorm_embedding=False,
)
# fairseq features shardlm does not build: key → (value that is off, what it is).
_UNSUPPORTED = {
    "character_embeddings": (False, "character-CNN input embeddings (--character-embeddings)"),
    "base_layers": (0, "BASE layers (--base-layers)"),
    "decoder_xformers_att_config": (None, "xFormers attention (--decoder-xformers-att-config)"),
    "moe_freq": (0, "mixture-of-experts layers (--moe-freq)"),
    "alibi": (False, "ALiBi attention biases"),
    "cross_self_attention": (False, "cross+self attention (--cross-self-attention)"),
}


# NormFormer's flags and the tensor each makes in every layer. fairseq's transformer_lm
# config holds them, but its TransformerDecoderLayerBase reads them from a TransformerConfig,
# which has no such fields: TransformerConfig.from_namespace copies unknown keys from
# vars(cfg), and of the DictConfig that fairseq-train and fairseq-eval-lm pass that is
# omegaconf's internals, not its keys. So fairseq 0.12.2 (and its main branch) trains and
# scores a transformer_lm without them; the tensors say what the writer built.
NORMFORMER_TENSORS = {
    "scale_attn": "attn_ln.weight",
    "scale_fc": "ffn_layernorm.weight",
    "scale_heads": "c_attn",
    "scale_resids": "w_resid",
}


def normformer_not_built(model, names):
    """The NormFormer flags `model` (a checkpoint's config) sets whose tensors no layer of the
    checkpoint holds (`names`: its tensor names): the fairseq that wrote it did not apply them."""
    suffixes = {name.split(".", 3)[-1] for name in names if name.startswith("decoder.layers.")}
    return [flag for flag, tensor in NORMFORMER_TENSORS.items() if model.get(flag) and tensor not in suffixes]


def fairseq_model_config(state):
    """(arch, model options dict, task options dict) of a loaded fairseq checkpoint: its
    `cfg` (fairseq >= 0.10's dataclass config, saved as plain dicts) or its older `args`
    (an argparse.Namespace), whose missing keys take the arch's and base_lm_architecture's
    defaults as fairseq would fill them."""
    cfg = state.get("cfg")
    if isinstance(cfg, dict) and isinstance(cfg.get("model"), dict):
        model, task = dict(cfg["model"]), dict(cfg.get("task") or {})
        arch = model.get("_name") or model.get("arch")
        return arch, model, task
    args = state.get("args")
    if args is None:
        raise FairseqConfigError("it has neither `cfg` nor `args`: not a checkpoint written by fairseq-train")
    args = dict(vars(args))
    arch = args.get("arch")
    legacy = {**_BASE_LM, **PRESETS.get(arch, {}), **args}
    # base_lm_architecture's upgrades of older keys
    if "no_tie_adaptive_proj" in args:
        legacy["no_decoder_final_norm"] = True
        if args["no_tie_adaptive_proj"] is False:
            legacy["tie_adaptive_proj"] = True
    if "decoder_final_norm" in args:
        legacy["no_decoder_final_norm"] = not args["decoder_final_norm"]
    legacy.setdefault("decoder_input_dim", legacy["decoder_embed_dim"])
    legacy.setdefault("decoder_output_dim", legacy["decoder_embed_dim"])
    legacy["decoder_normalize_before"] = True
    return arch, legacy, legacy


def model_from_fairseq(arch, model):
    """fairseq's model options → (our fixed fields, our training-time defaults).
    FairseqConfigError naming the first feature we cannot build."""
    if not str(arch or "").startswith("transformer_lm"):
        raise FairseqConfigError(
            f"arch {arch!r} is not a fairseq transformer language model (transformer_lm, "
            "transformer_lm_gpt, ...): only those are supported"
        )
    for key, (off, what) in _UNSUPPORTED.items():
        if model.get(key, off) not in (off, None, 0, False, ""):
            raise FairseqConfigError(f"{what} is not supported by shardlm ({key}={model[key]!r})")
    if model.get("activation_fn", "relu") not in ACTIVATIONS:
        raise FairseqConfigError(f"activation_fn {model['activation_fn']!r} is not supported")
    fixed = {k: v for k, v in model.items() if k in OUR_KEYS and k not in TRAINING_KEYS and k not in _RUN_KEYS}
    fixed["decoder_input_dim"] = model.get("decoder_input_dim") or model["decoder_embed_dim"]
    fixed["decoder_output_dim"] = model.get("decoder_output_dim") or model["decoder_embed_dim"]
    # fairseq counts positions from padding_idx + 1 (make_positions), in both kinds of table.
    fixed["positions_offset"] = PADDING_IDX + 1
    # fairseq's dataclass keys that can be None where ours take a number
    for key in ("adaptive_softmax_dropout", "adaptive_input_factor", "adaptive_softmax_factor"):
        if fixed.get(key) is None:
            fixed.pop(key, None)
    training = {k: model[k] for k in TRAINING_KEYS if model.get(k) is not None}
    if "relu_dropout" in model and not model.get("activation_dropout"):
        training["activation_dropout"] = model["relu_dropout"]  # its older name
    return fixed, training


def _layer_id(model_cfg, i):
    """Which of the checkpoint's layers our layer i is (--decoder-layers-to-keep prunes)."""
    keep = layers_to_keep(model_cfg)
    return i if keep is None else keep[i]


_SOFTMAX = {"head.class_proj": "head.class_proj", "proj": "0", "words": "2"}


def fairseq_parts(name, model_cfg, names):
    """The checkpoint tensors that make our parameter `name`, stacked by rows in this order;
    `names`: the checkpoint's tensor names (the layout differs across fairseq versions)."""
    parts = name.split(".")
    if parts[0] == "layers":
        i, rest = _layer_id(model_cfg, int(parts[1])), ".".join(parts[2:])
        prefix = f"decoder.layers.{i}."
        if rest.startswith("qkv_proj."):
            kind = rest.split(".")[1]
            fused = f"{prefix}self_attn.in_proj_{kind}"
            if fused in names:  # fairseq < 0.9
                return [fused]
            return [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
        if rest.startswith("out_proj."):
            return [f"{prefix}self_attn.{rest}"]
        return [prefix + rest]
    if parts[0] == "adaptive_softmax":
        if parts[1] == "class_proj":
            return ["decoder.adaptive_softmax.head.class_proj.weight"]
        if parts[1] == "tail":
            return [f"decoder.adaptive_softmax.tail.{parts[2]}.{_SOFTMAX[parts[3]]}.weight"]
    if name == "output_projection.weight" and "decoder.output_projection.weight" not in names:
        return ["decoder.embed_out"]  # fairseq < 0.10
    return ["decoder." + name]


def is_buffer(name):
    """fairseq's state dict keys that are buffers, not parameters (no optimizer state)."""
    return name.endswith(".version") or name.endswith("._float_tensor")
