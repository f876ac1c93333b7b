"""Stop cleanly when the cluster says so: STOP_SIGNALS (trainer/errors.py) finish the
current update, the ranks agree, checkpoint_last is saved, and under SLURM the job requeues itself so the
same command resumes from it. Outside SLURM the same signals save and exit.

A signal reaches the ranks at different moments (or only some of them), so the flag is
summed over all ranks after every update: all stop after the same update, or none does.
"""
import logging
import os
import signal
import subprocess
import time

from trainer.errors import STOP_SIGNALS
from trainer.parallel.ranks import all_reduce_sum

log = logging.getLogger("shardlm")


# A signal sent to every process of a job (SLURM, `kill -TERM -PGID`) reaches a spawned
# rank twice: directly, and forwarded by its launcher milliseconds later. Copies this close
# are one signal.
SAME_SIGNAL_S = 1.0


class Preemption:
    def __init__(self, env):
        self.env = env
        self.received = None
        self.first_at = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.received is not None and signum == signal.SIGTERM and now - self.first_at > SAME_SIGNAL_S:
            # A second TERM: the cluster is out of patience; die the default way.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.received = signal.Signals(signum).name
        self.first_at = self.first_at or now

    def agreed(self):
        """True on every rank once any rank has received a signal (one tiny all-reduce)."""
        (flag,) = all_reduce_sum([1.0 if self.received else 0.0], self.env)
        return flag > 0

    def requeue(self):
        """Under SLURM, put this job back in the queue (rank 0, once); True if requeued."""
        job = os.environ.get("SLURM_JOB_ID")
        if not self.env.is_master or not job:
            return False
        # The job id is one argument, never a shell string.
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if r.returncode != 0:
            log.warning(f"could not requeue SLURM job {job}: {(r.stderr or r.stdout).strip()}; "
                        "resubmit it to resume from checkpoint_last")
            return False
        log.info(f"requeued SLURM job {job}: it resumes from checkpoint_last")
        return True
