"""Data loading during training: how long the training loop waits for its next batch,
as a share of the time its update takes.

`train` runs in this process, through the same entry point as the console script
(`cli.train_main`) on the embedded corpus (memory-mapped token files, token blocks,
collation: the real path), with two wrappers and nothing else changed: every batch the
loop takes from the epoch's batch iterator (`EpochBatchIterator.next_epoch_itr()`) is
timed around its `next()`, and every `Trainer.train_step` (forward, backward, optimizer
step of one update) is timed. Batches are loaded by `--num-workers` processes (default 1,
as `train` runs), so the `next()` time is exactly what the loop waits for them. The first
epoch's batch list is built before the loop, by
`len(itr)`: it is a one-off per epoch and not counted. Share = Σ waits / Σ step times over
the updates after two warm-up ones, --update-freq 1, no validation. Two shapes: `make
demo`'s model (4 × 128, 128 tokens × 8 sequences: the short step where loading weighs
most) and bench_loop.py's (6 × 384, 256 × 8). Repetitions alternate the shapes; medians.
Goal: ≤ 2 % for each.

Usage: python bench/bench_dataload.py [--reps 3] [--steps 20] [--bf16]
"""

import contextlib
import io
import sys
import time

from benchlib import ROOT, goal, median, note, parser, report

sys.path.insert(0, str(ROOT))
COMMON = [
    "--dropout",
    "0",
    "--attention-dropout",
    "0",
    "--batch-size",
    "8",
    "--optimizer",
    "adam",
    "--lr",
    "0.0005",
    "--no-save",
    "--disable-validation",
    "--log-format",
    "json",
    "--log-interval",
    "1",
]
SHAPES = {
    "demo model": [
        "--arch",
        "transformer_lm_gpt2_tiny",
        "--decoder-layers",
        "4",
        "--decoder-embed-dim",
        "128",
        "--decoder-ffn-embed-dim",
        "512",
        "--decoder-attention-heads",
        "4",
        "--share-decoder-input-output-embed",
        "--tokens-per-sample",
        "128",
    ],
    "bench_loop shape": [
        "--decoder-layers",
        "6",
        "--decoder-embed-dim",
        "384",
        "--decoder-ffn-embed-dim",
        "1536",
        "--decoder-attention-heads",
        "6",
        "--share-decoder-input-output-embed",
        "--decoder-learned-pos",
        "--activation-fn",
        "gelu",
        "--tokens-per-sample",
        "256",
    ],
}
WARMUP = 2
GOAL = 0.02


@contextlib.contextmanager
def timed_training(waits, steps):
    """Record each next() on the training batch iterator and each train_step, in seconds."""
    from data.iterator import EpochBatchIterator
    from trainer.train.trainer import Trainer

    next_epoch_itr, train_step = EpochBatchIterator.next_epoch_itr, Trainer.train_step

    def timed_batches(itr):
        while True:
            start = time.perf_counter()
            try:
                batch = next(itr)
            except StopIteration:
                return
            waits.append(time.perf_counter() - start)
            yield batch

    def timed_next_epoch_itr(self):
        return timed_batches(next_epoch_itr(self))

    def timed_train_step(self, samples):
        start = time.perf_counter()
        stats = train_step(self, samples)
        steps.append(time.perf_counter() - start)
        return stats

    EpochBatchIterator.next_epoch_itr, Trainer.train_step = timed_next_epoch_itr, timed_train_step
    try:
        yield
    finally:
        EpochBatchIterator.next_epoch_itr, Trainer.train_step = next_epoch_itr, train_step


def measure(argv):
    """(Σ wait, Σ step) over the timed updates of one in-process `train ARGV` run."""
    import cli

    waits, steps, log = [], [], io.StringIO()
    with timed_training(waits, steps), contextlib.redirect_stdout(log):
        code = cli.train_main(argv)
    if code or len(steps) <= WARMUP:
        sys.exit(f"bench_dataload: train {' '.join(argv)} failed ({code}):\n{log.getvalue()[-2000:]}")
    assert len(waits) == len(steps), "one batch per update at --update-freq 1"
    return sum(waits[WARMUP:]), sum(steps[WARMUP:]), len(steps) - WARMUP


def main():
    p = parser(__doc__, reps=3)
    p.add_argument("--steps", type=int, default=20, help="timed updates per run (after 2 warm-up ones)")
    p.add_argument("--bf16", action="store_true", help="train in bf16 (shorter steps where the CPU has bf16)")
    a = p.parse_args()
    extra = COMMON + ["--max-update", str(a.steps + WARMUP)] + (["--bf16"] if a.bf16 else [])
    runs = {name: [] for name in SHAPES}
    for rep in range(a.reps):
        for name, shape in SHAPES.items():
            wait, step, n = measure(shape + extra)
            runs[name].append((wait, step, n))
            note(
                f"rep {rep + 1} {name}: {n} updates, wait {1e3 * wait / n:.2f} ms, step {1e3 * step / n:.1f} ms "
                f"per update: {100 * wait / step:.2f} %"
            )
    print(
        f"\nembedded corpus, batch 8, {a.steps} timed updates, {'bf16' if a.bf16 else 'fp32'}, "
        f"{a.reps} alternating repetitions, medians\n"
    )
    print("| shape | wait per update ms | step ms | wait / step |")
    print("|---|---|---|---|")
    goals = []
    for name, rs in runs.items():
        share = median(w / s for w, s, _ in rs)
        print(
            f"| {name} | {median(1e3 * w / n for w, _, n in rs):.2f} | {median(1e3 * s / n for _, s, n in rs):.1f} "
            f"| {100 * share:.2f} % |"
        )
        goals.append(
            goal(
                f"data loading: wait / step time ({name})",
                f"{100 * share:.2f} %",
                f"≤ {100 * GOAL:.0f} %",
                share <= GOAL,
            )
        )
    report(goals, a.results)


if __name__ == "__main__":
    main()
