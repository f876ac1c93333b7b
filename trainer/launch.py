"""Start the job's ranks: in this process, or spawned locally (fairseq's call_main).

A rank that fails ends the whole job: torch.multiprocessing.spawn terminates the other
ranks when one exits non-zero, so nobody waits forever in a collective.
"""
import dataclasses
import sys

from data.errors import DataError
from trainer.flags import UsageError

USER_ERRORS = (DataError, UsageError, FloatingPointError)


def launch(cfg, target=None, prog="train"):
    """Run `target(cfg, rdv)` (default: training) on every rank of the job."""
    from trainer.distributed import infer_rendezvous

    rdv = infer_rendezvous(cfg)
    if rdv.spawn > 1:
        import torch.multiprocessing as mp

        from trainer.preemption import forward_signals
        try:
            ranks = mp.start_processes(_spawned_rank, args=(cfg, rdv, target, prog), nprocs=rdv.spawn, join=False)
            forward_signals(ranks.processes)
            while not ranks.join():
                pass
        except mp.ProcessExitedException:
            return 1  # the rank printed its own one-line error
        except mp.ProcessRaisedException as e:
            print(str(e).strip(), file=sys.stderr)
            return 1
        return 0
    return run_rank(cfg, rdv, target, prog)


def _spawned_rank(index, cfg, rdv, target, prog):
    rdv = dataclasses.replace(rdv, rank=rdv.rank + index, local_rank=index, spawn=0)
    code = run_rank(cfg, rdv, target, prog)
    if code:
        sys.exit(code)


def run_rank(cfg, rdv, target=None, prog="train"):
    if target is None:
        from trainer.main import run as target
    try:
        return target(cfg, rdv)
    except USER_ERRORS as e:
        where = f"[rank {rdv.rank}] " if rdv.world_size > 1 else ""
        print(f"{prog}: error: {where}{e}", file=sys.stderr)
        return 1
