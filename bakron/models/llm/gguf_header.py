"""The header of a GGUF file read with every length, count and offset checked.

A GGUF file is: magic ``GGUF``, version (2 or 3), the tensor count, the metadata count, the
metadata (key, type, value), the tensor table (name, dimensions, GGML type, data offset), then
the tensor data, aligned to ``general.alignment`` (32 by default). The ``gguf`` package's
reader trusts these numbers (an array length beyond the file makes it loop; a tensor offset
may point anywhere), so bakron reads the header itself:

- every count and length is checked against the bytes left before it is used;
- nested arrays, unknown value types, duplicate keys or tensor names, more than 4 dimensions
  are refused;
- each tensor's size is its GGML type's block size x shape (the first dimension a multiple of
  the block size), and its data offset is the one llama.cpp's reader requires: the tensors
  follow each other in table order, each starting at the previous one's end rounded up to the
  alignment. So no two tensors overlap, none starts misaligned, and all lie inside the data
  section (the file must hold the last tensor's end).

Errors are :class:`~bakron.models.llm.schema.ModelFileError` naming the file and the key or
tensor; a big-endian file is an :class:`~bakron.models.llm.config.UnsupportedModelError`.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

from .schema import ModelFileError

__all__ = ["GGUFTensor", "GGUFHeader", "read_header", "type_name", "MAX_TENSORS", "MAX_KV"]

#: the most tensors and metadata entries a header may declare
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
_MAX_DIMS = 4

# GGUF value types: (struct code, size); 8 string, 9 array
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
            6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table: ``shape`` in numpy order (GGUF lists the dimensions
    innermost first), ``start``/``nbytes`` the absolute byte range of its data."""

    name: str
    shape: tuple
    ggml_type: int
    start: int
    nbytes: int


@dataclass
class GGUFHeader:
    """What :func:`read_header` returns: ``metadata`` {key: Python value (lists for
    arrays)}, ``types`` {key: GGUF value type}, ``tensors`` (table order), ``alignment``,
    ``data_start`` and the file ``size``."""

    metadata: dict
    types: dict
    tensors: list
    alignment: int
    data_start: int
    size: int


class _Cursor:
    def __init__(self, buf, size, source):
        self.buf, self.size, self.pos, self.source = buf, size, 0, source

    def need(self, n: int, what: str):
        if n < 0 or self.pos + n > self.size:
            raise ModelFileError(f"{self.source}: {what} runs past the end of the file "
                                 f"(needs {n} bytes at offset {self.pos}, the file has "
                                 f"{self.size}); the file is corrupt or truncated")

    def unpack(self, code: str, size: int, what: str):
        self.need(size, what)
        v = struct.unpack_from("<" + code, self.buf, self.pos)[0]
        self.pos += size
        return v

    def string(self, what: str, *, strict: bool) -> str:
        n = self.unpack("Q", 8, what)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        if not strict:
            return raw.decode("utf-8", errors="replace")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{self.source}: {what} is not valid UTF-8 ({raw[:40]!r})"
                                 ) from None


def _value(cur: _Cursor, vtype: int, key: str):
    if vtype in _SCALARS:
        code, size = _SCALARS[vtype]
        v = cur.unpack(code, size, f"metadata {key!r}")
        if vtype == 6:   # the shortest decimal: 1e-5 stored as float32 reads 1e-05
            return float(str(np.float32(v)))
        return v
    if vtype == _STRING:
        return cur.string(f"metadata {key!r}", strict=False)
    if vtype == _ARRAY:
        itype = cur.unpack("I", 4, f"metadata {key!r}")
        n = cur.unpack("Q", 8, f"metadata {key!r}")
        if itype == _ARRAY:
            raise ModelFileError(f"{cur.source}: metadata {key!r} is an array of arrays, "
                                 f"which GGUF readers do not support")
        if itype in _SCALARS:
            size = _SCALARS[itype][1]
            cur.need(n * size, f"metadata {key!r} ({n} elements)")
            a = np.frombuffer(cur.buf, dtype=_NUMPY[itype], count=n, offset=cur.pos)
            cur.pos += n * size
            if itype == 6:
                return [float(str(x)) for x in a]
            return a.tolist()
        if itype == _STRING:
            cur.need(n * 8, f"metadata {key!r} ({n} strings)")   # each has an 8-byte length
            return [cur.string(f"metadata {key!r}[{i}]", strict=False) for i in range(n)]
        raise ModelFileError(f"{cur.source}: metadata {key!r} is an array of unknown value "
                             f"type {itype}")
    raise ModelFileError(f"{cur.source}: metadata {key!r} has unknown value type {vtype}")


def _ggml_sizes():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): GGML_QUANT_SIZES[t] for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


def type_name(t: GGUFTensor) -> str:
    """The ``gguf`` package's name of the tensor's stored type (``"F32"``, ``"Q4_0"``, ...);
    :func:`read_header` has checked that the type is one it knows."""
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(t.ggml_type).name


def read_header(path, source: str | None = None) -> GGUFHeader:
    """The checked header of the GGUF file ``path`` (see the module docstring)."""
    from .config import UnsupportedModelError

    source = source or str(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ModelFileError(f"{source} is not a readable GGUF file (only {size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, size, source, UnsupportedModelError)


def _parse(buf, size, source, unsupported) -> GGUFHeader:
    cur = _Cursor(buf, size, source)
    if bytes(buf[:4]) != b"GGUF":
        raise ModelFileError(f"{source} is not a readable GGUF file (its first bytes are "
                             f"{bytes(buf[:4])!r}, not b'GGUF')")
    cur.pos = 4
    version = cur.unpack("I", 4, "the version")
    if version & 0xFFFF == 0 and version:
        raise unsupported(f"{source} is a big-endian GGUF file; only little-endian files "
                          f"are supported")
    if version not in (2, 3):
        raise unsupported(f"{source}: GGUF version {version} is not supported (2 or 3)")
    n_tensors = cur.unpack("Q", 8, "the tensor count")
    n_kv = cur.unpack("Q", 8, "the metadata count")
    if n_tensors > MAX_TENSORS or n_tensors * 24 > size:
        raise ModelFileError(f"{source}: the header declares {n_tensors} tensors, more than "
                             f"the file can hold; the file is corrupt")
    if n_kv > MAX_KV or n_kv * 13 > size:
        raise ModelFileError(f"{source}: the header declares {n_kv} metadata entries, more "
                             f"than the file can hold; the file is corrupt")
    meta, types = {}, {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}", strict=True)
        if key in meta:
            raise ModelFileError(f"{source}: metadata key {key!r} appears twice")
        vtype = cur.unpack("I", 4, f"metadata {key!r}")
        types[key] = vtype
        meta[key] = _value(cur, vtype, key)
    alignment = meta.get("general.alignment", 32)
    if "general.alignment" in meta and (types["general.alignment"] != 4 or alignment <= 0
                                        or alignment & (alignment - 1)):
        raise ModelFileError(f"{source}: general.alignment must be a power of two stored as "
                             f"uint32, got {alignment!r}")
    sizes = _ggml_sizes()
    table = []
    names = set()
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}", strict=True)
        if name in names:
            raise ModelFileError(f"{source}: tensor {name!r} appears twice in the tensor table")
        names.add(name)
        n_dims = cur.unpack("I", 4, f"tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelFileError(f"{source}: tensor {name!r} has {n_dims} dimensions (1 to "
                                 f"{_MAX_DIMS} allowed)")
        dims = [cur.unpack("Q", 8, f"tensor {name!r}") for _ in range(n_dims)]
        ggml_type = cur.unpack("I", 4, f"tensor {name!r}")
        offset = cur.unpack("Q", 8, f"tensor {name!r}")
        if ggml_type not in sizes:
            raise unsupported(f"{source}: tensor {name!r} has unknown GGML type {ggml_type}")
        table.append((name, dims, ggml_type, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors, expected = [], 0
    for name, dims, ggml_type, offset in table:
        block, type_size = sizes[ggml_type]
        n = 1
        for d in dims:
            n *= d
        if dims[0] % block:
            raise ModelFileError(f"{source}: tensor {name!r} has {dims[0]} elements per row, "
                                 f"not a multiple of its type's block of {block}")
        nbytes = n // block * type_size
        if offset != expected:
            why = (f"it is not a multiple of the alignment ({alignment})" if offset % alignment
                   else "its data would overlap the tensors before it" if offset < expected
                   else "it leaves a gap after the tensor before it")
            raise ModelFileError(
                f"{source}: tensor {name!r} has data offset {offset}, expected {expected}: "
                f"{why} (tensors follow each other in table order, each aligned to "
                f"{alignment} bytes, as llama.cpp requires); the file is corrupt or was "
                f"tampered with")
        end = data_start + offset + nbytes
        if end > size:
            raise ModelFileError(f"{source}: tensor {name!r} needs bytes up to offset {end} "
                                 f"but the file has {size}; the file is truncated")
        tensors.append(GGUFTensor(name, tuple(int(d) for d in reversed(dims)), ggml_type,
                                  data_start + offset, nbytes))
        expected = offset + -(-nbytes // alignment) * alignment
    return GGUFHeader(meta, types, tensors, int(alignment), data_start, size)
