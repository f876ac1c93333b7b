"""export-model: a checkpoint as one consolidated safetensors file with its config and
tokenizer, or as a Hugging Face GPT-2 directory, one tensor at a time."""
import os
import shutil
import tempfile
from pathlib import Path

import torch

from trainer.errors import UsageError
from trainer.inference.hf_gpt2 import check_hf_compatible, write_hf_gpt2
from trainer.inference.load import EXPORT_FILE, SIDE_FILES, CheckpointTensors
from trainer.inference.safetensors_file import write_safetensors


def export_model(path, out, fmt="safetensors", dtype=None):
    """Write `out/model.safetensors` (or an HF GPT-2 directory) from a checkpoint, one tensor
    at a time. Refuses to write into a directory that already holds a model. Everything is
    written in a temporary directory first, so a checkpoint that cannot be read leaves `out`
    as it was."""
    src = CheckpointTensors(path)
    out = Path(out)
    _check_out(out)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=_nearest_existing(out)))
    try:
        _write_export(src, tmp, fmt, dtype)
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == EXPORT_FILE):  # the model file last
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_out(out):
    if (out / EXPORT_FILE).exists():
        raise UsageError(f"{out / EXPORT_FILE} already exists; pass another --out (nothing was overwritten)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; pass a directory")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError(f"--out {out} cannot be created: {blocker} is a file; pass another --out")


def _nearest_existing(path):
    return next(p for p in (path, *path.parents) if p.exists())


def _write_export(src, out, fmt, dtype):
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    if fmt == "hf":
        check_hf_compatible(src.cfg.model)
        write_hf_gpt2(out, src.get, src.cfg.model, src.vocab_size(), src.max_positions(),
                      dtype=dtype or torch.float32, bos_token_id=0, pad_token_id=1, eos_token_id=2)
    else:
        specs = [(n, shape, dtype or dt) for n, (shape, dt) in sorted(src.specs.items())]
        write_safetensors(out / EXPORT_FILE, specs, lambda n: cast(src.get(n)),
                          metadata={"format": "pt", "producer": "shardlm"})
        shutil.copyfile(src.path / "config.yaml", out / "config.yaml")
    for name in SIDE_FILES[1:]:
        if (src.path / name).is_file():
            shutil.copyfile(src.path / name, out / name)
