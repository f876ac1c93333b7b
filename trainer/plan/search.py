"""From a composed config to a memory plan, and the fastest flag set that fits.

`plan` prints what trainer/plan/ledger.py predicts for the config as given and for each
flag set it would consider; `train --auto-tune` applies the choice. Flag sets are tried
fastest first: no resharding, resharding, + activation checkpointing, + activation
offload (GPU), + --cpu-offload (GPU); each at the requested micro-batch, then at
smaller ones with --update-freq raised so that the global batch stays the same.
A DDP run keeps DDP when it fits (it communicates least). Torch-free.
"""

from dataclasses import replace
from pathlib import Path

from data.data_dir import data_dirs
from data.embedded_corpus import prepare_embedded_corpus
from data.errors import DataError
from data.tokenizer import load_tokenizer
from models.config import PUBLISHED_VOCABS, adaptive_bands, head_dim, kv_heads, moe_ffn, moe_layers, num_layers
from trainer.config.checks import check_adaptive_vocab
from trainer.config.implied import implies_activation_checkpointing
from trainer.config.model_source import hf_vocab_size
from trainer.config.schema import ddp_backend, model_positions, vocabulary_data
from trainer.errors import UsageError
from trainer.formats.fairseq.checkpoint_file import is_fairseq_checkpoint
from trainer.formats.registry import model_settings
from trainer.plan.layouts import layout_label, layouts
from trainer.plan.ledger import ModelShape, Setup, predict
from trainer.plan.optimizer_memory import ELEMENTWISE_STATES
from trainer.rendezvous import infer_rendezvous


def vocab_size(cfg):
    task = cfg.task
    if (
        hf_vocab_size(cfg) is not None
    ):  # --finetune-from-model HF_DIR: its embedding's rows (Qwen3 pads past the data's)
        return hf_vocab_size(cfg)
    if task._name == "dummy_lm":
        return task.dict_size
    try:
        # The vocabulary of DATA's first directory (all of a sharded DATA's share it).
        data = vocabulary_data(task)
        data_dir = data_dirs(data)[0] if data else prepare_embedded_corpus()
        return load_tokenizer(data_dir).vocab_size
    except DataError as e:
        raise UsageError(str(e)) from None


def published_vocab(cfg):
    """(vocabulary, where it comes from) for a Llama-family preset without DATA: its
    published tokenizer's (models/config.py PUBLISHED_VOCABS); None otherwise. `plan` only:
    `train` without DATA trains on the embedded corpus, with its own small vocabulary."""
    name = cfg.model._name
    if cfg.task._name == "dummy_lm" or vocabulary_data(cfg.task) or name not in PUBLISHED_VOCABS:
        return None
    return PUBLISHED_VOCABS[name], f"{name}'s published vocabulary (no DATA given)"


def apply_hf_config(cfg, model_dir):
    """Set cfg.model to the Hugging Face model in model_dir (its config.json), or to a
    fairseq-train checkpoint's model (its saved config), and return
    (its vocabulary, where it comes from). UsageError, one line, when config.json is missing,
    not JSON, or describes a model we cannot build."""
    if not is_fairseq_checkpoint(model_dir):
        if not Path(model_dir).is_dir():
            raise UsageError(
                f"--path {model_dir}: no such directory or file (give a Hugging Face model directory or a "
                "fairseq-train checkpoint)"
            )
        if not (Path(model_dir) / "config.json").is_file():
            raise UsageError(f"{model_dir} is not a Hugging Face model directory: it has no config.json")
    fields, vocab, where = model_settings(model_dir)
    for key, value in fields.items():
        cfg.model[key] = value
    return vocab, where


def model_shape(cfg, vocab):
    model_cfg = cfg.model
    positions = model_positions(cfg)
    learned = model_cfg.decoder_learned_pos and not model_cfg.no_token_positional_embeddings
    final_norm = model_cfg.decoder_normalize_before and not model_cfg.no_decoder_final_norm
    return ModelShape(
        layers=num_layers(model_cfg),
        dim=model_cfg.decoder_embed_dim,
        ffn=model_cfg.decoder_ffn_embed_dim,
        heads=model_cfg.decoder_attention_heads,
        vocab=vocab,
        learned_positions=positions + getattr(model_cfg, "positions_offset", 0) if learned else 0,
        tied=model_cfg.share_decoder_input_output_embed,
        norms_outside_layers=int(final_norm) + int(model_cfg.layernorm_embedding),
        activation_fn=model_cfg.activation_fn,
        dropout=model_cfg.dropout,
        attention_dropout=model_cfg.attention_dropout,
        activation_dropout=model_cfg.activation_dropout,
        vocab_params=adaptive_vocab_params(model_cfg, vocab),
        normformer_params=normformer_params(model_cfg),
        projection_params=projection_params(model_cfg, vocab),
        kv_heads=kv_heads(model_cfg),
        head_dim=head_dim(model_cfg),
        gated=model_cfg.gated_ffn,
        bias=not model_cfg.no_bias,
        norm=model_cfg.norm_type,
        norm_bias=not model_cfg.no_bias,
        qk_norm=model_cfg.qk_norm,
        rope=model_cfg.rope,
        pq_noise=model_cfg.quant_noise_pq > 0,
        scalar_noise=model_cfg.quant_noise_scalar > 0,
        **expert_shape(model_cfg),
    )


def expert_shape(model_cfg):
    """ModelShape's mixture-of-experts fields (models/moe.py); none for a dense model."""
    sparse = moe_layers(model_cfg)
    if not sparse:
        return {}
    return dict(
        experts=model_cfg.moe_expert_count,
        expert_ffn=moe_ffn(model_cfg),
        top_k=model_cfg.moe_top_k,
        norm_topk=model_cfg.moe_norm_topk_prob,
        sparse_layers=tuple(sorted(sparse)),
    )


def normformer_params(m):
    """One layer's NormFormer parameters, as models/layer.DecoderLayer builds them."""
    dim, ffn = m.decoder_embed_dim, m.decoder_ffn_embed_dim
    per_width = 2 if m.norm_type == "layernorm" and not m.no_bias else 1  # a norm's weight (and bias)
    return (
        per_width * dim * m.scale_attn
        + m.decoder_attention_heads * m.scale_heads
        + per_width * ffn * m.scale_fc
        + dim * m.scale_resids
    )


def projection_params(m, vocab):
    """project_in_dim and project_out_dim, fairseq's d×d quant_noise layer (--quant-noise-pq
    without an adaptive input), and, without adaptive bands (counted by
    adaptive_vocab_params), the embedding and output tables' width other than d."""
    dim = m.decoder_embed_dim
    width_in, width_out = m.decoder_input_dim or dim, m.decoder_output_dim or dim
    total = dim * dim if m.quant_noise_pq > 0 and not m.adaptive_input else 0
    if not m.adaptive_input and width_in != dim:
        total += width_in * dim
    if width_out != dim and not m.tie_adaptive_weights:
        total += dim * width_out
    if not m.adaptive_input and m.adaptive_softmax_cutoff is None:
        total += vocab * (width_in - dim) + (0 if m.share_decoder_input_output_embed else vocab * (width_out - dim))
    return total


def adaptive_vocab_params(m, vocab):
    """Parameters of an adaptive input plus the output layer, or of the embedding plus an
    adaptive softmax, as models/adaptive.py builds them; None without either."""
    softmax = m.adaptive_softmax_cutoff is not None
    if not (m.adaptive_input or softmax):
        return None
    if not vocab:  # not known yet (the launcher's lower bound), as V×d tables of V=0 count nothing
        return 0
    check_adaptive_vocab(m, vocab)
    dim = m.decoder_embed_dim
    if m.adaptive_input:  # each band: its table and its projection to d
        bands = adaptive_bands(m.adaptive_input_cutoff, vocab, m.decoder_input_dim or dim, m.adaptive_input_factor)
        total = sum((end - start) * width + width * dim for start, end, width in bands)
    else:
        total = vocab * (m.decoder_input_dim or dim)
    out = m.decoder_output_dim or dim
    if not softmax:
        return total + vocab * out
    bands = adaptive_bands(m.adaptive_softmax_cutoff, vocab, out, m.adaptive_softmax_factor)
    tails = len(bands) - 1
    if m.tie_adaptive_weights:  # the word tables are the input's: the clusters' scores and untied projections
        return total + out * tails + (0 if m.tie_adaptive_proj else sum(out * w for _, _, w in bands[1:]))
    return total + out * (bands[0][1] + tails) + sum(out * w + w * (end - start) for start, end, w in bands[1:])


def sequences_per_batch(cfg):
    dataset, T = cfg.dataset, cfg.task.tokens_per_sample
    if dataset.batch_size:
        return min(dataset.batch_size, dataset.max_tokens // T) if dataset.max_tokens else dataset.batch_size
    return max(dataset.max_tokens // T, 1)


def setup_of(cfg, device, ranks_per_host):
    """The Setup of a composed config (its implied settings resolved: trainer/config/implied.py)."""
    distributed, common = cfg.distributed_training, cfg.common
    world = distributed.distributed_world_size
    tp, cp = common.model_parallel_size, common.context_parallel_size
    shard = 1
    if distributed.ddp_backend in ("fully_sharded", "hybrid_shard"):
        shard = fsdp_shard(distributed, world, ranks_per_host, tp)
    optimizer = cfg.optimizer
    # sgd keeps a momentum buffer only with momentum; adafactor's and muon's state is counted by shape
    states = ELEMENTWISE_STATES.get(optimizer._name, 1 if optimizer._name == "sgd" and optimizer.momentum else 0)
    return Setup(
        device=device,
        world=world,
        ranks_per_host=ranks_per_host,
        backend=ddp_backend(cfg),
        shard=shard,
        reshard_after_forward=not distributed.no_reshard_after_forward,
        checkpoint_activations=cfg.model.checkpoint_activations,
        offload_activations=cfg.model.offload_activations,
        cpu_offload=distributed.cpu_offload,
        defer_grad_sync=distributed.defer_grad_sync,
        update_freq=cfg.optimization.update_freq,
        sequences=sequences_per_batch(cfg),
        seq_len=cfg.task.tokens_per_sample,
        precision="bf16" if common.bf16 else "fp16" if common.fp16 else "fp32",
        fp32_reduce_scatter=distributed.fp32_reduce_scatter,
        optimizer_states=states,
        spawned=infer_rendezvous(cfg).spawn > 1,
        dpo=cfg.task._name == "dpo",
        packed_documents=cfg.task._name == "sft" or bool(cfg.task.get("per_document_attention", False)),
        optimizer=optimizer._name,
        first_moment=optimizer._name == "adafactor" and optimizer.get("beta1") is not None,
        ema_bytes=ema_bytes(cfg),
        tp=tp,
        cp=cp,
        ep=common.expert_parallel_size,
        model_parallel_ok=model_parallel_ok(cfg),
    )


def fsdp_shard(distributed, world, ranks_per_host, tp):
    """Ranks FSDP shards a parameter over (trainer/parallel/parallelize.py device_meshes):
    all but the tensor-parallel group's (context-parallel ranks shard like data-parallel
    ones), or under hybrid_shard a shard group's, which holds whole tensor-parallel groups."""
    if distributed.ddp_backend == "fully_sharded":
        return max(1, world // tp)
    return max(1, (distributed.shard_group_size or min(ranks_per_host, world)) // tp)


def model_parallel_ok(cfg):
    """Whether tensor parallelism can split this model
    (trainer/config/checks/parallel_dims.py's rules, less the degree's own; a mixture of
    experts takes it: its router and experts stay whole, each rank routing its own positions)."""
    model = cfg.model
    return not (
        cfg.common.compile
        or model.adaptive_input
        or model.adaptive_softmax_cutoff is not None
        or model.quant_noise_pq > 0
        or model.quant_noise_scalar > 0
        or model.scale_fc
    )


def ema_bytes(cfg):
    """Bytes per parameter of --store-ema's average: fp32 with --ema-fp32 or fp32 weights'
    training, else the 16-bit dtype of --fp16/--bf16 (trainer/train/ema.py ema_dtype)."""
    ema, common = cfg.ema, cfg.common
    if not ema.store_ema:
        return 0
    return 4 if ema.ema_fp32 or not (common.fp16 or common.bf16) else 2


def with_flags(s: Setup, **flags):
    """s with these settings, and what they imply, by the rule composition applies to a
    config (trainer/config/implied.py)."""
    s = replace(s, **flags)
    return replace(s, checkpoint_activations=True) if implies_activation_checkpointing(s) else s


def flag_sets(s: Setup, m: ModelShape = None):
    """(label, Setup) for every backend/flag combination worth trying, fastest first. With
    the model `m`, on GPUs, the sharded flag sets are tried on each layout in turn
    (layouts(): fewest model-parallel ranks first), a larger tensor- or context-parallel
    group only when no flag set fits a smaller one: it puts collectives on every layer's
    critical path and narrows every matmul. The offloads, which move states or activations
    over PCIe, come last, on each layout in turn."""
    off = dict(checkpoint_activations=False, offload_activations=False, cpu_offload=False)
    sets, fsdp = [], s
    if not s.sharded:
        sets.append((s.backend, with_flags(s, **off)))
        fsdp = replace(s, backend="fully_sharded", shard=s.world // s.tp)
        if s.world == 1:  # nothing to shard over: checkpointing is the next step
            sets.append((s.backend + " + checkpoint", with_flags(s, **{**off, "checkpoint_activations": True})))
    groups = []
    if s.world > 1 or s.sharded:
        groups.append(
            [
                ("no reshard", dict(reshard_after_forward=False, **off)),
                ("reshard", dict(reshard_after_forward=True, **off)),
                ("reshard + checkpoint", dict(reshard_after_forward=True, **{**off, "checkpoint_activations": True})),
            ]
        )
    if s.device == "cuda":  # on a CPU, both offloads keep the same bytes in the same memory
        on = dict(reshard_after_forward=True)
        groups.append(
            [
                ("+ offload activations", dict(on, offload_activations=True, cpu_offload=False)),
                ("+ cpu offload", dict(on, checkpoint_activations=True, offload_activations=False, cpu_offload=True)),
                ("+ both offloads", dict(on, offload_activations=True, cpu_offload=True)),
            ]
        )
    layout_list = layouts(m, fsdp) if m is not None else [fsdp]
    for group in groups:
        for layout in layout_list:
            sets += [(label + layout_label(layout), with_flags(layout, **flags)) for label, flags in group]
    return sets


def micro_batches(s: Setup):
    """The requested micro-batch, then its divisors, largest first: the global batch stays."""
    total = s.sequences
    return [
        replace(s, sequences=b, update_freq=s.update_freq * total // b) for b in range(total, 0, -1) if total % b == 0
    ]


def fits(p, device_gb, host_gb):
    """host_gb None: the host's memory is unknown (another machine's), so it is not judged."""
    return p.per_rank_gb <= device_gb and (host_gb is None or p.host_gb <= host_gb)


# The on/off flags a Setup stands for: (flag, config key, its value in Setup s), the value
# a resolved config holds (trainer/launch/auto_tune.py writes them into the config).
MEMORY_FLAGS = (
    (
        "--no-reshard-after-forward",
        "distributed_training.no_reshard_after_forward",
        lambda s: s.sharded and not s.reshard_after_forward,
    ),
    ("--checkpoint-activations", "model.checkpoint_activations", lambda s: s.checkpoint_activations),
    ("--offload-activations", "model.offload_activations", lambda s: s.offload_activations),
    ("--cpu-offload", "distributed_training.cpu_offload", lambda s: s.cpu_offload),
)
# Flags another flag implies (trainer/config/implied.py): not printed where implied.
IMPLIED_FLAGS = {"--checkpoint-activations": implies_activation_checkpointing}


def flags_of(s: Setup, given: Setup):
    """What to add to the command line to turn `given` into `s`: flags that switch a
    behaviour on, `key=false` overrides for one the user gave that is not needed."""
    out = [f"--ddp-backend {s.backend}"] if s.backend != given.backend else []
    if s.tp != given.tp:
        out.append(f"--model-parallel-size {s.tp}")
    if s.ep != given.ep:
        out.append(f"--expert-parallel-size {s.ep}")
    if s.cp != given.cp:
        out.append(f"--context-parallel-size {s.cp}")
    for flag, key, value_in in MEMORY_FLAGS:
        implied = IMPLIED_FLAGS.get(flag, lambda _: False)
        want, have = value_in(s) and not implied(s), value_in(given) and not implied(given)
        if want and not have:
            out.append(flag)
        elif have and not want:
            out.append(f"{key}=false")
    if s.sequences != given.sequences or s.update_freq != given.update_freq:
        out.append(f"--batch-size {s.sequences} --update-freq {s.update_freq}")
    return " ".join(out)


def choose(m: ModelShape, given: Setup, device_gb, host_gb):
    """Every candidate tried (label, Setup, Prediction, fits), and the first that fits (or None)."""
    tried, choice = [], None
    for label, s in flag_sets(given, m):
        if choice and (s.tp, s.cp, s.ep) != (choice[1].tp, choice[1].cp, choice[1].ep):
            continue  # a larger layout than the one chosen is never faster; its offloads neither
        for sb in micro_batches(s):
            p = predict(m, sb)
            ok = fits(p, device_gb, host_gb)
            if sb.sequences == s.sequences or ok:
                tried.append((label, sb, p, ok))
            if ok:
                choice = choice or (label, sb, p)
                break
    return tried, choice
