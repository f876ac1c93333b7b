"""The tensor-, context- and expert-parallel layouts the flag search (trainer/plan/search.py)
tries on GPUs: --model-parallel-size and --context-parallel-size degrees a model and a job can
take, each with the micro-batches that keep the global batch; for a mixture of experts,
--model-parallel-size degrees, each with the --expert-parallel-size degrees it can take
(context parallelism is not tried for one: it does not compose with expert parallelism).
Torch-free."""

from dataclasses import replace
from math import gcd

from trainer.config.checks.parallel_dims import splits_key_value_heads
from trainer.plan.comm import comm_bytes
from trainer.plan.shapes import ModelShape, Setup, tensor_parallel_share


def layout_label(s: Setup):
    return (
        (f", tp {s.tp}" if s.tp > 1 else "")
        + (f", cp {s.cp}" if s.cp > 1 else "")
        + (f", ep {s.ep}" if s.ep > 1 else "")
    )


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def with_layout(s: Setup, tp, cp):
    """s on tp × cp model-parallel ranks, FSDP's shards and the micro-batches adjusted so the
    global batch (sequences per update over the data-parallel ranks) stays; None where it
    cannot (its sequences do not split over the data-parallel ranks)."""
    dp = s.world // (tp * cp)
    total = s.sequences * s.update_freq * s.data_parallel
    group = s.shard * s.tp  # ranks of a shard group, tensor-parallel ones included
    if total % dp or group % tp or s.seq_len % (2 * cp if cp > 1 else 1):
        return None
    per_rank = total // dp
    sequences = gcd(s.sequences, per_rank)
    return replace(s, tp=tp, cp=cp, shard=group // tp, sequences=sequences, update_freq=per_rank // sequences)


def tensor_parallel_degrees(m: ModelShape, s: Setup):
    """TP degrees worth trying: divisors of a node's GPUs that divide the query and key/value
    heads and the feed-forward width (trainer/config/checks/parallel_dims.py)."""
    node = min(s.ranks_per_host, s.world)
    return [t for t in divisors(node) if m.heads % t == 0 and splits_key_value_heads(m.kv, m.hd, t) and m.ffn % t == 0]


def layouts(m: ModelShape, s: Setup):
    """The sharded Setup s on each tensor- and context-parallel layout worth trying: on GPUs,
    tensor-parallel groups inside a node (tensor_parallel_degrees), context-parallel ones of
    any size that divides the world and splits each sequence into 2 × cp chunks; fewest
    model-parallel ranks first, then fewest bytes received per rank (comm.comm_bytes: tensor
    parallelism divides FSDP's traffic, context parallelism's own is smaller). Elsewhere s
    alone. A mixture of experts: expert_layouts(m, s)."""
    if s.device != "cuda" or not s.sharded or s.world == 1:
        return [s]
    if m.experts:
        return expert_layouts(m, s)
    if not s.model_parallel_ok:
        return [s]
    cps = divisors(s.world)
    out = [with_layout(s, t, c) for t in tensor_parallel_degrees(m, s) for c in cps if s.world % (t * c) == 0]
    return by_cost(m, s, [o for o in out if o is not None])


def expert_layouts(m: ModelShape, s: Setup):
    """The sharded Setup s at each tensor-parallel degree worth trying (as a dense model's;
    the given one alone where the model or optimizer takes none, or under context
    parallelism) and, at each, each expert-parallel degree: groups of consecutive ranks
    inside a node (a divisor of its GPUs) that divide the experts and the ranks the mixture
    is sharded over (moe_shard: the TP ranks too). Fewest TP ranks first, then fewest bytes
    received per rank (comm.comm_bytes: the experts gathered over fewer ranks, E/ep of them,
    against the tokens' all-to-alls)."""
    node = min(s.ranks_per_host, s.world)
    tps = tensor_parallel_degrees(m, s) if s.model_parallel_ok and s.cp == 1 else [s.tp]
    eps = [e for e in divisors(node) if m.experts % e == 0] if s.cp == 1 else [s.ep]
    out = []
    for t in tps:
        at = with_layout(s, t, s.cp)
        if at is not None:
            out += [replace(at, ep=e) for e in eps if at.moe_shard % e == 0]
    return by_cost(m, s, out)


def by_cost(m: ModelShape, s: Setup, out):
    """The layouts `out`, with s itself if it is not among them, fewest model-parallel ranks
    first, then fewest bytes received per rank."""
    if not any((o.tp, o.cp, o.ep) == (s.tp, s.cp, s.ep) for o in out):
        out.append(s)

    def key(o):
        return o.tp * o.cp, sum(comm_bytes(tensor_parallel_share(m, o.tp), o).values())

    return sorted(out, key=key)
