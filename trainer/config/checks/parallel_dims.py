"""Checks of --model-parallel-size (tensor parallelism, trainer/parallel/tensor_parallel.py)
and --context-parallel-size (trainer/parallel/context_parallel.py): what each composes
with, and a model tensor parallelism can split into equal shares."""

from models.config import head_dim, kv_heads, moe_layers
from trainer.config.checks.values import positive
from trainer.config.schema import uses_fsdp
from trainer.errors import UsageError


def check_parallel_dims(cfg):
    positive(cfg, "common.model_parallel_size", "common.context_parallel_size", "common.expert_parallel_size")
    check_context_parallel(cfg)
    check_tensor_parallel(cfg)
    check_expert_parallel(cfg)


def check_expert_parallel(cfg):
    n = cfg.common.expert_parallel_size
    if n == 1:
        return
    flag, model = f"--expert-parallel-size {n}", cfg.model
    if not moe_layers(model):
        raise UsageError(f"{flag} splits a mixture of experts' experts; this model has none (--moe-expert-count)")
    if not uses_fsdp(cfg):
        raise UsageError(
            f"{flag} composes with --ddp-backend fully_sharded or hybrid_shard, which shard the rest "
            f"(got {cfg.distributed_training.ddp_backend})"
        )
    if model.moe_expert_count % n:
        raise UsageError(f"{flag} must divide --moe-expert-count {model.moe_expert_count}: each rank holds as many")
    if cfg.common.context_parallel_size > 1:
        raise UsageError(f"{flag} with context parallelism is not built yet; set --context-parallel-size 1")
    distributed = cfg.distributed_training
    world = distributed.distributed_world_size
    if world > 1 and world % n:
        raise UsageError(f"{flag} must divide --distributed-world-size {world}")
    group = distributed.shard_group_size
    if distributed.ddp_backend == "hybrid_shard" and group and group % n:
        raise UsageError(f"{flag} must divide --shard-group-size {group}: an expert group lies in one shard group")


def check_context_parallel(cfg):
    n = cfg.common.context_parallel_size
    if n == 1:
        return
    flag = f"--context-parallel-size {n}"
    world, tp = cfg.distributed_training.distributed_world_size, cfg.common.model_parallel_size
    if world > 1 and world % (n * tp):
        raise UsageError(f"{flag} × --model-parallel-size {tp} must divide --distributed-world-size {world}")


def check_tensor_parallel(cfg):
    n = cfg.common.model_parallel_size
    if n == 1:
        return
    flag = f"--model-parallel-size {n}"
    distributed, model = cfg.distributed_training, cfg.model
    if not uses_fsdp(cfg):
        raise UsageError(
            f"{flag} composes with --ddp-backend fully_sharded or hybrid_shard, which shard over the other ranks "
            f"(got {distributed.ddp_backend})"
        )
    world = distributed.distributed_world_size
    if world > 1 and world % n:
        raise UsageError(f"{flag} must divide --distributed-world-size {world}")
    check_model_splits(model, n, flag)


def check_model_splits(model, n, flag):
    """Refuse, in one line, a model (its config) tensor parallelism of degree n cannot split.
    A saved config may predate an option: it reads as off."""
    if getattr(model, "adaptive_input", False) or getattr(model, "adaptive_softmax_cutoff", None) is not None:
        raise UsageError(
            f"{flag}: the adaptive input and softmax cut the vocabulary into bands of other widths, which are "
            "not split across ranks; train them with --model-parallel-size 1"
        )
    if getattr(model, "quant_noise_pq", 0) > 0 or getattr(model, "quant_noise_scalar", 0) > 0:
        raise UsageError(f"{flag}: Quant-Noise draws its noise over whole weights; leave it at 1")
    if getattr(model, "scale_fc", False):
        raise UsageError(
            f"{flag}: --scale-fc normalizes the feed-forward's hidden width, which tensor parallelism splits "
            "across ranks; drop one of them"
        )
    for what, count in (
        ("--decoder-attention-heads", model.decoder_attention_heads),
        ("--decoder-ffn-embed-dim", model.decoder_ffn_embed_dim),
    ):
        if count % n:
            raise UsageError(f"{flag} must divide the model's {what}, {count}: each rank holds an equal share")
    kv, dim = kv_heads(model), head_dim(model)
    if not splits_key_value_heads(kv, dim, n):
        raise UsageError(
            f"{flag} must divide the model's key/value heads (--decoder-kv-heads), {kv}, or be a multiple of "
            f"them that divides the head dimension {dim} × {kv}: each rank holds an equal share of them"
        )


def splits_key_value_heads(kv, dim, n):
    """Whether n tensor-parallel ranks split kv key/value heads of `dim` channels: whole heads
    each, or (fewer heads than ranks) each head replicated over n / kv ranks that hold an equal
    share of its rows (trainer/parallel/tensor_parallel.py share_key_value_heads)."""
    return kv % n == 0 or (n % kv == 0 and (kv * dim) % n == 0)
