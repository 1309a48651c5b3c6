"""Quantizers: the scalar uniform grid (docs/conventions.md) and the tile-quantizer protocol.

A *tile quantizer* is any object with a method

    quantize(targets) -> (values, codes)

that rounds a batch of tiles ``targets`` of shape ``(k, t_x, t_y)``; ``values`` has the same
shape, ``codes`` is an integer array of the same shape or ``None``. A quantizer whose
``quantize`` also accepts keyword arguments ``rows`` and ``cols`` receives, for each tile of
the batch, the index of its first row and first column in W (integer arrays of shape ``(k,)``
in the targets' namespace) — needed by grids with per-row or per-group scales. The solvers call
``quantize`` once per batch of independent tiles, never per element.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from . import _xp
from ._validate import check_array_kind, check_bits, check_int

__all__ = ["TileQuantizer", "UniformQuantizer", "rms_step"]

# Step of the MSE-optimal uniform quantizer of a unit Gaussian with 2**b levels (Max 1960);
# ``fit(method="rms")`` uses step = factor * RMS.
_GAUSS_STEP = {1: 1.596, 2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881, 6: 0.1041, 7: 0.0569, 8: 0.0308}


def rms_step(bits: int) -> float:
    """Step size, in units of the RMS, of the MSE-optimal uniform grid for Gaussian weights."""
    return _GAUSS_STEP[check_bits(bits)]


@runtime_checkable
class TileQuantizer(Protocol):
    def quantize(self, targets):  # pragma: no cover - protocol
        ...


def _as_table(scale, name: str, m: int | None, n: int | None, group_size: int | None):
    """Normalise a scale/zero-point spec to a 2-D numpy table (R, G) with R in {1, m}."""
    if hasattr(scale, "shape") and hasattr(scale, "dtype"):
        check_array_kind(scale, name)
        if "complex" in str(scale.dtype):
            raise TypeError(f"{name} has the complex dtype {scale.dtype}; it must be real")
        raw = _xp.to_numpy(scale)
    else:
        raw = scale
    if isinstance(raw, (str, bytes)) or np.iscomplexobj(raw):
        raise TypeError(f"{name} must be a real number or array, got {raw!r}")
    try:
        a = np.array(raw, dtype=np.float64)  # a copy: later changes by the caller do not leak in
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number or array, got {type(raw).__name__} "
                        f"{raw!r}") from None
    if a.ndim == 0:
        return a.reshape(1, 1)
    if a.ndim == 1:
        if m is not None and a.shape[0] != m:
            raise ValueError(f"{name} has shape {a.shape} but W has {m} rows; a per-row {name} "
                             f"must have shape ({m},)")
        return a.reshape(-1, 1)
    if a.ndim == 2:
        if group_size is None:
            raise ValueError(f"{name} is 2-D (per-group) but group_size is not set")
        if m is not None and n is not None:
            groups = -(-n // group_size)
            if a.shape != (m, groups):
                raise ValueError(
                    f"{name} has shape {a.shape} but W is {m} x {n} with group_size {group_size}, "
                    f"so a per-group {name} must have shape ({m}, {groups})")
        return a
    raise ValueError(f"{name} must be a scalar, a per-row vector or a per-group matrix, "
                     f"got {a.ndim} dimensions")


class UniformQuantizer:
    """Scalar uniform grid with ``bits`` bits (docs/conventions.md).

    Symmetric codes ``c = clip(round(t/s), -2**(b-1), 2**(b-1)-1)`` with value ``s*c``;
    asymmetric codes ``c = clip(round(t/s) + z, 0, 2**b - 1)`` with value ``s*(c - z)``.
    Ties round half to even. ``scale`` (and ``zero_point``) is a scalar, a per-row vector
    ``(m,)`` or a per-group matrix ``(m, ceil(n / group_size))``. The solver never changes it.
    """

    def __init__(self, bits, scale, *, symmetric: bool = True, zero_point=None,
                 group_size: int | None = None):
        self.bits = check_bits(bits)
        self.symmetric = bool(symmetric)
        self.group_size = None if group_size is None else check_int(group_size, "group_size",
                                                                     minimum=1)
        self._scale = _as_table(scale, "scale", None, None, self.group_size)
        self._per_group = len(getattr(scale, "shape", np.shape(scale))) == 2
        if not np.all(np.isfinite(self._scale)) or np.any(self._scale <= 0):
            raise ValueError("scale must be finite and > 0 everywhere")
        if self.symmetric:
            if zero_point is not None:
                raise ValueError("zero_point is only used with symmetric=False")
            self._zero = None
        else:
            zp = 2 ** (self.bits - 1) if zero_point is None else zero_point
            self._zero = _as_table(zp, "zero_point", None, None, self.group_size)
            if not np.all(np.isfinite(self._zero)):
                raise ValueError("zero_point must be finite")
        # copies, so that the caller may change its arrays afterwards
        self.scale = _copy(scale)
        self.zero_point = _copy(zero_point)
        self._cache: dict = {}

    # -- description -------------------------------------------------------------------
    @property
    def code_range(self) -> tuple[int, int]:
        if self.symmetric:
            return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1
        return 0, 2 ** self.bits - 1

    @property
    def granularity(self) -> str:
        if self._per_group:
            return "group"
        return "row" if self._scale.shape[0] > 1 else "tensor"

    def __repr__(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        gs = f", group_size={self.group_size}" if self.group_size else ""
        return f"UniformQuantizer(bits={self.bits}, {kind}, {self.granularity} scale{gs})"

    def check_shape(self, m: int, n: int) -> None:
        """Raise ``ValueError`` if the scale (or zero point) does not fit an m x n matrix."""
        for name, tab in (("scale", self._scale), ("zero_point", self._zero)):
            if tab is None or tab.shape == (1, 1):
                continue
            r, g = tab.shape
            if r not in (1, m):
                raise ValueError(f"{name} has {r} rows but W has {m} rows; a per-row {name} "
                                 f"must have shape ({m},)")
            if self._per_group:
                groups = -(-n // self.group_size)
                if (r, g) != (m, groups):
                    raise ValueError(
                        f"{name} has shape {(r, g)} but W is {m} x {n} with group_size "
                        f"{self.group_size}, so a per-group {name} must have shape "
                        f"({m}, {groups})")

    def check_dtype(self, dtype) -> None:
        """Raise ``ValueError`` if a scale is 0 or infinite (or a zero point not finite) once
        cast to ``dtype``, the working dtype of W: valid float64 scales can underflow or
        overflow in float32."""
        dt = np.dtype(str(dtype).split(".")[-1]) if not isinstance(dtype, np.dtype) else dtype
        with np.errstate(over="ignore", under="ignore"):
            s = self._scale.astype(dt)
            z = None if self._zero is None else self._zero.astype(dt)
        bad = ~np.isfinite(s) | (s <= 0)
        if np.any(bad):
            i = tuple(int(v) for v in np.argwhere(bad)[0])
            raise ValueError(f"scale has {int(bad.sum())} entr{'y' if bad.sum() == 1 else 'ies'} "
                             f"that {'is' if bad.sum() == 1 else 'are'} 0 or infinite in W's "
                             f"dtype {dt} (e.g. {self._scale[i]:.3g} at table index {i}); use "
                             f"scales representable in {dt} or compute in float64")
        if z is not None and not np.all(np.isfinite(z)):
            raise ValueError(f"zero_point is not finite in W's dtype {dt}")

    # -- tables in the caller's namespace ------------------------------------------------
    def tables(self, xp, device, dtype):
        """(scale, zero or None) as 2-D arrays of ``dtype`` in ``xp`` on ``device``."""
        key = (xp.__name__, str(device), str(dtype))
        hit = self._cache.get(key)
        if hit is None:
            s = xp.asarray(self._scale, dtype=dtype, device=device)
            z = None if self._zero is None else xp.asarray(self._zero, dtype=dtype, device=device)
            hit = self._cache[key] = (s, z)
        return hit

    def table_kind(self) -> tuple:
        """What a compiled engine needs equal across the items of a stack that it rounds
        with stacked tables: symmetric or not, the code range, the group size and the
        tables' shapes."""
        return (self.symmetric, self.code_range, self.group_size or 1, self._scale.shape,
                None if self._zero is None else self._zero.shape)

    @staticmethod
    def stacked_tables(quantizers, xp, device, dtype):
        """``(scale, zero or None)`` of ``quantizers`` (one :meth:`table_kind`) as arrays
        ``(k, r, g)`` of ``dtype`` in ``xp`` on ``device``, item ``i`` equal to
        ``quantizers[i].tables(...)``: stacked on the host and copied over once (one copy
        per quantizer took 128 transfers for an MoE stack); cast on the host when ``dtype``
        is a numpy dtype (half the bytes to copy for float32)."""
        try:
            host = np.dtype(dtype)
        except TypeError:  # another library's dtype object: cast where the array lands
            host = None
        s = np.stack([q._scale for q in quantizers], dtype=host)
        zs = [q._zero for q in quantizers]
        z = None if zs[0] is None else np.stack(zs, dtype=host)
        return (xp.asarray(s, dtype=dtype, device=device),
                None if z is None else xp.asarray(z, dtype=dtype, device=device))

    def _gather(self, xp, tab, rows_idx, cols_idx):
        """Per-element table values for tiles: rows_idx (k, tx), cols_idx (k, ty)."""
        r, g = tab.shape
        if r == 1 and g == 1:
            return tab[0, 0]
        ri = rows_idx if r > 1 else xp.zeros_like(rows_idx)
        gi = (cols_idx // self.group_size) if g > 1 else xp.zeros_like(cols_idx)
        flat = ri[:, :, None] * g + gi[:, None, :]
        k, tx, ty = flat.shape
        return xp.reshape(xp.take(xp.reshape(tab, (-1,)), xp.reshape(flat, (-1,))), (k, tx, ty))

    # -- the quantizer protocol ------------------------------------------------------------
    def quantize(self, targets, rows=None, cols=None):
        """Round tiles ``targets`` (k, t_x, t_y) whose first rows/cols are ``rows``/``cols``."""
        xp = _xp.namespace(targets)
        k, tx, ty = targets.shape
        dev = _xp.device(targets)
        s_tab, z_tab = self.tables(xp, dev, targets.dtype)
        if rows is None or cols is None:
            if s_tab.shape != (1, 1) or (z_tab is not None and z_tab.shape != (1, 1)):
                raise ValueError("this quantizer has per-row or per-group scales: quantize() "
                                 "needs the tiles' rows and cols offsets")
            rows = cols = xp.zeros((k,), dtype=xp.int64, device=dev)
        rows_idx = rows[:, None] + xp.arange(tx, dtype=xp.int64, device=dev)[None, :]
        cols_idx = cols[:, None] + xp.arange(ty, dtype=xp.int64, device=dev)[None, :]
        s = self._gather(xp, s_tab, rows_idx, cols_idx)
        lo, hi = self.code_range
        q = xp.round(targets / s)
        if self.symmetric:
            c = xp.clip(q, float(lo), float(hi))
            values = s * c
        else:
            z = self._gather(xp, z_tab, rows_idx, cols_idx)
            c = xp.clip(q + z, float(lo), float(hi))
            values = s * (c - z)
        return values, xp.astype(c, xp.int16)

    def dequantize(self, codes, dtype=None):
        """``Ŵ = s (c − z)`` from this grid's codes (m, n), in ``dtype`` (default float32) and
        the codes' namespace and device: the arithmetic of :meth:`quantize`, so the values
        are bitwise those of the solve that produced the codes."""
        xp = _xp.namespace(codes)
        m, n = codes.shape
        dtype = xp.float32 if dtype is None else dtype
        s, z = self.tables(xp, _xp.device(codes), dtype)

        def expand(t):
            r, g = t.shape
            if g == 1:
                return t
            gs = self.group_size
            full = xp.broadcast_to(xp.reshape(t, (r, g, 1)), (r, g, gs))
            return xp.reshape(full, (r, g * gs))[:, :n]

        c = xp.astype(codes, dtype)
        return expand(s) * c if z is None else expand(s) * (c - expand(z))

    def rtn(self, W):
        """Round-to-nearest of the whole matrix: (values, codes)."""
        xp = _xp.namespace(W)
        m, n = W.shape
        self.check_shape(m, n)
        z = xp.zeros((1,), dtype=xp.int64, device=_xp.device(W))
        v, c = self.quantize(W[None, ...], rows=z, cols=z)
        return v[0, ...], c[0, ...]

    # -- choosing scales -------------------------------------------------------------------
    @classmethod
    def fit(cls, W, bits, *, symmetric: bool = True, granularity: str = "row",
            group_size: int | None = None, method: str = "rms"):
        """Choose scales (and zero points) from ``W``.

        ``granularity`` is ``"tensor"``, ``"row"`` or ``"group"`` (with ``group_size``).
        ``method="rms"`` sets the step to the MSE-optimal Gaussian step times the RMS (the
        standard deviation and mean for asymmetric grids); ``method="minmax"`` covers the
        range: ``absmax / (2**(b-1) - 1)`` symmetric, ``(max - min) / (2**b - 1)`` asymmetric.
        """
        bits = check_bits(bits)
        if group_size is not None:
            group_size = check_int(group_size, "group_size", minimum=1)
        if method not in ("rms", "minmax"):
            raise ValueError(f"method must be 'rms' or 'minmax', got {method!r}")
        check_array_kind(W, "W")
        if "complex" in str(getattr(W, "dtype", "")):
            raise TypeError(f"W has the complex dtype {W.dtype}; it must be real")
        xp, Wh, chunk = _fit_source(W)
        if len(Wh.shape) != 2:
            raise ValueError(f"W must be a 2-D array, got shape {tuple(Wh.shape)}")
        if granularity not in ("tensor", "row", "group"):
            raise ValueError(f"granularity must be 'tensor', 'row' or 'group', got {granularity!r}")
        if granularity == "group" and (group_size is None or group_size < 1):
            raise ValueError("granularity='group' needs a positive group_size")
        m, n = Wh.shape
        # rows are fitted independently: row and group grids go through W in chunks of rows
        # (float64 copies; the same per-row reductions, so the same scales whatever the chunk)
        step = max(m, 1) if granularity == "tensor" else max(1, chunk // max(n, 1))
        scales, zeros = [], []
        for i in range(0, max(m, 1), step):
            Wn = xp.astype(xp.asarray(Wh[i:i + step, ...]), xp.float64)
            r = Wn.shape[0]
            if granularity == "tensor":
                parts = [xp.reshape(Wn, (1, 1, -1))]
            elif granularity == "row":
                parts = [xp.reshape(Wn, (r, 1, n))]
            else:  # whole groups side by side (r, groups, group_size), then the last one
                full = n - n % group_size
                parts = [xp.reshape(Wn[:, :full], (r, full // group_size, group_size))]
                if full < n:
                    parts.append(xp.reshape(Wn[:, full:], (r, 1, n - full)))
            fits = [_fit_block(xp, p, bits, symmetric, method) for p in parts]
            scales.append(np.concatenate([_xp.to_numpy(f[0]) for f in fits], axis=1))
            if not symmetric:
                zeros.append(np.concatenate([_xp.to_numpy(f[1]) for f in fits], axis=1))
        scale = np.concatenate(scales, axis=0)
        zero = np.concatenate(zeros, axis=0) if not symmetric else None
        # a scale that underflows in W's own dtype (|W| near that dtype's smallest numbers)
        # belongs to a row that is zero for that dtype: step 1 rounds it to zero, as for a
        # zero row
        wdt = _np_float_dtype(W)
        if wdt is not None and wdt.itemsize < 8:
            tiny = float(np.finfo(wdt).tiny)
            small = scale < tiny
            if np.any(small):
                scale = np.where(small, 1.0, scale)
                if zero is not None:
                    zero = np.where(small, 2.0 ** (bits - 1), zero)
        if granularity == "tensor":
            scale = float(scale[0, 0])
            zero = None if zero is None else float(zero[0, 0])
        elif granularity == "row":
            scale = scale[:, 0]
            zero = None if zero is None else zero[:, 0]
        return cls(bits, scale, symmetric=symmetric, zero_point=zero,
                   group_size=group_size if granularity == "group" else None)


#: elements of W converted to float64 at a time by ``UniformQuantizer.fit`` (row chunks):
#: on the host (a cache-sized copy), and on a device (one pass of large reductions)
_FIT_CHUNK = 1 << 18
_FIT_CHUNK_DEVICE = 1 << 24


def _fit_source(W):
    """Where ``fit`` reduces ``W``: ``(xp, W, chunk)``. Arrays in host memory (numpy,
    array-api-strict, other CPU arrays) are reduced by numpy in chunks of ``_FIT_CHUNK``
    elements; arrays on a device (cupy) are reduced there, in their own namespace, in chunks
    of ``_FIT_CHUNK_DEVICE``, so that W never crosses to the host (only the scales do)."""
    import array_api_compat.numpy as npx
    if not isinstance(W, np.ndarray):
        try:
            xp = _xp.namespace(W)
            on_host = "cpu" in str(_xp.device(W)).lower()
        except TypeError:
            xp, on_host = None, True
        if not on_host and not _xp.is_numpy(xp):
            return xp, W, _FIT_CHUNK_DEVICE
    return npx, _xp.to_numpy(W), _FIT_CHUNK


def _fit_block(xp, p, bits, symmetric, method):
    """Scale and zero point of each row (group) of ``p``: (R, G, k) -> (R, G) arrays, each
    reduced over its own k contiguous elements (float64, in ``p``'s namespace)."""
    tiny = float(np.finfo(np.float64).tiny)

    def full(like, v):
        return xp.full(like.shape, v, dtype=like.dtype, device=_xp.device(like))

    if symmetric:
        if method == "rms":
            s = _GAUSS_STEP[bits] * xp.sqrt(xp.mean(p * p, axis=2))
        else:
            s = xp.max(xp.abs(p), axis=2) / max(2 ** (bits - 1) - 1, 1)
        s = xp.where(s > tiny, s, full(s, 1.0))
        return s, None
    if method == "rms":
        mu, sd = xp.mean(p, axis=2), xp.std(p, axis=2)
        s = _GAUSS_STEP[bits] * sd
        s = xp.where(s > tiny, s, xp.maximum(xp.abs(mu), full(mu, 1.0)))
        z = 2 ** (bits - 1) - xp.round(mu / s)
    else:
        lo, hi = xp.min(p, axis=2), xp.max(p, axis=2)
        lo, hi = xp.minimum(lo, full(lo, 0.0)), xp.maximum(hi, full(hi, 0.0))
        s = (hi - lo) / (2 ** bits - 1)
        s = xp.where(s > tiny, s, full(s, 1.0))
        z = xp.round(-lo / s)
    z = xp.clip(z, 0, 2 ** bits - 1)
    return s, z


def _copy(x):
    """A copy of a scale or zero-point argument (arrays of any namespace; scalars as given)."""
    if x is None or not hasattr(x, "shape"):
        return x
    try:
        return _xp.namespace(x).asarray(x, copy=True)
    except Exception:  # not an array-API array: keep a host copy
        return np.array(x, copy=True)


def _np_float_dtype(W):
    """W's dtype as a numpy float dtype (float16/32/64), else None (bfloat16 counts as
    float32, its exponent range)."""
    name = str(getattr(W, "dtype", "float64")).split(".")[-1]
    if name == "bfloat16":
        return np.dtype(np.float32)
    try:
        dt = np.dtype(name)
    except TypeError:
        return None
    return dt if dt.kind == "f" else None
