"""Chunk sizes shared by the model's kernels and the memory planner.

models/linear_cross_entropy.py takes the loss a chunk of rows at a time and
models/cpu_attention.py a CPU's low-precision attention a chunk of heads at a time;
trainer/plan/ledger.py predicts the bytes those chunks hold. Both read the sizes here, so
a change to one is a change to the other. Imports nothing: the planner is torch-free.
Read as `chunks.NAME` at call time (not `from … import`), so that a test changing a size
changes it for the kernel and the planner alike.
"""

LOSS_CHUNK_BYTES = 32 * 2**20  # fp32 logits of one chunk of the loss's rows
# One chunk's T×T attention scores; its backward holds three such tensors.
ATTENTION_SCORES_BYTES = 8 * 2**20


def loss_chunk_rows(vocab):
    """Rows of the loss taken at once: their fp32 logits fill LOSS_CHUNK_BYTES (at least one row)."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab))


def attention_heads_per_chunk(heads, seq_len, itemsize):
    """Heads (of batch × heads) whose T×T scores a CPU's matmul attention computes at once."""
    return max(1, min(heads, ATTENTION_SCORES_BYTES // (seq_len * seq_len * itemsize)))
