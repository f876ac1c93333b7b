"""Console entry points: parse → compose config → call trainer / data.

Nothing here imports torch: `train --help` and a bad flag answer before it loads.
"""

import os
import sys

from trainer.errors import DEBUG_ENV, INTERRUPTED, UsageError, interrupted_line, show_traceback


def _argv(argv):
    """The command's arguments (default: the command line's). `--debug` (every command has
    it) turns on SHARDLM_DEBUG, in the environment so that spawned ranks inherit it:
    errors then show their traceback too."""
    argv = sys.argv[1:] if argv is None else argv
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"
    return argv


def _fail(prog, message, code):
    show_traceback()  # called from an except block: the error being handled
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def train_main(argv=None):
    from data.errors import DataError
    from trainer.config.checks import check_config
    from trainer.config.compose import compose_config
    from trainer.config.flags import build_parser, parse_flags
    from trainer.launch.preflight import check_inputs

    argv = _argv(argv)
    multirun = "-m" in argv or "--multirun" in argv
    argv = [a for a in argv if a not in ("-m", "--multirun")]
    try:
        parser = build_parser("train")
        ns, settings, overrides = parse_flags(parser, argv)
        if multirun:
            if any(k == "distributed_training.auto_tune" for k, _ in settings) or any(
                o.startswith("distributed_training.auto_tune") for o in overrides
            ):
                raise UsageError("--auto-tune plans one run; run `plan` for the sweep's settings instead of -m")
            if ns.config_dir or ns.config_name:
                raise UsageError(
                    "train -m takes flags and key=value overrides; --config-dir/--config-name "
                    "are not supported with -m yet"
                )
            # Check the first job of the sweep here, so a typo costs seconds, not a queue wait.
            first = [_first_of_sweep(o) for o in overrides if not o.startswith(("hydra.", "hydra/"))]
            first_cfg = compose_config(settings, first, None, None)
            check_config(first_cfg)
            check_inputs(first_cfg)
        else:
            cfg = compose_config(settings, overrides, ns.config_dir, ns.config_name)
            check_config(cfg)
            check_inputs(cfg)
            if cfg.distributed_training.dry_run:
                from trainer.dryrun.command import dry_run  # torch-free: its rank process loads torch

                return dry_run(cfg)
            if cfg.distributed_training.auto_tune:
                from trainer.launch.auto_tune import auto_tune

                print(auto_tune(cfg), file=sys.stderr, flush=True)
    except UsageError as e:
        return _fail("train", e, 2)
    except DataError as e:
        return _fail("train", e, 1)
    if multirun:
        from trainer.launch.sweep import multirun as run_sweep

        return run_sweep(settings, overrides)
    from trainer.launch.launcher import launch

    return launch(cfg)


def _first_of_sweep(override):
    """`optimization.lr=0.001,0.003` → `optimization.lr=0.001` (an unquoted, unbracketed sweep)."""
    key, sep, value = override.partition("=")
    if sep and "," in value and value[:1] not in "'\"[(" and "(" not in value:
        value = value.split(",")[0]
    return key + sep + value


def preprocess_main(argv=None):
    """fairseq-preprocess: local files -> sentencepiece (or an HF tokenizer) -> token files."""
    from data.errors import DataError

    try:
        args = _parse_command(
            "preprocess",
            "Tokenize local text, jsonl, parquet or csv files (or a saved HF dataset) into memory-mapped\n"
            "token files for train, with a sentencepiece model trained on --trainpref (default), reused\n"
            "(--spm-model), or a Hugging Face model's own tokenizer (--tokenizer).",
            argv,
        )
        from data.preprocess import preprocess

        preprocess(args)
    except UsageError as e:
        return _fail("preprocess", e, 2)
    except DataError as e:
        return _fail("preprocess", e, 1)
    return 0


def _parse_command(prog, description, argv):
    """The options of a command beside train, as its dataclass (trainer/config/commands.py)."""
    from trainer.config.commands import COMMAND_GROUPS
    from trainer.config.flags import build_command_parser, parse_command

    group, cls = COMMAND_GROUPS[prog]
    return parse_command(build_command_parser(prog, group, cls, description), group, cls, _argv(argv))


def eval_lm_main(argv=None):
    """fairseq-eval-lm: perplexity of a checkpoint (sharded or exported) on a split."""
    import functools

    from data.errors import DataError

    try:
        args = _parse_command(
            "eval-lm", "Loss (base 2) and perplexity of a trained model on a split (fairseq-eval-lm).", argv
        )
        from trainer.config.command_checks import check_eval_lm

        check_eval_lm(args)
        from trainer.config.compose import compose_config

        cfg = compose_config(
            [
                ("distributed_training.distributed_world_size", args.distributed_world_size),
                ("common.cpu", args.cpu),
                ("common.model_parallel_size", args.model_parallel_size),
            ],
            [],
            None,
            None,
        )
    except UsageError as e:
        return _fail("eval-lm", e, 2)
    except DataError as e:
        return _fail("eval-lm", e, 1)
    from trainer.inference import eval_lm
    from trainer.launch.launcher import launch

    return launch(cfg, functools.partial(eval_lm.run, args), prog="eval-lm")


def generate_main(argv=None):
    """fairseq-interactive: sample continuations of prompts."""
    from data.errors import DataError

    try:
        args = _parse_command(
            "generate", "Sample text from a trained model (a checkpoint directory or an export).", argv
        )
        from trainer.config.command_checks import check_generate

        check_generate(args)
        from trainer.inference import generate

        if args.model_parallel_size == 1:
            return generate.generate(args)
        # A model split over ranks: they start here, and take the prompts read once
        import functools

        from trainer.config.compose import compose_config
        from trainer.launch.launcher import launch

        prompts = None if args.chat else generate.read_prompts(args)
        n = args.model_parallel_size
        settings = [("distributed_training.distributed_world_size", n), ("common.model_parallel_size", n)]
        cfg = compose_config([*settings, ("common.cpu", args.cpu)], [], None, None)
        return launch(cfg, functools.partial(generate.run, args, prompts), prog="generate")
    except UsageError as e:
        return _fail("generate", e, 2)
    except DataError as e:
        return _fail("generate", e, 1)


def serve_main(argv=None):
    """An OpenAI-compatible HTTP server over a model (trainer/serve/app.py)."""
    from data.errors import DataError

    try:
        args = _parse_command(
            "serve", "Serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions).", argv
        )
        from trainer.config.compose import compose_config
        from trainer.rendezvous import infer_rendezvous

        cfg = compose_config(
            [
                ("distributed_training.distributed_world_size", args.distributed_world_size),
                ("common.cpu", args.cpu),
                ("common.model_parallel_size", args.model_parallel_size),
            ],
            [],
            None,
            None,
        )
        if infer_rendezvous(cfg).world_size > 1:  # --distributed-world-size N, torchrun or SLURM: shard
            import functools

            from trainer.launch.launcher import launch
            from trainer.serve import sharded as sharded_serving

            return launch(cfg, functools.partial(sharded_serving.run, args), prog="serve")
        from trainer.serve.command import serve

        return serve(args)
    except UsageError as e:
        return _fail("serve", e, 2)
    except DataError as e:
        return _fail("serve", e, 1)


def export_model_main(argv=None):
    """One consolidated safetensors file (or an HF GPT-2 directory) from a checkpoint."""
    from data.errors import DataError

    try:
        args = _parse_command(
            "export-model", "Write a checkpoint as one model.safetensors (+ config and tokenizer).", argv
        )
        from trainer.inference.export import export_model

        out = export_model(
            args.path, args.out, args.format, args.dtype, args.max_shard_size, ema=args.ema, compact=args.pq_compact
        )
    except UsageError as e:
        return _fail("export-model", e, 2)
    except DataError as e:
        return _fail("export-model", e, 1)
    print(f"exported {args.path} to {out}")
    return 0


def plan_main(argv=None):
    """Predict per-rank memory for `train`'s flags and pick the fastest flags that fit."""
    from trainer.config.commands import PlanConfig
    from trainer.config.compose import compose_config
    from trainer.config.flags import add_field_flags, build_parser, command_options, parse_flags

    argv = _argv(argv)
    try:
        parser = build_parser(
            "plan", "Predict one rank's peak memory for these `train` flags and print the fastest FSDP flags that fit."
        )
        add_field_flags(parser, "plan", PlanConfig)
        ns, settings, overrides = parse_flags(parser, argv)
        opts, settings, overrides = command_options("plan", PlanConfig, settings, overrides)
        cfg = compose_config(settings, overrides, ns.config_dir, ns.config_name)
        from trainer.plan.command import plan_report

        report = plan_report(cfg, opts)
    except UsageError as e:
        return _fail("plan", e, 2)
    print(report)
    return 0


COMMANDS = {
    "train": train_main,
    "plan": plan_main,
    "preprocess": preprocess_main,
    "eval-lm": eval_lm_main,
    "generate": generate_main,
    "serve": serve_main,
    "export-model": export_model_main,
    "export": export_model_main,
}  # the short name; a shell's own `export` wins over a script of that name


def shardlm_main(argv=None):
    """`shardlm train …` for users whose PATH already has a `train`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        return _fail("shardlm", f"usage: shardlm {{{','.join(COMMANDS)}}} [args]", 2)
    return COMMANDS[argv[0]](argv[1:])


def _entry(fn):
    def main():
        try:
            code = fn()
        except KeyboardInterrupt as e:  # Ctrl-C before a command handles it itself: one line, no traceback
            print(interrupted_line(os.path.basename(sys.argv[0]), e), file=sys.stderr)
            code = INTERRUPTED
        sys.exit(code)

    return main


train = _entry(train_main)
preprocess = _entry(preprocess_main)
shardlm = _entry(shardlm_main)
eval_lm = _entry(eval_lm_main)
generate = _entry(generate_main)
serve = _entry(serve_main)
export_model = _entry(export_model_main)
plan = _entry(plan_main)
