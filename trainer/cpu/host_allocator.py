"""Host memory for tensors: `--host-allocator caching` (the default) keeps freed pages and
hands them to later tensors of any size (trainer/cpu/host_allocator.cpp), as CUDA's caching
allocator does on a GPU.

Why: a training step allocates and frees the same tensors every update. With glibc, a
rank either returns large freed blocks to the OS, and faults their pages in again, zeroed
by the kernel, every time (FSDP's gathered layers, every update), or keeps them in its
heap, where blocks of other sizes cannot reuse them and the heap grows past the most ever
live at once. This allocator keeps them and moves their pages, without copying, into
whatever size is asked next, so it does neither: after the first update nothing faults,
and the mapped bytes never exceed the most ever live at once (figures, FSDP and DDP under
both allocators: docs/benchmarks.md).

The C++ source is compiled on first use with the system's C++ compiler against the
installed torch (under ~/.cache/shardlm) and reused after. Where it cannot be (no
compiler, not Linux), `install` says why and the rank keeps glibc's malloc
(trainer/cpu/rank.py warns once).
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from data.embedded_corpus import default_cache_dir

SOURCE = Path(__file__).with_suffix(".cpp")
TORCH_DIR = Path(torch.__file__).parent  # its headers and libc10 are what the library builds against
MIN_BYTES = 1 << 20  # smaller blocks stay with glibc: its bins already reuse them
STATS = (
    "served_exact",
    "served_split",
    "served_moved",
    "fresh_bytes",
    "moved_bytes",
    "mapped_bytes",
    "kept_bytes",
    "live_bytes",
    "peak_live_bytes",
    "released_bytes",
)

_lib = None


class Unavailable(Exception):
    """The allocator cannot be built or loaded here; the message says why."""


def _library_path():
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + str(TORCH_DIR).encode()).hexdigest()
    return default_cache_dir() / "host_allocator" / f"host_allocator-{key[:16]}.so"


def build():
    """The compiled library's path, compiling it first if this source and torch have none."""
    if not sys.platform.startswith("linux"):
        raise Unavailable("it needs Linux (mremap)")
    path = _library_path()
    if path.exists():
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise Unavailable("no C++ compiler (g++) found; install one or pass --host-allocator glibc")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # Ranks may build at once: each writes its own file, then renames it into place.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    except OSError as e:
        raise Unavailable(
            f"cannot write to {path.parent} ({e.strerror}); set SHARDLM_CACHE to a writable directory"
        ) from None
    os.close(fd)
    cmd = [
        compiler,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{TORCH_DIR / 'include'}",
        str(SOURCE),
        f"-L{TORCH_DIR / 'lib'}",
        "-lc10",
        f"-Wl,-rpath,{TORCH_DIR / 'lib'}",
        "-o",
        tmp,
    ]
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise Unavailable(f"cannot run the C++ compiler {compiler} ({e.strerror})") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise Unavailable(f"compiling {SOURCE.name} failed: {last}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def install(min_bytes=MIN_BYTES):
    """Make it torch's CPU allocator in this process; tensors made before keep theirs."""
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL(str(build()))
        except OSError as e:
            raise Unavailable(f"loading it failed: {e}") from None
        lib.shardlm_host_allocator_install.argtypes = [ctypes.c_size_t]
        lib.shardlm_host_allocator_stats.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
        _lib = lib
    if not _lib.shardlm_host_allocator_install(min_bytes):
        raise Unavailable("torch kept another CPU allocator of higher priority")


def installed():
    return _lib is not None


def stats():
    """The allocator's counters (STATS), all zero before `install`."""
    out = (ctypes.c_size_t * len(STATS))()
    if _lib is not None:
        _lib.shardlm_host_allocator_stats(out)
    return dict(zip(STATS, out))


def release_cached():
    """Return every kept page to the OS (the next allocations fault them in again)."""
    if _lib is not None:
        _lib.shardlm_host_allocator_release_cached()
