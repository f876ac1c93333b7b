"""The memory planner against measurement: `plan --format json --cpu` predicts each
configuration's per-rank peak, `train` runs it for a few updates, and the largest
`mem_gb` it logs (rank 0's peak resident set size; the ranks are symmetric) is the
measurement. Goal: every prediction within 10 % of its measurement. The --bf16 rows are
skipped on a CPU without bf16 matmul kernels (AVX512-BF16 or AMX), where a bf16 step takes
minutes.

Usage: python bench/bench_plan.py [--only NAME ...] [--updates 8]
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from task_data import save_hf_llama, write_task_data

from benchlib import BIN, bf16_unsupported, goal, json_records, note, parser, report, run_train


def model(layers, dim, vocab, seq=256, batch=2):
    return [
        "--task",
        "dummy_lm",
        "--dict-size",
        str(vocab),
        "--tokens-per-sample",
        str(seq),
        "--batch-size",
        str(batch),
        "--decoder-layers",
        str(layers),
        "--decoder-embed-dim",
        str(dim),
        "--decoder-ffn-embed-dim",
        str(4 * dim),
        "--decoder-attention-heads",
        str(dim // 64),
        "--share-decoder-input-output-embed",
        "--decoder-learned-pos",
        "--activation-fn",
        "gelu",
        "--dropout",
        "0",
        "--optimizer",
        "adam",
        "--lr",
        "0.0001",
    ]


def llama(layers, dim, ffn, heads, kv, vocab, head=None, qwen=False, seq=256, batch=2):
    """The Llama family's layer (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases;
    Qwen3's q/k norms and heads wider than dim / heads) at a size this host trains."""
    return [
        "--task",
        "dummy_lm",
        "--dict-size",
        str(vocab),
        "--tokens-per-sample",
        str(seq),
        "--batch-size",
        str(batch),
        "--arch",
        "qwen3_0_6b" if qwen else "llama3_2_1b",
        "--decoder-layers",
        str(layers),
        "--decoder-embed-dim",
        str(dim),
        "--decoder-ffn-embed-dim",
        str(ffn),
        "--decoder-attention-heads",
        str(heads),
        "--decoder-kv-heads",
        str(kv),
        "--decoder-head-dim",
        str(head or dim // heads),
        "--optimizer",
        "adam",
        "--lr",
        "0.0001",
    ]


M23 = model(6, 512, 8192, batch=8)  # 23 M parameters
M109 = model(6, 1024, 32768)  # 109 M
M51 = model(8, 640, 16384, batch=4)  # 50 M
M298 = model(13, 1280, 32768)  # 298 M
L76 = llama(8, 768, 2048, 12, 4, 32768)  # 76 M, tied (as Llama 3.2)
L76_B4 = llama(8, 768, 2048, 12, 4, 32768, batch=4)
Q53 = llama(6, 640, 1792, 8, 4, 32768, head=128, qwen=True)  # 53 M, heads 8 x 128 over a width of 640
FSDP2 = ["--ddp-backend", "fully_sharded", "--distributed-world-size", "2"]
CONFIGS = {
    "ddp 1 rank 23M": M23,
    "ddp 1 rank 23M --update-freq 2": M23 + ["--update-freq", "2"],
    "ddp 1 rank 20M, embedded corpus (train --batch-size 8)": ["--batch-size", "8"],
    "ddp 2 ranks 109M": M109 + ["--distributed-world-size", "2"],
    "fsdp 2 ranks 109M": M109 + FSDP2,
    "fsdp 2 ranks 109M --checkpoint-activations": M109 + FSDP2 + ["--checkpoint-activations"],
    "fsdp 2 ranks 109M --cpu-offload": M109 + FSDP2 + ["--cpu-offload"],
    "ddp 2 ranks 50M --update-freq 2": M51 + ["--distributed-world-size", "2", "--update-freq", "2"],
    "fsdp 1 rank 298M --checkpoint-activations": M298 + ["--ddp-backend", "fully_sharded", "--checkpoint-activations"],
    "fsdp 2 ranks 298M --no-reshard-after-forward": M298 + FSDP2 + ["--no-reshard-after-forward"],
    "ddp 1 rank 23M --bf16": M23 + ["--bf16"],
    "ddp 1 rank 23M --checkpoint-activations": M23 + ["--checkpoint-activations"],
    "fsdp 2 ranks 109M --bf16": M109 + FSDP2 + ["--bf16"],
    "llama fsdp 2 ranks 76M": L76 + FSDP2,
    "llama fsdp 2 ranks 76M --checkpoint-activations": L76 + FSDP2 + ["--checkpoint-activations"],
    "llama ddp 2 ranks 76M": L76 + ["--distributed-world-size", "2"],
    "llama fsdp 2 ranks 76M --bf16": L76 + FSDP2 + ["--bf16"],
    "llama fsdp 2 ranks 76M --bf16 --checkpoint-activations": L76 + FSDP2 + ["--bf16", "--checkpoint-activations"],
    "qwen3 fsdp 2 ranks 53M": Q53 + FSDP2,
    "qwen3 ddp 2 ranks 53M --checkpoint-activations": Q53
    + ["--distributed-world-size", "2", "--checkpoint-activations"],
    "qwen3 ddp 1 rank 53M --bf16": Q53 + ["--bf16"],
    # tensor parallelism (--model-parallel-size): alone on 2 ranks, and composed with FSDP on 4;
    # 4 sequences a rank, so that a rank's positions of the residual stream (B×T/2×d) are
    # blocks the caching host allocator keeps (1 MiB and more), not glibc's
    "llama tp 2 76M": L76_B4 + FSDP2 + ["--model-parallel-size", "2"],
    "llama fsdp 2 x tp 2 76M --checkpoint-activations": L76_B4
    + ["--ddp-backend", "fully_sharded", "--distributed-world-size", "4", "--model-parallel-size", "2"]
    + ["--checkpoint-activations"],
    "llama tp 2 76M --bf16": L76_B4 + FSDP2 + ["--model-parallel-size", "2", "--bf16"],
}


def with_optimizer(flags, name, *extra):
    """flags with --optimizer NAME (and its own flags) in place of adam."""
    i = flags.index("--optimizer")
    return flags[: i + 1] + [name] + flags[i + 2 :] + list(extra)


# The optimizers' rows: a batch small enough that the optimizer's state and step buffers
# are a large share of the peak (issue 40: adafactor's replicated columns, muon's owners).
M23_B2 = model(6, 512, 8192, batch=2)
OPTIMIZER_CONFIGS = {
    "fsdp 2 ranks 23M --optimizer adafactor": with_optimizer(M23_B2, "adafactor") + FSDP2,
    "fsdp 2 ranks 23M --optimizer adafactor --beta1 0.9": with_optimizer(M23_B2, "adafactor", "--beta1", "0.9") + FSDP2,
    "fsdp 2 ranks 23M --optimizer lamb": with_optimizer(M23_B2, "lamb") + FSDP2,
    "fsdp 2 ranks 23M --optimizer adamax": with_optimizer(M23_B2, "adamax") + FSDP2,
    "fsdp 2 ranks 23M --optimizer adagrad": with_optimizer(M23_B2, "adagrad") + FSDP2,
    "fsdp 2 ranks 23M --optimizer muon": with_optimizer(M23_B2, "muon") + FSDP2,
    "ddp 1 rank 23M --optimizer muon": with_optimizer(M23_B2, "muon"),
    "fsdp 2 ranks 109M --optimizer muon": with_optimizer(M109, "muon") + FSDP2,
}
CONFIGS.update(OPTIMIZER_CONFIGS)
# --task sft and --task dpo rows: a Llama model of Hugging Face's (--finetune-from-model; dpo's
# frozen reference is the same model) on data dirs made in a temporary directory (task_data.py).
# TASK_DATA: "{data}" and "{hf}" in the flags stand for the data dir and the model dir.
TASK_MODEL = dict(layers=6, dim=512, ffn=1536, heads=8, kv_heads=4, vocab=32768, positions=512)
TASK_DATA = {"dpo": ("preference_pairs", 257), "sft": ("conversations", 65)}  # kind, tokens a sequence
TASK_RUN = ["--tokens-per-sample", "256", "--optimizer", "adam", "--lr", "0.0001", "--finetune-from-model", "{hf}"]
TASK_CONFIGS = {
    "dpo ddp 1 rank 52M (4 pairs = 8 rows)": ["{data}/dpo", "--task", "dpo", "--batch-size", "4"] + TASK_RUN,
    "sft ddp 1 rank 52M (packed, block-causal mask)": ["{data}/sft", "--task", "sft", "--batch-size", "8"] + TASK_RUN,
    "sft fsdp 2 ranks 52M": ["{data}/sft", "--task", "sft", "--batch-size", "8"] + TASK_RUN + FSDP2,
}
CONFIGS.update(TASK_CONFIGS)


def make_task_data(root: Path):
    """The model and both data dirs, once per bench run; {"{hf}": …, "{data}": …}."""
    vocab = save_hf_llama(root / "hf", **TASK_MODEL)
    for task, (kind, length) in TASK_DATA.items():
        write_task_data(root / task, root / "hf", kind, 64, length, vocab)
    return {"{hf}": str(root / "hf"), "{data}": str(root)}


def with_paths(flags, paths):
    for key, value in paths.items():
        flags = [f.replace(key, value) for f in flags]
    return flags


def predicted(flags):
    out = subprocess.run(
        [str(BIN / "plan"), "--cpu", "--format", "json"] + flags, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)


def measured(flags, updates):
    out = run_train(
        flags
        + [
            "--max-update",
            str(updates),
            "--no-save",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--disable-validation",
        ]
    )
    return max(r["mem_gb"] for r in json_records(out))


def main():
    p = parser(__doc__, reps=1)
    p.add_argument(
        "--only",
        nargs="*",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        metavar="NAME",
        help=f"configurations to run, of: {'; '.join(CONFIGS)}",
    )
    p.add_argument(
        "--updates",
        type=int,
        default=8,
        help="updates per run (the optimizer state exists from the 2nd; the largest peak counts)",
    )
    a = p.parse_args()
    names = a.only
    why = bf16_unsupported() if any("--bf16" in CONFIGS[n] for n in names) else None
    if why:
        note(f"skipping the --bf16 rows: {why}")
        names = [n for n in names if "--bf16" not in CONFIGS[n]]
    rows, work = [], tempfile.TemporaryDirectory()
    paths = make_task_data(Path(work.name)) if any(n in TASK_CONFIGS for n in names) else {}
    for name in names:
        flags = with_paths(CONFIGS[name], paths)
        plan = predicted(flags)
        mem = max(measured(flags, a.updates) for _ in range(a.reps))  # memory does not drift
        err = plan["per_rank_gb"] / mem - 1
        rows.append((name, plan["params"], plan["per_rank_gb"], mem, err))
        note(f"{name}: predicted {plan['per_rank_gb']:.3f} GB, measured {mem:.3f} GB ({err:+.1%})")
    print("\n| configuration | parameters | predicted GB per rank | measured GB | error (goal within ±10 %) |")
    print("|---|---|---|---|---|")
    for name, params, pred, mem, err in rows:
        print(f"| {name} | {params / 1e6:.0f} M | {pred:.3f} | {mem:.3f} | {err:+.1%} |")
    worst = max(rows, key=lambda r: abs(r[4]))
    report(
        [
            goal(
                f"plan: predicted vs measured peak per rank, {len(rows)} configurations",
                f"worst {worst[4]:+.1%} ({worst[0]})",
                "within ±10 %",
                abs(worst[4]) <= 0.10,
            )
        ],
        a.results,
    )


if __name__ == "__main__":
    sys.exit(main())
