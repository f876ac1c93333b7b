"""`train … --dry-run`: the job checked on fake GPUs, on a host without any (a login node).

The job's ranks fill nodes of --dry-run-gpus-per-node GPUs in order, as torchrun and SLURM
place them. Every rank's GPU is worked out by the code that picks it in a real job; rank 0
and the last rank (the other end of every mesh) then each run in one process of their own
(trainer/dryrun/rank.py): the process groups the job makes, the model built and sharded,
its optimizer, and two updates (forward, backward, loss scale, unscale, clip, step), each
tensor fake (shape, dtype, device; no data), each CUDA call and collective checked. The
second update runs under torch's FSDPMemTracker: each rank's peak as the CUDA caching
allocator would count it, printed beside `plan`'s prediction of the same tensors. The two
ranks must issue the same collectives on the same device types, or the job would hang.

Torch-free here: the rank process loads the fake devices before torch.
"""

import concurrent.futures
import json
import subprocess
import sys

from omegaconf import OmegaConf

from trainer.config.compose import compose_config
from trainer.errors import UsageError
from trainer.plan.ledger import RUNTIME_GB, simulate
from trainer.plan.search import model_shape, setup_of, vocab_size

GB = 2**30


def dry_run_ranks(world):
    return sorted({0, world - 1})


def rank_reports(jobs):
    """Run `jobs` (dicts for trainer/dryrun/rank.py); their reports, in order. The jobs of one
    rank run one after another in one fresh process, each rank's in a process of its own, side
    by side: torch caches what it works out per device mesh (a shard's offset, a mesh's
    coordinate), and two ranks' meshes of one shape are equal to it."""
    by_rank = {}
    for i, job in enumerate(jobs):
        by_rank.setdefault(job["rank"], []).append(i)
    procs = {
        rank: subprocess.Popen(
            [sys.executable, "-m", "trainer.dryrun.rank"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in by_rank
    }
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:  # each pipe read as it fills
        outputs = dict(
            zip(procs, pool.map(lambda r: procs[r].communicate(json.dumps([jobs[i] for i in by_rank[r]])), procs))
        )
    reports = [None] * len(jobs)
    for rank, (out, err) in outputs.items():
        got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if procs[rank].returncode != 0 or len(got) != len(by_rank[rank]):
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the dry run's process of rank {rank} failed: {last}")
        for i, report in zip(by_rank[rank], got):
            reports[i] = report
    return reports


def job_of(cfg, rank, command="train"):
    dist = cfg.distributed_training
    return {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "rank": rank,
        "world_size": dist.distributed_world_size,
        "gpus_per_node": dist.dry_run_gpus_per_node,
        "command": command,
    }


def command_job(command, argv, world, rank, gpus_per_node=8):
    """A job of eval-lm, generate or serve (`argv`: its command line), on `world` ranks
    composed as cli.py launches the command."""
    cfg = compose_config([("distributed_training.distributed_world_size", world)], [], None, None)
    job = job_of(cfg, rank, command)
    job.update(gpus_per_node=gpus_per_node, argv=list(argv))
    return job


def check_job(cfg):
    dist = cfg.distributed_training
    if dist.dry_run_gpus_per_node < 1:
        raise UsageError(f"--dry-run-gpus-per-node must be at least 1, got {dist.dry_run_gpus_per_node}")
    if dist.auto_tune:
        raise UsageError("--dry-run checks the flags given: drop --auto-tune, or run `plan` to pick them first")
    if cfg.common.cpu:
        raise UsageError("--dry-run checks a GPU job on fake GPUs; drop --cpu (a CPU job runs as it is here)")


def gib(nbytes):
    return f"{nbytes / GB:.3g} GiB"


def planned_bytes(cfg):
    """plan's per-rank prediction on GPUs: (the tensors' peak, the runtime it adds) in bytes
    (from its ledger, torch-free: no rounding of its GiB figures)."""
    dist = cfg.distributed_training
    setup = setup_of(cfg, "cuda", min(dist.distributed_world_size, dist.dry_run_gpus_per_node))
    ledger, _ = simulate(model_shape(cfg, vocab_size(cfg)), setup)
    return ledger.peak, RUNTIME_GB["cuda"] * GB


def tp_groups_across_nodes(world, tp, gpus_per_node):
    """How many tensor-parallel groups (`tp` consecutive ranks: the mesh's last dimension) hold
    ranks of two nodes or more."""
    return sum(first // gpus_per_node != (first + tp - 1) // gpus_per_node for first in range(0, world, tp))


def collective_mismatch(reports):
    """The first collective where two ranks differ (op, device type, dtype or the group it is
    issued on, by its description: a device mesh's dimension), as a line, or None."""
    first = reports[0]
    for other in reports[1:]:
        for i, (a, b) in enumerate(zip(first["collectives"], other["collectives"])):
            if a != b:
                return (
                    f"collective #{i + 1} differs between rank {first['rank']} ({a[0]} of {a[2]} on {a[1]}, group "
                    f"{a[3] or '-'}) and rank {other['rank']} ({b[0]} of {b[2]} on {b[1]}, group {b[3] or '-'}): "
                    "a real job would hang or fail there"
                )
        if len(first["collectives"]) != len(other["collectives"]):
            return (
                f"rank {first['rank']} issues {len(first['collectives'])} collectives, rank {other['rank']} "
                f"{len(other['collectives'])}: a real job would hang"
            )
    return None


def dry_run(cfg, out=sys.stdout):
    """Check the job; print each rank's line and a last line starting `dry run:`. Returns
    the exit code: 0 when it would run, 2 for a command line that cannot (one line), 1
    when shardlm itself does something a GPU would refuse."""
    check_job(cfg)
    dist = cfg.distributed_training
    world, gpus = dist.distributed_world_size, dist.dry_run_gpus_per_node
    nodes = -(-world // gpus)
    reports = rank_reports([job_of(cfg, r) for r in dry_run_ranks(world)])
    for report in reports:
        if "usage_error" in report:
            raise UsageError(report["usage_error"])
    failed = [r for r in reports if "failure" in r]
    print(f"dry run of {world} rank(s) on {nodes} node(s) x {gpus} fake GPUs, {dist.ddp_backend}", file=out)
    for r in reports:
        if "failure" in r:
            print(f"rank {r['rank']}: FAILED {r['failure']}", file=out)
            continue
        groups = ", ".join(
            f"{how} {backend}" + ("" if ranks is None else f" of {len(ranks)}") for how, backend, ranks in r["groups"]
        )
        print(
            f"rank {r['rank']} (node {r['rank'] // gpus}, local rank {r['local_rank']} of {len(r['node_gpus'])}, "
            f"{r['device']}): groups [{groups}]; "
            f"{r['update_collectives']} collectives per update, {r['host_reads']} host reads, "
            f"{r['pinned_copies']} pinned / {r['pageable_copies']} pageable copies to the GPU; "
            f"peak {gib(r['peak_bytes'])} (FSDPMemTracker)",
            file=out,
        )
    if failed:
        r = failed[0]
        print(r["traceback"].rstrip(), file=sys.stderr)
        print(f"dry run: FAILED on rank {r['rank']}: {r['failure']}", file=out)
        return 1
    for r in reports:
        gpus_taken = r["node_gpus"]
        if len(set(gpus_taken)) != len(gpus_taken) or r["device"] != f"cuda:{gpus_taken[r['local_rank']]}":
            print(
                f"dry run: FAILED: node {r['rank'] // gpus}'s ranks take GPUs {gpus_taken}; rank {r['rank']} "
                f"is on {r['device']}",
                file=out,
            )
            return 1
    mismatch = collective_mismatch(reports)
    if mismatch:
        print(f"dry run: FAILED: {mismatch}", file=out)
        return 1
    tp = cfg.common.model_parallel_size
    if spanning := tp_groups_across_nodes(world, tp, gpus):
        print(
            f"--model-parallel-size {tp}: {spanning} of the {world // tp} tensor-parallel groups span nodes of {gpus} "
            "GPUs: every layer's all-gathers and reduce-scatters would cross the network",
            file=out,
        )
    if cfg.common.compile:
        print("--compile: not checked; the layers ran uncompiled (inductor needs a CUDA build of torch)", file=out)
    peaks = ", ".join(f"rank {r['rank']} {gib(r['peak_bytes'])}" for r in reports)
    tensors, runtime = planned_bytes(cfg)
    predicted = f"plan predicts {gib(tensors)} (+ {gib(runtime)} runtime: CUDA context, NCCL buffers)"
    print(
        f"dry run: ok, {world} rank(s) on {nodes} node(s) x {gpus} GPUs; peak per rank tracked: {peaks}; {predicted}",
        file=out,
    )
    return 0
