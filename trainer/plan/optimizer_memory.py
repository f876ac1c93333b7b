"""What each optimizer keeps per rank between updates, what its step allocates for a
moment, and what it communicates (the ledger's optimizer components, trainer/plan/ledger.py).

The counts follow the optimizers' code (trainer/train/optim.py, adafactor.py, lamb.py,
pointwise_optim.py, muon.py): FSDP2 shards a parameter's rows over the shard group and
creates elementwise state like the parameter, so it is sharded too; Adafactor's column
statistics of a matrix are the mean over every rank's rows, so every rank keeps them whole.
Muon's owners are packed from shapes alone by the same rule as the trainer's
(trainer/parallel/owner_packing.py), so the rank the plan charges with the most owner
work is the rank that has it. Torch-free.
"""

from dataclasses import dataclass

from trainer.parallel.owner_packing import owners_by_work
from trainer.plan.shapes import ModelShape, Setup, sharded_params

# fp32 tensors of a parameter's size kept per parameter: adam's exp_avg and exp_avg_sq,
# adamax's exp_avg and exp_inf, adadelta's square_avg and acc_delta, lamb's two moments,
# adagrad's sum, nag's momentum buffer. Adafactor and Muon are counted below.
ELEMENTWISE_STATES = {
    "adam": 2,
    "adamw": 2,
    "cpu_adam": 2,
    "nag": 1,
    "lamb": 2,
    "adamax": 2,
    "adadelta": 2,
    "adagrad": 1,
}
# Stepped by trainer/parallel/grad_sync.EarlyGather's order (trainer/train/trainer.py:
# ShardLocalAdamW and NAG, Muon being a ShardLocalAdamW): the next forward's first
# all-gathers start during their step.
EARLY_GATHER = {"adam", "adamw", "cpu_adam", "nag", "muon"}
FP32 = 4
BF16 = 2  # Muon's update, exchanged and orthogonalised in bf16


def layer_weights(m: ModelShape):
    """(rows, cols) of a decoder layer's 2-D weights as the model holds them: qkv_proj,
    out_proj, fc1, fc2 (nn.Linear's weight is out × in)."""
    return [(m.qkv_width, m.dim), (m.dim, m.inner), (m.fc1_width, m.dim), (m.dim, m.ffn)]


def muon_matrices(m: ModelShape):
    """(rows, cols) of every matrix Muon orthogonalises, in the trainer's order (layer by
    layer; qkv_proj split into q, k, v and a gated fc1 into gate and up: DecoderLayer.weight_blocks)."""
    kv = m.kv * m.hd
    fc1 = [(m.ffn, m.dim)] * (2 if m.gated else 1)
    layer = [(m.inner, m.dim), (kv, m.dim), (kv, m.dim), (m.dim, m.inner), *fc1, (m.dim, m.ffn)]
    return layer * m.layers


def root_matrices(m: ModelShape):
    """(rows, cols) of the root's tables, each a matrix of width d (the embedding, an untied
    output layer, learned positions; adaptive bands and projections counted as d-wide too:
    only their column count, d, matters for Adafactor's replicated statistics)."""
    vocab_tables = m.vocab_params if m.vocab_params is not None else m.vocab * m.dim * (1 if m.tied else 2)
    elements = vocab_tables + m.learned_positions * m.dim + m.projection_params
    tables = (1 if m.tied else 2) + (1 if m.learned_positions else 0) + (1 if m.projection_params else 0)
    return [(elements // (tables * m.dim), m.dim)] * tables


@dataclass
class OwnerLoad:
    """One rank's share of Muon's whole-matrix work: the elements of the matrices it owns
    and the largest of them (its Newton-Schulz temporaries are one matrix's at a time)."""

    elements: int
    largest: tuple  # (rows, cols); (0, 0) when it owns none


def owner_loads(m: ModelShape, ranks):
    """Each rank's OwnerLoad under the trainer's packing (largest work first onto the least
    loaded rank)."""
    matrices = muon_matrices(m)
    owners = owners_by_work([r * c * min(r, c) for r, c in matrices], ranks)
    loads = [OwnerLoad(0, (0, 0)) for _ in range(ranks)]
    for (r, c), rank in zip(matrices, owners):
        load = loads[rank]
        load.elements += r * c
        load.largest = max(load.largest, (r, c), key=lambda rc: rc[0] * rc[1])
    return loads


def newton_schulz_bytes(rows, cols):
    """Temporaries of one matrix's orthogonalisation (muon.newton_schulz), beside its input:
    the normalised X and the next X (rows × cols), the Gram matrix and its polynomial
    (short side squared), all bf16."""
    short = min(rows, cols)
    return BF16 * (2 * rows * cols + 2 * short * short)


def state_bytes(m: ModelShape, s: Setup):
    """(sharded, replicated) bytes of optimizer state per rank. Sharded state is the
    parameters' share (under tensor parallelism a mixture's experts are sharded over more
    ranks than the rest: shapes.sharded_params), exact for elementwise state."""
    P = m.params
    share = sharded_params(m, s) / P if P else 0.0  # of every parameter: 1/shard without a TP mixture
    if s.optimizer == "muon":
        matrices = sum(r * c for r, c in muon_matrices(m))
        return (FP32 * matrices + 2 * FP32 * (P - matrices)) * share, 0.0  # momentum; AdamW of the rest
    if s.optimizer == "adafactor":
        weights = layer_weights(m) * m.layers + root_matrices(m)
        vectors = P - sum(r * c for r, c in weights)
        rows = sum(r for r, _ in weights)
        # every rank keeps them whole, per logical matrix (qkv_proj's q, k, v; a gated fc1's two)
        columns = sum(c for _, c in muon_matrices(m) + root_matrices(m))
        first_moment = P if s.first_moment else 0
        return FP32 * (rows + vectors + first_moment) * share, float(FP32 * columns)
    return FP32 * s.optimizer_states * sharded_params(m, s), 0.0


def largest_param(m: ModelShape):
    # a sparse layer's stacked gate and up rows of every expert (moe.experts.fc1: E·2F × d)
    experts_fc1 = 2 * m.expert_params // 3 if m.sparse_layers else 0
    return max([r * c for r, c in layer_weights(m) + root_matrices(m)] + [experts_fc1])


def step_moments(m: ModelShape, s: Setup):
    """The moments of the step that hold the most, each {component: bytes}: the step's own
    buffers ("optimizer_step") and, for Muon, the owner's whole matrices
    ("muon_owner_workspace"). Elementwise temporaries of one parameter at a time are
    counted at the largest parameter's shard."""
    held, S = sharded_params(m, s), s.shard  # this rank's parameters
    one = FP32 * largest_param(m) / S  # one fp32 temporary of the largest parameter's shard
    foreach = s.device == "cuda"  # torch's adagrad/adadelta take their foreach path on a GPU only
    temps = {
        # the updates of every parameter, kept until the clipping by the update's RMS; the
        # row × column factor of the largest one
        "adafactor": FP32 * held + one,
        # the updates of every parameter, kept until the trust ratios; one parameter's
        # clipped gradient and denominator
        "lamb": FP32 * held + 2 * one,
        "adamax": FP32 * held,  # _foreach_add(exp_infs, eps): one list the model's size
        "adagrad": FP32 * held if foreach else one,  # sqrt of the sums
        "adadelta": 2 * FP32 * held if foreach else 2 * one,  # std and delta
    }
    if s.optimizer == "muon":
        return muon_moments(m, s)
    return [{"optimizer_step": temps.get(s.optimizer, 0.0)}]


def muon_moments(m: ModelShape, s: Setup):
    """Muon's step (trainer/train/muon.py) on the rank with the most owner work: its bf16
    updates of its shares stay alive through the step; the exchange (matrix_owners.py)
    sends a flat copy of them and receives the owned matrices' rows, reassembles them, and
    after Newton-Schulz sends the results back in a flat buffer and receives its rows.
    Without sharding nothing is sent: the whole matrices are copies of the rank's own."""
    S = s.shard
    share = BF16 * sum(r * c for r, c in muon_matrices(m)) / S
    load = max(owner_loads(m, S), key=lambda lo: BF16 * lo.elements + newton_schulz_bytes(*lo.largest))
    owned = BF16 * load.elements
    sent = 1 if S > 1 else 0  # the flat send and the receive buffer exist only with a collective
    return [
        # gather: updates + flat send; receive buffer + reassembled matrices
        {"optimizer_step": (1 + sent) * share, "muon_owner_workspace": (1 + sent) * owned},
        # Newton-Schulz of the last matrix: updates; whole matrices + results + temporaries
        {"optimizer_step": share, "muon_owner_workspace": 2 * owned + newton_schulz_bytes(*load.largest)},
        # scatter: updates + receive buffer; whole matrices + results + flat send
        {"optimizer_step": (1 + sent) * share, "muon_owner_workspace": (2 + sent) * owned},
    ]


def parameter_tensors(m: ModelShape):
    """How many parameter tensors the model has (Adafactor reduces a float or two per tensor)."""
    per_norm = 2 if m.norm == "layernorm" and m.norm_bias else 1
    layer = 4 + (4 if m.bias else 0) + 2 * per_norm + (2 if m.qk_norm else 0)
    return m.layers * layer + len(root_matrices(m)) + m.norms_outside_layers * per_norm


def alive_at_early_gather(m: ModelShape, s: Setup):
    """What the step still holds when it starts the next forward's all-gathers (its `then`):
    Muon calls it after every parameter has stepped, its updates and its owned matrices and
    results still referenced; AdamW and NAG hold nothing of their own."""
    if s.optimizer != "muon":
        return {}
    share = BF16 * sum(r * c for r, c in muon_matrices(m)) / s.shard
    load = max(owner_loads(m, s.shard), key=lambda lo: lo.elements)
    return {"optimizer_step": share, "muon_owner_workspace": 2 * BF16 * load.elements}


def optimizer_comm(m: ModelShape, s: Setup):
    """{collective: bytes each rank receives per update} of the step itself, over the
    shard group (HSDP's replicas hold the same rows and exchange nothing here)."""
    S = s.shard
    if S == 1:
        return {}
    share = (S - 1) / S
    # Adafactor's and LAMB's sums are per logical tensor: qkv_proj counts 3 (q, k, v), a gated
    # fc1 2 (gate, up), and their biases as many again
    stacked = m.layers * (2 + (1 if m.gated else 0)) * (2 if m.bias else 1)  # beyond one a parameter
    if s.optimizer == "adafactor":  # per matrix its rows' sum and column sums, then every update's square sum
        floats = sum(1 + c for _, c in muon_matrices(m) + root_matrices(m)) + parameter_tensors(m) + stacked
        return {"all_reduce": 2 * FP32 * floats * share}
    if s.optimizer == "lamb":  # the gradients' norm and each decayed matrix's, then each update's
        return {"all_reduce": 2 * FP32 * (1 + 2 * len(muon_matrices(m))) * share}
    if s.optimizer == "muon":  # bf16 rows to their owners and back: per direction ~ the rank's share
        elements = sum(r * c for r, c in muon_matrices(m))
        return {"all_to_all": 2 * BF16 * elements / S * share}
    return {}
