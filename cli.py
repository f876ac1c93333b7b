"""Console entry points: parse → compose config → call trainer / data.

Nothing here imports torch: `train --help` and a bad flag answer before it loads.
"""
import sys

from trainer.flags import UsageError


def _fail(prog, message, code):
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def train_main(argv=None):
    from trainer.checks import check_config
    from trainer.compose import compose_config
    from trainer.flags import build_parser, parse_flags

    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser("train")
        ns, settings, overrides = parse_flags(parser, argv)
        cfg = compose_config(settings, overrides, ns.config_dir, ns.config_name)
        check_config(cfg)
    except UsageError as e:
        return _fail("train", e, 2)
    from trainer.launch import launch
    return launch(cfg)


def preprocess_main(argv=None):
    from data.errors import DataError
    from data.preprocess import build_parser, preprocess

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        preprocess(args)
    except DataError as e:
        return _fail("preprocess", e, 1)
    return 0


COMMANDS = {"train": train_main, "preprocess": preprocess_main}


def shardlm_main(argv=None):
    """`shardlm train …` for users whose PATH already has a `train`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        return _fail("shardlm", f"usage: shardlm {{{','.join(COMMANDS)}}} [args]", 2)
    return COMMANDS[argv[0]](argv[1:])


def _entry(fn):
    def main():
        sys.exit(fn())
    return main


train = _entry(train_main)
preprocess = _entry(preprocess_main)
shardlm = _entry(shardlm_main)
