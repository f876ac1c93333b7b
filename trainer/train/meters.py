"""Running sums behind the log records (fairseq's meters), and peak memory."""
import math
import time

import torch

from models.config import head_dim, num_layers

LN2 = math.log(2)


class TrainMeters:
    """Sums over an interval (train_inner) or an epoch (train); `record()` turns them into
    fairseq's fields: loss in base 2 per token, ppl = 2**loss, wps, ups, wpb, bsz, …"""

    def __init__(self):
        self.reset()

    def reset(self):
        self.start = time.perf_counter()
        self.loss_sum = self.ntokens = self.nsentences = 0.0
        self.updates = self.gnorm_sum = self.clipped = self.train_wall = 0.0

    def add_update(self, loss_sum, ntokens, nsentences, gnorm, clipped, seconds):
        self.loss_sum += loss_sum
        self.ntokens += ntokens
        self.nsentences += nsentences
        self.updates += 1
        self.gnorm_sum += gnorm
        self.clipped += clipped
        self.train_wall += seconds

    FIELDS = ("loss_sum", "ntokens", "nsentences", "updates", "gnorm_sum", "clipped", "train_wall")

    def state_dict(self):
        return {k: getattr(self, k) for k in self.FIELDS}

    def load_state_dict(self, state):
        for k in self.FIELDS:
            setattr(self, k, float(state[k]))

    def record(self, num_updates, lr, clip_norm, loss_scale=None, flops_per_token=0.0, peak_tflops=None):
        """`peak_tflops` is the whole job's (per-rank peak x ranks): with it, `mfu` follows `tflops`."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        n = max(self.updates, 1)
        loss = self.loss_sum / max(self.ntokens, 1) / LN2
        rec = {"loss": round(loss, 3), "ppl": perplexity(loss), "wps": round(self.ntokens / elapsed),
               "ups": round(self.updates / elapsed, 2), "wpb": round(self.ntokens / n, 1),
               "bsz": round(self.nsentences / n, 1), "num_updates": num_updates, "lr": float(f"{lr:.6g}"),
               "gnorm": round(self.gnorm_sum / n, 3)}
        if clip_norm > 0:
            rec["clip"] = round(100.0 * self.clipped / n, 1)
        if loss_scale is not None:
            rec["loss_scale"] = round(loss_scale, 4)
        rec["train_wall"] = round(self.train_wall, 3)
        if flops_per_token:
            tflops = flops_per_token * self.ntokens / elapsed / 1e12
            rec["tflops"] = round(tflops, 4)
            if peak_tflops:
                rec["mfu"] = round(tflops / peak_tflops, 4)
        return rec


def perplexity(loss_base2):
    try:
        return round(2 ** loss_base2, 2)
    except OverflowError:
        return float("inf")


def peak_memory_gb(device):
    """This rank's peak memory since the previous call, then reset: the CUDA allocator's
    peak on GPU, the process's peak resident set size (VmHWM) on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return round(peak / 2 ** 30, 3)
    try:
        with open("/proc/self/status") as f:
            hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return round(hwm_kb / 2 ** 20, 3)
    except (OSError, StopIteration):
        import resource
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3)


def flops_per_token(model_cfg, num_params, vocab_size, embed_params, seq_len):
    """Training FLOPs per token (PaLM appendix B, the same count ref_loop.py uses):
    6·(non-embedding params) + 6·V·d for the output projection + 12·L·H·head_dim·T for
    attention. The attention term is the query heads' width, H·head_dim (d unless
    --decoder-head-dim says otherwise): grouped-query attention shares key/value heads
    between query heads but still multiplies every query head by T keys and T values,
    while its smaller qkv_proj is in the parameter count."""
    d, L = model_cfg.decoder_embed_dim, num_layers(model_cfg)
    inner = model_cfg.decoder_attention_heads * head_dim(model_cfg)
    return 6 * (num_params - embed_params) + 6 * vocab_size * d + 12 * L * inner * seq_len
