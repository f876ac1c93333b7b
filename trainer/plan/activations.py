"""What one decoder layer saves for backward, and what its backward holds, in bytes.

The saved-activation counts follow models/layer.py, as autograd's saved-tensor
hooks see them (tests/test_plan_models.py counts them on the real layer): a pre-LN layer saves
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
--qk-norm) saves differently. RMSNorm (models/norms.py's own, on every device)
saves its input and rstd, like LayerNorm. The rotary embedding's muls save
only the cos/sin tables (one pair per forward, shared by every layer; under autocast each
layer casts them for q and for k), and its rotated q and k are new tensors that attention
saves beside q/k/v (v stays a view of qkv_proj's output). Grouped-query attention saves the
kv heads only in SDPA (enable_gqa), but a CPU's bf16 attention repeats them to every query
head first and saves the repeated ones. The gated feed-forward saves fc1's output (gate and
up, 2·ffn wide), the activation of the gate and their product.

A mixture of experts' layer (models/moe.py) saves, in place of the feed-forward's tensors,
the router's and the experts' (sparse_ffn_saved_bytes); its dispatch's transients are
sparse_ffn_transient_bytes'. Under tensor parallelism both are of the rank's own positions,
which it routes through whole experts, and the router keeps its norm's output ungathered.

Quant-Noise's fc1 and fc2 keep the noised copy of their weights they multiplied by, and
--quant-noise-scalar's clamps their outputs before the clamps (models/quant_noise.py).
"""

from models import chunks  # the kernels' chunk sizes (torch-free): the model's and the prediction's are one
from trainer.plan.shapes import ModelShape, Setup


def cpu_attention_backward_bytes(m, s):
    """The T×T tensors a CPU's bf16/fp16 attention holds at once in one layer's backward
    (models/cpu_attention.py): probabilities and two gradients for one chunk of heads.
    Under context parallelism a rank's chunks of the sequence go one at a time, each over
    the keys up to its end: the last chunk's queries × all T keys at most. 0 where attention
    is SDPA's (CUDA, fp32, attention dropout)."""
    if not uses_cpu_matmul_attention(m, s):
        return 0
    queries = s.seq_len if s.cp == 1 else -(-s.seq_len // (2 * s.cp))
    per_head = queries * s.seq_len * 2
    return 3 * chunks.attention_heads_per_chunk(s.rows * m.heads, queries, 2, keys=s.seq_len) * per_head


def norm_saved_bytes(m: ModelShape, s: Setup, gathered=True):
    """Per token, what one norm before a matmul saves, that matmul's saved input included.
    gathered=False: the norm before a mixture of experts, whose router keeps the norm's output
    on the rank's own positions."""
    elem = s.compute_bytes  # bytes of one element in the compute dtype
    stream = 4 if s.precision != "fp32" and not s.sharded else elem  # autocast keeps the residual stream fp32
    # input, (mean,) rstd, output. Under tensor parallelism the norm sees 1/tp of the positions
    # (sequence parallelism) and a column-parallel matmul keeps its input all-gathered over them.
    return (stream * m.dim + (4 if m.norm == "rmsnorm" else 8) + (0 if gathered else elem * m.dim)) / s.tp + (
        elem * m.dim if gathered else 0
    )


# Activations whose backward keeps their output, not their input: the tensor fc2 (or the
# gate's product) keeps anyway, so they add no saved tensor of their own.
SAVES_OUTPUT = ("relu", "tanh", "linear")


def ffn_saved_width(m: ModelShape):
    """Per token, elements of the feed-forward's saved tensors (its input aside)."""
    ffn, act = m.ffn, m.activation_fn
    squared = ffn if act == "relu_squared" else 0  # relu's output, which pow keeps, besides pow's
    if m.gated:  # fc1's output (up is a view of it), act(gate) unless linear, the product fc2 keeps
        return 2 * ffn + (0 if act == "linear" else ffn) + squared + ffn
    return (ffn if act in SAVES_OUTPUT else 2 * ffn) + squared


def uses_cpu_matmul_attention(m: ModelShape, s: Setup):
    """models/cpu_attention.py: low precision on a CPU without attention dropout, and causal
    (packed documents' block-causal mask goes to SDPA instead)."""
    return s.device == "cpu" and s.precision != "fp32" and m.attention_dropout == 0 and not s.packed_documents


def document_mask_bytes(m: ModelShape, s: Setup):
    """(the mask shared by every layer, what one layer's attention adds) with packed
    documents: the B×1×T×T bool block-causal mask is built once per forward
    (models/documents.py; B×1×T/cp×T, the rank's queries over every key, under context
    parallelism), and SDPA turns it into an additive mask of q's dtype in every layer,
    which its backward keeps (counted on the real SDPA by tests/test_plan_tasks.py).
    Plain causal sequences have none, under context parallelism too (each chunk attends
    to the keys before its end: models/layer.py causal_attention)."""
    if not s.packed_documents:
        return 0, 0
    square = s.rows * s.local_seq_len * s.seq_len
    return square, square * s.compute_bytes


def rope_table_bytes(m: ModelShape, s: Setup):
    """The (cos, sin) pair of one forward, in the embeddings' dtype, shared by every layer.
    Under autocast no layer saves the fp32 pair itself, only its casts (layer_activation_bytes)."""
    if not m.rope or (s.precision != "fp32" and not s.sharded):
        return 0
    return 2 * rope_rows(s) * s.local_seq_len * m.hd * s.compute_bytes


def rope_rows(s: Setup):
    """Rows of rotary tables: one for all rows, or one per row with packed documents (each
    position's angle counts from its document's start)."""
    return s.rows if s.packed_documents else 1


def expert_rows(m: ModelShape, s: Setup):
    """Rows one rank's experts take per sparse layer and micro-batch: its own tokens' N·k
    choices (N: the positions it routes, 1/tp of the micro-batch's under tensor parallelism);
    under expert parallelism the choices of the group's tokens routed to its E/ep experts,
    which routing decides. Predicted at balance (N·k); at worst every token of the group goes
    to this rank's experts: ep·N·k (trainer/plan/report.py states it)."""
    return s.routed_tokens * m.top_k


def sparse_ffn_saved_bytes(m: ModelShape, s: Setup):
    """What a sparse layer's mixture of experts (models/moe.py MoEFeedForward) saves for
    backward, its input aside (the norm's output, counted with the norm): the router's fp32
    probabilities (N×E: softmax keeps its output), three N·k int64 index tensors (top-k's
    ids, the order that sorts them by expert, the tokens' ids that x[tokens] and index_add
    keep), --moe-norm-topk-prob's fp32 weights and their sum, the weights in sorted order
    (N·k); per row an expert takes, its input row (d), gate and up (2F), act(gate) and the
    product (F each); the experts' N·k×d outputs the weighting keeps, and their weighted copy
    index_add keeps. Under expert parallelism the sorted copies x[tokens] are sent, not saved:
    the received rows, put in expert order (the int64 order kept), are what the experts save,
    and the unpermuting index_add keeps their outputs before they travel back. N: the tokens
    the rank routes (under tensor parallelism its own positions, Setup.routed_tokens)."""
    n, k, elem, E, d, F = s.routed_tokens, m.top_k, s.compute_bytes, m.experts, m.dim, m.expert_ffn
    routing = n * E * 4 + 3 * n * k * 8 + (n * k * 4 + n * 4 if m.norm_topk else 0) + n * k * elem
    rows = expert_rows(m, s)
    experts = rows * elem * (d + 4 * F) + (rows * (8 + d * elem) if s.ep > 1 else 0)
    return routing + experts + 2 * n * k * d * elem


def sparse_ffn_transient_bytes(m: ModelShape, s: Setup):
    """(forward, backward) bytes a sparse layer's dispatch holds for a moment beyond what it
    saves. Forward, one process: the experts' outputs before they are concatenated (N·k×d),
    and the index_add's N×d result. Under expert parallelism the exchanges' buffers: the
    sorted copies sent (N·k×d), the rows received and the outputs unpermuted to go back
    (rows×d each). Backward: the gradient coming in (N×d),
    that of the weighted outputs and of the outputs (N·k×d each; then the input rows'
    pieces and their concatenation), under expert parallelism the exchanges' again. N: as
    sparse_ffn_saved_bytes'."""
    n, k, elem, d = s.routed_tokens, m.top_k, s.compute_bytes, m.dim
    rows = expert_rows(m, s)
    if s.ep > 1:
        return (n * k * d + 2 * rows * d) * elem, (n * d + 2 * n * k * d + 2 * rows * d) * elem
    return (n * k * d + n * d) * elem, (n * d + 2 * n * k * d) * elem


def layer_activation_bytes(m: ModelShape, s: Setup, sparse=False):
    """Bytes one decoder layer's forward saves for backward, for s.tokens tokens; sparse: a
    mixture of experts' layer (its feed-forward is sparse_ffn_saved_bytes')."""
    n, elem = s.tokens, s.compute_bytes  # tokens; bytes of one element in the compute dtype
    mask = 1 if s.device == "cuda" else elem  # one dropout-mask element
    autocast = s.precision != "fp32" and not s.sharded
    cpu_matmul = uses_cpu_matmul_attention(m, s)
    q_and_kv = m.heads + m.kv  # heads q_norm and k_norm see
    # the two norms before qkv_proj and fc1 (or the router), and the attention output out_proj keeps
    per_token = norm_saved_bytes(m, s) + norm_saved_bytes(m, s, gathered=not sparse) + elem * m.inner
    if cpu_matmul:  # q (scaled), k and v, each repeated to every query head
        per_token += 3 * elem * m.inner
    else:  # qkv_proj's output (v is a view of it), the rotated (or normalized) q and k
        per_token += elem * m.qkv_width + (elem * (m.inner + m.kv * m.hd) if m.rope or m.qk_norm else 0)
    if m.qk_norm:  # rstd per head (models/norms.py RMSNorm); its input is a view of qkv's output
        per_token += 4 * q_and_kv + (elem * m.qkv_width if cpu_matmul else 0)
    dense_ffn = not sparse
    per_token += elem * ffn_saved_width(m) * dense_ffn
    masks = (m.dropout > 0) * 2 * m.dim * mask / s.tp + (m.activation_dropout > 0) * m.ffn * mask * dense_ffn
    if dense_ffn and m.activation_dropout > 0 and m.activation_fn in ("relu", "tanh") and not m.gated:
        masks += m.ffn * elem  # fc2 now keeps the dropped output, the activation still its own
    if m.attention_dropout > 0 and s.device != "cuda":
        # the math path, in fp32 on a CPU: probabilities, dropout mask and dropped
        # probabilities (T×T per head), and q/k/v as fp32 copies of low-precision ones
        masks += m.heads * s.seq_len * 3 * 4
        per_token += m.qkv_width * (4 - elem)
    elif not cpu_matmul:
        per_token += m.heads * 4  # the fused kernel's log-sum-exp
    # else models/cpu_attention.py: nothing more; backward recomputes
    # autocast casts the rope tables to q's and k's dtype in every layer: four T×head_dim copies
    tables = 4 * rope_rows(s) * s.local_seq_len * m.hd * elem if m.rope and autocast else 0
    # Quant-Noise: fc1 and fc2 keep the noised copy of their weights they multiplied by
    # (under autocast that copy's cast, as they would keep the weight's); with both noises
    # the scalar noise's clamp keeps the pq-noised copy too (in fp32 under autocast), and
    # the scalar noise's output clamps keep fc1's and fc2's outputs.
    weights = (m.dim * m.fc1_width + m.ffn * m.dim) * dense_ffn
    copies = 4 * (m.pq_noise and m.scalar_noise) if autocast else elem * (m.pq_noise + m.scalar_noise)
    if m.scalar_noise and dense_ffn:
        per_token += elem * (m.fc1_width + m.dim)
    moe = sparse_ffn_saved_bytes(m, s) if sparse else 0
    return n * (per_token + masks) + tables + copies * weights + moe
