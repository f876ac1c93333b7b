"""Which layout `plan` picks for the Llama 3.1 models on 8 to 1024 GPUs of 80 GB (8 a node,
2 TB of host memory each), training at 8,192 tokens a sequence in bf16 under FSDP, one
sequence per GPU per update as given: its recommendation, the per-rank peak it predicts,
and the bytes a rank receives per update, over the data-parallel ranks (FSDP) and inside
the tensor- and context-parallel groups. Prints the Markdown table of
docs/fsdp-and-memory.md; no GPU needed (the planner is arithmetic).

Usage: python bench/plan_layouts.py [--tokens-per-sample 8192] [--device-memory-gb 80]
"""

import argparse
import contextlib
import io
import json
import sys

from benchlib import ROOT

sys.path.insert(0, str(ROOT))  # bench scripts run as files: the repository's modules come after this

import cli  # noqa: E402

MODELS = ("llama3_1_8b", "llama3_1_70b", "llama3_1_405b")
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)


def plan(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.plan_main([*argv, "--format", "json"]) == 0
    return json.loads(out.getvalue())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-sample", default="8192")
    ap.add_argument("--device-memory-gb", default="80")
    args = ap.parse_args()
    print("| model | GPUs | plan recommends | per-rank GB | FSDP GB/update | TP + CP GB/update |")
    print("|---|---:|---|---:|---:|---:|")
    for arch in MODELS:
        for world in WORLDS:
            p = plan(
                "--arch", arch, "--bf16", "--ddp-backend", "fully_sharded", "--batch-size", "1",
                "--tokens-per-sample", args.tokens_per_sample, "--distributed-world-size", str(world),
                "--device-memory-gb", args.device_memory_gb, "--host-memory-gb", "2048",
            )  # fmt: skip
            rec = p["recommended"]
            if rec is None:
                print(f"| {arch} | {world} | nothing fits | | | |")
                continue
            comm = chosen_comm(arch, world, rec, args)
            fsdp = comm["all_gather"] + comm["reduce_scatter"] + comm["all_reduce"]
            inside = comm["tensor_parallel"] + comm["context_parallel"]
            gb = p["recommended_per_rank_gb"]
            print(f"| {arch} | {world} | `{rec or '(as given)'}` | {gb:.1f} | {fsdp:.0f} | {inside:.0f} |")


def chosen_comm(arch, world, rec, args):
    """The recommended flag set's own traffic: plan it as given."""
    flags = [f for f in rec.split() if "=" not in f]
    p = plan(
        "--arch", arch, "--bf16", "--ddp-backend", "fully_sharded", "--batch-size", "1",
        "--tokens-per-sample", args.tokens_per_sample, "--distributed-world-size", str(world),
        "--device-memory-gb", args.device_memory_gb, "--host-memory-gb", "2048", *flags,
    )  # fmt: skip
    return p["comm_gb"]


if __name__ == "__main__":
    main()
