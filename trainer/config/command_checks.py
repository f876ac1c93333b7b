"""Checks of the commands beside train (eval-lm, generate, export-model, plan's own options).

Two kinds, each a one-line UsageError: checked types of one value, which the fields of
trainer/config/commands.py name as their `type`, so a flag and its key=value override are
refused alike while parsing; and checks of a command's options together, run before a
model loads or a rank starts.
"""

import argparse

from trainer.errors import UsageError


def positive_int(text):
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text):
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):  # nan fails this too
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def _whole_number(text):
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def check_eval_lm(args):
    if args.context_window < 0:
        raise UsageError(f"--context-window must be >= 0, got {args.context_window}")
    if args.data:  # before any rank starts or the model loads
        # data_dir reads token files with numpy: imported only when there is a DATA to check
        from data.data_dir import check_data_dir

        check_data_dir(args.data, [args.gen_subset], subset_flag="--gen-subset")


def check_generate(args):
    if not args.temperature >= 0 or args.temperature == float("inf") or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UsageError("need --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    if args.model_parallel_size > 1 and args.chat and not (args.prompt or args.messages):
        raise UsageError(
            "generate --chat without --prompt or --messages reads its turns as they are typed, on one process: "
            "pass the conversations with --messages FILE, or chat with a model split over ranks through serve "
            f"--distributed-world-size {args.model_parallel_size} --model-parallel-size {args.model_parallel_size}"
        )
