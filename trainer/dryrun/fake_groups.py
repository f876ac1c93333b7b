"""Process groups for the dry run: torch's `fake` backend (every collective returns at once,
any rank of any world size in one process), registered once per device type, so that a
group keeps the device types its real backends would have. A group made as "nccl" has a
CUDA side only: a CPU tensor in its collective fails as NCCL's does ("No backend type
associated with device type cpu"). FakeDevices also refuses tensors of two devices in
one collective, and a CUDA tensor of another GPU than the rank's (trainer/dryrun/device_checks.py).
"""

import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
from torch._C._distributed_c10d import FakeProcessGroup
from torch.distributed import distributed_c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.dryrun.fake_cuda import CudaMisuse

FAKE = {"nccl": "fakenccl", "gloo": "fakegloo"}  # real backend → its stand-in
DEVICES = {"nccl": "cuda", "gloo": "cpu"}


def _fake_group(common_opts, backend_opts):
    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)


def register_fake_backends():
    for real, fake in FAKE.items():
        if not hasattr(dist.Backend, fake.upper()):
            dist.Backend.register_backend(fake, _fake_group, extended_api=True, devices=[DEVICES[real]])


def fake_backend(backend):
    """ "cuda:nccl,cpu:gloo" → "cuda:fakenccl,cpu:fakegloo"; "nccl" → "cuda:fakenccl"."""
    parts = []
    for part in str(backend).split(","):
        device, _, name = part.rpartition(":")
        if name not in FAKE:
            raise CudaMisuse(f"the dry run has no stand-in for process-group backend {name!r}")
        parts.append(f"{device or DEVICES[name]}:{FAKE[name]}")
    return ",".join(parts)


class FakeGroups:
    """Patches torch.distributed for one process: the rendezvous answers at once with a fake
    store, and each group's backend is replaced by its stand-in, whether the job makes the
    group itself or torch makes it (a device mesh's dimensions, new_subgroups_by_enumeration:
    both call new_group by its name in torch's own modules). `groups` records each group the
    rank joins as (how it was made: "default", a device mesh's "mesh_<dimension>" or
    "new_group"; the backend asked for; its ranks, None for all). `cuda`: the CudaStandIn,
    whose set_device must come before an NCCL group (NCCL binds its communicator to the
    current GPU: without it every rank's would be on cuda:0)."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.groups = []

    def patch(self):
        register_fake_backends()
        real_init, real_new, real_rendezvous = dist.init_process_group, dist.new_group, dist.rendezvous
        saved = [(m, m.new_group) for m in (dist, distributed_c10d, device_mesh)]

        def rendezvous(url, rank=-1, world_size=-1, **kwargs):
            yield FakeStore(), rank, world_size

        def init_process_group(backend=None, store=None, **kwargs):
            if "nccl" in str(backend) and not self.cuda.device_set:
                raise CudaMisuse("init_process_group(nccl) before torch.cuda.set_device: NCCL would bind cuda:0")
            self.groups.append(("default", backend, None))
            return real_init(backend=fake_backend(backend), store=store or FakeStore(), **kwargs)

        def new_group(ranks=None, timeout=None, backend=None, *args, group_desc=None, **kwargs):
            if ranks is None or dist.get_rank() in ranks:
                how = group_desc if group_desc and group_desc.startswith("mesh_") else "new_group"
                self.groups.append((how, backend or "default", None if ranks is None else sorted(ranks)))
            if backend is not None:
                backend = fake_backend(backend)
            return real_new(ranks, timeout, backend, *args, group_desc=group_desc, **kwargs)

        dist.rendezvous, dist.init_process_group = rendezvous, init_process_group
        for module, _ in saved:
            module.new_group = new_group

        def restore():
            dist.rendezvous, dist.init_process_group = real_rendezvous, real_init
            for module, fn in saved:
                module.new_group = fn

        return restore
