"""What the server that local ranks are forked from imports, once, before any rank exists
(trainer/launch/local_ranks.py has multiprocessing's forkserver preload this module).

Importing it loads everything a rank of `train` or `eval-lm` needs, so that a rank forked
from the server starts with it loaded. In the server itself it also ties the server's
life to the launcher's: a launcher killed outright takes the server and so the ranks
with it, as spawned ranks went with their launcher.
"""

import importlib
import os

from trainer.errors import STOP_SIGNALS
from trainer.launch.local_ranks import LAUNCHER_PID, set_parent_death_signal

if os.environ.get(LAUNCHER_PID) == str(os.getppid()):  # this is the server, not a rank or the launcher
    import signal

    set_parent_death_signal(signal.SIGKILL)
    # A signal meant for the job (SLURM's USR1 before the time limit, scancel's TERM, a
    # shell's `kill -TERM -PGID`, Ctrl-C in a terminal) reaches every process of it, this
    # one too. The launcher and the ranks act on it; the server must live on, or its end
    # would kill the ranks during their last save. Its ranks take their own handlers back
    # (local_ranks._rank_main). The launcher started this process with these signals
    # blocked, so none could land before this point: one that did is dropped here.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

# Every rank's imports, DCP's included: whatever a rank imports after the fork, each
# rank pays for again.
RANK_MODULES = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "trainer.inference.eval_lm",
    "trainer.cpu.gloo_comms",
    "trainer.train.main",
)
for module in RANK_MODULES:
    importlib.import_module(module)
