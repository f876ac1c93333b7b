"""What a GPU would refuse, checked on fake devices: every op on a fake tensor passes through
FakeDevices (torch's FakeTensorMode, which also sees the ops DTensor and FSDP2 run inside
other ops), which checks it first.

- Collectives as NCCL checks them: one device per collective, a CUDA tensor of the rank's
  own GPU, a device type the group has a backend for (a CPU tensor in a collective of an
  NCCL-only group fails on a GPU: "No backend type associated with device type cpu").
- DTensor's random ops on a GPU (dropout under tensor parallelism) go through a
  higher-order op that only has a CUDA kernel: here it runs that kernel's code, CUDA's
  generator state moved through the stand-in's torch.cuda, on fake tensors.
- Host memory pinned (fake tensors have no pinned pages: pinning is recorded here), and each
  non-blocking copy to a GPU going to the rank's own GPU; one from pageable memory is
  recorded (it is silently synchronous on a GPU).
"""

import torch
import torch.distributed as dist
from torch._C import DispatchKey
from torch._prims.rng_prims import run_dtensor_rng_op
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_flatten

from trainer.dryrun.fake_cuda import CudaMisuse

aten = torch.ops.aten


def process_group(arg):
    """The process group an argument of a collective is: the group itself, the group boxed
    (c10d's ops get it as a ScriptObject), or its name (functional collectives); None for an
    argument that is no group."""
    if isinstance(arg, str):
        try:
            return dist.distributed_c10d._resolve_process_group(arg)
        except (KeyError, ValueError, RuntimeError):
            return None
    if isinstance(arg, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(arg)
        except RuntimeError:  # another boxed object (a ReduceOp)
            return None
    return arg if isinstance(arg, dist.ProcessGroup) else None


def group_devices(group):
    """The device types a process group has backends for."""
    return {t.type if isinstance(t, torch.device) else str(t) for t in group._device_types}


class FakeDevices(FakeTensorMode):
    """Fake tensors on fake GPUs, each op checked first. Records (collective, device type,
    dtypes, its group's description) in `collectives`, non-blocking copies to a GPU as (from
    pinned memory?, target) in `copies`; raises CudaMisuse where a GPU would fail.
    `rank_device` is set once the rank has one."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.rank_device = None
        self.host_reads = []
        self.collectives = []
        self.copies = []
        self.pinned_storages = set()  # pinning belongs to storage: a view of pinned memory is pinned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is aten._pin_memory.default:
            out = torch.empty_like(args[0])
            self.pin(out)
            return out
        if func is aten.is_pinned.default:
            return self.is_pinned(args[0])
        if func is aten._local_scalar_dense.default and getattr(args[0], "constant", None) is None:
            # The host reads a value the fake tensor does not have (a step counter on the host
            # keeps its value: fake mode follows small constants): every such value read is 0,
            # so losses and norms are finite and no update is skipped. On a GPU it waits.
            self.host_reads.append(str(args[0].device))
            return False if args[0].dtype == torch.bool else 0
        if func.namespace in ("c10d", "_c10d_functional"):
            self.check_collective(func, args, kwargs)
        elif func in (aten._to_copy.default, aten.copy_.default):
            self.check_copy(func, args, kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.empty.memory_format and kwargs.get("pin_memory"):
            self.pin(out)
        elif func in (aten.lift_fresh.default, aten.lift_fresh_copy.default) and _really_pinned(args[0]):
            self.pin(out)  # torch.tensor(data, pin_memory=True): a real pinned tensor made fake
        return out

    def adopt(self, batch):
        """A batch of real host tensors as fake ones, pinned where they were."""
        out = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                pinned, value = _really_pinned(value), self.from_tensor(value)
                if pinned:
                    self.pin(value)
            out[key] = value
        return out

    def pin(self, tensor):
        self.pinned_storages.add(tensor.untyped_storage()._cdata)

    def is_pinned(self, tensor):
        if not isinstance(tensor, FakeTensor):
            return _really_pinned(tensor)
        return tensor.untyped_storage()._cdata in self.pinned_storages

    def check_collective(self, func, args, kwargs):
        flat = tree_flatten((args, kwargs))[0]
        groups = list(filter(None, map(process_group, flat)))
        devices = {t.device for t in flat if isinstance(t, torch.Tensor)}
        name = func.name()
        if len(devices) > 1:
            raise CudaMisuse(f"{name} with tensors on {sorted(map(str, devices))}: one collective, one device")
        for device in devices:
            if device.type == "cuda" and self.rank_device is not None and device != self.rank_device:
                raise CudaMisuse(f"{name} of a tensor on {device} from the rank of {self.rank_device}")
            for have in map(group_devices, groups):
                if device.type not in have:
                    raise CudaMisuse(
                        f"{name} of a {device.type} tensor on a group with backends for {sorted(have)} only "
                        f"(No backend type associated with device type {device.type})"
                    )
        if devices:
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in flat if isinstance(t, torch.Tensor)})
            where = ",".join(g.group_desc for g in groups)  # "default_pg", a mesh's "mesh_tp", …
            self.collectives.append((name, next(iter(devices)).type, ",".join(dtypes), where))

    def check_copy(self, func, args, kwargs):
        source = args[1] if func is aten.copy_.default else args[0]
        target = args[0].device if func is aten.copy_.default else kwargs.get("device")
        if target is None or not isinstance(source, torch.Tensor):
            return
        target = torch.device(target)
        if target.type != "cuda" or source.device.type != "cpu":
            return
        if target.index is not None and self.rank_device is not None and target != self.rank_device:
            raise CudaMisuse(f"a copy to {target} from the rank of {self.rank_device}")
        if kwargs.get("non_blocking") or (len(args) > 2 and args[2]):
            self.copies.append((self.is_pinned(source), str(target)))


def run_random_ops_as_cuda(mode_class):
    """Make DTensor's random ops (a higher-order op, which finds its rule by the exact class
    of the dispatch mode on top) run under `mode_class` as their CUDA kernel runs them: the
    generator's offset moved to this rank's share of the random stream, the op run under
    torch.random.fork_rng, every torch.cuda call answered (and checked) by the stand-in, each
    op inside seen by the mode. FakeTensorMode's own rule would only run the op."""
    cuda_kernel = run_dtensor_rng_op.py_kernels[DispatchKey.CUDA]

    def as_cuda(mode, *args, **kwargs):
        with mode:  # the dispatcher took the mode off the stack to call this
            return cuda_kernel(*args, **kwargs)

    run_dtensor_rng_op.py_impl(mode_class)(as_cuda)


run_random_ops_as_cuda(FakeDevices)


def _really_pinned(tensor):
    """Whether a real host tensor is in (fake CUDA's) pinned memory."""
    if isinstance(tensor, FakeTensor) or tensor.device.type != "cpu":
        return False
    with unset_fake_temporarily():
        return tensor.is_pinned()
