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
from multiprocessing import forkserver, resource_tracker

from trainer.errors import STOP_SIGNALS, InterruptedAgain, end_child_processes

LAUNCHER_PID = "SHARDLM_RANK_SERVER_LAUNCHER"  # set only while the launcher starts the server
_started_tracker = False  # multiprocessing's resource tracker was started for the server, not before


def start_rank_server():
    """Start the server now: its imports overlap whatever the launcher still does."""
    stop_rank_server()  # one left by an earlier job has that job's environment
    forkserver.set_forkserver_preload(["trainer.launch.rank_server"])
    # The server inherits this mask: a job signal (a Ctrl-C to the whole process group)
    # waits until the server has set its own dispositions (trainer/launch/rank_server.py)
    # instead of interrupting its start with a traceback. The resource tracker goes first:
    # starting it unblocks these signals again (it guards its own start the same way).
    global _started_tracker
    _started_tracker = _started_tracker or resource_tracker._resource_tracker._fd is None
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    os.environ[LAUNCHER_PID] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[LAUNCHER_PID]
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


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


def stop_resource_tracker():
    """End multiprocessing's resource tracker, if it was started for the server, and wait for
    it: it would otherwise outlive the launcher by a moment (it leaves when its last holder
    does). One the process had before (its own semaphores registered there) stays."""
    global _started_tracker
    if not _started_tracker:
        return
    _started_tracker = False
    try:
        resource_tracker._resource_tracker._stop()  # CPython's internals, like the server's above
    except (AttributeError, ChildProcessError):
        pass


def rank_server_running():
    # multiprocessing keeps one server per process; these are CPython 3.11's internals
    return forkserver._forkserver._forkserver_pid is not None


def start_local_ranks(fn, args, nprocs, errors_dir, processes=None):
    """`fn(index, *args)` in `nprocs` forks of the server; returns their Process objects,
    appended to `processes` (when given) as each starts, so that a launcher interrupted
    halfway knows which to end. A rank that raises leaves its traceback in
    errors_dir/traceback.<index>."""
    ctx = multiprocessing.get_context("forkserver")
    processes = [] if processes is None else processes
    for i in range(nprocs):
        p = ctx.Process(target=_rank_main, args=(fn, i, args, traceback_file(errors_dir, i)), daemon=False)
        p.start()
        processes.append(p)
    return processes


def traceback_file(errors_dir, index):
    return os.path.join(errors_dir, f"traceback.{index}")


def _rank_main(fn, index, args, error_file):
    # The server's death (it follows the launcher's, killed outright) kills the rank too:
    # not SIGINT, which would have it save and stop with nobody left to report it.
    set_parent_death_signal(signal.SIGKILL)
    # The server ignores the job's signals (trainer/launch/rank_server.py); a rank must not.
    # Until training installs its handlers (trainer/train/preemption.py) they end the rank
    # at once: there is nothing to save yet.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    try:
        fn(index, *args)
    except KeyboardInterrupt:
        # Ctrl-C while starting, or a second one: the launcher got it too and reports the
        # job in one line. Dying of SIGINT tells it (and, outside a launcher, the shell) why.
        _die_of_sigint()
    except Exception:
        import traceback

        with open(error_file, "wb") as f:
            pickle.dump(traceback.format_exc(), f)
        sys.exit(1)


def _die_of_sigint():
    import logging

    end_child_processes()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(1)  # not reached: SIGINT's default action ends the process


def set_parent_death_signal(sig):
    """Have the kernel send `sig` to this process when its parent dies (Linux's prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a killed launcher leaves its ranks to end on their own


class JobSignals:
    """The launcher's handlers while its local ranks run. SIGUSR1, SIGTERM and a first
    Ctrl-C are passed on to the ranks, which save and stop as if signalled themselves (a
    signal sent to the whole process group reaches them twice; they take copies for one).
    A second Ctrl-C raises InterruptedAgain here, for the launcher to kill the ranks at once;
    so does a first one while the ranks are starting (KeyboardInterrupt): the server they are
    forked from may still be importing torch for seconds, and they have nothing to save.

    The kernel may hand a signal to any thread of the launcher (numpy's BLAS starts some),
    and then the main thread sleeping in wait() would not run the handler until a rank
    ended: `wakeup` is a file descriptor that becomes readable on every signal, for wait()."""

    def __init__(self):
        self.ranks = []  # filled by start_local_ranks as each starts
        self.starting = True  # until the launcher has started every rank
        self.interrupts = 0
        self.wakeup, wakeup_w = os.pipe()
        for fd in (self.wakeup, wakeup_w):
            os.set_blocking(fd, False)
        self.previous_wakeup = signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)
        self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.starting or self.interrupts > 1:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third one must not interrupt the way out
                raise InterruptedAgain if self.interrupts > 1 else KeyboardInterrupt
        for p in self.ranks:
            if p.is_alive():
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass  # it ended in between

    def ending(self):
        """The launcher is ending the interrupted job: more Ctrl-Cs have nothing left to stop."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def drain(self):
        """Empty `wakeup` once wait() has seen it (the handlers have run by then)."""
        try:
            while os.read(self.wakeup, 512):
                pass
        except BlockingIOError:
            pass

    def kill_ranks(self):
        kill_with_children(self.ranks)

    def restore(self):
        """The handlers as they were; SIGINT stays ignored once the job was interrupted: the
        command is ending, and a KeyboardInterrupt in its exit would be a traceback."""
        for sig, handler in self.previous.items():
            if sig != signal.SIGINT or not self.interrupts:
                signal.signal(sig, handler)
        os.close(signal.set_wakeup_fd(self.previous_wakeup))
        os.close(self.wakeup)


def kill_with_children(processes):
    """SIGKILL these ranks and every process they started (data loader workers, compile
    workers), together: a worker outliving its rank would serve it on (and print the
    traceback of a connection its rank broke) until it noticed."""
    alive = [p for p in processes if p.is_alive()]
    for pid in _descendants([p.pid for p in alive]) + [p.pid for p in alive]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in processes:
        p.join()


def _descendants(pids):
    """The processes started by `pids`, their children's too (Linux's /proc; [] elsewhere)."""
    children = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in filter(str.isdigit, entries):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(pids)
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found
