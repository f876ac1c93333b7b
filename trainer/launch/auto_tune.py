"""`train --auto-tune`: before any rank starts, plan for this machine (or
--memory-budget-gb) and set the fastest memory flags that fit (trainer/plan/)."""

from omegaconf import OmegaConf

from trainer.errors import UsageError
from trainer.host import gpu_memory_gb, host_memory_gb, runs_on_gpu
from trainer.plan.ledger import Setup
from trainer.plan.report import make_plan
from trainer.plan.search import MEMORY_FLAGS, flags_of, sequences_per_batch
from trainer.rendezvous import infer_rendezvous


def apply_choice(cfg, s: Setup):
    """Set the config's memory flags to those of Setup `s`."""
    values = {
        "distributed_training.ddp_backend": s.backend,
        "optimization.update_freq": s.update_freq,
        "common.model_parallel_size": s.tp,
        "common.context_parallel_size": s.cp,
        "common.expert_parallel_size": s.ep,
    }
    values.update({key: value_in(s) for _, key, value_in in MEMORY_FLAGS})
    if s.sequences != sequences_per_batch(cfg):
        values["dataset.batch_size"], values["dataset.max_tokens"] = s.sequences, None
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def auto_tune(cfg):
    """Plan, apply the choice, and say which flags it set. Every rank of a job started on
    its own (torchrun, SLURM) computes the same choice from the same inputs."""
    dist_cfg = cfg.distributed_training
    device = "cuda" if runs_on_gpu(cfg) else "cpu"
    ranks_per_host = infer_rendezvous(cfg).local_world_size
    host_gb = host_memory_gb() or float("inf")
    if dist_cfg.memory_budget_gb:
        budget = dist_cfg.memory_budget_gb
    elif device == "cuda":
        budget = gpu_memory_gb()
        if budget is None:
            raise UsageError("--auto-tune: cannot read the GPU's memory (nvidia-smi); give --memory-budget-gb")
    else:
        budget = host_gb / ranks_per_host
    plan = make_plan(cfg, device, budget, host_gb, ranks_per_host)
    if plan["choice"] is None:
        least = min(plan["tried"], key=lambda t: t[2].per_rank_gb)
        raise UsageError(
            f"--auto-tune: nothing fits in {budget:.2f} GB per rank; the least is "
            f"{least[2].per_rank_gb:.2f} GB ({flags_of(least[1], plan['given']) or 'as given'}): "
            "add ranks (--distributed-world-size) or raise --memory-budget-gb"
        )
    _, chosen, p = plan["choice"]
    flags = flags_of(chosen, plan["given"]) or "the flags as given"
    apply_choice(cfg, chosen)
    return (
        f"auto-tune: {flags} (predicted {p.per_rank_gb:.2f} GB per rank of a {budget:.2f} GB budget, "
        f"{device}, {ranks_per_host} rank(s) per host)"
    )
