"""`plan`: print the memory plan of a config (text or one JSON object)."""

import json

from trainer.plan import quantized
from trainer.plan.ledger import COMPONENTS, predict
from trainer.plan.search import choose, fits, flags_of, model_shape, setup_of, vocab_size

LABELS = {
    "runtime": "runtime (interpreter, libraries, communication)",
    "parameters": "parameters (fp32, this rank's shards)",
    "gradients": "gradients (fp32 shards; DDP: + its buckets)",
    "optimizer_state": "optimizer state (this rank's shards)",
    "optimizer_state_replicated": "optimizer state kept whole (adafactor's columns)",
    "ema": "--store-ema: average of the weights (shards)",
    "optimizer_step": "optimizer step's buffers (updates, exchange)",
    "muon_owner_workspace": "muon: owned whole matrices, Newton-Schulz",
    "gathered_parameters": "gathered layers (unsharded, with prefetch)",
    "unsharded_gradients": "unsharded gradients before reduce-scatter",
    "activations": "activations saved for backward",
    "logits_and_loss": "loss: fp32 logits of a chunk, gradients it keeps",
    "mixed_precision_copies": "mixed-precision copies of weights",
    "document_mask": "packed documents' attention masks",
    "reference_model": "reference model (dpo: frozen fp32 parameters)",
    "reference_forward": "reference forward (gathered layers, temporaries)",
    "pq_buffers": "iPQ: assignments and counts (whole)",
    "rebuilt_weights": "iPQ: weights rebuilt from centroids",
}
IPQ_COMPONENTS = ("pq_buffers", "rebuilt_weights")  # printed for a run under --quantization-config-path


def make_plan(cfg, device, device_gb, host_gb, ranks_per_host, vocab=None, model_name=None):
    """host_gb None: the host's memory is unknown; plans are not judged by it. vocab:
    (size, where it comes from) when not the data's (`train`'s own), as `plan` finds it
    without DATA (search.published_vocab, search.apply_hf_config)."""
    size, source = vocab or (vocab_size(cfg), None)
    # --quantization-config-path: the model as the run's last stage holds it (the run starts
    # unquantized: the launcher's preflight and the dry run count it so)
    m = quantized.with_quantization(cfg, model_shape(cfg, size))
    given = setup_of(cfg, device, ranks_per_host)
    p = predict(m, given)
    tried, choice = choose(m, given, device_gb, host_gb)
    return dict(
        model=m,
        given=given,
        prediction=p,
        tried=tried,
        choice=choice,
        device_gb=device_gb,
        host_gb=host_gb,
        vocab_source=source,
        model_name=model_name or cfg.model._name,
    )


def as_json(plan):
    p, given, choice = plan["prediction"], plan["given"], plan["choice"]
    return json.dumps(
        {
            "fits": fits(p, plan["device_gb"], plan["host_gb"]),
            "per_rank_gb": p.per_rank_gb,
            "host_gb": p.host_gb,
            "components": p.components,
            "comm_gb_per_update": round(p.comm_gb_per_update, 3),
            "comm_gb": p.comm,
            "device": given.device,
            "device_memory_gb": plan["device_gb"],
            "host_memory_gb": plan["host_gb"],
            "host_memory_checked": plan["host_gb"] is not None,
            "params": plan["model"].params,
            "model": plan["model_name"],
            "vocab": plan["model"].vocab,
            "vocab_source": plan["vocab_source"],  # null: DATA's tokenizer (or dummy_lm's --dict-size)
            # a mixture of experts: the expert rows a rank takes per sparse layer and micro-batch,
            # as predicted (balanced routing) and at worst (the EP group's tokens all to its experts)
            "expert_rows": expert_rows_of(plan["model"], given),
            "recommended": flags_of(choice[1], given) if choice else None,
            "recommended_per_rank_gb": choice[2].per_rank_gb if choice else None,
            "candidates": [
                {"flags": flags_of(s, given), "per_rank_gb": q.per_rank_gb, "host_gb": q.host_gb, "fits": ok}
                for _, s, q, ok in plan["tried"]
            ],
        }
    )


def expert_rows_of(m, s):
    if not m.sparse_layers:
        return None
    rows = s.routed_tokens * m.top_k  # activations.expert_rows
    return {"balanced": rows, "worst_case": s.ep * rows}


def expert_note(m, s):
    """A mixture of experts: what the prediction assumes of routing, and the worst case."""
    rows = expert_rows_of(m, s)
    note = (
        f"experts: {len(m.sparse_layers)} sparse layers x {m.experts} experts of {m.expert_ffn}, top-{m.top_k}; "
        f"predicted at balanced routing ({rows['balanced']:,} expert rows a rank per layer and micro-batch)"
    )
    if s.ep == 1:
        return note
    return (
        note + f"; at worst every token of the EP group goes to one rank's experts: "
        f"{rows['worst_case']:,} rows ({s.ep}x those buffers)"
    )


def as_text(cfg, plan):
    m, s, p = plan["model"], plan["given"], plan["prediction"]
    flags = [s.backend] + [
        f
        for f, on in (
            ("no reshard", s.sharded and not s.reshard_after_forward),
            ("checkpoint-activations", s.checkpoint_activations),
            ("offload-activations", s.offload_activations),
            ("cpu-offload", s.cpu_offload),
            (f"tensor parallel {s.tp}", s.tp > 1),
            (f"context parallel {s.cp}", s.cp > 1),
            (f"expert parallel {s.ep}", s.ep > 1),
        )
        if on
    ]
    source = f": {plan['vocab_source']}" if plan["vocab_source"] else ""
    lines = [
        f"model {plan['model_name']}: {m.params:,} parameters ({m.layers} layers x {m.dim}, "
        f"vocabulary {m.vocab}{source})",
        f"{s.world} rank(s), {s.ranks_per_host} per host, {s.device}, {s.precision}, {', '.join(flags)}, "
        f"--optimizer {s.optimizer}",
        f"batch per data-parallel rank: {s.sequences}{' pairs (2 rows each)' if s.dpo else ''} x {s.seq_len} "
        f"tokens, --update-freq {s.update_freq} ({s.rows * s.seq_len * s.update_freq * s.data_parallel:,} tokens "
        "per update)",
        "",
        "per rank, at the peak of an update:",
    ]
    for k in COMPONENTS:
        if k in IPQ_COMPONENTS and not m.pq:
            continue
        lines.append(f"  {LABELS[k]:<50} {p.components[k]:9.3f} GB")
    verdict = "fits" if p.per_rank_gb <= plan["device_gb"] else "does NOT fit"
    lines.append(f"  {'total':<50} {p.per_rank_gb:9.3f} GB of {plan['device_gb']:.1f} GB: {verdict}")
    if plan["host_gb"] is None:
        lines.append(f"host memory per host: {p.host_gb:.3f} GB, not checked (give --host-memory-gb to check it)")
    else:
        host_verdict = "fits" if p.host_gb <= plan["host_gb"] else "does NOT fit"
        lines.append(f"host memory per host: {p.host_gb:.3f} GB of {plan['host_gb']:.1f} GB: {host_verdict}")
    comm = p.comm
    lines.append(
        f"communication per rank per update: all-gather {comm['all_gather']:.3f} GB, reduce-scatter "
        f"{comm['reduce_scatter']:.3f} GB, all-reduce {comm['all_reduce']:.3f} GB"
        + (f", all-to-all {comm['all_to_all']:.3f} GB" if comm["all_to_all"] else "")
        + (f"; inside tensor-parallel groups {comm['tensor_parallel']:.3f} GB" if comm["tensor_parallel"] else "")
        + (f"; inside context-parallel groups {comm['context_parallel']:.3f} GB" if comm["context_parallel"] else "")
        + (f"; inside expert-parallel groups {comm['expert_parallel']:.3f} GB" if comm["expert_parallel"] else "")
    )
    if m.sparse_layers:
        lines.append(expert_note(m, s))
    if m.pq:
        lines.append(quantized.summary(m, s.shard))
    lines += ["", "flag sets, fastest first (per-rank GB, host GB):"]
    for label, t, q, ok in plan["tried"]:
        extra = flags_of(t, s) or "(as given)"
        lines.append(f"  {label:<30} {q.per_rank_gb:9.3f} {q.host_gb:10.3f}  {'fits' if ok else '-':<5} {extra}")
    choice = plan["choice"]
    if choice is None:
        lines.append("recommended: nothing fits; add ranks (--distributed-world-size) or memory")
    else:
        lines.append(
            f"recommended: {flags_of(choice[1], s) or '(the flags as given)'}  "
            f"→ {choice[2].per_rank_gb:.3f} GB per rank"
        )
    return "\n".join(lines)
