"""The config schema: one dataclass per config group, registered in Hydra's ConfigStore.

Each group's docstring names the modules where its fields take effect. Every field is
settable three ways — a fairseq flag generated from the field (trainer/config/flags.py),
a YAML key, a dotted override (trainer/config/compose.py) — so a field is the single
definition of an option. Field metadata: `help`; `choices`; `flag` when the
fairseq spelling is not `--field-name`; `alias` for a second spelling.
Torch-free: `train --help` must answer before torch is imported.
"""

from dataclasses import dataclass, field, fields
from typing import List, Optional

from models.config import PRESETS, TransformerLMConfig
from trainer.config.distributed_schema import DistributedTrainingConfig
from trainer.config.lr_scheduler_schema import LRSchedulerConfig
from trainer.config.optimizer_schema import OptimizerConfig
from trainer.config.option_field import option as _f

SHARDED_BACKENDS = ("fully_sharded", "hybrid_shard")
# fairseq's second names of two backends: the config keeps what the user wrote, the code
# reads ddp_backend(cfg).
BACKEND_ALIASES = {"c10d": "pytorch_ddp", "no_c10d": "legacy_ddp"}
LOG_FORMATS = ("json", "simple", "tqdm", "none")
BREAK_MODES = ("none", "complete", "complete_doc", "eos")


@dataclass
class CommonConfig:
    """Logging (trainer/train/progress.py), seed (train/main.py), device and precision
    (parallel/ranks.py, parallel/parallelize.py, train/trainer.py), --host-allocator
    (cpu/rank.py), --compile (parallel/parallelize.py)."""

    log_interval: int = _f(100, "log a train_inner record every N updates")
    log_format: Optional[str] = _f(None, "log format (default: tqdm on a terminal, else simple)", choices=LOG_FORMATS)
    log_file: Optional[str] = _f(None, "also write the log to this file")
    no_progress_bar: bool = _f(False, "no progress bar (log format defaults to simple)")
    tensorboard_logdir: Optional[str] = _f(None, "write scalars for TensorBoard under this directory")
    seed: int = _f(1, "random seed; the same seed gives the same run")
    cpu: bool = _f(False, "train on the CPU even when a GPU is present")
    fp16: bool = _f(False, "fp16 mixed precision with dynamic loss scaling")
    bf16: bool = _f(False, "bf16 mixed precision (no loss scaling)")
    memory_efficient_fp16: bool = _f(
        False,
        "implies --fp16 (fairseq's rule). shardlm never keeps an fp16 copy of the "
        "weights beside fp32 masters: the one copy is fp32, sharded under FSDP, cast "
        "per layer in forward",
    )
    memory_efficient_bf16: bool = _f(False, "implies --bf16, as --memory-efficient-fp16 implies --fp16")
    fp16_init_scale: float = _f(128.0, "initial fp16 loss scale")
    fp16_scale_window: Optional[int] = _f(
        None, "updates without overflow before the loss scale doubles (default: 2**14 / world size / update freq)"
    )
    min_loss_scale: float = _f(1e-4, "stop training when the fp16 loss scale falls below this")
    wandb_project: Optional[str] = _f(
        None,
        "also log to this Weights & Biases project from rank 0 (run name: "
        "$WANDB_NAME or the --save-dir's name; needs pip install 'shardlm[wandb]'). "
        "Unless $WANDB_MODE is set, a run that cannot reach W&B (no network, no "
        "`wandb login`) logs offline under ./wandb or $WANDB_DIR: `wandb sync` "
        "uploads it later",
    )
    peak_tflops: Optional[float] = _f(
        None, "the device's peak TFLOP/s per rank in the training dtype: log records add mfu = tflops / (peak x ranks)"
    )
    host_allocator: str = _f(
        "caching",
        "allocator of tensors in host memory: caching keeps freed pages and "
        "serves later tensors of any size from them, as CUDA's allocator does (built on "
        "first use with the system's C++ compiler; Linux; CPU ranks only); glibc: plain glibc "
        "malloc, also what a rank falls back to without a compiler",
        choices=("caching", "glibc"),
    )
    compile: bool = _f(
        False,
        "compile each decoder layer with torch.compile (inductor) before sharding; "
        "the first updates are slower while it compiles (on a CPU it needs a C++ compiler)",
    )
    model_parallel_size: int = _f(
        1,
        "tensor parallelism (Megatron's, with sequence parallelism): split each layer's heads, "
        "feed-forward width and the vocabulary over N ranks of a node, which see the same batches; "
        "FSDP (--ddp-backend fully_sharded / hybrid_shard) shards over the world size / N others",
        alias="--tensor-parallel-size",
    )
    context_parallel_size: int = _f(
        1,
        "context parallelism (Megatron's --context-parallel-size): each of N ranks holds 1/N of every "
        "sequence's positions (a chunk from each end, which balances causal attention) and attention "
        "gathers the others' keys and values; with --model-parallel-size, ranks are data × context × tensor",
    )
    quantization_config_path: Optional[str] = _f(
        None,
        "iterative product quantization (fairseq's iPQ, examples/quant_noise): a YAML of n_centroids, block_sizes "
        "and layers_to_quantize (one regex of fairseq's layer names per stage); each stage quantizes its layers "
        "with k-means and trains their centroids, the stages spread over --max-epoch or --max-update",
    )
    expert_parallel_size: int = _f(
        1,
        "expert parallelism: split each mixture-of-experts layer's experts over N consecutive data-parallel "
        "ranks, whose tokens travel to their experts' ranks and back (all-to-all); FSDP shards the experts over "
        "the world size / N ranks that hold the same ones",
    )


@dataclass
class DatasetConfig:
    """Batches (trainer/train/task.py) and validation (train/loop.py)."""

    batch_size: Optional[int] = _f(
        None,
        "sequences per batch per rank (this or --max-tokens is required with DATA; the embedded corpus defaults to 8)",
        alias="--max-sentences",
    )
    max_tokens: Optional[int] = _f(None, "tokens per batch per rank")
    train_subset: str = _f("train", "split to train on")
    valid_subset: str = _f("valid", "split(s) to validate on, comma-separated")
    batch_size_valid: Optional[int] = _f(None, "validation batch size (default: --batch-size)")
    max_tokens_valid: Optional[int] = _f(None, "validation max tokens (default: --max-tokens)")
    validate_interval: int = _f(1, "validate every N epochs")
    validate_interval_updates: int = _f(0, "also validate every N updates (0: only at epoch ends)")
    num_workers: int = _f(1, "processes that read and collate batches ahead of training (0: in the training process)")
    required_batch_size_multiple: int = _f(8, "cut each batch to a multiple of N sequences when it holds N or more")
    skip_invalid_size_inputs_valid_test: bool = _f(
        False, "drop validation/test samples longer than --tokens-per-sample (default: refuse them)"
    )
    combine_valid_subsets: Optional[bool] = _f(
        None, "validate on valid, valid1, valid2, … as one split", alias="--combine-val"
    )
    max_valid_steps: Optional[int] = _f(None, "validate on at most N batches", alias="--nval")
    disable_validation: bool = _f(False, "never validate")


@dataclass
class OptimizationConfig:
    """When to stop (trainer/train/loop.py), --update-freq and --clip-norm (train/trainer.py),
    --lr (train/optim.py)."""

    max_epoch: int = _f(0, "stop after N epochs (0: no limit)")
    max_update: int = _f(0, "stop after N updates (0: no limit)")
    lr: float = _f(
        0.25, "peak learning rate (fairseq's default; on the embedded corpus, without DATA, Adam's is 0.0005)"
    )
    stop_min_lr: float = _f(
        -1.0,
        "stop training when the learning rate is at or below this, checked before "
        "each epoch as fairseq does (-1: never)",
    )
    clip_norm: float = _f(0.0, "clip the global gradient norm to this (0: no clipping; gnorm is logged anyway)")
    update_freq: int = _f(1, "micro-batches per optimizer update (gradient accumulation)")


@dataclass
class CheckpointConfig:
    """trainer/checkpoint/checkpointer.py (what is saved and restored, when) and
    checkpoint/files.py (names, publishing, retention)."""

    save_dir: str = _f("checkpoints", "directory for config.yaml and checkpoints")
    restore_file: str = _f(
        "checkpoint_last",
        "checkpoint to resume from: a name in --save-dir or a path "
        "(the default resumes a run re-started with the same command)",
    )
    finetune_from_model: Optional[str] = _f(
        None,
        "start from this checkpoint's weights with a fresh optimizer, "
        "lr schedule, data position and meters (unless --save-dir "
        "already holds checkpoint_last)",
    )
    continue_once: Optional[str] = _f(
        None,
        "resume this checkpoint's run while --save-dir holds no checkpoint_last, then this run's own "
        "(fairseq's; how a WSD decay branches so that a requeue resumes the branch)",
    )
    reset_optimizer: bool = _f(False, "do not restore the optimizer state (or the fp16 loss scale)")
    reset_lr_scheduler: bool = _f(False, "do not restore the lr schedule's position: count updates from 0 for it")
    reset_dataloader: bool = _f(False, "do not restore the data position: start at epoch 1")
    reset_meters: bool = _f(False, "do not restore the epoch's running meters")
    save_interval: int = _f(1, "save checkpoint{epoch} every N epochs")
    save_interval_updates: int = _f(0, "also save checkpoint_{epoch}_{updates} (and validate) every N updates")
    keep_interval_updates: int = _f(-1, "keep only the last N checkpoint_{epoch}_{updates} (-1: all)")
    keep_last_epochs: int = _f(-1, "keep only the last N checkpoint{epoch} (-1: all)")
    keep_best_checkpoints: int = _f(-1, "also keep the best N as checkpoint.best_{metric}_{value} (-1: none)")
    no_save: bool = _f(False, "write nothing to --save-dir")
    no_epoch_checkpoints: bool = _f(False, "do not save checkpoint{epoch} at the end of epochs")
    no_last_checkpoints: bool = _f(False, "do not save checkpoint_last")
    no_save_optimizer_state: bool = _f(False, "leave the optimizer state out of checkpoints")
    best_checkpoint_metric: str = _f(
        "loss",
        "validation metric that picks checkpoint_best: loss or ppl; with --data-mixture also a source's "
        "NAME_loss or NAME_ppl",
    )
    maximize_best_checkpoint_metric: bool = _f(False, "a higher --best-checkpoint-metric is better")
    save_async: bool = _f(
        False, "write checkpoints in the background while training goes on", alias="--write-checkpoints-asynchronously"
    )


@dataclass
class TaskConfig:
    """trainer/train/task.py: the data, its splits and blocks."""

    _name: str = _f(
        "language_modeling",
        "task: language_modeling; sft (conversations, loss on the assistant's tokens); dpo (preference pairs)",
        flag="--task",
        choices=("language_modeling", "dummy_lm", "sft", "dpo"),
    )
    data: Optional[str] = _f(
        None,
        "data directory from `preprocess` or fairseq-preprocess "
        "(default: the embedded corpus); several joined by ':' are shards, "
        "one trained on per epoch in turn",
        flag="data",
    )
    data_mixture: Optional[List[str]] = _f(
        None,
        "train on a weighted mixture instead of DATA: W1 DIR1 W2 DIR2 … (Megatron's order; weights "
        "normalised; each DIR may be several joined by ':'); validation reads each DIR's valid split",
        nargs="+",
        metavar="W DIR",
    )
    data_mixture_temperature: Optional[float] = _f(
        None,
        "--data-mixture: each source's share is (weight x its training tokens)^(1/T), normalised "
        "(fairseq's sampling temperature; weights of 1 and T = 1 sample by size)",
    )
    tokens_per_sample: int = _f(1024, "tokens per sample (block length)")
    sample_break_mode: str = _f("none", "how samples are cut from the token stream", choices=BREAK_MODES)
    add_bos_token: bool = _f(False, "start each sample with the beginning-of-sentence symbol <s>")
    pad_to_fixed_length: bool = _f(False, "pad every batch to --tokens-per-sample positions")
    per_document_attention: bool = _f(
        False,
        "each sequence of a packed sample attends only to itself, its positions counted from 0 "
        "(--sample-break-mode complete, complete_doc or eos); --task sft always does",
    )
    dpo_beta: float = _f(0.1, "dpo: the KL penalty's weight beta (the rewards' scale)")
    dpo_label_smoothing: float = _f(
        0.0, "dpo: the chance a preference label is flipped (conservative DPO), in [0, 0.5)"
    )
    dpo_reference: Optional[str] = _f(
        None,
        "dpo: the frozen reference model, a Hugging Face dir or a checkpoint (default: the starting model, "
        "--finetune-from-model)",
    )
    dict_size: int = _f(49996, "dummy_lm: vocabulary size")
    dataset_size: int = _f(100000, "dummy_lm: samples per epoch")


@dataclass
class CriterionConfig:
    """The training loss: models/transformer_lm.py (cross_entropy, the adaptive softmax's
    adaptive_loss)."""

    _name: str = _f(
        "cross_entropy",
        "loss; adaptive_loss goes with --adaptive-softmax-cutoff",
        flag="--criterion",
        choices=("cross_entropy", "adaptive_loss"),
    )


@dataclass
class EMAConfig:
    """fairseq's `ema` group: an exponential moving average of the weights, updated after
    every counted update (trainer/train/ema.py), saved in checkpoints
    (checkpoint/checkpointer.py), validated on with --validate-with-ema (train/loop.py)."""

    store_ema: bool = _f(False, "keep an exponential moving average of the weights, saved in checkpoints")
    ema_decay: float = _f(0.9999, "decay of the moving average: ema = decay * ema + (1 - decay) * weights")
    ema_start_update: int = _f(
        0, "before this many updates the average is a copy of the weights (decay 0), as fairseq's"
    )
    ema_update_freq: int = _f(1, "update the average every N updates")
    ema_fp32: bool = _f(
        False, "keep the average in fp32 under --fp16/--bf16 (default: in their 16-bit dtype, as fairseq's model copy)"
    )
    ema_seed_model: Optional[str] = _f(
        None,
        "start the average from the average saved in this checkpoint (a shardlm checkpoint of a "
        "--store-ema run) instead of from the weights; a checkpoint resumed from overrides it, as in fairseq",
    )
    validate_with_ema: bool = _f(
        False,
        "validate on the averaged weights (swapped in for validation, back after); "
        "the best checkpoint is then the best average. Not a fairseq flag",
    )


@dataclass
class ShardLMConfig:
    common: CommonConfig = field(default_factory=CommonConfig)
    distributed_training: DistributedTrainingConfig = field(default_factory=DistributedTrainingConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optimization: OptimizationConfig = field(default_factory=OptimizationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: TransformerLMConfig = field(default_factory=TransformerLMConfig)
    criterion: CriterionConfig = field(default_factory=CriterionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)


GROUPS = {f.name: f.type for f in fields(ShardLMConfig)}

# Groups whose `_name` picks an option that sets several keys at once (fairseq's
# registries): `model=NAME` / `--arch NAME`, `optimizer=adamw`, … Each option lists
# only the keys it changes.
GROUP_OPTIONS = {
    "model": PRESETS,
    # sft packs whole conversations into a sample; dpo pads each sequence of its pairs
    "task": {
        "language_modeling": {},
        "dummy_lm": {"tokens_per_sample": 512},
        "sft": {"sample_break_mode": "complete"},
        "dpo": {"sample_break_mode": "eos"},
    },
    "criterion": {"cross_entropy": {}, "adaptive_loss": {}},
    "optimizer": {
        "adam": {},
        "adamw": {},
        "cpu_adam": {},
        "sgd": {},
        "nag": {"momentum": 0.99},
        **{name: {} for name in ("adafactor", "lamb", "adagrad", "adamax", "adadelta", "muon")},
    },
    "lr_scheduler": {
        "fixed": {},
        "inverse_sqrt": {"warmup_updates": 4000},
        "polynomial_decay": {},
        "cosine": {},
        "reduce_lr_on_plateau": {},
        "wsd": {},
        "tri_stage": {},
        "triangular": {"lr_period_updates": 5000},  # fairseq's triangular default (cosine's is -1)
        "step": {},
        "manual": {},
        "pass_through": {},
    },
}


def vocabulary_data(task):
    """The DATA whose tokenizer gives a run its ids: DATA, or the first source of
    --data-mixture (every source has the same one); None for the embedded corpus."""
    if task.data_mixture and len(task.data_mixture) > 1:  # checks.data refuses a mixture without pairs
        return str(task.data_mixture[1])
    return task.data


def ddp_backend(cfg):
    """--ddp-backend by its first name (c10d is pytorch_ddp, no_c10d legacy_ddp)."""
    backend = cfg.distributed_training.ddp_backend
    return BACKEND_ALIASES.get(backend, backend)


def model_positions(cfg):
    """The positions a model is built with: --max-target-positions, else its longest input,
    --tokens-per-sample plus the <s> of --add-bos-token. Also reads a saved run's
    config.yaml, which may predate --add-bos-token."""
    task_cfg = cfg.task
    return cfg.model.max_target_positions or task_cfg.tokens_per_sample + int(
        bool(task_cfg.get("add_bos_token", False))
    )


def uses_fsdp(cfg):
    """The one test of "is this backend sharded" on a composed config."""
    return ddp_backend(cfg) in SHARDED_BACKENDS


def register_configs():
    """Put the schema and every group option in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="shardlm_schema", node=ShardLMConfig)
    for group, options in GROUP_OPTIONS.items():
        for name, values in options.items():
            cs.store(group=group, name=name, node={"_name": name, **values})
