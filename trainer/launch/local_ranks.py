"""Start a job's local ranks as forks of a server that has imported torch once.

Spawned ranks (torch.multiprocessing's way) each start a fresh interpreter and import
torch, FSDP, DCP and the trainer again, each paying those imports' CPU time, after the
launcher itself had imported torch for nothing but the spawning. Instead the launcher,
which never imports torch, starts multiprocessing's forkserver as soon as it knows it will
spawn: the server imports all that once (trainer/launch/rank_server.py) and every rank is
a fork of it, ready at once. Forking the launcher itself would be faster still but is not
safe: a launcher that already ran OpenMP work (a test, or a sweep that trained a one-rank
job in this process) hands its forks a thread pool they hang in.

The server takes its environment when it starts; it is stopped when the job's ranks have
ended, so that the next job of the same process gets a server with that job's environment.
"""
import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
from multiprocessing import forkserver

from trainer.errors import STOP_SIGNALS

LAUNCHER_PID = "SHARDLM_RANK_SERVER_LAUNCHER"  # set only while the launcher starts the server


def start_rank_server():
    """Start the server now: its imports overlap whatever the launcher still does."""
    stop_rank_server()  # one left by an earlier job has that job's environment
    forkserver.set_forkserver_preload(["trainer.launch.rank_server"])
    os.environ[LAUNCHER_PID] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[LAUNCHER_PID]


def stop_rank_server():
    """End the server once the ranks have. Its own way out waits for every process that
    holds its pipe, a rank's lingering child included, and it ignores the job's signals:
    SIGKILL ends it at once."""
    server = forkserver._forkserver
    if rank_server_running():
        try:
            os.kill(server._forkserver_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server._stop()


def rank_server_running():
    # multiprocessing keeps one server per process; these are CPython 3.11's internals
    return forkserver._forkserver._forkserver_pid is not None


def start_local_ranks(fn, args, nprocs, errors_dir):
    """`fn(index, *args)` in `nprocs` forks of the server; returns their Process objects.
    A rank that raises leaves its traceback in errors_dir/traceback.<index>."""
    ctx = multiprocessing.get_context("forkserver")
    processes = []
    for i in range(nprocs):
        p = ctx.Process(target=_rank_main, args=(fn, i, args, traceback_file(errors_dir, i)), daemon=False)
        p.start()
        processes.append(p)
    return processes


def traceback_file(errors_dir, index):
    return os.path.join(errors_dir, f"traceback.{index}")


def _rank_main(fn, index, args, error_file):
    # The server's death (it follows the launcher's) interrupts the rank, as a spawned
    # rank's parent's death did.
    set_parent_death_signal(signal.SIGINT)
    for sig in STOP_SIGNALS:  # the server ignores them (trainer/launch/rank_server.py); a rank must not
        signal.signal(sig, signal.SIG_DFL)
    try:
        fn(index, *args)
    except KeyboardInterrupt:
        pass  # interrupted with the launcher, which reports the job
    except Exception:
        import traceback

        with open(error_file, "wb") as f:
            pickle.dump(traceback.format_exc(), f)
        sys.exit(1)


def set_parent_death_signal(sig):
    """Have the kernel send `sig` to this process when its parent dies (Linux's prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a killed launcher leaves its ranks to end on their own


def forward_signals(processes):
    """In a process that spawned local ranks: pass SIGUSR1/SIGTERM on to them, so they
    save and stop as if they had been signalled themselves."""
    def forward(signum, frame):
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signum)
    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
