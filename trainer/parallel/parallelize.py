"""The one place that wraps the model for its backend, and says how gradients sync.

FSDP order (torchtitan's): checkpoint each decoder layer → compile it (--compile) →
`fully_shard` each layer whose parameter count reaches --min-params-to-wrap →
`fully_shard` the root, which keeps the tied embedding/output projection and the final
norm in one group. Sharded models are built on the meta device and each rank initializes
only its shards, to exactly the values one process with the same --seed would have.
"""

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from trainer.config.schema import ddp_backend, uses_fsdp
from trainer.cpu.gloo_comms import prefetch_in_background, use_gloo_fast_comms
from trainer.errors import UsageError
from trainer.parallel.experts import apply_expert_parallel
from trainer.parallel.grad_sync import EarlyGather, GradSync
from trainer.parallel.tensor_parallel import (
    apply_tensor_parallel,
    fsdp_placement_under_tensor_parallelism,
    row_orders,
)

log = logging.getLogger("shardlm")


def mixed_precision_dtype(common):
    """The compute dtype of --bf16 / --fp16 (the `common` config group), None for fp32."""
    if common.bf16:
        return torch.bfloat16
    if common.fp16:
        return torch.float16
    return None


@dataclass(frozen=True)
class Sharding:
    """How shard_model wraps a model: plain values parallelize() reads from the config."""

    hybrid: bool  # --ddp-backend hybrid_shard: a (replicate, shard) mesh
    shard_group_size: Optional[int]  # ranks per shard group (hybrid; None: the ranks of a node)
    reshard_after_forward: bool
    param_dtype: Optional[torch.dtype]  # FSDP2's MixedPrecisionPolicy; None: fp32, no policy
    reduce_dtype: Optional[torch.dtype]
    cpu_offload: bool
    min_params_to_wrap: int
    # An adaptive input or softmax multiplies by its projections in backward,
    # --quant-noise-scalar's clamps read the embedding and output weights, and dpo's per-row
    # loss recomputes its logits in backward (models/linear_cross_entropy.py): the root,
    # which holds them, stays gathered for backward.
    root_read_in_backward: bool
    expert_parallel_size: int = 1  # --expert-parallel-size: the ranks each layer's experts are split over


def sharding_of(cfg):
    """The Sharding a composed config asks for."""
    dist_cfg = cfg.distributed_training
    param_dtype = mixed_precision_dtype(cfg.common)
    reduce_dtype = None if param_dtype is None else (torch.float32 if dist_cfg.fp32_reduce_scatter else param_dtype)
    return Sharding(
        hybrid=dist_cfg.ddp_backend == "hybrid_shard",
        shard_group_size=dist_cfg.shard_group_size,
        reshard_after_forward=not dist_cfg.no_reshard_after_forward,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        cpu_offload=dist_cfg.cpu_offload,
        min_params_to_wrap=cfg.model.min_params_to_wrap,
        root_read_in_backward=cfg.model.adaptive_input
        or cfg.model.adaptive_softmax_cutoff is not None
        or cfg.model.quant_noise_scalar > 0
        or cfg.task._name == "dpo",
        expert_parallel_size=cfg.common.expert_parallel_size,
    )


def apply_activation_checkpointing(model, offload, env):
    """Recompute each layer in backward (non-reentrant). The layer's own forward is
    replaced, so FSDP's hooks on the layer still run around it and the state-dict keys
    stay those of the bare model."""
    if offload and env.device.type != "cuda":
        if env.is_master:  # the same on every rank: say it once
            log.warning(
                "--offload-activations: activations already live in host memory on a CPU-only host; "
                "it has no effect here beyond --checkpoint-activations"
            )
        offload = False
    for layer in model.layers:
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if offload:
                with save_on_host():
                    return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


class save_on_host(torch.autograd.graph.saved_tensors_hooks):
    """torch's save_on_cpu(pin_memory=True) for a GPU rank, DTensors included: torch's copies
    each saved tensor into a plain pinned one, which DTensor refuses ("got mixed torch.Tensor
    and DTensor"), and a layer's input under tensor parallelism is one (its sequence shard).
    A DTensor's local shard goes to pinned host memory and comes back wrapped as it was."""

    def __init__(self):
        def pack(tensor):
            spec = tensor._spec if isinstance(tensor, DTensor) else None
            local = tensor._local_tensor if spec is not None else tensor
            host = torch.empty(local.size(), dtype=local.dtype, layout=local.layout, pin_memory=True)
            host.copy_(local, non_blocking=True)
            return local.device, host, spec, tensor.requires_grad

        def unpack(packed):
            device, host, spec, requires_grad = packed
            local = host.to(device, non_blocking=True)
            return local if spec is None else DTensor(local, spec, requires_grad=requires_grad)

        super().__init__(pack, unpack)


def compile_layers(model, forwards=False):
    """`torch.compile` each decoder layer in place (torchtitan's per-block compile): all
    layers share one class, so one compiled graph serves every layer. `Module.compile`
    keeps the layer itself in the model, so state-dict keys, and so checkpoints, are those
    of the bare model: a run may resume with or without --compile. FSDP2's hooks around
    the layer stay outside the compiled graph (dynamo skips them by default).
    forwards: compile each layer's forward alone (its hooks, and a checkpoint wrapped around
    it afterwards, run eagerly)."""
    for layer in model.layers:
        if forwards:
            layer.forward = torch.compile(layer.forward)
        else:
            layer.compile()


def device_meshes(hybrid, shard_group_size, env):
    """(FSDP's mesh, the tensor-parallel mesh or None): 1-D for fully_sharded, (replicate,
    shard) for hybrid_shard; under --model-parallel-size N both are dimensions of one mesh
    whose last, "tp", holds N consecutive ranks (a node's, so its traffic stays inside)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp, tp = env.world_size // env.tp, env.tp
    if not hybrid:
        if tp == 1:
            return init_device_mesh(env.device.type, (env.world_size,)), None
        mesh = init_device_mesh(env.device.type, (dp, tp), mesh_dim_names=("shard", "tp"))
        return mesh["shard"], mesh["tp"]
    # --shard-group-size counts ranks: a shard group holds whole tensor-parallel groups
    shard = (shard_group_size or env.local_world_size) // tp
    if not shard or dp % shard:
        given = shard_group_size or env.local_world_size
        raise UsageError(
            f"--shard-group-size {given} does not divide the world size {env.world_size}"
            if tp == 1
            else f"--shard-group-size {given} must be a multiple of --model-parallel-size {tp} "
            f"and divide the world size {env.world_size}"
        )
    if tp == 1:
        return init_device_mesh(env.device.type, (dp // shard, shard), mesh_dim_names=("replicate", "shard")), None
    mesh = init_device_mesh(env.device.type, (dp // shard, shard, tp), mesh_dim_names=("replicate", "shard", "tp"))
    return mesh["replicate", "shard"], mesh["tp"]


def token_mesh(fsdp_mesh, tp_mesh, env):
    """FSDP's mesh of what each rank computes on tokens of its own: the mixture-of-experts
    layers' routers and experts, which tensor parallelism does not split, but runs on each
    rank's own sequence positions (trainer/parallel/tensor_parallel.py). Without tensor
    parallelism that is FSDP's mesh; with it, the data-parallel and tensor-parallel ranks
    together: every rank ("tokens"), or (HSDP) HSDP's replicas × the rest."""
    if tp_mesh is None:
        return fsdp_mesh
    from torch.distributed.device_mesh import init_device_mesh

    if fsdp_mesh.ndim == 1:
        return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("tokens",))
    replicas = fsdp_mesh.size(0)
    return init_device_mesh(
        env.device.type, (replicas, env.world_size // replicas), mesh_dim_names=("replicate", "tokens")
    )


def expert_meshes(fsdp_mesh, n, env):
    """(the expert-parallel mesh, FSDP's mesh of the experts) under --expert-parallel-size n:
    n consecutive ranks of a shard group split the experts ("ep"); the ranks at the same place
    of the shard group's other expert groups ("efsdp"), and HSDP's replicas, shard them.
    fsdp_mesh: token_mesh's (under tensor parallelism, its ranks are shard group ranks too)."""
    from torch.distributed.device_mesh import init_device_mesh

    if env.world_size % n:
        raise UsageError(f"--expert-parallel-size {n} must divide the world size {env.world_size}")
    if fsdp_mesh.ndim == 1:
        mesh = init_device_mesh(env.device.type, (env.world_size // n, n), mesh_dim_names=("efsdp", "ep"))
        return mesh["ep"], mesh["efsdp"]
    replicas, shard = fsdp_mesh.size(0), fsdp_mesh.size(1)
    if shard % n:
        raise UsageError(f"--expert-parallel-size {n} must divide the shard group's {shard} ranks")
    mesh = init_device_mesh(env.device.type, (replicas, shard // n, n), mesh_dim_names=("replicate", "efsdp", "ep"))
    return mesh["ep"], mesh["replicate", "efsdp"]


def shard_model(model, sharding, env):
    """FSDP2: one unit per decoder layer (above --min-params-to-wrap), then the root.
    Returns the model, on CPU ranks the reduce-scatter to wait for (else None), the
    EarlyGather of the first units (None on one rank: nothing is gathered), and on CPU
    ranks {layer id: unit} of the layers chained for forward prefetch (else None)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh, tp_mesh = device_meshes(sharding.hybrid, sharding.shard_group_size, env)
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
        if not sharding.hybrid:
            # FSDP's shard group holds the ranks of distinct tokens (env.data_group's): token
            # counts and losses are summed on it, so that a GPU holds one NCCL communicator
            # over those ranks, not two (the one made first is never used, so never built).
            env.data_group = mesh.get_group()
    kwargs = dict(mesh=mesh, reshard_after_forward=sharding.reshard_after_forward)
    if tp_mesh is not None:
        kwargs["shard_placement_fn"] = fsdp_placement_under_tensor_parallelism(mesh)
    if sharding.param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=sharding.param_dtype, reduce_dtype=sharding.reduce_dtype)
    if sharding.cpu_offload:
        # Pinned memory needs an accelerator; without one the policy must not pin.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
        if env.device.type == "cpu" and env.is_master:
            log.warning(
                "--cpu-offload: parameters already live in host memory on a CPU-only host; "
                "it runs, with no memory effect here"
            )
    experts = shard_experts(model, sharding.expert_parallel_size, mesh, tp_mesh, kwargs, env)
    units = [
        layer for layer in model.layers if sum(p.numel() for p in layer.parameters()) >= sharding.min_params_to_wrap
    ]
    for i, unit in enumerate(units):
        # The last layer's backward starts right after its forward: resharding it in
        # between would only all-gather the same parameters again (torchtitan does the same).
        last = i == len(units) - 1
        fully_shard(unit, **{**kwargs, "reshard_after_forward": kwargs["reshard_after_forward"] and not last})
    # The root's own weights (the embeddings and the output projection, tied or not) are not
    # read in backward: the loss makes their gradient in forward (models/linear_cross_entropy
    # .py) and an embedding's backward needs only the ids. So the root gives its gathered
    # weights back after forward and is not gathered for backward (FSDP2's
    # set_unshard_in_backward), which saves their gathered size on every rank through all of
    # backward. Nor is the weight of --quant-noise-pq's quant_noise layer (in the root): its
    # backward reads the noised copy its forward made. The norms outside the layers do read
    # their weights in backward: each is a unit of its own, gathered from its forward to its
    # backward (a few KB), and so are
    # project_in_dim / project_out_dim (--decoder-input-dim / --decoder-output-dim). Layers left
    # unwrapped (--min-params-to-wrap) are in the root and need it gathered, as before.
    # An adaptive input or softmax (tied or not: its tables and projections stay in the
    # root, one group, as any tied pair must) multiplies by its projections in backward:
    # the root stays gathered for it.
    norms = []
    root_free_in_backward = len(units) == len(model.layers) and not sharding.root_read_in_backward
    if root_free_in_backward:
        norms = [
            m
            for m in (model.layernorm_embedding, model.layer_norm, model.project_in_dim, model.project_out_dim)
            if m is not None
        ]
        for norm in norms:
            fully_shard(norm, **{**kwargs, "reshard_after_forward": False})
    # Otherwise the root is used last in forward and first in backward: never resharded in
    # between, as FSDP2 does for a root by default.
    fully_shard(model, **{**kwargs, "reshard_after_forward": root_free_in_backward})
    model.set_unshard_in_backward(not root_free_in_backward)
    for unit in experts + units + norms + [model]:
        # Plain sums across ranks: the trainer divides the gradients by the update's token
        # count over all ranks after backward (in its clip pass), so an average would only
        # add a pass over the grads.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    background = prefetch = None
    # The CPU ranks' own collectives take over FSDP's on a 1-D or HSDP mesh; under tensor
    # parallelism FSDP's run as they are.
    if env.device.type == "cpu" and env.world_size > 1 and tp_mesh is None and not experts:
        can_defer = not sharding.hybrid and sharding.reduce_dtype in (None, torch.float32)
        background = use_gloo_fast_comms(model, units + norms, can_defer)
        prefetch_in_background(model, units)
        prefetch = {i: layer for i, layer in enumerate(model.layers) if any(layer is u for u in units)}
    # Under LayerDrop the next forward may skip the first layer: its early gather is then
    # dropped unused at the end of backward (FSDP2's finalize_backward), and stays correct,
    # since a skipped layer gets no gradient and so no step before it next runs.
    early = EarlyGather(model, units) if env.world_size > 1 else None
    return model, background, early, prefetch


def shard_experts(model, ep, mesh, tp_mesh, kwargs, env):
    """The mixture-of-experts layers' FSDP units, before their layers' (the policy's and dpo's
    reference alike); returns them. Under --expert-parallel-size ep each layer's experts are
    split over ep ranks and sharded over the ranks that hold the same ones. Under tensor
    parallelism each layer's router (and its experts, unless split already) is a unit of its
    own on token_mesh: its gradients are summed over the tensor-parallel ranks too, whose
    positions it routed. Otherwise the router and experts stay in their layer's unit."""
    from torch.distributed.fsdp import fully_shard

    units, moe_mesh = [], token_mesh(mesh, tp_mesh, env)
    if ep > 1:
        ep_mesh, expert_mesh = expert_meshes(moe_mesh, ep, env)
        units = apply_expert_parallel(model, ep_mesh)
        for unit in units:
            fully_shard(unit, **{**kwargs, "mesh": expert_mesh})
    if tp_mesh is not None:
        routers = [layer.moe for layer in model.layers if layer.moe is not None]
        for unit in routers:
            fully_shard(unit, **{**kwargs, "mesh": moe_mesh})
        units += routers
    return units


@torch.no_grad()
def materialize_shards(model, shard_device, compute_device, seed):
    """Allocate this rank's shards on `shard_device` and give them their single-process
    initial values for `seed`: each parameter is built whole on `compute_device`, one at a
    time, and only the local shard is kept."""
    from torch.distributed.tensor import distribute_tensor

    model.to_empty(device=shard_device)
    # to_empty left the buffers unset too, and FSDP does not move them off the host under
    # --cpu-offload: they go where the forward reads them
    model.init_buffers(compute_device)
    orders = row_orders(model)  # tensor parallelism's order of qkv_proj's and fc1's rows
    for name, p in model.named_parameters():
        full = torch.empty(p.shape, dtype=p.dtype, device=compute_device)
        model.init_parameter(name, full, seed)
        if name in orders:
            full = full[orders[name].to(compute_device)]
        p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())


def parallelize(model, cfg, env):
    """Wrap `model` (built on the meta device when sharded) for the configured backend;
    returns the model to train and its GradSync. The one function here that reads the
    config: the others take plain values."""
    model_cfg, dist_cfg = cfg.model, cfg.distributed_training
    # --offload-activations implies --checkpoint-activations (set when the config is composed).
    # Under tensor or context parallelism a layer's checkpointed region holds collectives and
    # DTensor redistributions, which torch.compile's traced checkpoint does not take (a mesh
    # among its saved values): the layers' forwards are compiled, and checkpointed eagerly.
    compile_inside = cfg.common.compile and model_cfg.checkpoint_activations and (env.tp > 1 or env.cp > 1)
    if compile_inside:
        compile_layers(model, forwards=True)
    if model_cfg.checkpoint_activations:
        apply_activation_checkpointing(model, model_cfg.offload_activations, env)
    if cfg.common.compile:
        if not compile_inside:
            compile_layers(model)
        if env.is_master:
            log.info(
                f"--compile: {len(model.layers)} decoder layers compiled with torch.compile (inductor); "
                "the first updates, and the first validation, include compiling"
            )
    backend, sharded = ddp_backend(cfg), uses_fsdp(cfg)
    background_reduce = early_gather = prefetch = None
    if sharded:
        sharding = sharding_of(cfg)
        model, background_reduce, early_gather, prefetch = shard_model(model, sharding, env)
        materialize_shards(model, "cpu" if sharding.cpu_offload else env.device, env.device, cfg.common.seed)
    elif env.world_size > 1 and backend == "pytorch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        # LayerDrop leaves the skipped layers without gradients, which DDP refuses unless it
        # looks for unused parameters; every rank skips the same ones (trainer.micro_batch_seed),
        # so their gradients stay None everywhere, as in one process.
        model = DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            find_unused_parameters=model_cfg.decoder_layerdrop > 0,
            bucket_cap_mb=dist_cfg.bucket_cap_mb,
        )
    no_buckets = bucket_cap_mb_unused(cfg, env.world_size)
    if no_buckets and env.is_master:  # the same on every rank: say it once
        log.info(no_buckets)
    grad_sync = GradSync(
        model, env, backend, sharded, dist_cfg.defer_grad_sync, background_reduce, early_gather, prefetch
    )
    return model, grad_sync


def freeze(model, cfg, env):
    """A model that only runs forward without gradients (--task dpo's reference): under FSDP
    sharded as the policy is, one unit per decoder layer then the root, each gathered for
    its forward and resharded after it, so a rank holds its shards and one layer at a time;
    otherwise each rank's own copy. No gradients, so no optimizer state and no reduction."""
    model.requires_grad_(False)
    if uses_fsdp(cfg):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        sharding = sharding_of(cfg)
        mesh, tp_mesh = device_meshes(sharding.hybrid, sharding.shard_group_size, env)
        if tp_mesh is not None:
            apply_tensor_parallel(model, tp_mesh)
        kwargs = dict(mesh=mesh, reshard_after_forward=True)
        if tp_mesh is not None:
            kwargs["shard_placement_fn"] = fsdp_placement_under_tensor_parallelism(mesh)
        if sharding.param_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=sharding.param_dtype)
        if sharding.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
        shard_experts(model, sharding.expert_parallel_size, mesh, tp_mesh, kwargs, env)
        for layer in model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        materialize_shards(model, "cpu" if sharding.cpu_offload else env.device, env.device, cfg.common.seed)
    return model.eval()


def bucket_cap_mb_unused(cfg, world_size):
    """Why a --bucket-cap-mb other than fairseq's 25 does nothing in this run (a line to log
    once), or None when it sizes DDP's buckets or was left at its default."""
    value = cfg.distributed_training.bucket_cap_mb
    if value == 25:
        return None
    if uses_fsdp(cfg):
        why = "FSDP2 reduce-scatters each layer group's gradients in one collective as its backward ends: no buckets"
    elif world_size == 1:
        why = "one rank has no gradients to all-reduce"
    elif ddp_backend(cfg) == "legacy_ddp":
        why = "legacy_ddp all-reduces each gradient on its own after backward"
    else:
        return None
    return f"--bucket-cap-mb {value} has no effect with --ddp-backend {cfg.distributed_training.ddp_backend}: {why}"


def local_rows(p):
    """(this rank's part of parameter p, the index of its first row in the whole): FSDP
    shards by rows (dim 0), so a rank's part is whole rows; an unsharded one is all of it."""
    if not hasattr(p, "to_local"):
        return p.data, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = p.to_local()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape) != tuple(local.shape) or any(offset[1:]):
        raise RuntimeError(
            f"unexpected shard layout of a {list(p.shape)} parameter: local {list(local.shape)} at {list(offset)}"
        )
    return local, offset[0]


def sharded_bytes(model):
    """Bytes of parameters this rank holds (its shards under FSDP)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total
