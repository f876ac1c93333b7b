"""A mixture-of-experts feed-forward (Qwen3-MoE's and Mixtral's sparse block): a router picks
each token's top-k experts, each a gated feed-forward, and the token's output is their
outputs weighted by the router's probabilities.

Dropless token choice: every token reaches its k experts, however many choose one. Tokens
are sorted by expert, so that each expert's are one contiguous run, and each expert's
matmuls take its run at once: one grouped matmul over the experts where torch has one for
the device (CUDA's torch._grouped_mm), else one matmul per expert, never a loop per token.

The experts' weights are stacked by rows in 2-D parameters, expert after expert, as the
dense layer's are (moe.experts.fc1, moe.experts.fc2): fc1 holds each expert's gate rows
then its up rows (E·2F × d), fc2 each expert's down projection (E·d × F). A slice of rows
is then whole rows of Hugging Face's per-expert tensors (trainer/formats/hf), FSDP's row
shards fall on experts' rows, and the optimizers that treat matrices whole see each
expert's (DecoderLayer.weight_blocks).

The router's statistics of the last forward (`routing`) serve the load-balancing loss and
the load metrics; reading them is the caller's (TransformerLM.router_stats).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import moe_ffn


class RouterStats:
    """One layer's routing of one forward: per expert, how many of the tokens' k choices
    fell on it (float, no gradient) and the sum of its router probabilities over the tokens
    (with gradient), and how many tokens were routed; padding is routed but not counted
    (transformers' attention mask)."""

    def __init__(self, choices, probs_sum, tokens):
        self.choices, self.probs_sum, self.tokens = choices, probs_sum, tokens


class MoEFeedForward(nn.Module):
    def __init__(self, cfg, activation_fn):
        super().__init__()
        dim, E = cfg.decoder_embed_dim, cfg.moe_expert_count
        self.num_experts, self.top_k = E, cfg.moe_top_k
        self.norm_topk_prob = cfg.moe_norm_topk_prob
        self.router = nn.Linear(dim, E, bias=False)
        self.experts = Experts(E, dim, moe_ffn(cfg), activation_fn)
        # auxiliary-loss-free balancing: a bias on the choice of experts, and the choices of
        # the update so far (every rank's) that move it after the update
        rate = getattr(cfg, "moe_router_bias_update_rate", 0.0)
        self.bias_rate = rate
        self.register_buffer("router_bias", torch.zeros(E) if rate > 0 else None)
        self.register_buffer("update_load", torch.zeros(E) if rate > 0 else None, persistent=False)
        self.routing = None  # RouterStats of the last forward
        self.counted = None  # the tokens (flat, bool) the next forward counts in them; None: all
        # How the tokens reach their experts and come back: here, where all the experts are;
        # under expert parallelism, over the ranks that hold them (trainer/parallel/experts.py).
        self.dispatch = local_dispatch

    def route(self, x):
        """x: N×d → (N×k expert ids, N×k weights in x's dtype, the router's N×E float32
        probabilities)."""
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        if self.router_bias is None:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        else:  # the bias picks the experts; the probabilities alone weight them
            experts = torch.topk(probs + self.router_bias, self.top_k, dim=-1).indices
            weights = probs.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype), probs

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights, probs = self.route(x)
        flat = experts.reshape(-1)
        # a scatter, not bincount: bincount sizes its output from the ids' max, which a GPU must
        # send to the host first
        counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        self.routing = self.stats(counts, flat, probs)
        # each (token, choice) once, grouped by expert, in token order within an expert
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        y = self.dispatch(x[tokens], counts, self.experts)
        y = y * weights.reshape(-1, 1)[order]
        out = torch.zeros_like(x).index_add_(0, tokens, y)
        return out.reshape(shape)

    @torch.no_grad()
    def update_bias(self):
        """After an update: each expert's bias moves by the rate toward balance (up if it got
        fewer of the update's choices than the mean expert, down if more), and the count
        starts again."""
        load = self.update_load
        self.router_bias.add_(self.bias_rate * torch.sign(load.mean() - load))
        load.zero_()

    def stats(self, counts, flat, probs):
        if self.counted is None:
            return RouterStats(counts.float(), probs.sum(dim=0), probs.shape[0])
        keep = self.counted.to(probs.dtype)
        choices = probs.new_zeros(self.num_experts).scatter_add_(0, flat, keep.repeat_interleave(self.top_k))
        return RouterStats(choices, (probs * keep[:, None]).sum(dim=0), keep.sum())


def local_dispatch(x, counts, experts):
    return experts(x, counts)


class Experts(nn.Module):
    """The experts' stacked weights (the module's note): fc1 E·2F × d, fc2 E·d × F. Under
    expert parallelism a rank holds some experts' rows: `local` (set by the parallel room)
    gives the rows this process holds of a parameter, itself by default."""

    def __init__(self, num_experts, dim, ffn, activation_fn):
        super().__init__()
        self.num_experts, self.ffn, self.activation_fn = num_experts, ffn, activation_fn
        self.fc1 = nn.Parameter(torch.empty(num_experts * 2 * ffn, dim))
        self.fc2 = nn.Parameter(torch.empty(num_experts * dim, ffn))
        self.local = _whole

    def forward(self, x, counts):
        """x: the rows of the experts this process holds, in runs of `counts` rows, one
        per expert in order."""
        return expert_ffn(x, self.local(self.fc1), self.local(self.fc2), counts, self.activation_fn)


def _whole(p):
    return p


def expert_ffn(x, fc1, fc2, counts, activation_fn):
    """Each expert's gated feed-forward on its run of x's rows (runs in expert order, of
    `counts` rows): fc2_e(act(gate_e(x)) * up_e(x))."""
    E = counts.shape[0]
    dim, ffn = fc1.shape[1], fc2.shape[1]
    w1, w2 = fc1.view(E, 2 * ffn, dim), fc2.view(E, dim, ffn)
    if grouped_mm_runs(x, w1):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(activation_fn(gate) * up, w2.transpose(-2, -1), offs=offsets)
    # the runs' sizes, read on the host; they add up to x's rows, which its shape says
    sizes = counts.tolist()
    sizes[-1] = x.shape[0] - sum(sizes[:-1])
    outs = []
    for e, run in enumerate(x.split(sizes)):
        if run.shape[0]:
            gate, up = F.linear(run, w1[e]).chunk(2, dim=-1)
            outs.append(F.linear(activation_fn(gate) * up, w2[e]))
    if not outs:
        # No token reached these experts (an expert-parallel rank's, under a skewed routing):
        # their weights still get a gradient, of zeros, so that FSDP's reduce-scatter of them
        # runs on this rank as on the others of its group, which would otherwise wait for it.
        return x.new_zeros(0, dim) + 0 * (fc1.sum() + fc2.sum())
    return torch.cat(outs)


def grouped_mm_runs(x, w):
    """Whether torch._grouped_mm takes these operands: CUDA's kernel (Hopper's and later),
    in bf16, with 16-byte aligned rows."""
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 9
        and x.shape[-1] % 8 == 0
        and w.shape[-2] % 8 == 0
    )
