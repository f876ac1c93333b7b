"""What this host has, read without torch (the launcher and `plan` never import it):
memory, and whether a run here computes on a GPU."""

import os
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


def runs_on_gpu(cfg):
    """A run of `cfg` here computes on a GPU: one is present (its device node), visible
    (CUDA_VISIBLE_DEVICES does not hide them all) and --cpu is not given."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = visible is not None and visible.strip() in ("", "-1")
    return not cfg.common.cpu and not hidden and os.path.exists("/dev/nvidia0")


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
