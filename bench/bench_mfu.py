"""Utilization: model TFLOP/s and MFU of `train` and of the plain loop
(bench/ref_loop.py), against a matmul peak measured in the same run.

Same shape and contenders as bench_loop.py. FLOPs per token are counted the same way on
both sides (PaLM appendix B: 6·non-embedding params + 6·V·d + 12·L·d·T). The peak is
ref_loop's own measurement: a 2048² matmul in the training dtype, 2 warm-up and 5 timed
products, here in a fresh process with the thread count that `train` reports using
("N threads per rank"), taken just before each `train` run and passed to it as
`--peak-tflops`, so its records carry `mfu`; ours is the median `mfu` of the records after
two warm-up updates (wall time between records, everything included). ref_loop measures
its peak after its own steps in its own process and prints its MFU; that is reported as
printed. Each repetition runs peak, train, ref in turn; medians over repetitions.
Goal: bf16 MFU of `train` ≥ 0.55 (the issue puts the plain loop at about 0.47–0.54; on an
AVX512-BF16 host here it reached 0.38–0.47 against a 0.80–0.98 TFLOP/s peak; train 0.58–0.68).

The Llama-shaped row (bench_loop.py's: RoPE, SwiGLU, grouped-query attention, the same
width, depth and parameters per layer) runs in the same repetitions, against the same
peak; its FLOPs are counted the same way (the attention's 12·L·H·head_dim·T: every query
head still sees every key). Goal: its MFU within 10 % of the GPT row's (≥ 0.90× it).

Usage: python bench/bench_mfu.py [--reps 3] [--steps 10] [--dtypes fp32 bf16] [--models gpt llama]
"""

import re
import sys

from bench_loop import LLAMA, REF_LOOP, SHAPE, run_ours, run_ref

from benchlib import goal, matmul_peak_tflops, median, note, parser, report, usable_dtypes

GOAL_DTYPE, GOAL_MFU = "bf16", 0.55
LLAMA_GOAL = 0.90  # the Llama row's MFU over the GPT row's


def measure(dtype, steps, threads, llama=False, peak=None):
    """One interleaved repetition: the peak (unless given), then train with it, then ref_loop."""
    if peak is None:
        peak, used = matmul_peak_tflops(dtype, threads)
    else:
        peak, used = peak
    records, out = run_ours(dtype, steps, ["--peak-tflops", f"{peak:.6g}"], llama)
    train_threads = int(re.search(r"(\d+) threads per rank", out).group(1))
    if train_threads != used:
        note(f"warning: peak measured on {used} threads, train used {train_threads}")
    ref = run_ref(dtype, steps, llama=llama)
    return {
        "peak": peak,
        "threads": train_threads,
        "used": used,
        "ours_tflops": median(r["tflops"] for r in records),
        "ours_mfu": median(r["mfu"] for r in records),
        "ref_tflops": ref["model_GFLOP/s"] / 1e3,
        "ref_peak": ref["peak_GFLOP/s"] / 1e3,
        "ref_mfu": ref["MFU"],
    }


def main():
    p = parser(__doc__, reps=3)
    p.add_argument("--steps", type=int, default=10, help="timed updates per run (after 2 warm-up ones)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=0, help="threads for the peak (default: torch's, as train)")
    p.add_argument(
        "--models",
        nargs="+",
        default=["gpt", "llama"],
        choices=["gpt", "llama"],
        help="gpt: the GPT shape; llama: the Llama-shaped row (its goal needs both)",
    )
    a = p.parse_args()
    if not REF_LOOP.exists():
        sys.exit(f"bench_mfu: no reference loop at {REF_LOOP}; set SHARDLM_REF_LOOP")
    dtypes, goals = usable_dtypes(a.dtypes, "utilization")
    rows = []
    for dtype in dtypes:
        reps = {model: [] for model in a.models}
        for rep in range(a.reps):
            peak = None  # measured before the first model's run, shared by the second
            for model in a.models:
                reps[model].append(measure(dtype, a.steps, a.threads, model == "llama", peak))
                m = reps[model][-1]
                peak = (m["peak"], m["used"])
                note(
                    f"{model} {dtype} rep {rep + 1}: peak {m['peak']:.3f} TFLOP/s on {m['threads']} threads; train "
                    f"{m['ours_tflops']:.3f} TFLOP/s MFU {m['ours_mfu']:.3f}; ref {m['ref_tflops']:.3f} TFLOP/s "
                    f"MFU {m['ref_mfu']:.3f}"
                )
        meds = {model: {k: median(m[k] for m in ms) for k in ms[0]} for model, ms in reps.items()}
        rows += [(model, dtype, med) for model, med in meds.items()]
        if "gpt" in meds:
            med = meds["gpt"]
            goal_text, met = ("-", None)
            if dtype == GOAL_DTYPE:
                goal_text, met = f"≥ {GOAL_MFU:.2f}", med["ours_mfu"] >= GOAL_MFU
            goals.append(
                goal(
                    f"utilization {dtype}: train MFU (ref_loop {med['ref_mfu']:.3f})",
                    f"{med['ours_mfu']:.3f} ({med['ours_tflops']:.3f} of {med['peak']:.3f} TFLOP/s)",
                    goal_text,
                    met,
                )
            )
        if "llama" in meds:
            med = meds["llama"]
            if "gpt" in meds:
                ratio = med["ours_mfu"] / meds["gpt"]["ours_mfu"]
                goals.append(
                    goal(
                        f"utilization {dtype}: Llama-shaped train MFU over the GPT row's "
                        f"(ref_loop llama {med['ref_mfu']:.3f})",
                        f"{ratio:.3f}× ({med['ours_mfu']:.3f} vs {meds['gpt']['ours_mfu']:.3f})",
                        f"≥ {LLAMA_GOAL:.2f}×",
                        ratio >= LLAMA_GOAL,
                    )
                )
            else:
                goals.append(
                    goal(
                        f"utilization {dtype}: Llama-shaped train MFU",
                        f"{med['ours_mfu']:.3f}",
                        "(the GPT row is needed for the goal)",
                        None,
                    )
                )
    print(
        f"\nshape: {SHAPE}, llama: + {LLAMA}, {a.steps} timed steps, {a.reps} interleaved repetitions, medians; "
        f"peak = 2048² matmul in the dtype\n"
    )
    print(
        "| model | dtype | threads | peak TFLOP/s | train TFLOP/s | train MFU | ref peak TFLOP/s | ref TFLOP/s "
        "| ref MFU |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model, dtype, m in rows:
        print(
            f"| {model} | {dtype} | {m['threads']:.0f} | {m['peak']:.3f} | {m['ours_tflops']:.3f} "
            f"| {m['ours_mfu']:.3f} | {m['ref_peak']:.3f} | {m['ref_tflops']:.3f} | {m['ref_mfu']:.3f} |"
        )
    report(goals, a.results)


if __name__ == "__main__":
    main()
