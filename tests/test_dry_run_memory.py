"""GPU memory without a GPU: the dry run's tracked peak and plan's ledger.

The tracked update counts attention as a GPU runs it (trainer/dryrun/dry_rank.py
flash_attention): torch's CPU build has no fused kernel for CUDA tensors, so SDPA of fake CUDA
tensors would take its math path and keep every head's T×T probabilities, which a GPU's
flash kernel never holds. plan counts FSDP2's reduction of each unit as torch does it
(trainer/plan/ledger.py UpdateWalk.reduce), checked here against the tracker where it decides
the peak; bench/bench_dry_run_memory.py compares the two on full-size models."""

import ast
import subprocess
import sys
import textwrap

from helpers import compose
from models import chunks
from trainer.dryrun.command import job_of, planned_bytes, rank_reports

SAVED_BY_ATTENTION = """
from trainer.dryrun.fake_cuda import load_fake_cuda
load_fake_cuda(8)
import torch
import torch.nn.functional as F
from trainer.dryrun.device_checks import FakeDevices
from trainer.dryrun.dry_rank import flash_attention
from trainer.dryrun.fake_cuda import CudaStandIn

CudaStandIn(8).patch()


def saved():
    \"\"\"The shapes causal GQA attention saves for backward (4 query heads over 2 kv heads,
    256 positions of 16 channels), and its input gradients' shapes.\"\"\"
    shapes = []
    with FakeDevices():
        q = torch.randn(1, 4, 256, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, 2, 256, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y.sum().backward()
        return shapes, [tuple(t.grad.shape) for t in (q, k, v)]


print(saved())
with flash_attention():
    print(saved())
print(saved())
"""


def test_the_tracked_update_saves_what_flash_attention_saves():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SAVED_BY_ATTENTION)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (math, _), (flash, grads), (after, _) = map(ast.literal_eval, done.stdout.splitlines()[-3:])
    square = (256, 256)
    assert any(s[-2:] == square for s in math)  # the math path keeps the probabilities
    assert not any(s[-2:] == square for s in flash)
    assert (1, 4, 256) in flash and (1, 4, 256, 16) in flash  # the row log-sum-exp and the output
    assert grads == [(1, 4, 256, 16), (1, 2, 256, 16), (1, 2, 256, 16)]
    assert after == math  # torch's own SDPA again outside


def llama(vocab, *flags):
    """8 gated layers of width 512 (7 M parameters each), 64 tokens, bf16, checkpointed: the
    activations are small beside the parameters' states and gradients."""
    argv = ["--task", "dummy_lm", "--dict-size", str(vocab), "--arch", "llama3_2_1b", "--decoder-layers", "8"]
    argv += ["--decoder-embed-dim", "512", "--decoder-attention-heads", "4", "--decoder-kv-heads", "2"]
    argv += ["--decoder-ffn-embed-dim", "4096", "--tokens-per-sample", "64", "--batch-size", "1", "--bf16"]
    argv += ["--optimizer", "adam", "--lr", "0.0001", "--checkpoint-activations", "--dry-run", *flags]
    return compose(argv)


def test_plan_counts_fsdp2s_reduction_as_the_tracker_does():
    """One rank and a 131k-token vocabulary: the peak is the root's reduction, where the
    reduce-scatter's bf16 input and output and the fp32 shard made from them are alive with
    every layer's fp32 gradient (plan had 0.93 of the tracker's peak, counting neither the
    output nor its cast). hybrid_shard with shard groups of 8 against fully_sharded over 8:
    FSDP2 holds each unit's all-reduced bf16 shard to the end of backward, which only the
    hybrid run has (plan had no difference)."""
    cfgs = [
        llama(131072, "--ddp-backend", "fully_sharded", "--distributed-world-size", "1"),
        llama(256, "--ddp-backend", "fully_sharded", "--distributed-world-size", "8"),
        llama(256, "--ddp-backend", "hybrid_shard", "--distributed-world-size", "16"),
    ]
    reports = rank_reports([job_of(cfg, 0) for cfg in cfgs])
    for r in reports:
        assert "failure" not in r, r.get("traceback")
    tracked = [r["peak_bytes"] for r in reports]
    planned = [planned_bytes(cfg)[0] for cfg in cfgs]
    assert abs(planned[0] / tracked[0] - 1) < 0.01
    held_tracked, held_planned = tracked[2] - tracked[1], planned[2] - planned[1]
    assert held_tracked > 0.05 * tracked[1]
    assert abs(held_planned / held_tracked - 1) < 0.05


def test_plan_counts_a_gpus_loss_chunk_as_the_tracker_does(monkeypatch):
    """4,096 tokens over a 131k-token vocabulary on one fake GPU: the loss takes two chunks of
    the GPU's size (models/chunks.py LOSS_CHUNK_BYTES_GPU), whose fp32 logits and bf16 product
    are most of the peak; plan reads the same size for a cuda setup. With a CPU's chunk
    size the plan falls short of the tracker by most of a chunk."""
    argv = ["--task", "dummy_lm", "--dict-size", "131072", "--arch", "llama3_2_1b", "--decoder-layers", "2"]
    argv += ["--decoder-embed-dim", "512", "--decoder-attention-heads", "4", "--decoder-kv-heads", "2"]
    argv += ["--decoder-ffn-embed-dim", "1024", "--tokens-per-sample", "4096", "--batch-size", "1", "--bf16"]
    argv += ["--optimizer", "adam", "--lr", "0.0001", "--checkpoint-activations", "--dry-run"]
    cfg = compose(argv + ["--ddp-backend", "fully_sharded", "--distributed-world-size", "1"])
    (report,) = rank_reports([job_of(cfg, 0)])
    assert "failure" not in report, report.get("traceback")
    assert abs(planned_bytes(cfg)[0] / report["peak_bytes"] - 1) < 0.01
    monkeypatch.setattr(chunks, "LOSS_CHUNK_BYTES_GPU", chunks.LOSS_CHUNK_BYTES)  # the planner only
    assert planned_bytes(cfg)[0] < 0.7 * report["peak_bytes"]
