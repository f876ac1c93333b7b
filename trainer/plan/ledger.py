"""Predict one rank's peak memory for a training config, without building anything.

The prediction walks one update the way the trainer runs it — forward layer by layer,
the loss, backward in reverse, the optimizer step — and keeps a ledger of every tensor
that is alive: sharded parameters, gradients and optimizer state; the layers FSDP has
gathered (with prefetch); the activations autograd saves (all of them, only each
layer's input under --checkpoint-activations, on the host under --offload-activations);
the loss's chunk of logits and the gradients it keeps; autocast's weight copies; iPQ's
assignments and the weights its layers rebuild from their centroids. The
peak of that ledger plus the runtime's own memory is the prediction; the ledger at the
peak is the breakdown. Torch-free: `plan` answers in a fraction of a second.

The walk is one phase a function: the states (parameters, gradients, optimizer state),
a micro-batch's forward, its loss, its backward (the layers, then the root's reduction),
and the optimizer step (trainer/plan/optimizer_step.py). --task dpo's frozen reference and
per-row loss are trainer/plan/dpo_reference.py's. What the model's layer saves for backward
is trainer/plan/activations.py's; the shapes it reads are trainer/plan/shapes.py's.
"""

import re
from dataclasses import dataclass, field

from models import chunks  # the kernels' chunk sizes (torch-free): the model's and the prediction's are one
from trainer.plan.activations import (
    cpu_attention_backward_bytes,
    document_mask_bytes,
    ffn_saved_width,
    layer_activation_bytes,
    rope_table_bytes,
    sparse_ffn_transient_bytes,
)
from trainer.plan.comm import comm_bytes
from trainer.plan.dpo_reference import per_row_loss, reference_forward, reference_model
from trainer.plan.optimizer_memory import state_bytes
from trainer.plan.optimizer_step import optimizer_step
from trainer.plan.shapes import ModelShape, Setup, sharded_params, tensor_parallel_share

# The planner's names, importable from here as before the split into shapes, activations and comm.
__all__ = [
    "COMPONENTS",
    "GB",
    "Ledger",
    "ModelShape",
    "Prediction",
    "Setup",
    "comm_bytes",
    "cpu_attention_backward_bytes",
    "layer_activation_bytes",
    "predict",
    "rope_table_bytes",
    "simulate",
]


GB = 2**30
# Memory a rank uses before any tensor of ours: on a CPU, the resident interpreter,
# torch's libraries and gloo (measured as the peak resident memory `train` logs as mem_gb
# for a model small enough that its tensors do not count: 2 layers of width 64, in a
# process of its own); on a GPU, the CUDA context, NCCL's buffers and the caching
# allocator's slack.
RUNTIME_GB = {"cpu": 0.33, "cuda": 1.0}
# A rank the launcher spawns is forked from its forkserver (trainer/launch/local_ranks.py): it
# maps only the library pages it touches, not all those a process touches importing
# torch itself, so it starts smaller (measured the same way, per rank, on 2 and 4 spawned ranks).
SPAWNED_CPU_RUNTIME_GB = 0.285
# The process's own resident memory on the host of a GPU rank (libraries, CUDA host state).
HOST_RUNTIME_GB = 3.0

COMPONENTS = (
    "runtime",
    "parameters",
    "gradients",
    "optimizer_state",
    "optimizer_state_replicated",
    "ema",
    "optimizer_step",
    "muon_owner_workspace",
    "gathered_parameters",
    "unsharded_gradients",
    "activations",
    "logits_and_loss",
    "mixed_precision_copies",
    "document_mask",
    "reference_model",
    "reference_forward",
    "pq_buffers",
    "rebuilt_weights",
)
# The linear layers outside the decoder layers that run in forward and keep their (rebuilt)
# weight for backward (an adaptive input's projections too); the tables keep only their
# indices, the output layer (or adaptive softmax) is the loss's.
ROOT_LINEARS = re.compile(r"decoder\.(quant_noise|project_in_dim|project_out_dim|embed_tokens\.embeddings\.\d+\.1)$")


@dataclass
class Ledger:
    """Bytes alive by component, and the largest total seen with its breakdown."""

    live: dict = field(default_factory=dict)
    peak: float = 0.0
    at_peak: dict = field(default_factory=dict)
    most: dict = field(default_factory=dict)  # each component's own largest value

    def add(self, component, nbytes):
        self.live[component] = self.live.get(component, 0) + nbytes
        self.most[component] = max(self.most.get(component, 0), self.live[component])
        self._check()

    def sub(self, component, nbytes):
        self.live[component] = self.live.get(component, 0) - nbytes

    def transient(self, component, nbytes):
        """Alive for a moment (a temporary inside one op), then gone."""
        self.add(component, nbytes)
        self.sub(component, nbytes)

    def _check(self):
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.live)


@dataclass
class MicroBatch:
    """What one micro-batch of an update does with the gradients (--update-freq, --defer-grad-sync)."""

    first: bool  # the first micro-batch makes the gradients; later ones add into them
    deferring: (
        bool  # --defer-grad-sync (FSDP), before the last: nothing is reduced, each unit keeps its unsharded gradient
    )
    kept: bool  # those unsharded gradients are already there
    first_reduce: bool  # FSDP2's first reduction of a unit becomes its sharded gradient


def micro_batch(s: Setup, micro):
    last = s.update_freq - 1
    deferring_sync = s.sharded and s.defer_grad_sync
    return MicroBatch(
        first=micro == 0,
        deferring=deferring_sync and micro < last,
        kept=deferring_sync and micro > 0,
        first_reduce=micro == (last if deferring_sync else 0),
    )


class UpdateWalk:
    """One update walked op by op, phase by phase: the ledger of device memory, the bytes
    kept on the host, and what lives from one phase into the next (the layers FSDP has
    gathered, the reduce-scatter still in flight)."""

    def __init__(self, m: ModelShape, s: Setup):
        self.m, self.s, self.ledger, self.host = m, s, Ledger(), 0.0
        elem = self.elem = s.compute_bytes  # bytes of one element in the compute (and FSDP param) dtype
        self.autocast = s.precision != "fp32" and not s.sharded  # DDP's mixed precision
        self.offload = s.cpu_offload and s.device == "cuda"
        self.offload_acts = s.offload_activations and s.device == "cuda"
        # one layer gathered, in param dtype (the largest, where a mixture of experts' layers differ)
        self.unit = max(self.unit_of(i) for i in range(m.layers)) if m.layers else 0
        # The next layer is gathered while one computes: FSDP2's own stream on a GPU, gloo's
        # thread with several CPU ranks (trainer/cpu/gloo_comms.py).
        self.prefetch = s.sharded and (s.device == "cuda" or s.world > 1)
        self.present = set()  # the layers gathered now
        self.act = layer_activation_bytes(m, s)
        self.sparse_act = layer_activation_bytes(m, s, sparse=True) if m.sparse_layers else 0
        self.sparse_forward, self.sparse_backward = sparse_ffn_transient_bytes(m, s) if m.sparse_layers else (0, 0)
        # Recomputed under checkpointing, a layer saves its input itself, the one kept.
        self.layer_input = s.tokens * m.dim * (4 if self.autocast else elem) / s.tp
        self.resid = 4 if self.autocast else elem  # the residual stream's element
        # Tensor parallelism: a row-parallel projection's partial sums over every position,
        # before their reduce-scatter (forward), and the gradient a column-parallel one makes
        # for its gathered input, before its reduce-scatter (backward). Context parallelism:
        # every position's keys and values gathered (forward), and in backward again with
        # their gradients, before those are reduce-scattered.
        self.tp_buffer = s.tokens * m.dim * elem if s.tp > 1 else 0
        kv = 2 * s.rows * s.seq_len * m.kv * m.hd * elem if s.cp > 1 else 0
        self.cp_forward, self.cp_backward = kv, 2 * kv
        self.rebuild_elem = elem if s.sharded else 4  # iPQ: the centroids' dtype where weights are rebuilt
        self.pq = {p.name: p for p in m.pq}
        self.reduce_bytes = 4 if s.fp32_reduce_scatter else elem
        # also the size of a unit's unsharded gradient kept in the reduce dtype (--defer-grad-sync)
        self.root_rs = m.root_params * self.reduce_bytes
        self.in_flight = 0  # the reduce-scatter input still alive behind the next layer's backward
        # On several CPU ranks gloo's transfers keep it until the next reduce-scatter starts
        # (trainer/cpu/gloo_comms.py), past that one's copy-in; FSDP2 lets it go before.
        # Under tensor parallelism FSDP's own collectives run (trainer/parallel/parallelize.py).
        # Under expert parallelism, too (the experts' units have meshes of their own).
        self.kept_by_gloo = s.device == "cpu" and s.world > 1 and s.tp == 1 and s.ep == 1
        # hybrid_shard: each unit's reduced shard in the reduce dtype, all-reduced across
        # replicas, is held by FSDP2 until the end of backward where it is not the gradient.
        self.all_reduced = 0
        # The output layer's weight is read again in backward: the int8 clamps, or dpo's
        # per-row loss, which recomputes its logits there. Under FSDP the root stays gathered.
        self.root_read_in_backward = m.scalar_noise or s.dpo
        self.shared_mask, self.layer_mask = document_mask_bytes(m, s)

    def low_copies(self, i):
        """autocast's copies of layer i's weights (it caches parameters' casts only: not
        iPQ's rebuilt weights)."""
        return self.elem * (self.m.matmul_params - self.m.pq_weights(i))

    # iPQ (--quantization-config-path; trainer/plan/quantized.py): a quantized layer rebuilds
    # its weight in every forward (models/pq.py weight_of: the centroids indexed by the
    # assignments, then copied into the weight's layout), and its matmul keeps the rebuilt
    # weight for backward as it keeps an activation (in the compute dtype: under autocast its
    # cast). Its backward makes the weight's gradient and a copy of it in the blocks' layout
    # before they are added into the centroids'.
    def rebuilt(self, i):
        """Bytes of rebuilt weights decoder layer i keeps from its forward to its backward."""
        return self.elem * self.m.pq_weights(i)

    def largest_rebuilt(self, i):
        return max((p.weight for p in self.m.pq_of(i)), default=0)

    def rebuild_moment(self, i, kept=True):
        """Beyond what layer i keeps, at the rebuild of its largest weight: the indexed
        centroids beside their copy (the copy kept, or under checkpointing both let go)."""
        w, rebuilt = self.largest_rebuilt(i), self.rebuild_elem
        return w * (2 * rebuilt - self.elem if kept else 2 * rebuilt)

    def regrad_moment(self, i):
        """A rebuilt weight's gradient and its copy in the blocks' layout, the largest's."""
        return 2 * self.largest_rebuilt(i) * self.rebuild_elem

    def pq_grads(self, name, rows, cols, bias):
        """Bytes of a linear layer's unsharded gradients: its centroids' where quantized."""
        p = self.pq.get(name)
        return self.elem * ((p.params if p else rows * cols) + (rows if bias else 0))

    @property
    def root_rebuilt(self):
        """What the root's linear layers keep of their rebuilt weights until the root's backward."""
        return self.elem * sum(p.weight for p in self.m.pq_of(-1) if ROOT_LINEARS.match(p.name))

    @property
    def output_rebuilt(self):
        """The output layer's rebuilt weight (the tied table's where it is quantized), which
        the loss reads: bytes, or 0 where it is not quantized."""
        m = self.m
        p = self.pq.get("decoder.embed_tokens" if m.tied else "decoder.output_projection")
        return p.weight * self.rebuild_elem if p else 0

    def gathered_params(self, i):
        """Layer i's parameters as FSDP gathers them: a sparse layer's experts under expert
        parallelism are their own unit, gathered over the ranks holding the same E/ep experts;
        under tensor parallelism its router and experts are (the rank's TP share of attention
        and norms, with the whole router and E/ep whole experts)."""
        m = self.m
        if not m.is_sparse(i):
            return m.params_of(i)
        return m.sparse_layer_params - m.expert_params + m.expert_params // self.s.ep

    def unit_of(self, i):
        return self.gathered_params(i) * self.elem if self.s.sharded else 0

    def act_of(self, i):
        return self.sparse_act if self.m.is_sparse(i) else self.act

    def gather(self, i):
        if 0 <= i < self.m.layers and i not in self.present:
            self.present.add(i)
            self.ledger.add("gathered_parameters", self.unit_of(i))

    def release(self, i):
        if i in self.present:
            self.present.discard(i)
            self.ledger.sub("gathered_parameters", self.unit_of(i))

    def states(self):
        """Sharded parameters, optimizer state and --store-ema's average (on the host under
        --cpu-offload on a GPU, with the sharded gradients), and DDP's buckets."""
        m, s, L = self.m, self.s, self.ledger
        held = sharded_params(m, s)  # this rank's shards
        sharded_state, replicated_state = state_bytes(m, s)
        for name, nbytes in (
            ("parameters", 4 * held),
            ("optimizer_state", sharded_state),
            ("optimizer_state_replicated", replicated_state),
            ("ema", s.ema_bytes * held),
        ):
            if self.offload:
                self.host += nbytes
            else:
                L.add(name, nbytes)
        if self.offload:
            self.host += 4 * held  # the sharded gradients
        if s.dpo:
            reference_model(self)
        L.add("pq_buffers", m.pq_buffer_bytes)  # buffers: whole on every rank, on the device
        if s.ddp_buckets:
            L.add("gradients", 4 * m.params)  # DDP's buckets: a flat copy of every gradient

    def forward(self):
        m, s, L, elem, n = self.m, self.s, self.ledger, self.elem, self.s.tokens
        if self.autocast:
            L.add("mixed_precision_copies", sum(self.low_copies(i) for i in range(m.layers)))  # autocast's cache
        if s.sharded:
            L.add("gathered_parameters", m.root_params * elem)  # the root, gathered until the loss
        L.add("activations", rope_table_bytes(m, s))  # --rope: alive until the first layer's backward
        L.add("document_mask", self.shared_mask)  # read by every layer, kept for their backward
        # iPQ's root: a rebuilt table lives while it is looked up; its linear layers keep theirs
        # (the output layer's is the loss's)
        root = max((p.weight for p in m.pq_of(-1) if p.name != "decoder.output_projection"), default=0)
        L.transient("rebuilt_weights", 2 * root * self.rebuild_elem)
        L.add("rebuilt_weights", self.root_rebuilt)
        for i in range(m.layers):
            self.gather(i)
            if self.prefetch:
                self.gather(i + 1)
            L.transient("activations", self.cp_forward + self.tp_buffer)
            sparse = m.is_sparse(i)
            if s.checkpoint_activations:
                # computed, not saved: the feed-forward's hidden states; a sparse layer's dispatch
                # holds about what it would save
                L.transient("activations", self.act_of(i) if sparse else n * elem * 2 * (m.fc1_width + m.dim))
                L.transient("document_mask", self.layer_mask)
                L.transient("rebuilt_weights", self.rebuild_moment(i, kept=False))
                if self.offload_acts:
                    self.host += self.layer_input
                else:
                    L.add("activations", self.layer_input)
            else:
                L.add("activations", self.act_of(i))
                L.transient("activations", self.sparse_forward if sparse else 0)
                L.add("document_mask", self.layer_mask)
                L.add("rebuilt_weights", self.rebuilt(i))
                L.transient("rebuilt_weights", self.rebuild_moment(i))
            if s.reshard_after_forward and i + 1 < m.layers:  # the last layer's backward is next
                self.release(i)
        L.add("activations", n * m.dim * self.resid / s.tp)  # the final norm's input

    def loss(self):
        """The loss (models/linear_cross_entropy.py): a chunk of fp32 logits at a time; the
        gradients for the hidden states and for W (fp32) are made in forward and kept, then
        scaled in place in backward and handed on."""
        m, s, L, elem, n = self.m, self.s, self.ledger, self.elem, self.s.tokens
        if s.dpo:
            return per_row_loss(self)
        if m.scalar_noise and not m.tied:
            return self.int8_logits_loss()
        low = 0 if elem == 4 else elem  # a low-precision copy, where there is one
        L.add("logits_and_loss", n * m.dim * elem + m.vocab * m.dim * 4)
        if self.autocast:  # the loss casts W itself (it runs outside autocast), for its forward
            L.add("mixed_precision_copies", m.vocab * m.dim * elem)
        # one chunk's buffers (fp32 logits, their low-precision product and gradient) and
        # W's gradient in low precision, added into the fp32 one (a CPU: a block at a time)
        rows = min(n, chunks.loss_chunk_rows(m.vocab, s.device))
        # iPQ: a quantized output layer's weight, rebuilt for the loss (its indexed centroids
        # beside it for a moment)
        L.transient("rebuilt_weights", 2 * self.output_rebuilt)
        L.add("rebuilt_weights", self.output_rebuilt)
        # under tensor parallelism, beside them: the hidden states gathered over every position
        L.transient("logits_and_loss", rows * m.vocab * (4 + low) + m.vocab * m.dim * low + self.tp_buffer)
        L.sub("rebuilt_weights", self.output_rebuilt)
        if self.autocast:
            L.sub("mixed_precision_copies", m.vocab * m.dim * elem)
        if s.sharded and not m.scalar_noise:  # the root's weights are not read in backward: given back
            L.sub("gathered_parameters", m.root_params * elem)  # (trainer/parallel/parallelize.py)
        # backward: the kept gradients are scaled in place and handed on
        L.transient("logits_and_loss", m.vocab * m.dim * low)
        # iPQ: the kept gradient for a rebuilt output weight, in its dtype and in the blocks' layout
        L.transient("rebuilt_weights", 2 * self.output_rebuilt)
        L.sub("logits_and_loss", n * m.dim * elem + m.vocab * m.dim * 4)

    def int8_logits_loss(self):
        """--quant-noise-scalar's output projection (untied): whole logits, clamped to their
        int8 range, then cross-entropy (models/transformer_lm.py output_loss). Kept for
        backward: the projection's input and noised weight, the logits the clamp keeps, and
        log-softmax's fp32 output; for a moment the clamped logits and their fp32 copy, and
        in backward two N×V gradients. The root stays gathered: the clamps read its weights."""
        m, L, elem, n = self.m, self.ledger, self.elem, self.s.tokens
        logits = n * m.vocab
        kept = n * m.dim * elem + m.vocab * m.dim * elem + logits * elem
        L.add("logits_and_loss", kept)
        L.transient("logits_and_loss", logits * (elem + (4 if elem != 4 else 0)))
        L.add("logits_and_loss", logits * 4)
        L.transient("logits_and_loss", logits * (4 + elem))
        L.sub("logits_and_loss", kept + logits * 4)

    def backward_layers(self, mb: MicroBatch):
        """The root's gradients appear, then each layer's backward, last layer first, and
        (FSDP) its reduce-scatter behind the next one's."""
        m, s, L, elem, n = self.m, self.s, self.ledger, self.elem, self.s.tokens
        if s.sharded:
            if not mb.kept:
                L.add("unsharded_gradients", m.root_params * elem)  # the root's, reduced at the end
        elif mb.first:
            L.add("gradients", 4 * m.root_params)
        L.sub("activations", n * m.dim * self.resid / s.tp)
        # A layer's backward peaks at its first node (fc2's): every saved tensor of the layer is
        # still alive, with the gradient coming in (n×d) and the one fc2 makes for its input (n×ffn).
        # Later nodes free what they used before the next makes more; a gated feed-forward's
        # product node holds one more (the gradients of act(gate) and of up, its product's freed).
        act_grads = n * (m.dim + m.fc1_width) * elem
        # Or later, a CPU's low-precision attention backward, if it holds more.
        attention_grads = cpu_attention_backward_bytes(m, s) + self.cp_backward
        # FSDP: the layer's unsharded gradients appear as its backward goes. fc2's node makes
        # fc2's (so the first node holds only those); fc1's node, fc1's, when the feed-forward's
        # other saved tensors are freed and the gradients for fc1's output and input are alive
        # with the one coming in; the attention's by the layer's end, its activations freed.
        dense_at_fc1 = n * (2 * m.dim + m.fc1_width) * elem - n * elem * ffn_saved_width(m)
        # A sparse layer's: the gathered experts' down projections, then their gate and up with
        # the router; its dispatch's backward buffers in place of fc2's and fc1's nodes'.
        local_experts = m.expert_params // s.ep
        sparse_fc2 = elem * local_experts // 3
        sparse_fc1 = elem * (local_experts - local_experts // 3 + m.experts * m.dim)
        for i in reversed(range(m.layers)):
            sparse = m.is_sparse(i)
            act = self.act_of(i)
            if sparse:
                fc2_grads, fc1_grads = sparse_fc2, sparse_fc1
            else:  # iPQ: a quantized one's are its centroids'
                fc2_grads = self.pq_grads(f"decoder.layers.{i}.fc2", m.dim, m.ffn, m.bias)
                fc1_grads = self.pq_grads(f"decoder.layers.{i}.fc1", m.fc1_width, m.dim, m.bias)
            first_node = self.sparse_backward if sparse else act_grads
            at_fc1 = 0 if sparse else dense_at_fc1
            self.gather(i)
            if self.prefetch:
                self.gather(i - 1)
            if s.checkpoint_activations:  # recomputed; the input was kept (or comes back)
                L.add("activations", act - (0 if self.offload_acts else self.layer_input))
                L.add("document_mask", self.layer_mask)
                L.add("rebuilt_weights", self.rebuilt(i))
            grads = s.sharded and not mb.kept  # this backward makes the layer's unsharded gradients
            if grads:
                L.add("unsharded_gradients", fc2_grads)
            elif not s.sharded and mb.first:
                L.add("gradients", 4 * m.params_of(i))
            L.add("rebuilt_weights", self.regrad_moment(i))
            L.transient("activations", max(first_node, attention_grads))
            L.sub("rebuilt_weights", self.regrad_moment(i))
            if grads:
                L.add("unsharded_gradients", fc1_grads)
                L.transient("activations", at_fc1)
            L.sub("activations", act)
            L.sub("rebuilt_weights", self.rebuilt(i))
            if grads:
                L.add("unsharded_gradients", self.unit_of(i) - fc2_grads - fc1_grads)
            L.sub("document_mask", self.layer_mask)
            if self.autocast:
                L.sub("mixed_precision_copies", self.low_copies(i))
            gathered = self.gathered_params(i)
            rs_buffer = gathered * self.reduce_bytes
            if mb.deferring:
                if not mb.kept and self.reduce_bytes != elem:  # accumulated in the reduce dtype
                    L.add("unsharded_gradients", rs_buffer - self.unit_of(i))
                self.release(i)
            elif s.sharded:
                self.release(i)  # FSDP2's post-backward reshards the layer, then reduces it
                # its shard: 1/S of the layer, 1/moe_shard of a sparse one's router and experts
                # (the experts' 1/(moe_shard/ep) of E/ep experts)
                self.reduce(gathered, rs_buffer if mb.kept else self.unit_of(i), mb, sharded_params(m, s, [i]))
        L.sub("activations", rope_table_bytes(m, s))
        L.sub("document_mask", self.shared_mask)

    def backward_root(self, mb: MicroBatch):
        """The embedding's backward, then (FSDP) the root's reduce-scatter."""
        m, s, L, elem = self.m, self.s, self.ledger, self.elem
        L.sub("rebuilt_weights", self.root_rebuilt)
        table = self.pq.get("decoder.embed_tokens")
        if table:  # iPQ: the table's dense gradient and its copy in the blocks' layout, for its centroids
            L.transient("rebuilt_weights", 2 * table.weight * self.rebuild_elem)
        elif m.tied:
            # the embedding's backward makes a dense V×d gradient of its own (under tensor
            # parallelism of the rank's V/N rows: m is its share), added into the one the loss
            # made for the same (tied) weight: both are alive for a moment
            L.transient(
                "gradients" if not s.sharded else "unsharded_gradients", m.vocab * m.dim * (elem if s.sharded else 4)
            )
        if s.sharded and self.root_read_in_backward:  # gathered through backward (int8_logits_loss, per_row_loss)
            L.sub("gathered_parameters", m.root_params * elem)  # resharded before its reduction
        if mb.deferring:
            if not mb.kept and self.reduce_bytes != elem:
                L.add("unsharded_gradients", self.root_rs - m.root_params * elem)
        elif s.sharded:
            self.reduce(m.root_params, self.root_rs if mb.kept else m.root_params * elem, mb, m.root_params / s.shard)
            # the end of backward: the last reduce-scatter input and the all-reduced shards go
            L.sub("unsharded_gradients", self.in_flight)
            L.sub("gradients", self.all_reduced)
            self.in_flight = self.all_reduced = 0

    def reduce(self, params, unsharded, mb: MicroBatch, shard_params):
        """FSDP2's reduction of one unit's gradients after its backward (post-backward's
        foreach_reduce): the previous unit's reduce-scatter input is let go, the gradients
        (`unsharded` bytes) are copied into a flat input in the reduce dtype and freed, and
        the reduce-scatter's output, this rank's shard of it (`shard_params` parameters), is
        cast to fp32 where the reduce dtype is lower; that fp32 shard becomes the sharded
        gradient (on the host under --cpu-offload) or, in a later micro-batch, is added into
        it. The input stays while the collective runs, behind the next unit's backward; under
        hybrid_shard the output, all-reduced across replicas, until the end of backward where
        it is not itself the gradient (FSDP2 holds it there against reuse while the all-reduce
        runs)."""
        L, s = self.ledger, self.s
        rs_input = params * self.reduce_bytes
        if not self.kept_by_gloo:
            L.sub("unsharded_gradients", self.in_flight)
        L.add("unsharded_gradients", rs_input)
        L.sub("unsharded_gradients", unsharded + (self.in_flight if self.kept_by_gloo else 0))
        self.in_flight = rs_input
        output, fp32 = shard_params * self.reduce_bytes, 4 * shard_params
        cast = fp32 if self.reduce_bytes != 4 else 0
        kept = mb.first_reduce and not self.offload
        held = output if s.backend == "hybrid_shard" and (cast or not kept) else 0
        L.add("gradients", output + cast)
        L.sub("gradients", output + cast - (fp32 if kept else 0) - held)
        self.all_reduced += held


def simulate(m: ModelShape, s: Setup):
    """Walk one update (the second: the optimizer state exists) and return the Ledger of
    device memory, plus the bytes kept on the host (--cpu-offload, --offload-activations
    on a GPU; on a CPU the device is the host and nothing moves). Under tensor parallelism
    the walk is of the rank's share of the model (shapes.tensor_parallel_share)."""
    walk = UpdateWalk(tensor_parallel_share(m, s.tp), s)
    walk.states()
    for micro in range(s.update_freq):
        mb = micro_batch(s, micro)
        if s.dpo:
            reference_forward(walk)
        walk.forward()
        walk.loss()
        walk.backward_layers(mb)
        walk.backward_root(mb)
    optimizer_step(walk)
    return walk.ledger, walk.host


def host_bytes_per_rank(s: Setup, offloaded):
    return offloaded + (HOST_RUNTIME_GB * GB if s.device == "cuda" else 0)


@dataclass
class Prediction:
    per_rank_gb: float
    host_gb: float
    components: dict
    comm: dict

    @property
    def comm_gb_per_update(self):
        return sum(self.comm.values())


def predict(m: ModelShape, s: Setup):
    ledger, offloaded = simulate(m, s)
    runtime = (SPAWNED_CPU_RUNTIME_GB if s.device == "cpu" and s.spawned else RUNTIME_GB[s.device]) * GB
    components = {k: 0.0 for k in COMPONENTS}
    components["runtime"] = runtime
    for k, v in ledger.at_peak.items():
        components[k] += v
    per_rank = runtime + ledger.peak
    host_rank = host_bytes_per_rank(s, offloaded)
    if s.device == "cpu":  # the device is the host: its ranks and their offloaded state
        host_rank += per_rank
    components = {k: round(v / GB, 3) for k, v in components.items()}
    comm = {k: round(v / GB, 3) for k, v in comm_bytes(tensor_parallel_share(m, s.tp), s).items()}
    return Prediction(round(per_rank / GB, 3), round(host_rank * s.ranks_per_host / GB, 3), components, comm)
