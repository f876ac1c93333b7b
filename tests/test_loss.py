"""The fused output projection + cross-entropy against the plain two-step form."""
import pytest
import torch
import torch.nn.functional as F

from models import linear_cross_entropy as lce


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk_rows", [7, 10_000])  # several chunks with a ragged last one; one chunk
def test_loss_and_gradients_equal_the_plain_form(monkeypatch, dtype, tol, chunk_rows):
    V, d = 300, 32
    monkeypatch.setattr(lce, "CHUNK_BYTES", 4 * V * chunk_rows)
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
