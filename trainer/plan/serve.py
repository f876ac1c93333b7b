"""`plan --serve`: one rank's memory while `serve` runs a model, and whether it fits.

What `serve` holds (trainer/serve/engine.py, models/batch_cache.py,
trainer/parallel/serve_steps.py): the weights in fp32 (2 bytes with --fp16/--bf16),
sharded over every rank by FSDP (one unit a layer, the root another); during a forward the
root and one layer gathered (two on a GPU, whose all-gather stream runs a layer ahead); the
KV cache, max_batch rows × --max-positions (default every position), allocated once and
whole on every rank, since every rank runs every forward; and the largest forward's temporaries:
a prefill of the longest prompt (one row, every position, its logits for every position
kept for echo's log-probabilities) or a decode step (max_batch rows, one token each).
Torch-free, as the rest of plan/.
"""

from dataclasses import dataclass

from trainer.plan.ledger import GB, RUNTIME_GB, ModelShape

SERVE_COMPONENTS = ("runtime", "parameters", "gathered_parameters", "kv_cache", "activations", "logits")
SERVE_LABELS = {
    "runtime": "runtime (interpreter, libraries, communication)",
    "parameters": "parameters (this rank's shards, serving dtype)",
    "gathered_parameters": "gathered root and layer(s) during a forward",
    "kv_cache": "KV cache (max_batch × positions, whole on every rank)",
    "activations": "largest forward's temporaries (one layer's)",
    "logits": "largest forward's logits",
}
# load_model builds the model in fp32 (without --fp16/--bf16), whatever the saved dtype.
SERVE_DTYPE_BYTES = 4


@dataclass
class ServeSetup:
    device: str  # "cpu" or "cuda"
    world: int
    max_batch: int
    positions: int  # the cache's positions per row: the model's max positions
    elem: int = SERVE_DTYPE_BYTES


def kv_cache_bytes(m: ModelShape, s: ServeSetup):
    """BatchKVCache: per layer a K and a V of max_batch × kv_heads × positions × head_dim."""
    return 2 * m.layers * s.max_batch * m.kv * s.positions * m.hd * s.elem


def forward_bytes(m: ModelShape, s: ServeSetup, rows, tokens):
    """(activations, logits) of one forward over `rows` rows of `tokens` new tokens each,
    attending to at most s.positions keys. Without autograd nothing is kept from one layer
    to the next but the residual stream, so the largest layer moment counts: its input, the
    qkv projection, the feed-forward's hidden width, and the attention scores, fp32 rows ×
    heads × tokens × keys (the masked SDPA's math path on a CPU; a GPU's kernels hold less)."""
    n = rows * tokens
    keys = min(s.positions, tokens) if tokens > 1 else s.positions
    layer = n * s.elem * (2 * m.dim + max(m.qkv_width, m.fc1_width)) + rows * m.heads * tokens * keys * 4
    # The model's logits in the serving dtype; echo's log_softmax reads an fp32 copy and makes another.
    cast = 0 if s.elem == 4 else 4
    logits = n * m.vocab * (s.elem + cast + 4)
    return layer, logits


def serve_components(m: ModelShape, s: ServeSetup):
    """{component: bytes} of one rank at its peak."""
    sharded = s.world > 1
    layers_gathered = min(m.layers, 2 if s.device == "cuda" else 1)
    prefill = forward_bytes(m, s, 1, s.positions)
    step = forward_bytes(m, s, s.max_batch, 1)
    acts, logits = max(prefill, step, key=sum)
    return {
        "runtime": RUNTIME_GB[s.device] * GB,
        "parameters": m.params * s.elem / s.world,
        # Unsharded (one rank) the weights are all there already: nothing more is gathered.
        "gathered_parameters": (m.root_params + layers_gathered * m.layer_params) * s.elem if sharded else 0,
        "kv_cache": kv_cache_bytes(m, s),
        "activations": acts,
        "logits": logits,
    }


def per_rank_gb(m, s):
    return sum(serve_components(m, s).values()) / GB


def smallest_world(m, s: ServeSetup, device_gb):
    """The fewest ranks (at least s.world) whose share fits, or None: only the parameters'
    share shrinks with the world (the cache and the forward are whole on every rank)."""
    at_two = serve_components(m, ServeSetup(s.device, max(s.world, 2), s.max_batch, s.positions, s.elem))
    room = device_gb * GB - (sum(at_two.values()) - at_two["parameters"])
    if s.world == 1 and per_rank_gb(m, s) <= device_gb:
        return 1
    if room <= 0:
        return None
    return max(s.world, 2, -(-int(m.params * s.elem) // int(room)))


def smallest_fit(m, s: ServeSetup, device_gb):
    """(world, max_batch) that fits: the smallest world size at the given max_batch, else
    the largest max_batch for which some world size fits (with its smallest world); None
    where not even one row fits on any number of ranks."""
    for batch in range(s.max_batch, 0, -1):
        world = smallest_world(m, ServeSetup(s.device, s.world, batch, s.positions, s.elem), device_gb)
        if world is not None:
            return world, batch
    return None


def serve_plan(m, s: ServeSetup, device_gb):
    comps = serve_components(m, s)
    per_rank = sum(comps.values()) / GB
    fit = per_rank <= device_gb
    return dict(
        fits=fit,
        per_rank_gb=round(per_rank, 3),
        device=s.device,
        device_memory_gb=device_gb,
        world_size=s.world,
        max_batch=s.max_batch,
        positions=s.positions,
        params=m.params,
        components={k: round(comps[k] / GB, 3) for k in SERVE_COMPONENTS},
        fit_with=None if fit else smallest_fit(m, s, device_gb),
    )


def as_text(plan):
    lines = [
        f"serve: {plan['params'] / 1e6:.1f}M parameters on {plan['world_size']} {plan['device']} rank(s), "
        f"--max-batch {plan['max_batch']}, {plan['positions']} positions a row",
        f"per rank: {plan['per_rank_gb']:.3f} GB of {plan['device_memory_gb']:.3f} GB",
    ]
    lines += [f"  {SERVE_LABELS[k]:<56} {v:8.3f} GB" for k, v in plan["components"].items()]
    if plan["fits"]:
        lines.append("fits")
    elif plan["fit_with"] is None:
        lines.append("does not fit, not even one row on any number of ranks: a larger device is needed")
    else:
        world, batch = plan["fit_with"]
        how = [f"--distributed-world-size {world}"] if world != plan["world_size"] else []
        how += [f"--max-batch {batch}"] if batch != plan["max_batch"] else []
        lines.append(f"does not fit; fits with {' '.join(how)}")
    return "\n".join(lines)
