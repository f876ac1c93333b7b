"""Checks of a composed config, before anything is built or written.

Each problem is one UsageError line that names the fix. Runs on the config, so a bad
value is caught the same way whether it came from a flag, a file or an override.
"""
import ast
import difflib
import importlib.util
import math
from dataclasses import fields
from dataclasses import MISSING

from models.config import adaptive_bands, parse_cutoffs
from models.config import head_dim, layers_to_keep
from models.config import TransformerLMConfig
from trainer.config.schema import uses_fsdp
from trainer.errors import UsageError
from trainer.config.flags import flag_name, iter_fields

INIT_METHOD_SCHEMES = ("tcp://", "env://", "file://")


def check_config(cfg):
    for group, f in iter_fields():
        value = cfg[group][f.name]
        choices = f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise UsageError(f"{flag_name(f)} {value!r} is not one of: {', '.join(choices)}")
        # nan passes every comparison below, and no setting means anything at inf.
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag_name(f)} must be a finite number, got {value}")
    m, d, o, t = cfg.model, cfg.distributed_training, cfg.optimization, cfg.task
    _positive(cfg, "model.decoder_layers", "model.decoder_embed_dim", "model.decoder_ffn_embed_dim",
              "model.decoder_attention_heads", "task.tokens_per_sample", "optimization.update_freq",
              "common.log_interval", "distributed_training.distributed_world_size", "task.dict_size",
              "task.dataset_size", "dataset.validate_interval")
    _positive(cfg, "dataset.batch_size", "dataset.max_tokens", "dataset.batch_size_valid",
              "dataset.max_tokens_valid", "model.max_target_positions", "common.peak_tflops",
              "dataset.max_valid_steps", optional=True)
    _positive(cfg, "common.fp16_init_scale", "common.min_loss_scale")
    _non_negative(cfg, "optimization.lr", "optimization.max_update", "optimization.max_epoch",
                  "optimization.clip_norm", "optimizer.weight_decay", "dataset.validate_interval_updates",
                  "lr_scheduler.warmup_updates", "model.min_params_to_wrap")
    for key in ("model.dropout", "model.attention_dropout", "model.activation_dropout"):
        if not 0.0 <= _get(cfg, key) < 1.0:
            raise UsageError(f"{key} must be in [0, 1), got {_get(cfg, key)}")
    _check_attention_shape(cfg)
    if len(cfg.optimizer.adam_betas) != 2:
        raise UsageError(f"--adam-betas needs two numbers like \"(0.9, 0.98)\", got {list(cfg.optimizer.adam_betas)}")
    if not all(0.0 <= b < 1.0 for b in cfg.optimizer.adam_betas):
        raise UsageError(f"--adam-betas must each be in [0, 1), got {list(cfg.optimizer.adam_betas)}")
    _non_negative(cfg, "optimizer.adam_eps", "optimizer.momentum", "lr_scheduler.power", "lr_scheduler.end_learning_rate",
                  "lr_scheduler.min_lr")
    if cfg.lr_scheduler.warmup_init_lr < 0 and cfg.lr_scheduler.warmup_init_lr != -1:
        raise UsageError(f"--warmup-init-lr must be >= 0 (or -1: start at 0), got {cfg.lr_scheduler.warmup_init_lr}")
    if not 0 <= cfg.common.seed < 2 ** 32:
        raise UsageError(f"--seed must be in [0, 2**32), got {cfg.common.seed}")
    if cfg.common.fp16 and cfg.common.bf16:
        raise UsageError("--fp16 and --bf16 are exclusive; pick one")
    sharded = uses_fsdp(cfg)
    for flag, on in (("--cpu-offload", d.cpu_offload), ("--no-reshard-after-forward", d.no_reshard_after_forward),
                     ("--fp32-reduce-scatter", d.fp32_reduce_scatter), ("--use-sharded-state", d.use_sharded_state)):
        if on and not sharded:
            raise UsageError(f"{flag} needs --ddp-backend fully_sharded or hybrid_shard "
                             f"(got {d.ddp_backend})")
    if d.distributed_port != -1 and not 0 < d.distributed_port < 65536:
        raise UsageError(f"--distributed-port {d.distributed_port} is not a port; use 1-65535 or -1 for any free port")
    if not 0 <= d.distributed_rank < d.distributed_world_size:
        raise UsageError(f"--distributed-rank {d.distributed_rank} is not a rank of --distributed-world-size "
                         f"{d.distributed_world_size}; use 0 to {d.distributed_world_size - 1}")
    if d.distributed_init_method and not d.distributed_init_method.startswith(INIT_METHOD_SCHEMES):
        raise UsageError(f"--distributed-init-method {d.distributed_init_method!r} is not a rendezvous address; "
                         "use tcp://HOST:PORT, env:// or file:///SHARED/PATH")
    _positive(cfg, "distributed_training.memory_budget_gb", optional=True)
    if d.memory_budget_gb is not None and not d.auto_tune:
        raise UsageError("--memory-budget-gb is the budget of --auto-tune; add --auto-tune (or run `plan`)")
    if d.shard_group_size is not None and d.shard_group_size < 1:
        raise UsageError(f"--shard-group-size must be positive, got {d.shard_group_size}")
    if d.shard_group_size is not None and d.ddp_backend != "hybrid_shard":
        raise UsageError("--shard-group-size needs --ddp-backend hybrid_shard")
    # A world size of 1 in the config may be torchrun's or SLURM's to fill in: checked there.
    if d.shard_group_size and d.distributed_world_size > 1 and d.distributed_world_size % d.shard_group_size:
        raise UsageError(f"--shard-group-size {d.shard_group_size} does not divide --distributed-world-size "
                         f"{d.distributed_world_size}; pick a divisor")
    ck = cfg.checkpoint
    resets = [f for f, on in (("--reset-optimizer", ck.reset_optimizer), ("--reset-lr-scheduler", ck.reset_lr_scheduler),
                              ("--reset-dataloader", ck.reset_dataloader), ("--reset-meters", ck.reset_meters)) if on]
    if ck.finetune_from_model and resets:
        raise UsageError(f"--finetune-from-model already resets the optimizer, lr schedule, data and meters; "
                         f"drop {resets[0]}")
    _non_negative(cfg, "checkpoint.save_interval_updates")
    _positive(cfg, "checkpoint.save_interval")
    if cfg.dataset.batch_size is None and cfg.dataset.max_tokens is None:  # with DATA (compose sets one without)
        raise UsageError("set --batch-size or --max-tokens (sequences or tokens per batch per rank)")
    for flag, max_tokens in (("--max-tokens", cfg.dataset.max_tokens), ("--max-tokens-valid", cfg.dataset.max_tokens_valid)):
        if max_tokens is not None and max_tokens < t.tokens_per_sample:  # fairseq: "exceeds max_tokens limit"
            raise UsageError(f"{flag} {max_tokens} is smaller than one sample (--tokens-per-sample "
                             f"{t.tokens_per_sample}); raise it or lower --tokens-per-sample")
    if t._name == "dummy_lm":
        if t.data:
            raise UsageError(f"--task dummy_lm makes random tokens and reads no DATA ({t.data}); drop DATA or the task")
        if t.dict_size <= 4:
            raise UsageError(f"--dict-size {t.dict_size} leaves no tokens beside the 4 special symbols; use at least 5")
    if cfg.lr_scheduler._name == "polynomial_decay" and not (cfg.lr_scheduler.total_num_update or o.max_update):
        raise UsageError("--lr-scheduler polynomial_decay needs --total-num-update or --max-update")
    _check_unsupported_model_keys(m)
    if m.max_target_positions is not None and t.tokens_per_sample > m.max_target_positions:
        raise UsageError(f"--tokens-per-sample {t.tokens_per_sample} exceeds the model's "
                         f"--max-target-positions {m.max_target_positions}; lower one or raise the other")
    _check_wandb(cfg)
    _check_optim(cfg)
    _check_adaptive(cfg)
    _check_model_features(cfg)
    _check_data(cfg)


def _check_unsupported_model_keys(m):
    """fairseq model options that shardlm does not build; their keys load at their do-nothing
    values (fairseq's own model YAML files list them all)."""
    if m.character_embeddings:
        raise UsageError("--character-embeddings (fairseq's character-CNN input) is not supported: shardlm's models "
                         "embed tokens (see --adaptive-input for smaller tables); drop it")
    for flag, value in (("--quant-noise-pq", m.quant_noise_pq), ("--quant-noise-scalar", m.quant_noise_scalar)):
        if value:
            raise UsageError(f"{flag} {value}: Quant-Noise (training for post-training quantization) is not "
                             "supported; set it to 0")


def parse_model_overrides(text):
    """eval-lm's --model-overrides, fairseq's Python dict literal of model keys → {key: value}."""
    try:
        overrides = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        overrides = None
    if not isinstance(overrides, dict):
        raise UsageError(f"--model-overrides {text!r} is not a dict; write it as fairseq does, e.g. "
                         "\"{'decoder_layers_to_keep':'0,2,4'}\"")
    known = {f.name for f in fields(TransformerLMConfig)} - {"_name"}
    for key in overrides:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {near[0]}?" if near else "see `train --help`, group model"
            raise UsageError(f"--model-overrides: {key!r} is not a model key ({hint})")
    return overrides


def _get(cfg, key):
    group, name = key.split(".")
    return cfg[group][name]


def _positive(cfg, *keys, optional=False):
    for key in keys:
        v = _get(cfg, key)
        if v is None and optional:
            continue
        if v is None or v <= 0:
            raise UsageError(f"{key} must be positive, got {v}")


def _non_negative(cfg, *keys):
    for key in keys:
        if _get(cfg, key) < 0:
            raise UsageError(f"{key} must be >= 0, got {_get(cfg, key)}")


def _check_wandb(cfg):
    """--wandb-project needs the optional wandb package: say so before any rank starts.
    find_spec looks for it without importing it (a slow import)."""
    if cfg.common.wandb_project and importlib.util.find_spec("wandb") is None:
        raise UsageError("--wandb-project needs the wandb package: pip install 'shardlm[wandb]' (or wandb)")


def _check_adaptive(cfg):
    """Adaptive input and softmax: fairseq's asserts, and the options that would do nothing."""
    m, criterion = cfg.model, cfg.criterion._name
    softmax = m.adaptive_softmax_cutoff is not None
    if softmax and criterion != "adaptive_loss":
        raise UsageError("--adaptive-softmax-cutoff is trained by its own loss: add --criterion adaptive_loss")
    if criterion == "adaptive_loss" and not softmax:
        raise UsageError("--criterion adaptive_loss needs an adaptive softmax: set --adaptive-softmax-cutoff "
                         "(e.g. 20000,60000) or use --criterion cross_entropy")
    if m.adaptive_input and m.adaptive_input_cutoff is None:
        raise UsageError("--adaptive-input needs --adaptive-input-cutoff (e.g. 20000,60000)")
    if m.share_decoder_input_output_embed and (m.adaptive_input or softmax):
        raise UsageError("--share-decoder-input-output-embed ties one full table to a full output projection; with "
                         "--adaptive-input / --adaptive-softmax-cutoff use --tie-adaptive-weights instead")
    for flag, value, unset, needs, on in (
            ("--adaptive-input-cutoff", m.adaptive_input_cutoff, None, "--adaptive-input", m.adaptive_input),
            ("--adaptive-input-factor", m.adaptive_input_factor, 4.0, "--adaptive-input", m.adaptive_input),
            ("--adaptive-softmax-dropout", m.adaptive_softmax_dropout, 0.0, "--adaptive-softmax-cutoff", softmax),
            ("--adaptive-softmax-factor", m.adaptive_softmax_factor, 4.0, "--adaptive-softmax-cutoff", softmax),
            ("--tie-adaptive-weights", m.tie_adaptive_weights, False, "--adaptive-input and --adaptive-softmax-cutoff",
             m.adaptive_input and softmax),
            ("--tie-adaptive-proj", m.tie_adaptive_proj, False, "--tie-adaptive-weights", m.tie_adaptive_weights)):
        if value != unset and not on:
            raise UsageError(f"{flag} {value} does nothing without {needs}; add {needs} or drop {flag}")
    for flag, value in (("--adaptive-input-factor", m.adaptive_input_factor),
                        ("--adaptive-softmax-factor", m.adaptive_softmax_factor)):
        if value <= 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    if not 0.0 <= m.adaptive_softmax_dropout < 1.0:
        raise UsageError(f"--adaptive-softmax-dropout must be in [0, 1), got {m.adaptive_softmax_dropout}")
    cutoffs = {}
    for flag, text in (("--adaptive-input-cutoff", m.adaptive_input_cutoff),
                       ("--adaptive-softmax-cutoff", m.adaptive_softmax_cutoff)):
        if text is not None:
            try:
                cutoffs[flag] = parse_cutoffs(text)
            except ValueError as e:
                raise UsageError(f"{flag} {text!r} {e}") from None
    if m.tie_adaptive_weights:  # fairseq's asserts in TransformerLanguageModel.build_model
        if m.adaptive_input_factor != m.adaptive_softmax_factor:
            raise UsageError(f"--tie-adaptive-weights needs --adaptive-input-factor {m.adaptive_input_factor} equal to "
                             f"--adaptive-softmax-factor {m.adaptive_softmax_factor}")
        if cutoffs["--adaptive-input-cutoff"] != cutoffs["--adaptive-softmax-cutoff"]:
            raise UsageError(f"--tie-adaptive-weights needs --adaptive-input-cutoff {m.adaptive_input_cutoff} equal to "
                             f"--adaptive-softmax-cutoff {m.adaptive_softmax_cutoff}")
        d = m.decoder_embed_dim
        if (m.decoder_input_dim or d) != d or (m.decoder_output_dim or d) != d:
            raise UsageError("--tie-adaptive-weights needs --decoder-input-dim and --decoder-output-dim equal to "
                             f"--decoder-embed-dim {d} (the tied tables serve both ends)")
    if cfg.task._name == "dummy_lm":  # the vocabulary is known now; with DATA, once it is read
        check_adaptive_vocab(m, cfg.task.dict_size)


def check_adaptive_vocab(m, vocab_size, padding_idx=1):
    """The adaptive cutoffs against the vocabulary (fairseq asserts none is larger), and
    each adaptive input band at least 1 wide."""
    d = m.decoder_embed_dim
    for on, flag, text, dim_flag, dim, factor_flag, factor in (
            (m.adaptive_input, "--adaptive-input-cutoff", m.adaptive_input_cutoff, "--decoder-input-dim",
             m.decoder_input_dim or d, "--adaptive-input-factor", m.adaptive_input_factor),
            (m.adaptive_softmax_cutoff is not None, "--adaptive-softmax-cutoff", m.adaptive_softmax_cutoff,
             "--decoder-output-dim", m.decoder_output_dim or d, "--adaptive-softmax-factor", m.adaptive_softmax_factor)):
        if not on:
            continue
        try:
            bands = adaptive_bands(text, vocab_size, dim, factor)
        except ValueError as e:
            fix = ("smaller --adaptive-input-cutoff and --adaptive-softmax-cutoff (equal, as --tie-adaptive-weights "
                   "needs)" if m.tie_adaptive_weights else f"a smaller {flag}")
            raise UsageError(f"{flag} {text} {e}: pass {fix}, every cutoff at most {vocab_size}") from None
        if flag != "--adaptive-input-cutoff":
            # A softmax tail 0 wide scores its words uniformly (its projections are empty
            # matrices), as in fairseq, whose own tests train one.
            continue
        if bands[0][1] <= padding_idx:
            raise UsageError(f"{flag} {text}: the first band must hold the padding id {padding_idx}; "
                             f"start the cutoffs above {padding_idx}")
        narrow = next(((i, w) for i, (_, _, w) in enumerate(bands) if w < 1), None)
        if narrow is not None:  # fairseq fails initializing such a table (std = width^-0.5)
            raise UsageError(f"{factor_flag} {factor} leaves band {narrow[0]} of {flag} {text} {narrow[1]} wide "
                             f"from {dim_flag} {dim}; lower the factor or pass fewer cutoffs")


# Options read by some optimizers or schedules only: set (away from its default) for
# another, each would be accepted and ignored.
OPTION_READERS = {
    "optimizer.momentum": ("sgd", "nag"),
    "optimizer.adam_betas": ("adam", "adamw", "cpu_adam"),
    "optimizer.adam_eps": ("adam", "adamw", "cpu_adam"),
    "lr_scheduler.min_lr": ("cosine",),
    "lr_scheduler.t_mult": ("cosine",),
    "lr_scheduler.lr_period_updates": ("cosine",),
    "lr_scheduler.lr_shrink": ("cosine", "reduce_lr_on_plateau"),
    "lr_scheduler.lr_threshold": ("reduce_lr_on_plateau",),
    "lr_scheduler.lr_patience": ("reduce_lr_on_plateau",),
    "lr_scheduler.end_learning_rate": ("polynomial_decay",),
    "lr_scheduler.power": ("polynomial_decay",),
    "lr_scheduler.total_num_update": ("polynomial_decay",),
}


def _check_optim(cfg):
    """--optimizer and --lr-scheduler: their pairings, their options' ranges, and options
    set for an optimizer or schedule that does not read them."""
    o, s, opt = cfg.optimization, cfg.lr_scheduler, cfg.optimizer
    fields = {f"{group}.{f.name}": f for group, f in iter_fields()}
    for key, readers in OPTION_READERS.items():
        f, group = fields[key], key.split(".")[0]
        default = f.default_factory() if f.default is MISSING else f.default
        value = list(_get(cfg, key)) if isinstance(default, list) else _get(cfg, key)
        chosen = cfg[group]._name
        if chosen not in readers and value != default:
            flag = "--optimizer" if group == "optimizer" else "--lr-scheduler"
            hint = "; to stop training at a low lr: --stop-min-lr" if key == "lr_scheduler.min_lr" else ""
            names = f"{', '.join(readers[:-1])} or {readers[-1]}" if len(readers) > 1 else readers[0]
            raise UsageError(f"{flag_name(f)} is read by {flag} {names} only (got {chosen}); "
                             f"drop it{hint}")
    if opt._name == "cpu_adam" and not cfg.distributed_training.cpu_offload:
        raise UsageError("--optimizer cpu_adam steps Adam on the host, over the shards --cpu-offload keeps there "
                         "(fairseq's pairing); add --cpu-offload (with --ddp-backend fully_sharded), or use "
                         "--optimizer adam")
    if s._name == "cosine":
        if s.t_mult <= 0:
            raise UsageError(f"--t-mult must be positive (each cosine cycle's length over the last's), got {s.t_mult}")
        if s.lr_shrink <= 0:
            raise UsageError(f"--lr-shrink must be positive (each cosine cycle's lr over the last's), "
                             f"got {s.lr_shrink}")
        if s.lr_period_updates != -1 and s.lr_period_updates <= 0:
            raise UsageError(f"--lr-period-updates must be positive (or -1: --max-update minus --warmup-updates), "
                             f"got {s.lr_period_updates}")
        if s.lr_period_updates == -1 and not o.max_update:
            raise UsageError("--lr-scheduler cosine needs --lr-period-updates or --max-update")
        period = s.lr_period_updates if s.lr_period_updates > 0 else max(o.max_update - s.warmup_updates, 1)
        if s.t_mult < 1 and not (o.max_update and o.max_update - s.warmup_updates < period / (1 - s.t_mult)):
            # fairseq's formula has no cycle past the sum of the shrinking cycles' lengths
            raise UsageError(f"--t-mult {s.t_mult} shrinks the cosine cycles to {period / (1 - s.t_mult):g} updates "
                             f"in all, fewer than --max-update {o.max_update or 'unlimited'} after warmup; use "
                             "--t-mult 1 or more, or a longer --lr-period-updates")
    if s._name == "reduce_lr_on_plateau":
        if not 0 < s.lr_shrink < 1:
            raise UsageError(f"--lr-shrink must be in (0, 1) for reduce_lr_on_plateau (the lr's factor on a "
                             f"plateau), got {s.lr_shrink}")
        _non_negative(cfg, "lr_scheduler.lr_threshold", "lr_scheduler.lr_patience")


def _check_attention_shape(cfg):
    """Heads, their width, grouped-query attention, rotary embeddings and norms."""
    m = cfg.model
    _positive(cfg, "model.decoder_kv_heads", "model.decoder_head_dim", optional=True)
    _positive(cfg, "model.norm_eps", "model.rope_theta")
    if m.decoder_head_dim is None and m.decoder_embed_dim % m.decoder_attention_heads:
        raise UsageError(f"--decoder-attention-heads {m.decoder_attention_heads} does not divide "
                         f"--decoder-embed-dim {m.decoder_embed_dim}; pick heads that divide it "
                         "(or set --decoder-head-dim)")
    if m.decoder_kv_heads is not None and m.decoder_attention_heads % m.decoder_kv_heads:
        raise UsageError(f"--decoder-kv-heads {m.decoder_kv_heads} does not divide --decoder-attention-heads "
                         f"{m.decoder_attention_heads}: each key/value head serves a whole group of query heads")
    if m.rope:
        if head_dim(m) % 2:
            raise UsageError(f"--rope rotates pairs of channels: the head width {head_dim(m)} must be even")
        if m.decoder_learned_pos:
            raise UsageError("--rope and --decoder-learned-pos are two position encodings; drop one")
        if m.rope_scaling == "llama3" and not (m.rope_scaling_factor > 0 and 0 < m.rope_low_freq_factor
                                               < m.rope_high_freq_factor and m.rope_original_max_positions > 0):
            raise UsageError("--rope-scaling llama3 needs --rope-scaling-factor > 0, 0 < --rope-low-freq-factor < "
                             "--rope-high-freq-factor and --rope-original-max-positions > 0")
    elif m.rope_scaling is not None:
        raise UsageError(f"--rope-scaling {m.rope_scaling} scales rotary embeddings: add --rope")


def _check_model_features(cfg):
    """LayerDrop, pruning to --decoder-layers-to-keep, and the embedding/output widths."""
    m = cfg.model
    if not 0.0 <= m.decoder_layerdrop < 1.0:
        raise UsageError(f"--decoder-layerdrop must be in [0, 1) (each layer's chance to be skipped), "
                         f"got {m.decoder_layerdrop}")
    try:
        layers_to_keep(m)
    except ValueError as e:
        raise UsageError(f"--decoder-layers-to-keep {m.decoder_layers_to_keep!r} {e}; give distinct ids "
                         f"from 0 to {m.decoder_layers - 1}, e.g. 0,2") from None
    _positive(cfg, "model.decoder_input_dim", "model.decoder_output_dim", optional=True)
    d = m.decoder_embed_dim
    width_in, width_out = m.decoder_input_dim or d, m.decoder_output_dim or d
    if m.share_decoder_input_output_embed and not m.adaptive_input and width_in != width_out:
        raise UsageError(f"--share-decoder-input-output-embed uses the embedding table as the output projection: "
                         f"--decoder-input-dim {width_in} and --decoder-output-dim {width_out} must be equal")


def _check_data(cfg):
    """Data loading and batching (trainer/train/task.py, data/iterator.py)."""
    t, m = cfg.task, cfg.model
    _positive(cfg, "dataset.required_batch_size_multiple")
    _non_negative(cfg, "dataset.num_workers")
    if t.add_bos_token and m.max_target_positions is not None and t.tokens_per_sample + 1 > m.max_target_positions:
        raise UsageError(f"--add-bos-token makes samples of --tokens-per-sample + 1 = {t.tokens_per_sample + 1} "
                         f"tokens, more than --max-target-positions {m.max_target_positions}; raise it or lower "
                         "--tokens-per-sample")
