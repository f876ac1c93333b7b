"""Chunk sizes shared by the model's kernels and the memory planner.

models/linear_cross_entropy.py takes the loss a chunk of rows at a time and
models/cpu_attention.py a CPU's low-precision attention a chunk of heads at a time;
trainer/plan/ledger.py predicts the bytes those chunks hold. Both read the sizes here, so
a change to one is a change to the other. Imports nothing: the planner is torch-free.
Read as `chunks.NAME` at call time (not `from … import`), so that a test changing a size
changes it for the kernel and the planner alike.
"""

# fp32 logits of one chunk of the loss's rows. Each chunk also makes a whole V×d gradient
# for W (a matmul whose inner size is the chunk's rows) and adds it into the fp32 sum, so
# fewer, larger chunks cost less; a CPU keeps them small for its caches and resident set.
# A GPU has the memory to spare and loses most to small matmuls and per-chunk launches: a
# GiB is a few thousand rows at a 128k vocabulary, a small part of a GPU's memory next to
# the N×V logits of the plain form.
LOSS_CHUNK_BYTES = 32 * 2**20
LOSS_CHUNK_BYTES_GPU = 2**30
# One chunk's T×T attention scores (T×S, T queries over S keys); its backward holds three
# such tensors.
ATTENTION_SCORES_BYTES = 8 * 2**20


def loss_chunk_rows(vocab, device_type):
    """Rows of the loss taken at once on a device of this type ("cuda", "cpu", …): their fp32
    logits fill LOSS_CHUNK_BYTES_GPU on a GPU, LOSS_CHUNK_BYTES elsewhere (at least one row)."""
    budget = LOSS_CHUNK_BYTES_GPU if device_type == "cuda" else LOSS_CHUNK_BYTES
    return max(1, budget // (4 * vocab))


def attention_heads_per_chunk(heads, seq_len, itemsize, keys=None):
    """Heads (of batch × heads) whose T×T scores (T×keys) a CPU's matmul attention computes
    at once."""
    return max(1, min(heads, ATTENTION_SCORES_BYTES // (seq_len * (keys or seq_len) * itemsize)))
