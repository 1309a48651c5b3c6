"""Read and write the safetensors format with numpy alone (no torch, no extra package).

Layout: an 8-byte little-endian header length N, a JSON header of N bytes mapping each name
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows),
an optional ``"__metadata__"`` dict of strings, then the raw little-endian data.
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


def read_header(path) -> tuple[dict, int]:
    """The JSON header and the byte offset where the data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8 or n > 100 * 2**20:
            raise ValueError(f"{path}: not a safetensors file (header length {n} is invalid)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"{path}: corrupt safetensors header ({exc})") from None
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
