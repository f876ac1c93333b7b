"""fairseq-style flags generated from the config dataclasses.

Each field of each group becomes `--field-name` (or the `flag` in its metadata); the
parser only records what the user typed, as (dotted key, value) pairs, so that
trainer/config/compose.py can layer them between the config file and the dotted overrides.
"""

import argparse
import difflib
import re
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
        raise argparse.ArgumentTypeError(f'expected numbers like "(0.9, 0.98)", got {text!r}') from None


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


def flag_aliases(f):
    """The field's other spellings: `alias`, one or a tuple of them (--local_rank, --local-rank)."""
    alias = f.metadata.get("alias") or ()
    return (alias,) if isinstance(alias, str) else tuple(alias)


def iter_fields():
    """(group, field) for every config field, in schema order."""
    for group, cls in GROUPS.items():
        for f in fields(cls):
            yield group, f


def _default_of(f):
    return f.default_factory() if f.default is MISSING else f.default


# A help that already says what its default is, `(default: the training run's)` or
# `…; default: 5GB`, is not followed by a second, generated `(default: None)`.
STATES_ITS_DEFAULT = re.compile(r"(?:^|\(|; )default\b")


def help_text(f):
    """A field's help with its default, said once."""
    text = f.metadata.get("help", "")
    return text if STATES_ITS_DEFAULT.search(text) else f"{text} (default: {_default_of(f)})"


def add_debug_flag(parser):
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on an error, also print its traceback (or set SHARDLM_DEBUG=1) (default: False)",
    )


TRAIN_DESCRIPTION = "Train a transformer language model (fairseq-train flags, Hydra config)."


def build_parser(prog="train", description=None):
    """train's parser (plan's too, which adds its own options): a flag for every config field."""
    parser = _Parser(
        prog=prog,
        allow_abbrev=False,
        usage=f"{prog} [DATA] [--flags] [group.key=value ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
        description=description or TRAIN_DESCRIPTION,
    )
    parser.add_argument("--config-dir", help="directory holding an experiment YAML file")
    parser.add_argument("--config-name", help="experiment YAML file (without .yaml) in --config-dir")
    add_debug_flag(parser)
    for group, cls in GROUPS.items():
        add_field_flags(parser, group, cls)
    return parser


def add_field_flags(parser, group, cls):
    """A flag for each field of the dataclass `cls`, under the heading `group`; each flag
    stores its typed value at `group.field` (parse_flags' settings)."""
    arg_group = parser.add_argument_group(group)
    for f in fields(cls):
        _add_field_flag(parser, arg_group, group, f)


def _add_field_flag(parser, arg_group, group, f):
    name, key = flag_name(f), f"{group}.{f.name}"
    seen = parser.__dict__.setdefault("_shardlm_flags", {})
    if name in seen:
        raise RuntimeError(f"flag {name} is defined by both {seen[name]} and {key}")
    seen[name] = key
    kw = dict(
        dest=key,
        default=argparse.SUPPRESS,
        help=help_text(f),
        metavar=f.metadata.get("metavar", f.name.strip("_").upper()),
    )
    if name == "data":  # the positional DATA directory
        kw.pop("dest"), kw.pop("metavar")
        arg_group.add_argument(key, nargs="?", metavar="DATA", **kw)
        return
    names = [name, *flag_aliases(f)] + ([f.metadata["short"]] if f.metadata.get("short") else [])
    if f.metadata.get("required"):
        kw["required"] = True
    tp, _ = _base_type(f.type)
    if tp is bool:
        kw.pop("metavar")
        arg_group.add_argument(*names, action="store_true", **kw)
        if _default_of(f) is True:  # a way to turn it off from the command line
            kw["help"] = f"turn off {name}"
            arg_group.add_argument("--no-" + name[2:], action="store_false", **kw)
        return
    if f.metadata.get("repeatable"):
        kw["action"] = "append"
    if f.metadata.get("nargs"):  # one flag, several values: --data-mixture 0.7 web 0.3 code
        kw["nargs"] = f.metadata["nargs"]
    kw["type"] = value_parser(f)
    if "choices" in f.metadata:
        kw["choices"] = list(f.metadata["choices"]) + ([None] if _takes_null(f) else [])
        kw["metavar"] = "{" + ",".join(f.metadata["choices"]) + "}"
    arg_group.add_argument(*names, **kw)


def _takes_null(f):
    """`none`/`null` sets an Optional field to None, except where the flag must be given."""
    return _base_type(f.type)[1] and not f.metadata.get("required")


def value_parser(f):
    """The function that turns a flag's text into its field's value: the field's `type`
    (a checked type such as command_checks.positive_int), else its annotation's."""
    tp, _ = _base_type(f.type)
    repeatable = f.metadata.get("repeatable")
    if repeatable or f.metadata.get("nargs"):
        tp = typing.get_args(tp)[0]  # one element per value: `--prompt none` is a prompt
    elif typing.get_origin(tp) in (list, typing.List):
        return parse_float_list
    convert = f.metadata.get("type", tp)
    return _typed(
        convert,
        _takes_null(f) and not (repeatable or f.metadata.get("nargs")),
        getattr(convert, "__name__", "value"),
        f.metadata.get("choices", ()),
    )


def parse_flags(parser, argv):
    """Split argv into typed flags and dotted overrides.

    Returns (namespace, flag_settings, overrides): flag_settings is [(dotted key, value)]
    for the flags the user typed, in schema order; overrides are `key=value` strings.
    """
    overrides, rest = [], []
    takes_value = {o for a in parser._actions if a.nargs != 0 for o in a.option_strings}
    for i, tok in enumerate(argv):
        # A dotted override is `key=value` (or `+key=…`/`~key`) not starting with a dash,
        # and not a flag's value: `generate --prompt "x = 1"` is a prompt.
        is_value = i > 0 and argv[i - 1] in takes_value
        if not is_value and not tok.startswith("-") and ("=" in tok or tok.startswith("~")):
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
        if any(not a.option_strings for a in parser._actions):
            return (
                f"unexpected argument {token!r}: only one DATA directory is accepted; options are --flags or key=value"
            )
        return f"unexpected argument {token!r}: options are --flags or key=value"
    name = token.split("=", 1)[0]
    options = [o for a in parser._actions for o in a.option_strings]
    near = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]}?)" if near else f"; see `{parser.prog} --help`"
    return f"unrecognized flag {name}{hint}"


def build_command_parser(prog, group, cls, description):
    """The parser of a command beside train (eval-lm, generate, export-model): a flag for
    each field of its dataclass (trainer/config/commands.py), stored at `group.field`."""
    parser = _Parser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=override_epilog(group, cls),
    )
    add_debug_flag(parser)
    add_field_flags(parser, group, cls)
    return parser


def override_epilog(group, cls):
    example = next(
        f
        for f in fields(cls)
        if flag_name(f).startswith("--")
        and _base_type(f.type)[0] is not bool
        and not f.metadata.get("required")
        and not f.metadata.get("repeatable")
    )
    return (
        f"Every flag is also a key=value override: `{flag_name(example)} X` = `{group}.{example.name}=X` "
        "(an override wins over its flag)."
    )


def parse_command(parser, group, cls, argv):
    """The dataclass `cls` from a command line of its flags and `group.key=value` overrides."""
    _, settings, overrides = parse_flags(parser, argv)
    options, other_settings, other_overrides = command_options(group, cls, settings, overrides)
    if other_overrides:  # flags of other groups cannot reach here: the parser has none
        key = other_overrides[0].lstrip("+~").partition("=")[0]
        raise UsageError(unknown_key_message(group, cls, key))
    return options


def command_options(group, cls, settings, overrides):
    """(the dataclass `cls` from `group`'s flags and overrides, the other settings, the other
    overrides). An override's text is read as its flag's is, by the same checked type, so
    `--batch-size 0` and `eval_lm.batch_size=0` are refused alike; it wins over the flag."""
    by_name = {f.name: f for f in fields(cls)}
    values = {key.partition(".")[2]: value for key, value in settings if key.partition(".")[0] == group}
    other_overrides = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        if key.partition(".")[0] != group:
            other_overrides.append(text)
            continue
        if not sep or key.partition(".")[2] not in by_name:
            raise UsageError(unknown_key_message(group, cls, key.lstrip("+~")))
        f = by_name[key.partition(".")[2]]
        value = override_value(f, key, raw)
        values[f.name] = values.get(f.name, []) + [value] if f.metadata.get("repeatable") else value
    other_settings = [(k, v) for k, v in settings if k.partition(".")[0] != group]
    return cls(**values), other_settings, other_overrides


def override_value(f, key, raw):
    """`key=raw`'s value for field f: true/false for a switch, else what its flag's type makes of raw."""
    try:
        if _base_type(f.type)[0] is bool:
            if raw.lower() not in ("true", "false"):
                raise argparse.ArgumentTypeError("expected true or false")
            return raw.lower() == "true"
        value = value_parser(f)(raw)
    except (argparse.ArgumentTypeError, ValueError) as e:
        reason = str(e) if isinstance(e, argparse.ArgumentTypeError) else f"expected {value_parser(f).__name__}"
        raise UsageError(f"cannot set {key}={raw!r}: {reason}") from None
    choices = f.metadata.get("choices")
    if choices and value not in choices and not (value is None and _takes_null(f)):
        raise UsageError(f"cannot set {key}={raw!r}: expected one of {', '.join(choices)}")
    return value


def unknown_key_message(group, cls, key):
    keys = [f"{group}.{f.name}" for f in fields(cls)]
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not near:  # `context_window=4` without its group still deserves a hint
        near = [
            f"{group}.{leaf}"
            for leaf in difflib.get_close_matches(
                key.split(".")[-1], [k.partition(".")[2] for k in keys], n=1, cutoff=0.6
            )
        ]
    hint = f" (did you mean {near[0]}?)" if near else f"; the keys are {group}.KEY, one per flag"
    return f"unknown config key {key}{hint}"


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
