"""preprocess's command line, flag by flag: every flag string it accepted when its flags were
hand-written argparse (data/preprocess.py before issue 48 item 8) still reaches the same
field with the same value, now that they are generated from PreprocessConfig
(trainer/config/commands.py); each is also a `preprocess.key=value` override, and a bad
value or an unknown flag gets one line, as for every other command. No torch."""

from dataclasses import fields
from pathlib import Path

import pytest

import cli
from data.embedded_corpus import preprocess_options as embedded_options
from helpers import preprocess_options
from trainer.config.commands import COMMAND_GROUPS, PreprocessConfig
from trainer.config.flags import build_command_parser

# Every option string `preprocess` accepted before its flags came from a dataclass, with a
# value other than its default and the field that value lands in. fairseq-preprocess's own
# flags that preprocess shares are --trainpref, --validpref, --testpref, --destdir (default
# data-bin in both) and --workers (default 1 in both); preprocess had no aliases and no
# other fairseq spellings (--only-source, --srcdict, ... were, and are, refused).
FLAGS = [
    ("--trainpref", "corpus/train.txt,more/*.jsonl", "trainpref", "corpus/train.txt,more/*.jsonl"),
    ("--validpref", "a.txt,b.txt", "validpref", "a.txt,b.txt"),
    ("--testpref", "test.parquet", "testpref", "test.parquet"),
    ("--destdir", "out/bin", "destdir", "out/bin"),
    ("--text-column", "body", "text_column", "body"),
    ("--input-format", "parquet", "input_format", "parquet"),
    ("--vocab-size", "120", "vocab_size", 120),
    ("--spm-model-type", "unigram", "spm_model_type", "unigram"),
    ("--spm-model", "tok.model", "spm_model", "tok.model"),
    ("--tokenizer", "./Llama-3.2-1B", "tokenizer", "./Llama-3.2-1B"),
    ("--chat-template", "chat.jinja", "chat_template", "chat.jinja"),
    ("--max-length", "2048", "max_length", 2048),
    ("--workers", "3", "workers", 3),
    ("--seed", "7", "seed", 7),
    ("--shard-mb", "0.5", "shard_mb", 0.5),  # issue 49 item 3: corpus-scale preprocess
]
SWITCHES = ["--debug"]  # sets SHARDLM_DEBUG (cli.py), no field
DEFAULTS = {
    "trainpref": None,
    "validpref": None,
    "testpref": None,
    "destdir": "data-bin",
    "text_column": "text",
    "input_format": "auto",
    # None: not given, so that passing one with --spm-model/--tokenizer is refused, not ignored;
    # data/preprocess.py then uses 8000, bpe and 1.
    "vocab_size": None,
    "spm_model_type": None,
    "spm_model": None,
    "tokenizer": None,
    "chat_template": None,
    "max_length": None,
    "workers": 1,
    "seed": None,
    "shard_mb": None,
}
INPUT_FORMATS = ["auto", "text", "json", "parquet", "csv", "arrow"]


def parse(argv):
    return preprocess_options(argv)


def option_strings():
    group, cls = COMMAND_GROUPS["preprocess"]
    return {o for a in build_command_parser("preprocess", group, cls, "")._actions for o in a.option_strings}


def test_the_flags_are_these_and_no_others():
    assert option_strings() == {"-h", "--help", *SWITCHES, *(flag for flag, *_ in FLAGS)}


@pytest.mark.parametrize("flag,text,field,value", FLAGS, ids=[f[0] for f in FLAGS])
def test_each_flag_reaches_its_field(flag, text, field, value):
    assert vars(parse([flag, text])) == {**DEFAULTS, field: value}
    assert vars(parse([f"{flag}={text}"])) == {**DEFAULTS, field: value}
    # its dotted override, alone and over the flag
    assert vars(parse([f"preprocess.{field}={text}"])) == {**DEFAULTS, field: value}
    assert getattr(parse([flag, DEFAULT_TEXT[field], f"preprocess.{field}={text}"]), field) == value


# A value of each field that parses to its default (the flag given, then overridden).
DEFAULT_TEXT = {field: "none" if value is None else str(value) for field, value in DEFAULTS.items()}


def test_defaults():
    assert vars(parse([])) == DEFAULTS
    assert [f.name for f in fields(PreprocessConfig)] == list(DEFAULTS)


def test_none_unsets_an_optional_value():
    assert parse(["--vocab-size", "120", "preprocess.vocab_size=null"]).vocab_size is None
    assert parse(["--tokenizer", "none"]).tokenizer is None


@pytest.mark.parametrize("choice", INPUT_FORMATS)
def test_every_input_format(choice):
    assert parse(["--input-format", choice]).input_format == choice


def test_debug_is_accepted(monkeypatch):
    monkeypatch.delenv("SHARDLM_DEBUG", raising=False)
    assert vars(parse(["--debug"])) == DEFAULTS


def test_the_embedded_corpus_names_every_option(tmp_path):
    assert list(vars(embedded_options(tmp_path, tmp_path))) == list(DEFAULTS)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--vocab-size", "abc"], "argument --vocab-size: invalid int value: 'abc'"),
        (["--workers", "0"], "argument --workers: must be at least 1, got 0"),
        (["--workers", "x"], "argument --workers: expected a whole number, got 'x'"),
        (["--max-length", "0"], "argument --max-length: must be at least 1, got 0"),
        (["--input-format", "xml"], "argument --input-format: invalid choice: 'xml'"),
        (["--spm-model-type", "wordpiece"], "argument --spm-model-type: invalid choice: 'wordpiece'"),
        (["--trainpref"], "argument --trainpref: expected one argument"),
        (["preprocess.workers=0"], "cannot set preprocess.workers='0': must be at least 1, got 0"),
        (["preprocess.input_format=xml"], "cannot set preprocess.input_format='xml': expected one of auto, text"),
        (["preprocess.vocab_size=big"], "cannot set preprocess.vocab_size='big': expected int"),
        (["--vocab", "60"], "unrecognized flag --vocab (did you mean --vocab-size?)"),
        (["--only-source"], "unrecognized flag --only-source; see `preprocess --help`"),
        (["--trainpre", "a.txt"], "unrecognized flag --trainpre (did you mean --trainpref?)"),
        (["preprocess.vocab=60"], "unknown config key preprocess.vocab (did you mean preprocess.vocab_size?)"),
        (["vocab_size=60"], "unknown config key vocab_size (did you mean preprocess.vocab_size?)"),
        (["train.txt"], "unexpected argument 'train.txt': options are --flags or key=value"),
    ],
)
def test_a_bad_value_or_unknown_flag_gets_one_line_and_exit_2(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("SHARDLM_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    code = cli.preprocess_main(["--trainpref", "train.txt"] + argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("preprocess: error: "), err
    assert message in err, err
    assert not any(Path(tmp_path).iterdir())  # nothing written


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit) as e:
        cli.preprocess_main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag, *_ in FLAGS:
        assert flag in out
    for shown in ("(default: data-bin)", "(default: text)", "(default: auto)", "(default: 8000)", "(default: bpe)"):
        assert out.count(shown) == 1, shown
    assert "`--trainpref X` = `preprocess.trainpref=X`" in out
