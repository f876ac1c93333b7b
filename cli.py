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


def _parse(parser, argv):
    return parser.parse_args(_argv(argv))


def _fail(prog, message, code):
    show_traceback()  # called from an except block: the error being handled
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def train_main(argv=None):
    from data.errors import DataError
    from trainer.config.checks import check_config
    from trainer.launch.preflight import check_inputs
    from trainer.config.compose import compose_config
    from trainer.config.flags import build_parser, parse_flags

    argv = _argv(argv)
    multirun = "-m" in argv or "--multirun" in argv
    argv = [a for a in argv if a not in ("-m", "--multirun")]
    try:
        parser = build_parser("train")
        ns, settings, overrides = parse_flags(parser, argv)
        if multirun:
            if any(k == "distributed_training.auto_tune" for k, _ in settings) or any(
                    o.startswith("distributed_training.auto_tune") for o in overrides):
                raise UsageError("--auto-tune plans one run; run `plan` for the sweep's settings instead of -m")
            if ns.config_dir or ns.config_name:
                raise UsageError("train -m takes flags and key=value overrides; --config-dir/--config-name "
                                 "are not supported with -m yet")
            # Check the first job of the sweep here, so a typo costs seconds, not a queue wait.
            first = [_first_of_sweep(o) for o in overrides if not o.startswith(("hydra.", "hydra/"))]
            first_cfg = compose_config(settings, first, None, None)
            check_config(first_cfg)
            check_inputs(first_cfg)
        else:
            cfg = compose_config(settings, overrides, ns.config_dir, ns.config_name)
            check_config(cfg)
            check_inputs(cfg)
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
    from data.errors import DataError
    from data.preprocess import build_parser, preprocess

    from trainer.config.flags import _Parser

    argv = _argv(argv)
    try:
        args = build_parser(_Parser).parse_args(argv)
        preprocess(args)
    except UsageError as e:
        return _fail("preprocess", e, 2)
    except DataError as e:
        return _fail("preprocess", e, 1)
    return 0


def _parser(prog, description):
    import argparse

    from trainer.config.flags import _Parser
    parser = _Parser(prog=prog, description=description, allow_abbrev=False,
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return parser


DEBUG_HELP = "on an error, also print its traceback (or set SHARDLM_DEBUG=1)"


def _positive_int(text):
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def eval_lm_main(argv=None):
    """fairseq-eval-lm: perplexity of a checkpoint (sharded or exported) on a split."""
    import functools

    from data.errors import DataError

    p = _parser("eval-lm", "Loss (base 2) and perplexity of a trained model on a split (fairseq-eval-lm).")
    p.add_argument("data", nargs="?", help="data directory (default: the embedded corpus)")
    p.add_argument("--path", required=True, help="checkpoint directory, export-model output, or Hugging Face "
                   "model directory (Llama/Qwen3: config.json, safetensors, tokenizer.json)")
    p.add_argument("--gen-subset", default="test", help="split to evaluate")
    p.add_argument("--tokens-per-sample", type=_positive_int, help="block length (default: the training run's)")
    p.add_argument("--context-window", type=int, default=0,
                   help="score each block with this many earlier tokens as unscored context")
    p.add_argument("--sample-break-mode", choices=("none", "complete", "complete_doc", "eos"),
                   help="how blocks are cut (default: the training run's)")
    p.add_argument("--batch-size", "--max-sentences", type=_positive_int, help="blocks per batch")
    p.add_argument("--max-tokens", type=_positive_int, help="tokens per batch (default 36000 without --batch-size)")
    p.add_argument("--distributed-world-size", type=_positive_int, default=1, help="ranks to spawn")
    p.add_argument("--cpu", action="store_true", help="evaluate on the CPU even when a GPU is present")
    p.add_argument("--num-workers", type=_non_negative_int, default=1,
                   help="processes that read and collate batches ahead (0: in the evaluating process)")
    p.add_argument("--no-progress-bar", action="store_true",
                   help="no progress line while evaluating (default: one on a terminal)")
    p.add_argument("--softmax-batch", type=_positive_int,
                   help="score at most this many tokens' output distributions at a time (bounds the "
                        "B x T x V memory of large vocabularies)")
    p.add_argument("--model-overrides", default="{}",
                   help="model config keys to change before loading, as fairseq's Python dict, e.g. "
                        "\"{'decoder_layers_to_keep':'0,2,4'}\"")
    try:
        args = _parse(p, argv)
        if args.context_window < 0:
            raise UsageError(f"--context-window must be >= 0, got {args.context_window}")
        from trainer.config.checks import parse_model_overrides
        args.model_overrides = parse_model_overrides(args.model_overrides)
        if args.data:  # before any rank starts or the model loads
            from data.data_dir import check_data_dir
            check_data_dir(args.data, [args.gen_subset], subset_flag="--gen-subset")
        from trainer.config.compose import compose_config
        cfg = compose_config([("distributed_training.distributed_world_size", args.distributed_world_size),
                              ("common.cpu", args.cpu)], [], None, None)
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

    p = _parser("generate", "Sample text from a trained model (a checkpoint directory or an export).")
    p.add_argument("--path", required=True, help="checkpoint directory, export-model output, or Hugging Face "
                   "model directory (Llama/Qwen3: config.json, safetensors, tokenizer.json)")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable); default: one prompt per stdin line")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to sample per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy decoding")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set with this probability")
    p.add_argument("--seed", type=int, default=1, help="the same seed gives the same text")
    p.add_argument("--no-kv-cache", action="store_true", help="re-run the whole prefix for every token (slow)")
    try:
        args = _parse(p, argv)
        if not args.temperature >= 0 or args.temperature == float("inf") or args.top_k < 0 \
                or not 0 < args.top_p <= 1:
            raise UsageError("need --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
        from trainer.inference.generate import generate
        return generate(args)
    except UsageError as e:
        return _fail("generate", e, 2)
    except DataError as e:
        return _fail("generate", e, 1)


def export_model_main(argv=None):
    """One consolidated safetensors file (or an HF GPT-2 directory) from a checkpoint."""
    from data.errors import DataError

    p = _parser("export-model", "Write a checkpoint as one model.safetensors (+ config and tokenizer).")
    p.add_argument("--path", required=True, help="checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (must not hold a model yet)")
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="hf: a directory transformers loads (LlamaForCausalLM, Qwen3ForCausalLM with --qk-norm, "
                        "or GPT2LMHeadModel), with the tokenizer as tokenizer.json")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="cast the weights (default: as saved)")
    p.add_argument("--max-shard-size", help="--format hf: split the weights into files of at most this size, "
                                            "as save_pretrained does (e.g. 500MB, 2GiB; default: 5GB)")
    try:
        args = _parse(p, argv)
        import torch

        from trainer.inference.export import export_model
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.dtype]
        out = export_model(args.path, args.out, args.format, dtype, args.max_shard_size)
    except UsageError as e:
        return _fail("export-model", e, 2)
    except DataError as e:
        return _fail("export-model", e, 1)
    print(f"exported {args.path} to {out}")
    return 0


def plan_main(argv=None):
    """Predict per-rank memory for `train`'s flags and pick the fastest flags that fit."""
    from trainer.host import host_memory_gb, runs_on_gpu
    from trainer.config.checks import check_config
    from trainer.config.compose import compose_config
    from trainer.config.flags import build_parser, parse_flags

    argv = _argv(argv)
    try:
        parser = build_parser("plan")
        parser.description = ("Predict one rank's peak memory for these `train` flags and print the fastest "
                              "FSDP flags that fit.")
        g = parser.add_argument_group("plan")
        g.add_argument("--device-memory-gb", type=_positive_float, help="memory of one GPU (plans for GPUs; "
                       "without it, and with --cpu, plans for this host's CPU)")
        g.add_argument("--host-memory-gb", type=_positive_float, help="memory of one host (default: this one's; "
                       "with --device-memory-gb, not checked unless given)")
        g.add_argument("--ranks-per-host", type=_positive_int, help="ranks on one host (default: all of them "
                       "on a CPU, up to 8 on GPUs)")
        g.add_argument("--format", choices=("text", "json"), default="text", help="json: one object")
        g.add_argument("--path", metavar="HF_DIR", help="plan for the Hugging Face model in this directory (Llama, "
                       "Qwen3): its config.json gives the model's shape and vocabulary, over --arch and model flags")
        ns, settings, overrides = parse_flags(parser, argv)
        cfg = compose_config(settings, overrides, ns.config_dir, ns.config_name)
        from trainer.plan import report as plan_report
        from trainer.plan.search import apply_hf_config, published_vocab
        # The vocabulary, when it is not DATA's: the HF model's, or a Llama-family preset's published one.
        vocab = apply_hf_config(cfg, ns.path) if ns.path else published_vocab(cfg)
        if cfg.distributed_training.auto_tune or cfg.distributed_training.memory_budget_gb is not None:
            # Checked before check_config, whose message for a lone budget would send the user to `plan`.
            raise UsageError("plan always picks the flags that fit; --auto-tune and --memory-budget-gb are "
                             "train's, so drop them here and give --device-memory-gb / --host-memory-gb")
        check_config(cfg)
        world = cfg.distributed_training.distributed_world_size
        device = "cuda" if ns.device_memory_gb and not cfg.common.cpu else "cpu"
        if device == "cpu" and runs_on_gpu(cfg):
            raise UsageError("this host has a GPU: give its memory with --device-memory-gb, or --cpu to plan "
                             "for the CPU")
        if ns.ranks_per_host and ns.ranks_per_host > world:
            raise UsageError(f"--ranks-per-host {ns.ranks_per_host} exceeds the job's {world} rank(s); "
                             "lower it or raise --distributed-world-size")
        ranks_per_host = ns.ranks_per_host or (world if device == "cpu" else min(world, 8))
        # --device-memory-gb plans a machine this command cannot see: its host memory is not
        # this machine's RAM, so without --host-memory-gb it goes unchecked (host_gb None).
        host_gb = ns.host_memory_gb or (None if ns.device_memory_gb else host_memory_gb())
        if host_gb is None and not ns.device_memory_gb:
            raise UsageError("cannot read this host's memory: give --host-memory-gb")
        device_gb = ns.device_memory_gb if device == "cuda" else (ns.device_memory_gb or host_gb / ranks_per_host)
        plan = plan_report.make_plan(cfg, device, device_gb, host_gb, ranks_per_host, vocab, ns.path)
    except UsageError as e:
        return _fail("plan", e, 2)
    print(plan_report.as_json(plan) if ns.format == "json" else plan_report.as_text(cfg, plan))
    return 0


def _non_negative_int(text):
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text):
    import argparse
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


COMMANDS = {"train": train_main, "plan": plan_main, "preprocess": preprocess_main, "eval-lm": eval_lm_main,
            "generate": generate_main, "export-model": export_model_main,
            "export": export_model_main}  # the short name; a shell's own `export` wins over a script of that name


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
export_model = _entry(export_model_main)
plan = _entry(plan_main)
