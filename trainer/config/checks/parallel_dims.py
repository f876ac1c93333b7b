"""Checks of --model-parallel-size (tensor parallelism, trainer/parallel/tensor_parallel.py)
and --context-parallel-size (trainer/parallel/context_parallel.py): what each composes
with, and a model tensor parallelism can split into equal shares."""

from models.config import kv_heads
from trainer.config.checks.values import positive
from trainer.config.schema import uses_fsdp
from trainer.errors import UsageError

# Optimizers whose step reads a whole tensor's rows' and columns' sums or norms, which
# tensor parallelism splits across ranks: their steps are not built for those shares yet.
# (Muon's owners take whole matrices from any split: trainer/parallel/tp_matrices.py.)
WHOLE_MATRIX_OPTIMIZERS = ("adafactor", "lamb")


def check_parallel_dims(cfg):
    positive(cfg, "common.model_parallel_size", "common.context_parallel_size")
    check_context_parallel(cfg)
    check_tensor_parallel(cfg)


def check_context_parallel(cfg):
    n = cfg.common.context_parallel_size
    if n == 1:
        return
    flag = f"--context-parallel-size {n}"
    if cfg.common.compile:
        raise UsageError(f"{flag} and --compile: compiling attention's key/value gather is not supported yet")
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
    if cfg.common.compile:
        raise UsageError(f"{flag} and --compile: compiling the split layers is not supported yet; drop --compile")
    if cfg.optimizer._name in WHOLE_MATRIX_OPTIMIZERS:
        raise UsageError(
            f"{flag}: --optimizer {cfg.optimizer._name} sums whole rows and columns, which tensor parallelism splits "
            "across ranks; use adam (or another per-element optimizer), or --model-parallel-size 1"
        )
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
        ("key/value heads (--decoder-kv-heads)", kv_heads(model)),
        ("--decoder-ffn-embed-dim", model.decoder_ffn_embed_dim),
    ):
        if count % n:
            raise UsageError(f"{flag} must divide the model's {what}, {count}: each rank holds an equal share")
