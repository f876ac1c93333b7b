"""Stop cleanly when the cluster or the user says so: STOP_SIGNALS (trainer/errors.py) finish
the current update, the ranks agree, checkpoint_last is saved, and under SLURM the job requeues
itself so the same command resumes from it. Outside SLURM the same signals save and exit;
Ctrl-C (SIGINT) with exit status 130, as an interrupted command does.

A signal reaches the ranks at different moments (or only some of them), so the flag is
summed over all ranks after every update: all stop after the same update, or none does.
The sum is posted after one update and read after the next (AsyncHostSum): no rank ever
waits for it, and a job stops one update after the signal's, with every rank at that update.
A second signal, later, means "now": a second SIGTERM kills the rank the default way, a
second Ctrl-C raises InterruptedAgain, which ends the job with one line; either first says
what --save-dir holds.
"""

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time

from trainer.errors import INTERRUPTED, STOP_SIGNALS, InterruptedAgain, end_child_processes, last_saved
from trainer.parallel.ranks import AsyncHostSum

log = logging.getLogger("shardlm")


# A signal sent to every process of a job (SLURM, `kill -TERM -PGID`) reaches a spawned
# rank twice: directly, and forwarded by its launcher milliseconds later. Copies this close
# are one signal.
SAME_SIGNAL_S = 1.0


class Preemption:
    def __init__(self, env, timeout, checkpoint_cfg):
        """checkpoint_cfg: where a run stopped at once has its last save (said before it stops)."""
        self.env, self.checkpoint_cfg = env, checkpoint_cfg
        self.flags = AsyncHostSum(env, timeout)  # every rank makes it here, at once
        self.received = None
        self.first_at = None
        self.interrupted = False  # a Ctrl-C reached this rank, or (once agreed) another one
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        now = time.monotonic()
        again = self.received is not None and now - self.first_at > SAME_SIGNAL_S
        if again and signum in (signal.SIGTERM, signal.SIGINT):
            end_child_processes()  # the data loader workers go first, quietly
        if again and signum == signal.SIGTERM:
            if self.env.is_master:  # (a second Ctrl-C's line says it: trainer.errors.interrupted_line)
                # Straight to the file descriptor: a signal handler must not wait on a lock
                # the interrupted code may hold (logging's, a stream's).
                os.write(
                    2,
                    f"second SIGTERM: stopping at once, not waiting for a save; "
                    f"{last_saved(self.checkpoint_cfg)}\n".encode(),
                )
            # A second TERM: the cluster is out of patience; die the default way.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        if again and signum == signal.SIGINT:
            # A second Ctrl-C: the user will not wait for the save. Python's own answer to
            # Ctrl-C, raised where the rank is; the launcher turns it into one line.
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third one must not interrupt the way out
            raise InterruptedAgain
        self.received = signal.Signals(signum).name
        self.first_at = self.first_at or now
        self.interrupted = self.interrupted or signum == signal.SIGINT

    def agreed(self):
        """Called after every update, on every rank: True on all of them, after the same
        update, once any has received a signal. It reads the sum posted after the update
        before (which also tells every rank whether it was a Ctrl-C) and posts this one's."""
        if self.env.world_size == 1:
            return self.received is not None
        sums = self.flags.result()
        if sums is not None and sums[0] > 0:
            self.interrupted = sums[1] > 0
            return True
        self.flags.post([1.0 if self.received else 0.0, 1.0 if self.interrupted else 0.0])
        return False

    def finish(self):
        """After the last update: take in the sum still in flight (every rank posted it)."""
        self.flags.result()

    def exit_code(self):
        """0, or 130 for a run that a Ctrl-C stopped (the shell's code for an interrupted command)."""
        return INTERRUPTED if self.interrupted else 0

    def requeue(self):
        """Under SLURM, put this job back in the queue (rank 0, once); True if requeued."""
        job = os.environ.get("SLURM_JOB_ID")
        if not self.env.is_master or not job:
            return False
        # The job id is one argument, never a shell string.
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if r.returncode != 0:
            log.warning(
                f"could not requeue SLURM job {job}: {(r.stderr or r.stdout).strip()}; "
                "resubmit it to resume from checkpoint_last"
            )
            return False
        log.info(f"requeued SLURM job {job}: it resumes from checkpoint_last")
        return True


def leave_stop_signals_to_the_rank(worker_id=None):
    """Run in each data-loading worker of a rank (data/iterator.py). A job's signals reach
    every process of it, its workers too: the rank finishes its update, saves and ends its
    workers itself, so a worker leaves them to it (torch's worker would die of SIGTERM, and
    its rank with it, unsaved). Only its rank's SIGTERM (torch ending a worker that did not
    stop when asked, or multiprocessing's exit) still ends it; it also dies with its rank."""
    for sig in STOP_SIGNALS:
        if sig != signal.SIGTERM:
            signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: torch's worker notices its rank is gone within seconds
    if not hasattr(signal, "sigwaitinfo"):  # macOS: torch's own handling (dies of any SIGTERM)
        return
    rank = os.getppid()
    # Blocked here, inherited by every thread started from now on: only the waiter takes it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait_for_the_ranks_sigterm():
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == rank:
                os._exit(0)

    threading.Thread(target=wait_for_the_ranks_sigterm, daemon=True, name="sigterm-from-rank").start()
