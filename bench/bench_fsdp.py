"""FSDP against DDP on 2 local ranks, on a model whose optimizer state dominates memory
(≈109 M parameters, 512 tokens per rank per update): tokens/s and per-rank peak memory.

Contenders run interleaved (ddp, fsdp, …, ddp, fsdp, …) in one invocation, several
repetitions, medians. `mem_gb` is rank 0's peak resident set size on CPU (the ranks are
symmetric), CUDA's peak allocation on GPU. Usage: python bench/bench_fsdp.py [--reps 2]
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

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


def run(extra, steps):
    train = str(Path(sys.executable).with_name("train"))
    out = subprocess.run([train] + MODEL + extra + ["--max-update", str(steps + WARMUP)],
                         check=True, capture_output=True, text=True).stdout
    records = [json.loads(line[line.index("{"):]) for line in out.splitlines() if "| train_inner |" in line]
    timed = records[WARMUP:]
    return statistics.median(r["wps"] for r in timed), max(r["mem_gb"] for r in records)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--only", nargs="*", default=list(CONTENDERS), help="contenders to run")
    a = p.parse_args()
    results = {name: ([], []) for name in a.only}
    for rep in range(a.reps):
        for name in a.only:
            wps, mem = run(CONTENDERS[name], a.steps)
            results[name][0].append(wps)
            results[name][1].append(mem)
            print(f"rep {rep + 1} {name}: {wps:.0f} tokens/s, {mem:.2f} GB", file=sys.stderr)
    ddp_wps = statistics.median(results["ddp"][0]) if "ddp" in results else None
    ddp_mem = statistics.median(results["ddp"][1]) if "ddp" in results else None
    print(f"\n2 ranks, 109 M parameters, 512 tokens per rank per update, {a.steps} timed updates, "
          f"{a.reps} interleaved repetitions, medians\n")
    print("| backend | tokens/s | × DDP (goal ≥ 0.9) | peak GB per rank | × DDP (goal ≤ 0.65) |")
    print("|---|---|---|---|---|")
    for name, (wps, mem) in results.items():
        w, m = statistics.median(wps), statistics.median(mem)
        rw = f"{w / ddp_wps:.3f}" if ddp_wps else "-"
        rm = f"{m / ddp_mem:.3f}" if ddp_mem else "-"
        print(f"| {name} | {w:.0f} | {rw} | {m:.2f} | {rm} |")


if __name__ == "__main__":
    main()
