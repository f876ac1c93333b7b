"""What the bench scripts share: running `train`, reading its json records, medians, the
matmul peak, and the goal rows that `bench/run_all.py` gathers into one table.

Each script prints its own table of medians, then its goal rows (benchmark, measured,
goal, met?); with `--results FILE` it also appends those rows to FILE as json lines.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # train, preprocess: console scripts of the same venv


def parser(doc, reps):
    """An argument parser with the options every bench script takes."""
    p = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    p.add_argument("--reps", type=int, default=reps, help="interleaved repetitions (medians are reported)")
    p.add_argument("--results", help="append the goal rows to this file as json lines (run_all.py)")
    return p


def median(values):
    return statistics.median(values)


def json_records(stdout, tag="train_inner"):
    """`train --log-format json` records of one tag; the object runs from the first `{` to the line end."""
    return [json.loads(line[line.index("{") :]) for line in stdout.splitlines() if f"| {tag} |" in line]


def run_train(argv, **kwargs):
    """`train ARGV` in a subprocess, as users run it; returns its stdout."""
    return subprocess.run(
        [str(BIN / "train")] + list(argv), check=True, capture_output=True, text=True, cwd=ROOT, **kwargs
    ).stdout


# The same measurement as bench/ref_loop.py's: 2 warm-up products of two
# 2048x2048 matrices, then 5 timed ones, in a fresh process with the given thread count.
_MATMUL = """
import sys, time, torch
dtype, threads = sys.argv[1], int(sys.argv[2])
if threads: torch.set_num_threads(threads)
dt = torch.bfloat16 if dtype == "bf16" else torch.float32
A, B = torch.randn(2048, 2048, dtype=dt), torch.randn(2048, 2048, dtype=dt)
for _ in range(2): A @ B
t = time.perf_counter()
for _ in range(5): A @ B
print(2 * 2048 ** 3 * 5 / (time.perf_counter() - t) / 1e12, torch.get_num_threads())
"""


def matmul_peak_tflops(dtype, threads=0):
    """(TFLOP/s, threads used) of a 2048² matmul in `dtype`; threads=0: torch's default."""
    out = subprocess.run(
        [sys.executable, "-c", _MATMUL, dtype, str(threads)], check=True, capture_output=True, text=True
    ).stdout.split()
    return float(out[0]), int(out[1])


# The GPU's counterpart: products of two 8192² matrices (a 2048² one is over too soon to
# keep a GPU busy), 10 warm-up and 50 timed, between synchronizations, on GPU 0 in a fresh
# process; it also names the device and its memory. "none" when torch there sees no GPU.
_CUDA_MATMUL = """
import sys, time, torch
if not torch.cuda.is_available():
    print("none"); sys.exit()
dtype, size = sys.argv[1], int(sys.argv[2])
dt = torch.bfloat16 if dtype == "bf16" else torch.float32
A, B = (torch.randn(size, size, dtype=dt, device="cuda") for _ in range(2))
for _ in range(10): A @ B
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(50): A @ B
torch.cuda.synchronize()
props = torch.cuda.get_device_properties(0)
print(2 * size ** 3 * 50 / (time.perf_counter() - t) / 1e12, props.total_memory / 2 ** 30, props.name)
"""


def cuda_matmul_peak_tflops(dtype="bf16", size=8192):
    """(TFLOP/s, device memory in GiB, device name) of size² matmuls in `dtype` on GPU 0,
    or None when torch sees no GPU. Run in a process of its own, so the caller holds no
    CUDA context and the `train` runs after it have the whole device."""
    out = subprocess.run(
        [sys.executable, "-c", _CUDA_MATMUL, dtype, str(size)], check=True, capture_output=True, text=True
    ).stdout.strip()
    if out == "none":
        return None
    tflops, memory, name = out.split(maxsplit=2)
    return float(tflops), float(memory), name


_BF16_PROBE = """
import time, torch
def rate(dt):
    A, B = torch.randn(256, 256, dtype=dt), torch.randn(256, 256, dtype=dt)
    A @ B
    t = time.perf_counter()
    for _ in range(3): A @ B
    return 3 / (time.perf_counter() - t)
print(rate(torch.bfloat16) / rate(torch.float32))
"""


def bf16_unsupported():
    """Why bf16 runs are skipped here, or None. CPUs without bf16 instructions (AVX512-BF16,
    AMX) multiply bf16 matrices through a slow fallback — a bf16 step then takes minutes,
    and its MFU measures the fallback, not the trainer. Probed with a 256² matmul."""
    import torch

    if torch.cuda.is_available():
        return None
    ratio = float(
        subprocess.run([sys.executable, "-c", _BF16_PROBE], check=True, capture_output=True, text=True).stdout
    )
    if ratio < 0.5:
        return f"this CPU has no bf16 matmul kernels (bf16 ran at {ratio:.3f}x fp32's speed)"
    return None


def usable_dtypes(dtypes, what):
    """`dtypes` without bf16 where it cannot run at speed, with goal rows saying so."""
    why = bf16_unsupported() if "bf16" in dtypes else None
    if why is None:
        return list(dtypes), []
    note(f"{what}: skipping bf16: {why}")
    return [d for d in dtypes if d != "bf16"], [goal(f"{what} bf16", "not run", why, "not measured")]


def goal(benchmark, measured, goal_text, met):
    """One row of the combined table; met is True, False, None (no goal) or a word."""
    if met is True or met is False:
        met = "yes" if met else "**no**"
    return {"benchmark": benchmark, "measured": measured, "goal": goal_text, "met": met or "-"}


def goal_table(rows):
    lines = ["| benchmark | measured | goal | met? |", "|---|---|---|---|"]
    lines += [f"| {r['benchmark']} | {r['measured']} | {r['goal']} | {r['met']} |" for r in rows]
    return "\n".join(lines)


def report(rows, results_file=None):
    """Print the goal rows; append them to results_file for run_all.py."""
    print("\n" + goal_table(rows))
    if results_file:
        with open(results_file, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def note(text):
    """Progress lines go to stderr, so stdout is the tables alone."""
    print(text, file=sys.stderr, flush=True)
