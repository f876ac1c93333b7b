"""FSDP against DDP on 2 local ranks, on a model whose optimizer state dominates memory
(≈109 M parameters, 512 tokens per rank per update): tokens/s and per-rank peak memory.

Contenders run interleaved in one invocation, several repetitions, in alternating order
(ddp, fsdp, …, then …, fsdp, ddp): this machine's speed drifts by 10-20 % over minutes,
and a fixed order would charge the drift to whichever contender always runs later.
`mem_gb` is rank 0's peak resident set size on CPU (the ranks are symmetric), CUDA's peak
allocation on GPU; tokens/s is the median `wps` of the json records after two warm-up
updates. A contender's "× DDP" is the median over repetitions of its tokens/s divided by
DDP's in the same repetition (paired: both ran minutes apart, not a whole run apart).
Goal, for plain FSDP: ≥ 0.95× DDP's tokens/s with ≤ 0.60× its per-rank peak memory; the
flag variants are shown against DDP for information.

Usage: python bench/bench_fsdp.py [--reps 4] [--steps 4] [--only ddp fsdp …]
"""
from benchlib import goal, json_records, median, note, parser, report, run_train

MODEL = ["--task", "dummy_lm", "--dict-size", "32768", "--tokens-per-sample", "256", "--batch-size", "2",
         "--decoder-layers", "6", "--decoder-embed-dim", "1024", "--decoder-ffn-embed-dim", "4096",
         "--decoder-attention-heads", "16", "--share-decoder-input-output-embed", "--decoder-learned-pos",
         "--activation-fn", "gelu", "--dropout", "0", "--attention-dropout", "0", "--optimizer", "adam",
         "--lr", "0.0001", "--no-save", "--log-format", "json", "--log-interval", "1",
         "--distributed-world-size", "2"]
FSDP = ["--ddp-backend", "fully_sharded"]
CONTENDERS = {
    "ddp": ["--ddp-backend", "pytorch_ddp"],
    "fsdp": FSDP,
    "fsdp --no-reshard-after-forward": FSDP + ["--no-reshard-after-forward"],
    "fsdp --cpu-offload": FSDP + ["--cpu-offload"],
    "fsdp --checkpoint-activations": FSDP + ["--checkpoint-activations"],
    "fsdp --update-freq 4": FSDP + ["--update-freq", "4"],
}
WARMUP = 2
GOAL_SPEED, GOAL_MEMORY = 0.95, 0.60


def run(extra, steps):
    """(median tokens/s after warm-up, peak GB of rank 0) of one 2-rank run."""
    records = json_records(run_train(MODEL + extra + ["--max-update", str(steps + WARMUP)]))
    return median(r["wps"] for r in records[WARMUP:]), max(r["mem_gb"] for r in records)


def main():
    p = parser(__doc__, reps=4)
    p.add_argument("--steps", type=int, default=4, help="timed updates per run (after 2 warm-up ones)")
    p.add_argument("--only", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS), metavar="NAME",
                   help=f"contenders to run, of: {', '.join(CONTENDERS)}")
    a = p.parse_args()
    results = {name: ([], []) for name in a.only}
    for rep in range(a.reps):
        for name in (a.only if rep % 2 == 0 else a.only[::-1]):
            wps, mem = run(CONTENDERS[name], a.steps)
            results[name][0].append(wps)
            results[name][1].append(mem)
            note(f"rep {rep + 1} {name}: {wps:.0f} tokens/s, {mem:.2f} GB")
    ddp_wps = median(results["ddp"][0]) if "ddp" in results else None
    ddp_mem = median(results["ddp"][1]) if "ddp" in results else None
    if ddp_wps:
        note("tokens/s per repetition: " + "; ".join(
            f"{name} {' '.join(f'{w:.0f}' for w in wps)}" for name, (wps, _) in results.items()))
    print(f"\n2 ranks, 109 M parameters, 512 tokens per rank per update, {a.steps} timed updates, "
          f"{a.reps} interleaved repetitions in alternating order, medians; × DDP: median of the "
          "per-repetition ratios\n")
    print(f"| backend | tokens/s | × DDP (goal ≥ {GOAL_SPEED}) | peak GB per rank | × DDP (goal ≤ {GOAL_MEMORY}) |")
    print("|---|---|---|---|---|")
    goals = []
    for name, (wps, mem) in results.items():
        w, m = median(wps), median(mem)
        speed = median(x / d for x, d in zip(wps, results["ddp"][0])) if ddp_wps else None
        rw = f"{speed:.3f}" if speed is not None else "-"
        rm = f"{m / ddp_mem:.3f}" if ddp_mem else "-"
        print(f"| {name} | {w:.0f} | {rw} | {m:.2f} | {rm} |")
        if not ddp_wps or name == "ddp":
            continue
        plain = name == "fsdp"
        goals.append(goal(f"{name} vs DDP, 2 ranks: tokens/s", f"{rw}× ({w:.0f} vs {ddp_wps:.0f})",
                          f"≥ {GOAL_SPEED}×" if plain else "(info)", speed >= GOAL_SPEED if plain else None))
        goals.append(goal(f"{name} vs DDP, 2 ranks: peak memory per rank", f"{rm}× ({m:.2f} vs {ddp_mem:.2f} GB)",
                          f"≤ {GOAL_MEMORY}×" if plain else "(info)", m / ddp_mem <= GOAL_MEMORY if plain else None))
    report(goals, a.results)


if __name__ == "__main__":
    main()
