"""Which format a path holds, and its reader: the one place a format is registered.

Each entry of FORMATS is (kind, test, reader): the first whose test accepts the path opens
it. The tests are torch-free and read no tensor; a reader module is imported only
when its format is opened (its torch import is what a torch-free command defers). Adding a
format is one module in its room and one line here.
"""

from pathlib import Path

from trainer.errors import UsageError
from trainer.formats.fairseq.checkpoint_file import fairseq_settings, is_fairseq_checkpoint
from trainer.formats.hf.config import is_hf_dir, read_hf_config
from trainer.formats.shardlm import checkpoint_dir
from trainer.formats.shardlm.export_dir import is_export


def _yes(test):
    """A yes-or-no test of a path as one that returns the path its reader opens, or None."""
    return lambda path: path if test(path) else None


# (kind, the path its reader opens or None, "module:class" of its reader), tried in this order.
FORMATS = [
    ("export", _yes(is_export), "trainer.formats.shardlm.reader:ExportReader"),
    ("checkpoint", checkpoint_dir.resolve, "trainer.formats.shardlm.reader:CheckpointReader"),
    ("hf", _yes(is_hf_dir), "trainer.formats.hf.reader:HFReader"),
    ("fairseq", _yes(is_fairseq_checkpoint), "trainer.formats.fairseq.reader:FairseqReader"),
]


def model_kind(path):
    """(kind, the path its reader opens) of the model at `path`; UsageError naming what
    would do when it is none of them."""
    path = checkpoint_dir.fairseq_path(path)  # `--path DIR/checkpoint_best.pt`, as fairseq's commands are given
    for kind, found, _ in FORMATS:
        opened = found(path)
        if opened is not None:
            return kind, Path(opened)
    if (path / "checkpoint_last").is_dir():
        raise UsageError(
            f"{path} is a --save-dir, not one checkpoint; pass one of its checkpoints, "
            f"e.g. --path {path / 'checkpoint_last'}"
        )
    raise UsageError(
        f"{path} is neither a checkpoint directory (from --save-dir), an export (from export-model), "
        "a Hugging Face model directory (config.json and safetensors) nor a fairseq-train checkpoint "
        "(.pt); pass one with --path"
    )


def open_model(path, ema=False):
    """The reader of the model at `path` (trainer/formats/reader.py); ema: of the moving
    average of the weights a checkpoint of train --store-ema holds (the inference commands' --ema)."""
    import importlib

    kind, opened = model_kind(path)
    module, name = next(reader for k, _, reader in FORMATS if k == kind).split(":")
    if not ema:
        return getattr(importlib.import_module(module), name)(opened)
    if kind != "checkpoint":
        raise UsageError(
            f"--ema reads the moving average of the weights in a checkpoint of train --store-ema; {path} is "
            f"a {KIND_NAMES[kind]}, which holds weights only: drop --ema"
        )
    return getattr(importlib.import_module(module), name)(opened, ema=True)


KIND_NAMES = {
    "export": "export-model output",
    "hf": "Hugging Face model directory",
    "fairseq": "fairseq-train checkpoint",
    "checkpoint": "checkpoint",
}


def model_files_dir(path):
    """Where the tokenizer and side files of the model at `path` are (a fairseq checkpoint's
    are beside it), found without reading a tensor."""
    kind, opened = model_kind(path)
    return opened.parent if kind == "fairseq" else opened


def model_settings(path):
    """(our model fields, vocabulary size, where they come from) of the model at `path`, read
    without its tensors (torch-free for a Hugging Face directory; a fairseq .pt is a torch
    pickle). `plan --path` sizes a model by them."""
    kind, opened = model_kind(path)
    if kind == "hf":
        _, fields, vocab, positions = read_hf_config(opened)
        return {**fields, "max_target_positions": positions}, vocab, f"from {opened / 'config.json'}"
    if kind == "fairseq":
        _, fixed, training, _, vocab = fairseq_settings(opened)
        return {**fixed, **training}, vocab, f"from {opened}"
    raise UsageError(
        f"--path {path} is a shardlm {kind}: plan sizes a model by its flags (or --path HF_DIR or a "
        "fairseq-train .pt); pass the flags it was trained with"
    )
