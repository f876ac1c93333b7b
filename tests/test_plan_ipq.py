"""`plan --quantization-config-path`: the model as iPQ's last stage holds it
(trainer/plan/quantized.py). Its count of centroids, assignments and counts equals a model
quantized stage by stage by the trainer's own code (trainer/train/ipq.py, models/pq.py), and
its predicted peak a measured run's after the last stage."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from plan_helpers import cfg_of

from models.pq import PQEmbedding, PQLinear
from models.transformer_lm import build_model
from trainer.config.schema import model_positions
from trainer.plan.quantized import with_quantization
from trainer.plan.search import model_shape
from trainer.train.ipq import IPQ

FIXTURES = Path(__file__).parent / "fixtures" / "ipq"
SMALL = ["--task", "dummy_lm", "--dict-size", "96", "--tokens-per-sample", "16", "--decoder-layers", "2"]
SMALL += ["--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4"]
MODELS = {
    # fairseq's three stages on a tied model: the feed-forwards, the table, the attention
    "tied": (SMALL + ["--share-decoder-input-output-embed"], FIXTURES / "small_config.yaml"),
    # learned positions, an output layer of its own, grouped-query attention; stages that
    # leave layers unquantized
    "untied": (SMALL + ["--decoder-learned-pos", "--decoder-kv-heads", "2"], FIXTURES / "plan_config.yaml"),
    # an adaptive input's bands and projections, a tied adaptive softmax's, the experts' routers
    "adaptive": (
        SMALL
        + ["--adaptive-input", "--adaptive-input-cutoff", "32,64", "--adaptive-softmax-cutoff", "32,64"]
        + ["--tie-adaptive-weights", "--moe-expert-count", "4"],
        FIXTURES / "plan_adaptive_config.yaml",
    ),
}


class _Trainer:
    """What IPQ.quantize reads of the trainer: its model, and the one it hands over."""

    def __init__(self, model):
        self.model, self.num_updates = model, 0

    def replace_model(self, model, grad_sync):
        self.model = model


def quantized_model(cfg, vocab):
    """The model after every stage of cfg's iPQ, quantized by the trainer's IPQ on one process."""
    positions = model_positions(cfg)

    def make_model(specs):
        model = build_model(cfg.model, vocab, positions, seed=cfg.common.seed)
        model.quantize_structure(specs, "cpu")
        return model, None

    env = SimpleNamespace(rank=0, world_size=1, is_master=False, device=torch.device("cpu"))
    ipq = IPQ(cfg, env, make_model)
    trainer = _Trainer(build_model(cfg.model, vocab, positions, seed=cfg.common.seed))
    for stage in range(len(ipq.schedule.layers_to_quantize)):
        ipq.quantize(stage, trainer, SimpleNamespace(follow=lambda trainer: None))
    return trainer.model


def fairseq_name(ours):
    """fairseq's name of one of our quantized modules (trainer/train/ipq.py fairseq_layers)."""
    part = re.match(r"layers\.(\d+)\.qkv_proj\.parts\.(q|k|v)$", ours)
    if part:
        return f"decoder.layers.{part.group(1)}.self_attn.{part.group(2)}_proj"
    return "decoder." + re.sub(r"^layers\.(\d+)\.out_proj$", r"layers.\1.self_attn.out_proj", ours)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_counted_centroids_assignments_and_counts_are_the_quantized_models(kind):
    """The layers plan counts as quantized are those the stages quantize, each of its shape;
    centroids, assignments and counts are the real tensors' bytes, and the parameters (the
    centroids in the weights' place) the real model's."""
    flags, config = MODELS[kind]
    cfg = cfg_of(*flags, "--quantization-config-path", str(config), "--max-update", "3")
    m = with_quantization(cfg, model_shape(cfg, 96))
    model = quantized_model(cfg, 96)
    real = {
        fairseq_name(name): module
        for name, module in model.named_modules()
        if isinstance(module, (PQLinear, PQEmbedding))
    }
    assert {p.name for p in m.pq} == set(real)
    for p in m.pq:
        module = real[p.name]
        assert module.weight.shape == (p.rows, p.cols) and module.centroids.shape == (p.centroids, p.block)
    buffers = {name: b.nbytes for name, b in model.named_buffers() if name.endswith((".assignments", ".counts"))}
    centroids = sum(t.nbytes for name, t in model.named_parameters() if name.endswith(".centroids"))
    assert m.pq_buffer_bytes == sum(buffers.values())
    assert 4 * sum(p.params for p in m.pq) == centroids
    assert m.params == sum(t.numel() for t in model.parameters())


def test_report_says_what_the_last_stage_holds(capsys):
    """The text report's iPQ line and components; without the flag, neither."""
    import cli

    flags, config = MODELS["tied"]
    flags = flags + ["--batch-size", "2"]
    argv = flags + ["--quantization-config-path", str(config), "--max-update", "3", "--cpu"]
    assert cli.plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "iPQ: 13 layers quantized at the last stage: centroids " in text
    assert "iPQ: weights rebuilt from centroids" in text
    assert cli.plan_main(flags + ["--cpu"]) == 0
    assert "iPQ" not in capsys.readouterr().out
