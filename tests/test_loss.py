"""The fused output projection + cross-entropy against the plain two-step form."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models import chunks
from models import linear_cross_entropy as lce
from trainer.cpu import host_allocator


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk_rows", [7, 10_000])  # several chunks with a ragged last one; one chunk
def test_loss_and_gradients_equal_the_plain_form(monkeypatch, dtype, tol, chunk_rows):
    V, d = 300, 32
    monkeypatch.setattr(chunks, "LOSS_CHUNK_BYTES", 4 * V * chunk_rows)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 17, d, generator=g).to(dtype).requires_grad_()
    w = (0.2 * torch.randn(V, d, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, V, (3, 17), generator=g)
    target[:, -3:] = 1  # padding, ignored

    fused = lce.linear_cross_entropy(x, w, target, ignore_index=1)
    (2.5 * fused).backward()  # a weight on the loss, as the trainer's 1/ntokens
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    plain = F.cross_entropy((x @ w.t()).float().view(-1, V), target.view(-1), ignore_index=1, reduction="sum")
    (2.5 * plain).backward()

    assert fused.dtype == torch.float32
    assert fused.item() == pytest.approx(plain.item(), rel=1e-5 if dtype == torch.float32 else 1e-3)
    assert gx.dtype == dtype and gw.dtype == dtype
    assert torch.allclose(gx.float(), x.grad.float(), atol=tol, rtol=tol)
    assert torch.allclose(gw.float(), w.grad.float(), atol=tol * 10, rtol=tol)


def test_without_gradients_only_the_loss_is_computed():
    x, w = torch.randn(5, 8), torch.randn(11, 8)
    target = torch.tensor([0, 3, 1, 10, 2])
    with torch.no_grad():
        fused = lce.linear_cross_entropy(x, w, target, ignore_index=1)
    plain = F.cross_entropy(x @ w.t(), target, ignore_index=1, reduction="sum")
    assert fused.item() == pytest.approx(plain.item(), rel=1e-6)


def _resident_mb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _forward_peak_mb(monkeypatch, V, d, rows, dtype):
    """MiB above the resident set that the loss's forward reaches, on 3 chunks of `rows`,
    under the caching host allocator every CPU rank installs: emptied, it maps only what
    outgrows the most ever live, so the peak above the resident set is what is alive at once."""
    host_allocator.install()
    monkeypatch.setattr(chunks, "LOSS_CHUNK_BYTES", 4 * V * rows)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * rows, d, generator=g).to(dtype).requires_grad_()
    w = torch.randn(V, d, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, V, (3 * rows,), generator=g)
    lce.linear_cross_entropy(x, w, target).backward()  # warm up: libraries, thread pools
    host_allocator.release_cached()
    base = _resident_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak to the current resident set
    loss = lce.linear_cross_entropy(x, w, target)
    extra = _resident_mb("VmHWM") - base
    loss.backward()
    return extra


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc to reset the peak")
def test_forward_holds_one_chunk_of_logits_at_a_time(monkeypatch):
    """Beyond the gradients it keeps, forward needs about one chunk of logits at its peak:
    the log-sum-exp and the softmax are computed in place over them, and a chunk's logits
    are gone before the next chunk's are made. Chunks of 40 MiB are above the 1 MiB mmap
    threshold that FSDP ranks set, so the peak resident set sees how many are alive at once."""
    V, d, rows = 10240, 16, 1024
    chunk_mb = 4 * V * rows / 2**20
    extra = _forward_peak_mb(monkeypatch, V, d, rows, torch.float32)
    assert chunk_mb * 0.9 <= extra < chunk_mb * 1.5, f"{extra:.0f} MiB at the peak for {chunk_mb:.0f} MiB chunks"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc to reset the peak")
def test_bf16_forward_peak_is_what_plan_counts(monkeypatch):
    """Under mixed precision forward holds, beyond the gradients it keeps (fp32 for W), one
    chunk's fp32 logits and low-precision product, and W's gradient in low precision, which
    is added into the fp32 one a few MiB at a time: no fp32 temporary of W's size (that
    was 20 MiB more here). The memory planner counts exactly these (trainer/plan/ledger.py)."""
    V, d, rows = 10240, 512, 1024
    extra = _forward_peak_mb(monkeypatch, V, d, rows, torch.bfloat16)
    kept = (3 * rows * d * 2 + V * d * 4) / 2**20  # grad_x (bf16), grad_w (fp32)
    transient = (rows * V * (4 + 2) + V * d * 2) / 2**20
    assert extra == pytest.approx(kept + transient, rel=0.08), f"{extra:.0f} MiB at the peak"


def test_a_gpu_adds_each_chunks_gradient_for_w_whole():
    """On a GPU W's low-precision gradient goes into the fp32 sum in one add per chunk (the
    add casts inside its kernel): in blocks of rows, as on a CPU, it was one small kernel
    per block, hundreds per chunk at a 128k vocabulary. Counted on fake GPUs (trainer/dryrun/):
    one loss of 4096 bf16 rows over a 32k × 512 W, forward and backward; each chunk runs
    three matmuls (logits, x's and W's gradients)."""
    script = """
        from trainer.dryrun.fake_cuda import load_fake_cuda
        load_fake_cuda(1)
        import json, torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from trainer.dryrun.device_checks import FakeDevices
        from models.linear_cross_entropy import linear_cross_entropy

        class Count(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.calls = {"add_": 0, "mm": 0}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in self.calls:
                    self.calls[name] += 1
                return func(*args, **(kwargs or {}))

        with FakeDevices():
            x = torch.empty(4096, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            w = torch.empty(32768, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            target = torch.zeros(4096, dtype=torch.long, device="cuda")
            with Count() as count:
                linear_cross_entropy(x, w, target).backward()
            assert w.grad.device.type == "cuda" and w.grad.dtype == torch.bfloat16
        print(json.dumps(count.calls))
    """
    script = textwrap.dedent(script)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    calls = json.loads(done.stdout.splitlines()[-1])
    n_chunks = calls["mm"] // 3
    assert calls["add_"] <= 2 * n_chunks, calls  # W's gradient and the loss's sum, per chunk
    assert n_chunks == -(-4096 // chunks.loss_chunk_rows(32768, "cuda"))
