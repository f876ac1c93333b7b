"""The optimizers' speed: per --optimizer (adam, adafactor, lamb, adagrad, adamax, adadelta,
muon), tokens/s of `train` on 2 FSDP ranks and in one process, and the optimizer step's
share of the update, on the 109 M model of bench_plan.py (M109) at 256 tokens per rank.

How the step is timed: each rank runs `train` in-process under a thin wrapper
(`--as-rank`) that times `Trainer.train_step` (the whole update: forward, backward,
clipping, step; what `update.seconds` measures) and, inside it, `Trainer.step` (the
optimizer's step as the update takes it, EarlyGather's start included). On a CPU both are
synchronous, so wall time is the work. The 2 ranks are started here as torchrun would
(RANK, WORLD_SIZE, MASTER_ADDR), one thread each; the single process has both threads.
The first two updates are warm-up (the first creates the optimizer state); tokens/s is
the tokens of an update over the median of the timed updates' seconds. Contenders run
interleaved, in alternating order from one repetition to the next; medians over
repetitions. Goals, 2 ranks: Muon's update ≤ 1.25× AdamW's, Adafactor's and LAMB's ≤ 1.1×.

Usage: python bench/bench_optim.py [--reps 1] [--steps 2] [--quick]
"""

import json
import os
import socket
import subprocess
import sys
import time

from bench_plan import M109, with_optimizer

from benchlib import ROOT, goal, median, note, parser, report

OPTIMIZERS = ["adam", "adafactor", "lamb", "adagrad", "adamax", "adadelta", "muon"]
GOALS = {"muon": 1.25, "adafactor": 1.1, "lamb": 1.1}
WARMUP = 2
TOKENS = 256  # per rank per update


def flags(optimizer, steps, update_freq=1):
    model = list(M109)
    model[model.index("--batch-size") + 1] = "1"
    return with_optimizer(model, optimizer) + [
        "--update-freq",
        str(update_freq),
        "--max-update",
        str(WARMUP + steps),
        "--no-save",
        "--disable-validation",
        "--log-format",
        "none",
    ]


def as_rank(argv):
    """Run `train argv` in this process, timing each update and its optimizer step; rank 0
    prints them as one json line."""
    sys.path.insert(0, str(ROOT))
    import cli
    from trainer.train.trainer import Trainer

    times = {"update": [], "step": []}
    train_step, step = Trainer.train_step, Trainer.step

    def timed(method, key):
        def run(self, *args, **kwargs):
            start = time.perf_counter()
            out = method(self, *args, **kwargs)
            times[key].append(time.perf_counter() - start)
            return out

        return run

    Trainer.train_step, Trainer.step = timed(train_step, "update"), timed(step, "step")
    code = cli.train_main(argv)
    if os.environ.get("RANK", "0") == "0":
        print("BENCH_OPTIM " + json.dumps(times), flush=True)
    return code


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(optimizer, ranks, steps, update_freq=1):
    """(median update seconds, median step seconds) of the timed updates."""
    argv = [sys.executable, __file__, "--as-rank"] + flags(optimizer, steps, update_freq)
    cores = os.cpu_count() or 2
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, OMP_NUM_THREADS=str(max(cores // ranks, 1)))
        if ranks > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(
            subprocess.Popen(
                argv + (["--ddp-backend", "fully_sharded"] if ranks > 1 else []),
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"{optimizer} on {ranks} rank(s) failed:\n{err[-2000:]}")
    line = next(x for x in outs[0][0].splitlines() if x.startswith("BENCH_OPTIM "))
    times = json.loads(line.split(" ", 1)[1])
    return median(times["update"][WARMUP:]), median(times["step"][WARMUP:])


def main():
    if "--as-rank" in sys.argv:
        return as_rank([a for a in sys.argv[1:] if a != "--as-rank"])
    p = parser(__doc__, reps=1)
    p.add_argument("--steps", type=int, default=2, help="timed updates per run, after 2 warm-up ones")
    p.add_argument("--quick", action="store_true", help="1 timed update: a check that it runs")
    p.add_argument(
        "--update-freq",
        type=int,
        default=1,
        help="micro-batches of 256 tokens per rank per update (Newton-Schulz is a cost per update: "
        "Muon's ratio falls as an update holds more tokens)",
    )
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="which to run, comma-separated (adam first)")
    p.add_argument("--ranks-only", action="store_true", help="only the 2-rank setup")
    a = p.parse_args()
    steps = 1 if a.quick else a.steps
    optimizers = a.optimizers.split(",")
    setups = [("2 ranks", 2)] + ([] if a.ranks_only else [("1 process", 1)])
    results = {(o, label): [] for o in optimizers for label, _ in setups}
    for rep in range(a.reps):
        order = [(o, s) for o in optimizers for s in setups]
        for optimizer, (label, ranks) in order if rep % 2 == 0 else order[::-1]:
            update, step = run(optimizer, ranks, steps, a.update_freq)
            results[(optimizer, label)].append((update, step))
            note(f"rep {rep + 1} {optimizer} {label}: update {update:.2f} s, step {step:.3f} s")
    print(
        f"\n109 M parameters, {TOKENS * a.update_freq} tokens per rank per update (--update-freq {a.update_freq}), "
        f"{steps} timed updates after {WARMUP} "
        f"warm-up, {a.reps} repetition(s) interleaved, medians; × adam: that update time over adam's"
    )
    print("\n| optimizer | setup | tokens/s | update s | step s | step share | update × adam |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for label, ranks in setups:
        base = median(u for u, _ in results[("adam", label)])
        for optimizer in optimizers:
            update = median(u for u, _ in results[(optimizer, label)])
            step = median(s for _, s in results[(optimizer, label)])
            ratio = update / base
            print(
                f"| {optimizer} | {label} | {TOKENS * a.update_freq * ranks / update:.0f} | {update:.2f} | "
                f"{step:.3f} | {step / update:.0%} | {ratio:.3f} |"
            )
            if ranks == 2 and optimizer in GOALS:
                rows.append(
                    goal(
                        f"optim: {optimizer} update vs adam's, 2 CPU ranks, 109M, "
                        f"{TOKENS * a.update_freq} tokens per rank per update",
                        f"{ratio:.3f}× ({update:.2f} vs {base:.2f} s)",
                        f"≤ {GOALS[optimizer]}×",
                        ratio <= GOALS[optimizer],
                    )
                )
    report(rows, a.results)


if __name__ == "__main__":
    sys.exit(main())
