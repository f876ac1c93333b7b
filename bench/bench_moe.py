"""A mixture of experts against a dense model with the same active parameters: tokens/s of
`train` on 2 ranks, the mixture with its experts split over both (--expert-parallel-size 2,
FSDP for the rest), the dense model under FSDP.

Both are Llama-shaped (RMSNorm, RoPE, SwiGLU, grouped-query attention) of the same width,
depth and attention. The mixture's layers route each token to 2 of 8 experts of width F; the
dense layers' SwiGLU is 2F wide: a token runs the same feed-forward weights in both (3·d·2F),
and the mixture holds 4x as many. What the mixture adds is its routing, the sort of the
tokens by expert, the per-expert matmuls (one grouped matmul on a GPU) and the two
all-to-alls of its tokens per layer. The contenders run interleaved, each side's median of
the json `train_inner` wps after the first two records is compared. Goal: the mixture ≥ 0.5×
the dense model's tokens/s.

Usage: python bench/bench_moe.py [--reps 3] [--steps 12]
"""

from benchlib import goal, json_records, median, note, parser, report, run_train

SHAPE = ["--arch", "llama3_2_1b", "--decoder-layers", "4", "--decoder-embed-dim", "256"]
SHAPE += ["--decoder-attention-heads", "4", "--decoder-kv-heads", "2", "--dict-size", "8192"]
F = 256
CONTENDERS = {
    "dense (FSDP 2)": ["--decoder-ffn-embed-dim", str(2 * F)],
    "mixture (EP 2)": ["--moe-expert-count", "8", "--moe-top-k", "2", "--moe-ffn-embed-dim", str(F)]
    + ["--moe-aux-loss-coef", "0.01", "--expert-parallel-size", "2"],
}
GOAL = 0.5


def tokens_per_second(extra, steps):
    argv = SHAPE + extra + ["--task", "dummy_lm", "--dataset-size", "100000", "--tokens-per-sample", "256"]
    argv += ["--batch-size", "8", "--optimizer", "adam", "--lr", "0.001", "--max-update", str(steps)]
    argv += ["--ddp-backend", "fully_sharded", "--distributed-world-size", "2", "--log-format", "json"]
    argv += ["--log-interval", "1", "--no-save", "--disable-validation"]
    records = json_records(run_train(argv))
    return median([r["wps"] for r in records[2:]])


def main():
    a = parser(__doc__, reps=3)
    a.add_argument("--steps", type=int, default=12)
    a = a.parse_args()
    rates = {name: [] for name in CONTENDERS}
    for rep in range(a.reps):
        for name, extra in CONTENDERS.items():
            rates[name].append(tokens_per_second(extra, a.steps))
            note(f"rep {rep + 1}: {name} {rates[name][-1]:.0f} tok/s")
    dense, mixture = (median(rates[name]) for name in CONTENDERS)
    print("| model | tokens/s (median) |\n|---|---|")
    for name in CONTENDERS:
        print(f"| {name} | {median(rates[name]):.0f} |")
    ratio = mixture / dense
    report(
        [goal("MoE (EP 2) vs dense, same active parameters", f"{ratio:.2f}x", f">= {GOAL}x", ratio >= GOAL)],
        a.results,
    )


if __name__ == "__main__":
    main()
