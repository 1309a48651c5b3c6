"""Tile quantizers on exactly the grids of llama.cpp's block formats Q8_0, Q4_0 and Q4_1.

Each format cuts every row of W into blocks of 32 consecutive inputs and stores, per block,
an fp16 scale ``d`` (and, for Q4_1, an fp16 minimum ``m``) and one integer per weight
(docs/export.md gives the byte layouts). The quantizers below hold those fp16 numbers as
per-group tables (``group_size=32``) so that the solvers round onto the very values that
llama.cpp reconstructs; :meth:`~BlockGrid.to_blocks` then writes the format's bytes, and
``gguf``'s de-quantization of those bytes gives back the quantizer's values bit for bit.

* ``Q8_0``: ``w = d * q``, ``q`` int8; fitted as llama.cpp does, ``d = max|w| / 127``.
* ``Q4_0``: ``w = d * (q - 8)``, ``q`` in 0..15; fitted with ``d = w* / -8`` where ``w*`` is
  the block's entry of largest magnitude (so ``d`` is negative when ``w*`` is positive).
  Held as a uniform grid of step ``|d|`` with zero point 8 (``d >= 0``) or 7 (``d < 0``:
  the stored nibble is then ``15 - code``).
* ``Q4_1``: ``w = d * q + m`` in float32 arithmetic, ``q`` in 0..15; fitted with
  ``d = (max - min) / 15``, ``m = min``.

Q8_0 and Q4_0 are plain :class:`~bakron.UniformQuantizer` grids (the numba engines run them);
Q4_1's offset ``m`` is not a multiple of ``d``, so it rounds through its own ``quantize``.
"""
from __future__ import annotations

import numpy as np

from .. import _xp
from ..quantizers import UniformQuantizer
from ._files import encode_on_grid

__all__ = ["BLOCK", "GGUF_FORMATS", "BlockGrid", "Q8_0Grid", "Q4_0Grid", "Q4_1Grid",
           "fit_block_grid", "grid_for_format", "as_block_grid"]

BLOCK = 32
# The smallest positive float16 (a subnormal): the scale of a block whose fp16 scale would
# be zero (all its weights below ~1e-7), so that the grid stays a grid (docs/export.md).
_FP16_TINY = float(np.float16(2.0 ** -24))
_FP16_MAX = float(np.finfo(np.float16).max)


def _blocks(W, fmt: str) -> np.ndarray:
    """W as float32 blocks (m, n/32, 32), after checking shape and values."""
    Wn = np.asarray(_xp.to_numpy(W))
    if Wn.ndim != 2 or 0 in Wn.shape:
        raise ValueError(f"W must be a non-empty 2-D array, got shape {Wn.shape}")
    if Wn.dtype.kind != "f":
        raise ValueError(f"W must hold floating-point numbers, got dtype {Wn.dtype}")
    m, n = Wn.shape
    if n % BLOCK:
        raise ValueError(f"{fmt} stores blocks of {BLOCK} consecutive inputs, but W has "
                         f"{n} columns (not a multiple of {BLOCK})")
    W32 = Wn.astype(np.float32)
    if not np.all(np.isfinite(W32)):
        raise ValueError("W contains NaN or Inf entries (or values beyond float32)")
    return W32.reshape(m, n // BLOCK, BLOCK)


def _fp16(x, what: str, fmt: str) -> np.ndarray:
    """float32 -> the nearest float16 (as float64), refusing overflow."""
    with np.errstate(over="ignore"):
        h = np.asarray(x, dtype=np.float32).astype(np.float16)
    if not np.all(np.isfinite(h)):
        big = float(np.max(np.abs(np.asarray(x, dtype=np.float64))))
        raise ValueError(f"{fmt}: a block {what} of magnitude {big:.6g} overflows float16 "
                         f"(largest {_FP16_MAX:g}); these weights cannot be stored in {fmt}")
    return h.astype(np.float64)


class BlockGrid(UniformQuantizer):
    """Common part of the llama.cpp block-format grids (per-group tables, groups of 32)."""

    format: str = ""
    block_bytes: int = 0

    def _blocks_and_inverse(self, W):
        """W's blocks of 32 and llama.cpp's inverse of the unrounded scale (``1/d``, 0 where
        ``d`` is 0), in float32 as llama.cpp computes them, for the formats' RTN rules."""
        d = self._d_fit
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        return _blocks(W, self.format), inv

    def check_shape(self, m: int, n: int) -> None:
        if n % BLOCK:
            raise ValueError(f"{self.format} stores blocks of {BLOCK} inputs, but W has {n} "
                             f"columns (not a multiple of {BLOCK})")
        super().check_shape(m, n)

    def __repr__(self) -> str:
        m, g = self._scale.shape
        return f"{type(self).__name__}({m} rows x {g} blocks of {BLOCK})"

    # -- export --------------------------------------------------------------------------
    def encode(self, W_hat, name: str = "W_hat") -> np.ndarray:
        """Codes of ``W_hat``, which must lie exactly on this grid (else ``ValueError``)."""
        return encode_on_grid(self, W_hat, name)

    def to_blocks(self, codes) -> np.ndarray:
        """The format's bytes for ``codes`` (m, n) in this grid's convention: (m, n/32 * bytes)."""
        c = np.asarray(_xp.to_numpy(codes)).astype(np.int64)
        m, n = c.shape
        self.check_shape(m, n)
        lo, hi = self.code_range
        if c.min() < lo or c.max() > hi:
            raise ValueError(f"codes must lie in [{lo}, {hi}] for {self.format}")
        out = self._pack(c.reshape(m, n // BLOCK, BLOCK))
        assert out.shape[-1] == self.block_bytes
        return out.reshape(m, -1)

    def _pack(self, c: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def _half_bytes(x) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x, dtype=np.float64).astype(np.float16)
                                    [..., None]).view(np.uint8)

    @staticmethod
    def _nibbles(q: np.ndarray) -> np.ndarray:
        """Nibbles (.., 32) -> bytes (.., 16): inputs 0..15 low nibbles, 16..31 high."""
        q = q.astype(np.uint8)
        return q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << np.uint8(4))


class Q8_0Grid(BlockGrid):
    """llama.cpp's Q8_0: ``w = d * q`` with an fp16 ``d`` per block of 32, ``q`` int8."""

    format = "Q8_0"
    block_bytes = 2 + BLOCK

    def __init__(self, d, *, d_fit=None):
        d = np.asarray(d, dtype=np.float64)
        if d.ndim != 2:
            raise ValueError(f"d must be a (rows, blocks) table, got shape {d.shape}")
        if np.any(d.astype(np.float16).astype(np.float64) != d):
            raise ValueError("d must hold float16 values (Q8_0 stores its scales in fp16)")
        super().__init__(8, d, symmetric=True, group_size=BLOCK)
        self._d_fit = None if d_fit is None else np.asarray(d_fit, dtype=np.float32)

    @classmethod
    def fit(cls, W):
        """llama.cpp's scale rule: ``d = max|w| / 127`` per block, rounded to fp16."""
        b = _blocks(W, cls.format)
        d = np.abs(b).max(axis=-1) / np.float32(127)
        d16 = _fp16(d, "scale", cls.format)
        d16 = np.where(d16 > 0, d16, _FP16_TINY)
        # where the fp16 scale underflowed, round (RTN too) with the scale that is stored
        return cls(d16, d_fit=np.where(d16 == _FP16_TINY, np.float32(_FP16_TINY), d))

    def rtn(self, W):
        """llama.cpp's round-to-nearest (ties away from zero, with the unrounded scale)."""
        if self._d_fit is None:
            return super().rtn(W)
        b, inv = self._blocks_and_inverse(W)
        a = np.abs(b * inv[..., None])
        fl = np.floor(a)  # half away from zero, in float32 as llama.cpp (no a + 0.5 rounding)
        q = np.sign(b * inv[..., None]) * (fl + np.floor(2 * (a - fl)))
        q = np.clip(q, -128, 127).reshape(W.shape).astype(np.int16)  # no -0.0 left
        return self._values(W, q), _xp.namespace(W).asarray(q)

    def _values(self, W, q):
        s = np.repeat(self._scale, BLOCK, axis=1)
        xp = _xp.namespace(W)
        return xp.asarray((s * q).astype(np.asarray(_xp.to_numpy(W)).dtype))

    def _pack(self, c):
        d = np.where(np.all(c == 0, axis=-1), 0.0, self._scale)  # llama.cpp's d of a 0 block
        return np.concatenate([self._half_bytes(d), c.astype(np.int8).view(np.uint8)], axis=-1)


class Q4_0Grid(BlockGrid):
    """llama.cpp's Q4_0: ``w = d * (q - 8)``, fp16 ``d`` (of either sign), ``q`` in 0..15.

    Held as step ``|d|`` with zero point 8 where ``d >= 0`` and 7 where ``d < 0``.
    """

    format = "Q4_0"
    block_bytes = 2 + BLOCK // 2

    def __init__(self, d, *, d_fit=None):
        d = np.asarray(d, dtype=np.float64)
        if d.ndim != 2:
            raise ValueError(f"d must be a (rows, blocks) table, got shape {d.shape}")
        if np.any(d.astype(np.float16).astype(np.float64) != d) or np.any(d == 0):
            raise ValueError("d must hold non-zero float16 values (Q4_0 stores fp16 scales)")
        self.d = d
        super().__init__(4, np.abs(d), symmetric=False, zero_point=np.where(d < 0, 7.0, 8.0),
                         group_size=BLOCK)
        self._d_fit = None if d_fit is None else np.asarray(d_fit, dtype=np.float32)

    @classmethod
    def fit(cls, W):
        """llama.cpp's rule: ``d = w* / -8``, ``w*`` the entry of largest magnitude."""
        b = _blocks(W, cls.format)
        imax = np.abs(b).argmax(axis=-1)[..., None]
        d = np.take_along_axis(b, imax, axis=-1)[..., 0] / np.float32(-8)
        d16 = _fp16(d, "scale", cls.format)
        tiny = np.where(np.signbit(d), -_FP16_TINY, _FP16_TINY)
        under = d16 == 0  # round (RTN too) with the scale that is stored there
        return cls(np.where(under, tiny, d16), d_fit=np.where(under, tiny.astype(np.float32), d))

    def rtn(self, W):
        """llama.cpp's round-to-nearest: ``trunc(w / d + 8.5)`` with the unrounded ``d``."""
        if self._d_fit is None:
            return super().rtn(W)
        b, inv = self._blocks_and_inverse(W)
        nib = np.clip(np.trunc(b * inv[..., None] + np.float32(8.5)), 0, 15)
        q = np.where((self.d < 0)[..., None], 15 - nib, nib).reshape(W.shape)  # our code
        s = np.repeat(self._scale, BLOCK, axis=1)
        z = np.repeat(self._zero, BLOCK, axis=1)
        xp = _xp.namespace(W)
        values = (s * (q - z)).astype(np.asarray(_xp.to_numpy(W)).dtype)
        return xp.asarray(values), xp.asarray(q.astype(np.int16))

    def _pack(self, c):
        neg = (self.d < 0)[..., None]
        nib = np.where(neg, 15 - c, c)
        # a block whose values are all zero gets llama.cpp's d = +-0.0 (same values)
        d = np.where(np.all(nib == 8, axis=-1), np.copysign(0.0, self.d), self.d)
        return np.concatenate([self._half_bytes(d), self._nibbles(nib)], axis=-1)


class Q4_1Grid(BlockGrid):
    """llama.cpp's Q4_1: ``w = d * q + m`` (float32 arithmetic), fp16 ``d`` >= 0 and ``m``.

    A block with ``d = 0`` (a constant block) reconstructs every weight as ``m``.
    """

    format = "Q4_1"
    block_bytes = 4 + BLOCK // 2

    def __init__(self, d, m, *, d_fit=None, m_fit=None):
        d = np.asarray(d, dtype=np.float64)
        mn = np.asarray(m, dtype=np.float64)
        if d.ndim != 2 or mn.shape != d.shape:
            raise ValueError(f"d and m must be (rows, blocks) tables of one shape, got "
                             f"{d.shape} and {mn.shape}")
        for name, t in (("d", d), ("m", mn)):
            if np.any(t.astype(np.float16).astype(np.float64) != t):
                raise ValueError(f"{name} must hold float16 values (Q4_1 stores them in fp16)")
        if np.any(d < 0):
            raise ValueError("d must be >= 0 (Q4_1's scale spans max - min)")
        super().__init__(4, np.where(d > 0, d, _FP16_TINY), symmetric=False,
                         zero_point=np.zeros_like(d), group_size=BLOCK)
        self.d = d
        self.m = mn
        self._m_cache: dict = {}
        self._d_fit = None if d_fit is None else np.asarray(d_fit, dtype=np.float32)
        self._m_fit = None if m_fit is None else np.asarray(m_fit, dtype=np.float32)

    @classmethod
    def fit(cls, W):
        """llama.cpp's rule: ``d = (max - min) / 15``, ``m = min`` per block."""
        b = _blocks(W, cls.format)
        lo, hi = b.min(axis=-1), b.max(axis=-1)
        d = (hi - lo) / np.float32(15)
        d16 = _fp16(d, "scale", cls.format)
        m16 = _fp16(lo, "minimum", cls.format)
        return cls(d16, m16, d_fit=d, m_fit=lo)

    def quantize(self, targets, rows=None, cols=None):
        """Round to ``d * q + m``; the values are computed in float32, as llama.cpp does."""
        xp = _xp.namespace(targets)
        k, tx, ty = targets.shape
        dev = _xp.device(targets)
        if rows is None or cols is None:
            raise ValueError("Q4_1 has per-block scales: quantize() needs the tiles' rows "
                             "and cols offsets")
        key = (xp.__name__, str(dev), str(targets.dtype))
        tabs = self._m_cache.get(key)
        if tabs is None:  # (d, d or 1 where d = 0, m), the last in float32
            tabs = self._m_cache[key] = (
                xp.asarray(self.d, dtype=targets.dtype, device=dev),
                xp.asarray(np.where(self.d > 0, self.d, 1.0), dtype=targets.dtype, device=dev),
                xp.asarray(self.m, dtype=xp.float32, device=dev))
        rows_idx = rows[:, None] + xp.arange(tx, dtype=xp.int64, device=dev)[None, :]
        cols_idx = cols[:, None] + xp.arange(ty, dtype=xp.int64, device=dev)[None, :]
        d, safe, mn = (self._gather(xp, t, rows_idx, cols_idx) for t in tabs)
        c = xp.clip(xp.round((targets - xp.astype(mn, targets.dtype)) / safe), 0.0, 15.0)
        c = xp.where(d > 0, c, xp.zeros_like(c))
        v32 = xp.astype(d, xp.float32) * xp.astype(c, xp.float32) + mn
        return xp.astype(v32, targets.dtype), xp.astype(c, xp.int16)

    def dequantize(self, codes, dtype=None):
        """``Ŵ = d q + m`` (float32 arithmetic, as :meth:`quantize`) from codes (m, n)."""
        xp = _xp.namespace(codes)
        dev = _xp.device(codes)
        n = codes.shape[1]
        d = np.repeat(self.d.astype(np.float32), self.group_size, axis=1)[:, :n]
        mn = np.repeat(self.m.astype(np.float32), self.group_size, axis=1)[:, :n]
        c = xp.astype(codes, xp.float32)
        v = xp.asarray(d, device=dev) * c + xp.asarray(mn, device=dev)
        return xp.astype(v, xp.float32 if dtype is None else dtype)

    def rtn(self, W):
        """llama.cpp's round-to-nearest: ``trunc((w - min) / d + 0.5)``, unrounded d and min."""
        xp = _xp.namespace(W)
        if self._d_fit is None:
            z = xp.zeros((1,), dtype=xp.int64, device=_xp.device(W))
            v, c = self.quantize(W[None, ...], rows=z, cols=z)
            return v[0, ...], c[0, ...]
        b = _blocks(W, self.format)
        d, lo = self._d_fit[..., None], self._m_fit[..., None]
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        q = np.clip(np.trunc((b - lo) * inv + np.float32(0.5)), 0, 15).reshape(W.shape)
        s = np.repeat(self.d, BLOCK, axis=1).astype(np.float32)
        mn = np.repeat(self.m, BLOCK, axis=1).astype(np.float32)
        values = (s * q.astype(np.float32) + mn).astype(np.asarray(_xp.to_numpy(W)).dtype)
        return xp.asarray(values), xp.asarray(q.astype(np.int16))

    def _pack(self, c):
        return np.concatenate([self._half_bytes(self.d), self._half_bytes(self.m),
                               self._nibbles(c)], axis=-1)


GGUF_FORMATS = {"Q8_0": Q8_0Grid, "Q4_0": Q4_0Grid, "Q4_1": Q4_1Grid}


def grid_for_format(fmt: str) -> type[BlockGrid]:
    """The quantizer class of a GGUF block format name (``"Q4_0"``, ``"Q4_1"``, ``"Q8_0"``)."""
    key = str(fmt).upper()
    if key not in GGUF_FORMATS:
        raise ValueError(f"format must be one of {sorted(GGUF_FORMATS)}, got {fmt!r}")
    return GGUF_FORMATS[key]


def fit_block_grid(W, fmt: str) -> BlockGrid:
    """Fit the grid of GGUF block format ``fmt`` to ``W`` (m outputs x n inputs) by its rules."""
    return grid_for_format(fmt).fit(W)


def _is_fp16(t) -> bool:
    return bool(np.all(np.asarray(t, np.float64).astype(np.float16).astype(np.float64) == t))


def as_block_grid(quantizer, fmt: str | None = None) -> BlockGrid:
    """``quantizer`` as a GGUF block grid (of format ``fmt`` when given), or ``ValueError``.

    Block grids pass through. A :class:`~bakron.UniformQuantizer` converts when a format
    stores exactly its values: scales per group of 32 inputs, in fp16, and 8-bit symmetric
    codes (``Q8_0``), 4-bit symmetric codes or zero points 8 (``Q4_0``), or 4-bit codes with
    integer zero points ``z`` and fp16 ``-scale * z`` (``Q4_1``). The message says which
    condition fails.
    """
    want = None if fmt is None else grid_for_format(fmt).format
    if isinstance(quantizer, BlockGrid):
        if want is not None and quantizer.format != want:
            raise ValueError(f"the layer was rounded onto a {quantizer.format} grid, not {want}")
        return quantizer
    if type(quantizer) is not UniformQuantizer:
        raise ValueError(f"GGUF stores llama.cpp block formats; {quantizer!r} is not one of "
                         f"their grids (fit one with bakron.export.fit_block_grid(W, fmt))")
    q = quantizer
    prefix = f"GGUF cannot store {q!r}"
    if q.granularity != "group" or q.group_size != BLOCK:
        raise ValueError(f"{prefix}: its blocks have one scale per {BLOCK} inputs, this grid "
                         f"has {q.granularity} scales"
                         + (f" with group_size {q.group_size}" if q.group_size else ""))
    s = q._scale
    if not _is_fp16(s):
        raise ValueError(f"{prefix}: its scales are not float16 numbers (GGUF stores fp16)")
    if q.bits == 8 and q.symmetric and want in (None, "Q8_0"):
        return Q8_0Grid(s)
    if q.bits != 4 or want == "Q8_0":
        kind = "asymmetric 8-bit" if q.bits == 8 else f"{q.bits}-bit"
        raise ValueError(f"{prefix}" + (f" as {want}" if want else "") + f": Q4_0/Q4_1 store "
                         f"4-bit codes and Q8_0 symmetric 8-bit codes; this grid has "
                         f"{kind} codes")
    z = np.full(s.shape, 8.0) if q.symmetric else np.broadcast_to(q._zero, s.shape)
    if want in (None, "Q4_0") and np.all(z == 8):
        return Q4_0Grid(s)
    if want in (None, "Q4_1") and np.all(z == np.round(z)) and np.all((z >= 0) & (z <= 15)):
        m = -s * z
        if _is_fp16(m):
            return Q4_1Grid(s, m + 0.0)
        raise ValueError(f"{prefix}: Q4_1 would need the minimum -scale * zero in fp16, which "
                         f"it is not")
    raise ValueError(f"{prefix}" + (f" as {want}" if want else "") + ": Q4_0's zero point is "
                     "8 and Q4_1's needs integer zero points in 0..15")
