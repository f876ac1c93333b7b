"""--task dpo in the walk of one update (trainer/plan/ledger.py UpdateWalk): the frozen
reference model's parameters, its forward over each micro-batch's rows before the
policy's, and the policy's per-row loss. Each function takes the walk and writes into its
ledger of device memory (or its host bytes under --cpu-offload on a GPU). Torch-free.
"""

from models import chunks  # the kernels' chunk sizes (torch-free): the model's and the prediction's are one
from trainer.plan.activations import cpu_attention_backward_bytes, rope_rows
from trainer.plan.shapes import sharded_params


def reference_model(walk):
    """The frozen reference: fp32 parameters only, sharded as the policy's (whole under DDP)."""
    held = 4 * sharded_params(walk.m, walk.s)
    if walk.offload:
        walk.host += held
    else:
        walk.ledger.add("reference_model", held)


def reference_forward(walk):
    """The frozen reference scores the micro-batch's rows first, without gradients, so
    nothing is kept from one layer to the next. Under FSDP its root is gathered for the
    whole forward and its layers one at a time (resharded after each; no prefetch is set,
    but a GPU's all-gather stream runs one layer ahead); each layer's temporaries come and
    go, as a checkpointed layer's do; then its per-row loss scores a chunk of fp32 logits
    at a time. Under context parallelism each rank scores its positions of the rows (their
    sums are all-reduced over the group: B floats)."""
    m, s, L, elem, n = walk.m, walk.s, walk.ledger, walk.elem, walk.s.tokens
    layers_gathered = min(m.layers, 2 if s.device == "cuda" else 1)
    gathered = m.root_params * elem + walk.unit * layers_gathered if s.sharded else 0
    rope = 2 * rope_rows(s) * s.seq_len * m.hd * walk.resid if m.rope else 0
    alive = gathered + n * m.dim * walk.resid + rope + walk.shared_mask  # with the residual stream
    L.add("reference_forward", alive)
    layer = max(n * elem * 2 * (m.fc1_width + m.dim), cpu_attention_backward_bytes(m, s)) + walk.layer_mask
    layer += walk.cp_forward  # context parallelism: the sequence's keys and values, gathered
    if walk.autocast:  # its weights need no gradient, so autocast casts them anew for each matmul
        layer += elem * max(m.dim * m.fc1_width, m.dim * m.qkv_width)
    L.transient("reference_forward", layer)
    low = 0 if elem == 4 else elem
    chunk = min(n, chunks.loss_chunk_rows(m.vocab, s.device)) * m.vocab * (4 + low)
    L.transient("reference_forward", n * m.dim * elem + chunk + (m.vocab * m.dim * elem if walk.autocast else 0))
    L.sub("reference_forward", alive)


def per_row_loss(walk):
    """The policy's loss, a summed cross-entropy per row (models/linear_cross_entropy.py
    LinearCrossEntropyPerRow): forward scores a chunk of fp32 logits at a time and keeps
    the hidden states (and W: the root stays gathered, backward_root gives it back);
    backward recomputes each chunk's logits and makes the gradients for the hidden
    states and, in fp32 (plus a low-precision product), for W."""
    m, L, elem, n = walk.m, walk.ledger, walk.elem, walk.s.tokens
    low = 0 if elem == 4 else elem
    chunk = min(n, chunks.loss_chunk_rows(m.vocab, walk.s.device)) * m.vocab * (4 + low)
    cast_w = m.vocab * m.dim * elem if walk.autocast else 0  # the loss casts W itself, and keeps the cast
    L.add("logits_and_loss", n * m.dim * elem)
    L.add("mixed_precision_copies", cast_w)
    L.transient("logits_and_loss", chunk)
    L.transient("logits_and_loss", n * m.dim * elem + m.vocab * m.dim * (4 + low) + chunk)
    L.sub("logits_and_loss", n * m.dim * elem)
    L.sub("mixed_precision_copies", cast_w)
