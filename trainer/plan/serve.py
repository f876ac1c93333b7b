"""`plan --serve`: one rank's memory while `serve` runs a model, and whether it fits.

What `serve` holds (trainer/serve/engine.py, models/batch_cache.py,
trainer/parallel/serve_steps.py): the weights in fp32 (2 bytes with --fp16/--bf16),
sharded over every rank by FSDP (one unit a layer, the root another); during a forward the
root and one layer gathered (two on a GPU, whose all-gather stream runs a layer ahead); the
KV cache, max_batch rows × --max-positions (default every position), allocated once and
whole on every rank, since every rank runs every forward; and the largest forward's temporaries:
a prefill of the longest prompt (one row, every position, its logits for every position
kept for echo's log-probabilities) or a decode step (max_batch rows, one token each).
A mixture of experts (models/moe.py) is served as a dense model is: no expert parallelism,
each sparse layer one FSDP unit holding all its experts, gathered whole; its forward's
largest moment is the experts' dispatch (sparse_ffn_bytes).
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


def sparse_ffn_bytes(m: ModelShape, s: ServeSetup, n):
    """The largest moment of a mixture of experts' feed-forward (models/moe.py) over n tokens,
    its input aside: the router's fp32 probabilities (N×E), the top-k ids, the order that
    sorts them by expert and the tokens' ids (int64, N·k each), the weights, the sorted copies
    x[tokens] (N·k×d), and the experts' work on those N·k rows. A CPU runs the experts one at
    a time, one run of N·k/E rows at balanced routing: at its largest either the last run's
    gate and up, act(gate) and their product (4F a row) beside the other runs' outputs (d),
    or the outputs' concatenation beside them and the last run's gate and up. A GPU's grouped
    matmul (bf16, Hopper's and later) takes every row at once: gate and up, act(gate) and the
    product (4F), then the output (d) beside gate, up and the product; other GPUs run the
    CPU's loop, so a GPU counts the larger."""
    if not m.sparse_layers:
        return 0
    rows, d, F = n * m.top_k, m.dim, m.expert_ffn
    routing = n * m.experts * 4 + 3 * rows * 8 + rows * s.elem
    run = -(-rows // m.experts)
    loop = max((rows - run) * d + run * 4 * F, 2 * rows * d + run * 2 * F)
    grouped = rows * (3 * F + max(F, d)) if s.device == "cuda" else 0
    return routing + s.elem * (rows * d + max(loop, grouped))


def forward_bytes(m: ModelShape, s: ServeSetup, rows, tokens):
    """(activations, logits) of one forward over `rows` rows of `tokens` new tokens each,
    attending to at most s.positions keys. Without autograd nothing is kept from one layer
    to the next but the residual stream, so the largest layer moment counts: its input, the
    qkv projection, the feed-forward's hidden width (a dense layer's fc1, a sparse layer's
    dispatch), and the attention scores, fp32 rows × heads × tokens × keys (the masked SDPA's
    math path on a CPU; a GPU's kernels hold less)."""
    n = rows * tokens
    keys = min(s.positions, tokens) if tokens > 1 else s.positions
    dense_ffn = m.fc1_width if m.layers > len(m.sparse_layers) else 0
    widest = max(n * s.elem * max(m.qkv_width, dense_ffn), sparse_ffn_bytes(m, s, n))
    layer = n * s.elem * 2 * m.dim + widest + rows * m.heads * tokens * keys * 4
    # The model's logits in the serving dtype; echo's log_softmax reads an fp32 copy and makes another.
    cast = 0 if s.elem == 4 else 4
    logits = n * m.vocab * (s.elem + cast + 4)
    return layer, logits


def gathered_layers_params(m: ModelShape, count):
    """The most parameters `count` consecutive layers hold (sparse layers outweigh dense ones)."""
    return max(sum(m.params_of(j) for j in range(i, i + count)) for i in range(m.layers - count + 1))


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
        "gathered_parameters": (m.root_params + gathered_layers_params(m, layers_gathered)) * s.elem if sharded else 0,
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
