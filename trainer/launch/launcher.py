"""Start the job's ranks: in this process, or spawned locally (fairseq's call_main).

A rank that fails ends the whole job: the launcher gives the other ranks a moment to
notice (a collective with a dead peer fails at once) and then kills them, so nobody
waits in a collective for the timeout. The job says once why it ended: a rank's own
one-line error, or, for a rank killed by a signal, which rank and by what.
"""

import dataclasses
import os
import pickle
import signal
import sys
import tempfile
import time

from trainer.errors import (
    INTERRUPTED,
    USER_ERRORS,
    RankStopped,
    end_child_processes,
    interrupted_line,
    resume_hint,
    show_traceback,
)
from trainer.launch.local_ranks import (
    JobSignals,
    kill_with_children,
    start_local_ranks,
    start_rank_server,
    stop_rank_server,
    stop_resource_tracker,
    traceback_file,
)
from trainer.rendezvous import check_gloo_address, infer_rendezvous

STOPPED = 3  # exit code of a spawned rank that stopped because of another rank
GRACE_S = 5.0  # how long the other ranks get to end on their own once one has failed


def launch(cfg, target=None, prog="train"):
    """Run `target(cfg, rdv)` (default: training) on every rank of the job."""
    try:
        rdv = infer_rendezvous(cfg)  # SLURM's variables and scontrol can be wrong too
        check_gloo_address(rdv)
    except USER_ERRORS as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    if rdv.spawn > 1:
        signals = JobSignals()  # before any helper process exists, so none is left behind
        try:
            # Each rank leaves its one-line error here; the launcher prints it once for the job
            # (every rank usually meets the same bad input, e.g. a bad --restore-file).
            with tempfile.TemporaryDirectory(prefix="shardlm-rank-errors-") as errors_dir:
                try:
                    start_rank_server()
                    start_local_ranks(
                        _spawned_rank, (cfg, rdv, target, prog, errors_dir), rdv.spawn, errors_dir, signals.ranks
                    )
                    signals.starting = False
                    return join_ranks(
                        signals.ranks,
                        rdv.rank,
                        prog,
                        resume_hint(cfg, prog),
                        errors_dir,
                        lambda: interrupted_line(prog, None, cfg) if signals.interrupts else None,
                        signals,
                    )
                except KeyboardInterrupt as e:  # Ctrl-C while starting, or a second one (JobSignals)
                    signals.kill_ranks()  # before their errors directory goes
                    print(interrupted_line(prog, e, cfg), file=sys.stderr)
                    return INTERRUPTED
        finally:
            stop_rank_server()
            stop_resource_tracker()
            signals.restore()
    return run_rank(cfg, rdv, target, prog)


def _ignore_ctrl_c():
    """The command is ending because of a Ctrl-C: another one changes nothing, and must not
    interrupt the interpreter's exit with a KeyboardInterrupt of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _spawned_rank(index, cfg, rdv, target, prog, errors_dir):
    rdv = dataclasses.replace(rdv, rank=rdv.rank + index, local_rank=index, spawn=0)
    if target is None:
        from trainer.train.main import run as target  # the rank imports torch; the launcher never does
    try:
        code = target(cfg, rdv)
    except RankStopped:
        # The launcher reports the rank that caused it. This rank's cleanup (finally blocks,
        # the process group's teardown) has run; finalizing the interpreter would also
        # destroy collectives still pending on the dead peer, which can abort in C++
        # ("terminate called without an active exception", seen in CI): leave without it.
        _exit_at_once(STOPPED)
    except USER_ERRORS as e:
        show_traceback()
        with open(os.path.join(errors_dir, str(rdv.rank)), "w", encoding="utf-8") as f:
            f.write(str(e))
        code = 1
    if code:
        sys.exit(code)


def _exit_at_once(code):
    import logging

    end_child_processes()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def join_ranks(procs, first_rank, prog, hint, errors_dir, interrupted=lambda: None, signals=None):
    """Wait for the spawned ranks; once one fails, end the others and say why in one line.
    A rank that stopped cleanly on Ctrl-C (exit status 130, checkpoint saved) has not
    failed. `interrupted()`: once the launcher has had a Ctrl-C, the line that says so,
    which is the job's reason whatever the ranks did then; None before. `signals`: the
    launcher's JobSignals, whose wakeup descriptor wait() watches too."""
    from multiprocessing.connection import wait

    waiting = {p.sentinel: i for i, p in enumerate(procs)}
    ended = []  # ranks in the order their ends were seen: the first to fail is the cause
    failed = None
    while waiting and failed is None:
        for sentinel in wait(list(waiting) + ([signals.wakeup] if signals else [])):
            if signals and sentinel == signals.wakeup:
                signals.drain()  # a signal: its handler has run (it forwarded it, or raised)
                continue
            i = waiting.pop(sentinel)
            procs[i].join()
            ended.append(i)
        failed = next((i for i in ended if procs[i].exitcode not in (0, INTERRUPTED)), None)
    if signals and interrupted() is not None:
        signals.ending()  # the job ends because of a Ctrl-C, said once: another one changes nothing
    if failed is None:
        return INTERRUPTED if interrupted() is not None or INTERRUPTED in (p.exitcode for p in procs) else 0
    # Interrupted, a rank that failed means no save can complete (saving takes every rank):
    # nothing to wait for.
    deadline = time.monotonic() + (0 if interrupted() is not None else GRACE_S)
    for i, p in enumerate(procs):
        p.join(max(deadline - time.monotonic(), 0))
        if not p.is_alive() and i not in ended:
            ended.append(i)
    ended_by_us = {i for i, p in enumerate(procs) if p.is_alive()}
    kill_with_children(procs)
    if line := interrupted():
        # Ranks ending while the job is interrupted (a Ctrl-C while starting, or ranks that
        # lost a peer to it) all end because of it: that is the one line.
        print(line, file=sys.stderr)
        return INTERRUPTED
    # A survivor may die of a signal too once its peer is gone (gloo can abort it), but
    # later: the rank named is the one whose death was seen first.
    killed = [i for i in ended if procs[i].exitcode < 0]
    if killed:
        i = killed[0]
        print(killed_line(prog, first_rank + i, procs[i].pid, -procs[i].exitcode, hint), file=sys.stderr)
    elif os.access(traceback_file(errors_dir, failed), os.R_OK):  # an unexpected exception: its traceback
        with open(traceback_file(errors_dir, failed), "rb") as f:
            print(f"{prog}: rank {first_rank + failed} failed:\n{pickle.load(f).strip()}", file=sys.stderr)
    elif messages := _rank_errors(errors_dir):
        if len(messages) > 1 and len(set(messages.values())) == 1:  # the same on every rank: say it once
            print(f"{prog}: error: {next(iter(messages.values()))}", file=sys.stderr)
        else:
            rank = min(messages)
            print(f"{prog}: error: [rank {rank}] {messages[rank]}", file=sys.stderr)
    elif all(procs[i].exitcode == STOPPED for i in range(len(procs)) if i not in ended_by_us):
        print(f"{prog}: error: the ranks lost each other; {hint}", file=sys.stderr)
    return 1


def killed_line(prog, rank, pid, signum, hint):
    """The job's one line for a rank killed by a signal. SIGABRT is how NCCL's watchdog ends a
    rank whose collective failed or timed out when TORCH_NCCL_ASYNC_ERROR_HANDLING asks it to
    (or its heartbeat monitor, when the rank is stuck): the rank named may be the survivor."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    why = (
        " (an abort from C++: NCCL's watchdog aborts a rank whose collective failed or timed out, "
        "when another rank died or hangs; the rank's log says which)"
        if signum == signal.SIGABRT
        else ""
    )
    return f"{prog}: error: rank {rank} (pid {pid}) was killed by {name}{why}; {hint}"


def _rank_errors(errors_dir):
    """rank -> its one-line error, for the spawned ranks that wrote one."""
    messages = {}
    for name in filter(str.isdigit, os.listdir(errors_dir)):  # not the tracebacks
        with open(os.path.join(errors_dir, name), encoding="utf-8") as f:
            messages[int(name)] = f.read()
    return messages


def _import_training():
    """The rank imports torch; the launcher never does. A Ctrl-C waits for the import to
    finish: KeyboardInterrupt raised inside the initialization of torch or of a C extension
    can escape through C++ and abort the process ("terminate called ... KeyboardInterrupt")
    or turn into another error. (Blocking SIGINT would not do: numpy's threads, started
    before, would still take it for the main thread.)"""
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        from trainer.train.main import run  # torch: the launcher of spawned ranks never imports it
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt
    return run


def run_rank(cfg, rdv, target=None, prog="train"):
    try:
        if target is None:
            target = _import_training()
        code = target(cfg, rdv)
        if code == INTERRUPTED:
            _ignore_ctrl_c()
        return code
    except USER_ERRORS as e:
        show_traceback()
        where = f"[rank {rdv.rank}] " if rdv.world_size > 1 else ""
        print(f"{prog}: error: {where}{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C before training took over SIGINT, or a second one
        _ignore_ctrl_c()
        print(interrupted_line(prog, e, cfg), file=sys.stderr)
        return INTERRUPTED
