"""Generation: the KV cache gives the full forward's logits, sampling with and without it
agrees token for token, seeds repeat, and each cached step runs a layer over one position."""

import pytest
import torch

from models.config import TransformerLMConfig
from models.generate import next_token, sample
from models.transformer_lm import KVCache, build_model

VOCAB, MAX_POSITIONS = 50, 32


def tiny_config(positions="sinusoidal", **overrides):
    return TransformerLMConfig(
        decoder_layers=2,
        decoder_embed_dim=64,
        decoder_ffn_embed_dim=128,
        decoder_attention_heads=2,
        dropout=0.0,
        decoder_learned_pos=positions == "learned",
        no_token_positional_embeddings=positions == "none",
        **overrides,
    )


def tiny_model(positions="sinusoidal", **overrides):
    return build_model(tiny_config(positions, **overrides), VOCAB, MAX_POSITIONS, seed=3).eval()


def tokens(n, seed=0):
    return torch.randint(2, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "positions,overrides",
    [
        ("learned", {}),
        ("sinusoidal", {}),
        ("none", {}),
        ("learned", {"decoder_normalize_before": False, "layernorm_embedding": True}),
    ],
)
def test_cached_logits_equal_full_forward(positions, overrides):
    model = tiny_model(positions, **overrides)
    seq = tokens(12)
    with torch.no_grad():
        full = model(seq)
        for chunks in ([1] * 12, [5, 7], [12]):
            cache, pieces, start = KVCache(model), [], 0
            for n in chunks:
                pieces.append(model(seq[:, start : start + n], cache))
                start += n
            assert cache.length == 12
            torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


def test_cache_offsets_positions():
    # The same token at a later position must give other logits: the offset is applied.
    model = tiny_model("learned")
    seq = tokens(4)
    with torch.no_grad():
        cache = KVCache(model)
        model(seq, cache)
        after_prefix = model(seq[:, :1], cache)
        alone = model(seq[:, :1])
    assert not torch.allclose(after_prefix, alone, atol=1e-3)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
@pytest.mark.parametrize(
    "how",
    [
        dict(temperature=0),
        dict(temperature=0.8, top_k=10, seed=5),
        dict(temperature=1.2, top_p=0.9, seed=7),
        dict(top_k=20, top_p=0.8, seed=11),
    ],
)
def test_sample_with_cache_equals_without(positions, how):
    model = tiny_model(positions)
    prompt = tokens(6)[0].tolist()
    cached = sample(model, prompt, 20, use_cache=True, **how)
    plain = sample(model, prompt, 20, use_cache=False, **how)
    assert len(cached) == 20 and cached == plain


def test_seed_repeats_and_differs_and_leaves_global_rng_alone():
    model = tiny_model()
    prompt = tokens(4)[0].tolist()
    rng = torch.get_rng_state()
    a = sample(model, prompt, 20, seed=1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert sample(model, prompt, 20, seed=1) == a
    assert sample(model, prompt, 20, seed=2) != a  # 20 draws over 50 tokens: equal only by freak chance


def test_greedy_limits_of_top_k_and_top_p():
    model = tiny_model()
    prompt = tokens(5)[0].tolist()
    greedy = sample(model, prompt, 10, temperature=0)
    assert sample(model, prompt, 10, top_k=1, seed=3) == greedy
    assert sample(model, prompt, 10, top_p=1e-6, seed=3) == greedy


def test_next_token_filters():
    logits = torch.tensor([0.5, 0.3, 0.2, 0.0]).log()  # probabilities 0.5, 0.3, 0.2, 0
    g = torch.Generator().manual_seed(0)
    assert next_token(logits, temperature=0) == 0
    assert {next_token(logits, top_k=2, generator=g) for _ in range(200)} == {0, 1}
    # nucleus: 0.5 alone reaches 0.5; reaching 0.6 needs the second token too.
    assert {next_token(logits, top_p=0.5, generator=g) for _ in range(200)} == {0}
    assert {next_token(logits, top_p=0.6, generator=g) for _ in range(200)} == {0, 1}
    assert {next_token(logits, generator=g) for _ in range(200)} == {0, 1, 2}


def test_eos_stops_and_empty_prompt_starts_from_bos():
    model = tiny_model()
    prompt = tokens(5)[0].tolist()
    greedy = sample(model, prompt, 10, temperature=0)
    stop = greedy[3]
    cut = sample(model, prompt, 10, temperature=0, eos=stop)
    assert cut == greedy[: greedy.index(stop)]
    assert sample(model, [], 8, temperature=0, bos=2) == sample(model, [2], 8, temperature=0)
    with pytest.raises(ValueError, match="bos"):
        sample(model, [], 8)


def test_too_long_raises_naming_the_flag():
    model = tiny_model()
    assert len(sample(model, [3] * 22, 10, temperature=0)) == 10  # exactly max_positions fits
    for use_cache in (True, False):
        with pytest.raises(ValueError, match="--max-new-tokens"):
            sample(model, [3] * 22, 11, use_cache=use_cache)
    cache = KVCache(model)
    with torch.no_grad():
        model(tokens(MAX_POSITIONS), cache)
        with pytest.raises(ValueError, match="positions"):
            model(tokens(1), cache)


@pytest.mark.parametrize("use_cache", [True, False])
def test_cached_step_runs_each_layer_over_one_position(use_cache):
    model = tiny_model()
    seen = {i: [] for i in range(len(model.layers))}
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, args, out, i=i: seen[i].append(args[0].shape[1]))
    sample(model, tokens(6)[0].tolist(), 5, temperature=0, use_cache=use_cache)
    # The prompt once, then one position per new token (the last token is never fed).
    expected = [6, 1, 1, 1, 1] if use_cache else [6, 7, 8, 9, 10]
    assert seen == {i: expected for i in seen}


def test_sample_restores_training_mode():
    model = tiny_model().train()
    sample(model, [3, 4], 2)
    assert model.training
