"""Checks of the data groups: task (what the samples are) and dataset (how they are
batched; trainer/train/task.py, data/iterator.py)."""

from data.errors import DataError
from data.mixture import parse_mixture, source_names
from trainer.config.checks.model import check_adaptive_vocab
from trainer.config.checks.values import non_negative, positive
from trainer.errors import UsageError


def check_task(cfg):
    task, model = cfg.task, cfg.model
    positive(cfg, "task.tokens_per_sample", "task.dict_size", "task.dataset_size")
    if task._name == "dummy_lm":
        if task.data:
            raise UsageError(
                f"--task dummy_lm makes random tokens and reads no DATA ({task.data}); drop DATA or the task"
            )
        if task.dict_size <= 4:
            raise UsageError(
                f"--dict-size {task.dict_size} leaves no tokens beside the 4 special symbols; use at least 5"
            )
        check_adaptive_vocab(model, task.dict_size)  # the vocabulary is known now; with DATA, once it is read
    _check_chat_tasks(cfg)
    _check_mixture(cfg)
    if model.max_target_positions is not None and task.tokens_per_sample > model.max_target_positions:
        raise UsageError(
            f"--tokens-per-sample {task.tokens_per_sample} exceeds the model's "
            f"--max-target-positions {model.max_target_positions}; lower one or raise the other"
        )
    if (
        task.add_bos_token
        and model.max_target_positions is not None
        and task.tokens_per_sample + 1 > model.max_target_positions
    ):
        raise UsageError(
            f"--add-bos-token makes samples of --tokens-per-sample + 1 = {task.tokens_per_sample + 1} "
            f"tokens, more than --max-target-positions {model.max_target_positions}; raise it or lower "
            "--tokens-per-sample"
        )


def _check_mixture(cfg):
    """--data-mixture replaces DATA; its sources name the metrics --best-checkpoint-metric may pick."""
    task, metric = cfg.task, cfg.checkpoint.best_checkpoint_metric
    names = []
    if task.data_mixture:
        if task.data:
            raise UsageError(f"pass DATA ({task.data}) or --data-mixture, not both: a mixture names all its data")
        if task._name == "dummy_lm":
            raise UsageError("--task dummy_lm makes random tokens and reads no --data-mixture; drop one of them")
        try:
            names = source_names([data for _, data in parse_mixture(task.data_mixture)])
        except DataError as e:
            raise UsageError(str(e)) from None
    if task.data_mixture_temperature is not None:
        if not task.data_mixture:
            raise UsageError("--data-mixture-temperature weighs the sources of --data-mixture; pass the mixture")
        if not task.data_mixture_temperature > 0:
            raise UsageError(f"--data-mixture-temperature must be positive, got {task.data_mixture_temperature}")
    allowed = ["loss", "ppl"] + [f"{name}_{what}" for name in names for what in ("loss", "ppl")]
    if metric not in allowed:
        hint = "" if names else " (a source's NAME_loss with --data-mixture)"
        raise UsageError(
            f"--best-checkpoint-metric {metric!r} is no validation metric here; use {', '.join(allowed)}{hint}"
        )


def _check_chat_tasks(cfg):
    """sft and dpo read whole conversations and pairs from DATA; their flags only act there."""
    task, name = cfg.task, cfg.task._name
    if task.per_document_attention and task.sample_break_mode == "none":
        raise UsageError(
            "--per-document-attention needs samples made of whole sequences; --sample-break-mode none cuts "
            "them: use complete, complete_doc or eos"
        )
    if task.per_document_attention and task.add_bos_token:
        raise UsageError("--per-document-attention keeps each sequence's own context; drop --add-bos-token")
    if name in ("sft", "dpo"):
        if not (task.data or task.data_mixture):
            raise UsageError(
                f"--task {name} trains on DATA written by `preprocess --tokenizer HF_DIR` from "
                + (
                    "conversations (rows with messages)"
                    if name == "sft"
                    else "preference pairs (prompt, chosen, rejected)"
                )
                + "; pass it"
            )
        if task.add_bos_token:
            raise UsageError(f"--task {name}: the chat template places <s> itself; drop --add-bos-token")
    if name == "sft" and task.sample_break_mode not in ("complete", "eos"):
        raise UsageError(
            f"--task sft keeps conversations whole: --sample-break-mode {task.sample_break_mode} would cut or "
            "group them otherwise; use complete (packed, the default) or eos (one per row)"
        )
    if name == "dpo":
        if task.sample_break_mode != "eos":
            raise UsageError("--task dpo scores each sequence of a pair on its own row: drop --sample-break-mode")
        if not 0.0 <= task.dpo_label_smoothing < 0.5:
            raise UsageError(f"--dpo-label-smoothing must be in [0, 0.5), got {task.dpo_label_smoothing}")
        if task.dpo_beta <= 0:
            raise UsageError(f"--dpo-beta must be positive, got {task.dpo_beta}")
        if not task.dpo_reference and not cfg.checkpoint.finetune_from_model:
            raise UsageError(
                "--task dpo needs a reference model: --finetune-from-model (the model to start from, also "
                "the reference) or --dpo-reference"
            )
    else:
        for key, default in (("dpo_beta", 0.1), ("dpo_label_smoothing", 0.0), ("dpo_reference", None)):
            if task[key] != default:
                raise UsageError(f"--{key.replace('_', '-')} is a setting of --task dpo; drop it or add --task dpo")


def check_dataset(cfg):
    dataset, tokens_per_sample = cfg.dataset, cfg.task.tokens_per_sample
    positive(cfg, "dataset.validate_interval", "dataset.required_batch_size_multiple")
    positive(
        cfg,
        "dataset.batch_size",
        "dataset.max_tokens",
        "dataset.batch_size_valid",
        "dataset.max_tokens_valid",
        "dataset.max_valid_steps",
        optional=True,
    )
    non_negative(cfg, "dataset.validate_interval_updates", "dataset.num_workers")
    if dataset.batch_size is None and dataset.max_tokens is None:  # with DATA (compose sets one without)
        raise UsageError("set --batch-size or --max-tokens (sequences or tokens per batch per rank)")
    for flag, max_tokens in (("--max-tokens", dataset.max_tokens), ("--max-tokens-valid", dataset.max_tokens_valid)):
        if max_tokens is not None and max_tokens < tokens_per_sample:  # fairseq: "exceeds max_tokens limit"
            raise UsageError(
                f"{flag} {max_tokens} is smaller than one sample (--tokens-per-sample "
                f"{tokens_per_sample}); raise it or lower --tokens-per-sample"
            )
