"""fairseq-style flags generated from the config dataclasses.

Each field of each group becomes `--field-name` (or the `flag` in its metadata); the
parser only records what the user typed, as (dotted key, value) pairs, so that
trainer/config/compose.py can layer them between the config file and the dotted overrides.
"""
import argparse
import difflib
import typing
from dataclasses import MISSING, fields

from models.config import PRESETS
from trainer.config.schema import GROUPS
from trainer.errors import UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def _base_type(tp):
    if typing.get_origin(tp) is typing.Union:  # Optional[X]
        return next(a for a in typing.get_args(tp) if a is not type(None)), True
    return tp, False


def parse_float_list(text):
    """'(0.9, 0.98)', '[0.9,0.98]' or '0.9,0.98' → [0.9, 0.98] (fairseq writes tuples)."""
    text = text.strip().strip("()[]")
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like \"(0.9, 0.98)\", got {text!r}")


def _typed(convert, optional, name, choices=()):
    def parse(text):
        # "none" is a real value of some fields (--log-format none), not a null.
        if optional and text.lower() in ("none", "null") and text not in choices:
            return None
        return convert(text)
    parse.__name__ = name  # argparse names the type in "invalid <name> value"
    return parse


def flag_name(f):
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def iter_fields():
    """(group, field) for every config field, in schema order."""
    for group, cls in GROUPS.items():
        for f in fields(cls):
            yield group, f


def _default_of(f):
    return f.default_factory() if f.default is MISSING else f.default


def build_parser(prog="train"):
    parser = _Parser(prog=prog, allow_abbrev=False, usage=f"{prog} [DATA] [--flags] [group.key=value ...]", formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="Train a transformer language model (fairseq-train flags, Hydra config).",
                     epilog=EPILOG)
    parser.add_argument("--config-dir", help="directory holding an experiment YAML file")
    parser.add_argument("--config-name", help="experiment YAML file (without .yaml) in --config-dir")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, also print its traceback (or set SHARDLM_DEBUG=1)")
    seen = {}
    for group, f in iter_fields():
        arg_group = _arg_groups(parser).setdefault(group, parser.add_argument_group(group))
        name = flag_name(f)
        key = f"{group}.{f.name}"
        if name in seen:
            raise RuntimeError(f"flag {name} is defined by both {seen[name]} and {key}")
        seen[name] = key
        default = _default_of(f)
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        kw = dict(dest=key, default=argparse.SUPPRESS, help=help_text, metavar=f.name.strip("_").upper())
        if name == "data":  # the positional DATA directory
            kw.pop("dest"), kw.pop("metavar")
            arg_group.add_argument(key, nargs="?", metavar="DATA", **kw)
            continue
        names = [name] + [n for n in (f.metadata.get("alias"), f.metadata.get("short")) if n]
        tp, optional = _base_type(f.type)
        if tp is bool:
            kw.pop("metavar")
            arg_group.add_argument(*names, action="store_true", **kw)
            if default is True:  # a way to turn it off from the command line
                kw["help"] = f"turn off {name}"
                arg_group.add_argument("--no-" + name[2:], action="store_false", **kw)
            continue
        if typing.get_origin(tp) in (list, typing.List):
            kw["type"] = parse_float_list
        else:
            kw["type"] = _typed(tp, optional, tp.__name__, f.metadata.get("choices", ()))
        if "choices" in f.metadata:
            kw["choices"] = list(f.metadata["choices"]) + ([None] if optional else [])
            kw["metavar"] = "{" + ",".join(f.metadata["choices"]) + "}"
        arg_group.add_argument(*names, **kw)
    return parser


def _arg_groups(parser):
    if not hasattr(parser, "_shardlm_groups"):
        parser._shardlm_groups = {}
    return parser._shardlm_groups


def parse_flags(parser, argv):
    """Split argv into typed flags and dotted overrides.

    Returns (namespace, flag_settings, overrides): flag_settings is [(dotted key, value)]
    for the flags the user typed, in schema order; overrides are `key=value` strings.
    """
    overrides, rest = [], []
    for tok in argv:
        # A dotted override is `key=value` (or `+key=…`/`~key`) not starting with a dash.
        if not tok.startswith("-") and ("=" in tok or tok.startswith("~")):
            overrides.append(tok)
        else:
            rest.append(tok)
    ns, unknown = parser.parse_known_args(rest)
    if unknown:
        raise UsageError(unknown_flag_message(parser, unknown[0]))
    settings = [(k, v) for k, v in vars(ns).items() if "." in k]
    return ns, settings, overrides


def unknown_flag_message(parser, token):
    if not token.startswith("-"):
        return f"unexpected argument {token!r}: only one DATA directory is accepted; options are --flags or key=value"
    name = token.split("=", 1)[0]
    options = [o for a in parser._actions for o in a.option_strings]
    near = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]}?)" if near else "; see `train --help`"
    return f"unrecognized flag {name}{hint}"


def _wrapped(words, indent="  ", width=100):
    lines, line = [], indent
    for word in words:
        if len(line) + len(word) > width and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += word + " "
    return "\n".join(lines + [line.rstrip()])


EPILOG = f"""\
Every flag is also a config key: `--update-freq 4` = `optimization.update_freq=4`.
Precedence (lowest first): --config-dir/--config-name file < --arch preset < flags < key=value overrides.
Presets (--arch; the Llama family's take their vocabulary from DATA):
{_wrapped(sorted(PRESETS))}
Examples:
  train --arch transformer_lm_gpt2_tiny --max-update 100 --batch-size 8 --tokens-per-sample 128
  train data-bin --ddp-backend fully_sharded optimization.max_update=1000 model=transformer_lm_gpt
  train data-bin --finetune-from-model ./Llama-3.2-1B --ddp-backend fully_sharded --bf16 --lr 2e-5
"""
