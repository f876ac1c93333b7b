"""Checkpoint directories on disk: names, atomic publication, retention, safe reading.

A checkpoint is a directory (fairseq's names without `.pt`: `checkpoint_last`,
`checkpoint3`, `checkpoint_3_1200`, `checkpoint_best`, `checkpoint.best_loss_2.310`)
holding `torch.distributed.checkpoint` files (one `.distcp` per rank, `.metadata`),
`trainer_state.json`, `rng/rank{r}.json`, `config.yaml` and the tokenizer.

It is written under `.tmp-<name>` and becomes visible by one rename, after every rank
has finished writing. A name that already exists is swapped atomically
(renameat2 RENAME_EXCHANGE) where the filesystem allows it; elsewhere the old
directory is first renamed to `<name>.old`, which `resolve()` still finds if the
process dies between the two renames. Further names of the same checkpoint are hard
links to the same files, so a save costs one write whatever the number of names.
"""

import ctypes
import errno
import os
import re
import shutil
from pathlib import Path

from trainer.errors import UsageError
from trainer.formats.fairseq.checkpoint_file import is_fairseq_checkpoint
from trainer.formats.hf.config import is_hf_dir, read_hf_config
from trainer.formats.shardlm.checkpoint_dir import fairseq_path, is_checkpoint, resolve

TMP_PREFIX = ".tmp-"
UPDATE_CKPT = re.compile(r"^checkpoint_(\d+)_(\d+)$")
EPOCH_CKPT = re.compile(r"^checkpoint(\d+)$")
BEST_CKPT = re.compile(r"^checkpoint\.best_(\w+)_(-?[\d.]+|inf|nan)$")
LOW_SPACE = 64 << 20  # a write that failed with less than this free ran out of space


def checkpoints_in(save_dir):
    """The names of the checkpoints in `save_dir`, checkpoint_last first if there."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    names = sorted(p.name for p in save_dir.iterdir() if not p.name.startswith(TMP_PREFIX) and is_checkpoint(p))
    return sorted(names, key=lambda name: name != "checkpoint_last")


def restore_choice(c):
    """What a run starts from, fairseq's load_checkpoint: (checkpoint directory or None,
    whether it is --finetune-from-model's, the path looked for). --finetune-from-model may
    be a Hugging Face model directory (its config.json checked here). Refuses in one line a
    --restore-file that names nothing while --save-dir holds checkpoints: fairseq would
    start afresh and its saves would overwrite them, for a typo."""
    save_dir = Path(c.save_dir)
    default = c.restore_file in ("checkpoint_last", "checkpoint_last.pt")
    if c.finetune_from_model and not default:
        raise UsageError(
            "--finetune-from-model and --restore-file name two checkpoints to start from; drop one of them"
        )
    continue_once = c.continue_once
    if continue_once and (not default or c.finetune_from_model):
        other = "--restore-file" if not default else "--finetune-from-model"
        raise UsageError(f"--continue-once and {other} name two checkpoints to start from; drop one of them")
    # The default is always --save-dir's (a checkpoint_last where train is started from is
    # another run's); another relative name is looked for from here, then in --save-dir.
    restore = fairseq_path(c.restore_file)
    if default or (not restore.is_absolute() and not restore.exists()):
        restore = fairseq_path(save_dir / c.restore_file)
    found = resolve(restore)
    if found is not None:
        return found, False, restore
    if continue_once and not is_fairseq_checkpoint(save_dir / "checkpoint_last.pt"):
        # The first launch of a branch: its run goes on from there; a requeue finds its own.
        found = resolve(fairseq_path(continue_once))
        if found is None and is_fairseq_checkpoint(continue_once):
            found = Path(continue_once)
        if found is None:
            raise UsageError(
                f"--continue-once {continue_once} is not a checkpoint; pass a checkpoint directory written by "
                "train (or a fairseq-train .pt)"
            )
        return found, False, found
    # fairseq-train's own checkpoint resumes its run; by default, its checkpoint_last.pt in --save-dir
    theirs = save_dir / "checkpoint_last.pt" if default and not (save_dir / "checkpoint_last").exists() else restore
    if is_fairseq_checkpoint(theirs):
        return theirs, False, theirs
    if not default:
        if restore.exists():
            what = (
                "a file, but not one torch.save wrote"
                if restore.is_file()
                else "a directory without trainer_state.json and .metadata"
            )
            raise UsageError(
                f"--restore-file {c.restore_file} is not a checkpoint: {restore} is {what}; "
                "pass a checkpoint directory written by train"
            )
        held = checkpoints_in(save_dir)
        if held and held[0] == "checkpoint_last":
            raise UsageError(
                f"--restore-file {c.restore_file} does not exist, and --save-dir {save_dir} holds "
                "checkpoint_last: fix the path, or drop --restore-file to resume from checkpoint_last"
            )
        if held:
            raise UsageError(
                f"--restore-file {c.restore_file} does not exist, and --save-dir {save_dir} holds "
                f"{', '.join(held)}: fix the path (e.g. --restore-file {held[-1]}), or choose "
                "another --save-dir"
            )
    if c.finetune_from_model and default:
        if is_fairseq_checkpoint(c.finetune_from_model):
            return Path(c.finetune_from_model), True, Path(c.finetune_from_model)
        if is_hf_dir(c.finetune_from_model):
            read_hf_config(c.finetune_from_model)
            return Path(c.finetune_from_model), True, Path(c.finetune_from_model)
        found = resolve(c.finetune_from_model)
        if found is None:
            raise UsageError(
                f"--finetune-from-model {c.finetune_from_model} is neither a checkpoint directory, "
                "nor a fairseq-train checkpoint, nor a Hugging Face model directory (config.json and "
                "safetensors weights); pass one written by train, fairseq-train or save_pretrained"
            )
        return found, True, found
    return None, False, restore


def temporary_dir(save_dir, name):
    return Path(save_dir) / f"{TMP_PREFIX}{name}"


def _rename_exchange(src, dst):
    """Atomically swap two existing paths; False where the OS or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_EXCHANGE) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(ctypes.get_errno(), f"cannot replace {dst}: {os.strerror(ctypes.get_errno())}")


def publish(tmp, final):
    """Make the complete directory `tmp` visible as `final`, replacing what was there."""
    tmp, final = Path(tmp), Path(final)
    _fsync_dir(tmp)
    if not final.exists():
        os.rename(tmp, final)
    elif _rename_exchange(tmp, final):
        shutil.rmtree(tmp)  # now holds the previous checkpoint
    else:
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    _fsync_dir(final.parent)


def link_copy(src, final):
    """Publish a second name for checkpoint `src`: hard links (a copy where links fail)."""
    src, final = Path(src), Path(final)
    tmp = temporary_dir(final.parent, final.name)
    shutil.rmtree(tmp, ignore_errors=True)
    for path in sorted(src.rglob("*")):
        target = tmp / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
    publish(tmp, final)


def remove_unfinished_saves(save_dir):
    """Delete the `.tmp-*` directories of saves that never finished (the process died);
    published checkpoints are never touched. Only safe while this run holds the save
    directory's lock. Returns the names removed."""
    leftovers = sorted(p for p in Path(save_dir).glob(f"{TMP_PREFIX}*") if p.is_dir())
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in leftovers]


def write_failure(write, save_dir):
    """Run `write`; the reason it could not write (one line, e.g. "No space left on device"), else None."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        write()
    except OSError as e:
        return e.strerror or str(e)
    except (RuntimeError, CheckpointException) as e:  # DCP gathers every rank's failure
        text = str(e)
        for reason in (
            "No space left on device",
            "Read-only file system",
            "Permission denied",
            "Disk quota exceeded",
            "Input/output error",
        ):
            if reason in text:
                return reason
        # torch.save's zip writer loses ENOSPC's errno ("[enforce fail at inline_container.cc:672]
        # unexpected pos 704 vs 598"): ask the disk.
        free = shutil.disk_usage(save_dir).free
        if "inline_container" in text and free < LOW_SPACE:
            return f"No space left on device ({free >> 10} KiB free)"
        raise
    return None


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prune(save_dir, c):
    """fairseq's retention: the newest --keep-interval-updates update checkpoints, the
    newest --keep-last-epochs epoch checkpoints, the best --keep-best-checkpoints."""
    save_dir = Path(save_dir)
    names = [p.name for p in save_dir.iterdir() if p.is_dir()]
    doomed = []
    if c.keep_interval_updates >= 0:
        updates = sorted((int(m.group(2)), n) for n in names if (m := UPDATE_CKPT.match(n)))
        doomed += [n for _, n in updates[: max(len(updates) - c.keep_interval_updates, 0)]]
    if c.keep_last_epochs >= 0:
        epochs = sorted((int(m.group(1)), n) for n in names if (m := EPOCH_CKPT.match(n)))
        doomed += [n for _, n in epochs[: max(len(epochs) - c.keep_last_epochs, 0)]]
    if c.keep_best_checkpoints >= 0:
        best = sorted((float(m.group(2)), n) for n in names if (m := BEST_CKPT.match(n)))
        if not c.maximize_best_checkpoint_metric:
            best.reverse()  # worst first
        doomed += [n for _, n in best[: max(len(best) - c.keep_best_checkpoints, 0)]]
    for name in doomed:
        shutil.rmtree(save_dir / name, ignore_errors=True)
    return doomed
