"""Bad input to each of the six commands: a non-zero exit, exactly one line
`<prog>: error: <what>; <fix>` on stderr, no traceback, and nothing written — the data
dir, checkpoint, export and working directory byte-identical, no ./checkpoints.
`--debug` or SHARDLM_DEBUG=1 add the traceback.

The table runs in this process through cli.py's entry functions (the console scripts
call nothing else), each case in a fresh copy of a real data dir, checkpoint and export;
a few run as the console scripts themselves.
"""

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cli
from helpers import run_train

BIN = Path(sys.executable).parent
TINY = [
    "--arch",
    "transformer_lm_gpt2_tiny",
    "--decoder-attention-heads",
    "2",
    "--decoder-ffn-embed-dim",
    "128",
    "--tokens-per-sample",
    "32",
    "--batch-size",
    "4",
    "--max-update",
    "2",
    "--log-format",
    "none",
]
CKPT = "ckpt/checkpoint_last"
YAML = ["--config-dir", "cfg", "--config-name", "exp"]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """corpus.txt, data/ (preprocess), ckpt/ (2 updates of train), export/ (export-model)."""
    root = tmp_path_factory.mktemp("bad-input")
    words = " ".join(f"w{i}" for i in range(40))
    (root / "corpus.txt").write_text("".join(f"{words[i:]} the end\n" for i in range(60)))
    bigger = "".join(f"a{i} b{i * 7} c{i * 13}\n" for i in range(400))  # for a tokenizer with more ids
    (root / "other.txt").write_text(bigger)
    for args in (
        ["--trainpref", "corpus.txt", "--validpref", "corpus.txt", "--destdir", "data", "--vocab-size", "60"],
        ["--trainpref", "other.txt", "--validpref", "other.txt", "--destdir", "other", "--vocab-size", "300"],
    ):
        r = subprocess.run([BIN / "preprocess", *args], cwd=root, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    run_train(["data", *TINY, "--save-dir", "ckpt"], cwd=root)
    r = subprocess.run(
        [BIN / "export-model", "--path", CKPT, "--out", "export"], cwd=root, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return root


def write(path, text):
    def setup(cwd):
        (cwd / path).parent.mkdir(parents=True, exist_ok=True)
        (cwd / path).write_text(text)

    return setup


def cut(path, keep):
    """Keep the first `keep` bytes (negative: drop the last -keep)."""

    def setup(cwd):
        data = (cwd / path).read_bytes()
        (cwd / path).write_bytes(data[:keep])

    return setup


def remove(path):
    return lambda cwd: (cwd / path).unlink()


def other_tokens(cwd):
    """data/'s tokenizer beside token files (and metadata) made with a bigger vocabulary."""
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx"):
        shutil.copyfile(cwd / "other" / name, cwd / "data" / name)


def vocab_in_metadata(cwd):
    meta_file = cwd / "data" / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["vocab_size"] += 7
    meta_file.write_text(json.dumps(meta))


CASES = [
    # train: flags, overrides, YAML
    ("train", TINY + ["--max-updat", "3"], None, r"unrecognized flag --max-updat \(did you mean --max-update\?\)"),
    ("train", TINY + ["optimization.foo=1"], None, r"unknown config key optimization\.foo"),
    ("train", TINY + ["a.b="], None, r"unknown config key a\.b"),
    ("train", TINY + ["optimization.lr=[1,"], None, r"cannot parse override"),
    ("train", TINY + ["--lr", "abc"], None, r"argument --lr: invalid float value: 'abc'"),
    ("train", TINY + ["--lr", "nan"], None, r"--lr must be a finite number, got nan"),
    ("train", TINY + ["--update-freq", "0"], None, r"update_freq must be positive, got 0"),
    ("train", TINY + ["--batch-size", "-1"], None, r"batch_size must be positive, got -1"),
    ("train", TINY + ["--fp16", "--bf16"], None, r"--fp16 and --bf16 are exclusive"),
    ("train", TINY + ["--cpu-offload"], None, r"--cpu-offload needs --ddp-backend fully_sharded"),
    ("train", TINY + ["--fp16", "--fp16-init-scale", "0"], None, r"fp16_init_scale must be positive"),
    ("train", TINY + ["--decoder-attention-heads", "3"], None, r"heads 3 does not divide --decoder-embed-dim 64"),
    (
        "train",
        TINY + ["--arch", "transformer_lm_gpt2_tinny"],
        None,
        r"unknown model .*did you mean transformer_lm_gpt2_tiny",
    ),
    (
        "train",
        TINY + ["--tokens-per-sample", "2048", "--max-target-positions", "1024"],
        None,
        r"--tokens-per-sample 2048 exceeds the model's --max-target-positions 1024",
    ),
    ("train", TINY[:-6] + ["--max-tokens", "8"], None, r"--max-tokens 8 is smaller than one sample"),
    ("train", TINY + ["--distributed-port", "70000"], None, r"--distributed-port 70000 is not a port"),
    ("train", TINY + ["--distributed-init-method", "localhost:1234"], None, r"is not a rendezvous address"),
    (
        "train",
        TINY + ["--ddp-backend", "hybrid_shard", "--shard-group-size", "3", "--distributed-world-size", "2"],
        None,
        r"--shard-group-size 3 does not divide --distributed-world-size 2",
    ),
    ("train", ["data"] + TINY + ["--task", "dummy_lm"], None, r"--task dummy_lm .* reads no DATA"),
    ("train", TINY + YAML, write("cfg/exp.yaml", "optimization: {lr: [1,\n"), r"cfg/exp\.yaml is not valid YAML"),
    (
        "train",
        TINY + YAML,
        write("cfg/exp.yaml", "optimization:\n  max_updat: 3\n"),
        r"unknown config key optimization\.max_updat \(did you mean optimization\.max_update\?\)",
    ),
    (
        "train",
        TINY + YAML + ["model=mine"],
        lambda c: (write("cfg/exp.yaml", "{}\n")(c), write("cfg/model/mine.yaml", "a: [\n")(c)),
        r"cfg/model/mine\.yaml is not valid YAML",
    ),
    (
        "train",
        TINY + ["--save-dir", "corpus.txt/run"],
        None,
        r"--save-dir corpus\.txt/run cannot be created: corpus\.txt is a file",
    ),
    ("train", TINY + ["--no-save", "--log-file", "logs/train.log"], None, r"directory logs does not exist"),
    ("train", TINY + ["--train-subset", "trian"], None, r"no split 'trian' in the embedded corpus"),
    ("train", TINY + ["--adam-betas", "(0.9, 1.5)"], None, r"--adam-betas must each be in \[0, 1\)"),
    ("train", TINY + ["--seed", "-1"], None, r"--seed must be in \[0, 2\*\*32\)"),
    (
        "train",
        TINY + ["--distributed-rank", "2", "--distributed-world-size", "2"],
        None,
        r"--distributed-rank 2 is not a rank",
    ),
    (
        "train",
        TINY + ["--no-save", "--tensorboard-logdir", "corpus.txt"],
        None,
        r"--tensorboard-logdir corpus\.txt is a file",
    ),
    (
        "train",
        TINY + ["--task", "dummy_lm", "--dict-size", str(10**11)],
        None,
        r"needs at least [\d,.]+ GB .* which has",
    ),
    # train: the data directory
    ("train", ["nodir"] + TINY, None, r"data directory nodir does not exist.*local data only"),
    ("train", ["empty"] + TINY, write("empty/.keep", ""), r"empty has neither tokenizer\.model nor dict\.txt"),
    ("train", ["corpus.txt"] + TINY, None, r"DATA corpus\.txt is a file"),
    ("train", ["data"] + TINY, other_tokens, r"data/train\.bin holds token id \d+, outside the tokenizer's \d+ ids"),
    ("train", ["data"] + TINY, vocab_in_metadata, r"records a vocabulary of \d+, the data dir's tokenizer has \d+"),
    ("train", ["data"] + TINY, write("data/metadata.json", "{not json"), r"data/metadata\.json is not valid JSON"),
    ("train", ["data"] + TINY, cut("data/train.bin", 100), r"data/train\.bin is truncated or does not match"),
    ("train", ["data"] + TINY, cut("data/train.bin", -1), r"data/train\.bin is truncated"),
    ("train", ["data"] + TINY, cut("data/train.idx", 40), r"data/train\.idx is truncated"),
    ("train", ["data"] + TINY, write("data/train.idx", "garbage" * 10), r"data/train\.idx is not an MMIDIDX index"),
    ("train", ["data"] + TINY, cut("data/valid.bin", 10), r"data/valid\.bin is truncated"),
    ("train", ["data"] + TINY, write("data/tokenizer.model", "garbage"), r"is not a sentencepiece model"),
    ("train", ["data"] + TINY + ["--valid-subset", "valid,tset"], None, r"no split 'tset' in data"),
    (
        "train",
        ["data"] + TINY[:-6] + ["--batch-size", "512", "--distributed-world-size", "4"],
        None,
        r"only \d batches for 4 ranks",
    ),  # the blocks, cut at fairseq's multiple of 8: 2 batches
    # preprocess
    (
        "preprocess",
        ["--trainpref", "corpus.txt", "--destdir", "out", "--vocab-size", "abc"],
        None,
        r"argument --vocab-size: invalid int value",
    ),
    (
        "preprocess",
        ["--trainpref", "corpus.txt", "--destdir", "out", "--vocab"],
        None,
        r"unrecognized flag --vocab \(did you mean --vocab-size\?\)",
    ),
    ("preprocess", ["--trainpref", "Salesforce/wikitext", "--destdir", "out"], None, r"reads local files only"),
    ("preprocess", ["--trainpref", "corpus.txt", "--destdir", "corpus.txt/out"], None, r"corpus\.txt is a file"),
    ("preprocess", ["--trainpref", "corpus.txt", "--destdir", "data"], None, r"data/metadata\.json already exists"),
    (
        "preprocess",
        ["--trainpref", "corpus.txt", "--input-format", "json", "--destdir", "out"],
        None,
        r"could not read .*corpus\.txt as json",
    ),
    # eval-lm
    (
        "eval-lm",
        ["data", "--path", "ckpt", "--gen-subset", "valid"],
        None,
        r"ckpt is a --save-dir.*--path ckpt/checkpoint_last",
    ),
    ("eval-lm", ["data", "--path", "data", "--gen-subset", "valid"], None, r"data is neither a checkpoint directory"),
    ("eval-lm", ["nodir", "--path", CKPT], None, r"data directory nodir does not exist"),
    ("eval-lm", ["data", "--path", CKPT, "--gen-subset", "tset"], None, r"no split 'tset'.*--gen-subset"),
    (
        "eval-lm",
        ["data", "--path", CKPT, "--gen-subset", "valid", "--max-tokens", "8"],
        None,
        r"--max-tokens 8 is smaller than one block",
    ),
    (
        "eval-lm",
        ["data", "--path", CKPT, "--gen-subset", "valid", "--tokens-per-sample", "4096"],
        None,
        r"exceeds the model's 32 positions",
    ),
    ("eval-lm", ["data", "--path", CKPT, "--gen-subset", "valid"], other_tokens, r"holds token id \d+, outside"),
    (
        "eval-lm",
        ["data", "--path", CKPT, "--gen-subset", "valid"],
        write(f"{CKPT}/config.yaml", "model: [\n"),
        r"config\.yaml is not valid YAML",
    ),
    (
        "eval-lm",
        ["data", "--path", CKPT, "--gen-subset", "valid"],
        cut(f"{CKPT}/__0_0.distcp", 100),
        r"cannot read .* the checkpoint is damaged",
    ),
    (
        "eval-lm",
        ["data", "--path", "export", "--gen-subset", "valid"],
        cut("export/model.safetensors", 500),
        r"not a valid safetensors file",
    ),
    # generate
    ("generate", ["--path", "export", "--prompt", "w1", "--temperature", "nan"], None, r"need --temperature >= 0"),
    ("generate", ["--path", "export"], None, r"no prompts: pass --prompt"),
    (
        "generate",
        ["--path", "export", "--prompt", "w1"],
        write("export/config.yaml", "model: 3\n"),
        r"is not a shardlm run config",
    ),
    ("generate", ["--path", CKPT, "--prompt", "w1"], remove(f"{CKPT}/__0_0.distcp"), r"the checkpoint is damaged"),
    (
        "generate",
        ["--path", "export", "--prompt", "w1", "--max-new-tokens", "1000"],
        None,
        r"exceeds the model's 32 positions",
    ),
    # serve
    ("serve", ["--path", "export", "--bf16", "--fp16"], None, r"--fp16 and --bf16 both given: pick one$"),
    ("serve", ["--path", "export", "--max-batch", "0"], None, r"--max-batch: must be at least 1, got 0$"),
    # export-model
    ("export-model", ["--path", CKPT, "--out", "export"], None, r"export/model\.safetensors already exists"),
    ("export-model", ["--path", CKPT, "--out", "corpus.txt"], None, r"--out corpus\.txt is a file"),
    ("export-model", ["--path", CKPT, "--out", "corpus.txt/x"], None, r"corpus\.txt is a file"),
    ("export-model", ["--path", CKPT, "--out", "out"], cut(f"{CKPT}/__0_0.distcp", 100), r"the checkpoint is damaged"),
    ("export-model", ["--path", CKPT, "--out", "out", "--dtype", "fp8"], None, r"argument --dtype: invalid choice"),
    # plan
    ("plan", TINY + ["--cpu", "--device-memory-gb", "-5"], None, r"--device-memory-gb: must be a positive number"),
    (
        "plan",
        TINY + ["--cpu", "--host-memory-gb", "inf"],
        None,
        r"--host-memory-gb: must be a positive number, got inf",
    ),
    ("plan", TINY + ["--cpu", "--ranks-per-host", "8"], None, r"--ranks-per-host 8 exceeds the job's 1 rank"),
    ("plan", TINY + ["--cpu", "--memory-budget-gb", "2"], None, r"--auto-tune and --memory-budget-gb are train's"),
    ("plan", TINY + ["--cpu", "--auto-tune"], None, r"plan always picks the flags that fit; .*--host-memory-gb$"),
]


def snapshot(root):
    """Every path under root, with the hash of each file's bytes."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def prepared(fixtures, cwd, setup):
    for name in ("data", "ckpt", "export", "other"):
        shutil.copytree(fixtures / name, cwd / name)
    shutil.copyfile(fixtures / "corpus.txt", cwd / "corpus.txt")
    if setup:
        setup(cwd)
    return snapshot(cwd)


@pytest.mark.parametrize("prog,argv,setup,message", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_writes_nothing(fixtures, tmp_path, prog, argv, setup, message, capsys, monkeypatch):
    monkeypatch.delenv("SHARDLM_DEBUG", raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    before = prepared(fixtures, tmp_path, setup)
    capsys.readouterr()
    code = cli.COMMANDS[prog](list(argv))
    err = capsys.readouterr().err
    assert code not in (0, None), err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert snapshot(tmp_path) == before  # no ./checkpoints, no out/, nothing changed


def run(cmd, cwd, env=None, stdin=""):
    full_env = {k: v for k, v in os.environ.items() if k != "SHARDLM_DEBUG"}
    return subprocess.run(
        [str(BIN / cmd[0]), *cmd[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        input=stdin,
        env={**full_env, **(env or {})},
        timeout=300,
    )


def test_console_scripts_answer_in_one_line(fixtures, tmp_path):
    """The real executables, one bad input each: exit code, one line, nothing written."""
    before = prepared(fixtures, tmp_path, cut("data/train.idx", 40))
    for cmd, code in (
        (["train", "data", *TINY], 1),
        (["preprocess", "--trainpref", "corpus.txt", "--destdir", "out", "--workers", "x"], 2),
        (["eval-lm", "data", "--path", "ckpt", "--gen-subset", "valid"], 1),
        (["generate", "--path", "export"], 2),
        (["export-model", "--path", CKPT, "--out", "corpus.txt"], 2),
        (["export", "--path", CKPT, "--out", "corpus.txt"], 2),  # export-model's short name
        (["plan", "--arch", "nope"], 2),
    ):
        r = run(cmd, tmp_path)
        assert r.returncode == code and r.stderr.count("\n") == 1, (cmd, r.stderr)
        prog = "export-model" if cmd[0] == "export" else cmd[0]
        assert r.stderr.startswith(f"{prog}: error: ") and "Traceback" not in r.stderr, (cmd, r.stderr)
    assert snapshot(tmp_path) == before


def test_debug_shows_the_traceback(fixtures, tmp_path):
    """--debug and SHARDLM_DEBUG=1: the traceback, then the same one line; spawned ranks too."""
    r = run(["train", *TINY, "--lr", "abc", "--debug"], tmp_path)
    assert r.returncode == 2 and "Traceback (most recent call last)" in r.stderr
    assert r.stderr.splitlines()[-1] == "train: error: argument --lr: invalid float value: 'abc'"
    r = run(["preprocess", "--trainpref", "missing.txt"], tmp_path, env={"SHARDLM_DEBUG": "1"})
    assert r.returncode == 1 and "Traceback" in r.stderr and "DataError" in r.stderr
    r = run(["preprocess", "--trainpref", "missing.txt"], tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    # An error inside the ranks (a --restore-file of a format this shardlm does not read) on 2 spawned ranks.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "trainer_state.json").write_text('{"format": 0}')
    (tmp_path / "old" / ".metadata").write_bytes(b"")
    r = run(
        ["train", *TINY, "--no-save", "--restore-file", "old", "--distributed-world-size", "2", "--debug"], tmp_path
    )
    assert r.returncode != 0 and "Traceback" in r.stderr and "in _spawned_rank" in r.stderr, r.stderr[-2000:]
    # Without --debug both ranks meet the same error; the job says it once.
    r = run(["train", *TINY, "--no-save", "--restore-file", "old", "--distributed-world-size", "2"], tmp_path)
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("train: error: checkpoint old has format 0, this shardlm reads "), r.stderr
    assert "--debug" in run(["train", "--help"], tmp_path).stdout
