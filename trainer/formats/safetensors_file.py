"""Read and write the safetensors format with torch and the standard library only.

A file is: an 8-byte little-endian length N, N bytes of JSON (padded with spaces to a
multiple of 8), then every tensor's raw little-endian bytes, back to back. The JSON maps
each name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
first byte after the header) and may hold "__metadata__", a str→str map.

Writing streams: the header is computed from the specs up front, so only one tensor
is ever in memory — what exporting a model too big for one process needs.
(https://github.com/huggingface/safetensors)
"""

import json
import math
import os
import struct
import sys

import torch

# safetensors' dtype codes; the optional ones exist only in newer torch releases.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
for _code, _attr in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        _DTYPES[_code] = getattr(torch, _attr)
_CODES = {dtype: code for code, dtype in _DTYPES.items()}

_MAX_HEADER = 100_000_000  # the reference implementation's limit, against absurd lengths


def _check_byteorder():
    # Tensors are written as their in-memory bytes; the format says little-endian.
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; this machine is big-endian")


def _nbytes(shape, dtype):
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _header_bytes(specs, metadata):
    header, offset = {}, 0
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    for name, shape, dtype in specs:
        if name == "__metadata__" or name in header:
            raise ValueError(f"tensor name {name!r} is reserved or repeated")
        if dtype not in _CODES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors code")
        end = offset + _nbytes(shape, dtype)
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    # Pad so the data starts 8-aligned: readers may map tensors in place.
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _raw_bytes(tensor):
    # reshape(-1) also serves 0-d tensors, which .view(uint8) refuses.
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path, specs, get_tensor, metadata=None):
    """Write `path` from `specs`, a list of (name, shape, dtype), calling `get_tensor(name)`
    once per name in order; only one tensor is held at a time. The file appears under
    `path` only when complete (written to `path + ".tmp"`, then renamed)."""
    _check_byteorder()
    specs = [(name, tuple(shape), dtype) for name, shape, dtype in specs]
    tmp = str(path) + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(_header_bytes(specs, metadata))
            for name, shape, dtype in specs:
                tensor = get_tensor(name)
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"tensor {name!r}: get_tensor returned {type(tensor).__name__}")
                if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise ValueError(
                        f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, but its spec says {shape} {dtype}"
                    )
                f.write(_raw_bytes(tensor.detach().cpu().contiguous()))
                del tensor
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _bad(path, why):
    return ValueError(f"{path}: not a valid safetensors file: {why}")


def _read_header(f, path):
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    if len(prefix) < 8:
        raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > min(_MAX_HEADER, size - 8):
        raise _bad(path, f"header length {n} exceeds the file ({size} bytes)")
    try:
        header = json.loads(f.read(n).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(path, f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    _validate(header, path, data_size=size - 8 - n)
    return header, 8 + n


def _validate(header, path, data_size):
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad(path, "__metadata__ is not a map of strings")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
            raise _bad(path, f"tensor {name!r} has no known dtype: {info!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
        ):
            raise _bad(path, f"tensor {name!r} has a malformed shape or data_offsets: {info!r}")
        begin, end = offsets
        if end - begin != _nbytes(shape, _DTYPES[info["dtype"]]):
            raise _bad(path, f"tensor {name!r}: offsets {offsets} do not fit shape {shape} {info['dtype']}")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise _bad(path, f"tensor {name!r} starts at byte {begin}, expected {position} (gap or overlap)")
        position = end
    if position != data_size:
        why = "truncated" if position > data_size else "trailing bytes"
        raise _bad(path, f"tensors need {position} bytes of data, the file has {data_size} ({why})")


def safetensors_header(path):
    """The parsed JSON header: name → {dtype, shape, data_offsets}, plus "__metadata__"
    when present. Reads no tensor data."""
    with open(path, "rb") as f:
        return _read_header(f, path)[0]


def read_safetensors(path, names=None):
    """(name → CPU tensor, metadata dict) for `names` (default: every tensor, in file order)."""
    _check_byteorder()
    with open(path, "rb") as f:
        header, data_start = _read_header(f, path)
        metadata = header.pop("__metadata__", {})
        missing = [n for n in names or () if n not in header]
        if missing:
            raise ValueError(f"{path}: no tensor named {missing[0]!r}")
        tensors = {}
        for name in names if names is not None else header:
            info = header[name]
            begin, end = info["data_offsets"]
            # A fresh buffer per tensor is aligned for its dtype, whatever the file's layout.
            raw = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(data_start + begin)
            if f.readinto(memoryview(raw.numpy())) != end - begin:
                raise _bad(path, f"tensor {name!r} is cut short")
            tensors[name] = raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors, metadata


def safetensors_specs(path):
    """{name: (shape, torch dtype)} of the tensors in a safetensors file, from its header."""
    return {
        name: (tuple(v["shape"]), _DTYPES[v["dtype"]])
        for name, v in safetensors_header(path).items()
        if name != "__metadata__"
    }
