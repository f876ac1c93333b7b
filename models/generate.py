"""Sample a continuation from a TransformerLM, one token at a time (fairseq-interactive style).

With the KV cache (the default) the prompt runs through the model once and every new token
after it costs one pass of each layer over one position. Without it each step re-runs the
whole prefix: slower, kept as the plain reference the cached path must agree with.
"""

import torch
import torch.nn.functional as F

from models.kv_cache import KVCache


def next_token(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
    """Pick one token id from a vector of V logits.

    temperature 0 is greedy (argmax). top_k > 0 keeps the k most likely tokens; top_p < 1
    keeps the smallest set of most likely tokens whose probabilities sum to at least top_p
    (nucleus sampling; the most likely token always stays)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth_best = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # A token stays if the tokens ranked above it sum to less than top_p: that is the
        # smallest set reaching top_p, and the first token (nothing above it) always stays.
        sorted_probs[sorted_probs.cumsum(0) - sorted_probs >= top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # multinomial takes unnormalized weights: no need to renormalize what was cut.
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    model,
    prompt_ids,
    max_new_tokens,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    seed=1,
    eos=None,
    bos=None,
    use_cache=True,
    banned=(),
):
    """Return up to `max_new_tokens` new token ids continuing `prompt_ids`.

    Stops early after sampling `eos` (which is not returned): one id, or several (a chat
    model ends a turn with one id and a text with another; the first met stops it). An empty prompt starts from
    `bos` (fairseq LMs use eos as the beginning of a sentence). Draws come from a generator
    seeded by `seed`: the same seed gives the same tokens and the global RNG is untouched.
    `banned`: token ids never picked (fairseq's generator bans <pad>)."""
    stop = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    tokens = list(prompt_ids)
    if not tokens:
        if bos is None:
            raise ValueError("empty prompt: pass bos= (fairseq LMs start from the eos token id)")
        tokens = [bos]
    if len(tokens) + max_new_tokens > model.max_positions:
        raise ValueError(
            f"prompt of {len(tokens)} tokens + --max-new-tokens {max_new_tokens} exceeds "
            f"the model's {model.max_positions} positions"
        )
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # The cache only needs room for this sequence, not for max_positions.
            cache = KVCache(model, 1, len(tokens) + max_new_tokens) if use_cache else None
            new, feed = [], tokens  # the cached path feeds the prompt once, then one token a step
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([feed], device=device), cache)[0, -1]
                if banned:
                    logits[list(banned)] = float("-inf")
                token = next_token(logits, temperature, top_k, top_p, generator)
                if token in stop:
                    break
                new.append(token)
                tokens.append(token)
                feed = [token] if use_cache else tokens
            return new
    finally:
        model.train(was_training)
