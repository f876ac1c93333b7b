"""fairseq's own documented language-model command lines run as they are.

Each line below is copied from a fairseq file (named above it), with `fairseq-train` /
`fairseq-eval-lm` / `fairseq-hydra-train` spelled `train` / `eval-lm` / `train`, paths put
in a temporary directory, and only size flags appended (SHRINK: a tiny model, short
samples, a few updates, 2 ranks where fairseq has 8 GPUs). They run on a data-bin
written as fairseq-preprocess writes it (dict.txt with its padding symbols, MMIDIDX
.bin/.idx) from fairseq's own test corpus recipe (tests/utils.py create_dummy_data).
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_fairseq_configs import WIKI103_YAML

from helpers import parse_records, train_here

LETTERS = [chr(c) for c in range(97, 123)]
# Appended to every training line: the model and the run shrunk, nothing else changed.
SHRINK = (
    "--decoder-layers 2 --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --decoder-attention-heads 2 "
    "--tokens-per-sample 32 --max-update 8 --log-interval 1"
)


def fairseq_data_bin(path, splits=(("train", 600), ("valid", 60), ("valid1", 40), ("test", 60))):
    """fairseq-preprocess --only-source on fairseq's dummy corpus: 1-20 lowercase letters per
    line; dict.txt by descending count, padded to a multiple of 8 with madeupword lines."""
    from data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    lines = {split: [rng.integers(0, 26, size=rng.integers(1, 21)) for _ in range(n)] for split, n in splits}
    counts = np.bincount(np.concatenate(lines["train"]), minlength=26)
    order = sorted(range(26), key=lambda i: (-counts[i], LETTERS[i]))
    symbols = [(LETTERS[i], counts[i]) for i in order]
    symbols += [(f"madeupword{k:04d}", 0) for k in range((-(len(symbols) + 4)) % 8)]
    path.mkdir(parents=True, exist_ok=True)
    (path / "dict.txt").write_text("".join(f"{s} {c}\n" for s, c in symbols))
    index = {LETTERS[i]: 4 + rank for rank, i in enumerate(order)}  # after <s> <pad> </s> <unk>
    for split, sentences in lines.items():
        builder = IndexedDatasetBuilder(path / split, dtype=np.uint16)
        for s in sentences:
            builder.add_item(np.array([index[LETTERS[c]] for c in s] + [2]))
        builder.finalize()
    return path


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return fairseq_data_bin(tmp_path_factory.mktemp("data-bin") / "wikitext-103")


def _run(line, data_bin, tmp_path, *extra, capfd=None):
    """A documented command line: `{DATA}` and `{CK}` stand for the data-bin and a save dir.
    With capfd, the command's entry point runs in this process (the same argv; a fresh process
    costs seconds of torch start-up): `train` through helpers.train_here (one rank only; its
    signal handlers and logging put back), eval-lm as it is."""
    argv = shlex.split(line.format(DATA=data_bin, CK=tmp_path / "checkpoints"))
    prog, args = argv[0], argv[1:] + shlex.split(" ".join(extra))
    if capfd is not None:
        import cli

        assert Path.cwd() == tmp_path  # as the subprocess's cwd below (conftest's chdir)
        if prog == "train":
            _, r = train_here(args, capfd, check=False)
        else:
            capfd.readouterr()
            code = cli.COMMANDS[prog](args)
            out, err = capfd.readouterr()
            r = subprocess.CompletedProcess(args, code or 0, out, err)
    else:
        cmd = [str(Path(sys.executable).with_name(prog))] + args
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, f"{prog} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr
    return parse_records(r.stdout), r


def _loss_fell(records):
    """The last three updates' mean loss is below the first's (batches of a few samples are noisy)."""
    losses = [rec["loss"] for rec in records["train_inner"]]
    assert len(losses) >= 4 and sum(losses[-3:]) / 3 < losses[0], losses
    return losses


# examples/language_model/README.md, "Train a language model" (2 GPUs), then its eval-lm line.
LM_README = """train --task language_modeling \
  {DATA} \
  --save-dir {CK} \
  --arch transformer_lm --share-decoder-input-output-embed \
  --dropout 0.1 \
  --optimizer adam --adam-betas '(0.9, 0.98)' --weight-decay 0.01 --clip-norm 0.0 \
  --lr 0.0005 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 \
  --tokens-per-sample 512 --sample-break-mode none \
  --max-tokens 2048 --update-freq 16 \
  --fp16 \
  --max-update 50000"""
LM_README_EVAL = """eval-lm {DATA} \
    --path {CK}/checkpoint_best.pt \
    --batch-size 2 \
    --tokens-per-sample 512 \
    --context-window 400"""


def test_language_model_readme_trains_and_evaluates(data_bin, tmp_path, capfd):
    # fp16 is slow on a CPU: fewer tokens per update; warmup shortened so the loss moves in 8 updates.
    records, _ = _run(
        LM_README,
        data_bin,
        tmp_path,
        SHRINK,
        "--max-tokens 64 --update-freq 2",
        "--distributed-world-size 2 --warmup-updates 2 --log-format json",
    )
    _loss_fell(records)
    _, r = _run(LM_README_EVAL, data_bin, tmp_path, "--tokens-per-sample 32 --context-window 16", capfd=capfd)
    assert re.search(r"Loss \(base 2\): [\d.]+, Perplexity: [\d.]+", r.stdout)


# examples/language_model/README.adaptive_inputs.md: the WikiText-103 adaptive-input model.
ADAPTIVE_INPUTS = """train --task language_modeling \
    {DATA} \
    --save-dir {CK} \
    --arch transformer_lm_wiki103 \
    --max-update 286000 --lr 1.0 --t-mult 2 --lr-period-updates 270000 --lr-scheduler cosine --lr-shrink 0.75 \
    --warmup-updates 16000 --warmup-init-lr 1e-07 --stop-min-lr 1e-09 --optimizer nag --min-lr 0.0001 --clip-norm 0.1 \
    --criterion adaptive_loss --max-tokens 3072 --update-freq 3 --tokens-per-sample 3072 --seed 1 \
    --sample-break-mode none --skip-invalid-size-inputs-valid-test --ddp-backend=legacy_ddp"""


def test_adaptive_inputs_readme_trains(data_bin, tmp_path):
    # The vocabulary here is 32 symbols: cutoffs within it; warmup and period shortened.
    records, _ = _run(
        ADAPTIVE_INPUTS,
        data_bin,
        tmp_path,
        SHRINK,
        "--adaptive-input-cutoff 10,20 --adaptive-softmax-cutoff 10,20 --max-tokens 128",
        "--update-freq 1 --warmup-updates 1 --lr-period-updates 16 --distributed-world-size 2 "
        "--log-format json --dropout 0 --attention-dropout 0 --activation-dropout 0",
    )
    _loss_fell(records)


# examples/fully_sharded_data_parallel/README.md: 13B on 1 GPU with CPU offload (and on 8 GPUs).
FSDP_README = """train {DATA} \
    --ddp-backend fully_sharded --fp16 --fp16-init-scale 4 \
    --cpu-offload --checkpoint-activations \
    --task language_modeling --tokens-per-sample 2048 --batch-size 8 \
    --arch transformer_lm_gpt3_13 \
    --optimizer cpu_adam --adam-betas "(0.9,0.98)" \
    --lr 0.0001 --lr-scheduler polynomial_decay --warmup-updates 5 --total-num-update 10 \
    --max-update 10 --no-save --log-format json --log-interval 1"""


def test_fsdp_readme_cpu_offload_with_cpu_adam_trains(data_bin, tmp_path):
    records, _ = _run(
        FSDP_README,
        data_bin,
        tmp_path,
        SHRINK,
        "--batch-size 2 --lr 0.003 --warmup-updates 1",
        "--distributed-world-size 2",
    )
    _loss_fell(records)
    assert not (tmp_path / "checkpoints").exists()  # --no-save


# scripts/test_fsdp.sh: train with a --restore-file that does not exist yet, then resume.
TEST_FSDP_SH = """train {DATA} \
    --ddp-backend fully_sharded --fp16 --fp16-init-scale 4 \
    --cpu-offload --checkpoint-activations \
    --task language_modeling --tokens-per-sample 256 --batch-size 8 \
    --arch transformer_lm_gpt2_tiny \
    --optimizer cpu_adam --adam-betas "(0.9,0.98)" \
    --lr 0.0001 --lr-scheduler polynomial_decay --warmup-updates 5 --total-num-update 10 \
    --max-update 5 --log-format json --log-interval 1 \
    --save-interval-updates 5 --save-dir fsdp_dummy --disable-validation \
    --restore-file x.pt"""
TEST_FSDP_SH_RESUME = """train {DATA} \
    --ddp-backend fully_sharded --fp16 --fp16-init-scale 4 \
    --cpu-offload --checkpoint-activations \
    --task language_modeling --tokens-per-sample 256 --batch-size 8 \
    --arch transformer_lm_gpt2_tiny \
    --optimizer cpu_adam --adam-betas "(0.9,0.98)" \
    --lr 0.0001 --lr-scheduler polynomial_decay --warmup-updates 5 --total-num-update 10 \
    --max-update 2 --log-format json --log-interval 1 \
    --save-interval-updates 2 --save-dir fsdp_dummy"""


def test_fsdp_script_starts_without_its_restore_file_then_resumes(data_bin, tmp_path):
    size = "--tokens-per-sample 32 --batch-size 2 --distributed-world-size 2"
    records, r = _run(TEST_FSDP_SH, data_bin, tmp_path, size)
    assert "No existing checkpoint found" in r.stdout + r.stderr
    assert records["train_inner"][-1]["num_updates"] == 5
    assert (tmp_path / "fsdp_dummy" / "checkpoint_last").is_dir()
    records, r = _run(TEST_FSDP_SH_RESUME, data_bin, tmp_path, size)
    assert "train_inner" not in records  # resumed at update 5, past --max-update 2: nothing to train


# examples/normformer/train_lm.sh: train_common + train_125M, with the README's NormFormer flags.
NORMFORMER = """train {DATA} \
      --combine-val \
      --train-subset train \
      --num-workers 2 \
      --validate-interval-updates 1000 \
      --save-interval-updates 1000 \
      --no-epoch-checkpoints \
      --ddp-backend fully_sharded \
      --memory-efficient-fp16 \
      --fp16-init-scale 4 \
      --checkpoint-activations \
      --arch transformer_lm_gpt \
      --activation-fn gelu \
      --share-decoder-input-output-embed \
      --task language_modeling \
      --sample-break-mode none \
      --tokens-per-sample 2048 \
      --optimizer adam --adam-betas "(0.9, 0.98)" \
      --adam-eps 1e-08 \
      --clip-norm 0.0 \
      --lr-scheduler polynomial_decay \
      --warmup-updates 750 \
      --dropout 0.1 \
      --attention-dropout 0.1 \
      --weight-decay 0.01 \
      --batch-size 16 \
      --update-freq 2 \
      --required-batch-size-multiple 1 \
      --total-num-update 572204 \
      --max-update 572204 \
      --seed 1 \
      --log-format json --log-interval 1 \
      --distributed-world-size 8 --distributed-port 13177 \
      --decoder-layers 12 --decoder-embed-dim 768 --decoder-ffn-embed-dim 3072 --decoder-attention-heads 12 \
      --scale-attn --scale-fc --scale-heads --lr 6e-4"""


def test_normformer_train_lm_sh_trains(data_bin, tmp_path):
    records, _ = _run(
        NORMFORMER,
        data_bin,
        tmp_path,
        SHRINK,
        "--batch-size 2 --warmup-updates 1 --lr 0.003",
        "--validate-interval-updates 2 --distributed-world-size 2 --distributed-port -1",
        "--save-dir",
        str(tmp_path / "ck"),
    )
    _loss_fell(records)
    assert records["valid"][0]["valid_num_updates"] == 2


# tests/test_binaries.py (test_transformer_lm, test_normformer_lm,
# test_transformer_lm_with_adaptive_softmax) through tests/utils.py train_language_model and
# eval_lm_main: the flags fairseq's own test suite passes.
TEST_BINARIES = """train --task language_modeling {DATA} --arch transformer_lm --optimizer adam --lr 0.0001 \
--max-tokens 500 --tokens-per-sample 500 --save-dir {CK} --max-epoch 1 --no-progress-bar \
--distributed-world-size 1 --ddp-backend no_c10d --num-workers 0"""
TEST_BINARIES_EVAL = "eval-lm {DATA} --path {CK}/checkpoint_last.pt --no-progress-bar --num-workers 0"


@pytest.mark.parametrize(
    "extra",
    [
        "--add-bos-token --nval 1",
        "--add-bos-token --nval 1 --scale-fc --scale-heads --scale-attn --scale-fc",
        "--add-bos-token --criterion adaptive_loss --adaptive-softmax-cutoff 5,10,15",
    ],
    ids=["transformer_lm", "normformer_lm", "adaptive_softmax"],
)
def test_fairseq_test_suite_lines_train_and_evaluate(extra, data_bin, tmp_path, capfd):
    size = (
        "--decoder-layers 2 --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --decoder-attention-heads 2 "
        "--tokens-per-sample 32 --max-tokens 256 --log-format json --log-interval 1"
    )
    records, _ = _run(TEST_BINARIES, data_bin, tmp_path, extra, size, capfd=capfd)
    _loss_fell(records)
    assert records["train"][-1]["train_num_updates"] > 0 and records["valid"]
    _, r = _run(TEST_BINARIES_EVAL, data_bin, tmp_path, "--tokens-per-sample 32", capfd=capfd)
    assert "Perplexity" in r.stdout
    _, r = _run(TEST_BINARIES_EVAL, data_bin, tmp_path, "--tokens-per-sample 32 --context-window 25", capfd=capfd)
    assert "Perplexity" in r.stdout


# tests/gpu/test_binaries_gpu.py TestMultiGPU.train_flags on transformer_lm_gpt2_tiny, and its
# resume from checkpoint_1_{save_interval}.pt continuing at the next update.
GPU_SUITE = """train --task language_modeling {DATA} --arch transformer_lm_gpt2_tiny --optimizer adam \
--lr 0.0001 --max-tokens 500 --tokens-per-sample 500 --save-dir {CK} --max-epoch 1 --no-progress-bar \
--distributed-world-size 2 --ddp-backend no_c10d --num-workers 0 \
--memory-efficient-fp16 --update-freq 1 --seed 1 --log-format json --max-update 4 --tokens-per-sample 20 \
--batch-size 2 --share-decoder-input-output-embed --optimizer adam --max-valid-steps 1 \
--pad-to-fixed-length --sample-break-mode none --save-interval-updates 2 --log-interval 1"""


def test_gpu_suite_resume_from_a_pt_checkpoint_name(data_bin, tmp_path):
    first, _ = _run(GPU_SUITE, data_bin, tmp_path)
    resumed, _ = _run(
        GPU_SUITE,
        data_bin,
        tmp_path,
        "--restore-file",
        str(tmp_path / "checkpoints" / "checkpoint_1_2.pt"),
        "--no-save",
    )
    assert resumed["train_inner"][0]["num_updates"] == 3
    assert resumed["train"][-1]["train_loss"] == first["train"][-1]["train_loss"]


# docs/hydra_integration.md, "Override default values through command line".
HYDRA_CASE_1 = """train \
    distributed_training.distributed_world_size=1 \
    dataset.batch_size=2 \
    task.data={DATA} \
    model=transformer_lm/transformer_lm_gpt \
    task=language_modeling \
    optimization.max_update=5000"""
# docs/hydra_integration.md, "Replace bundled configs with an external config".
# Its wiki103.yaml, verbatim but for the data path: test_fairseq_configs.WIKI103_YAML.
HYDRA_SHRINK = (
    "model.decoder_layers=2 model.decoder_embed_dim=32 model.decoder_ffn_embed_dim=64 "
    "model.decoder_attention_heads=2 task.tokens_per_sample=32 optimization.max_update=12 "
    "common.log_interval=1 common.log_format=json checkpoint.no_save=true"
)


def test_hydra_integration_docs_lines_train(data_bin, tmp_path, capfd):
    records, _ = _run(HYDRA_CASE_1, data_bin, tmp_path, HYDRA_SHRINK, "optimization.lr=0.003", capfd=capfd)
    _loss_fell(records)
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "wiki103.yaml").write_text(WIKI103_YAML.replace("/path/to/data", str(data_bin)))
    records, _ = _run(
        f"train --config-dir {configs} --config-name wiki103",
        data_bin,
        tmp_path,
        HYDRA_SHRINK,
        "optimization.lr=0.003",
        capfd=capfd,
    )
    _loss_fell(records)


@pytest.mark.parametrize("line", ["train --ddp-backend=fully_sharded --cpu-offload", "train"])
def test_the_users_own_line_trains_on_the_embedded_corpus(line, tmp_path, capfd):
    """The line shardlm was asked for, and bare `train`: no DATA, no batch size, no lr.
    Shrunk only in the model and the number of updates; the batch (8 sequences) and Adam's
    lr are the embedded corpus's defaults. The --cpu-offload line as a real process (its 2
    ranks' offload), bare `train` in this process."""
    records, r = _run(
        line,
        None,
        tmp_path,
        "--arch transformer_lm_gpt2_tiny --tokens-per-sample 64",
        "--max-update 8 --log-interval 1 --log-format json --no-save",
        capfd=capfd if line == "train" else None,
    )
    assert "embedded corpus" in r.stdout
    assert {rec["bsz"] for rec in records["train_inner"]} == {8}
    assert records["train_inner"][0]["lr"] == 0.0005
    _loss_fell(records)


# tests/test_binaries.py TestOptimizers.test_optimizers: train_translation_model's flags
# (tests/utils.py: --optimizer nag --lr 0.05 --max-tokens 500 --max-epoch 1, then the test's
# own --optimizer), on a language model; fairseq's six, with lamb, adamax and muon beside them.
TEST_OPTIMIZERS = """train --task language_modeling {DATA} --save-dir {CK} --arch transformer_lm --optimizer nag \
--lr 0.05 --max-tokens 500 --max-epoch 1 --no-progress-bar --distributed-world-size 1 --num-workers 0 \
--required-batch-size-multiple 1"""


@pytest.mark.parametrize(
    "optimizer", ["adafactor", "adam", "nag", "adagrad", "sgd", "adadelta", "lamb", "adamax", "muon"]
)
def test_fairseq_optimizer_lines_train(optimizer, data_bin, tmp_path, capfd):
    size = (
        "--decoder-layers 2 --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --decoder-attention-heads 2 "
        "--tokens-per-sample 32 --max-update 6 --log-format json --log-interval 1 --no-save --disable-validation"
    )
    records, _ = _run(TEST_OPTIMIZERS, data_bin, tmp_path, f"--optimizer {optimizer}", size, capfd=capfd)
    losses = [rec["loss"] for rec in records["train_inner"]]
    assert len(losses) == 6 and all(loss == loss for loss in losses), losses  # ran, nothing Nan
