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

Per-row sums (sequence log-likelihoods, for DPO) cannot take that shortcut: each row's
incoming gradient differs, and W's gradient is a sum over rows that would have to be kept
row by row (B copies of V×d). So LinearCrossEntropyPerRow scores in forward and recomputes
each chunk's logits in backward, where the rows' gradients are known: one more logits
matmul, still a chunk of logits alive at a time. It reads W in backward, so under FSDP the
module holding W must stay gathered for backward (trainer/parallel/parallelize.py's
root_read_in_backward).
"""

import torch

from models import chunks  # the chunk's size, shared with trainer/plan/ledger.py

# A vocabulary split by rows over several processes (tensor parallelism): weight holds rows
# `offset` … of it, and each process sees every position. The caller (the trainer's
# parallel room) passes an object with `offset` and two in-place reductions over the
# processes holding the other rows, `max_(t)` and `sum_(t)`, each returning t: the chunk's
# max logit, sum of exponentials and target logit are made whole with them; grad_w is this
# shard's, and grad_x each process's share (their sum over the processes is grad_x).


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, shard=None):
        """x: N×d hidden states, weight: V×d, target: N ids → summed loss (fp32, nats).
        shard: with weight a shard of the vocabulary's rows, how they join (above)."""
        needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if needs_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if needs_w else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for chunk_losses in _chunks(x, weight, target, ignore_index, grad_x, grad_w, shard=shard):
            loss += chunk_losses.sum()
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # Scaled in place: nothing else reads them (the graph is not retained).
        grad_x, grad_w = ctx.saved_tensors
        gx = grad_x.mul_(grad_loss.to(grad_x.dtype)) if grad_x is not None else None
        gw = grad_w.mul_(grad_loss).to(ctx.weight_dtype) if grad_w is not None else None
        return gx, gw, None, None, None


class LinearCrossEntropyPerRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, row_length, shard=None):
        """x: N×d hidden states of N // row_length rows, weight: V×d, target: N ids → each
        row's summed loss (fp32, nats)."""
        with torch.no_grad():
            losses = torch.cat(list(_chunks(x, weight, target, ignore_index, None, None, shard=shard)))
        ctx.save_for_backward(x, weight, target)
        ctx.ignore_index, ctx.row_length, ctx.shard = ignore_index, row_length, shard
        return losses.view(-1, row_length).sum(dim=1)

    @staticmethod
    def backward(ctx, grad_rows):
        x, weight, target = ctx.saved_tensors
        needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if needs_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if needs_w else None
        # Each position's gradient is its row's: the chunks' softmax − one-hot are scaled by it.
        scale = grad_rows.float().repeat_interleave(ctx.row_length)
        for _ in _chunks(x, weight, target, ctx.ignore_index, grad_x, grad_w, scale, ctx.shard):
            pass
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def _chunks(x, weight, target, ignore_index, grad_x, grad_w, scale=None, shard=None):
    """Yields each chunk's per-position losses (fp32, 0 where ignored), filling grad_x's
    rows and adding into grad_w as it goes (where given), each position's gradient scaled
    by `scale` (N, fp32; None: by 1). shard: a vocabulary shard (above)."""
    n, vocab = x.shape[0], weight.shape[0]
    chunk = chunks.loss_chunk_rows(vocab, x.device.type)
    # One chunk's buffers, allocated once and reused by every chunk: fp32 logits, and
    # under mixed precision the low-precision product and gradient. A CPU allocator
    # that hands large blocks back to the OS (FSDP ranks do) would otherwise fault in
    # fresh zeroed pages three times per chunk.
    rows, mixed = min(n, chunk), x.dtype != torch.float32
    logits = torch.empty(rows, vocab, dtype=torch.float32, device=x.device)
    low = torch.empty(rows, vocab, dtype=x.dtype, device=x.device) if mixed else None
    # Under mixed precision a chunk's gradient for W is made in the low dtype, then added
    # into the fp32 sum (see _add_low_into).
    needs_w = grad_w is not None
    grad_w_low = torch.empty(weight.shape, dtype=x.dtype, device=x.device) if mixed and needs_w else None
    for start in range(0, n, chunk):
        part = slice(start, start + chunk)
        yield _chunk(
            x[part],
            weight,
            target[part],
            ignore_index,
            None if grad_x is None else grad_x[part],
            grad_w,
            logits,
            low,
            grad_w_low,
            None if scale is None else scale[part],
            shard,
        )


def _chunk(xs, weight, ts, ignore_index, grad_x, grad_w, logits_buf, low_buf, grad_w_low, scale=None, shard=None):
    """One chunk's per-position losses; writes its rows of grad_x and adds into grad_w. The logits
    are made in logits_buf (fp32) by way of low_buf (the inputs' dtype; None under fp32),
    which then holds the gradient, and W's gradient by way of grad_w_low (likewise); a
    function of its own so its temporaries die on return."""
    rows = xs.shape[0]
    if low_buf is None:
        logits = torch.mm(xs, weight.t(), out=logits_buf[:rows])
    else:
        logits = logits_buf[:rows].copy_(torch.mm(xs, weight.t(), out=low_buf[:rows]))
    keep = ts != ignore_index
    mine = keep
    if shard is not None:  # ids counted from this shard's first row; the others' targets are not here
        ts = ts - shard.offset
        mine = keep & (ts >= 0) & (ts < weight.shape[0])
    safe = torch.where(mine, ts, torch.zeros_like(ts))
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    # The log-sum-exp by hand, in place over the logits: torch.logsumexp would allocate a
    # second chunk-sized tensor, and the softmax for the gradients would take another pass
    # of exp. exp(logits - max) / its sum is the softmax itself.
    top = logits.amax(dim=-1, keepdim=True)
    if shard is not None:
        picked = shard.sum_(torch.where(mine, picked, torch.zeros_like(picked)))
        top = shard.max_(top)
    total = logits.sub_(top).exp_().sum(dim=-1)
    if shard is not None:
        total = shard.sum_(total)
    lse = total.log() + top.squeeze(1)
    loss = torch.where(keep, lse - picked, torch.zeros_like(lse))
    if grad_x is None and grad_w is None:
        return loss
    # softmax − one-hot, zero on ignored rows, in place over the logits
    grad = logits.div_(total[:, None])
    grad[torch.arange(len(ts), device=xs.device), safe] -= mine.to(grad.dtype)
    grad.mul_((keep if scale is None else keep * scale)[:, None])
    if low_buf is not None:
        grad = low_buf[:rows].copy_(grad)
    if grad_x is not None:
        torch.mm(grad, weight, out=grad_x)
    if grad_w is not None:  # accumulated in fp32, without an fp32 temporary of W's size
        if grad_w_low is None:
            grad_w.addmm_(grad.t(), xs)
        else:
            _add_low_into(grad_w, torch.mm(grad.t(), xs, out=grad_w_low))
    return loss


ADD_BLOCK_BYTES = 4 * 2**20


def _add_low_into(total, part):
    """total += part, for an fp32 total and a low-precision part, without an fp32 temporary
    of the total's size. A GPU's add casts inside its kernel, so it is added whole: in
    blocks it would be one small kernel launch per block. Done whole, a CPU first copies
    all of part to fp32 (128 MiB for a 32k × 1024 W), and adds slower than in blocks of a
    few MiB of rows, which need none."""
    if total.device.type == "cuda":
        total.add_(part)
        return
    rows = max(1, ADD_BLOCK_BYTES // (4 * total.shape[1]))
    for start in range(0, total.shape[0], rows):
        total[start : start + rows] += part[start : start + rows]


def linear_cross_entropy(x, weight, target, ignore_index=-100, shard=None):
    """Summed cross-entropy (nats) of the logits x @ weight.T against target, over rows
    whose target is not ignore_index. x: (..., d), target: (...). shard: a vocabulary shard (above)."""
    return LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), ignore_index, shard)


def linear_cross_entropy_per_row(x, weight, target, ignore_index=-100, shard=None):
    """Each row's summed cross-entropy (nats, fp32) of the logits x @ weight.T against
    target, over positions whose target is not ignore_index. x: B×T×d, target: B×T → B."""
    B, T = target.shape
    return LinearCrossEntropyPerRow.apply(
        x.reshape(B * T, x.shape[-1]), weight, target.reshape(-1), ignore_index, T, shard
    )
