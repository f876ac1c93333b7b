"""What torch does on the host with values fake tensors do not have.

- Bookkeeping that builds small index tensors and reads them back (a device mesh's layout
  and a rank's coordinate in it, a shard's offset) runs on real host tensors, as it does on
  a GPU host; so does reading a
  rank's rows of a Hugging Face model (--finetune-from-model, dpo's reference) or a model's
  tensors (eval-lm, generate, serve) from disk.
- `torch.tensor(data, device=GPU)` builds the tensor on the host and copies it to the GPU
  from C++, out of fake mode's sight: here the copy is made in sight.
- The data pipeline reads real batches (its worker processes and pinning threads know
  nothing of fake tensors); each batch becomes fake, pinned where it was, as it is handed
  to the rank.
- DDP's start-up checks read every parameter's data in C++ (the shapes compared across
  ranks, rank 0's weights broadcast): skipped. Every rank builds the same shapes from one
  config, and the weights' values are not the dry run's to check.
"""

import functools

import torch
import torch.distributed.device_mesh as device_mesh
import torch.distributed.tensor._utils as dtensor_utils
import torch.nn.parallel.distributed as ddp
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily

import trainer.inference.load as inference_load
import trainer.train.ipq as ipq
from data.iterator import EpochBatchIterator
from data.mixture_batches import MixtureBatchIterator
from trainer.formats.fairseq.reader import FairseqReader
from trainer.formats.hf.weights import HFWeights
from trainer.formats.shardlm.reader import CheckpointReader, ExportReader

HOST_SIDE = (
    (device_mesh, "init_device_mesh"),
    # a mesh sliced or concatenated from another (a TP mesh's dimension, FSDP2's mesh of
    # dp × tp) works out its rank's coordinate on a host tensor too
    (device_mesh.DeviceMesh, "__init__"),
    # the function that does the work, not its public name: callers import that by name
    # (torch's DCP planners and sharding rules, the vocabulary-parallel loss's offset)
    (dtensor_utils, "_compute_local_shape_and_global_offset"),
    (HFWeights, "rows"),
    (CheckpointReader, "get"),
    (ExportReader, "get"),
    (FairseqReader, "rows"),
    # a model the commands build on the meta device is shapes only already; made fake, its
    # parameters could not be swapped for the device's by to_empty
    (inference_load, "build_model"),
)
# iPQ's stage (trainer/train/ipq.py): the k-means and the counts of its assignments are
# computed from the weights' values, which fake tensors do not have; they give zeros of their
# shapes (as a fake host read gives 0), and the rest of the stage runs as on GPUs: the whole
# tensors gathered, rank 0's centroids and assignments broadcast, the model built and sharded
# again, a new optimizer.
VALUE_STAND_INS = (
    (
        ipq,
        "quantize",
        lambda weight, block, k, **_: (
            torch.zeros(k, block, dtype=weight.dtype, device=weight.device),
            torch.zeros(weight.numel() // block, dtype=torch.long, device=weight.device),
        ),
    ),
    (
        ipq,
        "block_counts",
        lambda assignments, centroids: torch.zeros(centroids.shape[0], dtype=centroids.dtype, device=centroids.device),
    ),
)
SKIPPED = (
    (ddp, "_verify_param_shape_across_processes"),
    (ddp, "_sync_module_states"),
    # --compile: inductor writes GPU kernels only with a CUDA build of torch; layers run as written
    (torch.nn.Module, "compile"),
)


def unfaked_host_side():
    """Patch each of HOST_SIDE to run outside fake mode, SKIPPED to do nothing and
    torch.tensor to copy to a GPU in sight; returns a function that restores them."""
    stand_ins = tuple((module, name) for module, name, _ in VALUE_STAND_INS)
    saved = [
        (module, name, getattr(module, name)) for module, name in HOST_SIDE + SKIPPED + stand_ins + ((torch, "tensor"),)
    ]
    for module, name, fn in saved:
        setattr(module, name, _unfaked(fn) if (module, name) in HOST_SIDE else _skipped)
    for module, name, stand_in in VALUE_STAND_INS:
        setattr(module, name, stand_in)
    torch.tensor = _tensor_then_copy(saved[-1][2])

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


def _tensor_then_copy(tensor):
    @functools.wraps(tensor)
    def make(data, *args, device=None, **kwargs):
        mode = active_fake_mode()
        if mode is None or device is None or torch.device(device).type != "cuda":
            return tensor(data, *args, device=device, **kwargs)
        with unset_fake_temporarily():
            host = tensor(data, *args, **kwargs)
        # from_tensor keeps no constant: fake mode would copy a constant to the GPU for real
        return mode.from_tensor(host).to(device)

    return make


def real_batches(fake):
    """Patch the batch iterators (DATA's and a mixture's) to read real batches and hand them
    on as `fake`'s (a FakeDevices); returns a function that restores them."""
    originals = {cls: cls.next_epoch_itr for cls in (EpochBatchIterator, MixtureBatchIterator)}

    def patched(next_epoch_itr):
        def fake_batches(itr, *args, **kwargs):
            with unset_fake_temporarily():
                batches = next_epoch_itr(itr, *args, **kwargs)
            while True:
                with unset_fake_temporarily():
                    batch = next(batches, None)
                if batch is None:
                    return
                yield fake.adopt(batch)

        return fake_batches

    for cls, next_epoch_itr in originals.items():
        cls.next_epoch_itr = patched(next_epoch_itr)

    def restore():
        for cls, next_epoch_itr in originals.items():
            cls.next_epoch_itr = next_epoch_itr

    return restore
