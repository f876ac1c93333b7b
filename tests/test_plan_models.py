"""The planner's counts against the real models: parameter counts against
models/transformer_lm.py's (the GPT and Llama families), a layer's saved activations against
what autograd saves, a CPU attention's backward op by op, and MFU's FLOPs per token against
torch's count."""

from dataclasses import replace

import pytest
from plan_helpers import SETUP, SHAPE, cfg_of, saved_for_backward_bytes

from models import chunks
from trainer.plan.ledger import layer_activation_bytes
from trainer.plan.search import model_shape


@pytest.mark.parametrize(
    "flags",
    [
        ["--arch", "transformer_lm_gpt2_tiny"],
        ["--decoder-learned-pos", "--share-decoder-input-output-embed", "--activation-fn", "gelu"],
        ["--no-token-positional-embeddings", "--layernorm-embedding", "--no-decoder-final-norm"],
        [
            "--decoder-layers",
            "3",
            "--decoder-embed-dim",
            "96",
            "--decoder-ffn-embed-dim",
            "200",
            "--decoder-attention-heads",
            "3",
            "--max-target-positions",
            "300",
            "--decoder-learned-pos",
        ],
        [
            "--scale-attn",
            "--scale-fc",
            "--scale-heads",
            "--scale-resids",
            "--decoder-input-dim",
            "48",
            "--decoder-output-dim",
            "80",
            "--decoder-layers",
            "3",
            "--decoder-layers-to-keep",
            "0,2",
        ],
        ["--share-decoder-input-output-embed", "--decoder-input-dim", "48", "--decoder-output-dim", "48"],
        ["--quant-noise-pq", "0.1"],  # fairseq's quant_noise layer on the embeddings
    ],
)
def test_parameter_count_is_the_models(flags):
    from models.transformer_lm import build_model, num_parameters

    cfg = cfg_of("--task", "dummy_lm", "--dict-size", "777", "--tokens-per-sample", "64", *flags)
    model = build_model(cfg.model, 777, cfg.model.max_target_positions or 64, device="meta")
    assert model_shape(cfg, 777).params == num_parameters(model)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"activation_fn": "relu"},
        {"dropout": 0.1},
        {"activation_dropout": 0.1},
        {"activation_fn": "relu", "activation_dropout": 0.1},
        {"attention_dropout": 0.1},
        {"precision": "bf16"},
        {"precision": "bf16", "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1},
        {"normalize_before": False},
        {"pq_noise": True},
        {"precision": "bf16", "pq_noise": True},
        {"scalar_noise": True, "activation_fn": "relu"},
        {"precision": "bf16", "pq_noise": True, "scalar_noise": True},
    ],
)
def test_activation_bytes_are_what_autograd_saves_on_the_real_layer(variant):
    """The planner's count of one layer's saved activations against the tensors autograd
    actually saves for backward on models/transformer_lm.py's DecoderLayer (its input
    included, parameters not; storages shared by views counted once)."""
    import torch
    from omegaconf import OmegaConf

    from models.transformer_lm import DecoderLayer

    v = dict(variant)
    precision, pre_ln = v.pop("precision", "fp32"), v.pop("normalize_before", True)
    shape = replace(SHAPE, **v)
    cfg = OmegaConf.create(
        dict(
            decoder_embed_dim=shape.dim,
            decoder_ffn_embed_dim=shape.ffn,
            decoder_attention_heads=shape.heads,
            decoder_normalize_before=pre_ln,
            activation_fn=shape.activation_fn,
            dropout=shape.dropout,
            attention_dropout=shape.attention_dropout,
            activation_dropout=shape.activation_dropout,
            quant_noise_pq=0.1 if shape.pq_noise else 0.0,
            quant_noise_pq_block_size=8,
            quant_noise_scalar=0.5 if shape.scalar_noise else 0.0,
        )
    )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layer = DecoderLayer(cfg).to(dtype).train()
    x = torch.randn(SETUP.sequences, SETUP.seq_len, shape.dim, dtype=dtype, requires_grad=True)
    saved = saved_for_backward_bytes(layer, x)
    # bf16 norms keep their mean and rstd in bf16, where the planner counts fp32: 8 bytes a token
    slack = 8 * SETUP.tokens if precision == "bf16" else 0
    assert saved == pytest.approx(layer_activation_bytes(shape, replace(SETUP, precision=precision)), abs=slack)


# default: one chunk; then 4 of 16 heads; then a context-parallel rank's last chunk (CP 2)
@pytest.mark.parametrize("scores_bytes,cp", [(None, 1), (4 * 128 * 128 * 2, 1), (None, 2)])
def test_cpu_attention_backward_holds_what_plan_counts(monkeypatch, scores_bytes, cp):
    """The T×T tensors alive at once in the backward of models/cpu_attention.py, tracked op
    by op (storages counted once), against plan's count for the same layer; under context
    parallelism the T/(2 cp) × T tensors of the chunk that sees every key."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    import models.cpu_attention as cpu_attention
    import trainer.plan.ledger as memory_plan

    if scores_bytes:  # one number, read by the kernel and the planner alike
        monkeypatch.setattr(chunks, "ATTENTION_SCORES_BYTES", scores_bytes)
    B, H, T = SETUP.sequences, SHAPE.heads, SETUP.seq_len
    queries = T // (2 * cp) if cp > 1 else T

    class SquareTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.peak = [], 0  # weak references (a WeakSet would compare tensors)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.live += [
                weakref.ref(t)
                for t in tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[-2:] == (queries, T)
            ]
            alive = [t for t in (ref() for ref in self.live) if t is not None]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
            self.peak = max(self.peak, sum(storages.values()))
            return out

    q, k, v = [torch.randn(B, H, n, SHAPE.dim // H).to(torch.bfloat16).requires_grad_() for n in (queries, T, T)]
    out = cpu_attention.causal_matmul_attention(q, k, v)
    grad = torch.randn_like(out)
    with SquareTensors() as tracked:
        out.backward(grad)
    bf16 = replace(SETUP, precision="bf16", cp=cp)
    assert tracked.peak == memory_plan.cpu_attention_backward_bytes(SHAPE, bf16) > 0
    assert memory_plan.cpu_attention_backward_bytes(SHAPE, replace(bf16, device="cuda")) == 0
    assert memory_plan.cpu_attention_backward_bytes(SHAPE, SETUP) == 0  # fp32: SDPA


# The Llama family's layer at test size: 4 query heads over 2 kv heads, RoPE, SwiGLU, no
# biases, RMSNorm; Qwen3's also with q/k norms and heads wider than dim / heads.
LLAMA_LAYER = [
    "--arch",
    "llama3_2_1b",
    "--decoder-embed-dim",
    "256",
    "--decoder-ffn-embed-dim",
    "688",
    "--decoder-attention-heads",
    "4",
    "--decoder-kv-heads",
    "2",
    "--decoder-head-dim",
    "64",
]


QWEN3_LAYER = [
    "--arch",
    "qwen3_0_6b",
    "--decoder-embed-dim",
    "256",
    "--decoder-ffn-embed-dim",
    "688",
    "--decoder-attention-heads",
    "4",
    "--decoder-kv-heads",
    "2",
    "--decoder-head-dim",
    "96",
]


@pytest.mark.parametrize(
    "flags",
    [
        LLAMA_LAYER,
        QWEN3_LAYER,
        ["--arch", "llama3_1_8b"],
        ["--arch", "qwen3_8b"],
        LLAMA_LAYER + ["--norm-type", "layernorm", "--scale-attn", "--scale-fc"],
        LLAMA_LAYER + ["--no-bias", "false", "--decoder-layers", "3"],
    ],
)
def test_parameter_count_of_the_llama_family_is_the_models(flags):
    from models.transformer_lm import build_model, num_parameters

    cfg = cfg_of("--task", "dummy_lm", "--dict-size", "777", "--tokens-per-sample", "64", *flags)
    model = build_model(cfg.model, 777, 64, device="meta")
    assert model_shape(cfg, 777).params == num_parameters(model)


@pytest.mark.parametrize("flags", [LLAMA_LAYER, QWEN3_LAYER])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
def test_llama_family_activation_bytes_are_what_autograd_saves_on_the_real_layer(flags, precision):
    """As above, on the Llama and Qwen3 layers: RMSNorm (a CPU's composite), GQA (SDPA with
    enable_gqa in fp32, the repeated kv heads of the CPU's bf16 attention), RoPE's tables and
    rotated q/k, Qwen3's q/k norms, the gated FFN, no biases; bf16 as FSDP runs it (the
    layer in bf16), autocast as DDP does (its weight copies are the planner's
    mixed_precision_copies, not activations)."""
    import torch

    from models.transformer_lm import DecoderLayer, rope_inverse_frequencies, rope_tables
    from trainer.plan.ledger import rope_table_bytes

    cfg = cfg_of("--task", "dummy_lm", "--dict-size", "777", "--tokens-per-sample", str(SETUP.seq_len), *flags)
    shape = model_shape(cfg, 777)
    autocast = precision == "autocast"
    setup = replace(
        SETUP,
        precision="fp32" if precision == "fp32" else "bf16",
        **(dict(backend="pytorch_ddp", shard=1) if autocast else {}),
    )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layer = DecoderLayer(cfg.model).to(dtype).train()
    x = torch.randn(setup.sequences, setup.seq_len, shape.dim, dtype=dtype, requires_grad=True)
    rope = rope_tables(rope_inverse_frequencies(cfg.model), 0, setup.seq_len, dtype)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    weight_copies = {tuple(p.shape[::-1]) for p in layer.parameters() if p.dim() == 2}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and not (autocast and tuple(t.shape) in weight_copies):
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        layer(x, rope=rope)
    # the rope tables are the model's, one pair for all layers: the ledger counts them once
    assert sum(saved.values()) == layer_activation_bytes(shape, setup) + rope_table_bytes(shape, setup)


def test_flops_per_token_is_the_count_of_the_matmuls_of_grouped_query_attention():
    """MFU's FLOPs (trainer/train/meters.py) on Qwen3's layer, 4 query heads of 96 over 2 kv
    heads (H·head_dim ≠ d): 3× the forward's matmul FLOPs, counted by torch as the model
    runs them (the CPU's bf16 attention is batched matmuls), plus the PaLM count's 6 per
    parameter outside a matmul (the norms)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from models.transformer_lm import build_model, num_parameters
    from trainer.train.meters import flops_per_token

    T, V = 64, 300
    cfg = cfg_of(
        "--task",
        "dummy_lm",
        "--dict-size",
        str(V),
        "--tokens-per-sample",
        str(T),
        *QWEN3_LAYER,
        "--decoder-layers",
        "2",
    )
    model = build_model(cfg.model, V, T).to(torch.bfloat16)
    with FlopCounterMode(display=False) as counted:
        model(torch.randint(0, V, (1, T)))
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    embed = model.embed_tokens.weight.numel()
    fpt = flops_per_token(cfg.model, num_parameters(model), V, embed, T)
    assert fpt == 3 * counted.get_total_flops() / T + 6 * vectors
