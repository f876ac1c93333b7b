"""Settings that other settings imply, resolved once, at the end of composition.

Every reader (parallelize, the planner, a saved config.yaml) then reads plain fields and
none decides the rule again. Set on the config rather than computed where used, so that
a file or a dotted override implies them as a flag does. The planner's flag search builds
candidate settings of its own: it applies `implies_activation_checkpointing` to them.
"""

from trainer.config.model_source import apply_fairseq_model, apply_hf_model
from trainer.config.schema import vocabulary_data

EMBEDDED_CORPUS_BATCH_SIZE = 8  # sequences per rank, as fairseq's FSDP examples use
EMBEDDED_CORPUS_ADAM_LR = 5e-4  # the Adam lr of fairseq's language-model README


def implies_activation_checkpointing(settings):
    """--offload-activations moves what checkpointing keeps (each layer's input) to the
    host: it is a kind of checkpointing, so it turns checkpointing on. `settings`: anything
    with an `offload_activations` attribute (cfg.model, the planner's Setup)."""
    return bool(settings.offload_activations)


def resolve_implied(cfg, given=()):
    """Set what some settings imply: fairseq's parse_args_and_arch rules
    (--memory-efficient-fp16 implies --fp16, --memory-efficient-bf16 --bf16),
    --offload-activations implies --checkpoint-activations, the embedded corpus's batch size
    and Adam lr, and the model of --finetune-from-model HF_DIR (its config.json's) or of a fairseq-train
    checkpoint the run starts from (its config's).
    `given`: the keys the user set. Returns cfg."""
    apply_hf_model(cfg, given)
    apply_fairseq_model(cfg, given)
    common = cfg.common
    common.fp16 = common.fp16 or common.memory_efficient_fp16
    common.bf16 = common.bf16 or common.memory_efficient_bf16
    if implies_activation_checkpointing(cfg.model):
        cfg.model.checkpoint_activations = True
    # fairseq requires a batch size or max tokens, and its default --lr 0.25 (meant for NAG)
    # makes Adam diverge; for the embedded corpus (no DATA) shardlm picks both, so that `train`
    # alone, or `train --ddp-backend=fully_sharded --cpu-offload`, trains. Only what was not given.
    dataset, task = cfg.dataset, cfg.task
    if task._name == "language_modeling" and not vocabulary_data(task):
        if dataset.batch_size is None and dataset.max_tokens is None:
            dataset.batch_size = EMBEDDED_CORPUS_BATCH_SIZE
        if "optimization.lr" not in given and cfg.optimizer._name in ("adam", "adamw", "cpu_adam"):
            cfg.optimization.lr = EMBEDDED_CORPUS_ADAM_LR
    return cfg
