"""Layer jobs: file references, canonical settings, content checksums and deterministic keys.

A job names files, never arrays, so that it pickles to a few hundred bytes and any worker that
sees the same file system can run it. Its key is the SHA-256 of the checksums of its input
tensors, its canonical settings, the bakron version and the job format version.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

__all__ = ["TensorRef", "LayerJob", "DEFAULT_SETTINGS", "canonical_settings", "tensor_checksum",
           "load_tensor", "job_key", "jobs_from_path", "safe_file_name", "JOB_FORMAT",
           "tensor_info", "stack_key"]

#: bump when the meaning of a key changes (the layer-file layout or the settings' semantics)
JOB_FORMAT = 1

#: every solve setting and its default; a job's settings are completed with these before
#: hashing, so that passing a default explicitly gives the same key as leaving it out
DEFAULT_SETTINGS: dict[str, Any] = {
    "bits": 4, "tile": [16, 16], "method": "auto", "engine": "auto", "damp": 0.01,
    "symmetric": True, "granularity": "row", "group_size": None, "scale_method": "rms",
    "device": "auto", "dtype": None, "one_sided": False, "file_format": "safetensors",
}
_CHOICES = {
    "method": ("auto", "naive", "antidiagonal", "recursive"),
    "engine": ("auto", "array_api", "numba", "cuda"),
    "granularity": ("tensor", "row", "group"),
    "scale_method": None,  # validated by UniformQuantizer.fit
    "device": ("auto", "cpu", "gpu"),
    "dtype": (None, "float32", "float64"),
    "file_format": ("safetensors", "npz"),
}


def canonical_settings(settings: Mapping | None = None) -> dict:
    """Settings completed with :data:`DEFAULT_SETTINGS`, validated and JSON-normalised."""
    s = dict(DEFAULT_SETTINGS)
    for k, v in (settings or {}).items():
        if k not in DEFAULT_SETTINGS:
            raise ValueError(f"unknown setting {k!r}; known settings: {sorted(DEFAULT_SETTINGS)}")
        s[k] = v
    try:
        bits = int(s["bits"])
    except Exception:
        raise ValueError(f"bits must be an integer in 2..8, got {s['bits']!r}") from None
    if bits != s["bits"] or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 2..8, got {s['bits']!r}")
    s["bits"] = bits
    t = s["tile"]
    if isinstance(t, (int, np.integer)):
        t = [int(t), int(t)]
    try:
        t = [int(x) for x in t]
    except Exception:
        raise ValueError(f"tile must be an int or a pair, got {s['tile']!r}") from None
    if len(t) != 2 or min(t) < 1:
        raise ValueError(f"tile must be an int or a pair of positive ints, got {s['tile']!r}")
    s["tile"] = t
    d = float(s["damp"])
    if not d >= 0 or d != d:
        raise ValueError(f"damp must be >= 0, got {s['damp']!r}")
    s["damp"] = d
    s["symmetric"] = bool(s["symmetric"])
    s["one_sided"] = bool(s["one_sided"])
    if s["device"] == "cuda":
        s["device"] = "gpu"
    if s["group_size"] is not None:
        g = int(s["group_size"])
        if g != s["group_size"] or g < 1:
            raise ValueError(f"group_size must be a positive integer, got {s['group_size']!r}")
        s["group_size"] = g
    if s["granularity"] == "group" and s["group_size"] is None:
        raise ValueError("granularity='group' needs group_size")
    for k, allowed in _CHOICES.items():
        if allowed is not None and s[k] not in allowed:
            raise ValueError(f"{k} must be one of {allowed}, got {s[k]!r}")
    return s


def safe_file_name(name: str) -> str:
    """A file-system-safe, collision-free stem for a layer name."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "layer"
    if stem != name or len(stem) > 120:
        stem = stem[:100] + "-" + hashlib.sha256(name.encode()).hexdigest()[:10]
    return stem


@dataclass(frozen=True)
class TensorRef:
    """One tensor in a file: ``path`` (.safetensors, .npz or .npy) and the tensor ``name`` in
    it (``None`` for .npy). ``TensorRef.parse("file.safetensors::model.w")`` also works."""

    path: str
    name: str | None = None

    @classmethod
    def parse(cls, ref) -> "TensorRef":
        if isinstance(ref, TensorRef):
            return ref
        if isinstance(ref, (tuple, list)) and len(ref) == 2:
            return cls(os.path.abspath(os.fspath(ref[0])), ref[1])
        if isinstance(ref, (str, os.PathLike)):
            s = os.fspath(ref)
            if "::" in s:
                p, n = s.rsplit("::", 1)
                return cls(os.path.abspath(p), n)
            return cls(os.path.abspath(s), None)
        raise TypeError(f"a tensor reference is a path, 'path::name', (path, name) or a "
                        f"TensorRef, got {type(ref).__name__}")

    def __str__(self) -> str:
        return self.path if self.name is None else f"{self.path}::{self.name}"


@dataclass(frozen=True)
class LayerJob:
    """A layer to quantize: file references and settings (no arrays).

    ``H_out`` may be absent (one-sided), a square matrix, a packed upper triangle (1-D,
    m(m+1)/2) or a diagonal (1-D, length m: the fast path). ``H_in`` may be a square matrix
    or a packed triangle (see :mod:`bakron.factor_files`).
    """

    name: str
    W: TensorRef
    H_in: TensorRef
    H_out: TensorRef | None = None
    settings: dict = field(default_factory=dict)

    @classmethod
    def make(cls, name: str, W, H_in, H_out=None, **settings) -> "LayerJob":
        if not isinstance(name, str) or not name:
            raise ValueError(f"a job name must be a non-empty string, got {name!r}")
        return cls(name=name, W=TensorRef.parse(W), H_in=TensorRef.parse(H_in),
                   H_out=None if H_out is None else TensorRef.parse(H_out),
                   settings=canonical_settings(settings))

    def inputs(self) -> dict[str, TensorRef]:
        d = {"W": self.W, "H_in": self.H_in}
        if self.H_out is not None:
            d["H_out"] = self.H_out
        return d


# --------------------------------------------------------------------------------------------
# reading tensors and their checksums
#
# The checksum of a tensor is sha256 over "<numpy dtype str>|<shape>|" followed by the stored
# little-endian bytes, so that the same array has the same checksum in .npy, .npz and
# .safetensors files (BF16, which numpy lacks, is tagged "bf16").

_ST_DTYPE = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
             "I8": "|i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "|u1", "BOOL": "|b1",
             "BF16": "bf16"}
_CHUNK = 8 * 2**20


def _tag(dtype_str: str, shape) -> bytes:
    return f"{dtype_str}|{','.join(str(int(s)) for s in shape)}|".encode()


def _np_canonical(a: np.ndarray) -> tuple[str, np.ndarray]:
    dt = a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype
    return dt.str, np.ascontiguousarray(a.astype(dt, copy=False))


def _safetensors_entry(path: str, name: str):
    from .. import _safetensors

    header, start = _safetensors.read_header(path)
    if name is None:
        names = [k for k in header if k != "__metadata__"]
        if len(names) != 1:
            raise ValueError(f"{path}: holds {len(names)} tensors; name one with "
                             f"'{path}::NAME' (tensors: {sorted(names)[:8]}...)")
        name = names[0]
    info = header.get(name)
    if info is None or name == "__metadata__":
        raise KeyError(f"{path}: no tensor named {name!r}")
    dt = info["dtype"]
    if dt not in _ST_DTYPE:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dt}")
    b, e = info["data_offsets"]
    return _ST_DTYPE[dt], tuple(info["shape"]), start + b, e - b


def _kind(path: str) -> str:
    low = path.lower()
    for ext in (".safetensors", ".npz", ".npy"):
        if low.endswith(ext):
            return ext
    raise ValueError(f"{path}: unsupported file type (use .safetensors, .npz or .npy)")


def _load_np(ref: TensorRef) -> np.ndarray:
    kind = _kind(ref.path)
    if kind == ".npy":
        if ref.name is not None:
            raise ValueError(f"{ref.path}: a .npy file holds one array; drop '::{ref.name}'")
        return np.load(ref.path, mmap_mode="r", allow_pickle=False)
    from ..io import npz_names, read_npz  # the one bounded, pickle-free npz reader

    name = ref.name
    if name is None:
        files = npz_names(ref.path)
        if len(files) != 1:
            raise ValueError(f"{ref.path}: holds {len(files)} arrays; name one with "
                             f"'{ref.path}::NAME' (arrays: {files})")
        name = files[0]
    return read_npz(ref.path, [name])[name]


def load_tensor(ref: TensorRef) -> tuple[np.ndarray, str]:
    """Read a tensor: ``(array, checksum)``; BF16 becomes float32 (the checksum is over the
    stored bytes)."""
    ref = TensorRef.parse(ref)
    if not os.path.isfile(ref.path):
        raise FileNotFoundError(f"input file not found: {ref.path}")
    if _kind(ref.path) == ".safetensors":
        dts, shape, off, nbytes = _safetensors_entry(ref.path, ref.name)
        with open(ref.path, "rb") as f:
            f.seek(off)
            raw = f.read(nbytes)
        if len(raw) != nbytes:
            raise ValueError(f"{ref}: tensor data is truncated")
        digest = "sha256:" + hashlib.sha256(_tag(dts, shape) + raw).hexdigest()
        if dts == "bf16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32).reshape(shape)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(dts)).reshape(shape).copy()
        return arr, digest
    a = _load_np(ref)
    dts, c = _np_canonical(np.asarray(a))
    h = hashlib.sha256(_tag(dts, c.shape))
    h.update(memoryview(c).cast("B"))
    return np.array(c), "sha256:" + h.hexdigest()


def tensor_shape(ref: TensorRef) -> tuple:
    """A tensor's shape from its file's header, without reading the data."""
    ref = TensorRef.parse(ref)
    if not os.path.isfile(ref.path):
        raise FileNotFoundError(f"input file not found: {ref.path}")
    if _kind(ref.path) == ".safetensors":
        return _safetensors_entry(ref.path, ref.name)[1]
    return tuple(_load_np(ref).shape)


def tensor_info(ref: TensorRef) -> tuple[tuple, str]:
    """A tensor's ``(shape, dtype)`` (safetensors: from the header, without reading the
    data)."""
    ref = TensorRef.parse(ref)
    if not os.path.isfile(ref.path):
        raise FileNotFoundError(f"input file not found: {ref.path}")
    if _kind(ref.path) == ".safetensors":
        dts, shape, _, _ = _safetensors_entry(ref.path, ref.name)
        return tuple(shape), dts
    a = _load_np(ref)
    return tuple(a.shape), np.dtype(a.dtype).str


def stack_key(job: LayerJob):
    """Jobs with equal keys may run as one stack (docs/distributed.md "Stacks"): the same
    settings, W's shape and stored dtype, and kind of output factor as the solve uses it
    (none: one-sided or ``one_sided``; a diagonal; a matrix). ``(key, estimated bytes)``."""
    from ..layer_groups import layer_bytes

    s = canonical_settings(job.settings)
    shape, dts = tensor_info(job.W)
    if len(shape) != 2:
        raise ValueError(f"W must be 2-D, got shape {shape}")
    m, n = shape
    kind = "none"
    if job.H_out is not None and not s["one_sided"]:
        o_shape = tensor_info(job.H_out)[0]
        kind = "diag" if len(o_shape) == 1 and o_shape[0] == m else "dense"
    key = (json.dumps(s, sort_keys=True), tuple(shape), dts, kind)
    return key, layer_bytes(m, n, job.H_out is not None)


_CACHE: dict = {}


def tensor_checksum(ref: TensorRef) -> str:
    """The checksum of a tensor without decoding it (safetensors: hashed from the file in
    chunks). Memoised per (path, name, size, mtime, inode) within the process."""
    ref = TensorRef.parse(ref)
    try:
        st = os.stat(ref.path)
    except FileNotFoundError:
        raise FileNotFoundError(f"input file not found: {ref.path}") from None
    ck = (ref.path, ref.name, st.st_size, st.st_mtime_ns, st.st_ino)
    hit = _CACHE.get(ck)
    if hit is not None:
        return hit
    if _kind(ref.path) == ".safetensors":
        dts, shape, off, nbytes = _safetensors_entry(ref.path, ref.name)
        h = hashlib.sha256(_tag(dts, shape))
        with open(ref.path, "rb") as f:
            f.seek(off)
            left = nbytes
            while left:
                b = f.read(min(_CHUNK, left))
                if not b:
                    raise ValueError(f"{ref}: tensor data is truncated")
                h.update(b)
                left -= len(b)
        digest = "sha256:" + h.hexdigest()
    else:
        digest = load_tensor(ref)[1]
    _CACHE[ck] = digest
    return digest


def job_key(job: LayerJob, checksums: Mapping[str, str] | None = None) -> str:
    """The deterministic key of a job (hex SHA-256)."""
    from .. import __version__

    if checksums is None:
        checksums = {k: tensor_checksum(r) for k, r in job.inputs().items()}
    settings = canonical_settings(job.settings)
    if settings["file_format"] == "safetensors":  # the default keeps the keys made before the
        del settings["file_format"]               # setting existed (resumable folders)
    doc = {"job_format": JOB_FORMAT, "bakron": __version__,
           "inputs": {k: checksums[k] for k in sorted(job.inputs())},
           "settings": settings}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


# --------------------------------------------------------------------------------------------
# jobs from a file or folder (the `bakron quantize IN` convention)

_W_NAMES = ("W", "weight")
_HIN_NAMES = ("H_in", "hin")
_HOUT_NAMES = ("H_out", "hout", "hout_diag")


def _names_in(path: str) -> list[str]:
    kind = _kind(path)
    if kind == ".safetensors":
        from .. import _safetensors

        return [k for k in _safetensors.read_header(path)[0] if k != "__metadata__"]
    if kind == ".npz":
        from ..io import npz_names

        return npz_names(path)
    raise ValueError(f"{path}: a layer file is .npz or .safetensors")


def _pick(path: str, names: list[str], options, what: str, required: bool):
    found = [n for n in options if n in names]
    if len(found) > 1:
        raise ValueError(f"{path}: ambiguous {what}: both {found[0]!r} and {found[1]!r} present")
    if not found:
        if required:
            raise ValueError(f"{path}: no {what} tensor (looked for {list(options)}; found "
                             f"{names})")
        return None
    return TensorRef(os.path.abspath(path), found[0])


def jobs_from_path(in_path, **settings) -> list[LayerJob]:
    """Jobs for ``bakron quantize IN``: IN is a layer file (.npz/.safetensors holding ``W``
    and ``H_in``, optionally ``H_out``; the names ``weight``/``hin``/``hout``/``hout_diag`` of
    factor files are accepted too) or a folder of such files (one layer each, named by the file
    stem, sorted). ``settings`` are the solve settings shared by all layers."""
    in_path = os.path.abspath(os.fspath(in_path))
    if os.path.isdir(in_path):
        files = sorted(f for f in os.listdir(in_path)
                       if f.lower().endswith((".npz", ".safetensors")) and not f.startswith("."))
        if not files:
            raise ValueError(f"{in_path}: no .npz or .safetensors layer files in this folder")
        paths = [os.path.join(in_path, f) for f in files]
    elif os.path.isfile(in_path):
        paths = [in_path]
    else:
        raise FileNotFoundError(f"input not found: {in_path}")
    jobs, seen = [], {}
    for p in paths:
        names = _names_in(p)
        name = os.path.basename(p).rsplit(".", 1)[0]
        if name in seen:
            raise ValueError(f"two input files give the layer name {name!r}: {seen[name]} and "
                             f"{p}")
        seen[name] = p
        jobs.append(LayerJob.make(
            name, _pick(p, names, _W_NAMES, "weight (W)", True),
            _pick(p, names, _HIN_NAMES, "input Hessian (H_in)", True),
            _pick(p, names, _HOUT_NAMES, "output Hessian (H_out)", False), **settings))
    return jobs
