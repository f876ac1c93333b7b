"""The bytes a rank receives per update, by collective: what `plan` reports beside memory."""

from trainer.plan.optimizer_memory import optimizer_comm
from trainer.plan.shapes import ModelShape, Setup


def comm_bytes(m: ModelShape, s: Setup):
    """Bytes each rank receives per update, by collective (the size of what is gathered or
    reduced, times the share of it that comes from other ranks)."""
    P, elem = m.params, s.compute_bytes  # bytes of one element in the compute dtype
    out = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0, "all_to_all": 0.0}
    if s.world == 1:
        return out
    for collective, nbytes in optimizer_comm(m, s).items():  # the step's own (adafactor, lamb, muon)
        out[collective] += nbytes
    if s.sharded:
        S = s.shard
        share = (S - 1) / S
        regathered = m.layer_params * (m.layers - 1) if s.reshard_after_forward else 0
        out["all_gather"] = s.update_freq * (P + regathered) * elem * share
        reduces = 1 if s.defer_grad_sync else s.update_freq
        reduce_bytes = 4 if (s.fp32_reduce_scatter or elem == 4) else elem
        out["reduce_scatter"] = reduces * P * reduce_bytes * share
        replicas = s.world // S
        if replicas > 1:  # hybrid_shard: the shards' gradients are all-reduced across copies
            out["all_reduce"] = reduces * 2 * (P / S) * reduce_bytes * (replicas - 1) / replicas
    else:
        out["all_reduce"] = 2 * P * 4 * (s.world - 1) / s.world
    return out
