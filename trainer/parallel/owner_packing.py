"""Which rank of a shard group owns each whole matrix (--optimizer muon): a rule on
shapes alone, torch-free, so that the trainer (trainer/parallel/matrix_owners.py) and the
planner (trainer/plan/optimizer_memory.py) pack the same matrices onto the same ranks."""


def owners_by_work(works, ranks):
    """Longest-processing-time packing: the largest first, each onto the rank with the least
    work so far (ties: the lower index, the lower rank), so every rank computes the same."""
    loads, owners = [0] * ranks, [0] * len(works)
    for i in sorted(range(len(works)), key=lambda i: (-works[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i], loads[rank] = rank, loads[rank] + works[i]
    return owners
