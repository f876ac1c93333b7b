"""Running sums behind the log records (fairseq's meters), and peak memory."""

import math
import time

import torch

from models.config import head_dim, moe_ffn, moe_layers, num_layers

LN2 = math.log(2)


# An update's numbers, one float64 vector on the device (update_status): summed over ranks
# where they are per rank, read on the host only when a record or a check needs them.
# sample_size divides the loss: the target tokens (fairseq's), or --task dpo's pairs. A task's
# own sums (Objective.extras) follow them.
STATUS = ("loss_sum", "ntokens", "nsentences", "gnorm", "clipped", "bad", "sample_size")
BAD = STATUS.index("bad")


def update_status(loss_sum, counts, gnorm, clip_norm, extras=None):
    """[loss_sum, ntokens, nsentences, gnorm, clipped, bad, sample_size, *extras] of an
    update, on the device (counts: [ntokens, nsentences, sample_size]): `bad` is 1 where
    the loss or the gradient norm is not finite."""
    gnorm = gnorm.double()
    bad = ~(torch.isfinite(loss_sum) & torch.isfinite(gnorm))
    clipped = gnorm > clip_norm if clip_norm > 0 else torch.zeros_like(bad)
    values = [loss_sum, counts[0], counts[1], gnorm, clipped.double(), bad.double(), counts[2]]
    if extras is not None:
        values.extend(extras.double().unbind())
    return torch.stack(values)


class UpdateStats:
    """What train_step returns: the update's status vector (on the device), its number, its
    host seconds, and, once queued, the copy the host reads it from one update later."""

    def __init__(self, status, number, extras=()):
        self.status, self.number, self.extras = status, number, tuple(extras)
        self.seconds = 0.0
        self.copy = None

    def read(self):
        """The status as floats (waits for the device unless the copy was queued long ago)."""
        return self.copy.read() if self.copy is not None else self.status.tolist()

    def values(self):
        """{name: float} of STATUS and the task's extras: a host read, for tests and
        benchmarks, not the loop."""
        return dict(zip(STATUS + self.extras, self.read()))


class TrainMeters:
    """Sums over an interval (train_inner) or an epoch (train); `record()` turns them into
    fairseq's fields: loss in base 2 per token (per pair for --task dpo), ppl = 2**loss, wps,
    ups, wpb, bsz, … and the task's own (`extras`, sums over sentences: dpo's rewards). The
    sums live on the device and are read once per record: adding an update reads nothing.
    An update whose flags say bad (fp16's skipped overflow) adds nothing, not even itself."""

    BASE = ("loss_sum", "ntokens", "nsentences", "updates", "gnorm_sum", "clipped", "sample_size")

    def __init__(self, device=None, extras=()):
        self.device = device or torch.device("cpu")
        self.extras = tuple(extras)
        self.FIELDS = self.BASE + self.extras + ("train_wall",)
        self.reset()

    def reset(self):
        self.start = time.perf_counter()
        self.sums = torch.zeros(len(self.FIELDS) - 1, dtype=torch.float64, device=self.device)
        self.train_wall = 0.0

    def add(self, update):
        s = update.status
        counted = 1.0 - s[BAD]
        # BASE's order; a bad update's values may be nan
        values = torch.cat([torch.stack([s[0], s[1], s[2], counted, s[3], s[4], s[6]]), s[len(STATUS) :]])
        self.sums += torch.where(s[BAD] > 0, torch.zeros_like(values), values)
        self.train_wall += update.seconds

    def values(self):
        """{field: float}: one host read of the sums."""
        return dict(zip(self.FIELDS, self.sums.tolist() + [self.train_wall]))

    def state_dict(self):
        return self.values()

    def load_state_dict(self, state):
        # sample_size and extras are absent from checkpoints saved before they existed (the
        # loss was divided by ntokens then)
        defaults = {"sample_size": state["ntokens"]}
        self.sums = torch.tensor(
            [float(state.get(k, defaults.get(k, 0.0))) for k in self.FIELDS[:-1]],
            dtype=torch.float64,
            device=self.device,
        )
        self.train_wall = float(state["train_wall"])

    def record(self, num_updates, lr, clip_norm, loss_scale=None, flops_per_token=0.0, peak_tflops=None):
        """`peak_tflops` is the whole job's (per-rank peak x ranks): with it, `mfu` follows `tflops`."""
        v = self.values()
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        n = max(v["updates"], 1)
        loss = v["loss_sum"] / max(v["sample_size"], 1) / LN2
        rec = {
            "loss": round(loss, 3),
            "ppl": perplexity(loss),
            "wps": round(v["ntokens"] / elapsed),
            "ups": round(v["updates"] / elapsed, 2),
            "wpb": round(v["ntokens"] / n, 1),
            "bsz": round(v["nsentences"] / n, 1),
            "num_updates": num_updates,
            "lr": float(f"{lr:.6g}"),
            "gnorm": round(v["gnorm_sum"] / n, 3),
        }
        if clip_norm > 0:
            rec["clip"] = round(100.0 * v["clipped"] / n, 1)
        if loss_scale is not None:
            rec["loss_scale"] = round(loss_scale, 4)
        rec.update(extra_fields(v, v["nsentences"]))
        rec["train_wall"] = round(v["train_wall"], 3)
        if flops_per_token:
            tflops = flops_per_token * v["ntokens"] / elapsed / 1e12
            rec["tflops"] = round(tflops, 4)
            if peak_tflops:
                rec["mfu"] = round(tflops / peak_tflops, 4)
        return rec


def extra_fields(sums, nsentences):
    """--task dpo's record fields from its sums over pairs (TRL's rewards/chosen,
    rewards/rejected, rewards/margins, rewards/accuracies); a mixture of experts' load-balancing
    loss (its micro-batches' values weighted by their tokens, the mean); {} otherwise."""
    fields = {}
    if "moe_aux_loss" in sums:  # each weighted by its micro-batch's sample size
        size = max(sums.get("sample_size", 0), 1)
        fields.update(
            {k: round(v / size, 5 if k == "moe_aux_loss" else 3) for k, v in sums.items() if k.startswith("moe_")}
        )
    if "reward_chosen" not in sums:
        return fields
    n = max(nsentences, 1)
    chosen, rejected = sums["reward_chosen"] / n, sums["reward_rejected"] / n
    return {
        "reward_chosen": round(chosen, 4),
        "reward_rejected": round(rejected, 4),
        "reward_margin": round(chosen - rejected, 4),
        "reward_accuracy": round(sums["reward_correct"] / n, 4),
        **fields,
    }


def perplexity(loss_base2):
    try:
        return round(2**loss_base2, 2)
    except OverflowError:
        return float("inf")


def peak_memory(device):
    """This rank's peak memory since the previous call, then reset, as log fields in GiB. On a
    GPU, `mem_gb` is the CUDA caching allocator's peak of allocated bytes (the tensors alive,
    what plan's ledger counts) and `mem_reserved_gb` its peak of reserved bytes (those and
    the blocks it keeps cached for reuse); neither counts the CUDA context or NCCL's buffers,
    which plan's per-rank figure adds as its runtime. On a CPU, `mem_gb` alone: the process's
    peak resident set size (VmHWM), everything the process holds."""
    if device.type == "cuda":
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        return {"mem_gb": round(allocated / 2**30, 3), "mem_reserved_gb": round(reserved / 2**30, 3)}
    try:
        with open("/proc/self/status") as f:
            hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return {"mem_gb": round(hwm_kb / 2**20, 3)}
    except (OSError, StopIteration):
        import resource

        return {"mem_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}


def flops_per_token(model_cfg, num_params, vocab_size, embed_params, seq_len):
    """Training FLOPs per token (PaLM appendix B, the same count ref_loop.py uses):
    6·(non-embedding params) + 6·V·d for the output projection + 12·L·H·head_dim·T for
    attention. The attention term is the query heads' width, H·head_dim (d unless
    --decoder-head-dim says otherwise): grouped-query attention shares key/value heads
    between query heads but still multiplies every query head by T keys and T values,
    while its smaller qkv_proj is in the parameter count. A mixture of experts counts the
    experts a token runs (top-k of E), not all of them: its active parameters."""
    d, L = model_cfg.decoder_embed_dim, num_layers(model_cfg)
    inner = model_cfg.decoder_attention_heads * head_dim(model_cfg)
    sparse = len(moe_layers(model_cfg))
    if sparse:
        E, k = model_cfg.moe_expert_count, model_cfg.moe_top_k
        num_params -= sparse * (E - k) * 3 * d * moe_ffn(model_cfg)  # the experts a token skips
    return 6 * (num_params - embed_params) + 6 * vocab_size * d + 12 * L * inner * seq_len
