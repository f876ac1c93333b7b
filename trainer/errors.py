"""How a job stops on bad input or a lost rank, said in one line: the exception classes
every room raises, the hint that follows them, and `--debug`'s traceback.

A torch-free leaf: every room imports it, the torch-free entry points (`train --help`,
a bad flag, the launcher) included.
"""
import os
import signal
import traceback

from data.errors import DataError

DEBUG_ENV = "SHARDLM_DEBUG"  # kept in the environment, so spawned ranks see it too

# The signals that stop a job cleanly: SIGUSR1 (SLURM's warning before the time limit,
# `--signal=USR1@120`) and SIGTERM (preemption, scancel). The launcher forwards them to
# its local ranks; a rank saves checkpoint_last and stops (trainer/train/preemption.py).
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class UsageError(Exception):
    """Bad command-line or config input: printed as one line, exit code 2."""


class RankStopped(Exception):
    """This rank stops because of another rank: it lost a peer, or rank 0 refused the run.
    Under local spawn the launcher prints one line for the whole job; a rank started on
    its own (torchrun, SLURM, a tcp:// init method) prints this message itself."""


# What a rank reports as one line rather than a traceback.
USER_ERRORS = (DataError, UsageError, FloatingPointError, RankStopped)


def resume_hint(cfg, prog):
    checkpoint = getattr(cfg, "checkpoint", None)
    if prog == "train" and checkpoint is not None and not checkpoint.no_save:
        return "rerun the same command to resume from checkpoint_last"
    return "rerun the same command"


def debugging():
    """`--debug` or SHARDLM_DEBUG=1: an error shows its traceback as well as its one line."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def show_traceback():
    """Print the traceback of the exception being handled, when debugging."""
    if debugging():
        traceback.print_exc()
