"""`plan --serve` (trainer/plan/serve.py): one serving rank's memory, and whether it fits;
for a mixture of experts, its parameters against the built model's and its experts'
dispatch against the real block's."""

import json
import weakref

import pytest
import torch
from plan_helpers import cfg_of
from test_generate import MAX_POSITIONS, VOCAB, tiny_model
from test_plan_moe import MOE

import cli
from models.batch_cache import BatchKVCache
from trainer.plan.ledger import GB
from trainer.plan.search import model_shape
from trainer.plan.serve import ServeSetup, kv_cache_bytes, serve_components, serve_plan, sparse_ffn_bytes
from trainer.plan.shapes import ModelShape


def shape(**kw):
    base = dict(layers=2, dim=64, ffn=128, heads=2, vocab=VOCAB, learned_positions=0, tied=True)
    base.update(norms_outside_layers=1, activation_fn="relu", dropout=0.0, attention_dropout=0.0)
    return ModelShape(**{**base, "activation_dropout": 0.0, **kw})


def test_components_scale():
    m = shape()
    one = serve_components(m, ServeSetup("cuda", 1, 8, 1024))
    four = serve_components(m, ServeSetup("cuda", 4, 8, 1024))
    double = serve_components(m, ServeSetup("cuda", 4, 16, 1024))
    assert four["parameters"] == one["parameters"] / 4  # sharded over the world
    assert four["kv_cache"] == one["kv_cache"]  # whole on every rank
    assert double["kv_cache"] == 2 * four["kv_cache"]  # one row per request decoded together
    assert one["gathered_parameters"] == 0 < four["gathered_parameters"]  # one rank gathers nothing


def allocated(model):
    """The bytes of a 5-row BatchKVCache of `model`, allocated by its first forward."""
    cache = BatchKVCache(model, 5, MAX_POSITIONS)
    cache.add_row()
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), cache=cache.rows(0, 1))
    return sum(t.numel() * t.element_size() for t in cache.k + cache.v)


def test_kv_cache_matches_the_engine():
    """The cache BatchKVCache allocates, in bytes, for plain and grouped-query attention."""
    for overrides, kv in (({}, 0), ({"decoder_kv_heads": 1}, 1)):
        measured = allocated(tiny_model(**overrides))
        assert kv_cache_bytes(shape(kv_heads=kv), ServeSetup("cpu", 1, 5, MAX_POSITIONS)) == measured
    # serve --bf16: the cache takes the weights' dtype
    measured = allocated(tiny_model().to(torch.bfloat16))
    assert kv_cache_bytes(shape(), ServeSetup("cpu", 1, 5, MAX_POSITIONS, elem=2)) == measured


def test_fits_and_what_would():
    m = shape(layers=48, dim=1600, ffn=6400, heads=25, vocab=50257)  # gpt2-xl's size
    s = ServeSetup("cuda", 1, 16, 1024)
    need = sum(serve_components(m, s).values()) / GB
    assert serve_plan(m, s, need + 0.01)["fits"]
    plan = serve_plan(m, s, need - 0.5)
    assert not plan["fits"]
    world, batch = plan["fit_with"]
    assert batch == 16 and world > 1
    assert serve_plan(m, ServeSetup("cuda", world, 16, 1024), need - 0.5)["fits"]
    assert not serve_plan(m, ServeSetup("cuda", world - 1, 16, 1024), need - 0.5)["fits"] or world == 2
    # A cache larger than the device: no world size helps, fewer rows do.
    big = serve_plan(m, ServeSetup("cuda", 1, 512, 1024), 8.0)
    assert big["fit_with"][1] < 512
    assert serve_plan(m, ServeSetup("cuda", 1, 1, 1024), 1.0)["fit_with"] is None


def test_command_line(capsys):
    argv = ["--serve", "--arch", "transformer_lm_gpt2_big", "--tokens-per-sample", "2048", "--max-batch", "64"]
    two_ranks = ["--device-memory-gb", "4", "--distributed-world-size", "2", "--format", "json"]

    def plan(*flags):
        assert cli.plan_main(argv + two_ranks + list(flags)) == 0
        return json.loads(capsys.readouterr().out)

    full = plan()
    assert not full["fits"] and full["max_batch"] == 64 and full["world_size"] == 2
    assert set(full["components"]) >= {"parameters", "gathered_parameters", "kv_cache", "activations", "logits"}
    assert cli.plan_main(argv + ["--device-memory-gb", "140"]) == 0
    assert capsys.readouterr().out.strip().endswith("fits")
    # --bf16 (serve's): two bytes a weight and a cached key
    half = plan("--bf16")["components"]
    for part in ("parameters", "kv_cache"):
        assert half[part] == pytest.approx(full["components"][part] / 2, abs=1e-3), part
    # --max-positions (serve's): a quarter of the 2048 positions, a quarter of the cache
    short = plan("--max-positions", "512")
    assert short["positions"] == 512
    assert short["components"]["kv_cache"] == pytest.approx(full["components"]["kv_cache"] / 4, abs=1e-3)


def test_command_line_counts_the_experts(capsys):
    """plan --serve on Qwen3-MoE (every layer sparse, 128 experts of 768): its parameters are
    the model's built on the meta device, and the two layers a GPU gathers are sparse ones."""
    from models.config import PUBLISHED_VOCABS
    from models.transformer_lm import build_model, num_parameters
    from trainer.config.schema import model_positions

    argv = ["--serve", "--arch", "qwen3_moe_30b_a3b", "--bf16", "--distributed-world-size", "8"]
    assert cli.plan_main(argv + ["--device-memory-gb", "80", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    cfg = cfg_of("--arch", "qwen3_moe_30b_a3b")
    model = build_model(cfg.model, PUBLISHED_VOCABS["qwen3_moe_30b_a3b"], model_positions(cfg), device="meta")
    assert plan["params"] == num_parameters(model)
    layer = max(num_parameters(layer) for layer in model.layers)
    root = num_parameters(model) - sum(num_parameters(layer) for layer in model.layers)
    assert plan["components"]["gathered_parameters"] == pytest.approx((root + 2 * layer) * 2 / GB, abs=1e-3)
    assert plan["fits"]


def test_a_gathered_layer_is_the_largest():
    """--moe-freq 2: dense and sparse layers alternate, the sparse ones larger (4 experts of
    512); one gathered layer (a CPU) is a sparse one, two (a GPU) a sparse and a dense one."""
    m = model_shape(cfg_of("--decoder-layers", "4", "--moe-freq", "2", *MOE, "--moe-ffn-embed-dim", "512"), VOCAB)
    assert m.sparse_layers == (1, 3) and m.sparse_layer_params > m.layer_params
    cpu = serve_components(m, ServeSetup("cpu", 2, 1, 64))["gathered_parameters"]
    gpu = serve_components(m, ServeSetup("cuda", 2, 1, 64))["gathered_parameters"]
    assert cpu == (m.root_params + m.sparse_layer_params) * 4
    assert gpu == (m.root_params + m.sparse_layer_params + m.layer_params) * 4


def peak_bytes(fn, *args, ignore=()):
    """The most bytes of tensors alive at once while fn(*args) runs (each storage once),
    tensors made before it (args, weights) aside: tracked op by op."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    before = {t.untyped_storage().data_ptr() for t in [*args, *ignore]}

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.peak = [], 0  # weak references (a WeakSet would compare tensors)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.live += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            alive = [t for t in (ref() for ref in self.live) if t is not None]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
            self.peak = max(self.peak, sum(n for p, n in storages.items() if p not in before))
            return out

    with torch.no_grad(), Live() as tracked:
        fn(*args)
    return tracked.peak


# 4 experts of 128, 2 a token: the peak is the experts' outputs concatenated; 2 experts of
# 1024, 1 a token (WIDE_EXPERTS): it is the last expert's hidden width beside the other's outputs.
WIDE_EXPERTS = ["--moe-expert-count", "2", "--moe-top-k", "1", "--moe-ffn-embed-dim", "1024"]


@pytest.mark.parametrize("experts", [["--moe-expert-count", "4"], WIDE_EXPERTS])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sparse_feed_forward_holds_what_plan_counts(precision, experts):
    """A prefill of 256 tokens through the real mixture of experts (a CPU's loop over its
    experts), without autograd as serve runs it: its peak beyond its input against
    sparse_ffn_bytes, which the serve forward's largest layer moment takes. A random router
    routes near balance, as the prediction assumes."""
    from models.transformer_lm import DecoderLayer

    cfg = cfg_of("--tokens-per-sample", "256", *MOE, *experts)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    moe = DecoderLayer(cfg.model, sparse=True).moe.to(dtype).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, 256, cfg.model.decoder_embed_dim, dtype=dtype)
    measured = peak_bytes(moe, x, ignore=list(moe.parameters()))
    shape, setup = model_shape(cfg, VOCAB), ServeSetup("cpu", 1, 1, 256, x.element_size())
    predicted = sparse_ffn_bytes(shape, setup, 256)
    print(f"{precision} {' '.join(experts)}: predicted {predicted} B, measured {measured} B")
    assert predicted == pytest.approx(measured, rel=0.10)
    # plan --serve's largest forward (a 256-token prefill) holds it beside the layer's input and output
    assert serve_components(shape, setup)["activations"] >= measured + 2 * x.numel() * x.element_size()
