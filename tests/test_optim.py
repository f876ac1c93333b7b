"""fairseq's learning-rate schedules and the weight-decay parameter groups."""
import math

import pytest

from helpers import compose


def schedule(*argv):
    from trainer.optim import LRSchedule
    return LRSchedule(compose(["--batch-size", "1"] + list(argv)))


def test_inverse_sqrt_warms_up_then_decays_as_one_over_sqrt():
    s = schedule("--lr-scheduler", "inverse_sqrt", "--lr", "0.01", "--warmup-updates", "100")
    assert s.lr(0) == pytest.approx(0.01 / 100) and s.lr(99) == pytest.approx(0.01)
    assert s.lr(400) == pytest.approx(0.01 * math.sqrt(100 / 400))


def test_polynomial_decay_reaches_end_lr():
    s = schedule("--lr-scheduler", "polynomial_decay", "--lr", "0.01", "--warmup-updates", "10",
                 "--max-update", "110", "--end-learning-rate", "0.001")
    assert s.lr(10) == pytest.approx(0.01) and s.lr(60) == pytest.approx(0.0055)
    assert s.lr(110) == pytest.approx(0.001) and s.lr(500) == pytest.approx(0.001)


def test_cosine_and_fixed():
    s = schedule("--lr-scheduler", "cosine", "--lr", "0.01", "--min-lr", "0.001", "--max-update", "100")
    assert s.lr(0) == pytest.approx(0.01) and s.lr(50) == pytest.approx(0.0055) and s.lr(100) == pytest.approx(0.001)
    assert schedule("--lr", "0.3").lr(12345) == 0.3


def test_no_weight_decay_on_biases_norms_and_embeddings():
    from models.transformer_lm import build_model
    from trainer.optim import param_groups
    cfg = compose(["--batch-size", "1", "--arch", "transformer_lm_gpt2_tiny", "--decoder-learned-pos"])
    model = build_model(cfg.model, 100, 16)
    decay, rest = param_groups(model, 0.1)
    decayed = {id(p) for p in decay["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert names and all(n.endswith(("qkv_proj.weight", "out_proj.weight", "fc1.weight", "fc2.weight",
                                      "output_projection.weight")) for n in names)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
