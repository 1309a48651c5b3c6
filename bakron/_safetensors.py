"""Read and write the safetensors format with numpy alone (no torch, no extra package).

Layout: an 8-byte little-endian header length N, a JSON header of N bytes mapping each name
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows),
an optional ``"__metadata__"`` dict of strings, then the raw little-endian data.

The header is validated as the reference ``safetensors`` library does before anything is
allocated: at most 100 MB, a JSON object (nesting bounded), every entry with a known dtype, a
shape of non-negative integers and integer ``data_offsets`` that are ordered, contiguous from 0,
cover exactly the data section and span dtype size x number of elements bytes.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

__all__ = ["load", "save", "read_header"]

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {v.newbyteorder("<") if v.itemsize > 1 else v: k for k, v in _DTYPES.items()}
_SIZES = {**{k: v.itemsize for k, v in _DTYPES.items()}, "BF16": 2}

#: the reference library's limit on the JSON header
MAX_HEADER_BYTES = 100_000_000
_MAX_DEPTH = 64


def _depth_ok(raw: bytes) -> bool:
    """False when brackets nest deeper than _MAX_DEPTH (json would recurse into them)."""
    if raw.count(b"[") + raw.count(b"{") <= _MAX_DEPTH:
        return True
    depth = 0
    in_str = esc = False
    for b in raw:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > _MAX_DEPTH:
                return False
        elif b in (0x5D, 0x7D):
            depth -= 1
    return True


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_header(header, data_len: int, path) -> None:
    """Raise ``ValueError`` (naming ``path`` and the tensor) unless ``header`` describes a
    well-formed data section of ``data_len`` bytes."""
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.get("__metadata__")
    if meta is not None and (not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise ValueError(f"{path}: corrupt safetensors header (__metadata__ must map strings "
                         f"to strings)")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue

        def bad(problem):
            return ValueError(f"{path}: corrupt safetensors header: tensor {name!r}: {problem}")
        if not isinstance(info, dict):
            raise bad("the header entry is not an object")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dt not in _SIZES:
            raise bad(f"unsupported dtype {dt!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"shape {shape!r} must be a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs)
                or offs[0] < 0 or offs[1] < offs[0]):
            raise bad(f"data_offsets {offs!r} must be two ordered non-negative integers")
        nbytes = _SIZES[dt]
        for d in shape:
            nbytes *= d
        if offs[1] - offs[0] != nbytes:
            raise bad(f"data_offsets {offs} span {offs[1] - offs[0]} bytes but dtype {dt} x "
                      f"shape {shape} needs {nbytes}")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    end, name = 0, None
    for b, e, name in spans:
        if b != end:
            raise ValueError(f"{path}: corrupt safetensors header: tensor {name!r}: data_offsets "
                             f"start at {b}, expected {end} (tensors must be contiguous and not "
                             f"overlap)")
        end = e
    if end > data_len:
        raise ValueError(f"{path}: tensor {name!r} is truncated: the header describes {end} "
                         f"bytes of data but the file holds {data_len}")
    if end < data_len:
        raise ValueError(f"{path}: corrupt safetensors file: {data_len - end} bytes after the "
                         f"last tensor's data (the header describes {end})")


def read_header(path) -> tuple[dict, int]:
    """The validated JSON header and the byte offset where the data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (header length {n} is invalid "
                             f"for a file of {size} bytes; the limit is {MAX_HEADER_BYTES})")
        raw = f.read(n)
    if not _depth_ok(raw):
        raise ValueError(f"{path}: corrupt safetensors header (JSON nested deeper than "
                         f"{_MAX_DEPTH} levels)")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: corrupt safetensors header ({exc})") from None
    validate_header(header, size - 8 - n, path)
    return header, 8 + n


def load(path, names=None) -> dict[str, np.ndarray]:
    """Load tensors (all, or those in ``names``) as numpy arrays; BF16 becomes float32."""
    header, start = read_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            dt, shape = info["dtype"], tuple(info["shape"])
            begin, end = info["data_offsets"]
            f.seek(start + begin)
            raw = f.read(end - begin)
            if len(raw) != end - begin:
                raise ValueError(f"{path}: tensor {name!r} is truncated")
            if dt == "BF16":
                u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
                arr = u.view(np.float32).reshape(shape)
            elif dt in _DTYPES:
                arr = np.frombuffer(raw, dtype=_DTYPES[dt]).reshape(shape)
            else:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dt}")
            out[name] = arr.copy()
    if names is not None:
        missing = [n for n in names if n not in out]
        if missing:
            raise KeyError(f"{path}: no tensor named {missing}")
    return out


def metadata(path) -> dict:
    return read_header(path)[0].get("__metadata__", {}) or {}


def save(path, tensors: dict, metadata: dict | None = None, bf16=()) -> None:
    """Write ``tensors`` (name -> numpy array) to ``path`` (plain write; callers that need
    atomicity write to a temporary name and rename). Names in ``bf16`` hold uint16 arrays of
    bfloat16 bit patterns and are stored as BF16."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        key = a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype
        if key not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
        b = a.astype(key, copy=False).tobytes()
        dt = _NAMES[key]
        if name in bf16:
            if a.dtype != np.uint16:
                raise ValueError(f"tensor {name!r}: BF16 data must be uint16 bit patterns")
            dt = "BF16"
        header[name] = {"dtype": dt, "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
