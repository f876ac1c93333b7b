"""torch's own host-side bookkeeping that builds small index tensors and reads them back (a
device mesh's layout, a shard's offset): on fake tensors their values would be unknown, so
the dry run runs these on real host tensors, as they run on a GPU host."""

import functools

import torch.distributed.device_mesh as device_mesh
import torch.distributed.tensor._utils as dtensor_utils
from torch._subclasses.fake_tensor import unset_fake_temporarily

HOST_SIDE = ((device_mesh, "init_device_mesh"), (dtensor_utils, "compute_local_shape_and_global_offset"))


def unfaked_host_side():
    """Patch each of HOST_SIDE to run outside fake mode; returns a function that restores them."""
    saved = [(module, name, getattr(module, name)) for module, name in HOST_SIDE]
    for module, name, fn in saved:
        setattr(module, name, _unfaked(fn))

    def restore():
        for module, name, fn in saved:
            setattr(module, name, fn)

    return restore


def _unfaked(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return run
