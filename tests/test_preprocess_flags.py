"""preprocess's command line, flag by flag: every flag string it accepted when its flags were
hand-written argparse (data/preprocess.py before issue 48 item 8) still reaches the same
field with the same value, now that they are generated from PreprocessConfig. No torch."""

import pytest

from data.preprocess import build_parser

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
}
INPUT_FORMATS = ["auto", "text", "json", "parquet", "csv", "arrow"]


def parse(argv):
    return build_parser().parse_args(argv)


def option_strings():
    return {o for a in build_parser()._actions for o in a.option_strings}


def test_the_flags_are_these_and_no_others():
    assert option_strings() == {"-h", "--help", *SWITCHES, *(flag for flag, *_ in FLAGS)}


@pytest.mark.parametrize("flag,text,field,value", FLAGS, ids=[f[0] for f in FLAGS])
def test_each_flag_reaches_its_field(flag, text, field, value):
    assert getattr(parse([flag, text]), field) == value
    assert getattr(parse([f"{flag}={text}"]), field) == value
    others = {k: v for k, v in vars(parse([flag, text])).items() if k in DEFAULTS and k != field}
    assert others == {k: v for k, v in DEFAULTS.items() if k != field}


def test_defaults():
    assert {k: v for k, v in vars(parse([])).items() if k in DEFAULTS} == DEFAULTS


@pytest.mark.parametrize("choice", INPUT_FORMATS)
def test_every_input_format(choice):
    assert parse(["--input-format", choice]).input_format == choice


def test_debug_is_a_switch():
    assert parse(["--debug"]).debug is True
