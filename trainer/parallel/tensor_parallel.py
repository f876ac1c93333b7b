"""Tensor parallelism with sequence parallelism (Megatron-LM's layout, on torch's DTensor
styles), applied to the bare model before FSDP shards it over the data-parallel ranks.

Within a decoder layer, on the `tp` mesh dimension:
- attention's qkv_proj is column-parallel by heads: each process holds its query heads
  and the key/value heads they read (grouped-query attention's groups stay whole), and
  out_proj is row-parallel. With fewer key/value heads than processes, each key/value head
  is replicated over the processes whose queries read it (`share_key_value_heads`);
- the feed-forward's fc1 (gate and up under --gated-ffn) is column-parallel, fc2
  row-parallel;
- between them the residual stream, its norms and its dropout are split by sequence
  positions: an all-gather before each column-parallel projection, a reduce-scatter after
  each row-parallel one.
A mixture-of-experts layer's router and experts (models/moe.py) are not split: each process
routes its own sequence positions through whole experts, as a data-parallel rank routes its
own tokens, so that the layer needs no collective in forward and no process computes what
another does. To them the processes of the group are data-parallel ranks: FSDP shards them
over the data-parallel and tensor-parallel ranks together (trainer/parallel/parallelize.py),
expert parallelism draws its ranks from both, and the router's statistics are summed over
the group (`route_own_positions`), whose processes see the same micro-batch.
The token embedding and the output projection are split by vocabulary rows: the embedding
sums the processes' rows (an all-reduce), and the loss is computed on the vocabulary shards
(models/linear_cross_entropy.py) without ever holding B×T×V logits. What runs before the
first layer (positions, the embedding norm) runs whole on every process.

qkv_proj and a gated fc1 stack several matrices by rows (DecoderLayer.weight_blocks): a
plain split of their rows would give a process some of q's rows and none of v's. So under
tensor parallelism their rows are ordered per process (`tp_row_order`): process r's
query heads, then its key heads, then its value heads. Checkpoints keep the model's own
order (trainer/checkpoint/tp_rows.py maps between them), so a run resumes on any layout.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def tp_row_order(blocks, n):
    """The rows of a parameter stacking `blocks` (row counts, in order) as n processes hold
    them under tensor parallelism: process 0's share of each block, then process 1's, …
    Returns a LongTensor `order` with tp_layout = model_layout[order]."""
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    order = [
        start + r * (size // n) + i for r in range(n) for start, size in zip(starts, blocks) for i in range(size // n)
    ]
    return torch.tensor(order, dtype=torch.long)


def runs(order, start, length):
    """[(local row, model row, count)] of rows start … start+length-1 of the process-ordered
    layout, as runs of consecutive rows of the model's order."""
    rows = order[start : start + length].tolist()
    out = []
    for i, row in enumerate(rows):
        if out and out[-1][1] + out[-1][2] == row:
            local, first, count = out[-1]
            out[-1] = (local, first, count + 1)
        else:
            out.append((i, row, 1))
    return out


def local_pieces(p, order=None):
    """[(a view of this rank's part of parameter p, its first row in the model's order, row
    count, its columns or None for all)]: FSDP gives a rank rows, tensor parallelism rows or
    columns, and of a reordered parameter (`order`: row_orders) runs of the model's rows."""
    if not isinstance(p, DTensor):
        return [(p.data, 0, p.shape[0], None)]
    local = p.to_local()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"unexpected shard layout of a {list(p.shape)} parameter: local {list(local.shape)}")
    cols = slice(offset[1], offset[1] + shape[1]) if p.dim() > 1 and shape[1] != p.shape[1] else None
    if order is None:
        return [(local, offset[0], shape[0], cols)]
    return [(local[i : i + count], row, count, cols) for i, row, count in runs(order, offset[0], shape[0])]


def fused_rows(model):
    """{parameter name: its row blocks} of the parameters whose rows tensor parallelism
    reorders: every layer's qkv_proj (and its bias), a gated fc1 (and its bias); not a
    mixture of experts' stacked experts, which it does not split."""
    fused = {}
    for i, layer in enumerate(model.layers):
        for name, blocks in layer.weight_blocks().items():
            module = name.rsplit(".", 1)[0]
            if module.startswith("moe."):
                continue
            for kind in ("weight", "bias"):
                if getattr(getattr(layer, module), kind, None) is not None:
                    fused[f"layers.{i}.{module}.{kind}"] = tuple(blocks)
    return fused


def _replicate(name, module, mesh):
    for pname, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))


def _shard_rows(name, module, mesh):
    for pname, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))


class ReplicatedCompute(ParallelStyle):
    """A module every process of the group runs whole on the same input (what comes before
    the first layer): its parameters are replicated, and so are their gradients, each
    process computing all of it."""

    def _apply(self, module, mesh):
        def inputs(mod, args, mesh):
            return tuple(
                DTensor.from_local(a, mesh, [Replicate()], run_check=False) if torch.is_tensor(a) else a for a in args
            )

        return distribute_module(module, mesh, _replicate, inputs, lambda mod, out, mesh: out.to_local())


class Replicated(ParallelStyle):
    """A module whose input already is a DTensor (split by sequence positions): its
    parameters are replicated, and their gradients summed over the group by DTensor."""

    def _apply(self, module, mesh):
        return distribute_module(module, mesh, _replicate)


class VocabParallelEmbedding(ParallelStyle):
    """The token embedding split by vocabulary rows: each process looks the ids up in its own
    rows (zeros for the others'), an all-reduce sums the processes' lookups, and backward makes
    the gradient of this process's rows alone. (torch's RowwiseParallel on an embedding makes
    the whole table's gradient on every process, then keeps its rows: V×d where V/N×d does.)"""

    def _apply(self, module, mesh):
        distribute_module(module, mesh, _shard_rows)
        module.forward = functools.partial(_lookup_vocab_rows, module, mesh)
        return module


def _lookup_vocab_rows(module, mesh, ids):
    weight = module.weight  # this process's rows (FSDP has gathered them for the forward)
    local = weight.to_local()
    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    rows = ids - offset[0]
    outside = (rows < 0) | (rows >= local.shape[0])
    pad = module.padding_idx
    pad = pad - offset[0] if pad is not None and 0 <= pad - offset[0] < local.shape[0] else None
    mine = F.embedding(rows.masked_fill(outside, 0), local, pad).masked_fill(outside[..., None], 0)
    return DTensor.from_local(mine, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class VocabRows(ParallelStyle):
    """The untied output projection: its rows split by vocabulary, read only by the loss."""

    def _apply(self, module, mesh):
        return distribute_module(module, mesh, _shard_rows)


def layer_plan(layer):
    """The parallel style of each of a decoder layer's submodules."""
    plan = {
        "self_attn_layer_norm": SequenceParallel(),
        "qkv_proj": ColwiseParallel(input_layouts=Shard(1)),
        "out_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "final_layer_norm": SequenceParallel(),
    }
    if layer.moe is None:
        plan["fc1"] = ColwiseParallel(input_layouts=Shard(1))
        plan["fc2"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    if layer.q_norm is not None:  # per head, on this process's heads (dim 2 of B×T×H×D)
        plan["q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if layer.attn_ln is not None:
        plan["attn_ln"] = SequenceParallel()
    return plan


def share_key_value_heads(layer, mesh):
    """qkv_proj's forward hook when the group has more processes than the layer has key/value
    heads: each head is read by the queries of n / KV processes, which hold 1/n of its rows
    each, as evenly as other weights (tp_row_order). Its keys and values are gathered from
    those pieces before attention, whose backward sums the processes' gradients of them
    (Partial) and keeps each its own piece: the head computed once a process, its gradient
    whole. Only the K/V pieces travel, of every process (one all-gather on the group, not
    a subgroup's), a fraction of what sequence parallelism's gathers carry."""
    n, KV, D = mesh.size(), layer.num_kv_heads, layer.head_dim
    share, piece = n // KV, KV * D // n  # processes per key/value head; rows of k (or v) each holds
    head = mesh.get_local_rank() // share

    def hook(module, args, out):
        q, kv = out.split((out.shape[-1] - 2 * piece, 2 * piece), dim=-1)
        last = kv.dim() - 1
        pieces = (
            DTensor.from_local(kv, mesh, [Shard(last)], run_check=False)
            .redistribute(mesh, [Replicate()])
            .to_local(grad_placements=[Partial()])
            .unflatten(-1, (n, 2, piece))[..., head * share : (head + 1) * share, :, :]
        )
        return torch.cat((q, pieces[..., 0, :].flatten(-2), pieces[..., 1, :].flatten(-2)), dim=-1)

    return hook


class SumOwnGradient(torch.autograd.Function):
    """x summed over `group`; its backward passes each process's gradient of the sum as that
    of its own x (Megatron's reduce from the model-parallel region). DTensor's Partial →
    Replicate would not do: its backward spreads the gradient back as a Partial, a share of
    it on each process."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def route_own_positions(moe, mesh):
    """Hooks on a mixture-of-experts layer (models/moe.py) under sequence parallelism: it
    takes this process's positions (the local shard of its B×T/N×d input; their padding mask
    cut to them) and gives back its output as the same shard. In training, the routing's
    statistics are then summed over the group, so that every process holds its micro-batch's
    as one process would: the choices and token counts (no gradient) by an all-reduce, the
    probability sums by one whose backward gives each process the gradient of its own
    tokens' (SumOwnGradient), so the balancing loss, equal on every process, sends its
    gradient once."""
    group = mesh.get_group()
    whole = {}  # the shape and stride of the last input (a shard may be one position short)

    def before(module, args):
        x = args[0]
        whole["shape"], whole["stride"] = x.shape, x.stride()
        _, offset = compute_local_shape_and_global_offset(x.shape, mesh, x.placements)
        x = x.to_local()  # its backward: the gradient of these positions, Shard(1)
        counted = module.counted
        if counted is not None and counted.numel() != x.shape[0] * x.shape[1]:  # not cut yet
            first = offset[1]
            module.counted = counted.view(x.shape[0], -1)[:, first : first + x.shape[1]].reshape(-1)
        return (x, *args[1:])

    def after(module, args, out):
        stats = module.routing
        if module.training and stats is not None:
            tokens = torch.as_tensor(stats.tokens, dtype=torch.float32, device=stats.choices.device)
            counts = torch.cat([stats.choices.float(), tokens[None]])
            dist.all_reduce(counts, group=group)
            probs = SumOwnGradient.apply(stats.probs_sum, group)
            module.routing = type(stats)(counts[:-1], probs, counts[-1])
        return DTensor.from_local(out, mesh, [Shard(1)], run_check=False, shape=whole["shape"], stride=whole["stride"])

    moe.register_forward_pre_hook(before)
    moe.register_forward_hook(after)


def to_sequence_shards(mesh):
    """A decoder layer's forward pre-hook: the whole hidden states every process computed
    before the first layer become this process's positions (a slice; its backward gathers
    the gradients). A layer's input that already is split passes as it is."""

    def hook(module, args, kwargs):
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])
        return (x, *args[1:]), kwargs

    return hook


class VocabShard:
    """How a process's rows of the vocabulary join the others' in the loss
    (models/linear_cross_entropy.py): reductions over the tensor-parallel group."""

    def __init__(self, offset, group):
        self.offset, self.group = offset, group

    def max_(self, t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def sum_(self, t):
        dist.all_reduce(t, group=self.group)
        return t


def vocab_parallel_loss(model, mesh):
    """The model's loss on vocabulary shards: every process takes all positions' hidden
    states (gathered from their sequence shards) and its rows of the output projection;
    the gradient of the hidden states each process makes is its share, summed over the
    group as the gather's backward scatters it (Partial)."""
    unsharded = model.loss
    group = mesh.get_group()

    def loss(x, weight, target, per_row=False):
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        else:  # whole on every process already: its gradient is each process's share
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        return unsharded(x, weight.to_local(), target, per_row=per_row, shard=VocabShard(offset[0], group))

    model.loss = loss

    def logits(x):
        """Inference's whole logits: each process's vocabulary rows, gathered."""
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, [Replicate()]).to_local()
        weight = model.embed_tokens.weight if model.output_projection is None else model.output_projection.weight
        local = x @ weight.to_local().t()
        shape = (*local.shape[:-1], weight.shape[0])
        stride = tuple(int(torch.Size(shape)[i + 1 :].numel()) for i in range(len(shape)))
        return DTensor.from_local(
            local, mesh, [Shard(local.dim() - 1)], shape=torch.Size(shape), stride=stride
        ).full_tensor()

    model.logits = logits


def row_orders(model):
    """{parameter name: row order} of the parameters whose rows tensor parallelism reorders
    (tp_row_order), in a model split by apply_tensor_parallel; {} in any other."""
    # a parameter of qkv_proj (iPQ's stacked parts hold no weight of their own: models/pq.py)
    weight = next(model.layers[0].qkv_proj.parameters(), None) if len(model.layers) else None
    mesh = getattr(weight, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "tp" not in names or mesh.size(names.index("tp")) == 1:
        return {}
    n = mesh.size(names.index("tp"))
    return {name: tp_row_order(blocks, n) for name, blocks in fused_rows(model).items()}


def tensor_parallel_mesh(env):
    """The "tp" dimension of a (world / N, N) mesh of env's ranks: a model split for
    inference (eval-lm), its ranks ordered as train's."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(env.device.type, (env.world_size // env.tp, env.tp), mesh_dim_names=("dp", "tp"))
    return mesh["tp"]


def fsdp_placement_under_tensor_parallelism(fsdp_mesh):
    """FSDP2's shard_placement_fn over a model split by apply_tensor_parallel: a parameter
    split by rows whose ranks' rows FSDP's shard group cannot split evenly (an odd
    vocabulary's, V/N rows over the data-parallel ranks) is sharded by columns instead. FSDP2
    cuts such rows one way (_StridedShard) and DTensor's offsets count them another: the two
    disagree on the last ranks' rows, so its shards could neither be initialized nor saved
    where they are. None (rows) for every other parameter."""
    shard = fsdp_mesh.size(fsdp_mesh.ndim - 1)  # HSDP: the shard dimension; replicas hold the same

    def placement(param):
        rows_split = isinstance(param, DTensor) and param.placements[0] == Shard(0)
        if rows_split and param.dim() == 2 and param.shape[0] % (param.device_mesh.size() * shard):
            if param.shape[1] % shard == 0:
                return Shard(1)
        return None

    return placement


def apply_tensor_parallel(model, mesh):
    """Split `model` (on the meta device) over the 1-D mesh `mesh` ("tp") as the module's
    note says; row_orders(model) then says how qkv_proj's and fc1's rows are ordered."""
    for layer in model.layers:
        parallelize_module(layer, mesh, layer_plan(layer))
        if layer.num_kv_heads < mesh.size():  # after ColwiseParallel's hook: on its local output
            layer.qkv_proj.register_forward_hook(share_key_value_heads(layer, mesh))
        for attr in ("c_attn", "w_resid"):  # NormFormer's scales, on whole heads / channels
            p = getattr(layer, attr)
            if p is not None:
                layer.register_parameter(attr, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))
        if layer.moe is not None:
            route_own_positions(layer.moe, mesh)
        layer.register_forward_pre_hook(to_sequence_shards(mesh), with_kwargs=True)
    root = {"embed_tokens": VocabParallelEmbedding()}
    for name in ("embed_positions", "layernorm_embedding", "project_in_dim"):
        if getattr(model, name) is not None:
            root[name] = ReplicatedCompute()
    if model.layer_norm is not None:
        root["layer_norm"] = SequenceParallel()
    if model.project_out_dim is not None:
        root["project_out_dim"] = Replicated()
    if model.output_projection is not None:
        root["output_projection"] = VocabRows()
    parallelize_module(model, mesh, root)
    # LayerDrop may run no layer at all: what follows the layers splits the positions then
    # (before its own style's hook), and takes split ones as they are.
    for name in ("layer_norm", "project_out_dim"):
        if getattr(model, name) is not None:
            getattr(model, name).register_forward_pre_hook(to_sequence_shards(mesh), with_kwargs=True, prepend=True)
    vocab_parallel_loss(model, mesh)
