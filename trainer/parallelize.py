"""The one place that wraps the model: activation checkpointing, then FSDP2 per layer.

Order (torchtitan's): checkpoint each decoder layer → `fully_shard` each layer whose
parameter count reaches --min-params-to-wrap → `fully_shard` the root, which keeps the
tied embedding/output projection and the final norm in one group.
"""
import functools
import logging

import torch
from torch.utils.checkpoint import checkpoint

from trainer.config import SHARDED_BACKENDS

log = logging.getLogger("shardlm")


def mixed_precision_dtype(cfg):
    if cfg.common.bf16:
        return torch.bfloat16
    if cfg.common.fp16:
        return torch.float16
    return None


def apply_activation_checkpointing(model, offload, device):
    """Recompute each layer in backward (non-reentrant). The layer's own forward is
    replaced, so FSDP's hooks on the layer still run around it and the state-dict keys
    stay those of the bare model."""
    if offload and device.type != "cuda":
        log.warning("--offload-activations: activations already live in host memory on a CPU-only host; "
                    "it has no effect here beyond --checkpoint-activations")
        offload = False
    for layer in model.layers:
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if offload:
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


def shard_model(model, cfg, env):
    """FSDP2: one unit per decoder layer (above --min-params-to-wrap), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    d = cfg.distributed_training
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    kwargs = dict(mesh=mesh, reshard_after_forward=not d.no_reshard_after_forward)
    param_dtype = mixed_precision_dtype(cfg)
    if param_dtype is not None:
        reduce_dtype = torch.float32 if d.fp32_reduce_scatter else param_dtype
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if d.cpu_offload:
        # Pinned memory needs an accelerator; without one the policy must not pin.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
        if env.device.type == "cpu":
            log.warning("--cpu-offload: parameters already live in host memory on a CPU-only host; "
                        "it runs, with no memory effect here")
    for layer in model.layers:
        if sum(p.numel() for p in layer.parameters()) >= cfg.model.min_params_to_wrap:
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def parallelize(model, cfg, env):
    """Wrap `model` for the configured backend; returns the model to train."""
    m = cfg.model
    if m.checkpoint_activations or m.offload_activations:
        apply_activation_checkpointing(model, m.offload_activations, env.device)
    if cfg.distributed_training.ddp_backend in SHARDED_BACKENDS:
        return shard_model(model, cfg, env)
    return model  # one rank, pytorch_ddp/legacy_ddp: nothing to synchronize


def uses_fsdp(cfg):
    return cfg.distributed_training.ddp_backend in SHARDED_BACKENDS
