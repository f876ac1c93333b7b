"""bench/bench_gpu.py's contenders: the shapes (Llama 3.2 1B, and --quick's tiny one), the
train flags of each row, and how each runs: the plain loop (bench/ref_loop.py --impl llama),
`train` with its json records, `train` in a process of its own that counts the host
synchronisations inside its updates, and `plan`'s prediction for every row.
"""

import json
import subprocess
import sys
from pathlib import Path

from benchlib import BIN, ROOT, json_records, median, note, run_train

REF_LOOP = Path(__file__).resolve().parent / "ref_loop.py"
# Llama 3.2 1B as `--arch llama3_2_1b` builds it, with the Llama 3 tokenizer's vocabulary.
FULL = dict(layers=16, dim=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=2048, batch=8, steps=10)
QUICK = dict(layers=2, dim=64, heads=4, kv_heads=2, ffn=128, vocab=512, seq=64, batch=2, steps=1)
WARMUP = 2  # ref_loop drops its first two steps too
FSDP = ["--ddp-backend", "fully_sharded"]
# What --only names, in running order: the train flags of each row; "ref" is the plain loop.
RUNS = {
    "ref": None,
    "train": [],
    "train+compile": ["--compile"],
    "fsdp": FSDP,
    "fsdp+compile": FSDP + ["--compile"],
    "offload": FSDP + ["--cpu-offload"],
}


def row_name(key):
    return "plain loop (ref_loop.py)" if RUNS[key] is None else " ".join(["train"] + RUNS[key])


def model_args(s):
    """train's and plan's flags for shape `s`: the preset, its pieces spelled out (the full
    shape's are the preset's own), the batch, bf16 and the plain loop's AdamW."""
    return [
        "--task",
        "dummy_lm",
        "--dict-size",
        str(s["vocab"]),
        "--tokens-per-sample",
        str(s["seq"]),
        "--batch-size",
        str(s["batch"]),
        "--arch",
        "llama3_2_1b",
        "--decoder-layers",
        str(s["layers"]),
        "--decoder-embed-dim",
        str(s["dim"]),
        "--decoder-attention-heads",
        str(s["heads"]),
        "--decoder-kv-heads",
        str(s["kv_heads"]),
        "--decoder-head-dim",
        str(s["dim"] // s["heads"]),
        "--decoder-ffn-embed-dim",
        str(s["ffn"]),
        "--bf16",
        "--optimizer",
        "adamw",
        "--lr",
        "0.0001",
        "--weight-decay",
        "0.01",
    ]  # torch's AdamW default decay


def run_ref(s, device):
    """The plain loop: tokens/s, model TFLOP/s and peak memory (GiB)."""
    out = subprocess.run(
        [
            sys.executable,
            str(REF_LOOP),
            "--impl",
            "llama",
            "--device",
            device,
            "--layers",
            str(s["layers"]),
            "--dim",
            str(s["dim"]),
            "--heads",
            str(s["heads"]),
            "--kv-heads",
            str(s["kv_heads"]),
            "--ffn",
            str(s["ffn"]),
            "--vocab",
            str(s["vocab"]),
            "--seq",
            str(s["seq"]),
            "--batch",
            str(s["batch"]),
            "--steps",
            str(s["steps"]),
            "--dtype",
            "bf16",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    missing = [k for k in ("tokens/s", "model_GFLOP/s", "mem_gb") if k not in fields]
    if missing:
        raise RuntimeError(f"ref_loop printed no {', '.join(missing)}: {out.strip()}")
    return {
        "tps": float(fields["tokens/s"]),
        "tflops": float(fields["model_GFLOP/s"]) / 1e3,
        "mem": float(fields["mem_gb"]),
    }


def run_ours(s, flags, peak, env=None):
    """One `train` run: median wps, TFLOP/s and mfu after the warm-up, largest mem_gb."""
    # Two records of s["steps"] updates each: the first holds the warm-up (and compilation),
    # the second is timed. train reads its meters on the host once per record, as a user's
    # run with a --log-interval does, and the plain loop is timed over its steps the same way.
    out = run_train(
        model_args(s)
        + flags
        + [
            "--peak-tflops",
            f"{peak:.6g}",
            "--max-update",
            str(2 * s["steps"]),
            "--no-save",
            "--disable-validation",
            "--log-format",
            "json",
            "--log-interval",
            str(s["steps"]),
        ],
        env=env,
    )
    records = json_records(out)
    timed = records[1:]
    if not timed:
        raise RuntimeError(f"train logged {len(records)} records, none after the warm-up's")
    missing = sorted({k for r in records for k in ("wps", "tflops", "mfu", "mem_gb") if k not in r})
    if missing:
        raise RuntimeError(f"train's json records have no {', '.join(missing)}")
    return {
        "tps": median(r["wps"] for r in timed),
        "tflops": median(r["tflops"] for r in timed),
        "mfu": median(r["mfu"] for r in timed),
        "mem": max(r["mem_gb"] for r in records),
    }


# `train` in this process with torch's CUDA sync debug mode on inside each update: every op
# that makes the host wait for the device (.item(), a copy to pageable host memory, ...)
# warns, and the warnings of the updates after the first two are counted.
_SYNC_COUNT = """
import sys, warnings
import torch
import cli
from trainer.train.trainer import Trainer
seen, updates, step = [], [0], Trainer.train_step
def counted(self, samples):
    updates[0] += 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return step(self, samples)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            if updates[0] > 2:
                seen.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message))
Trainer.train_step = counted
code = cli.COMMANDS["train"](sys.argv[1:])
print(f"host_syncs={len(seen)} updates={max(updates[0] - 2, 0)}", *sorted(set(seen))[:5], sep="\\n")
sys.exit(code)
"""


def count_syncs(s, flags):
    """(host synchronisations inside the timed updates of `train` with `flags`, updates):
    torch.cuda.set_sync_debug_mode("warn") during each train_step; one rank, in-process."""
    out = subprocess.run(
        [sys.executable, "-c", _SYNC_COUNT]
        + model_args(s)
        + flags
        + ["--max-update", str(WARMUP + s["steps"]), "--no-save", "--disable-validation", "--log-format", "none"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    counts = dict(kv.split("=", 1) for kv in out.split() if kv.startswith(("host_syncs=", "updates=")))
    for line in out.splitlines():
        if "synchroniz" in line:
            note(f"host synchronisation in an update: {line.strip()}")
    return int(counts["host_syncs"]), int(counts["updates"])


def predictions(s, keys, device_memory_gb):
    """{key: plan's per-rank peak for that row's flags, or None if plan failed}: on this GPU's
    memory, or on this CPU. plan is torch-free and quick: all of them at once, before any run."""
    where = ["--device-memory-gb", f"{device_memory_gb:.1f}"] if device_memory_gb else ["--cpu"]
    procs = {
        k: subprocess.Popen(
            [str(BIN / "plan"), "--format", "json"] + where + model_args(s) + RUNS[k],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for k in keys
        if RUNS[k] is not None
    }
    plans = {}
    for k, proc in procs.items():
        out, err = proc.communicate()
        plans[k] = json.loads(out)["per_rank_gb"] if proc.returncode == 0 else None
        if plans[k] is None:
            note(f"plan for {row_name(k)} failed: " + " / ".join(err.strip().splitlines()[-3:]))
    return plans
