"""One option of the config schema: a dataclass field with its help and flag metadata."""

from dataclasses import field


def option(default, help, **meta):
    """A field whose metadata make its fairseq flag (trainer/config/flags.py): `help`;
    `choices`; `flag` when the fairseq spelling is not `--field-name`; `alias` for another
    spelling (a tuple for several). A list default is copied per instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})
