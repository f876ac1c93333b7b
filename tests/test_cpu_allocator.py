"""What each kind of CPU rank asks of glibc's allocator under --host-allocator glibc
(trainer/distributed.py; the default allocator is tests/test_host_allocator.py's), seen as
the page faults of a step-like pattern: tensors of 6-40 MiB made and touched one after
another, as forward makes activations, then all freed, as backward frees them; counted on
the fourth such step. Each case runs in a fresh process: allocator settings are
process-wide. (One tensor of one size is not a fair probe: its 64-byte-aligned request
can just miss its own freed hole when a small block lands behind it, and the heap grows.)"""
import os
import subprocess
import sys

import pytest

SIZES_MB = (6, 24, 40, 12, 6)
PROBE = f"""
import resource, sys, torch
from trainer import distributed
getattr(distributed, sys.argv[1])()
def step():
    kept = [torch.empty(mb << 20, dtype=torch.uint8).fill_(1) for mb in {SIZES_MB}]
    kept.clear()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = (sum(SIZES_MB) << 20) // 4096  # faults for fresh 4 KiB pages (fewer where huge pages back them)


def faults_of_a_later_step(policy, **env):
    out = subprocess.run([sys.executable, "-c", PROBE, policy], capture_output=True, text=True, check=True,
                         # huge pages would make fresh memory fault once per 2 MiB: counted in 4 KiB pages here
                         env={k: v for k, v in os.environ.items()
                              if not k.startswith("MALLOC_") and k != "THP_MEM_ALLOC_ENABLE"} | env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    return int(out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_unsharded_ranks_reuse_freed_memory_and_fsdp_ranks_return_it():
    assert faults_of_a_later_step("keep_freed_memory") < PAGES // 20
    # FSDP ranks hand large blocks back at once, so their peak shows what FSDP holds
    assert faults_of_a_later_step("return_large_frees_to_os") > PAGES // 50


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_users_own_malloc_settings_win():
    assert faults_of_a_later_step("keep_freed_memory", MALLOC_MMAP_THRESHOLD_="1048576") > PAGES // 50
