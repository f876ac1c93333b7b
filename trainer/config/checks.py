"""Checks of a composed config, before anything is built or written.

Each problem is one UsageError line that names the fix. Runs on the config, so a bad
value is caught the same way whether it came from a flag, a file or an override.
"""
import math

from trainer.config.schema import uses_fsdp
from trainer.errors import UsageError
from trainer.config.flags import flag_name, iter_fields

INIT_METHOD_SCHEMES = ("tcp://", "env://", "file://")


def check_config(cfg):
    for group, f in iter_fields():
        value = cfg[group][f.name]
        choices = f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise UsageError(f"{flag_name(f)} {value!r} is not one of: {', '.join(choices)}")
        # nan passes every comparison below, and no setting means anything at inf.
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag_name(f)} must be a finite number, got {value}")
    m, d, o, t = cfg.model, cfg.distributed_training, cfg.optimization, cfg.task
    _positive(cfg, "model.decoder_layers", "model.decoder_embed_dim", "model.decoder_ffn_embed_dim",
              "model.decoder_attention_heads", "task.tokens_per_sample", "optimization.update_freq",
              "common.log_interval", "distributed_training.distributed_world_size", "task.dict_size",
              "task.dataset_size", "dataset.validate_interval")
    _positive(cfg, "dataset.batch_size", "dataset.max_tokens", "dataset.batch_size_valid",
              "dataset.max_tokens_valid", "model.max_target_positions", "common.peak_tflops",
              "dataset.max_valid_steps", optional=True)
    _positive(cfg, "common.fp16_init_scale", "common.min_loss_scale")
    _non_negative(cfg, "optimization.lr", "optimization.max_update", "optimization.max_epoch",
                  "optimization.clip_norm", "optimizer.weight_decay", "dataset.validate_interval_updates",
                  "lr_scheduler.warmup_updates", "model.min_params_to_wrap")
    for key in ("model.dropout", "model.attention_dropout", "model.activation_dropout"):
        if not 0.0 <= _get(cfg, key) < 1.0:
            raise UsageError(f"{key} must be in [0, 1), got {_get(cfg, key)}")
    if m.decoder_embed_dim % m.decoder_attention_heads:
        raise UsageError(f"--decoder-attention-heads {m.decoder_attention_heads} does not divide "
                         f"--decoder-embed-dim {m.decoder_embed_dim}; pick heads that divide it")
    if len(cfg.optimizer.adam_betas) != 2:
        raise UsageError(f"--adam-betas needs two numbers like \"(0.9, 0.98)\", got {list(cfg.optimizer.adam_betas)}")
    if not all(0.0 <= b < 1.0 for b in cfg.optimizer.adam_betas):
        raise UsageError(f"--adam-betas must each be in [0, 1), got {list(cfg.optimizer.adam_betas)}")
    _non_negative(cfg, "optimizer.adam_eps", "optimizer.momentum", "lr_scheduler.power", "lr_scheduler.end_learning_rate",
                  "lr_scheduler.min_lr")
    if cfg.lr_scheduler.warmup_init_lr < 0 and cfg.lr_scheduler.warmup_init_lr != -1:
        raise UsageError(f"--warmup-init-lr must be >= 0 (or -1: start at 0), got {cfg.lr_scheduler.warmup_init_lr}")
    if not 0 <= cfg.common.seed < 2 ** 32:
        raise UsageError(f"--seed must be in [0, 2**32), got {cfg.common.seed}")
    if cfg.common.fp16 and cfg.common.bf16:
        raise UsageError("--fp16 and --bf16 are exclusive; pick one")
    sharded = uses_fsdp(cfg)
    for flag, on in (("--cpu-offload", d.cpu_offload), ("--no-reshard-after-forward", d.no_reshard_after_forward),
                     ("--fp32-reduce-scatter", d.fp32_reduce_scatter)):
        if on and not sharded:
            raise UsageError(f"{flag} needs --ddp-backend fully_sharded or hybrid_shard "
                             f"(got {d.ddp_backend})")
    if d.distributed_port != -1 and not 0 < d.distributed_port < 65536:
        raise UsageError(f"--distributed-port {d.distributed_port} is not a port; use 1-65535 or -1 for any free port")
    if not 0 <= d.distributed_rank < d.distributed_world_size:
        raise UsageError(f"--distributed-rank {d.distributed_rank} is not a rank of --distributed-world-size "
                         f"{d.distributed_world_size}; use 0 to {d.distributed_world_size - 1}")
    if d.distributed_init_method and not d.distributed_init_method.startswith(INIT_METHOD_SCHEMES):
        raise UsageError(f"--distributed-init-method {d.distributed_init_method!r} is not a rendezvous address; "
                         "use tcp://HOST:PORT, env:// or file:///SHARED/PATH")
    _positive(cfg, "distributed_training.memory_budget_gb", optional=True)
    if d.memory_budget_gb is not None and not d.auto_tune:
        raise UsageError("--memory-budget-gb is the budget of --auto-tune; add --auto-tune (or run `plan`)")
    if d.shard_group_size is not None and d.shard_group_size < 1:
        raise UsageError(f"--shard-group-size must be positive, got {d.shard_group_size}")
    if d.shard_group_size is not None and d.ddp_backend != "hybrid_shard":
        raise UsageError("--shard-group-size needs --ddp-backend hybrid_shard")
    # A world size of 1 in the config may be torchrun's or SLURM's to fill in: checked there.
    if d.shard_group_size and d.distributed_world_size > 1 and d.distributed_world_size % d.shard_group_size:
        raise UsageError(f"--shard-group-size {d.shard_group_size} does not divide --distributed-world-size "
                         f"{d.distributed_world_size}; pick a divisor")
    ck = cfg.checkpoint
    resets = [f for f, on in (("--reset-optimizer", ck.reset_optimizer), ("--reset-lr-scheduler", ck.reset_lr_scheduler),
                              ("--reset-dataloader", ck.reset_dataloader), ("--reset-meters", ck.reset_meters)) if on]
    if ck.finetune_from_model and resets:
        raise UsageError(f"--finetune-from-model already resets the optimizer, lr schedule, data and meters; "
                         f"drop {resets[0]}")
    _non_negative(cfg, "checkpoint.save_interval_updates")
    _positive(cfg, "checkpoint.save_interval")
    if cfg.dataset.batch_size is None and cfg.dataset.max_tokens is None:
        raise UsageError("set --batch-size or --max-tokens (sequences or tokens per batch per rank)")
    for flag, max_tokens in (("--max-tokens", cfg.dataset.max_tokens), ("--max-tokens-valid", cfg.dataset.max_tokens_valid)):
        if max_tokens is not None and max_tokens < t.tokens_per_sample:  # fairseq: "exceeds max_tokens limit"
            raise UsageError(f"{flag} {max_tokens} is smaller than one sample (--tokens-per-sample "
                             f"{t.tokens_per_sample}); raise it or lower --tokens-per-sample")
    if t._name == "dummy_lm":
        if t.data:
            raise UsageError(f"--task dummy_lm makes random tokens and reads no DATA ({t.data}); drop DATA or the task")
        if t.dict_size <= 4:
            raise UsageError(f"--dict-size {t.dict_size} leaves no tokens beside the 4 special symbols; use at least 5")
    if cfg.lr_scheduler._name == "polynomial_decay" and not (cfg.lr_scheduler.total_num_update or o.max_update):
        raise UsageError("--lr-scheduler polynomial_decay needs --total-num-update or --max-update")
    if m.max_target_positions is not None and t.tokens_per_sample > m.max_target_positions:
        raise UsageError(f"--tokens-per-sample {t.tokens_per_sample} exceeds the model's "
                         f"--max-target-positions {m.max_target_positions}; lower one or raise the other")


def _get(cfg, key):
    group, name = key.split(".")
    return cfg[group][name]


def _positive(cfg, *keys, optional=False):
    for key in keys:
        v = _get(cfg, key)
        if v is None and optional:
            continue
        if v is None or v <= 0:
            raise UsageError(f"{key} must be positive, got {v}")


def _non_negative(cfg, *keys):
    for key in keys:
        if _get(cfg, key) < 0:
            raise UsageError(f"{key} must be >= 0, got {_get(cfg, key)}")
