"""shardlm's own checkpoints as a format: a directory of `torch.distributed.checkpoint` files
(one `.distcp` per rank and `.metadata`) beside `trainer_state.json` and `config.yaml`.

What finds one (fairseq's `.pt` spelling and a `<name>.old` left by an interrupted save
included) and what reads its tensors safely: the metadata through a restricted unpickler,
the tensors by a planner that refuses pickled objects. Writing, naming, retention and
resuming a run are the checkpoint room's (trainer/checkpoint/).
"""

import io
import os
import pickle
from pathlib import Path

from trainer.errors import UsageError

STATE_FILE = "trainer_state.json"
# The parts of a checkpoint's tensors: the weights, and --store-ema's moving average of them
# under the same names (the optimizer's state is "optim.").
MODEL_PREFIX, EMA_PREFIX = "model.", "ema."


def is_checkpoint(path):
    path = Path(path)
    return (path / STATE_FILE).is_file() and (path / ".metadata").is_file()


def fairseq_path(path):
    """`path` as a command line names a checkpoint (--restore-file, --finetune-from-model,
    --path): fairseq spells them `checkpoint_last.pt`, `checkpoint_1_2.pt`, and scripts
    written for it keep doing so; shardlm's are directories without the suffix. A `.pt`
    name that does not exist means the same name without it, when that one does."""
    path = Path(path)
    if path.suffix == ".pt" and not path.exists():
        bare = path.with_suffix("")
        if bare.exists() or bare.with_name(bare.name + ".old").exists():
            return bare
    return path


def resolve(path):
    """The checkpoint directory at `path` (fairseq's `.pt` spelling tolerated), or None.
    `<name>.old` stands in for a `<name>` that a save died replacing (publish())."""
    path = fairseq_path(path)
    for candidate in (path, path.with_name(path.name + ".old")):
        if is_checkpoint(candidate):
            return candidate
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; only its own metadata classes, torch sizes and
    dtypes may come out of it, so a checkpoint cannot run code when it is read."""

    TORCH_NAMES = {
        "Size",
        "device",
        "layout",
        "memory_format",
        "strided",
        "sparse_coo",
        "contiguous_format",
        "preserve_format",
        "channels_last",
    }

    def find_class(self, module, name):
        import torch

        if module.startswith("torch.distributed.checkpoint.") or (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        if module == "torch" and (name in self.TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if (module, name) in (
            ("torch.serialization", "_get_layout"),  # a layout by its name
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
        ):  # the checkpoint's id
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def read_metadata(path):
    """The DCP metadata of checkpoint `path`, read without running arbitrary code."""
    with open(Path(path) / ".metadata", "rb") as f:
        data = f.read()
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise UsageError(
            f"{path}/.metadata is not a readable checkpoint index ({e}); pass another checkpoint"
        ) from None


def safe_reader(path):
    """A DCP FileSystemReader whose metadata goes through the restricted unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(os.fspath(path))


def tensor_specs(path, prefix=MODEL_PREFIX):
    """{name: (shape, dtype)} of the tensors under `prefix` in checkpoint `path`, from its metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_metadata(path)
    return {
        k[len(prefix) :]: (tuple(v.size), v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }


class NoBytesLoadPlanner:
    """Loads tensors only: a checkpoint whose DCP files hold pickled objects is refused."""

    def __new__(cls):
        from torch.distributed.checkpoint import DefaultLoadPlanner

        class _Planner(DefaultLoadPlanner):
            def load_bytes(self, read_item, value):
                raise UsageError(
                    f"checkpoint entry {read_item.dest_index.fqn} is a pickled object; "
                    "shardlm only loads tensors and JSON"
                )

        return _Planner()
