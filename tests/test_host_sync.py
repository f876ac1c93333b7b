"""An update the device never waits on: `train` reads no number on the host between an
update's first forward and its optimizer step, and outside that window only what is
designed to be read late.

Every way torch has of bringing a tensor's value to the host (item, tolist, float, int,
bool, numpy) is counted while real `train` runs (trainer.train.main.run, the loop with its
meters, logging and preemption check), with the update and the phase of it each read falls
in, and the function in trainer/ that made it. On a GPU each such read stops the host
until the device has caught up; on a CPU they are the same calls, so they are counted here.
What may be read, and how often:
- per --log-interval: the meters, in one read (every logged value at once);
- per update, after its optimizer step is queued: the previous update's flags (the host
  copy queued one update earlier, HostCopy.read) and, with several ranks, the preemption
  flags posted one update earlier (AsyncHostSum.result, host memory over gloo);
- nothing else, and nothing at all between the first forward and the optimizer step.
"""

import json
import sys
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers import DUMMY, compose, run_ranks

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy")
LATE = {"HostCopy.read", "AsyncHostSum.result"}  # read one update after they were queued
LOG = {"TrainMeters.values"}  # one read per record
UPDATES, INTERVAL = 12, 4


def _site():
    """The innermost function of trainer/ on the stack (`Class.method`), or what called torch."""
    for frame, _ in traceback.walk_stack(sys._getframe(2)):
        if "/trainer/" in frame.f_code.co_filename:
            return frame.f_code.co_qualname
    return "elsewhere"


def _counting_rank(index, argv, world, port, out):
    from trainer.train import main
    from trainer.train.trainer import Trainer

    where = {"update": 0, "phase": "start"}
    reads = []

    def counted(name, original):
        def read(self, *args, **kwargs):
            if where["update"] > 0:
                reads.append([where["update"], where["phase"], name, _site()])
            return original(self, *args, **kwargs)

        return read

    train_step, step = Trainer.train_step, Trainer.step

    def phased_train_step(self, samples):
        where["update"] += 1
        where["phase"] = "forward to step"
        try:
            return train_step(self, samples)
        finally:
            where["phase"] = "loop"

    def phased_step(self, bad):
        where["phase"] = "step"
        step(self, bad)
        where["phase"] = "after step"

    originals = {name: getattr(torch.Tensor, name) for name in READS}
    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    Trainer.train_step, Trainer.step = phased_train_step, phased_step
    try:
        from trainer.rendezvous import Rendezvous as R

        rdv = R(
            f"tcp://127.0.0.1:{port}" if world > 1 else "", world, rank=index, local_rank=index, local_world_size=world
        )
        main.run(compose(argv), rdv)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        Trainer.train_step, Trainer.step = train_step, step
    Path(f"{out}.{index}").write_text(json.dumps(reads))


def host_reads(argv, world, tmp_path):
    """Rank 0's reads while `train ARGV` runs on `world` ranks: [update, phase, how, site]."""
    from trainer.rendezvous import free_port

    out = tmp_path / "reads"
    run_ranks(_counting_rank, (argv, world, free_port(), str(out)), world)
    return json.loads(Path(f"{out}.0").read_text())


ARGV = DUMMY + [
    "--batch-size",
    "2",
    "--max-update",
    str(UPDATES),
    "--log-interval",
    str(INTERVAL),
    "--log-format",
    "json",
    "--disable-validation",
    "--clip-norm",
    "0.5",
]


# --store-ema on two of them: the average's update after each step reads nothing either
# (its weight comes from the host's update count). Not counted here: a 0-d tensor passed as
# a foreach op's scalar, which torch reads in C++ (train --dry-run counts those).
EMA = ["--store-ema", "--ema-update-freq", "2", "--ema-start-update", "3"]


@pytest.mark.parametrize(
    "extra,world",
    [([], 1), (["--bf16"] + EMA, 1), (["--ddp-backend", "fully_sharded", "--distributed-world-size", "2"] + EMA, 2)],
    ids=["fp32_1_rank", "bf16_1_rank_ema", "fsdp_2_ranks_ema"],
)
def test_an_update_reads_nothing_on_the_host_before_its_step(extra, world, tmp_path):
    reads = host_reads(ARGV + extra, world, tmp_path)
    # Nothing between an update's first forward and its optimizer step, nor in the step.
    assert [r for r in reads if r[1] in ("forward to step", "step")] == []
    # Late reads: at most one of each per update, after the step (the last update's flags,
    # the preemption flags posted one update earlier).
    late = Counter((r[0], r[3]) for r in reads if r[3] in LATE and r[1] == "after step")
    assert set(late.values()) == {1}, late
    assert {site for _, site in late} == {"HostCopy.read"}
    # In the loop: the update's own flags where its count must be exact (a record, which
    # every INTERVAL updates is), and the preemption flags posted after the update before.
    records = Counter(range(INTERVAL, UPDATES + 1, INTERVAL))
    assert Counter(r[0] for r in reads if r[3] == "HostCopy.read" and r[1] == "loop") == records
    agreements = Counter(r[0] for r in reads if r[3] == "AsyncHostSum.result")
    assert agreements == (Counter(range(2, UPDATES + 1)) if world > 1 else Counter())
    # The rest: the meters, once per record (every INTERVAL updates, and the epoch's
    # record where the run stops), and nothing else.
    logged = [r for r in reads if r[3] not in LATE]
    assert {r[3] for r in logged} <= LOG, logged
    assert Counter(r[0] for r in logged) == records + Counter([UPDATES])
