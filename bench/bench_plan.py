"""The memory planner against measurement: `plan --format json --cpu` predicts each
configuration's per-rank peak, `train` runs it for a few updates, and the largest
`mem_gb` it logs (rank 0's peak resident set size; the ranks are symmetric) is the
measurement. Goal: every prediction within 10 % of its measurement.

Usage: python bench/bench_plan.py [--only NAME ...] [--updates 3]
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def model(layers, dim, vocab, seq=256, batch=2):
    return ["--task", "dummy_lm", "--dict-size", str(vocab), "--tokens-per-sample", str(seq),
            "--batch-size", str(batch), "--decoder-layers", str(layers), "--decoder-embed-dim", str(dim),
            "--decoder-ffn-embed-dim", str(4 * dim), "--decoder-attention-heads", str(dim // 64),
            "--share-decoder-input-output-embed", "--decoder-learned-pos", "--activation-fn", "gelu",
            "--dropout", "0", "--optimizer", "adam", "--lr", "0.0001"]


M23 = model(6, 512, 8192, batch=8)            # 23 M parameters
M109 = model(6, 1024, 32768)                  # 109 M
M51 = model(8, 640, 16384, batch=4)           # 50 M
M298 = model(13, 1280, 32768)                 # 298 M
FSDP2 = ["--ddp-backend", "fully_sharded", "--distributed-world-size", "2"]
CONFIGS = {
    "ddp 1 rank 23M fp32": M23,
    "ddp 2 ranks 109M fp32": M109 + ["--distributed-world-size", "2"],
    "fsdp 2 ranks 109M fp32": M109 + FSDP2,
    "fsdp 2 ranks 109M --checkpoint-activations": M109 + FSDP2 + ["--checkpoint-activations"],
    "fsdp 2 ranks 109M --cpu-offload": M109 + FSDP2 + ["--cpu-offload"],
    "ddp 2 ranks 50M --bf16": M51 + ["--distributed-world-size", "2", "--bf16"],
    "fsdp 1 rank 298M --bf16 --checkpoint-activations": M298 + ["--ddp-backend", "fully_sharded", "--bf16",
                                                               "--checkpoint-activations"],
    "fsdp 2 ranks 298M --bf16 --no-reshard-after-forward": M298 + FSDP2 + ["--bf16", "--no-reshard-after-forward"],
}


def predicted(flags):
    out = subprocess.run([str(BIN / "plan"), "--cpu", "--format", "json"] + flags,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def measured(flags, updates):
    out = subprocess.run([str(BIN / "train")] + flags + ["--max-update", str(updates), "--no-save",
                                                         "--log-format", "json", "--log-interval", "1",
                                                         "--disable-validation"],
                         check=True, capture_output=True, text=True).stdout
    records = [json.loads(line[line.index("{"):]) for line in out.splitlines() if "| train_inner |" in line]
    return max(r["mem_gb"] for r in records)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=list(CONFIGS), help="configurations to run")
    p.add_argument("--updates", type=int, default=3, help="updates per run (the optimizer state exists from 2)")
    a = p.parse_args()
    rows = []
    for name in a.only:
        plan = predicted(CONFIGS[name])
        mem = measured(CONFIGS[name], a.updates)
        err = plan["per_rank_gb"] / mem - 1
        rows.append((name, plan["params"], plan["per_rank_gb"], mem, err))
        print(f"{name}: predicted {plan['per_rank_gb']:.3f} GB, measured {mem:.3f} GB ({err:+.1%})", file=sys.stderr)
    print("\n| configuration | parameters | predicted GB per rank | measured GB | error (goal within ±10 %) |")
    print("|---|---|---|---|---|")
    for name, params, pred, mem, err in rows:
        print(f"| {name} | {params / 1e6:.0f} M | {pred:.3f} | {mem:.3f} | {err:+.1%} |")
    worst = max(abs(r[4]) for r in rows)
    print(f"\nworst error {worst:.1%}: {'met' if worst <= 0.10 else 'NOT met'}")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
