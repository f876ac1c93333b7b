"""Hugging Face's GPT-2 (GPT2LMHeadModel) in our terms, both ways: config.json as our model
fields and back, and which of its tensors make each of our parameters. Torch-free but for
writing tensors: `train` reads a model directory's config before torch is imported.

A pre-LN TransformerLM with a final norm is GPT-2 up to renaming, with three twists:
- HF's Conv1D stores weights as [in, out], the transpose of our nn.Linear's [out, in];
- we scale token embeddings by sqrt(d) on input only, so wte = scale·E and, when the
  output is tied to E, lm_head = E becomes a separate tensor (tie_word_embeddings=False);
- sinusoidal positions are not parameters here; HF gets them as a fixed wpe table
  (and zeros when the model has no positions at all, which adds nothing either).
Every tensor is built alone from our full parameters, so an export streams one at a time.
Read back, a GPT-2 directory is a pre-LN model with learned positions counted from 0 and
unscaled embeddings (what wte holds is what the layers get), so a directory written here
and one written by transformers load alike.
"""

import json
import math
import os
import re
from pathlib import Path

from models.config import head_dim, kv_heads, num_layers
from trainer.errors import UsageError
from trainer.formats.hf.llama import HFConfigError

# F.gelu is the exact erf form: HF's "gelu"; its tanh approximation (fairseq's
# gelu_accurate, once gelu_fast) is HF's "gelu_new", GPT-2's own.
HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_accurate": "gelu_new", "gelu_fast": "gelu_new"}
# transformers' activation_function → ours, read back: GPT-2's own gelu_new is the tanh
# form, fairseq's gelu_accurate.
_READ_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_accurate", "gelu_pytorch_tanh": "gelu_accurate", "relu": "relu"}

# transformers checks the "format" metadata of model.safetensors before loading it.
HF_METADATA = {"format": "pt"}
DESCRIBED = "a GPT-2 one"  # for export-model's refusal, after the Llama family's

# HF name inside transformer.h.{i} → (our name inside layers.{i}, stored transposed).
_LAYER_TENSORS = {
    "ln_1.weight": ("self_attn_layer_norm.weight", False),
    "ln_1.bias": ("self_attn_layer_norm.bias", False),
    "attn.c_attn.weight": ("qkv_proj.weight", True),  # q, k, v blocks of d columns: same split
    "attn.c_attn.bias": ("qkv_proj.bias", False),
    "attn.c_proj.weight": ("out_proj.weight", True),
    "attn.c_proj.bias": ("out_proj.bias", False),
    "ln_2.weight": ("final_layer_norm.weight", False),
    "ln_2.bias": ("final_layer_norm.bias", False),
    "mlp.c_fc.weight": ("fc1.weight", True),
    "mlp.c_fc.bias": ("fc1.bias", False),
    "mlp.c_proj.weight": ("fc2.weight", True),
    "mlp.c_proj.bias": ("fc2.bias", False),
}


def check_hf_compatible(model_cfg):
    """Raise UsageError naming the first option GPT-2 cannot express."""
    why = gpt2_incompatibility(model_cfg)
    if why:
        raise UsageError(f"cannot export as a HuggingFace GPT-2 model: {why}")


def gpt2_incompatibility(model_cfg):
    """Why `model_cfg` is not a GPT-2 model, or None."""
    why = None
    if getattr(model_cfg, "norm_type", "layernorm") != "layernorm":
        why = f"{model_cfg.norm_type} norms; GPT-2's are LayerNorm"
    elif getattr(model_cfg, "no_bias", False):
        why = "layers without biases (no_bias); GPT-2's have them"
    elif getattr(model_cfg, "gated_ffn", False):
        why = "a gated feed-forward (gated_ffn); GPT-2's is not gated"
    elif getattr(model_cfg, "rope", False):
        why = "rotary embeddings (rope); GPT-2 adds positions to the embeddings"
    elif getattr(model_cfg, "qk_norm", False):
        why = "norms on queries and keys (qk_norm); GPT-2 has none"
    elif kv_heads(model_cfg) != model_cfg.decoder_attention_heads or (
        head_dim(model_cfg) * model_cfg.decoder_attention_heads != model_cfg.decoder_embed_dim
    ):
        why = "grouped-query attention or heads of another width (decoder_kv_heads/decoder_head_dim)"
    elif getattr(model_cfg, "quant_noise_pq", 0):
        why = "fairseq's quant_noise layer on the embeddings (quant_noise_pq); GPT-2 has none"
    elif getattr(model_cfg, "quant_noise_scalar", 0):
        why = "int8 weights and outputs in evaluation (quant_noise_scalar); GPT-2 computes in floats"
    elif getattr(model_cfg, "adaptive_input", False) or getattr(model_cfg, "adaptive_softmax_cutoff", None) is not None:
        why = "adaptive input/softmax bands; GPT-2 has one full embedding table and output projection"
    elif not model_cfg.decoder_normalize_before:
        why = "post-norm layers (decoder_normalize_before=False); GPT-2 normalizes before each sublayer"
    elif model_cfg.no_decoder_final_norm:
        why = "no final layer norm (no_decoder_final_norm); GPT-2 always applies ln_f"
    elif model_cfg.layernorm_embedding:
        why = "a layer norm after the embeddings (layernorm_embedding); GPT-2 has none"
    elif model_cfg.activation_fn not in HF_ACTIVATIONS:
        why = f"activation {model_cfg.activation_fn!r} has no GPT-2 equivalent"
    elif model_cfg.decoder_embed_dim % model_cfg.decoder_attention_heads:
        why = "decoder_embed_dim is not a multiple of decoder_attention_heads"
    elif any(getattr(model_cfg, key, False) for key in ("scale_attn", "scale_fc", "scale_heads", "scale_resids")):
        why = "NormFormer's extra norms and scales (scale_attn/fc/heads/resids); GPT-2 has none"
    elif any(
        getattr(model_cfg, key, None) not in (None, model_cfg.decoder_embed_dim)
        for key in ("decoder_input_dim", "decoder_output_dim")
    ):
        why = "embeddings or output of another width than the layers (decoder_input_dim/decoder_output_dim)"
    return why


incompatibility = gpt2_incompatibility  # the name every family module answers to


def _embed_scale(model_cfg):
    return 1.0 if model_cfg.no_scale_embedding else math.sqrt(model_cfg.decoder_embed_dim)


def _tied(model_cfg):
    # HF ties lm_head to wte; ours is tied to the unscaled table, so a scale unties it.
    return model_cfg.share_decoder_input_output_embed and _embed_scale(model_cfg) == 1.0


def hf_config(
    model_cfg, vocab_size, max_positions, bos_token_id=None, eos_token_id=None, pad_token_id=None, dtype=None
):
    """config.json for GPT2LMHeadModel, dropouts off (export is for inference)."""
    check_hf_compatible(model_cfg)
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": vocab_size,
        "n_positions": max_positions,
        "n_ctx": max_positions,
        "n_embd": model_cfg.decoder_embed_dim,
        "n_layer": num_layers(model_cfg),
        "n_head": model_cfg.decoder_attention_heads,
        "n_inner": model_cfg.decoder_ffn_embed_dim,
        "activation_function": HF_ACTIVATIONS[model_cfg.activation_fn],
        "layer_norm_epsilon": getattr(model_cfg, "norm_eps", 1e-5),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "scale_attn_weights": True,  # 1/sqrt(head_dim), as scaled_dot_product_attention does
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": _tied(model_cfg),
        "use_cache": True,
        # Written even when None: GPT2Config would otherwise default both to GPT-2's 50256.
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    if pad_token_id is not None:
        config["pad_token_id"] = pad_token_id
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


def hf_tensor_specs(model_cfg, vocab_size, max_positions, dtype):
    """[(hf_name, shape, dtype)] in file order, for write_safetensors."""
    check_hf_compatible(model_cfg)
    d, ffn = model_cfg.decoder_embed_dim, model_cfg.decoder_ffn_embed_dim
    shapes = [("transformer.wte.weight", (vocab_size, d)), ("transformer.wpe.weight", (max_positions, d))]
    layer_shapes = {
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "attn.c_attn.weight": (d, 3 * d),
        "attn.c_attn.bias": (3 * d,),
        "attn.c_proj.weight": (d, d),
        "attn.c_proj.bias": (d,),
        "ln_2.weight": (d,),
        "ln_2.bias": (d,),
        "mlp.c_fc.weight": (d, ffn),
        "mlp.c_fc.bias": (ffn,),
        "mlp.c_proj.weight": (ffn, d),
        "mlp.c_proj.bias": (d,),
    }
    for i in range(num_layers(model_cfg)):
        shapes += [(f"transformer.h.{i}.{name}", shape) for name, shape in layer_shapes.items()]
    shapes += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    if not _tied(model_cfg):
        shapes.append(("lm_head.weight", (vocab_size, d)))
    return [(name, shape, dtype) for name, shape in shapes]


def hf_tensor(hf_name, get_ours, model_cfg, max_positions, dtype=None):
    """HF tensor `hf_name` built from our parameters; `get_ours(name)` returns one of
    ours (full, on the CPU) by its TransformerLM name. Cast to `dtype` when given."""
    import torch  # writing only: reading config.json stays torch-free

    # torch too, for the same reason
    from models.transformer_lm import sinusoidal_positions

    dim = model_cfg.decoder_embed_dim
    if hf_name == "transformer.wte.weight":
        table, scale = get_ours("embed_tokens.weight"), _embed_scale(model_cfg)
        tensor = table if scale == 1.0 else table.float() * scale  # as TransformerLM.embed does
    elif hf_name == "transformer.wpe.weight":
        # GPT-2's wpe row i is position i: a table counted from --positions-offset (fairseq's
        # models) starts that many rows in.
        offset = getattr(model_cfg, "positions_offset", 0)
        if model_cfg.no_token_positional_embeddings:
            tensor = torch.zeros(max_positions, dim)
        elif model_cfg.decoder_learned_pos:
            tensor = get_ours("embed_positions.weight")[offset:]
        else:
            tensor = sinusoidal_positions(max_positions, dim, "cpu", torch.float32, start=offset)
    elif hf_name == "lm_head.weight":
        shared = model_cfg.share_decoder_input_output_embed
        tensor = get_ours("embed_tokens.weight" if shared else "output_projection.weight")
    elif hf_name in ("transformer.ln_f.weight", "transformer.ln_f.bias"):
        tensor = get_ours("layer_norm." + hf_name.rsplit(".", 1)[1])
    else:
        match = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", hf_name)
        if not match or match[2] not in _LAYER_TENSORS:
            raise ValueError(f"{hf_name!r} is not a GPT-2 tensor this export writes")
        ours, transposed = _LAYER_TENSORS[match[2]]
        tensor = get_ours(f"layers.{match[1]}.{ours}")
        if transposed:
            tensor = tensor.t()
    return tensor.to(dtype or tensor.dtype).contiguous()


def write_hf_gpt2(
    out_dir,
    get_ours,
    model_cfg,
    vocab_size,
    max_positions,
    dtype=None,
    max_shard_size=None,
    **token_ids,
):
    """A directory GPT2LMHeadModel.from_pretrained loads: config.json + model.safetensors (or
    shards and their index), streamed one tensor at a time. token_ids: bos_token_id,
    eos_token_id, pad_token_id. dtype: fp32 unless given."""
    import torch  # writing only: reading config.json stays torch-free

    # Our shards module imports torch too.
    from trainer.formats.hf.shards import DEFAULT_MAX_SHARD_SIZE, write_hf_weights

    dtype = dtype or torch.float32
    os.makedirs(out_dir, exist_ok=True)
    specs = hf_tensor_specs(model_cfg, vocab_size, max_positions, dtype)
    write_hf_weights(
        Path(out_dir),
        specs,
        lambda name: hf_tensor(name, get_ours, model_cfg, max_positions, dtype),
        max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        HF_METADATA,
    )
    config = hf_config(model_cfg, vocab_size, max_positions, dtype=dtype, **token_ids)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def model_from_hf_config(config):
    """config.json of GPT2LMHeadModel → (our model fields, vocab_size, max_positions);
    HFConfigError naming the key when the model is not one we build exactly."""
    act = config.get("activation_function", "gelu_new")
    if act not in _READ_ACTIVATIONS:
        raise HFConfigError(f"activation_function {act!r} is not supported ({', '.join(_READ_ACTIVATIONS)} are)")
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise HFConfigError("scale_attn_by_inverse_layer_idx true: attention scaled per layer is not supported")
    if not config.get("scale_attn_weights", True):
        raise HFConfigError("scale_attn_weights false: unscaled attention is not supported")
    dim = config["n_embd"]
    fields = dict(
        decoder_layers=config["n_layer"],
        decoder_embed_dim=dim,
        decoder_ffn_embed_dim=config.get("n_inner") or 4 * dim,
        decoder_attention_heads=config["n_head"],
        decoder_kv_heads=None,
        decoder_head_dim=None,
        norm_type="layernorm",
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        gated_ffn=False,
        activation_fn=_READ_ACTIVATIONS[act],
        no_bias=False,
        qk_norm=False,
        rope=False,
        rope_scaling=None,
        no_scale_embedding=True,
        share_decoder_input_output_embed=bool(config.get("tie_word_embeddings", True)),
        decoder_learned_pos=True,
        no_token_positional_embeddings=False,
        positions_offset=0,
        decoder_normalize_before=True,
        no_decoder_final_norm=False,
        layernorm_embedding=False,
        decoder_input_dim=dim,
        decoder_output_dim=dim,
        attention_dropout=float(config.get("attn_pdrop", 0.0)),
    )
    return fields, config["vocab_size"], config.get("n_positions", 1024)


# our name inside layers.{i} → (HF name inside transformer.h.{i}, stored transposed)
_OUR_LAYER_TENSORS = {ours: (theirs, transposed) for theirs, (ours, transposed) in _LAYER_TENSORS.items()}
_OUTSIDE_LAYERS = {
    "embed_tokens.weight": "transformer.wte.weight",
    "embed_positions.weight": "transformer.wpe.weight",
    "layer_norm.weight": "transformer.ln_f.weight",
    "layer_norm.bias": "transformer.ln_f.bias",
    "output_projection.weight": "lm_head.weight",
}


def hf_parts(name, model_cfg):
    """Our parameter `name` as HF tensors stacked by rows: [(hf name, rows)]; GPT-2 keeps each
    of ours whole in one tensor (c_attn is q, k and v side by side, as our qkv_proj)."""
    if name in _OUTSIDE_LAYERS:
        return [(_OUTSIDE_LAYERS[name], None)]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if not match or match[2] not in _OUR_LAYER_TENSORS:
        raise KeyError(name)
    return [(f"transformer.h.{match[1]}.{_OUR_LAYER_TENSORS[match[2]][0]}", None)]


def transposed(hf_name):
    """Whether `hf_name` is a Conv1D weight, stored [in, out]: our rows are its columns."""
    match = re.fullmatch(r"transformer\.h\.\d+\.(.+)", hf_name)
    return bool(match) and _LAYER_TENSORS.get(match[1], (None, False))[1]


def write_hf(out_dir, get_ours, our_specs, model_cfg, vocab_size, max_positions, dtype, saved_dtype, **kw):
    """export-model's face of every family: fp32 unless --dtype says otherwise (wte is our
    table times sqrt(d), computed in fp32)."""
    write_hf_gpt2(out_dir, get_ours, model_cfg, vocab_size, max_positions, dtype=dtype, **kw)
