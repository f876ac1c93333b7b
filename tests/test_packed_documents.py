"""Packed documents (forward's `segments`) score each document as it scores alone, on the
fairseq configs (sinusoidal and learned positions) and a Llama-like one, and as
transformers scores it alone; `per_row` gives each row's summed loss and its gradients."""

import pytest
import torch
import torch.nn.functional as F

import models.chunks as chunks
from helpers import TINY, compose
from models.documents import document_positions
from models.kv_cache import KVCache
from models.transformer_lm import build_model
from trainer.inference.load import load_model
from trainer.parallel.parallelize import apply_activation_checkpointing, sharding_of

VOCAB, PAD, MAX_POSITIONS = 50, 1, 32
LLAMA = [
    "--norm-type",
    "rmsnorm",
    "--gated-ffn",
    "--decoder-kv-heads",
    "1",
    "--no-bias",
    "--qk-norm",
    "--rope",
    "--rope-scaling",
    "llama3",
    "--rope-original-max-positions",
    "8",
]
CONFIGS = {
    "sinusoidal": TINY,
    "learned": TINY + ["--decoder-learned-pos", "--positions-offset", "2"],
    "llama": TINY + LLAMA,
}
# Two packed rows of 32 positions: documents of these lengths, then right padding.
DOCUMENTS = [[7, 12, 5, 4], [10, 3, 15]]


def tiny_model(name, *extra):
    torch.manual_seed(0)
    return build_model(compose(CONFIGS[name] + list(extra)).model, VOCAB, MAX_POSITIONS, padding_idx=PAD)


def packed_batch(pad_segment):
    """(tokens, targets, segments, docs): docs lists each document's (row, start, tokens,
    targets). Pads carry the last document's segment value (pad_segment "last") or -1."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.full((len(DOCUMENTS), MAX_POSITIONS), PAD)
    targets, segments = tokens.clone(), torch.full_like(tokens, -1)
    docs = []
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for value, n in enumerate(lengths):
            doc_tokens, doc_targets = torch.randint(2, VOCAB, (2, n), generator=g)
            tokens[row, start : start + n], targets[row, start : start + n] = doc_tokens, doc_targets
            segments[row, start : start + n] = value
            docs.append((row, start, doc_tokens, doc_targets))
            start += n
        if pad_segment == "last":
            segments[row, start:] = len(lengths) - 1
    return tokens, targets, segments, docs


def one_document_a_row(docs):
    """The same documents, each alone at the start of a right-padded row."""
    longest = max(len(t) for _, _, t, _ in docs)
    tokens = torch.full((len(docs), longest), PAD)
    targets = tokens.clone()
    for i, (_, _, doc_tokens, doc_targets) in enumerate(docs):
        tokens[i, : len(doc_tokens)], targets[i, : len(doc_targets)] = doc_tokens, doc_targets
    return tokens, targets


def grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(ours, expected, rtol=1e-5):
    assert ours.keys() == expected.keys()
    for name in expected:
        error = (ours[name] - expected[name]).norm() / expected[name].norm().clamp_min(1e-12)
        assert error < rtol, (name, error.item())


@pytest.mark.parametrize("pad_segment", ["last", -1])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_rows_score_each_document_as_alone(name, pad_segment):
    model = tiny_model(name)
    tokens, targets, segments, docs = packed_batch(pad_segment)
    alone_tokens, alone_targets = one_document_a_row(docs)
    packed_logits = model(tokens, segments=segments)
    alone_logits = model(alone_tokens)
    for i, (row, start, doc_tokens, _) in enumerate(docs):
        n = len(doc_tokens)
        torch.testing.assert_close(packed_logits[row, start : start + n], alone_logits[i, :n], rtol=1e-5, atol=1e-5)
    # Ignoring the segments lets later documents see earlier ones: the comparison can fail.
    ignored = model(tokens)
    row, start, doc_tokens, _ = docs[1]
    assert (ignored[row, start : start + len(doc_tokens)] - alone_logits[1, : len(doc_tokens)]).abs().max() > 1e-3
    # The same summed loss over the same targets, so the same gradients.
    packed_grads = grads(model, model(tokens, target=targets, segments=segments))
    assert_same_grads(packed_grads, grads(model, model(alone_tokens, target=alone_targets)))


def test_positions_restart_at_each_document():
    """Rotary scores depend only on relative positions, so under the block mask the logits
    cannot show whether rope's positions restart: the tables themselves must."""
    segments = torch.tensor([[4, 4, 4, 7, 7, 4, 4, -1], [0, 0, 0, 0, 0, 0, 1, 1]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 0], [0, 1, 2, 3, 4, 5, 0, 1]])
    assert torch.equal(document_positions(segments), expected)
    model = tiny_model("llama")
    x = torch.zeros(2, 8, 64)
    cos, sin = model.rope_tables(0, 8, x, document_positions(segments))
    plain_cos, plain_sin = model.rope_tables(0, 8, x)
    assert cos.shape == (2, 1, 8, plain_cos.shape[-1])
    assert torch.equal(cos[:, 0], plain_cos[expected]) and torch.equal(sin[:, 0], plain_sin[expected])


def test_checkpointed_layers_take_the_documents_mask():
    """--checkpoint-activations wraps each layer's forward: the mask and per-row rope
    tables pass through it, and the recomputed backward gives the same gradients."""
    tokens, targets, segments, _ = packed_batch(-1)
    plain = tiny_model("llama")
    expected = grads(plain, plain(tokens, target=targets, segments=segments))
    checkpointed = tiny_model("llama")
    apply_activation_checkpointing(checkpointed, False, None)
    assert_same_grads(grads(checkpointed, checkpointed(tokens, target=targets, segments=segments)), expected)


def test_packed_llama_gives_transformers_logits_of_each_document(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(2)
    theirs = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():  # every weight drawn, norms included
            p.normal_(0.0, 0.3)
    theirs.save_pretrained(tmp_path)
    ours, _, _ = load_model(tmp_path)
    tokens, _, segments, docs = packed_batch(-1)
    with torch.no_grad():
        packed = ours(tokens, segments=segments)
        for row, start, doc_tokens, _ in docs:
            expected = theirs(doc_tokens[None]).logits[0]
            got = packed[row, start : start + len(doc_tokens)]
            assert (got - expected).abs().max() < 1e-4 * expected.abs().max()


@pytest.mark.parametrize("name, extra", [("sinusoidal", []), ("llama", ["--share-decoder-input-output-embed"])])
def test_per_row_losses_and_gradients(monkeypatch, name, extra):
    # 5 positions a chunk: chunks straddle rows of 9, so each position must find its row's gradient.
    monkeypatch.setattr(chunks, "LOSS_CHUNK_BYTES", 5 * 4 * VOCAB)
    model = tiny_model(name, *extra)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, VOCAB, (4, 9), generator=g)
    targets = torch.randint(2, VOCAB, (4, 9), generator=g)
    targets[1, 6:] = targets[3, 2:] = PAD
    weights = torch.randn(4, generator=g)  # DPO weighs each row's log-likelihood differently

    rows = model(tokens, target=targets, per_row=True)
    assert rows.shape == (4,) and rows.dtype == torch.float32
    ours = grads(model, (weights * rows).sum())
    logits = model(tokens)
    expected_rows = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=PAD, reduction="none").sum(1)
    torch.testing.assert_close(rows, expected_rows.detach(), rtol=1e-5, atol=1e-5)
    assert_same_grads(ours, grads(model, (weights * expected_rows).sum()))


def test_dpo_keeps_the_output_weights_gathered_for_backward():
    """The per-row loss reads W in backward: a root resharded after forward would have
    freed it (FSDP2 raises 'setStorage: ... out of bounds for storage of size 0')."""
    assert not sharding_of(compose(TINY + ["--batch-size", "2"])).root_read_in_backward
    assert sharding_of(
        compose(["data-dpo", *TINY, "--task", "dpo", "--dpo-reference", "ref", "--batch-size", "2"])
    ).root_read_in_backward


def test_refusals():
    model = tiny_model("llama")
    tokens, targets, segments, _ = packed_batch(-1)
    with pytest.raises(ValueError, match="KV cache"):
        model(tokens, cache=KVCache(model, batch_size=2), segments=segments)
    with pytest.raises(ValueError, match="per_row needs a target"):
        model(tokens, per_row=True)
