"""What this host has, read without torch (the launcher and `plan` never import it):
memory, cores, and the GPUs a run here computes on."""

import os
import re
import subprocess


def _meminfo_gb(field):
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
        return kb / 2**20
    except (OSError, StopIteration):
        return None


def host_memory_gb():
    """This machine's total memory (/proc/meminfo), or None where there is none to read."""
    return _meminfo_gb("MemTotal")


def host_available_gb():
    """Memory this host can still give (/proc/meminfo's MemAvailable), or None."""
    return _meminfo_gb("MemAvailable")


def runs_on_gpu(cfg, environ=None, dev_entries=None):
    """A run of `cfg` here computes on a GPU: one is present and visible, and --cpu is not given."""
    return not cfg.common.cpu and visible_gpu_count(environ, dev_entries) > 0


def visible_gpu_count(environ=None, dev_entries=None):
    """The GPUs a process here can use, counted without torch: the driver's device nodes
    /dev/nvidia<N> (a container may expose only /dev/nvidia3; nvidiactl and nvidia-uvm are not
    GPUs), as many as CUDA_VISIBLE_DEVICES lets through. CUDA reads that list up to its
    first invalid entry ("-1" hides every GPU); an entry is an index or a GPU-/MIG- UUID."""
    env = os.environ if environ is None else environ
    if dev_entries is None:
        try:
            dev_entries = os.listdir("/dev")
        except OSError:
            dev_entries = []
    present = sum(1 for name in dev_entries if re.fullmatch(r"nvidia\d+", name))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    listed = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        listed += 1
    return min(listed, present)


def usable_cores():
    """The cores this process may run on (its affinity mask: SLURM's and taskset's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def gpu_memory_gb():
    """The first visible GPU's memory as nvidia-smi reports it, or None."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return float(out.split()[0]) / 1024  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
