"""The flags of the commands beside train (eval-lm, generate, export-model, preprocess, plan's own):
each is generated from a field of its dataclass (trainer/config/commands.py) as train's
are from schema.py, reaches that field as a flag and as a key=value override, and a bad
value gets one line. And no command's --help says a default twice. No torch needed."""

import re
import subprocess
import sys
import typing
from dataclasses import MISSING, fields

import pytest

import cli
from trainer.config.commands import COMMAND_GROUPS
from trainer.config.flags import (
    add_field_flags,
    build_command_parser,
    build_parser,
    command_options,
    flag_aliases,
    flag_name,
    parse_command,
    parse_flags,
)

# The flags a command needs before it parses anything else (given where a field is not the one under test).
REQUIRED = {
    "eval-lm": ["--path", "ckpt"],
    "generate": ["--path", "ckpt"],
    "serve": ["--path", "ckpt"],
    "export-model": ["--path", "ckpt", "--out", "out"],
    "plan": [],
    "preprocess": [],
}


def command_fields():
    return [(prog, f) for prog, (_, cls) in COMMAND_GROUPS.items() for f in fields(cls)]


def parse(prog, argv):
    """The command's options from argv, as its entry point reads them (plan: with train's flags)."""
    group, cls = COMMAND_GROUPS[prog]
    if prog != "plan":
        return parse_command(build_command_parser(prog, group, cls, ""), group, cls, argv)
    parser = build_parser("plan")
    add_field_flags(parser, group, cls)
    _, settings, overrides = parse_flags(parser, argv)
    return command_options(group, cls, settings, overrides)[0]


def _non_default(f):
    """(the text of a value for field f other than its default, that value)."""
    default = f.default_factory() if f.default is MISSING else f.default
    tp = f.type
    if typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if f.metadata.get("choices"):
        value = next(c for c in f.metadata["choices"] if c != default)
        return value, value
    if f.metadata.get("repeatable"):
        return "some prompt = with an equals sign", ["some prompt = with an equals sign"]
    if tp is int:
        return str((default or 0) + 3), (default or 0) + 3
    if tp is float:
        return "0.125", 0.125
    if typing.get_origin(tp) is dict:
        return "{'dropout': 0.25}", {"dropout": 0.25}
    return "some/value", "some/value"


def _without(argv, name):
    """REQUIRED without the flag under test (and its value)."""
    if name not in argv:
        return list(argv)
    i = argv.index(name)
    return argv[:i] + argv[i + 2 :]


@pytest.mark.parametrize("prog,f", command_fields(), ids=lambda x: getattr(x, "name", x))
def test_every_command_flag_reaches_its_field(prog, f):
    name, base = flag_name(f), _without(REQUIRED[prog], flag_name(f))
    default = f.default_factory() if f.default is MISSING else f.default
    if f.type is bool:
        assert getattr(parse(prog, base + [name]), f.name) is True and default is False
        return
    text, value = _non_default(f)
    argv = [text] if name == "data" else [name, text]
    assert getattr(parse(prog, base + argv), f.name) == value
    for alias in flag_aliases(f):
        assert getattr(parse(prog, base + [alias, text]), f.name) == value
    if not f.metadata.get("required"):  # a required flag is given as a flag
        assert getattr(parse(prog, base + [f"{COMMAND_GROUPS[prog][0]}.{f.name}={text}"]), f.name) == value
        assert getattr(parse(prog, REQUIRED[prog]), f.name) == default


@pytest.mark.parametrize(
    "prog,f", [(p, f) for p, f in command_fields() if f.type is bool], ids=lambda x: getattr(x, "name", x)
)
def test_a_switch_is_also_a_true_false_override(prog, f):
    group = COMMAND_GROUPS[prog][0]
    assert getattr(parse(prog, REQUIRED[prog] + [f"{group}.{f.name}=true"]), f.name) is True
    assert (
        getattr(
            parse(
                prog,
                REQUIRED[prog] + [f.metadata.get("flag", "--" + f.name.replace("_", "-")), f"{group}.{f.name}=false"],
            ),
            f.name,
        )
        is False
    )


def test_an_override_wins_over_its_flag_and_a_repeated_one_adds():
    args = parse("eval-lm", ["--path", "ckpt", "--context-window", "3", "eval_lm.context_window=5"])
    assert args.context_window == 5
    args = parse("generate", ["--path", "ckpt", "--prompt", "a", "generate.prompt=b", "--prompt", "c"])
    assert args.prompt == ["a", "c", "b"]
    assert parse("plan", ["--format", "text", "plan.format=json"]).format == "json"


def _help(prog, capsys):
    with pytest.raises(SystemExit) as e:
        cli.COMMANDS[prog](["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _entries(help_text):
    """Each flag's (or heading's) lines of a --help, joined into one line."""
    entries = []
    for line in help_text.splitlines():
        if re.match(r"^  \S", line) or not line.startswith("  "):
            entries.append(line.strip())
        else:
            entries[-1] += " " + line.strip()
    return entries


@pytest.mark.parametrize("prog", list(COMMAND_GROUPS) + ["export"])
def test_help_lists_every_flag_and_alias(prog, capsys):
    out = _help(prog, capsys)
    _, cls = COMMAND_GROUPS["export-model" if prog == "export" else prog]
    for f in fields(cls):
        for name in (flag_name(f), *flag_aliases(f)):
            assert (name if name != "data" else "DATA") in out


@pytest.mark.parametrize("prog", ["train", "eval-lm", "generate", "serve", "export-model", "plan", "preprocess"])
def test_no_help_says_a_default_twice(prog, capsys):
    """`(default: tqdm on a terminal, else simple) (default: None)`: the second one is noise."""
    twice = [e for e in _entries(_help(prog, capsys)) if len(re.findall(r"\(default\b|; default:", e)) > 1]
    assert not twice, twice


@pytest.mark.parametrize(
    "prog,argv,message",
    [
        ("eval-lm", ["--batch-size", "0"], "argument --batch-size/--max-sentences: must be at least 1, got 0"),
        ("eval-lm", ["--max-sentences", "x"], "expected a whole number, got 'x'"),
        ("eval-lm", ["--num-workers", "-1"], "argument --num-workers: must be >= 0, got -1"),
        ("eval-lm", ["--context-window", "-1"], "--context-window must be >= 0, got -1"),
        ("eval-lm", ["--model-overrides", "3"], "--model-overrides '3' is not a dict"),
        ("eval-lm", ["--model-overrides", "{'decoder_layrs': 2}"], "did you mean decoder_layers?"),
        ("eval-lm", ["--sample-break-mode", "eos2"], "argument --sample-break-mode: invalid choice: 'eos2'"),
        ("eval-lm", ["eval_lm.batch_size=0"], "cannot set eval_lm.batch_size='0': must be at least 1, got 0"),
        ("eval-lm", ["eval_lm.context_window=-1"], "--context-window must be >= 0, got -1"),
        ("eval-lm", ["eval_lm.cpu=maybe"], "cannot set eval_lm.cpu='maybe': expected true or false"),
        (
            "eval-lm",
            ["eval_lm.contxt_window=3"],
            "unknown config key eval_lm.contxt_window (did you mean eval_lm.context_window?)",
        ),
        ("eval-lm", ["context_window=3"], "(did you mean eval_lm.context_window?)"),
        ("eval-lm", ["--contxt-window", "3"], "unrecognized flag --contxt-window (did you mean --context-window?)"),
        ("eval-lm", ["a", "b"], "only one DATA directory is accepted"),
        ("generate", ["--temperature", "-1"], "need --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1"),
        ("generate", ["generate.top_p=0"], "need --temperature >= 0"),
        ("generate", ["--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
        ("generate", ["--top-k", "1.5"], "argument --top-k: invalid int value: '1.5'"),
        # DATA is fairseq-interactive's data dir; a second positional is a prompt given without --prompt
        ("generate", ["data", "prompt"], "unexpected argument 'prompt': only one DATA directory is accepted"),
        ("export-model", ["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        ("export-model", ["export_model.format=onnx"], "cannot set export_model.format='onnx': expected one of"),
        ("plan", ["--cpu", "--device-memory-gb", "-5"], "argument --device-memory-gb: must be a positive number"),
        (
            "plan",
            ["--cpu", "plan.host_memory_gb=nan"],
            "cannot set plan.host_memory_gb='nan': must be a positive number",
        ),
        ("plan", ["--cpu", "--ranks-per-host", "0"], "argument --ranks-per-host: must be at least 1, got 0"),
        ("plan", ["--cpu", "plan.ranks_per_host=8"], "--ranks-per-host 8 exceeds the job's 1 rank(s)"),
        ("plan", ["--cpu", "plan.formt=json"], "unknown config key plan.formt (did you mean plan.format?)"),
    ],
)
def test_a_bad_value_gets_one_line_and_exit_2(prog, argv, message, capsys, monkeypatch):
    monkeypatch.delenv("SHARDLM_DEBUG", raising=False)
    code = cli.COMMANDS[prog](REQUIRED[prog] + argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    assert message in err, err


def test_eval_lm_help_answers_without_torch():
    probe = (
        "import sys, cli\ntry:\n    cli.eval_lm_main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch loaded:', 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("torch loaded: False"), r.stderr
