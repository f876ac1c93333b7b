"""Iterative product quantization (models/pq.py, trainer/train/quantization.py) against a
transcription of fairseq 0.12's own code (modules/quantization/pq/{em,pq,utils}.py,
pq/modules/{qlinear,qemb}.py, quantization_options.py, quantization_utils.Quantizer),
run here with the global random states seeded as fairseq leaves them to its caller."""

import random
import re
from collections import Counter
from operator import attrgetter, itemgetter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from models import pq
from trainer.config.quantization import check_stage_matches, load_config, parse_config
from trainer.errors import UsageError
from trainer.train.quantization import QuantizationSchedule

README_CONFIG = Path(__file__).parent / "fixtures" / "ipq" / "transformer_quantization_config.yaml"


# --- fairseq's code, transcribed (logging and save/load left out) ---------------------


class FairseqEmptyClusterResolveError(Exception):
    pass


class FairseqPQ:
    """em.EM + pq.PQ for a 2-D weight: global torch and `random` states, fairseq's chunking."""

    def __init__(self, W, block_size, n_centroids=256, n_iter=20, eps=1e-6, max_tentatives=30):
        self.block_size = block_size
        self.out_features, self.in_features = W.size()
        assert self.in_features % self.block_size == 0
        self.W = W.reshape(self.out_features, -1, self.block_size).permute(2, 1, 0).flatten(1, 2)
        self.n_centroids, self.n_iter, self.eps, self.max_tentatives = n_centroids, n_iter, eps, max_tentatives
        self.resolved = []  # empty clusters found at each step (the objective's log line)

    def initialize_centroids(self):
        in_features, out_features = self.W.size()
        indices = torch.randint(low=0, high=out_features, size=(self.n_centroids,)).long()
        self.centroids = self.W[:, indices].t()

    def step(self, i):
        distances = self.compute_distances()
        self.assignments = torch.argmin(distances, dim=0)
        self.resolved.append(self.resolve_empty_clusters())
        for k in range(self.n_centroids):
            W_k = self.W[:, self.assignments == k]
            self.centroids[k] = W_k.mean(dim=1)

    def resolve_empty_clusters(self):
        counts = Counter(map(lambda x: x.item(), self.assignments))
        empty_clusters = set(range(self.n_centroids)) - set(counts.keys())
        n_empty_clusters = len(empty_clusters)
        tentatives = 0
        while len(empty_clusters) > 0:
            k = random.choice(list(empty_clusters))
            m = counts.most_common(1)[0][0]
            e = torch.randn_like(self.centroids[m]) * self.eps
            self.centroids[k] = self.centroids[m].clone()
            self.centroids[k] += e
            self.centroids[m] -= e
            distances = self.compute_distances()
            self.assignments = torch.argmin(distances, dim=0)
            counts = Counter(map(lambda x: x.item(), self.assignments))
            empty_clusters = set(range(self.n_centroids)) - set(counts.keys())
            if tentatives == self.max_tentatives:
                raise FairseqEmptyClusterResolveError
            tentatives += 1
        return n_empty_clusters

    def compute_distances(self):
        nb_centroids_chunks = 1
        while True:
            try:
                return torch.cat(
                    [
                        (self.W[None, :, :] - centroids_c[:, :, None]).norm(p=2, dim=1)
                        for centroids_c in self.centroids.chunk(nb_centroids_chunks, dim=0)
                    ],
                    dim=0,
                )
            except RuntimeError:
                nb_centroids_chunks *= 2

    def encode(self):
        self.initialize_centroids()
        for i in range(self.n_iter):
            try:
                self.step(i)
            except FairseqEmptyClusterResolveError:
                break

    def decode(self):
        return (
            self.centroids[self.assignments]
            .reshape(-1, self.out_features, self.block_size)
            .permute(1, 0, 2)
            .flatten(1, 2)
        )


class FairseqPQLinear(nn.Module):
    def __init__(self, centroids, assignments, bias, in_features, out_features):
        super().__init__()
        self.block_size, self.n_centroids = centroids.size(1), centroids.size(0)
        self.in_features, self.out_features = in_features, out_features
        self.centroids = nn.Parameter(centroids, requires_grad=True)
        self.register_buffer("assignments", assignments)
        self.register_buffer("counts", torch.bincount(assignments).type_as(centroids))
        self.bias = nn.Parameter(bias) if bias is not None else None

    @property
    def weight(self):
        return (
            self.centroids[self.assignments]
            .reshape(-1, self.out_features, self.block_size)
            .permute(1, 0, 2)
            .flatten(1, 2)
        )

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def fairseq_get_layers(model, filter_regexp):
    all_layers = map(itemgetter(0), model.named_parameters())
    all_layers = filter(lambda x: "bias" not in x, all_layers)
    all_layers = map(lambda x: x.replace(".weight_orig", ""), all_layers)
    all_layers = map(lambda x: x.replace(".weight", ""), all_layers)
    r = re.compile("(module\\.)?" + "(" + filter_regexp + ")")
    return list(filter(r.match, all_layers))


def fairseq_get_param(module, layer_name, param_config):
    feature, params = param_config[module.__class__.__name__]
    if feature != "fuzzy_name":
        feature_value = str(getattr(module, feature))
        if feature_value not in params:
            feature_value = "*"
    else:
        feature_values = [name for name in params if name in layer_name]
        feature_value = feature_values[0] if feature_values else "*"
    return params[feature_value]


def fairseq_parse_config_yaml(yaml_data):
    options = {"n_centroids": None, "block_sizes": None, "layers_to_quantize": None}
    for entry in ("n_centroids", "block_sizes"):
        if entry in yaml_data:
            options[entry] = {layer: (d["key"], d["value"]) for layer, d in yaml_data[entry].items()}
    if "layers_to_quantize" in yaml_data:
        options["layers_to_quantize"] = yaml_data["layers_to_quantize"]
    return options


def seed_fairseq(seed):
    torch.manual_seed(seed)
    random.seed(seed)


# --- k-means and the weight it gives ----------------------------------------------------


def clustered_weight(out_features, in_features, block_size, distinct, seed):
    """A weight whose blocks are copies of `distinct` prototypes: k-means' first centroids,
    blocks drawn with replacement, repeat one, and the copy's cluster is empty."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(distinct, block_size, generator=g)
    picks = torch.randint(distinct, (out_features * in_features // block_size,), generator=g)
    return prototypes[picks].reshape(out_features, in_features)


CASES = [  # (what it exercises, weight, block_size, n_centroids, n_iter, max_tentatives, seeds)
    ("randn 48x32", lambda: torch.randn(48, 32, generator=torch.Generator().manual_seed(1)), 4, 16, 6, 30, (0, 7)),
    ("embedding 40x16", lambda: torch.randn(40, 16, generator=torch.Generator().manual_seed(2)), 8, 8, 5, 30, (0, 7)),
    ("empty clusters split", lambda: clustered_weight(32, 32, 4, 20, 3), 4, 16, 6, 30, (0, 7)),
    ("unresolved: stops early", lambda: clustered_weight(32, 32, 4, 8, 3), 4, 16, 6, 30, (0, 7)),
    ("unresolved, all equal: stops", lambda: torch.ones(16, 16), 4, 4, 5, 3, (0,)),
    # the most populated clusters tie: the split one is the first to appear (Counter's order)
    ("most populated tie, then stops", lambda: clustered_weight(16, 16, 4, 4, 0), 4, 12, 4, 2, (0,)),
    # resolved by the last allowed split, yet fairseq stops (it counts before it checks)
    ("resolved on the last tentative: stops", lambda: clustered_weight(16, 16, 4, 10, 0), 4, 8, 4, 1, (1,)),
]


@pytest.mark.parametrize("case,seed", [pytest.param(c, s, id=f"{c[0]}, seed {s}") for c in CASES for s in c[-1]])
def test_kmeans_equals_fairseq(case, seed):
    _, make, block_size, n_centroids, n_iter, max_tentatives, _ = case
    W = make()
    seed_fairseq(seed)
    ref = FairseqPQ(W.clone(), block_size, n_centroids, n_iter, max_tentatives=max_tentatives)
    ref.encode()
    centroids, assignments = pq.quantize(W, block_size, n_centroids, n_iter, max_tentatives=max_tentatives, seed=seed)
    assert torch.equal(centroids, ref.centroids.contiguous())
    assert torch.equal(assignments, ref.assignments)
    assert torch.equal(pq.weight_of(centroids, assignments, W.shape[0]), ref.decode())
    if case[0] == "empty clusters split":
        assert sum(ref.resolved) > 0  # the split ran
    if "stops" in case[0]:
        assert len(ref.resolved) < n_iter  # fairseq's loop broke off
    else:
        assert len(ref.resolved) == n_iter


def test_blocks_round_trip_and_chunked_distances(monkeypatch):
    """Each block is its own centroid → the weight back, element for element: the block
    order is fairseq's (block index major, row minor). Distances in chunks equal one chunk."""
    W = torch.randn(12, 24)
    blocks = pq.blocks_of(W, 4)
    assert blocks.shape == (4, 12 * 6)
    assert torch.equal(blocks[:, 1 * 12 + 5], W[5, 4:8])
    assert torch.equal(pq.weight_of(blocks.t(), torch.arange(blocks.shape[1]), 12), W)
    centroids = torch.randn(10, 4)
    whole = pq.distances(blocks, centroids)
    monkeypatch.setattr(pq, "_CHUNK_ELEMENTS", 4 * blocks.shape[1] * 3)  # 3 centroids a chunk
    assert torch.equal(pq.distances(blocks, centroids), whole)


# --- the PQ modules ---------------------------------------------------------------------


def test_pq_linear_forward_and_centroid_gradient():
    """Forward: F.linear with the rebuilt weight. Gradient: fairseq's PQLinear registers no
    hook, so a centroid's gradient is the sum of the weight's gradient over its blocks
    (PQConv2d alone divides by the counts)."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 24)
    centroids, assignments = pq.quantize(linear.weight, 8, 6, n_iter=4, seed=3)
    assert not centroids.requires_grad  # k-means sees the weight's values, not its graph
    ours = pq.PQLinear(centroids.clone(), assignments, linear.bias.detach().clone(), 32, 24)
    ref = FairseqPQLinear(centroids.clone(), assignments, linear.bias.detach().clone(), 32, 24)
    x = torch.randn(5, 7, 32)
    weight = pq.weight_of(centroids, assignments, 24)
    assert torch.equal(ours(x), F.linear(x, weight, linear.bias))
    assert torch.equal(ours.weight, ref.weight)

    target = torch.randn(5, 7, 24)
    for module in (ours, ref):
        ((module(x) - target) ** 2).sum().backward()
    assert torch.allclose(ours.centroids.grad, ref.centroids.grad, rtol=0, atol=1e-5)
    assert torch.equal(ours.bias.grad, ref.bias.grad)

    # the rule itself: the weight's gradient, cut into blocks and summed per centroid
    w = weight.clone().requires_grad_(True)
    ((F.linear(x, w, linear.bias) - target) ** 2).sum().backward()
    per_block = pq.blocks_of(w.grad, 8).t()
    summed = torch.zeros_like(centroids).index_add_(0, assignments, per_block)
    assert torch.allclose(ours.centroids.grad, summed, rtol=1e-5, atol=1e-5)
    counts = torch.bincount(assignments, minlength=6).clamp(min=1)[:, None].to(summed.dtype)
    assert counts.max() > 1 and not torch.allclose(ours.centroids.grad, summed / counts, rtol=1e-3, atol=1e-5)
    assert torch.equal(ours.counts, ref.counts)
    assert set(dict(ours.named_parameters())) == {"centroids", "bias"}
    assert set(dict(ours.named_buffers())) == {"assignments", "counts"}


def test_pq_embedding_forward_and_gradient():
    """F.embedding with the rebuilt table, padding_idx included (its row gets no gradient,
    so its blocks add nothing to their centroids)."""
    torch.manual_seed(0)
    table = torch.randn(20, 16)
    centroids, assignments = pq.quantize(table, 8, 5, n_iter=4, seed=1)
    ids = torch.tensor([[1, 3, 3, 0], [19, 2, 1, 7]])
    for padding_idx in (None, 1, -19):
        emb = pq.PQEmbedding(centroids.clone(), assignments, 20, 16, padding_idx=padding_idx)
        weight = pq.weight_of(centroids, assignments, 20)
        assert torch.equal(emb(ids), F.embedding(ids, weight, padding_idx))
        grad_out = torch.randn(2, 4, 16)
        (emb(ids) * grad_out).sum().backward()
        w = weight.clone().requires_grad_(True)
        (F.embedding(ids, w, padding_idx) * grad_out).sum().backward()
        summed = torch.zeros_like(centroids).index_add_(0, assignments, pq.blocks_of(w.grad, 8).t())
        assert torch.allclose(emb.centroids.grad, summed, rtol=1e-5, atol=1e-6)
    assert emb.padding_idx == 1  # -19 of 20 rows
    with pytest.raises(ValueError, match="Wrong PQ sizes"):
        pq.PQEmbedding(centroids, assignments, 20, 12)


# --- fairseq's config file and which layers it names ----------------------------------


class FairseqLayerNames(nn.Module):
    """The parameter names of fairseq's transformer_lm with adaptive input (2 layers, 3
    bands): decoder.layers.N.{fc1,fc2,self_attn.{k,v,q,out}_proj}, and
    decoder.embed_tokens.embeddings.B.{0: table, 1: projection}."""

    def __init__(self):
        super().__init__()
        layer = lambda: nn.ModuleDict(  # noqa: E731
            {
                "self_attn": nn.ModuleDict({p: nn.Linear(16, 16) for p in ("k_proj", "v_proj", "q_proj", "out_proj")}),
                "self_attn_layer_norm": nn.LayerNorm(16),
                "fc1": nn.Linear(16, 32),
                "fc2": nn.Linear(32, 16),
                "final_layer_norm": nn.LayerNorm(16),
            }
        )
        bands = nn.ModuleList(nn.Sequential(nn.Embedding(10, w), nn.Linear(w, 16, bias=False)) for w in (16, 8, 8))
        self.decoder = nn.ModuleDict(
            {"layers": nn.ModuleList([layer(), layer()]), "embed_tokens": nn.ModuleDict({"embeddings": bands})}
        )


def test_readme_config_parses_as_fairseq():
    data = yaml.safe_load(README_CONFIG.read_text())
    config = load_config(README_CONFIG)
    expected = fairseq_parse_config_yaml(data)
    assert config == expected
    assert config["n_centroids"] == {"Linear": ("in_features", {"*": 256}), "Embedding": ("embedding_dim", {"*": 256})}
    assert config["block_sizes"] == {
        "Linear": ("fuzzy_name", {"fc": 8, "attn": 4, "emb": 4}),
        "Embedding": ("fuzzy_name", {"emb": 8}),
    }
    # plain YAML scalars keep both backslashes: the regex wants a backslash in the name
    assert config["layers_to_quantize"][0] == r"decoder\\.layers\\.\d+\\.fc[12]"
    model = FairseqLayerNames()
    for stage, regex in enumerate(config["layers_to_quantize"]):
        assert pq.layers_matching(model, regex) == fairseq_get_layers(model, regex) == []
        with pytest.raises(UsageError, match=rf"layers_to_quantize\[{stage}\].*matches no layer.*two backslashes"):
            check_stage_matches(stage, regex, [])


def test_default_regexes_and_params_equal_fairseq():
    """fairseq's built-in stages (the README file's, single backslashes): what each selects,
    and each layer's block size and centroid count by the README file's rules."""
    config = load_config(README_CONFIG)
    defaults = parse_config({})["layers_to_quantize"]
    model = FairseqLayerNames()
    stages = [pq.layers_matching(model, regex) for regex in defaults]
    assert stages == [fairseq_get_layers(model, regex) for regex in defaults]
    assert stages[0] == [f"decoder.layers.{i}.{fc}" for i in (0, 1) for fc in ("fc1", "fc2")]
    assert stages[1] == [f"decoder.embed_tokens.embeddings.{b}.{m}" for b in (0, 1, 2) for m in (0, 1)]
    assert stages[2] == [
        f"decoder.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("k_proj", "v_proj", "q_proj", "out_proj")
    ]
    expected_blocks = {"fc1": 8, "fc2": 8, "0.0": 8, "0.1": 4, "k_proj": 4, "out_proj": 4}
    for name in sum(stages, []):
        module = attrgetter(name)(model)
        block = pq.pq_param(module, name, config["block_sizes"])
        assert block == fairseq_get_param(module, name, config["block_sizes"])
        assert pq.pq_param(module, name, config["n_centroids"]) == 256
        for suffix, size in expected_blocks.items():
            if name.endswith(suffix):
                assert block == size
    # a prefix lets our names (no "decoder.") meet fairseq's regexes
    assert pq.layers_matching(model.decoder, defaults[0], prefix="decoder.") == [
        f"layers.{i}.{fc}" for i in (0, 1) for fc in ("fc1", "fc2")
    ]


def test_quantize_layers_equals_fairseq_quantize_model():
    """One stage on a model: each layer replaced by its PQ module, with the centroids and
    assignments of fairseq's quantize_model_ (one random stream through the layers)."""
    torch.manual_seed(0)
    model = FairseqLayerNames()
    ref_model = FairseqLayerNames()
    ref_model.load_state_dict(model.state_dict())
    config = parse_config(
        {
            "n_centroids": {
                "Linear": {"key": "in_features", "value": {"*": 4}},
                "Embedding": {"key": "embedding_dim", "value": {"16": 6, "*": 4}},
            }
        }
    )
    names = pq.layers_matching(model, "decoder\\.(layers\\.0\\.fc1|embed_tokens\\.embeddings\\.[01]\\.0)")
    tracker = pq.SizeTracker(model)
    assert (
        pq.quantize_layers_(
            model, names, config["block_sizes"], config["n_centroids"], seed=5, size_tracker=tracker, n_iter=3
        )
        == names
    )
    seed_fairseq(5)
    for name in names:
        module = attrgetter(name)(ref_model)
        ref = FairseqPQ(
            module.weight.data.clone(),
            fairseq_get_param(module, name, config["block_sizes"]),
            fairseq_get_param(module, name, config["n_centroids"]),
            n_iter=3,
            max_tentatives=100,
        )
        ref.encode()
        ours = attrgetter(name)(model)
        assert type(ours) is (pq.PQLinear if isinstance(module, nn.Linear) else pq.PQEmbedding)
        assert torch.equal(ours.centroids, ref.centroids.contiguous()) and torch.equal(
            ours.assignments, ref.assignments
        )
        assert torch.equal(ours.weight, ref.decode())
    assert attrgetter(names[1])(model).n_centroids == 6  # embedding_dim 16 → "16"
    assert torch.equal(model.decoder.layers[0].fc1.bias, ref_model.decoder.layers[0].fc1.bias)
    assert "After quantizing 3 layers" in repr(tracker)


# --- the schedule -----------------------------------------------------------------------


def test_schedule_by_epoch_and_by_update():
    config = parse_config({})
    by_epoch = QuantizationSchedule(config, max_epoch=6, max_update=0)
    assert [by_epoch.begin_epoch(e) for e in range(1, 8)] == [0, None, 1, None, 2, None, None]
    assert all(by_epoch.step_update(n) is None for n in range(1, 20))

    by_update = QuantizationSchedule(config, max_epoch=0, max_update=30)
    assert by_update.begin_epoch(1) == 0 and by_update.begin_epoch(2) is None
    stages = {n: by_update.step_update(n) for n in range(1, 31)}
    assert {n: s for n, s in stages.items() if s is not None} == {10: 1, 20: 2}  # 30: all done
    state = by_update.state_dict()
    assert state["quantization_step"] == 3 and state["update_schedule"] == 10
    resumed = QuantizationSchedule(config, max_epoch=0, max_update=30)
    resumed.load_state_dict(state)
    assert resumed.begin_epoch(5) is None


@pytest.mark.parametrize(
    "max_epoch,max_update,message",
    [
        (5, 0, "--max-epoch \\(=5\\) must be evenly divisible"),
        (0, 10, "--max-update \\(=10\\)"),
        (3, 30, "exactly one"),
        (0, 0, "exactly one"),
    ],
)
def test_schedule_refuses(max_epoch, max_update, message):
    with pytest.raises(UsageError, match=message):
        QuantizationSchedule(parse_config({}), max_epoch, max_update)


def test_bad_config_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("block_sizes:\n  Linear: {key: fuzzy_name}\n")
    with pytest.raises(UsageError, match="block_sizes.Linear must be"):
        load_config(bad)
    bad.write_text("layers_to_quantize: decoder.layers\n")
    with pytest.raises(UsageError, match="a list of regexes"):
        load_config(bad)
    with pytest.raises(UsageError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
