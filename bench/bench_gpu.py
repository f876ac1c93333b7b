"""One GPU, Llama 3.2 1B: `train` against a plain PyTorch loop, with and without FSDP and
--compile, and FSDP with --cpu-offload, in tokens/s, MFU, peak memory and `plan`'s prediction.

The contenders train the same model on GPU 0 of one host: `--arch llama3_2_1b` (16 layers of
width 2048, 32 query heads of width 64 sharing 8 key/value heads, SwiGLU of 8192, RMSNorm of
eps 1e-5, RoPE of theta 500000, tied embeddings, no biases) on random tokens of the Llama 3
vocabulary (`--task dummy_lm --dict-size 128256`), 2,048 tokens per sequence, bf16, AdamW:
- plain loop: bench/ref_loop.py --impl llama --device cuda, the GPU twin of bench_loop's
  reference loop: the same model in plain PyTorch under bf16 autocast, SDPA attention,
  torch's fused AdamW, nothing around it (the preset's llama3 rope scaling changes the
  rotary tables' values, not the work, and the loop leaves it out);
- train: one rank, no sharding (world size 1: the module itself, no DDP wrapper);
- train --ddp-backend fully_sharded: FSDP2 on a one-rank mesh, per-layer units;
- each of those two with --compile (every decoder layer through torch.compile);
- train --ddp-backend fully_sharded --cpu-offload: parameter shards and the optimizer step
  on the host; its step time is reported beside FSDP's on the GPU alone.
Every contender takes 8 sequences per step. The plain loop keeps a whole batch's fp32 logits
(train computes its loss a chunk at a time), so it needs the most memory of them, and that
batch still leaves it room to spare on one 141 GB H200.

Each repetition measures the bf16 matmul peak (benchlib.cuda_matmul_peak_tflops: 8192²
products in a process of its own), then runs every contender in turn (A, B, C, …, A, B, C, …);
the table holds medians over repetitions. tokens/s: ref_loop's median step after two warm-up
steps; train's median `wps` of its json train_inner records (one per update) after two
warm-up updates, where compilation falls. MFU: model FLOPs per second (PaLM's count, the same
on both sides) over that repetition's peak, which train gets as --peak-tflops and logs as
`mfu`. Peak memory: the largest `mem_gb` train logs (torch.cuda.max_memory_allocated), and
ref_loop's max_memory_allocated; beside it `plan --format json` with the same flags and this
GPU's memory, and the error of that prediction.
Goals: train ≥ 1.00× the plain loop's tokens/s; FSDP ≥ 0.95× train without it; bf16 MFU of
the FSDP row ≥ 0.45; plan within ±5 % of every measured train peak; --cpu-offload's step
time for information. On a GPU one more FSDP run counts the host synchronisations inside
its updates (from the first forward to the optimizer step, the loop's meters aside), as
torch.cuda.set_sync_debug_mode("warn") reports them: the goal is none.

--quick: a tiny Llama (2 layers of width 64, 64 tokens, one timed step, one repetition) on
the GPU if there is one, else on the CPU: a check that every row runs and the whole table
prints, not numbers. Its --compile rows trace the layers with dynamo but run them on dynamo's
eager backend (TORCH_COMPILE_OVERRIDE_BACKENDS), since inductor's code generation would take
longer than everything else together. Without --quick and without a GPU it says so in one
line and stops (exit status 0; with --results, a goal row "not run"), so that `make bench`
on a host without a GPU goes on.
A full run takes a while (compilation, the offloaded steps): --only and --reps split it.
The contenders (the shapes, each row's flags, how each runs) are bench/gpu_contenders.py's.

Usage: python bench/bench_gpu.py [--reps 3] [--steps 10] [--batch 8] [--quick]
                                 [--only ref train train+compile fsdp fsdp+compile offload]
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpu_contenders import FSDP, FULL, QUICK, RUNS, WARMUP, count_syncs, predictions, row_name, run_ours, run_ref

from benchlib import cuda_matmul_peak_tflops, goal, matmul_peak_tflops, median, note, parser, report

GOAL_TRAIN, GOAL_FSDP, GOAL_MFU, GOAL_PLAN = 1.00, 0.95, 0.45, 0.05
QUICK_COMPILE_ENV = {"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager"}


def find_gpu():
    """(bf16 matmul TFLOP/s, GiB, name) of GPU 0, or None. Where no NVIDIA device node exists
    there is no CUDA GPU to ask torch about, and the process that would ask is spared."""
    if not (Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi")):
        return None
    return peak_or_exit(cuda_matmul_peak_tflops, "bf16")


def attempt(what, fn, *args, **kwargs):
    """fn(*args) or, when its process fails, None after a note with the end of its stderr,
    so one contender running out of memory leaves the others' rows."""
    try:
        return fn(*args, **kwargs)
    except (subprocess.CalledProcessError, RuntimeError, ValueError) as e:
        tail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()[-3:]
        note(f"{what} failed: " + " / ".join(tail))
        return None


def peak_or_exit(fn, *args):
    """fn(*args), a matmul peak helper; without a peak there is no MFU: stop in one line."""
    try:
        return fn(*args)
    except subprocess.CalledProcessError as e:
        sys.exit("bench_gpu: measuring the matmul peak failed: " + " / ".join(e.stderr.strip().splitlines()[-2:]))


def measure_peak(gpu, rep):
    """This repetition's bf16 matmul peak (TFLOP/s) on the contenders' device; on a GPU the
    first repetition's is the one find_gpu measured."""
    if not gpu:
        return peak_or_exit(matmul_peak_tflops, "bf16")[0]
    return gpu[0] if rep == 0 else peak_or_exit(cuda_matmul_peak_tflops, "bf16")[0]


def measure(keys, s, a, gpu):
    """Every repetition: the peak, then each contender; {key: [result or None per rep]}, [peaks]."""
    results, peaks = {k: [] for k in keys}, []
    device = "cuda" if gpu else "cpu"
    for rep in range(a.reps):
        peak = measure_peak(gpu, rep)
        peaks.append(peak)
        for key in keys:
            if RUNS[key] is None:
                r = attempt(row_name(key), run_ref, s, device)
                if r:
                    r["mfu"] = r["tflops"] / peak
            else:
                compiled = a.quick and "--compile" in RUNS[key]
                env = {**os.environ, **QUICK_COMPILE_ENV} if compiled else None
                r = attempt(row_name(key), run_ours, s, RUNS[key], peak, env)
            results[key].append(r)
            note(
                f"rep {rep + 1}, peak {peak:.4g} TFLOP/s: {row_name(key)}: "
                + (f"{r['tps']:.0f} tokens/s, MFU {r['mfu']:.3f}, {r['mem']:.3f} GB" if r else "failed")
            )
    return results, peaks


def summarize(results, s):
    """{key: medians over the repetitions that ran (the largest memory), or None}."""
    rows = {}
    for key, reps in results.items():
        done = [r for r in reps if r]
        rows[key] = (
            None
            if not done
            else {
                "tps": median(r["tps"] for r in done),
                "tflops": median(r["tflops"] for r in done),
                "mfu": median(r["mfu"] for r in done),
                "mem": max(r["mem"] for r in done),
            }
        )
        if rows[key]:
            rows[key]["step_ms"] = s["batch"] * s["seq"] / rows[key]["tps"] * 1e3
    return rows


def goals(rows, plans, prefix, syncs=None):
    """The goal rows for the contenders that were asked for; a failed one fails its goals.
    syncs: count_syncs' (synchronisations, updates) for the FSDP row, or None (no GPU)."""
    out = []

    def pair(a, b, text, target):
        if a in rows and b in rows:
            if rows[a] and rows[b]:
                ratio = rows[a]["tps"] / rows[b]["tps"]
                out.append(
                    goal(
                        f"{prefix}: {text}",
                        f"{ratio:.3f}× ({rows[a]['tps']:.0f} vs {rows[b]['tps']:.0f})",
                        f"≥ {target:.2f}×",
                        ratio >= target,
                    )
                )
            else:
                out.append(goal(f"{prefix}: {text}", "not measured (a run failed)", f"≥ {target:.2f}×", False))

    pair("train", "ref", "train / plain loop tokens/s", GOAL_TRAIN)
    pair("fsdp", "train", "train --ddp-backend fully_sharded / train tokens/s", GOAL_FSDP)
    if "fsdp" in rows:
        r = rows["fsdp"]
        out.append(
            goal(
                f"{prefix}: bf16 MFU of train --ddp-backend fully_sharded",
                f"{r['mfu']:.3f} ({r['tflops']:.4g} TFLOP/s)" if r else "not measured (the run failed)",
                f"≥ {GOAL_MFU:.2f}",
                bool(r) and r["mfu"] >= GOAL_MFU,
            )
        )
    errors = {k: plans[k] / rows[k]["mem"] - 1 for k in plans if rows.get(k) and plans[k] is not None}
    if plans:
        worst = max(errors, key=lambda k: abs(errors[k]), default=None)
        out.append(
            goal(
                f"{prefix}: plan predicted vs measured peak memory, {len(plans)} train runs",
                f"worst {errors[worst]:+.1%} ({row_name(worst)})" if worst else "not measured (runs failed)",
                f"within ±{GOAL_PLAN:.0%}",
                bool(worst) and abs(errors[worst]) <= GOAL_PLAN and len(errors) == len(plans),
            )
        )
    if syncs is not None:
        count, updates = syncs
        out.append(
            goal(
                f"{prefix}: host synchronisations inside an update of train --ddp-backend fully_sharded "
                "(torch.cuda sync debug mode)",
                f"{count} in {updates} updates",
                "0",
                count == 0,
            )
        )
    if "offload" in rows:
        r, base = rows["offload"], rows.get("fsdp")
        measured = (
            "not measured (the run failed)"
            if not r
            else f"{r['step_ms']:.0f} ms per step"
            + (f" vs {base['step_ms']:.0f} ms without offload ({r['step_ms'] / base['step_ms']:.2f}×)" if base else "")
        )
        out.append(
            goal(
                f"{prefix}: train --ddp-backend fully_sharded --cpu-offload step time",
                measured,
                "(for information)",
                None if r else False,
            )
        )
    return out


def print_table(rows, plans):
    print("| run | tokens/s | step ms | model TFLOP/s | MFU | peak memory GB | plan GB | plan error |")
    print("|---|---|---|---|---|---|---|---|")
    for key, r in rows.items():
        if not r:
            print(f"| {row_name(key)} | failed | | | | | | |")
            continue
        plan = f"{plans[key]:.3f} | {plans[key] / r['mem'] - 1:+.1%}" if plans.get(key) is not None else "- | -"
        print(
            f"| {row_name(key)} | {r['tps']:.0f} | {r['step_ms']:.1f} | {r['tflops']:.4g} | {r['mfu']:.3g} "
            f"| {r['mem']:.3f} | {plan} |"
        )


def main():
    p = parser(__doc__, reps=None)
    p.add_argument(
        "--steps",
        type=int,
        help="timed updates per run, after as many warm-up ones in train "
        f"({WARMUP} in the plain loop) (default {FULL['steps']}; --quick {QUICK['steps']})",
    )
    p.add_argument("--batch", type=int, help=f"sequences per step (default {FULL['batch']}; --quick {QUICK['batch']})")
    p.add_argument(
        "--only",
        nargs="+",
        choices=list(RUNS),
        default=list(RUNS),
        metavar="RUN",
        help=f"contenders to run, of: {' '.join(RUNS)} (a goal needs the rows it compares)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny Llama, one timed step, one repetition, on the GPU or else the CPU: a smoke test",
    )
    a = p.parse_args()
    if any(v is not None and v < 1 for v in (a.reps, a.steps, a.batch)):
        p.error("--reps, --steps and --batch must be at least 1")
    a.reps = a.reps or (1 if a.quick else 3)
    s = dict(QUICK if a.quick else FULL)
    s.update({k: v for k, v in (("steps", a.steps), ("batch", a.batch)) if v})
    gpu = find_gpu()
    if gpu is None and not a.quick:
        # Not a failure: `make bench` on a host without a GPU records the row "not run" and goes on.
        why = "needs a CUDA GPU and there is none here (--quick runs a tiny shape on this CPU)"
        if a.results:
            with open(a.results, "a") as f:
                f.write(json.dumps(goal("gpu: the one-GPU benchmark", "not run", why, "not measured")) + "\n")
        print(f"bench_gpu: {why}", file=sys.stderr)
        return
    keys = [k for k in RUNS if k in a.only]  # running order, whatever the order asked
    plans = predictions(s, keys, gpu[1] if gpu else None)
    results, peaks = measure(keys, s, a, gpu)
    rows = summarize(results, s)
    device = f"{gpu[2]} ({gpu[1]:.1f} GiB)" if gpu else "this CPU (no GPU)"
    print(
        f"\n{'--quick, a tiny shape: ' if a.quick else ''}--arch llama3_2_1b at {s['layers']} layers x {s['dim']}, "
        f"{s['heads']} heads ({s['kv_heads']} key/value), ffn {s['ffn']}, vocabulary {s['vocab']}; "
        f"{s['batch']} x {s['seq']} tokens per step, bf16; on {device}; bf16 matmul peak {median(peaks):.4g} "
        f"TFLOP/s; {s['steps']} timed step(s) per run, {a.reps} interleaved repetition(s), medians"
        + ("; --compile rows on dynamo's eager backend" if a.quick else "")
        + "\n"
    )
    print_table(rows, plans)
    syncs = attempt("counting host synchronisations", count_syncs, s, FSDP) if gpu and "fsdp" in keys else None
    report(goals(rows, plans, "gpu --quick" if a.quick else "gpu", syncs), a.results)
    if any(r is None for r in rows.values()) or any(v is None for v in plans.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
