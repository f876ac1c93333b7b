"""The largest model each backend trains on 2 CPU ranks within one memory budget for the
whole job: DDP, FSDP, and FSDP with --checkpoint-activations. Goal: FSDP trains ≥ 1.8×
DDP's parameters in the same memory.

The models are one family of GPT-style shapes (transformer_lm, pre-LN, gelu, learned
positions, tied embeddings, a 50257-token vocabulary): size h has h layers of width 64·h,
h heads of 64 and a feed-forward of 4·64·h, so depth grows with width at a fixed
ratio. Each trains in fp32 with Adam, one sequence of 512 random tokens per rank
(`--task dummy_lm`), for a few updates (the optimizer state exists from the second).

The planner sizes the candidates: `plan --cpu --format json` predicts a rank's peak, and
its `host_gb` (per rank × ranks on the host) is the job's. Each pick is the largest size,
between the largest confirmed within the budget and the smallest measured over it, whose
predicted job times a calibration fits the budget; `train` then runs it. The calibration
is the last run's measured job over its predicted one (for a backend's first pick, the
previous backend's last, when above 1; else 1). The search ends when no size is left to
pick (the next size up is measured, or predicted, over the budget) or after --trials runs.

The job's memory (bench/job_memory.py) is the sum, over every process of the job (the launcher, the server the
ranks are forked from, the ranks, any process they start), of its proportional set size
(Pss, /proc/PID/smaps_rollup); the measured peak is the largest sum sampled. Pss, not the
resident set size: the ranks are forks of one server that imported torch, so each rank's
RSS counts the shared library pages again, and a sum of RSS counts them once per process;
Pss splits each shared page among the processes that map it, so the sum counts every page
once — the physical memory the job holds, what a cgroup's memory limit charges (page cache
aside). The kernel walks every page table for Pss, so it is read every --interval seconds
only while that costs under a tenth of one core (a large job: every few seconds); between
reads, the processes' RSS (cheap) less the pages the last read found counted twice stands
in, and a job that seems past the budget is read at once. Sparse reads suffice because the
caching host allocator keeps the pages a rank frees: from the update that first holds the
optimizer state (the 2nd) to the end, the job stays at its peak, and the updates after it
(hence at least 3) give the reads time to see it. A run is stopped, and counted as
over, as soon as a read exceeds the budget. Beside it each rank's own peak RSS (VmHWM, the
kernel's exact high-water mark, read every --interval seconds; train resets it only at a
log record, and these runs log once, at the end) is compared with the planner's per-rank
prediction, the figure train logs as mem_gb and bench_plan.py checks.

Usage: python bench/bench_scale.py [--budget-gb 20] [--updates 3] [--trials 3]
                                   [--only ddp fsdp "fsdp --checkpoint-activations"]
"""

import json
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache

from job_memory import run_job

from benchlib import BIN, ROOT, goal, json_records, note, parser, report

VOCAB, SEQ, HEAD = 50257, 512, 64
BACKENDS = {
    "ddp": ["--ddp-backend", "pytorch_ddp"],
    "fsdp": ["--ddp-backend", "fully_sharded"],
    "fsdp --checkpoint-activations": ["--ddp-backend", "fully_sharded", "--checkpoint-activations"],
}
GOAL_RATIO = 1.8  # FSDP's largest model over DDP's, in parameters
LARGEST = 256  # sizes searched: 1 .. LARGEST (width 16384); the budget ends the search far sooner


def model(size):
    """Size h of the family: h layers of width 64·h (h heads of 64), feed-forward 4·64·h."""
    dim = HEAD * size
    return [
        "--cpu",
        "--task",
        "dummy_lm",
        "--dict-size",
        str(VOCAB),
        "--tokens-per-sample",
        str(SEQ),
        "--batch-size",
        "1",
        "--decoder-layers",
        str(size),
        "--decoder-embed-dim",
        str(dim),
        "--decoder-ffn-embed-dim",
        str(4 * dim),
        "--decoder-attention-heads",
        str(size),
        "--share-decoder-input-output-embed",
        "--decoder-learned-pos",
        "--activation-fn",
        "gelu",
        "--dropout",
        "0",
        "--attention-dropout",
        "0",
        "--optimizer",
        "adam",
        "--lr",
        "0.0001",
        "--distributed-world-size",
        "2",
    ]


def shape(size):
    return f"{size} x {HEAD * size}"


@lru_cache(maxsize=None)
def predicted(backend, size):
    """plan's json for this size: params, per_rank_gb, host_gb (the job: per rank x ranks)."""
    done = subprocess.run(
        [str(BIN / "plan"), "--format", "json"] + model(size) + BACKENDS[backend],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode:
        sys.exit(f"bench_scale: plan failed for {backend} {shape(size)}: {done.stderr.strip()}")
    return json.loads(done.stdout)


@dataclass
class Run:
    backend: str
    size: int
    params: int
    predicted_job: float  # GB
    predicted_rank: float
    job: float  # measured: the largest sampled sum of Pss, GB
    rank: float  # measured: the largest process's peak RSS, GB
    updates: int
    seconds: float
    stopped: bool  # stopped for going over the budget

    def fits(self, budget):
        return not self.stopped and self.job <= budget


def confirm(backend, size, a):
    """Train one size for a.updates updates (a.reps times), measuring the job's memory."""
    plan = predicted(backend, size)
    argv = (
        model(size)
        + BACKENDS[backend]
        + [
            "--max-update",
            str(a.updates),
            "--no-save",
            "--disable-validation",
            "--log-format",
            "json",
            # one record, at the end: a record resets the ranks' VmHWM (train's mem_gb)
            "--log-interval",
            str(a.updates + 1),
            "--num-workers",
            "0",
        ]
    )  # random tokens need no reader process
    job = rank = seconds = 0.0
    updates, stopped = 0, False
    for _ in range(a.reps):  # memory does not drift: the largest of the repetitions counts
        stdout, j, r, s, sec = run_job(argv, a.budget_gb, a.interval, a.timeout)
        summary = json_records(stdout, "train")
        updates = summary[-1]["train_num_updates"] if summary else 0
        job, rank, stopped, seconds = max(job, j), max(rank, r), stopped or s, sec
        if stopped:
            break
    run = Run(backend, size, plan["params"], plan["host_gb"], plan["per_rank_gb"], job, rank, updates, seconds, stopped)
    note(
        f"{backend} {shape(size)} ({run.params / 1e6:.0f} M): predicted job {run.predicted_job:.2f} GB, "
        f"measured {'> ' if stopped else ''}{job:.2f} GB ({'stopped: over' if stopped else updates} "
        f"{'the budget' if stopped else 'updates'}), largest rank {rank:.2f} GB vs {run.predicted_rank:.2f} "
        f"predicted, {seconds:.0f} s"
    )
    return run


def largest_predicted(backend, lo, hi, budget, ratio):
    """The largest size in [lo, hi) whose predicted job, times `ratio`, fits; None if none.
    Predictions grow with the size: a binary search."""
    if lo >= hi or predicted(backend, lo)["host_gb"] * ratio > budget:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predicted(backend, mid)["host_gb"] * ratio <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def search(backend, a, ratio):
    """(the largest size confirmed within the budget or None, every run made); `ratio`
    calibrates the first pick."""
    best, over, runs = None, LARGEST + 1, []
    for _ in range(a.trials):
        size = largest_predicted(backend, (best or 0) + 1, over, a.budget_gb, ratio)
        if size is None:
            break
        run = confirm(backend, size, a)
        runs.append(run)
        # measured over predicted: the next pick's calibration (a lower bound when stopped)
        ratio = run.job / run.predicted_job
        if run.fits(a.budget_gb):
            best = size
        else:
            over = size
    return best, runs


# ---- tables


def none_found(backend, runs):
    """Why a backend has no size: plan fits none, or none ran within the budget."""
    tried = sum(r.backend == backend for r in runs)
    return f"none within the budget in {tried} run(s)" if tried else "nothing fits (plan)"


def fmt_job(run):
    return f"> {run.job:.2f} (stopped)" if run.stopped else f"{run.job:.2f}"


def print_tables(found, runs, budget, updates):
    print(
        f"\n2 CPU ranks, job budget {budget:g} GB; the family: h layers x width 64·h, heads of 64, "
        f"feed-forward 4x, vocabulary {VOCAB} (tied), fp32 Adam, 1 x {SEQ} random tokens per rank, "
        f"{updates} updates. Job memory: the largest sum of Pss over the job's processes, sampled.\n"
    )
    print(
        "| backend | layers x width | parameters | predicted peak (job, GB) | measured peak (job, GB) "
        "| updates run | seconds |"
    )
    print("|---|---|---|---|---|---|---|")
    for backend, run in found.items():
        if run is None:
            print(f"| {backend} | {none_found(backend, runs)} | - | - | - | - | - |")
        else:
            print(
                f"| {backend} | {shape(run.size)} | {run.params / 1e6:.0f} M | {run.predicted_job:.2f} | "
                f"{fmt_job(run)} | {run.updates} | {run.seconds:.0f} |"
            )
    if not runs:
        return
    print(
        "\nEvery run of the search, in order (plan's per-rank prediction against the largest "
        "process's peak RSS, VmHWM):\n"
    )
    print(
        "| backend | layers x width | parameters | predicted job GB | measured job GB | job error "
        "| predicted per rank GB | largest rank peak RSS GB | rank error | within budget | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        job_err = "-" if r.stopped else f"{r.predicted_job / r.job - 1:+.1%}"
        rank_err = "-" if r.stopped else f"{r.predicted_rank / r.rank - 1:+.1%}"
        print(
            f"| {r.backend} | {shape(r.size)} | {r.params / 1e6:.0f} M | {r.predicted_job:.2f} | {fmt_job(r)} | "
            f"{job_err} | {r.predicted_rank:.2f} | {r.rank:.2f} | {rank_err} | "
            f"{'yes' if r.fits(budget) else 'no'} | {r.seconds:.0f} |"
        )


def goal_rows(found, runs, budget):
    rows = []
    ddp = found.get("ddp")
    for backend in ("fsdp", "fsdp --checkpoint-activations"):
        if backend not in found or "ddp" not in found:
            continue
        plain, run = backend == "fsdp", found[backend]
        name = f"scale: {backend} vs DDP, largest model in {budget:g} GB (2 CPU ranks, job)"
        if ddp is None or run is None:
            missing = "ddp" if ddp is None else backend
            measured = f"{missing}: {none_found(missing, runs)}"
            rows.append(
                goal(name, measured, f"≥ {GOAL_RATIO}× parameters" if plain else "(info)", False if plain else None)
            )
            continue
        ratio = run.params / ddp.params
        rows.append(
            goal(
                name,
                f"{ratio:.2f}× parameters ({run.params / 1e6:.0f} M vs {ddp.params / 1e6:.0f} M)",
                f"≥ {GOAL_RATIO}× parameters" if plain else "(info)",
                ratio >= GOAL_RATIO if plain else None,
            )
        )
    measured = [r for r in runs if not r.stopped]
    if measured:
        worst = max(measured, key=lambda r: abs(r.predicted_job / r.job - 1))
        rows.append(
            goal(
                f"scale: plan's job prediction vs measured, {len(measured)} runs",
                f"worst {worst.predicted_job / worst.job - 1:+.1%} ({worst.backend} {shape(worst.size)})",
                "(info)",
                None,
            )
        )
    return rows


def main():
    p = parser(__doc__, reps=1)
    p.add_argument(
        "--budget-gb",
        type=float,
        default=20.0,
        help="memory for the whole job (both ranks and their launcher), in GB of 2**30 bytes",
    )
    p.add_argument(
        "--updates",
        type=int,
        default=3,
        help="updates per run, at least 3: the peak comes in the "
        "2nd, the first to hold the optimizer state, and a later one holds it while it is read",
    )
    p.add_argument("--trials", type=int, default=3, help="most confirmation runs per backend")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between memory samples")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take before it is stopped")
    p.add_argument(
        "--only",
        nargs="+",
        default=list(BACKENDS),
        choices=list(BACKENDS),
        metavar="NAME",
        help=f"backends to size, of: {', '.join(BACKENDS)}",
    )
    a = p.parse_args()
    if a.budget_gb <= 0 or a.updates < 3 or a.trials < 1 or a.reps < 1:
        p.error("--budget-gb must be > 0, --updates >= 3, --trials and --reps >= 1")
    found, runs = {}, []
    for backend in a.only:
        # the planner errs alike on the backends of one family: the previous backend's last
        # calibration starts this one, never below 1 (the first pick trusts plan at most)
        best, tried = search(backend, a, max([1.0] + [r.job / r.predicted_job for r in runs[-1:]]))
        runs += tried
        # the run that confirmed the best size: the last one of that size
        found[backend] = next((r for r in reversed(tried) if r.size == best), None)
    print_tables(found, runs, a.budget_gb, a.updates)
    report(goal_rows(found, runs, a.budget_gb), a.results)


if __name__ == "__main__":
    sys.exit(main())
