"""Iterative product quantization (iPQ; Stock et al., 2020) as fairseq 0.12 does it
(fairseq/modules/quantization/pq/): the math and the modules, no schedule (that is
trainer/train/quantization.py) and no communication.

A weight (out_features × in_features; an embedding table is rows × embedding_dim) is cut
into blocks of `block_size` consecutive input weights of each row. k-means (fairseq's EM:
em.py) over those blocks gives `n_centroids` centroids (n_centroids × block_size) and,
for each block, the index of its centroid. The layer then keeps the centroids as its
trainable parameter, the indices as a buffer, and rebuilds its weight in every forward
(fairseq's PQLinear, PQEmbedding), so training moves the centroids only.

The centroids' gradient is autograd's: the sum of the weight's gradient over the blocks
assigned to each centroid. fairseq divides it by the counts only in PQConv2d (a hook,
qconv.py); its PQLinear and PQEmbedding register no hook, and neither do these.

Determinism: fairseq draws the k-means' random choices from the global random states and
then broadcasts rank 0's result ("quantization performed on all GPUs with same seed",
pq/utils.py). Here they come from a seed: the same seed on the same device gives the same
centroids and assignments on every rank. The caller still broadcasts rank 0's (as
fairseq does), since a GPU and a CPU, or two kernels, may round a distance apart.
"""

import math
import random
import re
from collections import Counter
from operator import attrgetter

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.pq_config import layer_param

# The largest broadcast (centroids × block_size × blocks) one distance chunk makes. fairseq
# doubles its chunk count whenever a chunk raises (an out-of-memory error on GPU); a host
# may swap or be killed instead of raising, so the chunks are sized beforehand. Each
# centroid's distances are the same expression either way.
_CHUNK_ELEMENTS = 2**26


class EmptyClusterResolveError(Exception):
    """fairseq's: max_tentatives splits did not fill every cluster; k-means stops there."""


def blocks_of(weight, block_size):
    """fairseq's PQ._reshape: (out_features, in_features) → (block_size, n_blocks), block j =
    b * out_features + o holding input weights [b*block_size, (b+1)*block_size) of row o."""
    out_features, in_features = weight.shape
    if in_features % block_size != 0:
        raise ValueError(f"block size {block_size} does not divide {in_features} input features")
    return weight.reshape(out_features, -1, block_size).permute(2, 1, 0).flatten(1, 2)


def weight_of(centroids, assignments, out_features):
    """fairseq's PQ.decode and PQLinear.weight: the (out_features, in_features) weight whose
    blocks are their centroids."""
    block_size = centroids.shape[1]
    return centroids[assignments].reshape(-1, out_features, block_size).permute(1, 0, 2).flatten(1, 2)


def distances(W, centroids):
    """(n_centroids, n_blocks): the L2 distance of each column of W to each centroid, by
    fairseq's broadcast (EM.compute_distances), in centroid chunks."""
    n_chunks = max(1, math.ceil(centroids.numel() * W.shape[1] / _CHUNK_ELEMENTS))
    chunks = centroids.chunk(n_chunks, dim=0)
    return torch.cat([(W[None, :, :] - c[:, :, None]).norm(p=2, dim=1) for c in chunks], dim=0)


def _assign(W, centroids):
    return torch.argmin(distances(W, centroids), dim=0)


def _resolve_empty_clusters(W, centroids, assignments, n_centroids, eps, max_tentatives, generator, rng):
    """fairseq's EM.resolve_empty_clusters: while a cluster is empty, split the most
    populated one (ties: the first to appear in the assignments, as Counter.most_common)
    into two centroids eps-noise apart and assign again. Raises after max_tentatives + 1
    splits, even when the last one filled every cluster (fairseq checks the count after
    the split). Returns the assignments."""
    counts = Counter(assignments.tolist())
    empty = set(range(n_centroids)) - set(counts.keys())
    tentatives = 0
    while len(empty) > 0:
        k = rng.choice(list(empty))
        m = counts.most_common(1)[0][0]
        e = torch.randn(centroids[m].shape, generator=generator, dtype=centroids.dtype).to(centroids.device) * eps
        centroids[k] = centroids[m].clone()
        centroids[k] += e
        centroids[m] -= e
        assignments = _assign(W, centroids)
        counts = Counter(assignments.tolist())
        empty = set(range(n_centroids)) - set(counts.keys())
        if tentatives == max_tentatives:
            raise EmptyClusterResolveError(assignments)
        tentatives += 1
    return assignments


def kmeans(W, n_centroids, n_iter, eps=1e-6, max_tentatives=30, seed=0, generator=None, rng=None):
    """fairseq's EM over the columns of W (dim × n): (centroids n_centroids × dim, assignments n).

    The first centroids are columns drawn with replacement; each iteration assigns every
    column to its nearest centroid, fills empty clusters, and moves each centroid to the
    mean of its columns. An unresolvable empty cluster stops the iterations with the
    centroids and assignments as they are then (fairseq's PQ.encode). The draws come from
    `generator` (a CPU torch.Generator) and `rng` (a random.Random), made from `seed` when
    not given; passing them on from layer to layer continues one stream, as fairseq's
    global states do. With torch.manual_seed(s) and random.seed(s), fairseq on CPU draws
    what seed=s draws here."""
    generator = generator if generator is not None else torch.Generator().manual_seed(seed)
    rng = rng if rng is not None else random.Random(seed)
    indices = torch.randint(low=0, high=W.shape[1], size=(n_centroids,), generator=generator).long()
    centroids = W[:, indices.to(W.device)].t()
    assignments = torch.empty(0, dtype=torch.long, device=W.device)
    for _ in range(n_iter):
        assignments = _assign(W, centroids)
        try:
            assignments = _resolve_empty_clusters(
                W, centroids, assignments, n_centroids, eps, max_tentatives, generator, rng
            )
        except EmptyClusterResolveError as stop:
            assignments = stop.args[0]
            break
        for k in range(n_centroids):
            centroids[k] = W[:, assignments == k].mean(dim=1)
    return centroids.contiguous(), assignments.contiguous()


def quantize(weight, block_size, n_centroids, n_iter=15, eps=1e-6, max_tentatives=100, **draws):
    """A 2-D weight's (centroids, assignments), with quantize_model_'s defaults (15
    iterations, 100 tentatives). `draws`: seed, or generator and rng, as kmeans takes."""
    return kmeans(blocks_of(weight.detach(), block_size), n_centroids, n_iter, eps, max_tentatives, **draws)


def block_counts(assignments, centroids):
    """The blocks assigned to each centroid, as fairseq's PQ layers keep them: a bincount
    without minlength, so a trailing centroid no block uses (possible after an unresolved
    empty cluster) has no count."""
    return torch.bincount(assignments).type_as(centroids)


class PQLinear(nn.Module):
    """fairseq's PQLinear: nn.Linear's forward with its weight rebuilt from the centroids
    (the parameter), the assignments and the counts (buffers); the bias as it was."""

    def __init__(self, centroids, assignments, bias, in_features, out_features, counts=None):
        super().__init__()
        self.block_size, self.n_centroids = centroids.shape[1], centroids.shape[0]
        self.in_features, self.out_features = in_features, out_features
        if in_features % self.block_size != 0 or len(assignments) % out_features != 0:
            raise ValueError("Wrong PQ sizes")
        self.centroids = nn.Parameter(centroids, requires_grad=True)
        self.register_buffer("assignments", assignments)
        self.register_buffer("counts", block_counts(assignments, centroids) if counts is None else counts)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @property
    def weight(self):
        return weight_of(self.centroids, self.assignments, self.out_features)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"n_centroids={self.n_centroids}, block_size={self.block_size}, bias={self.bias is not None}"
        )


class PQEmbedding(nn.Module):
    """fairseq's PQEmbedding: F.embedding with the table rebuilt from the centroids. A
    negative padding_idx counts from the end, as nn.Embedding's."""

    def __init__(
        self,
        centroids,
        assignments,
        num_embeddings,
        embedding_dim,
        padding_idx=None,
        max_norm=None,
        norm_type=2.0,
        scale_grad_by_freq=False,
        sparse=False,
        counts=None,
    ):
        super().__init__()
        self.block_size, self.n_centroids = centroids.shape[1], centroids.shape[0]
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError("Padding_idx must be within num_embeddings")
        self.padding_idx = padding_idx % num_embeddings if padding_idx is not None else None
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = (
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
        )
        if embedding_dim % self.block_size != 0 or len(assignments) % num_embeddings != 0:
            raise ValueError("Wrong PQ sizes")
        self.centroids = nn.Parameter(centroids, requires_grad=True)
        self.register_buffer("assignments", assignments)
        self.register_buffer("counts", block_counts(assignments, centroids) if counts is None else counts)

    @property
    def weight(self):
        return weight_of(self.centroids, self.assignments, self.num_embeddings)

    def forward(self, ids):
        return F.embedding(
            ids, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )

    def extra_repr(self):
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        sizes = f"n_centroids={self.n_centroids}, block_size={self.block_size}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}, {sizes}"


def layer_type(module):
    """The config's name for a module's type: fairseq keys the config by class name
    ("Linear", "Embedding"); Quant-Noise's subclasses here answer as their base class."""
    for base in (nn.Linear, nn.Embedding):
        if isinstance(module, base):
            return base.__name__
    return type(module).__name__


def pq_param(module, name, config):
    """fairseq's get_param on a module (models/pq_config.py layer_param, its type as
    layer_type names it)."""
    return layer_param(layer_type(module), module, name, config)


def layers_matching(model, regex, prefix="", remove_weights=False):
    """fairseq's get_layers: the names (as model.named_parameters() gives them, without
    ".weight") whose `prefix` + name the regex matches at its start (re.match: no end
    anchor), an optional "module." before it. Names holding "bias" drop out."""
    names = [name for name, _ in model.named_parameters() if "bias" not in name]
    names = [name.replace(".weight_orig", "") for name in names]
    if remove_weights:
        names = [name.replace(".weights", "") for name in names]
    names = [name.replace(".weight", "") for name in names]
    pattern = re.compile("(module\\.)?(" + regex + ")")
    return [name for name in names if pattern.match(prefix + name)]


def set_submodule(model, name, module):
    """fairseq's attrsetter: model.<name> = module (a dotted name)."""
    *head, tail = name.split(".")
    setattr(attrgetter(".".join(head))(model) if head else model, tail, module)


def quantized_module(module, centroids, assignments, counts=None):
    """The PQ counterpart of an nn.Linear or nn.Embedding, as quantize_model_ builds it:
    the bias copied; the embedding's padding_idx, max_norm and the rest not (fairseq
    passes only the sizes to PQEmbedding)."""
    if isinstance(module, nn.Linear):
        bias = module.bias.detach().clone() if module.bias is not None else None
        return PQLinear(centroids, assignments, bias, module.in_features, module.out_features, counts)
    if isinstance(module, nn.Embedding):
        return PQEmbedding(centroids, assignments, module.num_embeddings, module.embedding_dim, counts=counts)
    raise ValueError(f"Module {module} not yet supported for quantization")


def quantize_layers_(model, names, block_sizes, n_centroids, prefix="", seed=0, size_tracker=None, **kmeans_options):
    """fairseq's quantize_model_ on the layers `names` (layers_matching's), in order: each is
    replaced in place by its PQ module. One random stream from `seed` runs through the
    layers. `prefix` + name is the name the fuzzy_name keys see. Returns `names`."""
    draws = {"generator": torch.Generator().manual_seed(seed), "rng": random.Random(seed)}
    for name in names:
        module = attrgetter(name)(model)
        block_size = pq_param(module, prefix + name, block_sizes)
        k = pq_param(module, prefix + name, n_centroids)
        weight = module.weight.detach().clone()
        centroids, assignments = quantize(weight, block_size, k, **kmeans_options, **draws)
        set_submodule(model, name, quantized_module(module, centroids, assignments))
        if size_tracker is not None:
            size_tracker.update(weight, block_size, k)
    return names


class SizeTracker:
    """fairseq's SizeTracker: the model's size in MB before and after iPQ, logged after each
    stage. The count assumes fp16 centroids and log2(n_centroids)-bit indices."""

    def __init__(self, model):
        self.size_non_compressed_model = sum(p.numel() for p in model.parameters()) * 4 / 1024 / 1024
        self.size_non_quantized = self.size_non_compressed_model
        self.size_index = self.size_centroids = 0
        self.n_quantized_layers = 0

    def update(self, W, block_size, n_centroids):
        self.n_quantized_layers += 1
        self.size_index += math.log2(n_centroids) / block_size * W.numel() / 8 / 1024 / 1024
        self.size_centroids += n_centroids * block_size * 2 / 1024 / 1024
        self.size_non_quantized -= W.numel() * 4 / 1024 / 1024

    def __repr__(self):
        size_compressed = self.size_index + self.size_centroids + self.size_non_quantized
        ratio = self.size_non_compressed_model / size_compressed
        return (
            f"Non-compressed model size: {self.size_non_compressed_model:.2f} MB. "
            f"After quantizing {self.n_quantized_layers} layers, size "
            f"(indexing + centroids + other): {self.size_index:.2f} MB + "
            f"{self.size_centroids:.2f} MB + {self.size_non_quantized:.2f} MB = "
            f"{size_compressed:.2f} MB, compression ratio: {ratio:.2f}x"
        )


class StackedLinear(nn.Module):
    """A linear layer whose weight stacks several matrices by rows (the attention's qkv_proj:
    fairseq's q_proj, k_proj and v_proj), some of them quantized: each part is a PQLinear
    (without bias) or a plain weight, and the stacked weight is rebuilt in every forward.
    fairseq quantizes q, k and v as three layers, each with its own centroids."""

    def __init__(self, parts, bias):
        super().__init__()
        self.parts = nn.ModuleDict(parts)
        self.bias = bias if bias is None else nn.Parameter(bias)

    @property
    def weight(self):
        return torch.cat([part.weight for part in self.parts.values()])

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def empty_pq_module(module, spec, device):
    """The PQ counterpart of `module` (an nn.Linear or nn.Embedding) with uninitialized
    centroids and zero assignments of the shapes `spec` ({"centroids": (k, block),
    "assignments": (n,), "counts": (m,)}) says: the place a checkpoint's values load into."""
    centroids = torch.empty(spec["centroids"], device=device)
    assignments = torch.zeros(spec["assignments"], dtype=torch.long, device=device)
    pq = quantized_module(module, centroids, assignments, torch.zeros(spec["counts"], device=device))
    if isinstance(module, nn.Linear) and module.bias is not None:
        pq.bias = nn.Parameter(torch.empty(module.bias.shape, device=device))
    return pq


def quantized_specs(shapes):
    """{module name: its PQ spec} from a checkpoint's tensor shapes ({name: shape}): a module
    saved as `<name>.centroids`, `.assignments` and `.counts` in place of `<name>.weight`."""
    specs = {}
    for name, shape in shapes.items():
        if name.endswith(".centroids"):
            module = name[: -len(".centroids")]
            specs[module] = {
                "centroids": tuple(shape),
                "assignments": tuple(shapes[module + ".assignments"]),
                "counts": tuple(shapes[module + ".counts"]),
            }
    return specs


def stacked(linear, rows, device):
    """A StackedLinear of `linear`'s shape whose parts (uninitialized, plain) are `rows`
    ({part name: row count}, in row order)."""
    parts = {name: nn.Linear(linear.in_features, n, bias=False, device=device) for name, n in rows.items()}
    bias = None if linear.bias is None else torch.empty(linear.bias.shape, device=device)
    return StackedLinear(parts, bias)


def apply_quantized(model, specs, part_rows, device):
    """Make the modules `specs` names (quantized_specs) PQ modules of those shapes, in place,
    uninitialized: what a checkpoint of a quantized model loads into. A name under
    `<owner>.parts.` is a part of a stacked weight: `owner` becomes a StackedLinear first, of
    the parts part_rows(owner) gives ({name: rows})."""
    for name, spec in specs.items():
        head, _, _ = name.rpartition(".")
        if head.endswith(".parts"):
            owner = head[: -len(".parts")]
            module = attrgetter(owner)(model)
            if not isinstance(module, StackedLinear):
                set_submodule(model, owner, stacked(module, part_rows(owner), device))
        set_submodule(model, name, empty_pq_module(attrgetter(name)(model), spec, device))


def split_stacked(state, owner, rows):
    """`state` ({name: tensor}, a model's whole tensors) with `owner`'s weight cut into the
    weights of its parts (rows: {part name: row count}), as a StackedLinear names them; a
    state already cut is returned as it is."""
    state = dict(state)
    weight = state.pop(owner + ".weight", None)
    if weight is not None:
        for part, piece in zip(rows, weight.split(list(rows.values()))):
            state[f"{owner}.parts.{part}.weight"] = piece
    return state
