"""The batched generation engine (trainer/serve/engine.py): requests decoded together,
joining and leaving between steps, get what one request decoded alone gets — `sample`'s
greedy and seeded tokens, transformers' greedy tokens for a Hugging Face directory — and
the log-probabilities the model's full forward (eval-lm's loss) gives."""

import time

import pytest
import torch
import torch.nn.functional as F
from test_generate import VOCAB, tiny_model

from models.generate import sample
from trainer.serve.engine import Engine, GenerationRequest

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23, 24], [30, 31], [40, 41, 42, 43]]


@pytest.mark.parametrize("positions,overrides", [("sinusoidal", {}), ("learned", {}), ("none", {"rope": True})])
def test_batched_greedy_equals_sample_with_requests_joining_midway(positions, overrides):
    model = tiny_model(positions, **overrides)
    expected = [sample(model, p, 12, temperature=0) for p in PROMPTS]
    # 4 rows for 6 requests: two wait for a row; three more join once the first is decoding.
    with Engine(model, max_batch=4) as engine:
        first = [engine.submit(GenerationRequest(p, max_tokens=12, temperature=0)) for p in PROMPTS[:3]]
        next(iter(first[0]))
        later = [engine.submit(GenerationRequest(p, max_tokens=12, temperature=0)) for p in PROMPTS[3:]]
        got = [[t.id for t in h.result(timeout=30).tokens] for h in first + later]
    assert got == expected


def test_hf_llama_greedy_equals_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trainer.inference.load import load_model

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)  # away from init's near-uniform logits, so argmax ties are unlikely
    theirs.save_pretrained(tmp_path)
    ours, _, _ = load_model(tmp_path)
    with Engine(ours, eos_ids=[2], max_batch=4) as engine:
        handles = [engine.submit(GenerationRequest(p, max_tokens=20, temperature=0)) for p in PROMPTS[:4]]
        got = [[t.id for t in h.result(timeout=30).tokens] for h in handles]
    for prompt, tokens in zip(PROMPTS[:4], got):
        ids = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=2)[0]
        ids = ids[len(prompt) :].tolist()
        assert tokens == ids[: ids.index(2)] if 2 in ids else tokens == ids


def test_seeded_sampling_does_not_depend_on_companions():
    model = tiny_model()
    how = dict(max_tokens=15, temperature=1.2, top_p=0.9)
    with Engine(model, max_batch=4) as engine:
        alone = engine.submit(GenerationRequest(PROMPTS[1], seed=5, **how)).result(timeout=30)
        companions = [engine.submit(GenerationRequest(p, **how)) for p in (PROMPTS[0], PROMPTS[3])]
        batched = engine.submit(GenerationRequest(PROMPTS[1], seed=5, **how))
        assert [t.id for t in batched.result(timeout=30).tokens] == [t.id for t in alone.tokens]
        assert all(h.result(timeout=30).finish_reason == "length" for h in companions)
    assert [t.id for t in alone.tokens] == sample(model, PROMPTS[1], 15, temperature=1.2, top_p=0.9, seed=5)


def test_cancel_frees_the_row():
    model = tiny_model()
    with Engine(model, max_batch=1) as engine:
        long = engine.submit(GenerationRequest(PROMPTS[0], max_tokens=None, temperature=0))
        waiting = engine.submit(GenerationRequest(PROMPTS[1], max_tokens=5, temperature=0))
        next(iter(long))
        assert not waiting.done()  # the only row is taken
        long.cancel()
        assert len(waiting.result(timeout=30).tokens) == 5
        assert long.result(timeout=30).finish_reason == "cancelled"
        assert engine.cache.size == 0


def test_echo_and_token_logprobs_equal_the_full_forward():
    model = tiny_model("learned")
    prompt = PROMPTS[1]
    with Engine(model, max_batch=2) as engine:
        other = engine.submit(GenerationRequest(PROMPTS[0], max_tokens=20, temperature=0))
        scored = engine.score(prompt, logprobs=3)
        done = engine.submit(GenerationRequest(prompt, max_tokens=6, temperature=0, logprobs=2, echo=True)).result()
        other.result(timeout=30)
    assert scored[0].logprob is None and [t.id for t in scored] == prompt
    full = [t.id for t in done.tokens]
    with torch.no_grad():
        seq = torch.tensor([prompt + full])
        logp = F.log_softmax(model(seq)[0].float(), dim=-1)
        # eval-lm's per-sequence value: the model's summed cross-entropy of the prompt.
        n = len(prompt)
        nll = model(seq[:, : n - 1], target=seq[:, 1:n], per_row=True)[0]
    want = logp[torch.arange(len(prompt) + len(full) - 1), seq[0, 1:]]
    got = [t.logprob for t in scored[1:]] + [t.logprob for t in done.tokens]
    torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-5)
    assert [t.logprob for t in done.prompt] == [t.logprob for t in scored]
    torch.testing.assert_close(-sum(t.logprob for t in scored[1:]), float(nll), rtol=0, atol=1e-4)
    top = scored[2].top
    assert len(top) == 3 and top[0][1] == pytest.approx(float(logp[1].max()), abs=1e-5)


def test_stop_ids_end_a_completion_without_being_returned():
    model = tiny_model()
    greedy = sample(model, PROMPTS[2], 10, temperature=0)
    end = greedy.index(greedy[3])
    with Engine(model) as engine:
        how = dict(max_tokens=10, temperature=0, stop_ids=[greedy[3]])
        done = engine.submit(GenerationRequest(PROMPTS[2], **how)).result(timeout=30)
        scored = engine.submit(GenerationRequest(PROMPTS[2], logprobs=1, **how)).result(timeout=30)
    assert [t.id for t in done.tokens] == greedy[:end] and done.finish_reason == "stop"
    assert done.stop_token is None  # kept only when log-probabilities are asked for
    # with them, the id that ended it and its score (serve lists it, as OpenAI's API does)
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([PROMPTS[2] + greedy[:end]]))[0, -1].float(), dim=-1)
    assert scored.stop_token.id == greedy[3] and [t.id for t in scored.tokens] == greedy[:end]
    assert scored.stop_token.logprob == pytest.approx(float(logp[greedy[3]]), abs=1e-5)


def test_16_concurrent_requests_share_forwards():
    model = tiny_model()
    request = dict(max_tokens=24, temperature=0)
    with Engine(model, max_batch=16) as engine:
        engine.submit(GenerationRequest(PROMPTS[0], **request)).result(timeout=30)  # warm up
        start = time.perf_counter()
        engine.submit(GenerationRequest(PROMPTS[0], **request)).result(timeout=30)
        one = time.perf_counter() - start
        start = time.perf_counter()
        handles = [engine.submit(GenerationRequest(PROMPTS[i % 6], **request)) for i in range(16)]
        for h in handles:
            h.result(timeout=60)
        sixteen = time.perf_counter() - start
    print(f"16 concurrent requests took {sixteen / one:.2f}x one request's time ({16 * one / sixteen:.1f}x tokens/s)")


class LetterTokenizer:
    """Token i is the letter chr(65 + i % 26): enough text to find stop strings in."""

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def test_stop_string_ends_the_completion_and_cuts_its_text():
    model = tiny_model()
    greedy = sample(model, PROMPTS[2], 10, temperature=0)
    text = LetterTokenizer().decode(greedy)
    stop = text[4:6]
    with Engine(model, LetterTokenizer()) as engine:
        done = engine.submit(GenerationRequest(PROMPTS[2], max_tokens=10, temperature=0, stop=[stop])).result(30)
    end = text.index(stop)
    assert done.finish_reason == "stop" and done.text == text[:end]
    assert [t.id for t in done.tokens] == greedy[: end + len(stop)]
