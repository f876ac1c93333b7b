"""The tensors of a checkpoint: what DCP saves (model and optimizer state, without wrapper
prefixes), the checks that refuse another model or another optimizer in one line, and
a load that reads tensors only, never a pickled object."""

import warnings
from pathlib import Path

from omegaconf import OmegaConf

from models.config import layers_to_keep
from trainer.config.flags import flag_name, iter_fields
from trainer.errors import UsageError
from trainer.formats.shardlm import checkpoint_dir

# One process without a process group is a normal way to save and load here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def tensor_state(model, optimizer, with_optimizer=True, ema=None):
    """{"model": …, "optim": …, "ema": …} as DCP saves it: sharded DTensors under FSDP, whole
    tensors otherwise; names without wrapper prefixes, so every backend reads every other's.
    ema: --store-ema's average (trainer/train/ema.py), under the parameters' names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if with_optimizer and optimizer is not None:
        # Only the per-parameter tensors: lr, betas, … come from the config on resume.
        state["optim"] = get_optimizer_state_dict(model, optimizer)["state"]
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


# The options that decide which parameters a model has and their shapes, in the order a
# mismatch is best explained by.
SHAPE_OPTIONS = (
    "model.decoder_embed_dim",
    "model.decoder_ffn_embed_dim",
    "model.decoder_layers",
    "model.share_decoder_input_output_embed",
    "model.decoder_learned_pos",
    "model.no_token_positional_embeddings",
    "model.layernorm_embedding",
    "model.no_decoder_final_norm",
    "model.decoder_layers_to_keep",
    "model.decoder_input_dim",
    "model.decoder_output_dim",
    "model.scale_attn",
    "model.scale_fc",
    "model.scale_heads",
    "model.scale_resids",
    "model.adaptive_input",
    "model.adaptive_input_cutoff",
    "model.adaptive_input_factor",
    "model.adaptive_softmax_cutoff",
    "model.adaptive_softmax_factor",
    "model.tie_adaptive_weights",
    "model.tie_adaptive_proj",
    "model.quant_noise_pq",  # 0 or not: fairseq's quant_noise layer or none
    "model.max_target_positions",
    "task.tokens_per_sample",
    "task.dict_size",
    "task.data",
)


def shape_option_difference(path, cfg):
    """'--decoder-embed-dim 128 in the checkpoint, 64 here' for the first model option
    that differs from the checkpoint's config.yaml; '' when none does or it cannot be read."""

    try:
        saved = OmegaConf.load(Path(path) / "config.yaml")
    except Exception:  # an old or hand-made checkpoint: the parameter names will do
        return ""
    flags = {f"{group}.{f.name}": flag_name(f) for group, f in iter_fields()}
    for key in SHAPE_OPTIONS:
        there, here = OmegaConf.select(saved, key), OmegaConf.select(cfg, key)
        if there != here:
            flag = "DATA" if key == "task.data" else flags.get(key, key)
            return f"{flag} {there} in the checkpoint, {here} here"
    return ""


def saved_layer_ids(model_cfg, saved_names):
    """Which checkpoint layer each of this model's layers loads from: for a model pruned by
    --decoder-layers-to-keep and a checkpoint of all --decoder-layers layers, layer i here
    is layer keep[i] there (fairseq's checkpoint_utils.prune_state_dict). None when the
    checkpoint holds this model's own layers (one trained or exported pruned, or no pruning)."""
    keep = layers_to_keep(model_cfg)
    saved_layers = {name.split(".")[1] for name in saved_names if name.startswith("layers.")}
    if keep is None or len(saved_layers) == len(keep) or len(saved_layers) != model_cfg.decoder_layers:
        return None
    return keep


def renumber_layers(tensors, ids):
    """{name: value} with each `layers.<i>.…` name renamed `layers.<ids[i]>.…` (ids: a list or
    a dict); `tensors` itself when ids is None."""
    if ids is None:
        return tensors

    def rename(name):
        head, _, rest = name.partition(".")
        if head != "layers":
            return name
        i, _, tail = rest.partition(".")
        return f"layers.{ids[int(i)]}.{tail}"

    return {rename(name): value for name, value in tensors.items()}


def check_shapes(path, model_state, cfg=None, kept_layers=None, prefix=checkpoint_dir.MODEL_PREFIX):
    """Refuse a checkpoint of another model in one line naming the first difference.
    kept_layers: the checkpoint's layers a pruned model loads (`saved_layer_ids`); the
    others are not refused as extra. prefix: the part checked (the weights; the average's)."""
    saved = checkpoint_dir.tensor_specs(path, prefix)
    if kept_layers is not None:
        kept = {str(i) for i in kept_layers}
        saved = {n: spec for n, spec in saved.items() if not n.startswith("layers.") or n.split(".")[1] in kept}
    fix = "pass the model flags it was trained with, or another --save-dir"

    def refuse(what):
        option = shape_option_difference(path, cfg) if cfg is not None else ""
        return UsageError(
            f"checkpoint {path} holds a different model: " + (f"{option} ({what})" if option else what) + f"; {fix}"
        )

    for name, tensor in model_state.items():
        if name not in saved:
            raise refuse(f"it has no parameter {name}")
        shape = tuple(tensor.shape)
        if saved[name][0] != shape:
            raise refuse(f"{name} is {list(saved[name][0])} there and {list(shape)} here")
    extra = sorted(set(saved) - set(model_state))
    if extra:
        raise refuse(f"it has parameter {extra[0]}, which this model lacks")


# Optimizers whose state is the same tensors: their checkpoints resume one another.
SAME_STATE = {"adamw": "adam", "cpu_adam": "adam"}


def check_optimizer_name(path, saved, here):
    """Refuse a checkpoint whose optimizer state is another optimizer's, in one line. `saved`:
    the --optimizer recorded with it (None in checkpoints older than the record: their
    state's keys are checked as before, by check_optimizer_state)."""
    if saved is None or SAME_STATE.get(saved, saved) == SAME_STATE.get(here, here):
        return
    raise UsageError(
        f"checkpoint {path} holds --optimizer {saved}'s state, not {here}'s; resume with --optimizer {saved}, "
        f"or pass --reset-optimizer to start {here} afresh"
    )


def check_optimizer_state(path, optim_state):
    """Refuse optimizer state the checkpoint does not have (another --optimizer) in one line.
    Returns the parameters it has no state for at all while it has some for others: never
    stepped yet (LayerDrop skipped their layer in every update so far), they go on without."""
    saved = set(checkpoint_dir.read_metadata(path).state_dict_metadata)
    stepped = {fqn for fqn, entries in optim_state.items() if any(f"optim.{fqn}.{key}" in saved for key in entries)}
    never_stepped = set(optim_state) - stepped if stepped else set()
    for fqn, entries in optim_state.items():
        if fqn in never_stepped:
            continue
        for key in entries:
            if f"optim.{fqn}.{key}" not in saved:
                raise UsageError(
                    f"checkpoint {path} has no optimizer state {key!r} for {fqn} (saved with another "
                    "--optimizer?); pass --reset-optimizer to start the optimizer afresh"
                )
    return never_stepped


def load_tensors(path, state, row_orders=None):
    """Fill `state`'s tensors in place from checkpoint `path` (any world size, any backend).
    row_orders: tensor parallelism's orders of the model's rows (trainer/checkpoint/tp_rows.py)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    planner = checkpoint_dir.NoBytesLoadPlanner()
    if row_orders:
        from trainer.checkpoint.tp_rows import row_order_load  # DCP planners: imported where used

        planner = row_order_load(type(planner), row_orders)
    try:
        dcp.load(state, storage_reader=checkpoint_dir.safe_reader(path), planner=planner)
    except UsageError:
        raise
    except (Exception, CheckpointException) as e:  # a truncated or damaged shard: DCP's error is pages long
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = (lines[-1] if lines else type(e).__name__).split(". ")[0][:200]
        raise UsageError(
            f"checkpoint {path} could not be read ({why}); pass another --restore-file "
            "(an older checkpoint_N_M) or move this one away"
        ) from None
