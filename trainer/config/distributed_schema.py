"""The distributed_training group of the config schema (trainer/config/schema.py): how ranks
find each other, the data-parallel backend and its FSDP flags."""

from dataclasses import dataclass
from typing import Optional

from trainer.config.option_field import option as _f

DDP_BACKENDS = ("pytorch_ddp", "c10d", "legacy_ddp", "no_c10d", "fully_sharded", "hybrid_shard")


@dataclass
class DistributedTrainingConfig:
    """How ranks find each other (trainer/rendezvous.py), process groups and
    --heartbeat-timeout (parallel/ranks.py), the backend and its FSDP flags
    (parallel/parallelize.py, parallel/grad_sync.py), --auto-tune (launch/auto_tune.py)."""

    distributed_world_size: int = _f(1, "total number of ranks")
    distributed_port: int = _f(
        -1, "port for the rendezvous (-1: a free one locally, derived from SLURM_JOB_ID under SLURM)"
    )
    distributed_init_method: Optional[str] = _f(
        None, "rendezvous address, e.g. tcp://host:port (default: from torchrun or SLURM variables, else local)"
    )
    distributed_rank: int = _f(0, "rank of the first process started here, with --distributed-init-method")
    distributed_no_spawn: bool = _f(
        False,
        "run one rank in this process instead of spawning this host's: with --distributed-init-method, "
        "rank --distributed-rank on GPU --device-id; under srun, each task one rank (as under torchrun); "
        "refused with more than one rank and no way to find the others",
    )
    device_id: Optional[int] = _f(
        None,
        "the GPU (index on this node) of a process that runs one rank: alone, under torchrun, as "
        "srun's task per rank, or with --distributed-no-spawn; refused where this process spawns "
        "ranks, each of which takes its own (default: its local rank, $LOCAL_RANK or $SLURM_LOCALID; else 0)",
        alias=("--local_rank", "--local-rank"),  # torch.distributed.launch's, before torch 2.0 and since
    )
    heartbeat_timeout: int = _f(
        -1,
        "seconds a collective may wait for the other ranks before the job ends (a dead or hung rank); -1: 30 minutes",
    )
    shard_group_size: Optional[int] = _f(
        None,
        "hybrid_shard: ranks that shard one copy of the model "
        "(default: ranks per node); copies are replicated across groups",
    )
    defer_grad_sync: bool = _f(
        False,
        "with --update-freq: keep gradients unsynchronized until the last "
        "micro-batch (FSDP: unsharded, more memory; DDP: no_sync)",
    )
    ddp_backend: str = _f("pytorch_ddp", "data-parallel backend", choices=DDP_BACKENDS)
    bucket_cap_mb: int = _f(
        25,
        "pytorch_ddp: MiB of gradients per all-reduce bucket, each sent as soon as backward fills it "
        "(FSDP backends reduce-scatter per layer group instead; legacy_ddp and one rank have no buckets)",
    )
    cpu_offload: bool = _f(False, "FSDP: keep parameter shards and the optimizer step on the CPU")
    no_reshard_after_forward: bool = _f(
        False, "FSDP: keep parameters gathered from forward to backward (ZeRO-2-like: faster, more memory)"
    )
    fp32_reduce_scatter: bool = _f(False, "FSDP: reduce-scatter gradients in fp32 under --fp16/--bf16")
    use_sharded_state: bool = _f(
        False,
        "FSDP: save and load each rank's shards (shardlm's checkpoints always "
        "are: one DCP directory, each rank writing its own shards, resumable on any "
        "number of ranks)",
    )
    auto_tune: bool = _f(
        False,
        "let the memory planner (`plan`) pick the backend, resharding, activation "
        "checkpointing, offload and --update-freq that fit --memory-budget-gb; prints the choice",
    )
    memory_budget_gb: Optional[float] = _f(
        None,
        "--auto-tune: memory per rank to plan for (default: the "
        "device's memory; on a CPU the host's, shared by its ranks)",
    )
    dry_run: bool = _f(
        False,
        "check the job on fake GPUs instead of running it (a login node needs none): each rank's node and "
        "GPU, its process groups, the model sharded, and two updates of rank 0 and of the last rank with "
        "every CUDA call and collective checked; prints each rank's peak memory beside plan's and exits",
    )
    dry_run_gpus_per_node: int = _f(8, "--dry-run: GPUs per node of the job checked")
