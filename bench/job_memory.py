"""bench/bench_scale.py's measure of a job's memory, read from /proc while `train` runs:
the sum over the job's processes of their proportional set size (Pss), sampled at most
every --interval seconds and no more often than keeps the kernel's page-table walks under
a tenth of one core, the processes' RSS less the pages counted twice standing in between;
and each process's peak RSS (VmHWM). A job over the budget is stopped at once. Why Pss and
how often: bench_scale.py's docstring.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

from benchlib import BIN, ROOT

GB = 2**30  # as train's mem_gb and plan's figures


def job_processes(root):
    """The pids of `root` and all its descendants."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the command name (2nd field) may hold spaces: the parent's pid follows its ")"
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def fields_kb(path, *keys):
    """The values of `keys` ("VmRSS:", …) in a /proc file of "key: value kB" lines, in bytes."""
    found = {}
    with open(path) as f:
        for line in f:
            key = line.split(maxsplit=1)[0] if line.strip() else ""
            if key in keys:
                found[key] = int(line.split()[1]) * 1024
    if len(found) < len(keys):
        raise OSError(f"{path} lacks one of {keys}")
    return [found[k] for k in keys]


def status_memory(pid):
    """(VmRSS, VmHWM) of a process in bytes, or None when it is gone: cheap to read."""
    try:
        return fields_kb(f"/proc/{pid}/status", "VmRSS:", "VmHWM:")
    except OSError:
        return None


def pss(pid, rss):
    """A process's Pss in bytes (0 when it is gone). The kernel walks the process's page
    tables for it: costly for a large process. Without smaps_rollup (Linux < 4.14) its RSS
    stands in: an overcount, never an undercount."""
    try:
        return fields_kb(f"/proc/{pid}/smaps_rollup", "Pss:")[0]
    except FileNotFoundError:
        return rss if os.path.exists(f"/proc/{pid}") else 0
    except OSError:
        return 0


class JobMemory:
    """A running job's memory, read from /proc: each process's peak RSS at every sample,
    the sum of Pss at most every `interval` seconds and, as a Pss sample costs the kernel
    a walk of every page table, no more often than keeps that walk under a tenth of one core."""

    def __init__(self, root, interval):
        self.root, self.interval = root, interval
        self.peak = 0  # the largest sum of Pss seen, bytes
        self.hwm = {}  # pid: the largest VmHWM seen
        self.shared = 0  # sum of RSS minus sum of Pss at the last Pss sample: pages counted twice
        self.next_pss = 0.0

    def sample(self, budget):
        """Read the job once; returns its sum of Pss (bytes) when this sample read it, else
        None. Between Pss samples the sum of RSS less the pages it counted twice stands in,
        and a Pss sample is taken at once when that passes `budget` (bytes)."""
        status = {pid: m for pid in job_processes(self.root) if (m := status_memory(pid))}
        for pid, (_, hwm) in status.items():
            self.hwm[pid] = max(self.hwm.get(pid, 0), hwm)
        rss = sum(r for r, _ in status.values())
        now = time.monotonic()
        if now < self.next_pss and rss - self.shared <= budget:
            return None
        total = sum(pss(pid, r) for pid, (r, _) in status.items())
        cost = time.monotonic() - now
        self.shared = max(0, rss - total)
        self.peak = max(self.peak, total)
        self.next_pss = now + max(self.interval, 9 * cost)
        return total


def end_job(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole group has already ended


def run_job(argv, budget, interval, timeout):
    """Run `train ARGV`, sampling its processes' memory; stop it once over `budget` GB.
    Returns (stdout, peak job GB, largest process peak RSS GB, stopped, seconds)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        # a session of its own: the launcher, the rank server and the ranks share its process
        # group, so one signal to that group ends the whole job and nothing else
        proc = subprocess.Popen([str(BIN / "train")] + argv, stdout=out, stderr=err, cwd=ROOT, start_new_session=True)
        memory, stopped = JobMemory(proc.pid, interval), False
        try:
            while proc.poll() is None:
                job = memory.sample(budget * GB)
                stopped = job is not None and job > budget * GB
                if stopped or time.perf_counter() - start > timeout:
                    end_job(proc)
                    break
                time.sleep(interval)
        except BaseException:
            end_job(proc)
            raise
        finally:
            proc.wait()
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout = out.read()
        if proc.returncode and not stopped:
            tail = "\n".join(err.read().strip().splitlines()[-5:])
            sys.exit(
                f"bench_scale: train {' '.join(argv)} failed (exit code {proc.returncode}"
                f"{', timed out' if seconds > timeout else ''}):\n{tail}"
            )
    return stdout, memory.peak / GB, max(memory.hwm.values(), default=0) / GB, stopped, seconds
