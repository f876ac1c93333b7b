"""Process groups for the dry run: torch's `fake` backend (every collective returns at once,
any rank of any world size in one process), registered once per device type, so that a
group keeps the device types its real backends would have. A group made as "nccl" has a
CUDA side only: a CPU tensor in its collective fails as NCCL's does ("No backend type
associated with device type cpu"). FakeDevices also refuses tensors of two devices in
one collective, and a CUDA tensor of another GPU than the rank's (trainer/dryrun/device_checks.py).
"""

import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
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
    store, and each group's backend is replaced by its stand-in. `groups` records
    (how the group was made, the backend asked for). `cuda`: the CudaStandIn, whose
    set_device must come before an NCCL group (NCCL binds its communicator to the current
    GPU: without it every rank's would be on cuda:0)."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.groups = []

    def patch(self):
        register_fake_backends()
        real_init, real_new, real_rendezvous = dist.init_process_group, dist.new_group, dist.rendezvous

        def rendezvous(url, rank=-1, world_size=-1, **kwargs):
            yield FakeStore(), rank, world_size

        def init_process_group(backend=None, store=None, **kwargs):
            if "nccl" in str(backend) and not self.cuda.device_set:
                raise CudaMisuse("init_process_group(nccl) before torch.cuda.set_device: NCCL would bind cuda:0")
            self.groups.append(("default", backend))
            return real_init(backend=fake_backend(backend), store=store or FakeStore(), **kwargs)

        def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
            self.groups.append(("new_group", backend or "default"))
            if backend is not None:
                backend = fake_backend(backend)
            return real_new(ranks, timeout, backend, *args, **kwargs)

        dist.rendezvous, dist.init_process_group, dist.new_group = rendezvous, init_process_group, new_group

        def restore():
            dist.rendezvous, dist.init_process_group, dist.new_group = real_rendezvous, real_init, real_new

        return restore
