"""`plan --serve` (trainer/plan/serve.py): one serving rank's memory, and whether it fits."""

import json

import pytest
import torch
from test_generate import MAX_POSITIONS, VOCAB, tiny_model

import cli
from models.batch_cache import BatchKVCache
from trainer.plan.ledger import GB
from trainer.plan.serve import ServeSetup, kv_cache_bytes, serve_components, serve_plan
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
