"""`plan` for --task dpo (the frozen reference, two rows a pair) and for packed documents
(--task sft, --per-document-attention: the block-causal mask). tests/test_plan_*.py hold
the planner's other tests; SHAPE and SETUP (tests/plan_helpers.py) are their small model and 4-rank FSDP setup."""

from dataclasses import replace

import pytest
from plan_helpers import SETUP, SHAPE, plan_json

import cli
from trainer.plan.activations import document_mask_bytes
from trainer.plan.ledger import GB, simulate

DDP = replace(SETUP, backend="pytorch_ddp", shard=1)


def most(setup, component):
    """The largest number of bytes `component` holds at any moment of an update."""
    return simulate(SHAPE, setup)[0].most.get(component, 0)


def test_reference_is_sharded_like_the_policy_under_fsdp_and_whole_under_ddp():
    """Its fp32 parameters, this rank's share: P/world under FSDP, every one under DDP;
    none without --task dpo."""
    fp32 = 4 * SHAPE.params
    for world in (2, 4):
        fsdp = replace(SETUP, dpo=True, world=world, ranks_per_host=world, shard=world)
        assert most(fsdp, "reference_model") == fp32 / world
        assert most(replace(DDP, dpo=True, world=world, ranks_per_host=world), "reference_model") == fp32
    assert most(SETUP, "reference_model") == most(SETUP, "reference_forward") == 0
    # --cpu-offload on a GPU keeps the reference's shards on the host, with the policy's
    offload = replace(SETUP, dpo=True, device="cuda", cpu_offload=True)
    assert most(offload, "reference_model") == 0
    assert simulate(SHAPE, offload)[1] - simulate(SHAPE, replace(offload, dpo=False))[1] == fp32 / 4


def test_reference_forward_gathers_one_layer_and_the_root_under_fsdp():
    """Its forward holds the root and a layer gathered (two on a GPU, whose all-gather runs
    ahead), in the compute dtype, on top of its temporaries; nothing of the policy's."""
    bf16 = replace(SETUP, dpo=True, precision="bf16")
    unit, root = 2 * SHAPE.layer_params, 2 * SHAPE.root_params
    temporaries = most(replace(bf16, backend="pytorch_ddp", shard=1), "reference_forward")
    # under DDP autocast keeps the residual stream fp32 and casts weights anew: compare by difference
    sharded = most(bf16, "reference_forward")
    on_gpu = most(replace(bf16, device="cuda"), "reference_forward")
    assert on_gpu - sharded == unit
    assert sharded > root + unit
    assert temporaries > 0


def test_dpo_doubles_the_policys_rows():
    """A batch of B pairs is 2B rows: the policy saves what 2B sequences save."""
    pairs = replace(SETUP, dpo=True, sequences=2)
    assert pairs.rows == pairs.tokens // pairs.seq_len == 4
    lm_rows = replace(SETUP, sequences=4)
    assert most(pairs, "activations") == most(lm_rows, "activations")
    assert most(pairs, "activations") > most(replace(SETUP, sequences=2), "activations")
    assert most(pairs, "logits_and_loss") > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_packed_documents_count_their_masks(precision):
    """The bool B×T×T mask once, and each layer's additive copy that SDPA keeps for backward;
    under context parallelism B×T/2×T on CP 2 (the rank's queries over every key), and
    still none for plain causal sequences (models/layer.py causal_attention)."""
    packed = replace(SETUP, packed_documents=True, precision=precision)
    rows, T, elem = packed.rows, packed.seq_len, packed.compute_bytes
    assert most(packed, "document_mask") == rows * T * T * (1 + SHAPE.layers * elem)
    assert most(replace(packed, checkpoint_activations=True), "document_mask") == rows * T * T * (1 + elem)
    assert most(replace(SETUP, precision=precision), "document_mask") == 0
    cp2 = dict(world=2, shard=2, backend="fully_sharded", cp=2)
    assert most(replace(packed, **cp2), "document_mask") == rows * T // 2 * T * (1 + SHAPE.layers * elem)
    assert most(replace(SETUP, precision=precision, **cp2), "document_mask") == 0
    # two rows a pair for the mask too
    assert most(replace(packed, dpo=True), "document_mask") == 2 * most(packed, "document_mask")


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sdpa_keeps_what_plan_counts_for_a_block_causal_mask(dtype_name):
    """SDPA given a bool mask converts it to q's dtype and saves that copy for backward:
    what document_mask_bytes says one layer adds (its other saved tensors are the causal
    path's, counted by layer_activation_bytes)."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    B, H, T, D = 2, 4, 64, 16
    q, k, v = (torch.randn(B, H, T, D, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    squares = [t for t in saved if t.shape[-2:] == (T, T)]
    precision = "fp32" if dtype == torch.float32 else "bf16"
    setup = replace(SETUP, packed_documents=True, sequences=B, seq_len=T, precision=precision)
    assert sum(t.numel() * t.element_size() for t in squares) == document_mask_bytes(SHAPE, setup)[1]


def test_plan_takes_the_task_flags_and_a_hugging_face_model(tmp_path, capsys):
    """plan DATA --task dpo --finetune-from-model HF_DIR: the model of its config.json, its
    reference model as a line of the breakdown; --task sft counts its masks."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=2000,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "llama")
    (tmp_path / "data").mkdir()  # DATA is required; plan reads no data when the model names its vocabulary
    common = [str(tmp_path / "data"), "--finetune-from-model", str(tmp_path / "llama"), "--cpu"]
    common += ["--batch-size", "2", "--tokens-per-sample", "64"]
    dpo = plan_json(capsys, "--task", "dpo", *common)
    assert dpo["vocab"] == 2000
    assert dpo["components"]["reference_model"] == round(4 * dpo["params"] / GB, 3) > 0
    lm = plan_json(capsys, "--task", "language_modeling", *common)
    assert lm["components"]["reference_model"] == 0 and lm["per_rank_gb"] < dpo["per_rank_gb"]
    # the masks of 2 rows of 64: too few bytes to show in GB, but their line is there
    assert cli.plan_main(["--task", "sft", *common]) == 0
    text = capsys.readouterr().out
    assert "packed documents' attention masks" in text and "reference model" in text
