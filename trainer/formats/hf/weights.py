"""A Hugging Face model directory as a source of weights: `config.json` plus
`model.safetensors`, or `model-0000N-of-0000M.safetensors` named by
`model.safetensors.index.json`.

Everything is checked before any weight is read (every file there, every header readable,
every tensor our model needs present with the shape and a float dtype our parameter
implies), so a bad directory costs a second and one line naming the file and the tensor.
The files are read with the `safetensors` library, memory-mapped: a rank reads only the
rows of its own shards (`get_slice`), so no rank ever holds the whole model.
"""

import json
import struct
from pathlib import Path

import torch

from trainer.errors import UsageError
from trainer.formats.hf.llama import row_slices

SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class HFWeights:
    """The tensors of an HF directory by name: their files, shapes and dtypes, and row slices
    of our parameters read from them. Use as a context manager (it keeps the files open)."""

    def __init__(self, path, family):
        self.path = Path(path)
        self.family = family  # trainer/formats/hf/config.py FAMILIES: its tensors' names and layout
        self.specs, self._open = {}, {}  # before _tensor_files: a single model.safetensors is opened there
        self.files = self._tensor_files()  # HF tensor name → file
        for file in sorted(set(self.files.values())):
            handle = self._handle(file)
            for name in handle.keys():
                if self.files.get(name) == file:
                    piece = handle.get_slice(name)
                    self.specs[name] = (tuple(piece.get_shape()), piece.get_dtype())
        for name, file in self.files.items():
            if name not in self.specs:
                raise UsageError(
                    f"{self.path / INDEX} maps {name} to {file}, which does not hold it; the download "
                    "is incomplete or mixed: fetch the model directory again"
                )

    def _tensor_files(self):
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError):
                raise UsageError(
                    f"{index} is not a safetensors index (no weight_map); fetch the model directory again"
                ) from None
            for name, file in sorted(weight_map.items()):
                if not (self.path / file).is_file():
                    raise UsageError(
                        f"missing shard {self.path / file} (holds {name}, per {INDEX}); fetch the model directory again"
                    )
            return dict(weight_map)
        if not (self.path / SINGLE_FILE).is_file():
            raise UsageError(
                f"{self.path} has a config.json but no {SINGLE_FILE} or {INDEX}; pass a Hugging Face "
                "model directory with its safetensors weights"
            )
        return {name: SINGLE_FILE for name in self._handle(SINGLE_FILE).keys()}

    def _handle(self, file):
        if file not in self._open:
            from safetensors import SafetensorError, safe_open

            try:
                self._open[file] = safe_open(str(self.path / file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise UsageError(self._unreadable(file, e)) from None
        return self._open[file]

    def _unreadable(self, file, error):
        """Why `file` cannot be opened, naming a tensor where one can be named: the first one
        a file cut short no longer holds whole (its header still says where each ends), else
        one the index maps to it (a file cut inside its header names none of its own)."""
        path = self.path / file
        cut = _cut_tensor(path)
        if cut is not None:
            name, end, size = cut
            return (
                f"{path} is cut short: tensor {name} ends at byte {end}, the file has {size}; the download is "
                "incomplete: fetch it again"
            )
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        held = sorted(name for name, f in getattr(self, "files", {}).items() if f == file)
        holds = f" (holds {held[0]}, per {INDEX})" if held else ""
        return (
            f"{path}{holds} is not a readable safetensors file ({reason[:160]}); it is truncated or damaged: "
            "fetch it again"
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._open.clear()  # safe_open handles unmap when dropped

    def check(self, params, model_cfg):
        """Raise UsageError naming the file and tensor when the directory does not give every
        one of `params` ({our name: shape}) whole, with the shape our config implies."""
        for name, shape in params.items():
            for hf_name, rows in self.family.hf_parts(name, model_cfg):
                expected = (rows if rows is not None else shape[0], *shape[1:])
                if self.family.transposed(hf_name):
                    expected = expected[::-1]
                if hf_name not in self.specs:
                    raise UsageError(
                        f"{self.path} has no tensor {hf_name} (for {name}); the weights do not cover "
                        "the model its config.json describes: fetch the complete directory"
                    )
                found, dtype = self.specs[hf_name]
                where = self.path / self.files[hf_name]
                if found != tuple(expected):
                    raise UsageError(
                        f"{where}: tensor {hf_name} is {list(found)}, config.json implies "
                        f"{list(expected)}; the weights and config.json are of different models"
                    )
                if dtype not in FLOAT_DTYPES:
                    raise UsageError(
                        f"{where}: tensor {hf_name} is {dtype}, not a float type (F32, F16, BF16); "
                        "quantized weights are not supported: pass the unquantized model"
                    )

    def dtype_of(self, name, model_cfg):
        """The dtype our parameter `name` is saved in (its first part's)."""
        return FLOAT_DTYPES[self.specs[self.family.hf_parts(name, model_cfg)[0][0]][1]]

    def rows(self, name, model_cfg, start, stop, dtype):
        """Rows start…stop-1 of our parameter `name`, read from the files (only those rows)."""
        pieces = []
        for hf_name, lo, hi in row_slices(self.family.hf_parts(name, model_cfg), start, stop):
            whole = self._handle(self.files[hf_name]).get_slice(hf_name)
            # a Conv1D weight is [in, out]: our rows are its columns
            piece = whole[:, lo:hi].t() if self.family.transposed(hf_name) else whole[lo:hi]
            pieces.append(piece.to(dtype))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _cut_tensor(path):
    """(name, end byte, file size) of the first tensor that a safetensors file whose header
    is whole but whose data is cut short lacks; None when the header itself is unreadable."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return None
            header = json.loads(f.read(n))
        ends = sorted(
            (8 + n + info["data_offsets"][1], name) for name, info in header.items() if name != "__metadata__"
        )
    except (OSError, struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return next(((name, end, size) for end, name in ends if end > size), None)
