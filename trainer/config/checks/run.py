"""Checks of the run's own groups: common (precision, seed, logging, --quantization-config-path),
distributed_training (backend, ranks, rendezvous, --auto-tune), checkpoint and ema."""

import importlib.util
from pathlib import Path

from trainer.config.checks.values import non_negative, positive
from trainer.config.schema import uses_fsdp
from trainer.errors import UsageError

INIT_METHOD_SCHEMES = ("tcp://", "env://", "file://")


def check_common(cfg):
    common = cfg.common
    positive(cfg, "common.log_interval")
    positive(cfg, "common.peak_tflops", optional=True)
    positive(cfg, "common.fp16_init_scale", "common.min_loss_scale")
    if not 0 <= common.seed < 2**32:
        raise UsageError(f"--seed must be in [0, 2**32), got {common.seed}")
    if common.fp16 and common.bf16:
        raise UsageError("--fp16 and --bf16 are exclusive; pick one")
    # --wandb-project needs the optional wandb package: say so before any rank starts.
    # find_spec looks for it without importing it (a slow import).
    if common.wandb_project and importlib.util.find_spec("wandb") is None:
        raise UsageError("--wandb-project needs the wandb package: pip install 'shardlm[wandb]' (or wandb)")


def check_distributed(cfg):
    distributed = cfg.distributed_training
    positive(cfg, "distributed_training.distributed_world_size", "distributed_training.bucket_cap_mb")
    sharded = uses_fsdp(cfg)
    for flag, on in (
        ("--cpu-offload", distributed.cpu_offload),
        ("--no-reshard-after-forward", distributed.no_reshard_after_forward),
        ("--fp32-reduce-scatter", distributed.fp32_reduce_scatter),
        ("--use-sharded-state", distributed.use_sharded_state),
    ):
        if on and not sharded:
            raise UsageError(
                f"{flag} needs --ddp-backend fully_sharded or hybrid_shard (got {distributed.ddp_backend})"
            )
    port, rank, world = distributed.distributed_port, distributed.distributed_rank, distributed.distributed_world_size
    if port != -1 and not 0 < port < 65536:
        raise UsageError(f"--distributed-port {port} is not a port; use 1-65535 or -1 for any free port")
    if not 0 <= rank < world:
        raise UsageError(
            f"--distributed-rank {rank} is not a rank of --distributed-world-size {world}; use 0 to {world - 1}"
        )
    init_method = distributed.distributed_init_method
    if init_method and not init_method.startswith(INIT_METHOD_SCHEMES):
        raise UsageError(
            f"--distributed-init-method {init_method!r} is not a rendezvous address; "
            "use tcp://HOST:PORT, env:// or file:///SHARED/PATH"
        )
    positive(cfg, "distributed_training.memory_budget_gb", optional=True)
    if distributed.memory_budget_gb is not None and not distributed.auto_tune:
        raise UsageError("--memory-budget-gb is the budget of --auto-tune; add --auto-tune (or run `plan`)")
    group = distributed.shard_group_size
    if group is not None and group < 1:
        raise UsageError(f"--shard-group-size must be positive, got {group}")
    if group is not None and distributed.ddp_backend != "hybrid_shard":
        raise UsageError("--shard-group-size needs --ddp-backend hybrid_shard")
    # A world size of 1 in the config may be torchrun's or SLURM's to fill in: checked there.
    if group and world > 1 and world % group:
        raise UsageError(f"--shard-group-size {group} does not divide --distributed-world-size {world}; pick a divisor")


def check_checkpoint(cfg):
    checkpoint = cfg.checkpoint
    resets = [
        flag
        for flag, on in (
            ("--reset-optimizer", checkpoint.reset_optimizer),
            ("--reset-lr-scheduler", checkpoint.reset_lr_scheduler),
            ("--reset-dataloader", checkpoint.reset_dataloader),
            ("--reset-meters", checkpoint.reset_meters),
        )
        if on
    ]
    if checkpoint.finetune_from_model and resets:
        raise UsageError(
            f"--finetune-from-model already resets the optimizer, lr schedule, data and meters; drop {resets[0]}"
        )
    non_negative(cfg, "checkpoint.save_interval_updates")
    positive(cfg, "checkpoint.save_interval")


def check_ema(cfg):
    """--store-ema's options: a decay in [0, 1], counts of updates; each other --ema-* flag
    and --validate-with-ema act only on an average that is kept, so without --store-ema
    they are refused rather than ignored."""
    ema = cfg.ema
    if not 0.0 <= ema.ema_decay <= 1.0:
        raise UsageError(f"--ema-decay must be in [0, 1], got {ema.ema_decay} (fairseq's default is 0.9999)")
    non_negative(cfg, "ema.ema_start_update")
    positive(cfg, "ema.ema_update_freq")
    if ema.store_ema:
        return
    given = [
        flag
        for flag, on in (
            ("--validate-with-ema", ema.validate_with_ema),
            ("--ema-fp32", ema.ema_fp32),
            ("--ema-seed-model", ema.ema_seed_model is not None),
            ("--ema-decay", ema.ema_decay != 0.9999),
            ("--ema-start-update", ema.ema_start_update != 0),
            ("--ema-update-freq", ema.ema_update_freq != 1),
        )
        if on
    ]
    if given:
        raise UsageError(f"{given[0]} acts on the moving average of the weights: add --store-ema (or drop {given[0]})")


def check_quantization(cfg):
    """--quantization-config-path (trainer/train/ipq.py): the file, and what iPQ does not
    compose with here."""
    common = cfg.common
    path = common.quantization_config_path
    if not path:
        return
    if not Path(path).is_file():
        raise UsageError(f"--quantization-config-path {path}: no such file")
    if common.model_parallel_size > 1 or common.context_parallel_size > 1 or common.expert_parallel_size > 1:
        raise UsageError(
            "--quantization-config-path quantizes whole weights; use it with --model-parallel-size, "
            "--context-parallel-size and --expert-parallel-size 1"
        )
    if cfg.ema.store_ema:
        raise UsageError("--quantization-config-path replaces the weights by centroids; drop --store-ema")
    if cfg.optimizer._name == "muon":
        raise UsageError("--quantization-config-path trains centroids, not matrices: use another --optimizer than muon")
