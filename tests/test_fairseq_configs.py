"""fairseq-hydra-train's config surface in `train`: fairseq's model YAML files by group path,
its key aliases and list spellings, docs/hydra_integration.md's three cases, and fairseq's own
config.yaml, each as real files; the docs' cases and config.yaml as real tiny runs (one rank,
through `train`'s entry point in this process: helpers.train_here), and a one-line error from
a real `train` process."""

import sys

import numpy as np
import pytest
import yaml

from helpers import run_train, train_here
from trainer.config.compose import CONF_DIR, KEY_ALIASES, compose_config
from trainer.config.flags import build_parser, parse_flags
from trainer.errors import UsageError

FAIRSEQ_MODELS = [
    "transformer_lm_baevski_gbw",
    "transformer_lm_baevski_wiki103",
    "transformer_lm_big",
    "transformer_lm_gbw",
    "transformer_lm_gpt",
    "transformer_lm_gpt2_big",
    "transformer_lm_gpt2_medium",
    "transformer_lm_gpt2_small",
    "transformer_lm_wiki103",
]

# fairseq/config/config.yaml, verbatim.
FAIRSEQ_CONFIG_YAML = """\
# @package _group_

hydra:
  run:
    dir: .

defaults:
    - _self_
    - task: null
    - model: null
    - criterion: cross_entropy
    - optimizer: null
    - lr_scheduler: fixed
    - bpe: null
    - tokenizer: null
    - scoring: null
    - generation: null
    - common_eval: null
    - eval_lm: null
"""

# docs/hydra_integration.md, case 2: /path/to/external/configs/wiki103.yaml, verbatim but the data path.
WIKI103_YAML = """\
# @package _group_

model:
  _name: transformer_lm
distributed_training:
  distributed_world_size: 1
dataset:
  batch_size: 2
task:
  _name: language_modeling
  data: /path/to/data
  add_bos_token: false
  max_target_positions: 1024
optimization:
  max_update: 50000
  lr: [ 0.25 ]
criterion: cross_entropy
optimizer: adam
lr_scheduler:
  _name: cosine
"""

# Appended to a run's overrides: a tiny model, 2 updates, json records, nothing saved.
SHRINK = [
    "model.decoder_layers=2",
    "model.decoder_embed_dim=64",
    "model.decoder_input_dim=64",
    "model.decoder_output_dim=64",
    "model.decoder_ffn_embed_dim=128",
    "model.decoder_attention_heads=2",
    "task.tokens_per_sample=32",
    "optimization.max_update=2",
    "checkpoint.no_save=true",
    "common.log_format=json",
    "dataset.max_valid_steps=1",
]


def compose(argv):
    ns, settings, overrides = parse_flags(build_parser(), argv)
    return compose_config(settings, overrides, ns.config_dir, ns.config_name)


def refused(argv, *phrases):
    with pytest.raises(UsageError) as e:
        compose(argv)
    message = str(e.value)
    assert "\n" not in message and all(p in message for p in phrases), message
    return message


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def model_file(name):
    return (CONF_DIR / "model" / "transformer_lm" / f"{name}.yaml").read_text()


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    """A tiny data directory as fairseq-preprocess writes it: dict.txt + MMIDIDX train/valid."""
    from data.indexed_dataset import IndexedDatasetBuilder

    path = tmp_path_factory.mktemp("data-bin")
    (path / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(40)))
    rng = np.random.default_rng(0)
    for split, n in (("train", 100), ("valid", 10)):
        builder = IndexedDatasetBuilder(path / split, dtype=np.uint16)
        for _ in range(n):  # symbol ids 4.. ending in </s> = 2
            builder.add_item(np.append(4 + rng.integers(0, 40, size=rng.integers(3, 15)), 2))
        builder.finalize()
    return path


# ---------------------------------------------------------------- 1. group paths
def test_fairseq_model_files_are_selected_by_group_path(tmp_path):
    gpt = compose(["model=transformer_lm/transformer_lm_gpt"])
    assert (gpt.model._name, gpt.model.decoder_layers, gpt.model.decoder_embed_dim) == ("transformer_lm_gpt", 12, 768)
    assert (gpt.model.decoder_input_dim, gpt.model.decoder_output_dim, gpt.model.attention_dropout) == (768, 768, 0.1)
    # --arch keeps its meaning: the preset of that name, the same shape as fairseq's file.
    arch = compose(["--arch", "transformer_lm_gpt"])
    assert arch.model._name == "transformer_lm_gpt" and arch.model.decoder_input_dim is None
    assert all(
        arch.model[k] == gpt.model[k]
        for k in (
            "decoder_layers",
            "decoder_embed_dim",
            "activation_fn",
            "decoder_ffn_embed_dim",
            "decoder_attention_heads",
        )
    )
    # In a file's defaults list; the file's own keys come after it (Hydra's `_self_` last).
    write(
        tmp_path / "exp.yaml", "defaults:\n  - model: transformer_lm/transformer_lm_gpt\nmodel:\n  decoder_layers: 3\n"
    )
    cfg = compose(["--config-dir", str(tmp_path), "--config-name", "exp"])
    assert (cfg.model._name, cfg.model.decoder_layers, cfg.model.decoder_embed_dim) == ("transformer_lm_gpt", 3, 768)
    # docs case 3: the user's --config-dir adds model/transformer_lm/2_layers.yaml to the search path.
    write(
        tmp_path / "model" / "transformer_lm" / "2_layers.yaml",
        model_file("transformer_lm_gpt").replace("decoder_layers: 12", "decoder_layers: 2"),
    )
    cfg = compose(["model=transformer_lm/2_layers", "--config-dir", str(tmp_path)])
    assert (cfg.model._name, cfg.model.decoder_layers, cfg.model.decoder_embed_dim) == ("transformer_lm", 2, 768)
    # The user's directory comes first in the search path, as Hydra's --config-dir does.
    write(tmp_path / "model" / "transformer_lm" / "transformer_lm_gpt.yaml", "decoder_layers: 5\n")
    cfg = compose(["model=transformer_lm/transformer_lm_gpt", "--config-dir", str(tmp_path)])
    assert (cfg.model._name, cfg.model.decoder_layers, cfg.model.decoder_embed_dim) == ("transformer_lm_gpt", 5, 512)
    refused(["model=transformer_lm/transformer_lm_gtp"], "did you mean transformer_lm/transformer_lm_gpt?")


# ---------------------------------------------------- 2. every key of fairseq's files
@pytest.mark.parametrize("name", FAIRSEQ_MODELS)
def test_every_key_of_fairseqs_model_files_loads(name):
    text = model_file(name)
    assert text.startswith("# @package _group_\n")
    cfg = compose([f"model=transformer_lm/{name}"])
    listed = yaml.safe_load(text)
    assert len(listed) == 35  # fairseq's 35 keys, each a field or an alias of one
    for key, value in listed.items():
        key = KEY_ALIASES.get(f"model.{key}", f"model.{key}").split(".")[1]
        assert cfg.model[key] == value, key
    assert cfg.model.activation_dropout == listed["relu_dropout"]


def test_fairseq_key_aliases_in_files_and_overrides(tmp_path):
    cfg = compose(["model.relu_dropout=0.2", "task.max_target_positions=64", "dataset.max_sentences=3"])
    assert (cfg.model.activation_dropout, cfg.model.max_target_positions, cfg.dataset.batch_size) == (0.2, 64, 3)
    write(
        tmp_path / "exp.yaml",
        "model: {relu_dropout: 0.3, activation_dropout: 0.3}\n"
        "task: {max_target_positions: 128}\ndataset: {max_sentences: 4}\n",
    )
    cfg = compose(["--config-dir", str(tmp_path), "--config-name", "exp"])
    assert (cfg.model.activation_dropout, cfg.model.max_target_positions, cfg.dataset.batch_size) == (0.3, 128, 4)
    # Across sources it is precedence: the override wins over the file.
    cfg = compose(["--config-dir", str(tmp_path), "--config-name", "exp", "model.activation_dropout=0.1"])
    assert cfg.model.activation_dropout == 0.1
    write(tmp_path / "both.yaml", "model: {relu_dropout: 0.3, activation_dropout: 0.1}\n")
    refused(
        ["--config-dir", str(tmp_path), "--config-name", "both"],
        "both.yaml",
        "relu_dropout=0.3",
        "activation_dropout=0.1",
        "set only one of them",
    )
    refused(["task.max_target_positions=64", "model.max_target_positions=128"], "set only one of them")
    write(tmp_path / "model" / "mine.yaml", "relu_dropout: 0.1\nactivation_dropout: 0.0\n")
    refused(["--config-dir", str(tmp_path), "model=mine"], "mine.yaml", "relu_dropout", "set only one")


# ----------------------------------------------- 3. fairseq's experiment file (docs case 2)
def test_docs_case_2_external_config_composes_and_trains(tmp_path, data_bin, capfd):
    write(tmp_path / "configs" / "wiki103.yaml", WIKI103_YAML.replace("/path/to/data", str(data_bin)))
    argv = ["--config-dir", str(tmp_path / "configs"), "--config-name", "wiki103"]
    cfg = compose(argv)
    assert (cfg.model._name, cfg.distributed_training.distributed_world_size, cfg.dataset.batch_size) == (
        "transformer_lm",
        1,
        2,
    )
    assert (cfg.task._name, cfg.task.data, cfg.task.add_bos_token) == ("language_modeling", str(data_bin), False)
    assert (cfg.model.max_target_positions, cfg.optimization.max_update, cfg.optimization.lr) == (1024, 50000, 0.25)
    assert (cfg.criterion._name, cfg.optimizer._name, cfg.lr_scheduler._name) == ("cross_entropy", "adam", "cosine")
    records, _ = train_here(argv + SHRINK, capfd)
    assert records["train"][-1]["train_num_updates"] == 2
    # fairseq's per-epoch lists: one value is a value, more are refused in one line.
    write(tmp_path / "configs" / "epochs.yaml", "optimization:\n  lr: [0.25, 0.1]\n")
    refused(
        argv[:2] + ["--config-name", "epochs"], "epochs.yaml", "per-epoch lr lists are not supported", "give one value"
    )
    write(tmp_path / "configs" / "one.yaml", "optimization:\n  update_freq: [2]\n")
    assert compose(argv[:2] + ["--config-name", "one"]).optimization.update_freq == 2
    refused(["optimization.update_freq=[1,2]"], "per-epoch update_freq lists are not supported")


# ------------------------------------------------ 4. --config-dir without --config-name
def test_config_dir_alone_reads_its_config_yaml_else_shardlms(tmp_path):
    write(tmp_path / "model" / "mine.yaml", "decoder_layers: 2\n")
    cfg = compose(["--config-dir", str(tmp_path), "model=mine"])  # no config.yaml there: conf/config.yaml
    assert (cfg.model._name, cfg.model.decoder_layers, cfg.optimizer._name) == ("mine", 2, "adam")
    write(tmp_path / "config.yaml", "defaults:\n  - model: mine\noptimization: {max_update: 7}\n")
    cfg = compose(["--config-dir", str(tmp_path)])
    assert (cfg.model.decoder_layers, cfg.optimization.max_update) == (2, 7)


# -------------------------------------------- 5. fairseq's config.yaml and docs case 1
def test_fairseqs_config_yaml_composes(tmp_path):
    write(tmp_path / "config.yaml", FAIRSEQ_CONFIG_YAML)
    cfg = compose(["--config-dir", str(tmp_path)])
    base = compose([])
    assert cfg == base  # its null entries select nothing; its others are shardlm's defaults too
    # `_self_` first: the options listed after it override the file's own keys (Hydra's order).
    write(
        tmp_path / "self_first.yaml",
        FAIRSEQ_CONFIG_YAML.replace("lr_scheduler: fixed", "lr_scheduler: cosine")
        + "lr_scheduler: {_name: inverse_sqrt, warmup_updates: 10}\n",
    )
    cfg = compose(["--config-dir", str(tmp_path), "--config-name", "self_first"])
    assert (cfg.lr_scheduler._name, cfg.lr_scheduler.warmup_updates) == ("cosine", 10)
    for old, new, phrases in [
        ("bpe: null", "bpe: gpt2", ("bpe=gpt2", "`preprocess`", "set bpe to null")),
        ("generation: null", "generation: beam", ("generation=beam", "`generate`")),
        ("eval_lm: null", "eval_lm: x", ("eval-lm",)),
        ("dir: .", "dir: outputs", ("hydra.run.dir='outputs'", "working directory")),
        ("run:\n    dir: .", "job:\n    chdir: true", ("hydra.job.chdir", "train -m")),
        ("- _self_", "- _self_\n    - _self_", ("listed twice",)),
        ("- model: null", "- model@x: null", ("unknown defaults entry",)),
        ("# @package _group_", "# @package model", ("# @package model", "is not supported")),
    ]:
        assert old in FAIRSEQ_CONFIG_YAML
        write(tmp_path / "bad.yaml", FAIRSEQ_CONFIG_YAML.replace(old, new))
        refused(["--config-dir", str(tmp_path), "--config-name", "bad"], *phrases)
    refused(["bpe=sentencepiece"], "`preprocess`")
    assert compose(["bpe=null", "hydra.run.dir=."]) == base


def test_docs_case_1_overrides_train(tmp_path, data_bin, capfd):
    overrides = [
        "distributed_training.distributed_world_size=1",
        "dataset.batch_size=2",
        f"task.data={data_bin}",
        "model=transformer_lm/transformer_lm_gpt",
        "task=language_modeling",
        "optimization.max_update=5000",
    ]
    cfg = compose(overrides)
    assert (cfg.model._name, cfg.model.decoder_layers, cfg.optimization.max_update) == ("transformer_lm_gpt", 12, 5000)
    records, r = train_here(overrides + SHRINK, capfd)
    assert records["train"][-1]["train_num_updates"] == 2 and "transformer_lm_gpt" in r.stdout


def test_fairseqs_config_yaml_with_a_user_model_file_trains(tmp_path, data_bin, capfd):
    """docs case 3 with fairseq's config.yaml in the --config-dir: the full fairseq layout."""
    write(tmp_path / "configs" / "config.yaml", FAIRSEQ_CONFIG_YAML)
    write(
        tmp_path / "configs" / "model" / "transformer_lm" / "2_layers.yaml",
        model_file("transformer_lm_gpt").replace("decoder_layers: 12", "decoder_layers: 2"),
    )
    argv = [
        "distributed_training.distributed_world_size=1",
        "dataset.batch_size=2",
        f"task.data={data_bin}",
        "model=transformer_lm/2_layers",
        "task=language_modeling",
        "optimization.max_update=5000",
        "--config-dir",
        str(tmp_path / "configs"),
    ] + SHRINK[1:]  # the file's 2 layers
    records, r = train_here(argv, capfd)
    assert records["train"][-1]["train_num_updates"] == 2 and "2 layers" in r.stdout


def test_a_sweep_takes_fairseqs_group_paths_and_aliases(tmp_path, capfd, monkeypatch):
    """`train -m`: Hydra expands the sweep without reading fairseq's files or aliases itself.
    Its jobs run in the launcher's process (Hydra's basic launcher): here, this one."""
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # the sweep hands Hydra its own sys.argv
    records, r = train_here(
        [
            "--task",
            "dummy_lm",
            "--dict-size",
            "256",
            "--dataset-size",
            "64",
            "--batch-size",
            "2",
            "model=transformer_lm/transformer_lm_gpt",
            "model.relu_dropout=0.05",
            "-m",
            "optimization.lr=0.125,0.25",
        ]
        + SHRINK[:7]
        + ["optimization.max_update=1"]
        + SHRINK[8:],
        capfd,
    )
    assert sorted(rec["train_lr"] for rec in records["train"]) == [0.125, 0.25]
    assert r.stdout.count("model transformer_lm_gpt, 2 layers") == 2


# ------------------------------------------------------------ 6. one-line errors
def test_errors_reach_the_user_in_one_line(tmp_path):
    write(tmp_path / "config.yaml", FAIRSEQ_CONFIG_YAML.replace("bpe: null", "bpe: gpt2"))
    _, r = run_train(["--config-dir", str(tmp_path)], cwd=tmp_path, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "bpe=gpt2" in lines[0] and "drop it" in lines[0], r.stderr
