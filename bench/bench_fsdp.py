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

The host allocator stays measured: "ddp + jemalloc" and "fsdp + jemalloc" run with
`--host-allocator glibc` and jemalloc preloaded (LD_PRELOAD, so it is malloc in the
launcher and every rank) with PyTorch's recommended MALLOC_CONF, interleaved with the
others; their rows are also compared with the same backend under the default caching
allocator. Where libjemalloc is not found (SHARDLM_JEMALLOC names it, else the usual
library directories are searched), those rows say "not installed" and the rest runs.

Usage: python bench/bench_fsdp.py [--reps 4] [--steps 4] [--only ddp fsdp "fsdp + jemalloc" …]
"""

import glob
import os
import subprocess
import sys
from ctypes.util import find_library

from benchlib import goal, json_records, median, note, parser, report, run_train

MODEL = [
    "--task",
    "dummy_lm",
    "--dict-size",
    "32768",
    "--tokens-per-sample",
    "256",
    "--batch-size",
    "2",
    "--decoder-layers",
    "6",
    "--decoder-embed-dim",
    "1024",
    "--decoder-ffn-embed-dim",
    "4096",
    "--decoder-attention-heads",
    "16",
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
    "--no-save",
    "--disable-validation",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--distributed-world-size",
    "2",
]
DDP, FSDP = ["--ddp-backend", "pytorch_ddp"], ["--ddp-backend", "fully_sharded"]
JEMALLOC = ["--host-allocator", "glibc"]  # plus LD_PRELOAD of libjemalloc: see jemalloc_env
CONTENDERS = {
    "ddp": DDP,
    "ddp + jemalloc": DDP + JEMALLOC,
    "fsdp": FSDP,
    "fsdp + jemalloc": FSDP + JEMALLOC,
    "fsdp --no-reshard-after-forward": FSDP + ["--no-reshard-after-forward"],
    "fsdp --cpu-offload": FSDP + ["--cpu-offload"],
    "fsdp --checkpoint-activations": FSDP + ["--checkpoint-activations"],
    "fsdp --update-freq 4": FSDP + ["--update-freq", "4"],
}
WARMUP = 2
GOAL_SPEED, GOAL_MEMORY = 0.95, 0.60
# PyTorch's recommended jemalloc settings for CPU training (its performance tuning guide).
MALLOC_CONF = (
    "oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:9000000000,muzzy_decay_ms:9000000000"
)
NOT_INSTALLED = "not installed (apt-get install libjemalloc2)"
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/usr/local/lib64",
)


def jemalloc_library():
    """The path (or soname) of a libjemalloc that preloads here, or None."""
    candidates = [os.environ.get("SHARDLM_JEMALLOC")] if os.environ.get("SHARDLM_JEMALLOC") else []
    for d in LIBRARY_DIRS:
        candidates += sorted(glob.glob(os.path.join(d, "libjemalloc.so*")), reverse=True)
    candidates += [find_library("jemalloc")]
    for lib in filter(None, candidates):
        # ld.so ignores a library it cannot preload (with a message) and goes on with glibc:
        # check that it is really mapped into a process before measuring anything with it.
        probe = subprocess.run(
            [sys.executable, "-c", "print(any('jemalloc' in line for line in open('/proc/self/maps')))"],
            capture_output=True,
            text=True,
            env={**os.environ, "LD_PRELOAD": lib},
        )
        if probe.stdout.strip() == "True":
            return lib
    return None


def jemalloc_env(lib):
    """The environment of a run with jemalloc as every process's malloc."""
    preload = " ".join(filter(None, [lib, os.environ.get("LD_PRELOAD")]))
    return {**os.environ, "LD_PRELOAD": preload, "MALLOC_CONF": MALLOC_CONF}


def run(extra, steps, env=None):
    """(median tokens/s after warm-up, peak GB of rank 0) of one 2-rank run."""
    records = json_records(run_train(MODEL + extra + ["--max-update", str(steps + WARMUP)], env=env))
    return median(r["wps"] for r in records[WARMUP:]), max(r["mem_gb"] for r in records)


def main():
    p = parser(__doc__, reps=4)
    p.add_argument("--steps", type=int, default=4, help="timed updates per run (after 2 warm-up ones)")
    p.add_argument(
        "--only",
        nargs="+",
        default=list(CONTENDERS),
        choices=list(CONTENDERS),
        metavar="NAME",
        help=f"contenders to run, of: {', '.join(CONTENDERS)}",
    )
    a = p.parse_args()
    jemalloc = jemalloc_library() if any(n.endswith("jemalloc") for n in a.only) else None
    missing = [n for n in a.only if n.endswith("jemalloc") and jemalloc is None]
    if missing:
        note(f"libjemalloc not found: {', '.join(missing)}: {NOT_INSTALLED}")
    elif jemalloc:
        note(f"jemalloc rows: LD_PRELOAD={jemalloc} MALLOC_CONF={MALLOC_CONF}")
    names = [n for n in a.only if n not in missing]
    results = {name: ([], []) for name in names}
    for rep in range(a.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            env = jemalloc_env(jemalloc) if name.endswith("jemalloc") else None
            wps, mem = run(CONTENDERS[name], a.steps, env)
            results[name][0].append(wps)
            results[name][1].append(mem)
            note(f"rep {rep + 1} {name}: {wps:.0f} tokens/s, {mem:.2f} GB")
    ddp_wps = median(results["ddp"][0]) if "ddp" in results else None
    ddp_mem = median(results["ddp"][1]) if "ddp" in results else None
    if ddp_wps:
        note(
            "tokens/s per repetition: "
            + "; ".join(f"{name} {' '.join(f'{w:.0f}' for w in wps)}" for name, (wps, _) in results.items())
        )
    print(
        f"\n2 ranks, 109 M parameters, 512 tokens per rank per update, {a.steps} timed updates, "
        f"{a.reps} interleaved repetitions in alternating order, medians; × DDP: median of the "
        "per-repetition ratios; + jemalloc: --host-allocator glibc with jemalloc preloaded "
        f"(MALLOC_CONF={MALLOC_CONF}), the others --host-allocator caching\n"
    )
    print(f"| backend | tokens/s | × DDP (goal ≥ {GOAL_SPEED}) | peak GB per rank | × DDP (goal ≤ {GOAL_MEMORY}) |")
    print("|---|---|---|---|---|")
    goals = []
    for name in a.only:
        if name in missing:
            print(f"| {name} | {NOT_INSTALLED} | - | - | - |")
            goals.append(goal(f"{name} vs DDP, 2 ranks", NOT_INSTALLED, "(info)", "not measured"))
            continue
        wps, mem = results[name]
        w, m = median(wps), median(mem)
        speed = median(x / d for x, d in zip(wps, results["ddp"][0])) if ddp_wps else None
        rw = f"{speed:.3f}" if speed is not None else "-"
        rm = f"{m / ddp_mem:.3f}" if ddp_mem else "-"
        print(f"| {name} | {w:.0f} | {rw} | {m:.2f} | {rm} |")
        if not ddp_wps or name == "ddp":
            continue
        plain = name == "fsdp"
        goals.append(
            goal(
                f"{name} vs DDP, 2 ranks: tokens/s",
                f"{rw}× ({w:.0f} vs {ddp_wps:.0f})",
                f"≥ {GOAL_SPEED}×" if plain else "(info)",
                speed >= GOAL_SPEED if plain else None,
            )
        )
        goals.append(
            goal(
                f"{name} vs DDP, 2 ranks: peak memory per rank",
                f"{rm}× ({m:.2f} vs {ddp_mem:.2f} GB)",
                f"≤ {GOAL_MEMORY}×" if plain else "(info)",
                m / ddp_mem <= GOAL_MEMORY if plain else None,
            )
        )
    goals += allocator_rows(results)
    report(goals, a.results)


def allocator_rows(results):
    """Each jemalloc row against the same backend under the default caching allocator
    (paired per repetition, as × DDP is), for information."""
    rows = []
    for name, (wps, mem) in results.items():
        base = name.removesuffix(" + jemalloc")
        if base == name or base not in results:
            continue
        speed = median(x / b for x, b in zip(wps, results[base][0]))
        size = median(mem) / median(results[base][1])
        rows.append(
            goal(
                f"{name} vs {base} (caching allocator), 2 ranks: tokens/s",
                f"{speed:.3f}× ({median(wps):.0f} vs {median(results[base][0]):.0f})",
                "(info)",
                None,
            )
        )
        rows.append(
            goal(
                f"{name} vs {base} (caching allocator), 2 ranks: peak memory per rank",
                f"{size:.3f}× ({median(mem):.2f} vs {median(results[base][1]):.2f} GB)",
                "(info)",
                None,
            )
        )
    return rows


if __name__ == "__main__":
    main()
