"""How a job stops on bad input, a lost rank or Ctrl-C, said in one line: the exception
classes every room raises, the hint that follows them, and `--debug`'s traceback.

A torch-free leaf: every room imports it, the torch-free entry points (`train --help`,
a bad flag, the launcher) included.
"""

import json
import multiprocessing
import os
import signal
import traceback

from data.errors import DataError

DEBUG_ENV = "SHARDLM_DEBUG"  # kept in the environment, so spawned ranks see it too

# The signals that stop a job cleanly: SIGUSR1 (SLURM's warning before the time limit,
# `--signal=USR1@120`), SIGTERM (preemption, scancel) and SIGINT (Ctrl-C). The launcher
# forwards them to its local ranks; a rank saves checkpoint_last and stops
# (trainer/train/preemption.py).
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
INTERRUPTED = 130  # exit status of a job stopped by Ctrl-C: 128 + SIGINT, as shells report it


class InterruptedAgain(KeyboardInterrupt):
    """A second Ctrl-C while the first one's save is under way: stop at once, unsaved."""


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


def end_child_processes():
    """SIGKILL the processes this one started through multiprocessing (a rank's data loader
    workers) before it stops at once: left to the interpreter's exit, or orphaned, a worker
    serving its rank a batch prints the traceback of the connection its rank dropped."""
    # torch's DataLoader raises from its SIGCHLD handler when a worker dies of a signal;
    # these deaths are this process's doing.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        child.kill()
        child.join(1)


def interrupted_line(prog, error, cfg=None):
    """The one line a job stopped by Ctrl-C ends with, in place of KeyboardInterrupt's traceback."""
    hint = resume_hint(cfg, prog)
    save_dir = getattr(getattr(cfg, "checkpoint", None), "save_dir", None)
    if save_dir is not None and not os.path.isdir(os.path.join(save_dir, "checkpoint_last")):
        hint = resume_hint(None, prog)  # interrupted before its first save: there is nothing to resume
    if isinstance(error, InterruptedAgain):
        saved = f"; {last_saved(cfg.checkpoint)}" if prog == "train" and save_dir is not None else ""
        return f"{prog}: interrupted again: stopped at once, not waiting for a save{saved}; {hint}"
    return f"{prog}: interrupted; {hint}"


def last_saved(checkpoint_cfg):
    """What --save-dir keeps of a run stopped at once, in words (read from the disk: what the
    user has, whichever process asks)."""
    if checkpoint_cfg.no_save:
        return "nothing was saved (--no-save)"
    state = os.path.join(checkpoint_cfg.save_dir, "checkpoint_last", "trainer_state.json")
    try:
        with open(state) as f:
            num_updates = json.load(f)["num_updates"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"nothing was saved in {checkpoint_cfg.save_dir}"
    return f"{os.path.join(checkpoint_cfg.save_dir, 'checkpoint_last')} holds update {num_updates}"


def debugging():
    """`--debug` or SHARDLM_DEBUG=1: an error shows its traceback as well as its one line."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def show_traceback():
    """Print the traceback of the exception being handled, when debugging."""
    if debugging():
        traceback.print_exc()
