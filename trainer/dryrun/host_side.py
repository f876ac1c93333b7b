"""What torch does on the host with values fake tensors do not have.

- Bookkeeping that builds small index tensors and reads them back (a device mesh's layout,
  a shard's offset) runs on real host tensors, as it does on a GPU host; so does reading a
  rank's rows of a Hugging Face model (--finetune-from-model, dpo's reference) from disk.
- DDP's start-up checks read every parameter's data in C++ (the shapes compared across
  ranks, rank 0's weights broadcast): skipped. Every rank builds the same shapes from one
  config, and the weights' values are not the dry run's to check.
"""

import functools

import torch.distributed.device_mesh as device_mesh
import torch.distributed.tensor._utils as dtensor_utils
import torch.nn.parallel.distributed as ddp
from torch._subclasses.fake_tensor import unset_fake_temporarily

from trainer.checkpoint.hf_dir import HFWeights

HOST_SIDE = (
    (device_mesh, "init_device_mesh"),
    (dtensor_utils, "compute_local_shape_and_global_offset"),
    (HFWeights, "rows"),
)
SKIPPED = ((ddp, "_verify_param_shape_across_processes"), (ddp, "_sync_module_states"))


def unfaked_host_side():
    """Patch each of HOST_SIDE to run outside fake mode, and SKIPPED to do nothing; returns a
    function that restores them."""
    saved = [(module, name, getattr(module, name)) for module, name in HOST_SIDE + SKIPPED]
    for module, name, fn in saved:
        setattr(module, name, _unfaked(fn) if (module, name) in HOST_SIDE else _skipped)

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


def _skipped(*args, **kwargs):
    return None
