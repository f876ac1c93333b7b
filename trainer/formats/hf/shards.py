"""A Hugging Face model directory's weights: `model.safetensors`, or shards of at most
--max-shard-size with `model.safetensors.index.json`, split as `save_pretrained` splits
(huggingface_hub's split_state_dict_into_shards_factory): tensors in order, a new file when
the next tensor would overflow this one, a tensor bigger than the limit alone in its own.

The split is computed from shapes alone, so every file streams one tensor at a time.
"""

import json
import math
import re

import torch

from trainer.errors import UsageError
from trainer.formats.safetensors_file import write_safetensors

DEFAULT_MAX_SHARD_SIZE = "5GB"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# huggingface_hub's decimal units, and the binary ones older transformers also took.
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_shard_size(text):
    """'5GB' → 5_000_000_000 bytes (a bare number is bytes); UsageError when unreadable."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match[2].upper() if match else None
    if unit not in _UNITS or int(float(match[1]) * _UNITS[unit]) < 1:
        raise UsageError(f"--max-shard-size {text!r}: give a positive size such as 5GB, 500MB or 2GiB")
    return int(float(match[1]) * _UNITS[unit])


def _nbytes(shape, dtype):
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def plan_shards(specs, max_bytes):
    """specs [(name, shape, dtype)] → [[spec, …] per file], in order."""
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = _nbytes(spec[1], spec[2])
        if nbytes > max_bytes:  # alone, in a file of its own, where it stands
            shards.append([spec])
            continue
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(count):
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_hf_weights(out_dir, specs, get_tensor, max_shard_size=DEFAULT_MAX_SHARD_SIZE, metadata=None):
    """Write `specs` [(name, shape, dtype)] into `out_dir` as one model.safetensors or as
    shards + index, calling `get_tensor(name)` once per name in spec order. Returns the
    file names written."""
    max_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_shard_size(max_shard_size)
    shards = plan_shards(specs, max_bytes)
    names = shard_file_names(len(shards))
    for name, shard in zip(names, shards):
        write_safetensors(out_dir / name, shard, get_tensor, metadata)
    if len(shards) > 1:
        index = {
            "metadata": {
                "total_parameters": sum(math.prod(shape) for _, shape, _ in specs),
                "total_size": sum(_nbytes(shape, dtype) for _, shape, dtype in specs),
            },
            "weight_map": {spec[0]: name for name, shard in zip(names, shards) for spec in shard},
        }
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")  # as save_pretrained
        names.append(INDEX_FILE)
    return names
