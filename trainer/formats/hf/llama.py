"""Hugging Face's Llama-family models (LlamaForCausalLM, Qwen3ForCausalLM) in our terms:
their config.json as our model fields and back, and which of their tensors make each of our
parameters. Torch-free: `train` reads a model directory's config before torch is imported.

Our layer fuses what they keep apart: qkv_proj is q_proj, k_proj and v_proj stacked by rows,
fc1 is gate_proj and up_proj stacked by rows. Every other tensor is theirs under another
name, in the same [out, in] orientation, so a slice of rows of ours is a slice of rows of
one or more of theirs: a sharded rank reads only its rows (trainer/formats/hf/weights.py),
and an export writes each HF tensor as a row range of one of ours, one of ours held at a time.
"""

import json

from models.config import head_dim, kv_heads, moe_ffn, num_layers, parse_layer_ids
from trainer.errors import UsageError

DESCRIBED = "a Llama-family model"  # for export-model's refusal

# model_type → the class transformers builds from it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

# transformers' hidden_act → our --activation-fn (silu is fairseq's swish).
_ACTIVATIONS = {"silu": "swish", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_accurate", "relu": "relu"}


class HFConfigError(ValueError):
    """config.json describes a model we cannot build; the message says which key and why."""


def _rope_settings(config):
    """rope_theta and the scaling, from transformers' current `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling` (both kinds of config.json are published)."""
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rope_theta=float(theta), rope_scaling=None)
    if kind != "llama3":
        raise HFConfigError(f"rope scaling {kind!r} is not supported (default and llama3 are)")
    return dict(
        rope_theta=float(theta),
        rope_scaling="llama3",
        rope_scaling_factor=float(params["factor"]),
        rope_low_freq_factor=float(params["low_freq_factor"]),
        rope_high_freq_factor=float(params["high_freq_factor"]),
        rope_original_max_positions=int(params["original_max_position_embeddings"]),
    )


def model_from_hf_config(config):
    """config.json (a dict) → (our model fields, vocab_size, max_positions). HFConfigError
    naming the key when the model is not one we can build exactly."""
    model_type = config.get("model_type")
    act = config.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise HFConfigError(f"hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)} are)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise HFConfigError("attention_bias/mlp_bias true: biased Llama layers are not supported")
    if config.get("pretraining_tp", 1) != 1:
        raise HFConfigError(f"pretraining_tp {config['pretraining_tp']}: only 1 is supported")
    if model_type in ("qwen3", "qwen3_moe") and config.get("use_sliding_window"):
        raise HFConfigError("use_sliding_window true: sliding-window attention is not supported")
    if model_type == "mixtral" and config.get("sliding_window"):
        raise HFConfigError("sliding_window set: sliding-window attention is not supported")
    if config.get("router_jitter_noise"):
        raise HFConfigError("router_jitter_noise > 0: jittered routing is not supported")
    heads = config["num_attention_heads"]
    fields = dict(
        decoder_layers=config["num_hidden_layers"],
        decoder_embed_dim=config["hidden_size"],
        decoder_ffn_embed_dim=config["intermediate_size"],
        decoder_attention_heads=heads,
        decoder_kv_heads=config.get("num_key_value_heads") or heads,
        decoder_head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        norm_type="rmsnorm",
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        gated_ffn=True,
        activation_fn=_ACTIVATIONS[act],
        no_bias=True,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope=True,
        **_rope_settings(config),
        no_scale_embedding=True,
        share_decoder_input_output_embed=bool(config.get("tie_word_embeddings", False)),
        decoder_learned_pos=False,
        no_token_positional_embeddings=True,
        decoder_normalize_before=True,
        no_decoder_final_norm=False,
        layernorm_embedding=False,
        attention_dropout=float(config.get("attention_dropout", 0.0)),
        **_moe_fields(model_type, config),
    )
    return fields, config["vocab_size"], config.get("max_position_embeddings", 2048)


def _moe_fields(model_type, config):
    """Qwen3-MoE's and Mixtral's experts as our --moe-* fields; {} for a dense model."""
    if model_type == "qwen3_moe":
        return dict(
            # the published configs' num_experts; transformers 5 writes num_local_experts
            moe_expert_count=config["num_experts"] if "num_experts" in config else config["num_local_experts"],
            moe_top_k=config["num_experts_per_tok"],
            moe_ffn_embed_dim=config["moe_intermediate_size"],
            moe_norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            moe_freq=config.get("decoder_sparse_step", 1),
            moe_dense_layers=",".join(str(i) for i in config.get("mlp_only_layers") or []),
            moe_aux_loss_coef=_aux_loss_coef(config),
        )
    if model_type == "mixtral":  # every layer sparse, its experts intermediate_size wide
        return dict(
            moe_expert_count=config["num_local_experts"],
            moe_top_k=config["num_experts_per_tok"],
            moe_ffn_embed_dim=config["intermediate_size"],
            moe_norm_topk_prob=True,
            moe_freq=1,
            moe_dense_layers="",
            moe_aux_loss_coef=_aux_loss_coef(config),
        )
    return {}


def _aux_loss_coef(config):
    """The model's router_aux_loss_coef, which TRL's trainers add whatever output_router_logits
    says (transformers' own loss adds it only with output_router_logits, off in the published
    configs): --moe-aux-loss-coef 0 trains without it."""
    return float(config.get("router_aux_loss_coef", 0.001))


def _aux_loss_keys(model_cfg):
    coef = model_cfg.moe_aux_loss_coef
    return dict(router_aux_loss_coef=coef or 0.001, output_router_logits=coef > 0)


def llama_incompatibility(model_cfg):
    """Why `model_cfg` is not a Llama or Qwen3 model transformers can build, or None."""
    if getattr(model_cfg, "norm_type", "layernorm") != "rmsnorm":
        return "its norms are LayerNorm (--norm-type rmsnorm is the Llama family's)"
    if not getattr(model_cfg, "rope", False):
        return "it has no rotary embeddings (--rope)"
    if not getattr(model_cfg, "gated_ffn", False):
        return "its feed-forward is not gated (--gated-ffn)"
    if not getattr(model_cfg, "no_bias", False):
        return "its layers have biases (--no-bias)"
    if model_cfg.activation_fn not in {ours: theirs for theirs, ours in _ACTIVATIONS.items()}:
        return f"activation {model_cfg.activation_fn!r} has no transformers name"
    if not model_cfg.no_scale_embedding:
        return "it scales token embeddings by sqrt(d) (--no-scale-embedding is Llama's)"
    if not model_cfg.decoder_normalize_before or model_cfg.no_decoder_final_norm or model_cfg.layernorm_embedding:
        return "its norms are not placed as Llama's (pre-norm, a final norm, none after the embeddings)"
    if any(getattr(model_cfg, k, False) for k in ("scale_attn", "scale_fc", "scale_heads", "scale_resids")):
        return "it has NormFormer's scales"
    if getattr(model_cfg, "adaptive_input", False) or getattr(model_cfg, "adaptive_softmax_cutoff", None):
        return "it has adaptive input/softmax bands"
    if getattr(model_cfg, "moe_router_bias_update_rate", 0) > 0:
        return "its routers have balancing biases (--moe-router-bias-update-rate), which Qwen3-MoE and Mixtral lack"
    if getattr(model_cfg, "quant_noise_pq", 0):
        return "it has fairseq's quant_noise layer on the embeddings (--quant-noise-pq)"
    if getattr(model_cfg, "quant_noise_scalar", 0):
        return "its evaluation makes weights and outputs int8 values (--quant-noise-scalar)"
    if any(
        getattr(model_cfg, k, None) not in (None, model_cfg.decoder_embed_dim)
        for k in ("decoder_input_dim", "decoder_output_dim")
    ):
        return "its embeddings or output are of another width than the layers"
    return None


incompatibility = llama_incompatibility  # the name every family module answers to


def hf_model_type(model_cfg):
    qk_norm = getattr(model_cfg, "qk_norm", False)
    if getattr(model_cfg, "moe_expert_count", 0):
        return "qwen3_moe" if qk_norm else "mixtral"
    return "qwen3" if qk_norm else "llama"


def hf_config(
    model_cfg, vocab_size, max_positions, bos_token_id=None, eos_token_id=None, pad_token_id=None, dtype="float32"
):
    """config.json for LlamaForCausalLM or Qwen3ForCausalLM (Qwen3 when --qk-norm)."""
    why = llama_incompatibility(model_cfg)
    if why:
        raise HFConfigError(f"not a Llama-family model: {why}")
    model_type = hf_model_type(model_cfg)
    rope = {"rope_type": "default", "rope_theta": model_cfg.rope_theta}
    if model_cfg.rope_scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=model_cfg.rope_scaling_factor,
            low_freq_factor=model_cfg.rope_low_freq_factor,
            high_freq_factor=model_cfg.rope_high_freq_factor,
            original_max_position_embeddings=model_cfg.rope_original_max_positions,
        )
    act = {ours: theirs for theirs, ours in _ACTIVATIONS.items()}[model_cfg.activation_fn]
    config = {
        "model_type": model_type,
        "architectures": [ARCHITECTURES[model_type]],
        "vocab_size": vocab_size,
        "hidden_size": model_cfg.decoder_embed_dim,
        "intermediate_size": model_cfg.decoder_ffn_embed_dim,
        "num_hidden_layers": num_layers(model_cfg),
        "num_attention_heads": model_cfg.decoder_attention_heads,
        "num_key_value_heads": kv_heads(model_cfg),
        "head_dim": head_dim(model_cfg),
        "hidden_act": act,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": model_cfg.norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, releases before it rope_theta/rope_scaling.
        "rope_parameters": rope,
        "rope_theta": model_cfg.rope_theta,
        "rope_scaling": None
        if rope["rope_type"] == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(model_cfg.share_decoder_input_output_embed),
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": dtype,
    }
    if model_type == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    elif model_type == "mixtral":
        config.update(_mixtral_keys(model_cfg))
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers(model_cfg))
    if model_type == "qwen3_moe":
        config.update(
            num_experts=model_cfg.moe_expert_count,
            num_experts_per_tok=model_cfg.moe_top_k,
            moe_intermediate_size=moe_ffn(model_cfg),
            norm_topk_prob=bool(model_cfg.moe_norm_topk_prob),
            decoder_sparse_step=model_cfg.moe_freq,
            mlp_only_layers=sorted(parse_layer_ids(model_cfg.moe_dense_layers)),
            **_aux_loss_keys(model_cfg),
        )
    return config


def _mixtral_keys(model_cfg):
    """Mixtral's own keys: its experts are intermediate_size wide, every layer sparse,
    renormalized; what it cannot say is refused."""
    if model_cfg.moe_freq != 1 or parse_layer_ids(model_cfg.moe_dense_layers) or not model_cfg.moe_norm_topk_prob:
        raise HFConfigError(
            "Mixtral's layers are all sparse with renormalized top-k weights: --moe-freq 1, no --moe-dense-layers, "
            "--moe-norm-topk-prob (or --qk-norm: a Qwen3-MoE)"
        )
    return dict(
        intermediate_size=moe_ffn(model_cfg),
        num_local_experts=model_cfg.moe_expert_count,
        num_experts_per_tok=model_cfg.moe_top_k,
        router_jitter_noise=0.0,
        **_aux_loss_keys(model_cfg),
        sliding_window=None,
    )


def hf_parts(name, model_cfg):
    """Our parameter `name` as HF tensors stacked by rows: [(hf name, rows)], in order."""
    dim, ffn = model_cfg.decoder_embed_dim, model_cfg.decoder_ffn_embed_dim
    H, KV, D = model_cfg.decoder_attention_heads, kv_heads(model_cfg), head_dim(model_cfg)
    if name == "embed_tokens.weight":
        return [("model.embed_tokens.weight", None)]
    if name == "output_projection.weight":
        return [("lm_head.weight", None)]
    if name == "layer_norm.weight":
        return [("model.norm.weight", None)]
    prefix, _, rest = name.partition(".")
    layer, _, local = rest.partition(".")
    if prefix != "layers" or not layer.isdigit():
        raise KeyError(name)
    hf = f"model.layers.{layer}."
    parts = {
        "self_attn_layer_norm.weight": [(hf + "input_layernorm.weight", dim)],
        "qkv_proj.weight": [
            (hf + "self_attn.q_proj.weight", H * D),
            (hf + "self_attn.k_proj.weight", KV * D),
            (hf + "self_attn.v_proj.weight", KV * D),
        ],
        "q_norm.weight": [(hf + "self_attn.q_norm.weight", D)],
        "k_norm.weight": [(hf + "self_attn.k_norm.weight", D)],
        "out_proj.weight": [(hf + "self_attn.o_proj.weight", dim)],
        "final_layer_norm.weight": [(hf + "post_attention_layernorm.weight", dim)],
        "fc1.weight": [(hf + "mlp.gate_proj.weight", ffn), (hf + "mlp.up_proj.weight", ffn)],
        "fc2.weight": [(hf + "mlp.down_proj.weight", dim)],
        **_expert_parts(hf, model_cfg),
    }
    if local not in parts:
        raise KeyError(name)
    return parts[local]


def _expert_parts(hf, model_cfg):
    """A sparse layer's router and experts (models/moe.py: moe.experts.fc1 stacks each expert's
    gate and up rows, moe.experts.fc2 each expert's down projection) as Qwen3-MoE's or Mixtral's tensors."""
    E = getattr(model_cfg, "moe_expert_count", 0)
    if not E:
        return {}
    F, dim = moe_ffn(model_cfg), model_cfg.decoder_embed_dim
    if hf_model_type(model_cfg) == "mixtral":
        block, gate, up, down = hf + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        block, gate, up, down = hf + "mlp.", "gate_proj", "up_proj", "down_proj"
    experts = [f"{block}experts.{e}." for e in range(E)]
    return {
        "moe.router.weight": [(block + "gate.weight", E)],
        "moe.experts.fc1": [(e + f"{name}.weight", F) for e in experts for name in (gate, up)],
        "moe.experts.fc2": [(e + f"{down}.weight", dim) for e in experts],
    }


def transposed(hf_name):
    """Llama's tensors are all [out, in], as ours: none is stored transposed."""
    return False


def row_slices(parts, start, stop):
    """Rows start…stop-1 of the stacked tensor as [(hf name, first row, end row)] of the parts
    they fall in (a part of None rows is the whole tensor)."""
    if len(parts) == 1:
        return [(parts[0][0], start, stop)]
    out, offset = [], 0
    for hf_name, rows in parts:
        lo, hi = max(start, offset), min(stop, offset + rows)
        if lo < hi:
            out.append((hf_name, lo - offset, hi - offset))
        offset += rows
    return out


HF_METADATA = {"format": "pt"}  # transformers checks it before loading a safetensors file


def hf_tensor_sources(our_specs, model_cfg):
    """our_specs [(our name, shape)] → [(hf name, hf shape, our name, first row, end row)],
    in our order. A tied output has no tensor of its own, so no lm_head is written for it."""
    sources = []
    for name, shape in our_specs:
        try:
            parts = hf_parts(name, model_cfg)
        except KeyError:
            raise UsageError(
                f"cannot export as a Hugging Face Llama model: it has a tensor {name} "
                "that Llama's layers have no place for"
            ) from None
        shape, start = tuple(shape), 0
        for hf_name, rows in parts:
            rows = shape[0] if rows is None else rows
            sources.append((hf_name, (rows, *shape[1:]), name, start, start + rows))
            start += rows
        if start != shape[0]:  # a config that does not describe the checkpoint's tensors
            raise UsageError(
                f"{name} has {shape[0]} rows, its config.yaml implies {start}; the checkpoint and its config disagree"
            )
    return sources


def write_hf_llama(
    out_dir,
    get_ours,
    our_specs,
    model_cfg,
    vocab_size,
    max_positions,
    dtype,
    max_shard_size=None,
    **token_ids,
):
    """A directory AutoModelForCausalLM loads: config.json + model.safetensors or shards and
    their index. `get_ours(name)` returns one of our parameters, whole, on the CPU;
    token_ids: bos_token_id, eos_token_id, pad_token_id."""
    # torch, which reading config.json does without
    from trainer.formats.hf.shards import DEFAULT_MAX_SHARD_SIZE, write_hf_weights

    sources = hf_tensor_sources(our_specs, model_cfg)
    config = hf_config(model_cfg, vocab_size, max_positions, dtype=str(dtype).removeprefix("torch."), **token_ids)
    by_name = {hf_name: (ours, lo, hi) for hf_name, _, ours, lo, hi in sources}
    held = {}  # the one tensor of ours whose parts are being written

    def get_tensor(hf_name):
        ours, lo, hi = by_name[hf_name]
        if ours not in held:
            held.clear()
            held[ours] = get_ours(ours)
        return held[ours][lo:hi].to(dtype).contiguous()

    write_hf_weights(
        out_dir,
        [(hf_name, shape, dtype) for hf_name, shape, *_ in sources],
        get_tensor,
        max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        HF_METADATA,
    )
    held.clear()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_hf(out_dir, get_ours, our_specs, model_cfg, vocab_size, max_positions, dtype, saved_dtype, **kw):
    """export-model's face of every family: the saved dtype unless --dtype says otherwise."""
    write_hf_llama(out_dir, get_ours, our_specs, model_cfg, vocab_size, max_positions, dtype or saved_dtype, **kw)
