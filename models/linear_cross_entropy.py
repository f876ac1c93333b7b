"""The output projection and the cross-entropy loss as one op that never holds the logits.

`F.cross_entropy(x @ W.T, y)` keeps N×V logits, an fp32 copy of them under mixed
precision, and log-softmax's N×V fp32 output for backward; its backward adds two more
N×V tensors. On a 50k vocabulary that is the largest single allocation of a step. Here
the rows are taken a chunk at a time: the chunk's logits, their log-sum-exp, the loss,
and — since d loss / d logits = softmax − one-hot is known as soon as the logits are —
the gradients with respect to the hidden states and to W, by the same two matmuls
backward would run. Only those gradients (N×d and V×d) are kept for backward, which
scales them by the incoming gradient. Same FLOPs as the plain form, a chunk of logits
alive at a time, and fp32 only inside a chunk.
"""

import torch

from models import chunks  # the chunk's size, shared with trainer/plan/ledger.py


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index):
        """x: N×d hidden states, weight: V×d, target: N ids → summed loss (fp32, nats)."""
        n, vocab = x.shape[0], weight.shape[0]
        chunk = chunks.loss_chunk_rows(vocab)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if needs_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if needs_w else None
        # One chunk's buffers, allocated once and reused by every chunk: fp32 logits, and
        # under mixed precision the low-precision product and gradient. A CPU allocator
        # that hands large blocks back to the OS (FSDP ranks do) would otherwise fault in
        # fresh zeroed pages three times per chunk.
        rows, mixed = min(n, chunk), x.dtype != torch.float32
        logits = torch.empty(rows, vocab, dtype=torch.float32, device=x.device)
        low = torch.empty(rows, vocab, dtype=x.dtype, device=x.device) if mixed else None
        # Under mixed precision a chunk's gradient for W is made in the low dtype, then added
        # into the fp32 sum (see _add_in_blocks).
        grad_w_low = torch.empty(weight.shape, dtype=x.dtype, device=x.device) if mixed and needs_w else None
        for start in range(0, n, chunk):
            loss += _chunk(
                x[start : start + chunk],
                weight,
                target[start : start + chunk],
                ignore_index,
                grad_x[start : start + chunk] if needs_x else None,
                grad_w if needs_w else None,
                logits,
                low,
                grad_w_low,
            )
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # Scaled in place: nothing else reads them (the graph is not retained).
        grad_x, grad_w = ctx.saved_tensors
        gx = grad_x.mul_(grad_loss.to(grad_x.dtype)) if grad_x is not None else None
        gw = grad_w.mul_(grad_loss).to(ctx.weight_dtype) if grad_w is not None else None
        return gx, gw, None, None


def _chunk(xs, weight, ts, ignore_index, grad_x, grad_w, logits_buf, low_buf, grad_w_low):
    """One chunk's summed loss; writes its rows of grad_x and adds into grad_w. The logits
    are made in logits_buf (fp32) by way of low_buf (the inputs' dtype; None under fp32),
    which then holds the gradient, and W's gradient by way of grad_w_low (likewise); a
    function of its own so its temporaries die on return."""
    rows = xs.shape[0]
    if low_buf is None:
        logits = torch.mm(xs, weight.t(), out=logits_buf[:rows])
    else:
        logits = logits_buf[:rows].copy_(torch.mm(xs, weight.t(), out=low_buf[:rows]))
    keep = ts != ignore_index
    safe = torch.where(keep, ts, torch.zeros_like(ts))
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    # The log-sum-exp by hand, in place over the logits: torch.logsumexp would allocate a
    # second chunk-sized tensor, and the softmax for the gradients would take another pass
    # of exp. exp(logits - max) / its sum is the softmax itself.
    top = logits.amax(dim=-1, keepdim=True)
    total = logits.sub_(top).exp_().sum(dim=-1)
    lse = total.log() + top.squeeze(1)
    loss = torch.where(keep, lse - picked, torch.zeros_like(lse)).sum()
    if grad_x is None and grad_w is None:
        return loss
    # softmax − one-hot, zero on ignored rows, in place over the logits
    grad = logits.div_(total[:, None])
    grad[torch.arange(len(ts), device=xs.device), safe] -= 1.0
    grad.mul_(keep[:, None])
    if low_buf is not None:
        grad = low_buf[:rows].copy_(grad)
    if grad_x is not None:
        torch.mm(grad, weight, out=grad_x)
    if grad_w is not None:  # accumulated in fp32, without an fp32 temporary of W's size
        if grad_w_low is None:
            grad_w.addmm_(grad.t(), xs)
        else:
            _add_in_blocks(grad_w, torch.mm(grad.t(), xs, out=grad_w_low))
    return loss


ADD_BLOCK_BYTES = 4 * 2**20


def _add_in_blocks(total, part):
    """total += part, for an fp32 total and a low-precision part, a few MiB of rows at a
    time. Done whole, a CPU first copies all of part to fp32: a temporary the size of the
    total (128 MiB for a 32k × 1024 W), and a slower add than in blocks, which need none."""
    rows = max(1, ADD_BLOCK_BYTES // (4 * total.shape[1]))
    for start in range(0, total.shape[0], rows):
        total[start : start + rows] += part[start : start + rows]


def linear_cross_entropy(x, weight, target, ignore_index=-100):
    """Summed cross-entropy (nats) of the logits x @ weight.T against target, over rows
    whose target is not ignore_index. x: (..., d), target: (...)."""
    return LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), ignore_index)
