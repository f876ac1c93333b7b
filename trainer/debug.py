"""`--debug` / SHARDLM_DEBUG=1: an error shows its traceback as well as its one line.

Kept in the environment, so ranks spawned by `train` and `eval-lm` see it too.
"""
import os
import traceback

ENV = "SHARDLM_DEBUG"


def debugging():
    return os.environ.get(ENV, "") not in ("", "0")


def show_traceback():
    """Print the traceback of the exception being handled, when debugging."""
    if debugging():
        traceback.print_exc()
