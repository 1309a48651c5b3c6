"""Per-layer Hessian factor files: packed upper triangles in safetensors (interop).

Layout (``format = "bakron-factors"``, ``format_version = "1"``; see docs/distributed.md)
-----------------------------------------------------------------------------------------
One safetensors file holds the Kronecker factors of one layer (bare names) or of many layers
(names prefixed with ``"<layer>."``):

``hin``
    H_I (n x n) as a 1-D tensor of length n(n+1)/2: the **upper triangle packed column by
    column** -- for c = 0..n-1, for r = 0..c: ``H[r, c]``; entry (r, c), r <= c, sits at index
    ``c(c+1)/2 + r``. This is LAPACK's ``UPLO='U'`` packed storage and, for a symmetric matrix,
    the same sequence as the lower triangle read row by row (``H[torch.tril_indices(n, n)]``,
    the ``hin``/``hout`` buffers of YAQA and the ``flatH`` of QuIP#/QTIP), so such vectors load
    here unchanged and vice versa. dtype F32 or F64 (bakron writes the dtype it is given; F64
    is recommended, the solver factorises in float64 anyway).
``hout``
    H_O (m x m), packed the same way.
``hout_diag``
    Instead of ``hout``: the diagonal of a diagonal H_O as a length-m vector (the fast path: no
    m x m matrix is ever built, A_O = 0 and only the proxy error is weighted by it).

The header's ``__metadata__`` carries ``format``, ``format_version``, ``packing =
"upper-colmajor"``, and ``n_in`` / ``n_out`` (``"<layer>.n_in"`` in multi-layer files), plus any
user metadata (strings). Readers also accept a dense 2-D ``hin``/``hout`` (any symmetric
float matrix) so that unpacked exports load too.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from . import _safetensors
from ._lib import packing as _packing
from ._lib.symmetric import symmetrize
from ._validate import check_symmetric

__all__ = [
    "FactorSet", "pack_upper", "unpack_upper", "save_factors", "save_factor_collection",
    "load_factors", "list_factor_layers", "quantize_from_factors", "quantize_layer_diag_out",
    "FORMAT", "FORMAT_VERSION", "PACKING",
]

FORMAT = "bakron-factors"
FORMAT_VERSION = "1"
PACKING = _packing.PACKING


# --------------------------------------------------------------------------------------------
# packing


def pack_upper(H) -> np.ndarray:
    """Pack a symmetric (n, n) matrix into its upper triangle, column by column.

    Entry ``(r, c)`` with ``r <= c`` goes to index ``c(c+1)/2 + r`` (:mod:`bakron._lib.packing`).
    The matrix is symmetrised first (``(H + H.T) / 2``, exact for a symmetric matrix); its
    dtype is kept.
    """
    H = np.asarray(H)
    if H.ndim != 2 or H.shape[0] != H.shape[1] or H.shape[0] == 0:
        raise ValueError(f"pack_upper needs a non-empty square matrix, got shape {H.shape}")
    if H.dtype.kind != "f":
        raise TypeError(f"pack_upper needs a real float matrix, got dtype {H.dtype}")
    return np.ascontiguousarray(_packing.pack_upper(np, symmetrize(np, H)))


def unpack_upper(v, n: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack_upper`: the full symmetric (n, n) matrix (exact, dtype kept)."""
    return _packing.unpack_upper(np, np.asarray(v), n)


# --------------------------------------------------------------------------------------------
# the in-memory form


@dataclass
class FactorSet:
    """The factors of one layer as read from (or to be written to) a factor file.

    ``h_in`` is the dense (n, n) H_I; exactly one of ``h_out`` (dense (m, m)) and
    ``h_out_diag`` ((m,) vector) is set for a two-sided layer, neither for a one-sided one.
    """

    h_in: np.ndarray
    h_out: np.ndarray | None = None
    h_out_diag: np.ndarray | None = None
    metadata: dict = field(default_factory=dict)

    @property
    def n_in(self) -> int:
        return int(self.h_in.shape[0])

    @property
    def n_out(self) -> int | None:
        if self.h_out is not None:
            return int(self.h_out.shape[0])
        if self.h_out_diag is not None:
            return int(self.h_out_diag.shape[0])
        return None


def _check_float(a, name):
    if a.dtype.kind != "f":
        raise TypeError(f"{name} must be a float array, got dtype {a.dtype}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or Inf entries")


def _prepare_entries(h_in, h_out, dtype, prefix: str) -> tuple[dict, dict]:
    tensors, meta = {}, {}
    h_in = np.asarray(h_in)
    if h_in.ndim != 2:
        raise ValueError(f"h_in must be a 2-D (n, n) matrix, got shape {h_in.shape}")
    if h_in.shape[0] != h_in.shape[1] or h_in.shape[0] == 0:
        raise ValueError(f"h_in must be square and non-empty, got shape {h_in.shape}")
    _check_float(h_in, "h_in")
    check_symmetric(np, h_in.astype(np.float64), "h_in")
    dt = h_in.dtype if dtype is None else np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise TypeError(f"factor files store float32 or float64, got dtype {dt}")
    tensors[prefix + "hin"] = pack_upper(h_in).astype(dt, copy=False)
    meta[prefix + "n_in"] = str(h_in.shape[0])
    if h_out is not None:
        h_out = np.asarray(h_out)
        _check_float(h_out, "h_out")
        if h_out.ndim == 1:
            if h_out.shape[0] == 0 or np.any(h_out < 0):
                raise ValueError("a diagonal h_out must be a non-empty vector with entries >= 0")
            tensors[prefix + "hout_diag"] = h_out.astype(dt, copy=False)
        elif h_out.ndim == 2 and h_out.shape[0] == h_out.shape[1] and h_out.shape[0] > 0:
            check_symmetric(np, h_out.astype(np.float64), "h_out")
            tensors[prefix + "hout"] = pack_upper(h_out).astype(dt, copy=False)
        else:
            raise ValueError(f"h_out must be an (m, m) matrix or a length-m diagonal, got shape "
                             f"{h_out.shape}")
        meta[prefix + "n_out"] = str(h_out.shape[0])
    return tensors, meta


def _write(path, tensors, meta, metadata, overwrite):
    from ._lib.fs import atomic_save_tensors

    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    full = {"format": FORMAT, "format_version": FORMAT_VERSION, "packing": PACKING,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for k, v in (metadata or {}).items():
        if k in full or k in meta:
            raise ValueError(f"metadata key {k!r} is reserved by the factor-file format")
        full[str(k)] = str(v)
    full.update(meta)
    atomic_save_tensors(path, tensors, full)


def save_factors(path, h_in, h_out=None, *, dtype=None, metadata: Mapping | None = None,
                 overwrite: bool = False) -> None:
    """Write one layer's factors to ``path`` (safetensors, atomically).

    ``h_out`` may be an (m, m) matrix (stored packed as ``hout``), a length-m vector (a
    diagonal H_O, stored as ``hout_diag``) or ``None`` (one-sided). ``dtype`` (float32 or
    float64) converts the stored values; default: keep ``h_in``'s dtype. An existing file is
    never replaced unless ``overwrite=True``.
    """
    tensors, meta = _prepare_entries(h_in, h_out, dtype, "")
    _write(path, tensors, meta, metadata, overwrite)


def save_factor_collection(path, layers: Mapping, *, dtype=None,
                           metadata: Mapping | None = None, overwrite: bool = False) -> None:
    """Write many layers into one file: ``layers`` maps a layer name to ``(h_in, h_out)``
    (``h_out`` may be ``None`` or a diagonal vector) or to a :class:`FactorSet`; tensors are
    named ``"<layer>.hin"`` etc."""
    tensors, meta = {}, {}
    if not layers:
        raise ValueError("layers is empty")
    for name, fac in layers.items():
        if not isinstance(name, str) or not name or name.endswith("."):
            raise ValueError(f"layer names must be non-empty strings, got {name!r}")
        if isinstance(fac, FactorSet):
            h_in, h_out = fac.h_in, fac.h_out if fac.h_out is not None else fac.h_out_diag
        else:
            h_in, h_out = fac
        t, mt = _prepare_entries(h_in, h_out, dtype, name + ".")
        tensors.update(t)
        meta.update(mt)
    _write(path, tensors, meta, metadata, overwrite)


def list_factor_layers(path) -> list[str]:
    """Layer names in a factor file (``[""]`` for a single-layer file with bare names)."""
    header, _ = _safetensors.read_header(path)
    names = [k for k in header if k != "__metadata__"]
    out = set()
    for k in names:
        for suffix in ("hin",):
            if k == suffix:
                out.add("")
            elif k.endswith("." + suffix):
                out.add(k[: -len(suffix) - 1])
    if not out:
        raise ValueError(f"{path}: no 'hin' tensor: not a factor file")
    return sorted(out)


def _read_sym(arr: np.ndarray, name: str, path) -> np.ndarray:
    if arr.ndim == 1:
        try:
            return unpack_upper(arr)
        except ValueError as exc:
            raise ValueError(f"{path}: tensor {name!r}: {exc}") from None
    if arr.ndim == 2 and arr.shape[0] == arr.shape[1]:
        return arr
    raise ValueError(f"{path}: tensor {name!r} has shape {arr.shape}: expected a packed "
                     f"triangle (1-D) or a square matrix")


def load_factors(path, layer: str | None = None) -> FactorSet:
    """Read one layer's factors (dense matrices; a diagonal H_O stays a vector).

    ``layer`` selects ``"<layer>.hin"`` etc. in a multi-layer file; omit it for bare names.
    """
    header, _ = _safetensors.read_header(path)
    meta = dict(header.get("__metadata__", {}) or {})
    fmt = meta.get("format")
    if fmt is not None and fmt != FORMAT:
        raise ValueError(f"{path}: metadata format is {fmt!r}, not {FORMAT!r}")
    if meta.get("packing", PACKING) != PACKING:
        raise ValueError(f"{path}: packing {meta.get('packing')!r} is not {PACKING!r}")
    prefix = "" if not layer else layer + "."
    names = {k for k in header if k != "__metadata__"}
    want = [prefix + "hin"]
    if prefix + "hin" not in names:
        have = list_factor_layers(path) if any(k.endswith("hin") for k in names) else []
        raise KeyError(f"{path}: no tensor {prefix + 'hin'!r} (layers in this file: {have})")
    if prefix + "hout" in names and prefix + "hout_diag" in names:
        raise ValueError(f"{path}: both {prefix}hout and {prefix}hout_diag are present")
    for extra in ("hout", "hout_diag"):
        if prefix + extra in names:
            want.append(prefix + extra)
    t = _safetensors.load(path, want)
    h_in = _read_sym(t[prefix + "hin"], prefix + "hin", path)
    h_out = diag = None
    if prefix + "hout" in t:
        h_out = _read_sym(t[prefix + "hout"], prefix + "hout", path)
    if prefix + "hout_diag" in t:
        diag = t[prefix + "hout_diag"]
        if diag.ndim != 1:
            raise ValueError(f"{path}: {prefix}hout_diag must be 1-D, got shape {diag.shape}")
    for key, val in (("n_in", h_in), ("n_out", h_out if h_out is not None else diag)):
        rec = meta.get(prefix + key)
        if rec is not None and val is not None and int(rec) != val.shape[0]:
            raise ValueError(f"{path}: metadata {prefix + key} = {rec} but the tensor is "
                             f"{val.shape[0]} wide")
    return FactorSet(h_in=h_in, h_out=h_out, h_out_diag=diag, metadata=meta)


# --------------------------------------------------------------------------------------------
# solving from factors


def quantize_layer_diag_out(W, H_in, h_out_diag, *, damp: float = 0.01, tile=(16, 16), **kw):
    """:func:`bakron.quantize_layer` for a *diagonal* H_O given as its diagonal (length m).

    The same as ``quantize_layer(W, H_in, h_out_diag)``: a diagonal H_O has a unit block-LDL
    factor (``A_O = 0``), so the rounding is the one-sided rule and no m x m matrix is built;
    the two-sided proxy errors are weighted by the diagonal. The rounded weights are the same
    as ``quantize_layer(W, H_in, diag(h_out_diag))``. ``result.factor_out`` is a
    :class:`bakron.Factor` whose ``A`` is ``None`` (zero) and whose ``D``/``H`` are the
    normalised, damped diagonal as a vector.
    """
    from .layer import quantize_layer

    if len(getattr(h_out_diag, "shape", ())) != 1:
        raise ValueError(f"h_out_diag must be a vector (the diagonal of H_out), got shape "
                         f"{tuple(getattr(h_out_diag, 'shape', ()))}")
    return quantize_layer(W, H_in, h_out_diag, damp=damp, tile=tile, **kw)


def quantize_from_factors(W, factors, *, layer: str | None = None, **kwargs):
    """Quantize ``W`` with factors from a factor file (a path) or a :class:`FactorSet`.

    Keyword arguments are those of :func:`bakron.quantize_layer`. A diagonal H_O takes the
    fast path of :func:`quantize_layer_diag_out`. Numpy arrays only (move the result yourself).
    """
    from .layer import quantize_layer

    fs = factors if isinstance(factors, FactorSet) else load_factors(factors, layer)
    W = np.asarray(W)
    if W.ndim != 2:
        raise ValueError(f"W must be a 2-D array, got shape {W.shape}")
    if fs.n_in != W.shape[1]:
        raise ValueError(f"the factor file's H_in is {fs.n_in} x {fs.n_in} but W has "
                         f"{W.shape[1]} columns")
    if fs.n_out is not None and fs.n_out != W.shape[0]:
        raise ValueError(f"the factor file's H_out is {fs.n_out} wide but W has {W.shape[0]} "
                         f"rows")
    if fs.h_out_diag is not None:
        return quantize_layer_diag_out(W, fs.h_in, fs.h_out_diag, **kwargs)
    return quantize_layer(W, fs.h_in, fs.h_out, **kwargs)
