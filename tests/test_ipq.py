"""Iterative PQ in training (--quantization-config-path, trainer/train/ipq.py): FSDP ranks
train what one process trains through every stage, a checkpoint taken between stages resumes
on another layout on the curve of the run never stopped, and the exports (weights rebuilt,
or fairseq's compact form) give the checkpoint's logits; fairseq's README lines (the
Quant-Noise LM, then its iPQ) run, on fairseq's test corpus (tests/test_fairseq_command_lines.py).
The k-means and PQ layers against fairseq's code: tests/test_pq.py."""

import shutil
from pathlib import Path

import pytest
import torch
from test_fairseq_command_lines import _run, data_bin  # noqa: F401 (data_bin: the module's fixture)

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


# examples/quant_noise/README.md, "Language Modeling": a Transformer + Quant-Noise trained on
# Wikitext-103, then "To quantize the trained Language Model" with iterative PQ (the README's
# transformer_quantization_config.yaml as it is), restored from the first line's checkpoint.
QUANT_NOISE_LM = """train --task language_modeling {DATA} \
    --save-dir checkpoints/transformer_wikitext-103 \
    --adaptive-input --adaptive-input-cutoff 20000,60000 --adaptive-input-factor 4 \
    --adaptive-softmax-cutoff 20000,60000 --adaptive-softmax-dropout 0.2 --adaptive-softmax-factor 4.0 \
    --tie-adaptive-proj --tie-adaptive-weights \
    --arch transformer_lm_gbw \
    --attention-dropout 0.1 --dropout 0.2 --relu-dropout 0.1 \
    --clip-norm 0.1 --criterion adaptive_loss \
    --ddp-backend no_c10d \
    --decoder-attention-heads 8 --decoder-embed-dim 1024 --decoder-ffn-embed-dim 4096 --decoder-input-dim 1024 \
    --decoder-layers 16 --decoder-normalize-before --decoder-output-dim 1024 \
    --lr 0.0001 --lr-period-updates 270000 --lr-scheduler cosine --lr-shrink 0.75 --max-lr 1.0 --t-mult 2.0 \
    --max-tokens 3072 --tokens-per-sample 3072 --momentum 0.99 --optimizer nag \
    --sample-break-mode none --update-freq 3 \
    --warmup-init-lr 1e-07 --warmup-updates 16000 \
    --weight-decay 0 --seed 1 --min-lr 1e-09 \
    --quant-noise-pq 0.05 --quant-noise-pq-block-size 8"""
IPQ_LM = """train --task language_modeling {DATA} \
    --save-dir checkpoints/transformer_wikitext-103 \
    --adaptive-input --adaptive-input-cutoff 20000,60000 --adaptive-input-factor 4 \
    --adaptive-softmax-cutoff 20000,60000 --adaptive-softmax-dropout 0.2 --adaptive-softmax-factor 4.0 \
    --arch transformer_lm_gbw \
    --attention-dropout 0.1 --dropout 0.2 --relu-dropout 0.1  \
    --bucket-cap-mb 25 --char-embedder-highway-layers 2 --character-embedding-dim 4 \
    --clip-norm 0.1 --criterion adaptive_loss \
    --ddp-backend no_c10d \
    --decoder-attention-heads 8 --decoder-embed-dim 1024 --decoder-ffn-embed-dim 4096 --decoder-input-dim 1024 \
    --decoder-layers 16 --decoder-normalize-before --decoder-output-dim 1024 \
    --fp16 --keep-last-epochs -1 \
    --lr 0.0001 --lr-period-updates 270000 --lr-scheduler cosine --lr-shrink 0.75 --max-lr 0.05 --min-lr 1e-09 \
    --max-tokens 2944  --tokens-per-sample 2944\
    --momentum 0.99 --no-epoch-checkpoints --no-progress-bar --optimizer nag --required-batch-size-multiple 8 \
    --sample-break-mode none --t-mult 2.0 --skip-invalid-size-inputs-valid-test \
    --tie-adaptive-proj --tie-adaptive-weights --update-freq 3 --weight-decay 0 --seed 1  \
    --log-interval 100 --no-progress-bar --skip-invalid-size-inputs-valid-test \
    --restore-file path/to/trained/lm/with/quant/noise \
    --max-update 13500 --quantization-config-path /path/to/config/yaml"""
README_CONFIG = Path(__file__).parent / "fixtures" / "ipq" / "transformer_quantization_config.yaml"
# One layer whose adaptive bands (32 symbols: cutoffs 10, 20; 64, 32 and 16 wide) hold whole
# blocks of 8; the update count continues from the first line's 3, three stages of 2.
QUANT_SHRINK = (
    "--decoder-layers 1 --decoder-embed-dim 64 --decoder-input-dim 64 --decoder-output-dim 64 "
    "--decoder-ffn-embed-dim 64 --decoder-attention-heads 2 --tokens-per-sample 32 --max-tokens 128 "
    "--adaptive-input-cutoff 10,20 --adaptive-softmax-cutoff 10,20 --adaptive-input-factor 2 "
    "--adaptive-softmax-factor 2 --update-freq 1 --log-interval 1 --required-batch-size-multiple 1 "
    "--dropout 0 --attention-dropout 0 --relu-dropout 0"
)


def test_quant_noise_then_ipq_readme_lines(data_bin, tmp_path, capfd):  # noqa: F811
    """The Quant-Noise LM, then its iterative PQ from that checkpoint with the README's config:
    the three stages quantize the feed-forwards, then the adaptive input's tables and
    projections (the softmax tied to them), then the attention. Both lines pass --max-lr,
    which fairseq 0.9's cosine schedule read and 0.12's has no more (fairseq-train refuses
    them, as train does): it is the one flag taken out."""
    first = QUANT_NOISE_LM.replace(" --max-lr 1.0", "")
    _run(first, data_bin, tmp_path, QUANT_SHRINK, "--max-update 3 --warmup-updates 1", capfd=capfd)
    saved = tmp_path / "checkpoints" / "transformer_wikitext-103" / "checkpoint_last"
    line = IPQ_LM.replace(" --max-lr 0.05", "").replace("path/to/trained/lm/with/quant/noise", str(saved))
    line = line.replace("/path/to/config/yaml", str(README_CONFIG))
    records, r = _run(line, data_bin, tmp_path, QUANT_SHRINK, "--max-update 9 --log-format json", capfd=capfd)
    stages = [s for s in r.stdout.splitlines() + r.stderr.splitlines() if "iterative PQ stage" in s]
    assert len(stages) == 3, stages
    # the first at the restored run's first epoch start, then every 9 / 3 updates of the count
    assert [s.split(" at update ")[1].split(":")[0] for s in stages] == ["3", "6", "9"]
    from trainer.formats.shardlm.checkpoint_dir import tensor_specs

    specs = tensor_specs(saved)
    quantized = {name[: -len(".centroids")] for name in specs if name.endswith(".centroids")}
    assert quantized == {
        "layers.0.fc1",
        "layers.0.fc2",
        *(f"embed_tokens.embeddings.{band}.{i}" for band in range(3) for i in range(2)),
        *(f"layers.0.qkv_proj.parts.{part}" for part in "qkv"),
        "layers.0.out_proj",
    }
    assert specs["layers.0.fc1.centroids"][0] == (256, 8) and specs["layers.0.out_proj.centroids"][0] == (256, 4)
    assert not any(name.endswith(".weight") for name in specs if name.split(".weight")[0] in quantized)
    # the checkpoint scores and generates: eval-lm and generate build its quantized layers from its tensors
    _, r = _run("eval-lm {DATA} --path " + str(saved), data_bin, tmp_path, "--tokens-per-sample 32", capfd=capfd)
    assert "Loss (base 2)" in r.stdout + r.stderr
    _, r = _run(f"generate --path {saved} --prompt 'a b c' --max-new-tokens 4", data_bin, tmp_path, capfd=capfd)
    assert len(r.stdout.split()) >= 4, r.stdout
