"""Every random stream of a process (Python, numpy, torch, its GPU's) as JSON, one file per
rank: a resumed run continues each rank's dropout and data order as the uninterrupted one
would.

A rank's GPU stream is its own device's alone, saved under "cuda_device" and restored on the
device the rank has when it resumes, whatever its index: a job saved with every GPU of a
node visible to each rank (local rank r on cuda:r) resumes with one GPU per task (each on
cuda:0), and the other way round. Checkpoints before kept every visible GPU's stream, a
list under "cuda": the rank's entry is the one its device had then (old_cuda_entry)."""

import logging
import random

import numpy as np
import torch

log = logging.getLogger("shardlm")


def rng_state(device):
    """This process's random states; `device`: the rank's (its GPU's stream only)."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state().tolist(),
    }
    if device.type == "cuda":
        state["cuda_device"] = torch.cuda.get_rng_state(device).tolist()
    return state


def set_rng_state(state, device, local_rank):
    """Restores `state` (rng_state's) on this process; the GPU stream on `device`, the rank's
    now. local_rank picks the rank's entry of an old checkpoint's list."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if device.type != "cuda":
        return
    own = state.get("cuda_device")
    if own is None and "cuda" in state:
        own = old_cuda_entry(state["cuda"], local_rank)
        if own is None:
            log.warning(
                f"the checkpoint's GPU random states ({len(state['cuda'])}) have none of local rank {local_rank}: "
                "its GPU stream (dropout) starts fresh"
            )
    if own is not None:
        torch.cuda.set_rng_state(torch.tensor(own, dtype=torch.uint8), device)


def old_cuda_entry(streams, local_rank):
    """The stream of local rank `local_rank` in an old checkpoint's list of every visible GPU's:
    that rank ran on GPU `local_rank` when it saw more GPUs than that, else on the one GPU it
    saw (trainer/parallel/ranks.cuda_device_index); None when neither holds."""
    if local_rank < len(streams):
        return streams[local_rank]
    return streams[0] if len(streams) == 1 else None
