"""The `plan` command and `train --auto-tune`: JSON and text reports, bad input in one line,
plan --path for a Hugging Face model directory, --auto-tune training with what it picked, and
one prediction against a measured run (bench/bench_plan.py compares more)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from plan_helpers import measured_peak_gb, plan_json

import cli

BIN = Path(sys.executable).parent


def test_plan_json_and_text(capsys):
    argv = [
        "--task",
        "dummy_lm",
        "--dict-size",
        "1000",
        "--arch",
        "transformer_lm_gpt2_tiny",
        "--batch-size",
        "4",
        "--tokens-per-sample",
        "64",
        "--cpu",
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
    ]
    p = plan_json(capsys, *argv)
    assert {"fits", "per_rank_gb", "host_gb", "components", "comm_gb_per_update", "recommended"} <= set(p)
    assert sum(p["components"].values()) == pytest.approx(p["per_rank_gb"], abs=0.01)
    assert p["host_gb"] == pytest.approx(2 * p["per_rank_gb"], abs=0.002)  # a CPU host holds its two ranks
    assert cli.plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "gathered layers" in text and "recommended:" in text and "all-gather" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device-memory-gb", "-1"], "must be a positive number"),
        (["--format", "yaml"], "invalid choice"),
        (["--decoder-layrs", "2"], "did you mean --decoder-layers"),
        (["/no/such/data", "--batch-size", "2"], "does not exist"),
    ],
)
def test_plan_bad_input_is_one_line(argv, message):
    r = subprocess.run([str(BIN / "plan"), "--cpu"] + argv, capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_train_auto_tune_picks_what_fits_and_trains_with_it(tmp_path, capsys):
    """A budget below the plan as given: train --auto-tune prints the flags `plan` recommends
    for that budget, saves a config that has them, and trains."""
    model = [
        "--task",
        "dummy_lm",
        "--dict-size",
        "2000",
        "--tokens-per-sample",
        "128",
        "--batch-size",
        "8",
        "--decoder-layers",
        "4",
        "--decoder-embed-dim",
        "128",
        "--decoder-ffn-embed-dim",
        "512",
        "--decoder-attention-heads",
        "4",
        "--dropout",
        "0",
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--cpu",
    ]
    p = plan_json(capsys, *model)
    plain, ckpt = (c["per_rank_gb"] for c in p["candidates"][1:3])
    budget = round((plain + ckpt) / 2, 3)
    expected = plan_json(capsys, *model, "--device-memory-gb", str(budget))
    assert not expected["fits"] and expected["recommended"] and expected["recommended_per_rank_gb"] <= budget
    r = subprocess.run(
        [str(BIN / "train")]
        + model
        + [
            "--auto-tune",
            "--memory-budget-gb",
            str(budget),
            "--max-update",
            "3",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--disable-validation",
            "--save-dir",
            str(tmp_path / "ck"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert (
        f"auto-tune: {expected['recommended']} (predicted {expected['recommended_per_rank_gb']:.2f} GB per rank "
        f"of a {budget:.2f} GB budget"
    ) in r.stderr
    saved = (tmp_path / "ck" / "config.yaml").read_text()
    rec = expected["recommended"]
    assert ("no_reshard_after_forward: true" in saved) == ("--no-reshard-after-forward" in rec)
    assert ("checkpoint_activations: true" in saved) == ("--checkpoint-activations" in rec)
    if "--batch-size" in rec:  # the global batch stays: 8 sequences per rank per update
        b, uf = int(rec.split("--batch-size ")[1].split()[0]), int(rec.split("--update-freq ")[1].split()[0])
        assert b * uf == 8 and f"batch_size: {b}" in saved and f"update_freq: {uf}" in saved
    assert '"num_updates": 3' in r.stdout + r.stderr


def test_prediction_matches_a_measured_run(tmp_path, capsys):
    """Predicted vs measured peak resident memory per rank (bench/bench_plan.py does more
    configurations): 2 FSDP ranks with checkpointing, activations larger than the model."""
    model = [
        "--task",
        "dummy_lm",
        "--dict-size",
        "8192",
        "--tokens-per-sample",
        "256",
        "--batch-size",
        "16",
        "--decoder-layers",
        "4",
        "--decoder-embed-dim",
        "384",
        "--decoder-ffn-embed-dim",
        "1536",
        "--decoder-attention-heads",
        "6",
        "--decoder-learned-pos",
        "--share-decoder-input-output-embed",
        "--activation-fn",
        "gelu",
        "--dropout",
        "0",
        "--ddp-backend",
        "fully_sharded",
        "--distributed-world-size",
        "2",
        "--checkpoint-activations",
    ]
    predicted = plan_json(capsys, *model, "--cpu")["per_rank_gb"]
    measured = measured_peak_gb(model, 3, tmp_path)
    assert predicted == pytest.approx(measured, rel=0.10)


def test_plan_path_plans_for_a_hugging_face_model_directory(tmp_path, capsys):
    """plan --path HF_DIR: the model of its config.json (transformers' own, saved by
    save_pretrained), with that model's parameter count; a directory that is not one gets
    a one-line error."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path / "qwen")
    with torch.device("meta"):
        hf_params = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    p = plan_json(capsys, "--path", str(tmp_path / "qwen"), "--cpu", "--batch-size", "2", "--tokens-per-sample", "64")
    assert (p["params"], p["vocab"], p["model"]) == (hf_params, 300, str(tmp_path / "qwen"))
    assert p["vocab_source"] == f"from {tmp_path / 'qwen' / 'config.json'}"
    # train --finetune-from-model HF_DIR plans with the model's embedding rows, not the data's
    tuned = plan_json(
        capsys,
        "--finetune-from-model",
        str(tmp_path / "qwen"),
        "--task",
        "dummy_lm",
        "--dict-size",
        "200",
        "--cpu",
        "--batch-size",
        "2",
        "--tokens-per-sample",
        "64",
    )
    assert (tuned["params"], tuned["vocab"]) == (hf_params, 300)
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    (tmp_path / "gpt_neox").mkdir()
    (tmp_path / "gpt_neox" / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    for name, message in (
        ("empty", "has no config.json"),
        ("bad", "config.json is not valid JSON"),
        ("gpt_neox", "model_type 'gpt_neox' is not supported"),
        ("missing", "no such directory"),
    ):
        assert cli.plan_main(["--path", str(tmp_path / name), "--cpu"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
