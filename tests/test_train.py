"""Training behaviour users see: loss falls, seeds repeat, accumulation equals a big
batch, fp16 scales and skips, logs and TensorBoard carry fairseq's fields."""

import pytest

from helpers import DUMMY, run_train, train_here, update_losses


def test_update_freq_equals_larger_batch():
    """Two micro-batches make the update one batch holding the same sequences makes (a run of
    --batch-size 8 reads other sequences per update: fairseq's order shuffles whole batches)."""
    big = update_losses(DUMMY + ["--batch-size", "4"], 4, merge=2)
    accumulated = update_losses(DUMMY + ["--batch-size", "4", "--update-freq", "2"], 4)
    assert big == pytest.approx(accumulated, rel=1e-5, abs=1e-5)
    assert big[-1] < big[0]


def test_seed_repeats_and_differs():
    a = update_losses(DUMMY + ["--batch-size", "4", "--dropout", "0.1"], 3)
    b = update_losses(DUMMY + ["--batch-size", "4", "--dropout", "0.1"], 3)
    c = update_losses(DUMMY + ["--batch-size", "4", "--dropout", "0.1", "--seed", "2"], 3)
    assert a == b and a != c


@pytest.mark.parametrize(
    "extra",
    [
        ["--checkpoint-activations"],
        ["--offload-activations"],
        ["--ddp-backend", "fully_sharded"],
        [
            "--ddp-backend",
            "fully_sharded",
            "--checkpoint-activations",
            "--no-reshard-after-forward",
            "--min-params-to-wrap",
            "100000",
        ],
    ],
)
def test_memory_options_do_not_change_the_numbers(extra):
    plain = update_losses(DUMMY + ["--batch-size", "4"], 3)
    assert update_losses(DUMMY + ["--batch-size", "4"] + extra, 3) == pytest.approx(plain, rel=1e-5)


def test_bf16_trains_close_to_fp32():
    fp32 = update_losses(DUMMY + ["--batch-size", "4"], 3)
    bf16 = update_losses(DUMMY + ["--batch-size", "4", "--bf16"], 3)
    assert bf16 == pytest.approx(fp32, rel=2e-2)


def test_fp16_logs_loss_scale_and_overflow_skips_updates(tmp_path, capfd):
    # 2**40 overflows fp16 gradients: those updates are skipped (not counted) and the
    # scale halves until it fits.
    records, r = train_here(
        DUMMY
        + [
            "--batch-size",
            "2",
            "--fp16",
            "--fp16-init-scale",
            str(2**40),
            "--max-update",
            "3",
            "--log-format",
            "json",
            "--log-interval",
            "1",
        ],
        capfd,
    )
    inner = records["train_inner"]
    assert [rec["num_updates"] for rec in inner] == [1, 2, 3]
    assert all("loss_scale" in rec for rec in inner) and inner[0]["loss_scale"] < 2**40
    assert "gradient overflow detected" in r.stdout
    assert records["train"][0]["train_num_updates"] == 3


def test_json_log_fields_and_tensorboard(tmp_path, capfd):
    tb = tmp_path / "tb"
    records, _ = train_here(
        DUMMY
        + [
            "--batch-size",
            "4",
            "--max-update",
            "4",
            "--log-format",
            "json",
            "--log-interval",
            "2",
            "--clip-norm",
            "0.5",
            "--tensorboard-logdir",
            str(tb),
        ],
        capfd,
    )
    rec = records["train_inner"][0]
    for key in (
        "loss",
        "ppl",
        "wps",
        "ups",
        "wpb",
        "bsz",
        "num_updates",
        "lr",
        "gnorm",
        "clip",
        "train_wall",
        "mem_gb",
        "wall",
        "tflops",
    ):
        assert key in rec, key
    assert rec["ppl"] == pytest.approx(2 ** rec["loss"], rel=1e-2)
    assert rec["wpb"] == 4 * 32 and rec["bsz"] == 4 and rec["mem_gb"] > 0.05
    assert "mfu" not in rec  # no --peak-tflops, no peak to divide by
    assert "mem_reserved_gb" not in rec  # a GPU rank's only
    assert "train_loss" in records["train"][0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb / "train_inner"))
    acc.Reload()
    assert {"loss", "ppl", "gnorm", "lr", "wps"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [2, 4]


def test_peak_tflops_adds_mfu_over_all_ranks():
    # tflops counts the whole job's tokens, so the peak it is divided by is per rank x ranks.
    peak = 0.001
    records, _ = run_train(
        DUMMY
        + [
            "--batch-size",
            "4",
            "--max-update",
            "2",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--peak-tflops",
            str(peak),
            "--distributed-world-size",
            "2",
        ]
    )
    for rec in records["train_inner"]:
        assert rec["tflops"] > 0
        # tflops is rounded to 4 decimals, mfu is computed before that rounding
        assert rec["mfu"] == pytest.approx(rec["tflops"] / (peak * 2), abs=0.5e-4 / (peak * 2) + 1e-4)
    assert "train_mfu" in records["train"][0]


def test_simple_format_and_log_file(tmp_path, capfd):
    log_file = tmp_path / "train.log"
    _, r = train_here(
        DUMMY
        + [
            "--batch-size",
            "4",
            "--max-update",
            "2",
            "--log-format",
            "simple",
            "--log-interval",
            "1",
            "--log-file",
            str(log_file),
        ],
        capfd,
    )
    assert "| train_inner | epoch 001:" in r.stdout and "loss=" in r.stdout and "num_updates=2" in r.stdout
    assert "num. model params:" in r.stdout
    assert "num_updates=2" in log_file.read_text()


def test_presets_build_on_meta_device():
    from models.config import PRESETS
    from models.transformer_lm import build_model, num_parameters
    from trainer.config.compose import compose_config

    for name in PRESETS:
        cfg = compose_config([("model._name", name)], [])
        # One Billion Word's 793,471 tokens: room for every preset's adaptive cutoffs.
        model = build_model(cfg.model, 793471, 2048, device="meta")
        assert all(p.is_meta for p in model.parameters())
    cfg = compose_config([("model._name", "transformer_lm_gpt3_13")], [])
    n = num_parameters(build_model(cfg.model, 50264, 2048, device="meta"))
    assert 12.8e9 < n < 13.2e9  # "13B"
