"""The bytes a rank receives per update, by collective: what `plan` reports beside memory."""

from trainer.plan.optimizer_memory import optimizer_comm
from trainer.plan.shapes import ModelShape, Setup, sharded_params

COLLECTIVES = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "tensor_parallel",
    "context_parallel",
    "expert_parallel",
)


def fsdp_units(m: ModelShape, s: Setup):
    """(parameters gathered, ranks they are gathered over, gathers per micro-batch) of each of
    FSDP's units: the root once; a layer once in forward and, resharded after it (all but the
    last), again in backward. A sparse layer's router and experts are units of their own under
    tensor parallelism (over moe_shard ranks, the TP ranks too), its experts under expert
    parallelism (E/ep of them over moe_shard // ep ranks): resharded after forward, the last
    layer's too (trainer/parallel/parallelize.py shard_experts, expert_meshes)."""
    S, M, ep = s.shard, s.moe_shard, s.ep
    again = 1 if s.reshard_after_forward else 0
    units = [(m.root_params, S, 1)]
    for i in range(m.layers):
        layer_again = again if i < m.layers - 1 else 0
        if not m.is_sparse(i):
            units.append((m.params_of(i), S, 1 + layer_again))
            continue
        router, experts = m.experts * m.dim, m.expert_params // ep
        own = []  # (parameters, ranks) of the units of their own
        if ep > 1:
            own.append((experts, M // ep))
            experts = 0
        if s.tp > 1:
            own.append((router + experts, M))
            router = experts = 0
        units.append((m.params_of(i) - m.moe_params + router + experts, S, 1 + layer_again))
        units += [(n, ranks, 1 + again) for n, ranks in own]
    return units


def comm_bytes(m: ModelShape, s: Setup):
    """Bytes each rank receives per update, by collective (the size of what is gathered or
    reduced, times the share of it that comes from other ranks). FSDP's are over each unit's
    ranks (fsdp_units), the optimizer's over the data-parallel ranks; `tensor_parallel` and
    `context_parallel` count what those groups exchange inside themselves; `expert_parallel`,
    the tokens' all-to-alls to their experts' ranks and back. Under tensor parallelism `m` is
    the rank's share (shapes.tensor_parallel_share)."""
    P, elem = m.params, s.compute_bytes  # bytes of one element in the compute dtype
    out = dict.fromkeys(COLLECTIVES, 0.0)
    if s.world == 1:
        return out
    for collective, nbytes in optimizer_comm(m, s).items():  # the step's own (adafactor, lamb, muon)
        out[collective] += nbytes
    if s.sharded:
        units = fsdp_units(m, s)
        out["all_gather"] = s.update_freq * elem * sum(n * (g - 1) / g * times for n, g, times in units)
        reduces = 1 if s.defer_grad_sync else s.update_freq
        reduce_bytes = 4 if (s.fp32_reduce_scatter or elem == 4) else elem
        out["reduce_scatter"] = reduces * reduce_bytes * sum(n * (g - 1) / g for n, g, _ in units)
        replicas = s.world // (s.shard * s.tp)
        if replicas > 1:  # hybrid_shard: the shards' gradients are all-reduced across copies
            out["all_reduce"] = reduces * 2 * sharded_params(m, s) * reduce_bytes * (replicas - 1) / replicas
    else:
        out["all_reduce"] = 2 * P * 4 * (s.world - 1) / s.world
    forwards = 2 if s.checkpoint_activations else 1  # a checkpointed layer's forward runs again in backward
    hidden = s.tokens * m.dim * elem  # B × T × d of the rank's positions (all of a sequence's but CP's)
    if s.tp > 1:
        # per layer: an all-gather before qkv_proj and fc1 and a reduce-scatter after out_proj
        # and fc2 in each forward, the mirror in backward (a sparse layer: attention's pair only,
        # its experts run on the rank's own positions; the router's statistics, a few floats,
        # aside); the embedding's all-reduce, the loss's all-gather of the final hidden states
        # and its backward's reduce-scatter
        pairs = 2 * m.layers - len(m.sparse_layers)
        per_pair = 2 * (forwards + 1) * hidden
        out["tensor_parallel"] = s.update_freq * (pairs * per_pair + 4 * hidden) * (s.tp - 1) / s.tp
    if s.cp > 1:
        # per layer: every position's keys and values gathered in each forward, and in
        # backward gathered again and their gradients reduce-scattered
        kv = 2 * s.rows * s.seq_len * m.kv * m.hd * elem
        out["context_parallel"] = s.update_freq * m.layers * (forwards + 2) * kv * (s.cp - 1) / s.cp
    if s.ep > 1:
        # per sparse layer: the token copies to their experts' ranks and the outputs back in
        # each forward, the mirror in backward; each the N·k rows' share that leaves the rank
        rows = s.routed_tokens * m.top_k * m.dim * elem  # the rank's own positions' choices
        exchanges = 2 * forwards + 2
        out["expert_parallel"] = s.update_freq * len(m.sparse_layers) * exchanges * rows * (s.ep - 1) / s.ep
    return out
