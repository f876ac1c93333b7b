"""Fake CUDA devices on a torch built without CUDA, for the dry run.

Two halves, because torch reaches CUDA from both languages:
- C++ (fake_cuda.cpp, compiled on first use against the installed torch, as the host
  allocator is): a device guard, so `.to("cuda:k")`, `torch.device` contexts and FSDP2's
  device switches work; and CUDA's hooks, so CUDA generators and pinned host memory exist.
  It must be loaded before torch is imported (torch caches the hooks it finds first).
- Python (CudaStandIn): `torch.cuda`'s functions answered by a stand-in that records every
  call and checks its arguments as the driver would: a device index that exists, set before
  the NCCL group is made, a stream or event used on its own device, a non-blocking copy
  from pinned memory to this rank's own GPU.

Tensors on these devices are fake (FakeTensorMode): shapes, dtypes and devices, no data.
"""

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from data.embedded_corpus import default_cache_dir  # torch-free

SOURCE = Path(__file__).with_suffix(".cpp")
DEVICES_ENV = "SHARDLM_FAKE_CUDA_DEVICES"  # GPUs per node the C++ guard reports
GIB = 1 << 30
_library = None


class FakeCudaUnavailable(Exception):
    """The fake devices cannot be built here; the message says why."""


class CudaMisuse(AssertionError):
    """A CUDA call that a real GPU would refuse (or silently get wrong): the message says which."""


def _torch_dir():
    spec = importlib.util.find_spec("torch")  # not imported: the library must load first
    return Path(spec.submodule_search_locations[0])


def _library_path(torch_dir):
    key = hashlib.sha256(SOURCE.read_bytes() + str(torch_dir).encode()).hexdigest()
    return default_cache_dir() / "fake_cuda" / f"fake_cuda-{key[:16]}.so"


def build_library():
    torch_dir = _torch_dir()
    path = _library_path(torch_dir)
    if path.exists():
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise FakeCudaUnavailable("no C++ compiler (g++) found: the dry run compiles its fake CUDA devices")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    lib = torch_dir / "lib"
    cmd = [compiler, "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{torch_dir / 'include'}", str(SOURCE)]
    cmd += [f"-L{lib}", "-Wl,--no-as-needed", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise FakeCudaUnavailable(f"compiling {SOURCE.name} failed: {last}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_fake_cuda(gpus_per_node):
    """Compile and load the C++ half; call before `import torch`."""
    if "torch" in sys.modules:
        raise FakeCudaUnavailable("torch was imported before the fake CUDA devices were loaded")
    global _library
    os.environ[DEVICES_ENV] = str(gpus_per_node)
    _library = ctypes.CDLL(str(build_library()), mode=ctypes.RTLD_GLOBAL)


@dataclass(eq=False)  # streams are compared and hashed by identity, as torch's are
class FakeStream:
    device: object
    cuda: "CudaStandIn"
    priority: int = 0
    events: list = field(default_factory=list)

    def _check(self, what, other_device):
        if other_device != self.device:
            raise CudaMisuse(f"{what} on a stream of {self.device} with something of {other_device}")

    def wait_stream(self, other):
        self.cuda.record("Stream.wait_stream", self.device, other.device)

    def wait_event(self, event):
        self.cuda.record("Stream.wait_event", self.device, event.device)

    def record_event(self, event=None):
        event = event or FakeEvent(self.cuda)
        event.record(self)
        return event

    def synchronize(self):
        self.cuda.record("Stream.synchronize", self.device)

    def query(self):
        return True

    def __enter__(self):
        self.cuda.stream(self).__enter__()

    def __exit__(self, *exc):
        self.cuda.stream_stack.pop()

    @property
    def cuda_stream(self):
        return id(self)


class FakeEvent:
    def __init__(self, cuda, enable_timing=False, blocking=False, interprocess=False):
        self.cuda, self.device = cuda, None

    def record(self, stream=None):
        stream = stream or self.cuda.current_stream()
        # CUDA binds an event to the device of the stream that first records it.
        if self.device is not None and self.device != stream.device:
            raise CudaMisuse(f"an event of {self.device} recorded on a stream of {stream.device}")
        if stream.device != self.cuda.current():
            raise CudaMisuse(
                f"an event recorded on a stream of {stream.device} while the current device is {self.cuda.current()}"
            )
        self.device = stream.device
        self.cuda.record("Event.record", stream.device)

    def wait(self, stream=None):
        stream = stream or self.cuda.current_stream()
        self.cuda.record("Event.wait", stream.device, self.device)

    def synchronize(self):
        self.cuda.record("Event.synchronize", self.device)

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class CudaStandIn:
    """Answers `torch.cuda`'s Python API for `gpus_per_node` fake GPUs and records each call
    as (name, *arguments) in `calls`."""

    def __init__(self, gpus_per_node, device_memory_gb=80.0):
        self.gpus = gpus_per_node
        self.memory = int(device_memory_gb * GIB)
        self.calls = []
        self.index = 0
        self.device_set = False
        self.streams = {}
        self.stream_stack = []
        self.saved = {}

    def record(self, name, *args):
        self.calls.append((name, *args))

    def called(self, name):
        return [c for c in self.calls if c[0] == name]

    # devices
    def _index(self, device):
        import torch

        if device is None:
            return self.index
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            if device.type != "cuda":
                raise CudaMisuse(f"torch.cuda was given a {device.type} device")
            index = self.index if device.index is None else device.index
        if not 0 <= index < self.gpus:
            raise CudaMisuse(f"CUDA error: invalid device ordinal {index} (this node has {self.gpus} GPUs)")
        return index

    def current(self):
        import torch

        return torch.device("cuda", self.index)

    def set_device(self, device):
        self.index = self._index(device)
        self.device_set = True
        if _library is not None:  # the C++ guard's current device follows
            _library.fake_cuda_set_device(self.index)
        self.record("set_device", self.index)

    def current_device(self):
        return self.index

    def device_count(self):
        return self.gpus

    def current_stream(self, device=None):
        import torch

        if self.stream_stack and device is None:
            return self.stream_stack[-1]
        index = self._index(device)
        key = ("default", index)
        if key not in self.streams:
            self.streams[key] = FakeStream(torch.device("cuda", index), self)
        return self.streams[key]

    default_stream = current_stream

    def new_stream(self, device=None, priority=0):
        import torch

        index = self._index(device)
        self.record("Stream", index)
        return FakeStream(torch.device("cuda", index), self, priority)

    @contextlib.contextmanager
    def stream(self, stream):
        if stream is None:
            yield
            return
        if stream.device != self.current():
            raise CudaMisuse(f"torch.cuda.stream() of {stream.device} while the current device is {self.current()}")
        self.stream_stack.append(stream)
        try:
            yield
        finally:
            self.stream_stack.pop()

    # memory (figures come from the memory tracker, not from here)
    def memory_stat(self, name, device=None):
        self._index(device)
        self.record(name, device)
        return 0

    def mem_get_info(self, device=None):
        self._index(device)
        return self.memory, self.memory

    def properties(self, device=None):
        self._index(device)
        return SimpleNamespace(name="fake GPU", total_memory=self.memory, major=9, minor=0, multi_processor_count=132)

    # random states (16 bytes per device, as CUDA's Philox generator keeps)
    def get_rng_state(self, device="cuda"):
        import torch

        index = self._index(device)
        self.record("get_rng_state", index)
        return self.saved.get(index, torch.zeros(16, dtype=torch.uint8)).clone()

    def set_rng_state(self, state, device="cuda"):
        index = self._index(device)
        self.record("set_rng_state", index)
        self.saved[index] = state.clone()

    def get_rng_state_all(self):
        return [self.get_rng_state(i) for i in range(self.gpus)]

    def set_rng_state_all(self, states):
        for i, s in enumerate(states):
            self.set_rng_state(s, i)

    def patch(self):
        """Install the stand-in on torch.cuda; returns a function that restores it."""
        import torch

        cuda = torch.cuda
        this = self

        class Stream(FakeStream):
            def __new__(cls, device=None, priority=0, **kwargs):
                return this.new_stream(device, priority)

        class Event(FakeEvent):
            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                super().__init__(this, enable_timing, blocking, interprocess)

        def noop(name):
            # one function per name: torch.compile's trace rules refuse one object under two names
            return lambda *args, **kwargs: self.record(name)

        replacements = dict(
            is_available=lambda: True,
            is_initialized=lambda: True,
            _lazy_init=noop("_lazy_init"),
            init=noop("init"),
            device_count=self.device_count,
            set_device=self.set_device,
            current_device=self.current_device,
            current_stream=self.current_stream,
            default_stream=self.default_stream,
            stream=self.stream,
            Stream=Stream,
            Event=Event,
            synchronize=lambda device=None: self.record("synchronize", self._index(device)),
            empty_cache=noop("empty_cache"),
            max_memory_allocated=lambda device=None: self.memory_stat("max_memory_allocated", device),
            max_memory_reserved=lambda device=None: self.memory_stat("max_memory_reserved", device),
            memory_allocated=lambda device=None: self.memory_stat("memory_allocated", device),
            memory_reserved=lambda device=None: self.memory_stat("memory_reserved", device),
            reset_peak_memory_stats=lambda device=None: self.memory_stat("reset_peak_memory_stats", device),
            mem_get_info=self.mem_get_info,
            get_device_properties=self.properties,
            get_device_name=lambda device=None: self.properties(device).name,
            get_device_capability=lambda device=None: (9, 0),
            is_bf16_supported=lambda including_emulation=True: True,
            get_rng_state=self.get_rng_state,
            set_rng_state=self.set_rng_state,
            get_rng_state_all=self.get_rng_state_all,
            set_rng_state_all=self.set_rng_state_all,
            manual_seed=noop("manual_seed"),
            manual_seed_all=noop("manual_seed_all"),
            _is_in_bad_fork=lambda: False,
        )
        old = {name: getattr(cuda, name, None) for name in replacements}
        for name, value in replacements.items():
            setattr(cuda, name, value)

        def restore():
            for name, value in old.items():
                setattr(cuda, name, value)

        return restore
