"""Iterative PQ in training (--quantization-config-path, trainer/train/ipq.py): FSDP ranks
train what one process trains through every stage, a checkpoint taken between stages resumes
on another layout on the curve of the run never stopped, and the exports (weights rebuilt,
or fairseq's compact form) give the checkpoint's logits. fairseq's own command lines:
tests/test_fairseq_command_lines.py; the k-means and PQ layers: tests/test_pq.py."""

import shutil
from pathlib import Path

import pytest
import torch

from helpers import train_updates

CONFIG = Path(__file__).parent / "fixtures" / "ipq" / "small_config.yaml"
# 6 updates, three stages: the feed-forwards at the start, the (tied) embedding after update 2,
# the attention's q, k, v (each its own centroids) and out_proj after update 4
ARGV = ["--task", "dummy_lm", "--dict-size", "100", "--dataset-size", "64", "--tokens-per-sample", "16"]
ARGV += ["--arch", "transformer_lm", "--decoder-layers", "2", "--decoder-embed-dim", "32"]
ARGV += ["--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4", "--share-decoder-input-output-embed"]
ARGV += ["--optimizer", "adam", "--lr", "0.003", "--max-update", "6", "--batch-size", "2", "--dropout", "0"]
ARGV += ["--quantization-config-path", str(CONFIG)]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """2 FSDP ranks through the three stages, a checkpoint after update 3."""
    tmp = tmp_path_factory.mktemp("ipq")
    argv = ARGV + ["--ddp-backend", "fully_sharded", "--save-dir", str(tmp / "ck"), "--save-interval-updates", "3"]
    return tmp, train_updates(argv, 2, tmp)


def test_fsdp_ranks_and_a_resume_on_one_process_train_what_one_process_trains(sharded_run, tmp_path):
    """Losses and gradient norms of the 2 FSDP ranks equal one process reading both ranks'
    samples (--update-freq 2), over the three stages; resumed from update 3 (between two
    stages) on one process, the run goes on on that curve."""
    tmp, sharded = sharded_run
    alone = train_updates(ARGV + ["--update-freq", "2"], 1, tmp_path)
    assert sorted(sharded) == sorted(alone) == [1, 2, 3, 4, 5, 6]
    for n in alone:
        assert sharded[n] == pytest.approx(alone[n], rel=1e-5), n
    shutil.copytree(tmp / "ck" / "checkpoint_1_3", tmp_path / "resumed" / "checkpoint_last")
    rest = train_updates(ARGV + ["--update-freq", "2", "--save-dir", str(tmp_path / "resumed")], 1, tmp_path)
    assert sorted(rest) == [4, 5, 6]
    for n in rest:
        assert rest[n] == pytest.approx(alone[n], rel=1e-5), n


def test_exports_give_the_quantized_checkpoints_logits(sharded_run, tmp_path):
    """export-model rebuilds each quantized weight (qkv_proj's parts stacked back), or with
    --pq-compact keeps fairseq's centroids, assignments and counts; both load (eval-lm's,
    generate's loader) to the checkpoint's logits."""
    import cli
    from trainer.formats.safetensors_file import safetensors_specs
    from trainer.inference.load import load_model

    tmp, _ = sharded_run
    checkpoint = tmp / "ck" / "checkpoint_last"
    for out, extra in (("full", []), ("compact", ["--pq-compact"])):
        assert cli.export_model_main(["--path", str(checkpoint), "--out", str(tmp_path / out), *extra]) == 0
    ids = torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = load_model(str(checkpoint))[0](ids)
        for out in ("full", "compact"):
            assert torch.equal(load_model(str(tmp_path / out))[0](ids), expected), out
    full = safetensors_specs(tmp_path / "full" / "model.safetensors")
    assert "layers.0.qkv_proj.weight" in full and not any(name.endswith(".centroids") for name in full)
    compact = safetensors_specs(tmp_path / "compact" / "model.safetensors")
    assert {"layers.1.fc2.centroids", "layers.1.qkv_proj.parts.v.assignments", "embed_tokens.counts"} <= set(compact)
