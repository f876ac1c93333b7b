"""Files and values from elsewhere never run code: crafted checkpoints and exports are
refused at every command that loads them, no config file or sweep override makes Hydra
instantiate a class outside shardlm's launchers, and SLURM's host list reaches `scontrol`
as one argument, never a shell. Each attack, if it worked, would create a marker file."""

import dataclasses
import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from helpers import DUMMY, TINY, run_train

BIN = Path(sys.executable).parent


class RunsCommand:
    """Pickles to a call of os.system: unpickling it runs the command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def run(cmd, *args, env=None):
    import subprocess

    return subprocess.run(
        [str(BIN / cmd), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def refused_in_one_line(r, prog):
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr


# ------------------------------------------------------------ checkpoints and exports
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real checkpoint (2 updates on the embedded corpus) and its export."""
    root = tmp_path_factory.mktemp("trained")
    run_train(
        [a for a in TINY if a != "--no-save"]
        + [
            "--batch-size",
            "4",
            "--max-update",
            "2",
            "--save-dir",
            str(root / "ck"),
            "--log-format",
            "none",
            "--max-valid-steps",
            "2",
        ]
    )
    assert run("export-model", "--path", root / "ck" / "checkpoint_last", "--out", root / "export").returncode == 0
    return root


def poison(kind, trained, where, marker):
    """A copy of the checkpoint (or export) with one file replaced by a crafted one."""
    import torch

    from trainer.formats.shardlm.checkpoint_dir import read_metadata

    src = trained / ("export" if kind == "export" else "ck/checkpoint_last")
    shutil.copytree(src, where)
    evil = RunsCommand(f"touch {marker}")
    if kind == "metadata":  # DCP's index is a pickle
        (where / ".metadata").write_bytes(pickle.dumps(evil))
    elif kind == "shard":  # every tensor entry points at a torch.save'd object that runs the command
        buf = io.BytesIO()
        torch.save(evil, buf)
        payload = buf.getvalue()
        md = read_metadata(where)
        for shard in where.glob("*.distcp"):
            shard.write_bytes(payload)
        md.storage_data = {k: dataclasses.replace(v, offset=0, length=len(payload)) for k, v in md.storage_data.items()}
        (where / ".metadata").write_bytes(pickle.dumps(md))
    elif kind == "yaml":  # PyYAML's unsafe loader would call os.system
        (where / "config.yaml").write_text(f'model: !!python/object/apply:os.system ["touch {marker}"]\n')
    elif kind == "export":
        (where / "model.safetensors").write_bytes(pickle.dumps(evil))
    return where


@pytest.mark.parametrize(
    "prog,kind",
    [
        ("train", "shard"),  # ("train", "metadata") is test_checkpoint.py's
        ("eval-lm", "metadata"),
        ("eval-lm", "export"),
        ("generate", "shard"),
        ("generate", "yaml"),
        ("export-model", "metadata"),
        ("export-model", "shard"),
    ],
)
def test_crafted_checkpoint_or_export_is_refused_without_running(trained, tmp_path, prog, kind):
    marker = tmp_path / "pwned"
    path = poison(kind, trained, tmp_path / "crafted", marker)
    if prog == "train":
        args = [a for a in TINY if a != "--no-save"] + [
            "--batch-size",
            "4",
            "--max-update",
            "4",
            "--save-dir",
            tmp_path / "ck",
            "--restore-file",
            path,
        ]
    else:
        args = {
            "eval-lm": ["--path", path],
            "generate": ["--path", path, "--prompt", "a"],
            "export-model": ["--path", path, "--out", tmp_path / "out"],
        }[prog]
    r = run(prog, *args)
    refused_in_one_line(r, prog)
    assert not marker.exists()
    if kind == "shard":  # the payload is real: only weights_only loading stops it
        import torch

        shard = next(path.glob("*.distcp")).read_bytes()
        torch.load(io.BytesIO(shard), weights_only=False)
        assert marker.exists()


# ------------------------------------------------------------------- Hydra and YAML
@pytest.mark.parametrize(
    "text,option",
    [
        ("_target_: os.system\n", None),
        ("model: {_target_: os.system, command: touch MARKER}\n", None),
        ("model: evil\n", "_target_: os.system\ncommand: touch MARKER\n"),
    ],
    ids=["top_level", "in_a_group", "group_option_file"],
)
def test_yaml_cannot_name_a_class(tmp_path, text, option):
    marker = tmp_path / "pwned"
    (tmp_path / "exp.yaml").write_text(text.replace("MARKER", str(marker)))
    if option:
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "evil.yaml").write_text(option.replace("MARKER", str(marker)))
    _, r = run_train(
        DUMMY + ["--batch-size", "2", "--max-update", "1", "--config-dir", tmp_path, "--config-name", "exp"],
        check=False,
    )
    refused_in_one_line(r, "train")
    assert "_target_" in r.stderr and not marker.exists()


def test_a_sweep_instantiates_only_shardlms_launchers(tmp_path):
    marker = tmp_path / "pwned"
    search = tmp_path / "search" / "hydra" / "callbacks"
    search.mkdir(parents=True)
    (search / "evil.yaml").write_text(
        f"# @package hydra.callbacks\nevil: {{_target_: os.system, command: touch {marker}}}\n"
    )
    sweep = DUMMY + ["--batch-size", "2", "--max-update", "1", "-m"]
    for overrides in (
        ["hydra.launcher._target_=os.system"],
        [f"hydra.searchpath=[file://{tmp_path / 'search'}]", "hydra/callbacks=evil"],
        ["hydra/launcher=evil"],
    ):
        _, r = run_train(sweep + overrides, check=False)
        refused_in_one_line(r, "train")
        assert not marker.exists() and not Path("multirun").exists()


# --------------------------------------------------------------------------- SLURM
@pytest.mark.parametrize("nodelist", ["node[1-2];touch MARKER", "$(touch MARKER)"])
def test_slurm_host_list_is_one_argument_never_a_shell(tmp_path, nodelist):
    # A stand-in scontrol records the arguments it receives and fails as the real one does
    # on a list it cannot parse; a shell anywhere on the way would have run the touch.
    marker, calls = tmp_path / "pwned", tmp_path / "calls.json"
    nodelist = nodelist.replace("MARKER", str(marker))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "scontrol"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\nopen({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) "
        "+ '\\n')\nsys.exit('scontrol: error: Invalid hostlist')\n"
    )
    fake.chmod(0o755)
    env = {
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "1",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": nodelist,
    }
    _, r = run_train(
        DUMMY + ["--batch-size", "2", "--max-update", "1", "--distributed-world-size", "2"], check=False, env=env
    )
    refused_in_one_line(r, "train")
    assert "scontrol could not expand" in r.stderr
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [["show", "hostnames", nodelist]]
    assert not marker.exists()
