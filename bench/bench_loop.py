"""Framework overhead: `train --task dummy_lm` against the plain PyTorch loop
(bench/ref_loop.py) on the same shape, fp32 and bf16, in tokens/s.

Both train the same model (pre-LN GPT, learned positions, tied embeddings, GELU, AdamW
with weight decay 0.01, no dropout) on random tokens in one process with torch's default
threads. ref_loop times its steps with nothing around them and takes the median of all
but the first two; for `train` the median `wps` of the json `train_inner` records after
the first two updates, which counts everything the loop does between updates (data,
logging, meters). The contenders run interleaved (ref, ours, ref, ours, …) in one
invocation and each side's median is compared, because timings on these machines drift
±40 % run to run. Goal: ours ≥ 1.00× the reference; 0.98× is the floor.

The Llama-shaped rows do the same on a Llama of the same width, depth and heads (RMSNorm,
RoPE, SwiGLU, grouped-query attention with half the heads' keys and values, no biases, tied
embeddings), its SwiGLU's width sized so that a layer has the GPT layer's parameters:
`train --arch llama3_2_1b` at that shape against `ref_loop.py --impl llama`. Same goal.

Then, for information, both compiled: `train --compile` (each decoder layer through
torch.compile before sharding) against `ref_loop.py --compile` (its blocks compiled the
same way), in the first dtype; compilation falls in the two warm-up steps both sides drop.

Usage: python bench/bench_loop.py [--reps 3] [--steps 10] [--dtypes fp32 bf16] [--models gpt llama]
                                 [--no-compile]
"""

import os
import subprocess
import sys
from pathlib import Path

from benchlib import goal, json_records, median, note, parser, report, run_train, usable_dtypes

REF_LOOP = Path(os.environ.get("SHARDLM_REF_LOOP", Path(__file__).resolve().parent / "ref_loop.py"))
SHAPE = dict(layers=6, dim=384, heads=6, seq=256, batch=8, vocab=8192)
# The Llama at that shape: 3 key/value heads for the 6 query heads; SwiGLU's 3·1152·384
# weights and its attention's 384·(384+2·192) + 384² make the GPT layer's 12·384².
LLAMA = dict(kv_heads=3, ffn=1152)
WARMUP = 2  # ref_loop also drops its first two steps
GOAL, FLOOR = 1.00, 0.98


def run_ref(dtype, steps, compiled=False, llama=False):
    """ref_loop's printed tokens/s, model_GFLOP/s, peak_GFLOP/s and MFU."""
    s = SHAPE
    impl = ["--impl", "llama", "--kv-heads", str(LLAMA["kv_heads"]), "--ffn", str(LLAMA["ffn"])] if llama else []
    out = subprocess.run(
        [
            sys.executable,
            str(REF_LOOP),
            "--layers",
            str(s["layers"]),
            "--dim",
            str(s["dim"]),
            "--heads",
            str(s["heads"]),
            "--seq",
            str(s["seq"]),
            "--batch",
            str(s["batch"]),
            "--vocab",
            str(s["vocab"]),
            "--steps",
            str(steps),
            "--dtype",
            dtype,
        ]
        + (["--compile"] if compiled else [])
        + impl,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return {k: float(fields[k]) for k in ("tokens/s", "model_GFLOP/s", "peak_GFLOP/s", "MFU")}


def train_args(dtype, steps, llama=False):
    s = SHAPE
    if llama:  # the preset's pieces (tied, as Llama 3.2) at this shape
        model = [
            "--arch",
            "llama3_2_1b",
            "--decoder-kv-heads",
            str(LLAMA["kv_heads"]),
            "--decoder-head-dim",
            str(s["dim"] // s["heads"]),
            "--decoder-ffn-embed-dim",
            str(LLAMA["ffn"]),
        ]
    else:
        model = [
            "--decoder-ffn-embed-dim",
            str(4 * s["dim"]),
            "--share-decoder-input-output-embed",
            "--decoder-learned-pos",
            "--activation-fn",
            "gelu",
            "--dropout",
            "0",
        ]
    args = [
        "--task",
        "dummy_lm",
        "--dict-size",
        str(s["vocab"]),
        "--tokens-per-sample",
        str(s["seq"]),
        "--batch-size",
        str(s["batch"]),
        "--decoder-layers",
        str(s["layers"]),
        "--decoder-embed-dim",
        str(s["dim"]),
        "--decoder-attention-heads",
        str(s["heads"]),
        *model,
        "--optimizer",
        "adamw",
        "--lr",
        "0.0001",
        "--weight-decay",
        "0.01",  # ref's AdamW
        "--max-update",
        str(steps + WARMUP),
        "--no-save",
        "--disable-validation",
        "--log-format",
        "json",
        "--log-interval",
        "1",
    ]
    return args + (["--bf16"] if dtype == "bf16" else [])


def run_ours(dtype, steps, extra=(), llama=False):
    """(timed train_inner records, stdout) of one `train` run."""
    out = run_train(train_args(dtype, steps, llama) + list(extra))
    return json_records(out)[WARMUP:], out


def verdict(ratio):
    return True if ratio >= GOAL else ("floor only" if ratio >= FLOOR else False)


def main():
    p = parser(__doc__, reps=3)
    p.add_argument("--steps", type=int, default=10, help="timed updates per run (after 2 warm-up ones)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument(
        "--models",
        nargs="+",
        default=["gpt", "llama"],
        choices=["gpt", "llama"],
        help="gpt: the GPT shape; llama: the Llama-shaped rows",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the compiled pair (train --compile, ref --compile)")
    a = p.parse_args()
    if not REF_LOOP.exists():
        sys.exit(f"bench_loop: no reference loop at {REF_LOOP}; set SHARDLM_REF_LOOP")
    dtypes, goals = usable_dtypes(a.dtypes, "overhead")
    runs = [(dtype, False, model == "llama") for model in a.models for dtype in dtypes]
    if not a.no_compile and dtypes and "gpt" in a.models:
        runs.append((dtypes[0], True, False))
    rows = []
    for dtype, compiled, llama in runs:
        name = ("llama " if llama else "") + dtype + (" --compile" if compiled else "")
        ref, ours = [], []
        for rep in range(a.reps):
            ref.append(run_ref(dtype, a.steps, compiled, llama)["tokens/s"])
            ours.append(median(r["wps"] for r in run_ours(dtype, a.steps, ["--compile"] if compiled else [], llama)[0]))
            note(f"{name} rep {rep + 1}: ref {ref[-1]:.0f} tok/s, train {ours[-1]:.0f} tok/s")
        r, o = median(ref), median(ours)
        rows.append((name, r, o, o / r))
        if compiled:  # for information: the goal is the eager pair's
            goals.append(
                goal(
                    f"overhead {name}: train --compile / ref_loop --compile tokens/s",
                    f"{o / r:.3f}× ({o:.0f} vs {r:.0f})",
                    "(for information)",
                    None,
                )
            )
        else:
            goals.append(
                goal(
                    f"overhead {name}: train / ref_loop tokens/s",
                    f"{o / r:.3f}× ({o:.0f} vs {r:.0f})",
                    f"≥ {GOAL:.2f}× (floor {FLOOR:.2f}×)",
                    verdict(o / r),
                )
            )
    print(
        f"\nshape: {SHAPE}, llama rows: + {LLAMA}, {a.steps} timed steps, {a.reps} interleaved repetitions, medians\n"
    )
    print(f"| run | ref_loop tokens/s | train tokens/s | ratio (goal ≥ {GOAL:.2f}, floor {FLOOR:.2f}) |")
    print("|---|---|---|---|")
    for name, r, o, ratio in rows:
        print(f"| {name} | {r:.0f} | {o:.0f} | {ratio:.3f} |")
    report(goals, a.results)


if __name__ == "__main__":
    main()
