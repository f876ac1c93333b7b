"""Expert parallelism (--expert-parallel-size N): the experts of each mixture-of-experts layer
(models/moe.py) are split over N ranks of the data-parallel group, each holding E/N whole
experts; every rank routes its own tokens, and they travel to their experts' ranks and back.

Per layer and micro-batch: the ranks first exchange how many tokens each sends each expert
(one all-to-all of E counts), then the tokens themselves (one all-to-all each way, of the
sizes those counts give; their backward is the reverse exchange). A rank's experts take
every token of the group routed to them: each expert's gradient is the group's whole, and
FSDP reduce-scatters it over the ranks that hold the same experts in the other groups
(torchtitan's dp_shard_mod_ep), as it does every other parameter over all the ranks.
"""

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


class ExpertParallelDispatch:
    """MoEFeedForward.dispatch over an expert-parallel group of n ranks: rank r holds experts
    r·E/n … (r+1)·E/n - 1."""

    def __init__(self, group, n):
        self.group, self.n = group, n

    def __call__(self, x, counts, experts):
        """x: this rank's token copies sorted by expert, `counts` (E) of them each →
        their experts' outputs, in the same order."""
        n, E = self.n, counts.shape[0]
        local = E // n
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source rank × my experts]
        # the sizes of the exchanges, read on the host (all_to_all takes them there); the
        # rows sent add up to x's, which its shape says without a read
        send = counts.view(n, local).sum(1).tolist()
        send[-1] = x.shape[0] - sum(send[:-1])
        by_source = received.view(n, local)
        recv = by_source.sum(1).tolist()
        tokens = _exchange(x, recv, send, self.group)
        # runs by (source, expert) → by (expert, source): each expert's rows together
        order = _expert_major(by_source, sum(recv))
        y = experts(tokens[order], by_source.sum(0))
        return _exchange(_unpermute(y, order), send, recv, self.group)


def _exchange(x, out_splits, in_splits, group):
    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


def _unpermute(y, order):
    """y's rows put back where `order` took them from (y = t[order] → t), with gradient."""
    return torch.zeros_like(y).index_add(0, order, y)


def _expert_major(by_source, total):
    """The row order taking `total` rows laid out source by source (each source's rows expert
    by expert, counts `by_source`) to expert by expert (each expert's rows source by source).
    The total comes from the host: repeat_interleave would otherwise read it from the device."""
    n, local = by_source.shape
    flat = by_source.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # each (source, expert) run's first row
    runs = starts.view(n, local).t().reshape(-1)  # expert-major
    lengths = by_source.t().reshape(-1)
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=by_source.device)
    rows = torch.arange(len(lengths), device=by_source.device)
    run_of_row = torch.repeat_interleave(rows, lengths, output_size=total)
    first_row = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(total, device=by_source.device) - first_row[run_of_row]
    return runs[run_of_row] + within


def expert_layers(model):
    return [layer.moe for layer in model.layers if getattr(layer, "moe", None) is not None]


def apply_expert_parallel(model, mesh):
    """Split each mixture-of-experts layer's experts over the 1-D mesh `mesh` ("ep"), by rows
    (whole experts), and route its tokens over it. Returns the Experts modules, which FSDP
    then shards over the ranks that hold the same experts."""
    group, n = mesh.get_group(), mesh.size()
    modules = []
    for moe in expert_layers(model):
        experts = moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))
        experts.local = _local_rows
        moe.dispatch = ExpertParallelDispatch(group, n)
        modules.append(experts)
    return modules


def _local_rows(p):
    return p.to_local() if isinstance(p, DTensor) else p
