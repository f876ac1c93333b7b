"""The three ways to set a field (flag, YAML file, dotted override), their precedence,
and the one-line answers to bad input. No torch needed: this is `train`'s front door."""

import subprocess
import sys
import typing
from dataclasses import MISSING

import pytest
from omegaconf import OmegaConf

from helpers import DUMMY, run_train
from trainer.config.checks import check_config
from trainer.config.compose import compose_config
from trainer.config.flags import build_parser, flag_name, iter_fields, parse_flags
from trainer.config.schema import GROUP_OPTIONS
from trainer.errors import UsageError


def compose(argv, config_dir=None):
    parser = build_parser()
    ns, settings, overrides = parse_flags(parser, argv)
    return compose_config(settings, overrides, ns.config_dir or config_dir, ns.config_name)


def write(path, text):
    path.write_text(text)
    return path


def test_precedence_file_then_arch_then_flags_then_overrides(tmp_path):
    write(
        tmp_path / "exp.yaml",
        "model:\n  decoder_layers: 3\n  decoder_embed_dim: 96\noptimization:\n  lr: [0.0005]\n  max_update: 7\n",
    )
    base = ["--config-dir", str(tmp_path), "--config-name", "exp"]
    cfg = compose(base)
    assert (cfg.model.decoder_layers, cfg.optimization.lr, cfg.optimization.max_update) == (3, 0.0005, 7)
    assert cfg.optimization.update_freq == 1  # untouched keys keep their defaults
    cfg = compose(base + ["--arch", "transformer_lm_gpt"])  # the preset beats the file
    assert (cfg.model.decoder_layers, cfg.model.decoder_embed_dim) == (12, 768)
    cfg = compose(base + ["--arch", "transformer_lm_gpt", "--decoder-layers", "4", "--lr", "0.01"])
    assert (cfg.model.decoder_layers, cfg.model.decoder_embed_dim, cfg.optimization.lr) == (4, 768, 0.01)
    cfg = compose(base + ["--decoder-layers", "4", "model.decoder_layers=5", "--lr", "0.01", "optimization.lr=0.02"])
    assert (cfg.model.decoder_layers, cfg.optimization.lr, cfg.optimization.max_update) == (5, 0.02, 7)


def test_group_selection_by_override_by_flag_and_in_file(tmp_path):
    cfg = compose(["model=transformer_lm_gpt2_tiny", "model.decoder_layers=3"])
    assert (cfg.model._name, cfg.model.decoder_layers, cfg.model.decoder_embed_dim) == (
        "transformer_lm_gpt2_tiny",
        3,
        64,
    )
    cfg = compose(["--lr-scheduler", "inverse_sqrt"])
    assert cfg.lr_scheduler.warmup_updates == 4000  # the option's own default, like fairseq
    cfg = compose(["--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10"])
    assert cfg.lr_scheduler.warmup_updates == 10
    write(tmp_path / "exp.yaml", "optimizer: adamw\nmodel:\n  _name: transformer_lm_gpt3_small\n  dropout: 0.2\n")
    cfg = compose(["--config-dir", str(tmp_path), "--config-name", "exp"])
    assert (cfg.optimizer._name, cfg.model.decoder_layers, cfg.model.dropout) == ("adamw", 12, 0.2)
    (tmp_path / "model").mkdir()
    write(tmp_path / "model" / "mine.yaml", "decoder_layers: 2\ndecoder_embed_dim: 32\n")
    cfg = compose(["--config-dir", str(tmp_path), "--config-name", "exp", "model=mine"])
    assert (cfg.model._name, cfg.model.decoder_layers, cfg.model.decoder_embed_dim) == ("mine", 2, 32)


def _non_default(f):
    """A value for field f that differs from its default, as (argv, expected value)."""
    default = f.default_factory() if f.default is MISSING else f.default
    name = flag_name(f)
    tp = f.type
    if typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    choices = f.metadata.get("choices")
    if name == "--arch":
        return [name, "transformer_lm_gpt2_tiny"], "transformer_lm_gpt2_tiny"
    if choices:
        value = next(c for c in choices if c != default)
        return [name, value], value
    if tp is bool:
        return ([name], True) if not default else (["--no-" + name[2:]], False)
    if typing.get_origin(tp) in (list, typing.List) and typing.get_args(tp) == (str,):
        return [name, "0.7", "web", "0.3", "code"], ["0.7", "web", "0.3", "code"]
    if typing.get_origin(tp) in (list, typing.List):
        return [name, "(0.8, 0.95)"], [0.8, 0.95]
    if tp is int:
        value = (default or 0) + 3
        return [name, str(value)], value
    if tp is float:
        return [name, "0.125"], 0.125
    if name == "data":
        return ["some/data-bin"], "some/data-bin"
    return [name, "some_value"], "some_value"


@pytest.mark.parametrize("group,f", list(iter_fields()), ids=lambda x: getattr(x, "name", x))
def test_every_flag_reaches_its_field(group, f):
    argv, expected = _non_default(f)
    cfg = compose(argv)
    assert cfg[group][f.name] == expected


def test_fairseq_spellings():
    cfg = compose(
        [
            "--adam-betas",
            "(0.9, 0.98)",
            "--max-sentences",
            "4",
            "--relu-dropout",
            "0.1",
            "-a",
            "transformer_lm_gpt",
            "--ddp-backend",
            "fully_sharded",
            "data-bin",
        ]
    )
    assert list(cfg.optimizer.adam_betas) == [0.9, 0.98]
    assert (cfg.dataset.batch_size, cfg.model.activation_dropout, cfg.model._name) == (4, 0.1, "transformer_lm_gpt")
    assert (cfg.distributed_training.ddp_backend, cfg.task.data) == ("fully_sharded", "data-bin")
    cfg = compose(["optimizer.adam_betas=[0.9,0.95]", "common.log_file=null", "--log-format", "none"])
    assert list(cfg.optimizer.adam_betas) == [0.9, 0.95] and cfg.common.log_file is None
    assert cfg.common.log_format == "none"


def test_saved_config_reproduces_the_run(tmp_path):
    cfg = compose(
        [
            "--arch",
            "transformer_lm_gpt2_tiny",
            "--decoder-layers",
            "3",
            "--lr",
            "0.003",
            "--lr-scheduler",
            "cosine",
            "optimization.max_update=9",
            "--adam-betas",
            "(0.9,0.98)",
        ]
    )
    write(tmp_path / "config.yaml", OmegaConf.to_yaml(cfg))
    again = compose(["--config-dir", str(tmp_path), "--config-name", "config"])
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cpu-ofload"], "unrecognized flag --cpu-ofload (did you mean --cpu-offload?)"),
        (
            ["optimization.max_updat=3"],
            "unknown config key optimization.max_updat (did you mean optimization.max_update?)",
        ),
        (["update_freq=2"], "did you mean optimization.update_freq?"),
        (["--arch", "transformer_lm_gtp"], "unknown model 'transformer_lm_gtp' (did you mean transformer_lm_gpt?)"),
        (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
        (["optimization.lr=abc"], "cannot set optimization.lr='abc'"),
        (["+common.new_key=1"], "keys cannot be added"),
    ],
)
def test_bad_input_is_one_line(argv, message):
    with pytest.raises(UsageError) as e:
        compose(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--fp16", "--bf16"], "--fp16 and --bf16 are exclusive"),
        (["--cpu-offload"], "--cpu-offload needs --ddp-backend fully_sharded"),
        (["--update-freq", "0"], "optimization.update_freq must be positive"),
        (["--peak-tflops", "0"], "common.peak_tflops must be positive"),
        (["--decoder-attention-heads", "5"], "does not divide --decoder-embed-dim 512"),
        (["--shard-group-size", "2"], "--shard-group-size needs --ddp-backend hybrid_shard"),
        (["--distributed-port", "70000"], "is not a port"),
        (["task.data=data-bin"], "set --batch-size or --max-tokens"),  # with DATA, fairseq's rule
    ],
)
def test_contradictions_are_refused(argv, message):
    argv = argv + ([] if argv[0].startswith("task.") else ["--batch-size", "2"])
    with pytest.raises(UsageError) as e:
        check_config(compose(argv))
    assert message in str(e.value)


def test_the_embedded_corpus_gets_a_batch_size_and_adams_lr_when_none_is_given():
    """`train --ddp-backend=fully_sharded --cpu-offload` alone trains: without DATA the
    embedded corpus gets 8 sequences per rank and the lr of fairseq's LM README (fairseq's
    default 0.25 makes Adam diverge). What the user sets is kept."""
    cfg = compose(["--ddp-backend=fully_sharded", "--cpu-offload"])
    assert (cfg.dataset.batch_size, cfg.optimization.lr) == (8, 5e-4)
    assert compose(["optimization.lr=0.1"]).optimization.lr == 0.1
    assert compose(["--max-tokens", "512"]).dataset.batch_size is None
    assert compose(["--optimizer", "sgd"]).optimization.lr == 0.25
    assert compose(["task.data=data-bin", "--batch-size", "2"]).optimization.lr == 0.25  # fairseq's default


def test_offload_activations_implies_checkpointing_once_composed(tmp_path):
    """--offload-activations is checkpointing with the kept inputs on the host: composition
    sets --checkpoint-activations for it (trainer/config/implied.py), however it was given,
    so every reader sees the plain field."""
    write(tmp_path / "exp.yaml", "model: {offload_activations: true}\n")
    for argv in (
        ["--offload-activations"],
        ["model.offload_activations=true"],
        ["--config-dir", str(tmp_path), "--config-name", "exp"],
    ):
        model = compose(argv).model
        assert model.offload_activations and model.checkpoint_activations, argv
    model = compose([]).model
    assert not model.offload_activations and not model.checkpoint_activations
    assert compose(["--checkpoint-activations"]).model.offload_activations is False


def test_bad_yaml_file(tmp_path):
    write(tmp_path / "bad.yaml", "optimization: {max_update: 3\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        compose(["--config-dir", str(tmp_path), "--config-name", "bad"])
    write(tmp_path / "typo.yaml", "optimisation:\n  max_update: 3\n")
    with pytest.raises(UsageError, match="did you mean optimization"):
        compose(["--config-dir", str(tmp_path), "--config-name", "typo"])
    with pytest.raises(UsageError, match="no config file"):
        compose(["--config-dir", str(tmp_path), "--config-name", "missing"])


def test_cli_answers_without_traceback_and_help_lists_every_flag():
    r = subprocess.run(
        [sys.executable, "-c", "import cli,sys; sys.exit(cli.train_main())", "--cpu-ofload"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "did you mean --cpu-offload" in r.stderr
    probe = (
        "import sys, cli\ntry:\n    cli.train_main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch loaded:', 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("torch loaded: False")
    for _group, f in iter_fields():
        assert (flag_name(f) if flag_name(f) != "data" else "DATA") in r.stdout
    for group in ("common:", "distributed_training:", "dataset:", "optimization:", "model:", "optimizer:"):
        assert group in r.stdout
    assert set(GROUP_OPTIONS["model"]) >= {"transformer_lm_gpt3_175", "transformer_lm_gpt2_tiny"}


def test_shardlm_command_dispatches():
    from pathlib import Path

    shardlm = Path(sys.executable).with_name("shardlm")
    r = subprocess.run([shardlm, "train", "--cpu-ofload"], capture_output=True, text=True)
    assert r.returncode == 2 and "did you mean --cpu-offload" in r.stderr
    r = subprocess.run([shardlm, "exprot"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: shardlm" in r.stderr


def test_a_local_sweep_runs_each_job_with_its_values(tmp_path):
    """`train -m` on this host (Hydra's basic launcher): one job per value, each with it."""
    records, _ = run_train(
        DUMMY
        + [
            "--batch-size",
            "2",
            "--max-update",
            "1",
            "--no-save",
            "--log-format",
            "json",
            "-m",
            "optimization.lr=0.125,0.25",
        ],
        cwd=tmp_path,
    )
    assert sorted(r["train_lr"] for r in records["train"]) == [0.125, 0.25]
