"""Stop cleanly when the cluster says so: SIGUSR1 (SLURM's warning before the time limit,
`--signal=USR1@120`) and SIGTERM (preemption, scancel) finish the current update, the
ranks agree, checkpoint_last is saved, and under SLURM the job requeues itself so the
same command resumes from it. Outside SLURM the same signals save and exit.

A signal reaches the ranks at different moments (or only some of them), so the flag is
summed over all ranks after every update: all stop after the same update, or none does.
"""
import logging
import os
import signal
import subprocess
import time

log = logging.getLogger("shardlm")
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


# A signal sent to every process of a job (SLURM, `kill -TERM -PGID`) reaches a spawned
# rank twice: directly, and forwarded by its launcher milliseconds later. Copies this close
# are one signal.
SAME_SIGNAL_S = 1.0


class Preemption:
    def __init__(self, env):
        self.env = env
        self.received = None
        self.first_at = None
        for sig in SIGNALS:
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
        # Imported here: the launcher imports this module (forward_signals) and never torch.
        from trainer.distributed import all_reduce_sum

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


def forward_signals(processes):
    """In a process that spawned local ranks: pass SIGUSR1/SIGTERM on to them, so they
    save and stop as if they had been signalled themselves."""
    def forward(signum, frame):
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signum)
    for sig in SIGNALS:
        signal.signal(sig, forward)
