"""Runs every benchmark script (what `make bench` does), one after the other, each
printing its own tables, then one combined markdown table: benchmark, measured, goal, met?

Each script is also runnable alone (`python bench/bench_loop.py --help`); here they run
with their defaults, or with `--reps N` for all, or with `--quick` (one repetition, a few
steps, a 5 MB corpus, FSDP against DDP only: a check that everything runs, not numbers).
A script that fails gets a row saying so and the others still run; the exit code is then 1.

Usage: python bench/run_all.py [--quick] [--reps N] [--only startup loop mfu dataload preprocess fsdp plan]
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import goal, goal_table

HERE = Path(__file__).resolve().parent
# In running order, with the arguments --quick adds (and --reps 1): a smoke test of each.
SCRIPTS = {
    "startup": ("bench_startup.py", []),
    "loop": ("bench_loop.py", ["--steps", "2"]),
    "mfu": ("bench_mfu.py", ["--steps", "2"]),
    "dataload": ("bench_dataload.py", ["--steps", "3"]),
    "preprocess": ("bench_preprocess.py", ["--mb", "5"]),
    "fsdp": ("bench_fsdp.py", ["--steps", "1", "--only", "ddp", "fsdp"]),
    "plan": ("bench_plan.py", ["--only", "ddp 1 rank 23M", "fsdp 2 ranks 109M"]),
}


def main():
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--quick", action="store_true", help="minimal settings: checks that each script runs")
    p.add_argument("--reps", type=int, help="repetitions for every script (default: each script's own)")
    p.add_argument("--only", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS), help="scripts to run")
    a = p.parse_args()
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for name in a.only:
            script, quick = SCRIPTS[name]
            results = Path(tmp) / f"{name}.jsonl"
            args = list(quick if a.quick else [])
            reps = a.reps or (1 if a.quick else None)
            args += ["--reps", str(reps)] if reps else []
            print(f"\n## {script} {' '.join(args)}\n", flush=True)
            start = time.perf_counter()
            code = subprocess.run([sys.executable, str(HERE / script)] + args + ["--results", str(results)]).returncode
            print(f"\n({script}: {time.perf_counter() - start:.0f} s)", flush=True)
            if code:
                failed = True
                rows.append(goal(script, f"failed (exit code {code})", "-", False))
            elif results.exists():
                rows += [json.loads(line) for line in results.read_text().splitlines()]
    print("\n## Goals" + (" (--quick: a smoke test, not numbers to keep)" if a.quick else "") + "\n")
    print(goal_table(rows))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
