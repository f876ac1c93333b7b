"""Predict one rank's peak memory for a training config, without building anything.

The prediction walks one update the way the trainer runs it — forward layer by layer,
the loss, backward in reverse, the optimizer step — and keeps a ledger of every tensor
that is alive: sharded parameters, gradients and optimizer state; the layers FSDP has
gathered (with prefetch); the activations autograd saves (all of them, only each
layer's input under --checkpoint-activations, on the host under --offload-activations);
the loss's chunk of logits and the gradients it keeps; autocast's weight copies. The
peak of that ledger plus the runtime's own memory is the prediction; the ledger at the
peak is the breakdown. Torch-free: `plan` answers in a fraction of a second.

The saved-activation counts follow models/transformer_lm.py, as autograd's saved-tensor
hooks see them (tests/test_plan.py counts them on the real layer): a pre-LN layer saves
its input x, the attention input, q/k/v (one tensor), the attention output (the fused
kernels write it token-major, so out_proj's input is a view of it, not a copy), the
residual x1, the FFN input, fc1's output and (gelu) the activation's output — relu's
output is the tensor both relu and fc2 keep. SDPA's fused kernels save only a row
log-sum-exp, and a CPU's bf16/fp16 attention (models/cpu_attention.py) not even that;
with attention dropout a CPU takes SDPA's math path, which keeps the T×T probabilities,
the dropout mask and the dropped probabilities, in fp32 (CUDA's fused kernels apply
dropout themselves). Dropout keeps its mask: one byte per element on CUDA, an
element of the input's dtype on a CPU (no fused kernel there).

The Llama family's layer (--norm-type rmsnorm, --rope, --gated-ffn, --decoder-kv-heads,
--qk-norm) saves differently. RMSNorm (models/transformer_lm.py's own, on every device)
saves its input and rstd, like LayerNorm. The rotary embedding's muls save
only the cos/sin tables (one pair per forward, shared by every layer; under autocast each
layer casts them for q and for k), and its rotated q and k are new tensors that attention
saves beside q/k/v (v stays a view of qkv_proj's output). Grouped-query attention saves the
kv heads only in SDPA (enable_gqa), but a CPU's bf16 attention repeats them to every query
head first and saves the repeated ones. The gated feed-forward saves fc1's output (gate and
up, 2·ffn wide), the activation of the gate and their product.
"""
from dataclasses import dataclass, field
from typing import Optional

from models import chunks  # the kernels' chunk sizes (torch-free): the model's and the prediction's are one
from trainer.config.schema import SHARDED_BACKENDS


def cpu_attention_backward_bytes(m, s):
    """The T×T tensors a CPU's bf16/fp16 attention holds at once in one layer's backward
    (models/cpu_attention.py): probabilities and two gradients for one chunk of heads.
    0 where attention is SDPA's (CUDA, fp32, attention dropout)."""
    if s.device == "cuda" or s.precision == "fp32" or m.attention_dropout > 0:
        return 0
    per_head = s.seq_len ** 2 * 2
    return 3 * chunks.attention_heads_per_chunk(s.sequences * m.heads, s.seq_len, 2) * per_head


GB = 2 ** 30
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

COMPONENTS = ("runtime", "parameters", "gradients", "optimizer_state", "gathered_parameters",
              "unsharded_gradients", "activations", "logits_and_loss", "mixed_precision_copies")


@dataclass
class ModelShape:
    layers: int
    dim: int
    ffn: int
    heads: int
    vocab: int
    learned_positions: int  # rows of the learned position table (0: sinusoidal or none)
    tied: bool
    norms_outside_layers: int  # final norm and/or embedding norm
    activation_fn: str
    dropout: float
    attention_dropout: float
    activation_dropout: float
    # The token embedding's and the output layer's parameters when they are not V×d tables
    # (an adaptive input or softmax: plan/search.py counts its bands); None: V×d each, or once tied.
    vocab_params: Optional[int] = None
    normformer_params: int = 0  # per layer: NormFormer's norms and scales (--scale-attn/fc/heads/resids)
    # project_in_dim/project_out_dim and the embedding/output tables' width beyond V×d
    # (--decoder-input-dim/--decoder-output-dim)
    projection_params: int = 0
    # The Llama family's pieces (models/config.py); the defaults are the GPT-style layer.
    kv_heads: int = 0  # --decoder-kv-heads (0: as many as the query heads)
    head_dim: int = 0  # --decoder-head-dim (0: dim // heads)
    gated: bool = False  # --gated-ffn: fc1 is gate and up, 2·ffn rows
    bias: bool = True  # biases in the linear layers (--no-bias: none)
    norm: str = "layernorm"  # --norm-type
    norm_bias: bool = True  # a LayerNorm's bias (--no-bias: none; RMSNorm has none)
    qk_norm: bool = False  # --qk-norm: an RMSNorm of head_dim on queries and keys
    rope: bool = False  # --rope: cos/sin tables, rotated q and k

    @property
    def hd(self):
        return self.head_dim or self.dim // self.heads

    @property
    def kv(self):
        return self.kv_heads or self.heads

    @property
    def inner(self):
        """The attention's width: query heads × head_dim (d unless --decoder-head-dim says otherwise)."""
        return self.heads * self.hd

    @property
    def qkv_width(self):
        return self.inner + 2 * self.kv * self.hd

    @property
    def fc1_width(self):
        return 2 * self.ffn if self.gated else self.ffn

    def norm_params(self, width):
        return width * (2 if self.norm == "layernorm" and self.norm_bias else 1)

    @property
    def matmul_params(self):
        """One layer's weight matrices: qkv_proj, out_proj, fc1, fc2."""
        d = self.dim
        return d * self.qkv_width + self.inner * d + d * self.fc1_width + self.ffn * d

    @property
    def layer_params(self):
        d = self.dim
        biases = (self.qkv_width + d + self.fc1_width + d) if self.bias else 0
        qk_norms = 2 * self.hd if self.qk_norm else 0
        return self.matmul_params + biases + 2 * self.norm_params(d) + qk_norms + self.normformer_params

    @property
    def root_params(self):
        """Parameters outside the decoder layers: FSDP's root unit."""
        d = self.dim
        tables = self.vocab * d * (1 if self.tied else 2) if self.vocab_params is None else self.vocab_params
        return (tables + self.learned_positions * d + self.norms_outside_layers * self.norm_params(d)
                + self.projection_params)

    @property
    def params(self):
        return self.layers * self.layer_params + self.root_params


@dataclass
class Setup:
    """What the trainer will do, from the config: precision, sharding, batch."""
    device: str  # "cpu" or "cuda"
    world: int
    ranks_per_host: int
    backend: str
    shard: int  # ranks one copy of the model is sharded over (1: not sharded)
    reshard_after_forward: bool
    checkpoint_activations: bool
    offload_activations: bool
    cpu_offload: bool
    defer_grad_sync: bool
    update_freq: int
    sequences: int  # per micro-batch per rank
    seq_len: int
    precision: str  # "fp32", "bf16" or "fp16"
    fp32_reduce_scatter: bool
    optimizer_states: int  # fp32 tensors the optimizer keeps per parameter
    spawned: bool = False  # a local rank the launcher forks (not a process of its own)

    @property
    def sharded(self):
        return self.backend in SHARDED_BACKENDS

    @property
    def ddp_buckets(self):
        """torch's DDP on several ranks: every gradient is a view into its flat buckets,
        allocated once and kept."""
        return not self.sharded and self.world > 1 and self.backend == "pytorch_ddp"

    @property
    def tokens(self):
        return self.sequences * self.seq_len

    @property
    def compute_bytes(self):
        return 4 if self.precision == "fp32" else 2


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


def norm_saved_bytes(m: ModelShape, s: Setup):
    """Per token, what one norm before a matmul saves, that matmul's saved input included."""
    c, d = s.compute_bytes, m.dim
    stream = 4 if s.precision != "fp32" and not s.sharded else c  # autocast keeps the residual stream fp32
    return stream * d + (4 if m.norm == "rmsnorm" else 8) + c * d  # input, (mean,) rstd, output


# Activations whose backward keeps their output, not their input: the tensor fc2 (or the
# gate's product) keeps anyway, so they add no saved tensor of their own.
SAVES_OUTPUT = ("relu", "tanh", "linear")


def ffn_saved_width(m: ModelShape):
    """Per token, elements of the feed-forward's saved tensors (its input aside)."""
    f, act = m.ffn, m.activation_fn
    squared = f if act == "relu_squared" else 0  # relu's output, which pow keeps, besides pow's
    if m.gated:  # fc1's output (up is a view of it), act(gate) unless linear, the product fc2 keeps
        return 2 * f + (0 if act == "linear" else f) + squared + f
    return (f if act in SAVES_OUTPUT else 2 * f) + squared


def uses_cpu_matmul_attention(m: ModelShape, s: Setup):
    """models/cpu_attention.py: low precision on a CPU without attention dropout."""
    return s.device == "cpu" and s.precision != "fp32" and m.attention_dropout == 0


def rope_table_bytes(m: ModelShape, s: Setup):
    """The (cos, sin) pair of one forward, in the embeddings' dtype, shared by every layer.
    Under autocast no layer saves the fp32 pair itself, only its casts (layer_activation_bytes)."""
    if not m.rope or (s.precision != "fp32" and not s.sharded):
        return 0
    return 2 * s.seq_len * m.hd * s.compute_bytes


def layer_activation_bytes(m: ModelShape, s: Setup):
    """Bytes one decoder layer's forward saves for backward, for s.tokens tokens."""
    n, d, f, c = s.tokens, m.dim, m.ffn, s.compute_bytes
    mask = 1 if s.device == "cuda" else c  # one dropout-mask element
    autocast = s.precision != "fp32" and not s.sharded
    cpu_matmul = uses_cpu_matmul_attention(m, s)
    q_and_kv = m.heads + m.kv  # heads q_norm and k_norm see
    # the two norms before qkv_proj and fc1, and the attention output out_proj keeps
    per_token = 2 * norm_saved_bytes(m, s) + c * m.inner
    if cpu_matmul:  # q (scaled), k and v, each repeated to every query head
        per_token += 3 * c * m.inner
    else:  # qkv_proj's output (v is a view of it), the rotated (or normalized) q and k
        per_token += c * m.qkv_width + (c * (m.inner + m.kv * m.hd) if m.rope or m.qk_norm else 0)
    if m.qk_norm:  # rstd per head (models/transformer_lm.py RMSNorm); its input is a view of qkv's output
        per_token += 4 * q_and_kv + (c * m.qkv_width if cpu_matmul else 0)
    per_token += c * ffn_saved_width(m)
    masks = (m.dropout > 0) * 2 * d * mask + (m.activation_dropout > 0) * f * mask
    if m.activation_dropout > 0 and m.activation_fn in ("relu", "tanh") and not m.gated:
        masks += f * c  # fc2 now keeps the dropped output, the activation still its own
    if m.attention_dropout > 0 and s.device != "cuda":
        # the math path, in fp32 on a CPU: probabilities, dropout mask and dropped
        # probabilities (T×T per head), and q/k/v as fp32 copies of low-precision ones
        masks += m.heads * s.seq_len * 3 * 4
        per_token += m.qkv_width * (4 - c)
    elif not cpu_matmul:
        per_token += m.heads * 4  # the fused kernel's log-sum-exp
    # else models/cpu_attention.py: nothing more; backward recomputes
    # autocast casts the rope tables to q's and k's dtype in every layer: four T×head_dim copies
    tables = 4 * s.seq_len * m.hd * c if m.rope and autocast else 0
    return n * (per_token + masks) + tables


def simulate(m: ModelShape, s: Setup):
    """Walk one update (the second: the optimizer state exists) and return the Ledger of
    device memory, plus the bytes kept on the host (--cpu-offload, --offload-activations
    on a GPU; on a CPU the device is the host and nothing moves)."""
    L = Ledger()
    P, S, c, n = m.params, s.shard, s.compute_bytes, s.tokens
    autocast = s.precision != "fp32" and not s.sharded  # DDP's mixed precision
    offload = s.cpu_offload and s.device == "cuda"
    offload_acts = s.offload_activations and s.device == "cuda"
    host = 0.0
    for name, nbytes in (("parameters", 4 * P / S), ("optimizer_state", 4 * s.optimizer_states * P / S)):
        if offload:
            host += nbytes
        else:
            L.add(name, nbytes)
    if offload:
        host += 4 * P / S  # the sharded gradients
    if s.ddp_buckets:
        L.add("gradients", 4 * P)  # DDP's buckets: a flat copy of every gradient
    unit = m.layer_params * c if s.sharded else 0  # one layer gathered, in param dtype
    # The next layer is gathered while one computes: FSDP2's own stream on a GPU, gloo's
    # thread with several CPU ranks (trainer/cpu/gloo_comms.py).
    prefetch = s.sharded and (s.device == "cuda" or s.world > 1)
    present = set()

    def gather(i):
        if 0 <= i < m.layers and i not in present:
            present.add(i)
            L.add("gathered_parameters", unit)

    def release(i):
        if i in present:
            present.discard(i)
            L.sub("gathered_parameters", unit)

    act = layer_activation_bytes(m, s)
    layer_input = n * m.dim * (4 if autocast else c)
    # Recomputed under checkpointing, a layer saves its input itself, the one kept.
    input_in_act = layer_input
    resid = 4 if autocast else c
    # A layer's backward peaks at its first node (fc2's): every saved tensor of the layer is
    # still alive, with the gradient coming in (n×d) and the one fc2 makes for its input (n×ffn).
    # Later nodes free what they used before the next makes more; a gated feed-forward's
    # product node holds one more (the gradients of act(gate) and of up, its product's freed).
    act_grads = n * (m.dim + m.fc1_width) * c
    # Or later, a CPU's low-precision attention backward, if it holds more.
    attention_grads = cpu_attention_backward_bytes(m, s)
    low_copies = c * m.matmul_params  # autocast's copies of one layer's weights
    reduce_bytes = 4 if s.fp32_reduce_scatter else c
    # also the size of a unit's unsharded gradient kept in the reduce dtype (--defer-grad-sync)
    rs_buffer, root_rs = m.layer_params * reduce_bytes, m.root_params * reduce_bytes
    in_flight = 0
    last = s.update_freq - 1
    for micro in range(s.update_freq):
        grads_now = micro == 0  # later micro-batches add into the same gradients
        # --defer-grad-sync (FSDP): micro-batches before the last reduce nothing; each unit
        # keeps its unsharded gradient (in the reduce dtype) until the last one reduces it.
        deferring = s.sharded and s.defer_grad_sync and micro < last
        kept = s.sharded and s.defer_grad_sync and micro > 0  # unsharded gradients already there
        first_reduce = micro == (last if s.sharded and s.defer_grad_sync else 0)
        # FSDP2's first reduction of a unit becomes its sharded gradient; a later one lands
        # in a new output of the shard's size, added into it, then freed.
        later_output = 0 if first_reduce else reduce_bytes / S
        # ---- forward
        if autocast:
            L.add("mixed_precision_copies", m.layers * low_copies)  # autocast's weight cache
        if s.sharded:
            L.add("gathered_parameters", m.root_params * c)  # the root, gathered until the loss
        L.add("activations", rope_table_bytes(m, s))  # --rope: alive until the first layer's backward
        for i in range(m.layers):
            gather(i)
            if prefetch:
                gather(i + 1)
            if s.checkpoint_activations:
                L.transient("activations", n * c * 2 * (m.fc1_width + m.dim))  # computed, not saved
                if offload_acts:
                    host += layer_input
                else:
                    L.add("activations", layer_input)
            else:
                L.add("activations", act)
            if s.reshard_after_forward and i + 1 < m.layers:  # the last layer's backward is next
                release(i)
        L.add("activations", n * m.dim * resid)  # the final norm's input
        # the loss (models/linear_cross_entropy.py): a chunk of fp32 logits at a time; the
        # gradients for the hidden states and for W (fp32) are made in forward and kept
        low = 0 if c == 4 else c  # a low-precision copy, where there is one
        L.add("logits_and_loss", n * m.dim * c + m.vocab * m.dim * 4)
        if autocast:  # the loss casts W itself (it runs outside autocast), for its forward
            L.add("mixed_precision_copies", m.vocab * m.dim * c)
        # one chunk's buffers (fp32 logits, their low-precision product and gradient) and
        # W's gradient in low precision, added into the fp32 one a block at a time
        L.transient("logits_and_loss", min(n, chunks.loss_chunk_rows(m.vocab)) * m.vocab * (4 + low) + m.vocab * m.dim * low)
        if autocast:
            L.sub("mixed_precision_copies", m.vocab * m.dim * c)
        if s.sharded:  # the root's weights are not read in backward: given back (trainer/parallel/parallelize.py)
            L.sub("gathered_parameters", m.root_params * c)
        # ---- backward: the kept gradients are scaled in place and handed on
        L.transient("logits_and_loss", m.vocab * m.dim * low)
        L.sub("logits_and_loss", n * m.dim * c + m.vocab * m.dim * 4)
        if s.sharded:
            if not kept:
                L.add("unsharded_gradients", m.root_params * c)  # the root's, reduced at the end
        elif grads_now:
            L.add("gradients", 4 * m.root_params)
        L.sub("activations", n * m.dim * resid)
        for i in reversed(range(m.layers)):
            gather(i)
            if prefetch:
                gather(i - 1)
            if s.checkpoint_activations:  # recomputed; the input was kept (or comes back)
                L.add("activations", act - (0 if offload_acts else input_in_act))
            if s.sharded:
                if not kept:
                    L.add("unsharded_gradients", unit)
            elif grads_now:
                L.add("gradients", 4 * m.layer_params)
            L.transient("activations", max(act_grads, attention_grads))
            L.sub("activations", act)
            if autocast:
                L.sub("mixed_precision_copies", low_copies)
            if deferring:
                if not kept and reduce_bytes != c:  # accumulated in the reduce dtype
                    L.add("unsharded_gradients", rs_buffer - unit)
                release(i)
            elif s.sharded:
                # reduce-scatter: the gradients are copied into a flat input buffer in the
                # reduce dtype, which stays alive while the collective runs, behind the next
                # layer's backward (FSDP2's own stream on a GPU, gloo's thread here).
                L.add("unsharded_gradients", rs_buffer)
                L.sub("unsharded_gradients", (rs_buffer if kept else unit) + in_flight)
                in_flight = rs_buffer
                L.transient("gradients", m.layer_params * later_output)
                if first_reduce and not offload:
                    L.add("gradients", 4 * m.layer_params / S)
                release(i)
        L.sub("activations", rope_table_bytes(m, s))
        if m.tied:
            # the embedding's backward makes a dense V×d gradient of its own, added into the
            # one the loss made for the same (tied) weight: both are alive for a moment
            L.transient("gradients" if not s.sharded else "unsharded_gradients",
                        m.vocab * m.dim * (c if s.sharded else 4))
        if deferring:
            if not kept and reduce_bytes != c:
                L.add("unsharded_gradients", root_rs - m.root_params * c)
        elif s.sharded:
            L.add("unsharded_gradients", root_rs)
            L.transient("gradients", m.root_params * later_output)
            L.sub("unsharded_gradients", (root_rs if kept else m.root_params * c) + in_flight + root_rs)
            in_flight = 0
            if first_reduce and not offload:
                L.add("gradients", 4 * m.root_params / S)
    # The optimizer step is fused and in place; then the gradients are freed. With adam
    # (2 states) on several ranks, the root and the first layer are gathered for the next
    # forward while the rest is stepped (parallelize.EarlyGather).
    if s.sharded and s.world > 1 and s.optimizer_states == 2:
        L.transient("gathered_parameters", m.root_params * c + (unit if m.layers else 0))
    return L, host


def host_bytes_per_rank(s: Setup, offloaded):
    return offloaded + (HOST_RUNTIME_GB * GB if s.device == "cuda" else 0)


def comm_bytes(m: ModelShape, s: Setup):
    """Bytes each rank receives per update, by collective (the size of what is gathered or
    reduced, times the share of it that comes from other ranks)."""
    P, c = m.params, s.compute_bytes
    out = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    if s.world == 1:
        return out
    if s.sharded:
        S = s.shard
        share = (S - 1) / S
        regathered = m.layer_params * (m.layers - 1) if s.reshard_after_forward else 0
        out["all_gather"] = s.update_freq * (P + regathered) * c * share
        reduces = 1 if s.defer_grad_sync else s.update_freq
        reduce_bytes = 4 if (s.fp32_reduce_scatter or c == 4) else c
        out["reduce_scatter"] = reduces * P * reduce_bytes * share
        replicas = s.world // S
        if replicas > 1:  # hybrid_shard: the shards' gradients are all-reduced across copies
            out["all_reduce"] = reduces * 2 * (P / S) * reduce_bytes * (replicas - 1) / replicas
    else:
        out["all_reduce"] = 2 * P * 4 * (s.world - 1) / s.world
    return out


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
    comm = {k: round(v / GB, 3) for k, v in comm_bytes(m, s).items()}
    return Prediction(round(per_rank / GB, 3), round(host_rank * s.ranks_per_host / GB, 3), components, comm)
