"""What the planner knows of a run: the model's shape and the trainer's setup, from the
config (trainer/plan/search.py builds both). Torch-free: plain numbers and flags."""

from dataclasses import dataclass, replace
from typing import Optional

from trainer.config.schema import SHARDED_BACKENDS


@dataclass(frozen=True)
class PQLayer:
    """A layer iPQ has quantized by the run's last stage (trainer/plan/quantized.py): its
    weight (rows × cols) is gone; it holds `centroids` × `block` centroids (a parameter,
    sharded and optimized as any) and, whole on every rank (FSDP does not shard buffers), one
    int64 assignment per block and a float count per centroid, and rebuilds the weight in
    every forward (models/pq.py)."""

    name: str  # fairseq's (decoder.layers.0.fc1, decoder.embed_tokens)
    layer: int  # the decoder layer holding it; -1: the root (tables, projections)
    rows: int
    cols: int
    block: int
    centroids: int

    @property
    def weight(self):
        return self.rows * self.cols

    @property
    def params(self):
        return self.centroids * self.block

    @property
    def saved(self):
        """Parameters fewer than the layer had: its weight, less its centroids."""
        return self.weight - self.params

    @property
    def buffer_bytes(self):
        """Its assignments (int64, one per block) and counts (fp32, at most one per centroid)."""
        return 8 * self.weight // self.block + 4 * self.centroids


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
    # (--decoder-input-dim/--decoder-output-dim), and --quant-noise-pq's quant_noise layer
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
    pq_noise: bool = False  # --quant-noise-pq: fc1 and fc2 multiply by a noised copy of their weights
    scalar_noise: bool = False  # --quant-noise-scalar: so do they, and they clamp their outputs (and the logits)
    # Mixtures of experts (models/moe.py): the sparse layers hold, in place of fc1 and fc2, a
    # router (E×d, no bias) and `experts` gated experts of width expert_ffn (gate, up, down:
    # 3·d·F each, no biases); each token goes to top_k of them. The other layers are dense.
    experts: int = 0
    expert_ffn: int = 0
    top_k: int = 0
    norm_topk: bool = False  # --moe-norm-topk-prob: the top-k weights renormalized
    sparse_layers: tuple = ()  # their ids (models/config.py moe_layers)
    pq: tuple = ()  # --quantization-config-path: the layers quantized at the last stage (PQLayer)

    def pq_of(self, i):
        """The quantized layers of decoder layer i (-1: the root's)."""
        return [p for p in self.pq if p.layer == i]

    def pq_weights(self, i):
        """Elements of the weights decoder layer i (-1: the root) rebuilds in every forward."""
        return sum(p.weight for p in self.pq_of(i))

    @property
    def pq_buffer_bytes(self):
        """iPQ's assignments and counts: whole on every rank."""
        return sum(p.buffer_bytes for p in self.pq)

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
        dim = self.dim
        return dim * self.qkv_width + self.inner * dim + dim * self.fc1_width + self.ffn * dim

    @property
    def layer_params(self):
        dim = self.dim
        biases = (self.qkv_width + dim + self.fc1_width + dim) if self.bias else 0
        qk_norms = 2 * self.hd if self.qk_norm else 0
        return self.matmul_params + biases + 2 * self.norm_params(dim) + qk_norms + self.normformer_params

    @property
    def ffn_params(self):
        """A dense layer's feed-forward: fc1 and fc2, with their biases."""
        biases = (self.fc1_width + self.dim) if self.bias else 0
        return self.dim * self.fc1_width + self.ffn * self.dim + biases

    @property
    def expert_params(self):
        """One sparse layer's experts (moe.experts.fc1 and fc2): E·3·d·F."""
        return self.experts * 3 * self.dim * self.expert_ffn

    @property
    def moe_params(self):
        """One sparse layer's mixture of experts (layer.moe): the router (E×d) and the experts."""
        return self.experts * self.dim + self.expert_params

    @property
    def sparse_layer_params(self):
        """A sparse layer: the dense layer's attention and norms, the router and the experts."""
        return self.layer_params - self.ffn_params + self.moe_params

    def is_sparse(self, i):
        return i in self.sparse_layers

    def params_of(self, i):
        """Layer i's parameters (FSDP's unit): iPQ's centroids in its quantized weights' place."""
        dense = self.sparse_layer_params if self.is_sparse(i) else self.layer_params
        return dense - sum(p.saved for p in self.pq_of(i))

    @property
    def root_params(self):
        """Parameters outside the decoder layers: FSDP's root unit."""
        dim = self.dim
        tables = self.vocab * dim * (1 if self.tied else 2) if self.vocab_params is None else self.vocab_params
        return (
            tables
            + self.learned_positions * dim
            + self.norms_outside_layers * self.norm_params(dim)
            + self.projection_params
            - sum(p.saved for p in self.pq_of(-1))
        )

    @property
    def params(self):
        sparse = len(self.sparse_layers)
        quantized = sum(p.saved for p in self.pq if p.layer >= 0)  # the root's are root_params'
        return (
            (self.layers - sparse) * self.layer_params
            + sparse * self.sparse_layer_params
            + self.root_params
            - quantized
        )


def tensor_parallel_share(m: ModelShape, tp: int):
    """The model one rank of a tensor-parallel group holds (trainer/parallel/tensor_parallel.py):
    1/tp of the query and key/value heads, of the feed-forward's width and of the vocabulary's
    rows; the norms, the width d, learned positions and a mixture of experts' router and experts
    whole (each rank routes its own positions through whole experts; FSDP shards them over the
    TP ranks too: sharded_params). Its parameter count is the rank's before FSDP shards it.
    With fewer key/value heads than ranks, a rank attends with one whole head (gathered from
    the pieces of it the ranks sharing it hold): counted as one head's rows, a few more than
    the rank holds."""
    if tp == 1:
        return m
    return replace(
        m,
        heads=m.heads // tp,
        kv_heads=max(1, m.kv // tp),
        head_dim=m.hd,
        ffn=m.ffn // tp,
        vocab=-(-m.vocab // tp),
    )


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
    sequences: int  # per micro-batch per rank: --batch-size (dpo: pairs, each two rows)
    seq_len: int
    precision: str  # "fp32", "bf16" or "fp16"
    fp32_reduce_scatter: bool
    optimizer_states: int  # fp32 tensors kept per parameter (adafactor's, muon's: plan/optimizer_memory.py)
    spawned: bool = False  # a local rank the launcher forks (not a process of its own)
    # --task dpo: each sample is two rows (chosen, rejected), scored per row, and a frozen
    # reference model runs its own forward on them first (trainer/train/objectives.py DPOLoss).
    dpo: bool = False
    # --task sft or --per-document-attention: packed documents, so every forward builds a
    # block-causal mask and rotary tables per position (models/documents.py).
    packed_documents: bool = False
    optimizer: str = "adam"  # --optimizer: what its state and its step hold (trainer/plan/optimizer_memory.py)
    first_moment: bool = False  # adafactor's --beta1: an fp32 first moment per parameter
    # --store-ema: bytes per parameter of the moving average (trainer/train/ema.py), sharded as
    # the parameters are; 4 with --ema-fp32 or fp32 training, else 2; 0 without it.
    ema_bytes: int = 0
    # --model-parallel-size (trainer/parallel/tensor_parallel.py) and --context-parallel-size:
    # ranks are data × context × tensor; `shard` above counts FSDP's ranks (data × context).
    tp: int = 1
    cp: int = 1
    # --expert-parallel-size (trainer/parallel/experts.py): each sparse layer's experts split
    # over ep consecutive ranks of the MoE's shard group (moe_shard), FSDP-sharded over the
    # moe_shard // ep ranks that hold the same ones. Per rank that is still 1/moe_shard of
    # them; gathered, E/ep experts.
    ep: int = 1
    # the model and optimizer are ones tensor parallelism splits (no adaptive bands, Quant-Noise,
    # --scale-fc, whole-matrix optimizer or --compile): the search may try tp > 1
    model_parallel_ok: bool = True

    @property
    def moe_shard(self):
        """Ranks FSDP shards a sparse layer's mixture of experts over (its own unit under tensor
        parallelism: trainer/parallel/parallelize.py token_mesh): the shard group's data-parallel
        and tensor-parallel ranks together; under expert parallelism the experts split over ep of
        them and are sharded over the moe_shard // ep others."""
        return self.shard * self.tp

    @property
    def routed_tokens(self):
        """Tokens a rank routes through its sparse layers per micro-batch: its own positions of
        the micro-batch's (sequence parallelism gives each TP rank its T/tp of every row, the
        first ranks one more where T does not split evenly)."""
        return self.rows * -(-self.local_seq_len // self.tp)

    @property
    def data_parallel(self):
        """Ranks that read distinct batches: the world over the tensor and context groups."""
        return max(1, self.world // (self.tp * self.cp))

    @property
    def local_seq_len(self):
        """Positions of each sequence this rank holds: all of them, or 1/cp under context parallelism."""
        return self.seq_len // self.cp

    @property
    def sharded(self):
        return self.backend in SHARDED_BACKENDS

    @property
    def ddp_buckets(self):
        """torch's DDP on several ranks: every gradient is a view into its flat buckets,
        allocated once and kept."""
        return not self.sharded and self.world > 1 and self.backend == "pytorch_ddp"

    @property
    def rows(self):
        """Sequences the model sees per micro-batch: a dpo pair is two."""
        return self.sequences * (2 if self.dpo else 1)

    @property
    def tokens(self):
        """Tokens of the micro-batch the rank's layers see: its share of the sequence under
        context parallelism (the tensor-parallel split of the residual stream is the ledger's)."""
        return self.rows * self.local_seq_len

    @property
    def compute_bytes(self):
        return 4 if self.precision == "fp32" else 2


def sharded_params(m: ModelShape, s: Setup, layers=None):
    """Parameters one rank holds of `m` (under tensor parallelism the rank's share), or of
    the layers `layers` only: FSDP's 1/shard of them, a sparse layer's router and experts
    1/moe_shard (their own unit under tensor parallelism, sharded over its ranks too)."""
    if layers is None:
        total, sparse = m.params, len(m.sparse_layers)
    else:
        total, sparse = sum(m.params_of(i) for i in layers), sum(1 for i in layers if m.is_sparse(i))
    moe = sparse * m.moe_params
    return (total - moe) / s.shard + moe / s.moe_shard
