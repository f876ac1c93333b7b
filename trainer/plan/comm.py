"""The bytes a rank receives per update, by collective: what `plan` reports beside memory."""

from trainer.plan.optimizer_memory import optimizer_comm
from trainer.plan.shapes import ModelShape, Setup

COLLECTIVES = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "tensor_parallel",
    "context_parallel",
    "expert_parallel",
)


def comm_bytes(m: ModelShape, s: Setup):
    """Bytes each rank receives per update, by collective (the size of what is gathered or
    reduced, times the share of it that comes from other ranks). FSDP's and the optimizer's
    are over the data-parallel ranks; `tensor_parallel` and `context_parallel` count what
    those groups exchange inside themselves; `expert_parallel`, the tokens' all-to-alls to
    their experts' ranks and back. Under tensor parallelism `m` is the rank's share
    (shapes.tensor_parallel_share); under expert parallelism the experts' units are gathered
    and reduced over the shard // ep ranks that hold the same ones, E/ep experts each."""
    P, elem = m.params, s.compute_bytes  # bytes of one element in the compute dtype
    out = dict.fromkeys(COLLECTIVES, 0.0)
    if s.world == 1:
        return out
    for collective, nbytes in optimizer_comm(m, s).items():  # the step's own (adafactor, lamb, muon)
        out[collective] += nbytes
    if s.sharded:
        S = s.shard
        share = (S - 1) / S
        regathered_ids = range(m.layers - 1) if s.reshard_after_forward else ()
        regathered = sum(m.params_of(i) for i in regathered_ids)
        # the experts' own units (expert parallelism): E/ep experts gathered over S/ep ranks
        expert_units = len(m.sparse_layers) if s.ep > 1 else 0
        expert_regathered = sum(1 for i in regathered_ids if m.is_sparse(i)) if s.ep > 1 else 0
        expert_shard = max(1, S // s.ep)
        expert_share = (expert_shard - 1) / expert_shard / s.ep  # of a layer's E experts' bytes
        experts, experts_again = expert_units * m.expert_params, expert_regathered * m.expert_params
        out["all_gather"] = (
            s.update_freq
            * elem
            * ((P - experts + regathered - experts_again) * share + (experts + experts_again) * expert_share)
        )
        reduces = 1 if s.defer_grad_sync else s.update_freq
        reduce_bytes = 4 if (s.fp32_reduce_scatter or elem == 4) else elem
        out["reduce_scatter"] = reduces * reduce_bytes * ((P - experts) * share + experts * expert_share)
        replicas = s.world // (S * s.tp)
        if replicas > 1:  # hybrid_shard: the shards' gradients are all-reduced across copies
            out["all_reduce"] = reduces * 2 * (P / S) * reduce_bytes * (replicas - 1) / replicas
    else:
        out["all_reduce"] = 2 * P * 4 * (s.world - 1) / s.world
    forwards = 2 if s.checkpoint_activations else 1  # a checkpointed layer's forward runs again in backward
    hidden = s.tokens * m.dim * elem  # B × T × d of the rank's positions (all of a sequence's but CP's)
    if s.tp > 1:
        # per layer: an all-gather before qkv_proj and fc1 and a reduce-scatter after out_proj
        # and fc2 in each forward, the mirror in backward; the embedding's all-reduce, the
        # loss's all-gather of the final hidden states and its backward's reduce-scatter
        per_layer = 4 * (forwards + 1) * hidden
        out["tensor_parallel"] = s.update_freq * (m.layers * per_layer + 4 * hidden) * (s.tp - 1) / s.tp
    if s.cp > 1:
        # per layer: every position's keys and values gathered in each forward, and in
        # backward gathered again and their gradients reduce-scattered
        kv = 2 * s.rows * s.seq_len * m.kv * m.hd * elem
        out["context_parallel"] = s.update_freq * m.layers * (forwards + 2) * kv * (s.cp - 1) / s.cp
    if s.ep > 1:
        # per sparse layer: the token copies to their experts' ranks and the outputs back in
        # each forward, the mirror in backward; each the N·k rows' share that leaves the rank
        rows = s.tokens * m.top_k * m.dim * elem
        exchanges = 2 * forwards + 2
        out["expert_parallel"] = s.update_freq * len(m.sparse_layers) * exchanges * rows * (s.ep - 1) / s.ep
    return out
