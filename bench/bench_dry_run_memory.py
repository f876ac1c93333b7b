"""GPU memory without a GPU: `plan`'s per-rank peak against the dry run's (`train --dry-run`:
the project's own training code on fake CUDA devices, one rank of a world of any size, its
second update measured by torch's FSDPMemTracker as the CUDA caching allocator would count
it), for Llama 3.2 1B, Llama 3.1 8B, Qwen3 8B and GPT-3 13B at 2,048 and 4,096 tokens per rank.

The grid: --arch llama3_2_1b, llama3_1_8b, qwen3_8b and transformer_lm_gpt3_13 (--task
dummy_lm with --dict-size the model's published vocabulary: 128,256 for Llama 3, 151,936 for
Qwen3, GPT-2's BPE of 50,257 for GPT-3), --tokens-per-sample 2048 and 4096 with --batch-size 1
(one sequence per rank), --distributed-world-size 8 and 64 on nodes of 8 GPUs
(--dry-run-gpus-per-node 8), --ddp-backend fully_sharded and hybrid_shard (shard groups of a
node's 8), with and without --checkpoint-activations, --bf16 and --fp16, with and without
--cpu-offload, --optimizer adam: 256 rows. Each row is rank 0 of its job (every rank of
FSDP2 holds shards of one padded size). Plan: trainer/dryrun/command.planned_bytes, the
ledger's peak without plan's fixed runtime (the CUDA context and NCCL's buffers, which no
tensor holds); the tracker: the peak of the dry run's FSDPMemTracker (its Total, with
attention run as a GPU's flash kernel: trainer/dryrun/dry_rank.py), which rounds each
storage up to the caching allocator's 512-byte blocks. Goal (issue 47): plan within ±5 % of
the tracker on every row. Memory is deterministic: one run of each row.

A row costs the Python of a fake forward and backward and the tracker's bookkeeping of
every op, not their arithmetic, so the models with the most layers take longest; the table's
heading gives the whole grid's minutes (benchmarks.md).
--quick runs 16 rows of the 256: a fractional factorial (each model in 4 rows, with each
other setting both ways; every two of those six settings in all four combinations).
--models runs the grid of some models only. Rows run in batches (one model and sequence
length each), each batch in one fresh process (trainer.dryrun.command.rank_reports).

Usage: python bench/bench_dry_run_memory.py [--quick] [--models llama3_2_1b ...]
"""

import itertools
import sys
import time

from benchlib import ROOT, goal, note, parser, report

sys.path.insert(0, str(ROOT))  # bench scripts run as files: the repository's modules come after this

from trainer.config.checks import check_config  # noqa: E402
from trainer.config.compose import compose_config  # noqa: E402
from trainer.config.flags import build_parser, parse_flags  # noqa: E402
from trainer.dryrun.command import job_of, planned_bytes, rank_reports  # noqa: E402

GIB = 2**30
# --arch: its published vocabulary (--dict-size)
MODELS = {
    "llama3_2_1b": 128256,
    "llama3_1_8b": 128256,
    "qwen3_8b": 151936,
    "transformer_lm_gpt3_13": 50257,
}
SEQ_LENS = (2048, 4096)
WORLDS = (8, 64)
BACKENDS = ("fully_sharded", "hybrid_shard")
PRECISIONS = ("bf16", "fp16")
GPUS_PER_NODE = 8


def grid(models):
    """Every row: (arch, seq_len, world, backend, checkpoint_activations, precision, cpu_offload)."""
    return list(itertools.product(models, SEQ_LENS, WORLDS, BACKENDS, (False, True), PRECISIONS, (False, True)))


def quick_rows():
    """16 rows: a 2^(6-2) fractional factorial of the six two-way settings (sequence length,
    world, backend, checkpointing, precision, offload: the first four every way, the last
    two their sums mod 2), each model taking the 4 runs of one value of two more sums,
    so that each model sees every setting both ways."""
    rows, models = [], list(MODELS)
    for r in range(16):
        a, b, c, d = (r >> i & 1 for i in range(4))
        e, f = a ^ b ^ c, b ^ c ^ d
        model = models[2 * (a ^ b ^ d) + (a ^ c ^ d)]
        rows.append((model, SEQ_LENS[a], WORLDS[b], BACKENDS[c], bool(d), PRECISIONS[e], bool(f)))
    return sorted(rows, key=lambda row: (list(MODELS).index(row[0]), row[1:]))


def flags(arch, seq_len, world, backend, checkpoint, precision, offload):
    argv = ["--task", "dummy_lm", "--dict-size", str(MODELS[arch]), "--arch", arch]
    argv += ["--tokens-per-sample", str(seq_len), "--batch-size", "1", "--optimizer", "adam", "--lr", "0.0001"]
    argv += ["--distributed-world-size", str(world), "--dry-run-gpus-per-node", str(GPUS_PER_NODE)]
    argv += ["--ddp-backend", backend, f"--{precision}", "--dry-run"]
    argv += ["--checkpoint-activations"] if checkpoint else []
    argv += ["--cpu-offload"] if offload else []
    return argv


def compose(argv):
    """The config `train ARGV` runs (as cli.py composes it)."""
    ns, settings, overrides = parse_flags(build_parser(), argv)
    cfg = compose_config(settings, overrides, ns.config_dir, ns.config_name)
    check_config(cfg)
    return cfg


def setting(row):
    _, _, world, backend, checkpoint, precision, offload = row
    words = [f"{world} ranks", backend, precision]
    words += ["ckpt"] if checkpoint else []
    words += ["offload"] if offload else []
    return " ".join(words)


def measure(rows):
    """{row: (plan's bytes, the tracker's bytes or None, failure or None)}, a batch per
    (model, sequence length), each batch's rows one after another in one process."""
    results = {}
    for key, batch in itertools.groupby(rows, key=lambda row: row[:2]):
        batch = list(batch)
        cfgs = [compose(flags(*row)) for row in batch]
        started = time.perf_counter()
        reports = rank_reports([job_of(cfg, 0) for cfg in cfgs])
        for row, cfg, rep in zip(batch, cfgs, reports):
            planned, _ = planned_bytes(cfg)
            failure = rep.get("failure") or rep.get("usage_error")
            tracked = None if failure else rep["peak_bytes"]
            results[row] = (planned, tracked, failure)
            ratio = f"{planned / tracked:.3f}" if tracked else f"failed: {failure}"
            note(f"{row[0]} {row[1]} tokens {setting(row)}: plan {planned / GIB:.2f} GiB, {ratio} ({rep['seconds']} s)")
        note(f"{key[0]} at {key[1]} tokens: {len(batch)} rows in {time.perf_counter() - started:.0f} s")
    return results


def main():
    p = parser(__doc__, reps=1)
    p.add_argument("--quick", action="store_true", help="16 rows of the grid (a fractional factorial)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="the models' rows only")
    a = p.parse_args()  # --reps: accepted as every script's, not used (memory is deterministic)
    rows = [r for r in quick_rows() if r[0] in a.models] if a.quick else grid(a.models)
    started = time.perf_counter()
    results = measure(rows)
    minutes = (time.perf_counter() - started) / 60
    print(
        f"\n{len(rows)} rows{' (--quick)' if a.quick else ''}, rank 0 of each job, adam, one sequence per rank, "
        f"nodes of {GPUS_PER_NODE} GPUs; plan: its ledger's peak without its runtime; "
        f"tracker: FSDPMemTracker over the dry run's second update; {minutes:.0f} min\n"
    )
    print("| model | tokens | setting | plan GiB | tracker GiB | plan / tracker (goal 0.95–1.05) |")
    print("|---|---|---|---|---|---|")
    measured = []
    for row in rows:
        planned, tracked, failure = results[row]
        if tracked is None:
            print(f"| {row[0]} | {row[1]} | {setting(row)} | {planned / GIB:.2f} | failed: {failure} | - |")
            continue
        ratio = planned / tracked
        measured.append((ratio, row))
        print(f"| {row[0]} | {row[1]} | {setting(row)} | {planned / GIB:.2f} | {tracked / GIB:.2f} | {ratio:.3f} |")
    failed = len(rows) - len(measured)
    what = f"dry run: plan / FSDPMemTracker peak per rank, {len(rows)} rows" + (" (--quick)" if a.quick else "")
    if measured:
        worst, row = max(measured, key=lambda m: abs(m[0] - 1))
        text = f"worst {worst:.3f} ({row[0]} {row[1]} tokens {setting(row)})"
        text += f"; {failed} rows failed" if failed else ""
        rows_out = [goal(what, text, "within 0.95–1.05×, every row", abs(worst - 1) <= 0.05 and not failed)]
    else:
        rows_out = [goal(what, "every row failed", "within 0.95–1.05×, every row", False)]
    report(rows_out, a.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
