"""`--host-allocator caching` (trainer/cpu/host_allocator.cpp), built with this machine's
compiler and installed in fresh processes: the allocator is process-wide, and each case
must see it from its first tensor."""

import json
import os
import subprocess
import sys

import pytest

from helpers import DUMMY, multi_rank_losses, run_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mremap: Linux only")

PRELUDE = """
import json, os, resource, sys, torch
from trainer.cpu import host_allocator
host_allocator.install()
MB = 1 << 20
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def hwm_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024
"""


def run_probe(body):
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, cwd=ROOT, timeout=300
    )  # a deadlocked probe fails its test instead of hanging the suite
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_step_of_other_sizes_reuses_the_freed_pages_without_faulting():
    # Each step makes tensors of sizes the previous steps never made, in another order;
    # their total never exceeds the first step's. Every later request is served from
    # kept pages: whole, split, or moved together.
    r = run_probe("""
steps = [(6, 24, 40, 12, 6), (7, 33, 5, 41, 2), (88,), (3, 3, 3, 60, 19)]
counts = []
for sizes in steps:
    before = faults()
    kept = [torch.empty(mb * MB, dtype=torch.uint8).fill_(1) for mb in sizes]
    counts.append(faults() - before)
    kept.clear()
print(json.dumps({"faults": counts, **host_allocator.stats()}))
""")
    pages_first = (6 + 24 + 40 + 12 + 6) * 256
    assert r["faults"][0] > pages_first // 2  # fresh memory does fault: the probe can see it
    assert all(f < pages_first // 50 for f in r["faults"][1:]), r["faults"]
    assert r["served_split"] > 0 and r["served_moved"] > 0
    assert r["mapped_bytes"] == r["peak_live_bytes"] == 88 * (1 << 20)


def test_mapped_memory_never_exceeds_the_most_ever_live():
    # Live bytes rise and fall in a pattern of many sizes; what the process maps (and so
    # its resident peak) follows the most ever live at once, not the sum of what was made.
    r = run_probe("""
g = torch.Generator().manual_seed(0)
live, made = [], 0
base = hwm_mb()
for i in range(300):
    if live and (len(live) > 12 or torch.rand(1, generator=g).item() < 0.4):
        live.pop(int(torch.randint(len(live), (1,), generator=g)))
    else:
        mb = int(torch.randint(1, 24, (1,), generator=g))
        live.append(torch.empty(mb * MB, dtype=torch.uint8).fill_(1))
        made += mb * MB
    s = host_allocator.stats()
    assert s["mapped_bytes"] == s["live_bytes"] + s["kept_bytes"]
    assert s["mapped_bytes"] <= s["peak_live_bytes"], s
print(json.dumps({"made": made, "hwm_growth_mb": hwm_mb() - base, **host_allocator.stats()}))
""")
    assert r["made"] > 5 * r["peak_live_bytes"]  # most requests were served by reused pages
    assert r["fresh_bytes"] == r["peak_live_bytes"]
    assert r["hwm_growth_mb"] < r["peak_live_bytes"] / (1 << 20) + 20


def test_moved_and_split_pages_hold_exactly_what_is_written_and_release_returns_them():
    r = run_probe("""
a = [torch.full((mb * MB // 4,), float(mb)) for mb in (4, 8, 12, 16)]
keep = torch.full((5 * MB // 4,), 5.0)
del a[1], a[2]                            # frees the 8 and 16 MiB blocks (a is now [4, 12])
big = torch.full((20 * MB // 4,), 7.0)    # larger than either: both moved into one range
small = torch.full((3 * MB // 4,), 3.0)   # the head of a kept block
ok = bool((keep == 5).all() and (big == 7).all() and (small == 3).all()
          and (a[0] == 4).all() and (a[1] == 12).all())
del big, small
rss_before = hwm_mb()
host_allocator.release_cached()
with open("/proc/self/status") as f:
    rss_after = next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
print(json.dumps({"ok": ok, "rss_drop_mb": rss_before - rss_after, **host_allocator.stats()}))
""")
    assert r["ok"]
    assert r["served_moved"] >= 1 and r["moved_bytes"] >= 20 << 20
    assert r["kept_bytes"] == 0 and r["released_bytes"] >= 20 << 20
    assert r["rss_drop_mb"] > 15


def test_a_forked_child_allocates_while_another_thread_of_its_parent_frees():
    # DataLoader workers are forked from ranks whose gloo threads free tensors: the child
    # must not inherit the allocator's lock held.
    r = run_probe("""
import threading, time
# Only the allocator's lock may be raced here. Two of torch's own fork hazards hung this probe
# under load, forever, in the child: OpenMP's thread team (a fork while the churn thread ran a
# parallel fill_: the child's fill_ waited at the team's barrier), and the ops' dispatcher
# handles, C++ function statics (a fork during their one-time initialisation). So: no OpenMP team,
# and both ops initialised before the churn starts.
torch.set_num_threads(1)
torch.empty(2 * MB, dtype=torch.uint8).fill_(1)
stop = False
def churn():  # nothing but the allocator's alloc and free: its lock is held most often
    while not stop:
        torch.empty(2 * MB, dtype=torch.uint8)
t = threading.Thread(target=churn); t.start()
codes = []
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        x = torch.empty(3 * MB, dtype=torch.uint8).fill_(2); del x
        os._exit(0)
    deadline = time.monotonic() + 30  # a child stuck on an inherited lock fails the test, not hangs it
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            codes.append(os.waitstatus_to_exitcode(status)); break
        if time.monotonic() > deadline:
            os.kill(pid, 9); os.waitpid(pid, 0); codes.append("hung"); break
        time.sleep(0.01)
stop = True; t.join()
print(json.dumps({"codes": codes}))
""")
    assert r["codes"] == [0] * 20


def test_fsdp_trains_the_same_with_either_host_allocator(tmp_path):
    # Layers of 4 MiB weights and 2 MiB activations: the gathers, gradients and
    # activations all come from the caching allocator, moved and split pages included.
    argv = DUMMY + [
        "--decoder-embed-dim",
        "512",
        "--decoder-ffn-embed-dim",
        "2048",
        "--tokens-per-sample",
        "256",
        "--batch-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--clip-norm",
        "0.5",
    ]
    caching = multi_rank_losses(argv + ["--host-allocator", "caching"], 2, 4, tmp_path)
    glibc = multi_rank_losses(argv + ["--host-allocator", "glibc"], 2, 4, tmp_path)
    assert caching == glibc


@pytest.mark.parametrize(
    "env, why",
    [
        ({"CXX": "/no/such/g++"}, "cannot run the C++ compiler /no/such/g++"),
        ({"SHARDLM_CACHE": "/proc/shardlm"}, "cannot write to /proc/shardlm"),
    ],
)
def test_without_a_compiler_or_a_writable_cache_training_says_so_and_uses_glibc(env, why, tmp_path):
    env = {"SHARDLM_CACHE": str(tmp_path / "cache"), **env}  # nothing built there yet
    records, done = run_train(
        DUMMY + ["--batch-size", "4", "--max-update", "2", "--log-format", "json", "--log-interval", "1"], env=env
    )
    warning = [line for line in (done.stdout + done.stderr).splitlines() if "--host-allocator caching" in line]
    assert len(warning) == 1 and why in warning[0] and warning[0].endswith("using glibc's"), warning
    assert len(records["train_inner"]) == 2
