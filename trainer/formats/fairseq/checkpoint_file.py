"""A checkpoint written by fairseq-train (`checkpoint_last.pt`, a torch.save pickle) as the
model of a command: `eval-lm`, `generate`, `export-model` and `plan --path X.pt`, and
`train --finetune-from-model X.pt` or `--restore-file X.pt` (which resumes fairseq's run).

The file is read by torch's weights_only unpickler with an allow-list of the types fairseq's
checkpoints hold (dicts, tensors, and the argparse.Namespace of fairseq < 0.10), so a crafted
file is refused unread instead of running its code. Its config decides the model, as a Hugging
Face config.json does (trainer/config/model_source.py says what flags may change);
trainer/formats/fairseq/model.py maps its options and tensors to ours.
"""

import argparse
import functools
import logging
import pickle
import re
import zipfile
from pathlib import Path

from trainer.errors import UsageError
from trainer.formats.fairseq.fsdp_shards import consolidate, is_shard, missing_shards, shard_files, world_size
from trainer.formats.fairseq.model import (
    FairseqConfigError,
    fairseq_model_config,
    model_from_fairseq,
    normformer_not_built,
)

log = logging.getLogger("shardlm")
# The legacy (non-zip) torch.save format starts with a pickle's protocol-2 opcode.
_LEGACY_MAGIC = b"\x80\x02"


def is_fairseq_checkpoint(path):
    """A file torch.save wrote (zip or legacy format): the only kind of checkpoint that is a
    file; ours are directories. Or fairseq's sharded FSDP checkpoint, named as fairseq's
    commands name it (`checkpoint_last.pt`, its files `checkpoint_last-shard{i}.pt` beside it)."""
    path = Path(path)
    if not path.is_file():
        shards = shard_files(path)
        return shards is not None and is_fairseq_checkpoint(next(iter(shards.values())))
    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as f:
        return f.read(2) == _LEGACY_MAGIC


class FairseqObject:
    """Stands in for a fairseq class whose instances a checkpoint pickles (the meters in the
    extra_state of fairseq < 0.9): unpickled as plain attributes; no code of fairseq's runs."""


_FAIRSEQ_CLASSES = [
    f"fairseq.{module}.{name}"
    for module in ("meters", "logging.meters")
    for name in ("AverageMeter", "TimeMeter", "StopwatchMeter")
]


def _allowed_globals():
    """What a fairseq checkpoint may hold beyond weights_only's tensors and containers:
    fairseq < 0.10 saved its options as an argparse.Namespace, fairseq < 0.9 its meters as
    objects, and numpy scalars appear in some versions' meters."""
    import numpy as np

    allowed = [argparse.Namespace, np.dtype, *{type(np.dtype(t)) for t in ("float64", "float32", "int64")}]
    core = getattr(np, "_core", None) or np.core
    allowed.append(core.multiarray.scalar)
    return allowed + [(FairseqObject, name) for name in _FAIRSEQ_CLASSES]


@functools.lru_cache(maxsize=4)
def _load(path, mtime):
    # The config is inside torch's pickle: only torch can read it, so a command given a
    # fairseq checkpoint imports torch here, while composing.
    import torch

    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"a reference to {found[1]}" if found else "an object outside the allow-list"
        raise UsageError(
            f"{path} holds {what}, which no fairseq checkpoint does: refused unread (unpickling it could "
            "run code); pass a checkpoint written by fairseq-train"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError, zipfile.BadZipFile) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UsageError(f"cannot read {path}: {reason}; the file is damaged or incomplete") from None


def read_fairseq_checkpoint(path):
    """The checkpoint's dict (tensors memory-mapped); UsageError in one line when it is not one.
    The shards of an FSDP checkpoint are read as one (trainer/formats/fairseq/fsdp_shards.py)."""
    named = Path(path)
    shards = shard_files(named)
    state = _read_file(named) if named.is_file() else None
    if shards is None or (state is not None and not is_shard(state)):
        return state if state is not None else _read_file(named)
    world = world_size(state if state is not None else _read_file(min(shards.items())[1]))
    missing_shards(named, shards, world)
    return _read_shards(tuple(_file_key(shards[rank]) for rank in range(world)))


def _file_key(path):
    path = Path(path).resolve()
    return str(path), path.stat().st_mtime_ns


def _read_file(path):
    state = _load(*_file_key(path))
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise UsageError(
            f"{Path(path).resolve()} is a torch file but not a fairseq-train checkpoint (no `model` state dict)"
        )
    return state


@functools.lru_cache(maxsize=2)
def _read_shards(keys):
    return consolidate([(Path(path), _load(path, mtime)) for path, mtime in keys])


@functools.lru_cache(maxsize=None)
def _warn_once(message):
    """Each command reads a checkpoint's config several times; the user reads a warning once."""
    log.warning(message)


def vocab_size_of(model_state):
    """The embedding's rows: the dictionary the model was trained with (its bands' when adaptive)."""
    if "decoder.embed_tokens.weight" in model_state:
        return int(model_state["decoder.embed_tokens.weight"].shape[0])
    bands = [k for k in model_state if re.fullmatch(r"decoder\.embed_tokens\.embeddings\.\d+\.0\.weight", k)]
    return sum(int(model_state[k].shape[0]) for k in bands)


def fairseq_settings(path):
    """(arch, our fixed model fields, training-time defaults, fairseq's task options, vocab
    size) of a fairseq checkpoint; UsageError naming what shardlm cannot build."""
    state = read_fairseq_checkpoint(path)
    try:
        arch, model, task = fairseq_model_config(state)
        unbuilt = normformer_not_built(model, state["model"])
        if unbuilt:  # as fairseq built and scored it
            model = {**model, **dict.fromkeys(unbuilt, False)}
            flags = " ".join("--" + k.replace("_", "-") for k in unbuilt)
            _warn_once(
                f"{path}: its config sets {flags} (NormFormer), but the fairseq that wrote it did not apply "
                "them (its transformer_lm drops these flags) and it holds no tensors of theirs: the model is "
                "built without them, as fairseq built and scored it"
            )
        fixed, training = model_from_fairseq(arch, model)
    except FairseqConfigError as e:
        raise UsageError(f"{path}: {e}") from None
    # fairseq's max_target_positions defaults to the task's --tokens-per-sample
    fixed["max_target_positions"] = model.get("max_target_positions") or task.get("tokens_per_sample") or 1024
    return arch, fixed, training, task, vocab_size_of(state["model"])


def check_fairseq_dictionary(path, data_dir, data_vocab):
    """A fairseq checkpoint holds no dictionary: its embedding rows are its data-bin's
    dict.txt, in that order. DATA must have as many types, and be the very dict.txt where one
    is found (beside the checkpoint, as fairseq's model archives ship it, or at the data-bin
    its config names)."""
    path, data_dir = Path(path), Path(data_dir)
    _, _, _, task, model_vocab = fairseq_settings(path)
    fix = "pass the data-bin the fairseq model was trained on"
    if data_vocab != model_vocab:
        raise UsageError(
            f"DATA {data_dir} has a vocabulary of {data_vocab} types, {path}'s embeddings {model_vocab} rows: {fix}"
        )
    trained_on = str(task.get("data") or "").split(":")[0]  # fairseq's DATA, its first shard
    candidates = [path.parent / "dict.txt"] + ([Path(trained_on).expanduser() / "dict.txt"] if trained_on else [])
    ours = data_dir / "dict.txt"
    for theirs in candidates:
        if theirs.is_file() and ours.is_file() and theirs.read_bytes() != ours.read_bytes():
            raise UsageError(
                f"DATA {data_dir}'s dict.txt differs from {theirs}, the one {path} was trained with: {fix}"
            )
