"""--wandb-project: rank 0 logs fairseq's scalars to a W&B run (offline where W&B cannot be
reached), and without the wandb package the flag is refused before any rank starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import DUMMY, run_train


def wandb_records(run_file):
    """The records of a run's .wandb file, read as `wandb sync` reads them: a LevelDB-style
    log (a 7-byte header, then 32 KiB blocks of chunks: crc32c, length, type) of protobuf
    Records. wandb ships no reader of offline runs, so the test parses the format itself."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, chunk, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def test_offline_run_has_fairseqs_scalars_from_rank_0_only(tmp_path, monkeypatch):
    # W&B's API unreachable and no WANDB_MODE: the run logs offline, as on a machine without
    # network (a refused local port stands in for it, the same here and in CI).
    monkeypatch.delenv("WANDB_MODE", raising=False)
    env = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    records, r = run_train(
        DUMMY
        + [
            "--batch-size",
            "4",
            "--max-update",
            "4",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--wandb-project",
            "p",
            "--distributed-world-size",
            "2",
            "--save-dir",
            str(tmp_path / "run7"),
        ],
        cwd=tmp_path,
        env=env,
    )
    assert "cannot be reached: logging offline" in r.stdout + r.stderr
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs  # rank 0's run only
    history, run = {}, None
    for rec in wandb_records(runs[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(rec.history.step.num, {}).update(row)
    assert run.project == "p" and run.display_name == "run7"  # fairseq's name: the save dir's
    config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in run.config.update}
    assert config["optimization"]["max_update"] == 4 and config["common"]["wandb_project"] == "p"
    # fairseq's keys (tag/key) at step num_updates, with the values the json log shows
    assert sorted(history) == [1, 2, 3, 4]
    for rec in records["train_inner"]:
        row = history[rec["num_updates"]]
        for key in ("loss", "ppl", "wps", "lr", "gnorm", "mem_gb"):
            assert row[f"train_inner/{key}"] == rec[key], key
        assert "train_inner/num_updates" not in row
    summary = records["train"][-1]
    assert history[4]["train/loss"] == summary["train_loss"]
    assert history[4]["valid/loss"] == records["valid"][-1]["valid_loss"]


def test_wandb_project_without_wandb_is_refused_before_ranks_start(tmp_path):
    # A sitecustomize that hides the package: importlib.util.find_spec("wandb") returns None in
    # this `train`, as where wandb is not installed.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(
        [str(Path(sys.executable).with_name("train"))] + DUMMY + ["--batch-size", "4", "--wandb-project", "p"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""  # no rank started: nothing logged
    assert r.stderr.strip() == (
        "train: error: --wandb-project needs the wandb package: pip install 'shardlm[wandb]' (or wandb)"
    )
