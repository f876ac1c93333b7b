"""The dry run's tracked update counts attention as a GPU runs it (trainer/dryrun/dry_rank.py
flash_attention): torch's CPU build has no fused kernel for CUDA tensors, so SDPA of fake CUDA
tensors would take its math path and keep every head's T×T probabilities, which a GPU's
flash kernel never holds. bench/bench_dry_run_memory.py compares the tracked peaks with plan."""

import ast
import subprocess
import sys
import textwrap

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
