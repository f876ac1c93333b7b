"""Framework overhead: `train --task dummy_lm` against the plain PyTorch loop
(../shared/bench/ref_loop.py) on the same shape, fp32 and bf16.

The contenders run interleaved (ref, ours, ref, ours, …) in one invocation and each
side's median is compared, because timings on these machines drift ±40 % run to run.
Prints a markdown table. Usage: python bench/bench_loop.py [--reps 3] [--steps 10]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REF_LOOP = Path(os.environ.get("SHARDLM_REF_LOOP", ROOT.parent / "shared" / "bench" / "ref_loop.py"))
SHAPE = dict(layers=6, dim=384, heads=6, seq=256, batch=8, vocab=8192)
WARMUP = 2  # ref_loop also drops its first two steps


def ref_tokens_per_s(dtype, steps):
    s = SHAPE
    out = subprocess.run([sys.executable, str(REF_LOOP), "--layers", str(s["layers"]), "--dim", str(s["dim"]),
                          "--heads", str(s["heads"]), "--seq", str(s["seq"]), "--batch", str(s["batch"]),
                          "--vocab", str(s["vocab"]), "--steps", str(steps), "--dtype", dtype],
                         check=True, capture_output=True, text=True).stdout
    return float(re.search(r"tokens/s=([\d.]+)", out).group(1))


def train_command(dtype, steps):
    s = SHAPE
    cmd = [str(Path(sys.executable).with_name("train")), "--task", "dummy_lm", "--dict-size", str(s["vocab"]),
           "--tokens-per-sample", str(s["seq"]), "--batch-size", str(s["batch"]),
           "--decoder-layers", str(s["layers"]), "--decoder-embed-dim", str(s["dim"]),
           "--decoder-attention-heads", str(s["heads"]), "--decoder-ffn-embed-dim", str(4 * s["dim"]),
           "--share-decoder-input-output-embed", "--decoder-learned-pos", "--activation-fn", "gelu",
           "--dropout", "0", "--optimizer", "adamw", "--lr", "0.0001", "--weight-decay", "0.01",  # ref's AdamW
           "--max-update", str(steps + WARMUP), "--no-save", "--log-format", "json",
           "--log-interval", "1"]
    return cmd + (["--bf16"] if dtype == "bf16" else [])


def train_tokens_per_s(dtype, steps):
    out = subprocess.run(train_command(dtype, steps), check=True, capture_output=True, text=True).stdout
    records = [json.loads(line[line.index("{"):]) for line in out.splitlines() if "| train_inner |" in line]
    wps = [r["wps"] for r in records[WARMUP:]]
    return statistics.median(wps)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    if not REF_LOOP.exists():
        sys.exit(f"bench_loop: no reference loop at {REF_LOOP}; set SHARDLM_REF_LOOP")
    rows = []
    for dtype in ("fp32", "bf16"):
        ref, ours = [], []
        for rep in range(a.reps):
            ref.append(ref_tokens_per_s(dtype, a.steps))
            ours.append(train_tokens_per_s(dtype, a.steps))
            print(f"{dtype} rep {rep + 1}: ref {ref[-1]:.0f} tok/s, train {ours[-1]:.0f} tok/s", file=sys.stderr)
        r, o = statistics.median(ref), statistics.median(ours)
        rows.append((dtype, r, o, o / r))
    print(f"\nshape: {SHAPE}, {a.steps} timed steps, {a.reps} interleaved repetitions, medians\n")
    print("| dtype | ref_loop tokens/s | train tokens/s | ratio (goal ≥ 0.95) |")
    print("|---|---|---|---|")
    for dtype, r, o, ratio in rows:
        print(f"| {dtype} | {r:.0f} | {o:.0f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
