"""The numba CPU engine: compiled base blocks, the recursion driving BLAS, the baselines.

Selected by ``bakron.solve(..., engine="numba")``, and by ``engine="auto"`` for numpy inputs
with a :class:`bakron.UniformQuantizer` when numba imports. numba is imported only when this
engine first runs (``import bakron`` never imports it).

What runs compiled (``backends/_numba_kernels.py``):

* the base block (two-sided: row tiles bottom-up, the rows below pushed through one small
  GEMM, then a one-sided sweep right to left with the quantizer fused; one-sided: every row
  tile in parallel);
* ``method="recursive"``: the whole quadrant recursion of SPEC §4 as a precomputed plan of
  base blocks and feedback updates, executed in one compiled call. Updates are BLAS GEMMs
  accumulating in place (``beta = 1``) into one buffer that holds the offsets ``F`` of
  unsolved blocks and the errors ``E`` of solved ones; products with the unit-triangular
  diagonal blocks of ``G`` skip their zero triangle (panels). Extra memory: that buffer
  (``m n``) plus at most ``m n / 3`` of scratch, besides the outputs;
* ``method="antidiagonal"``: the accumulator variant (one parallel step per anti-diagonal,
  tiles of a diagonal in parallel) and the direct variant (two BLAS products per tile).

Rounding is bit-identical to :meth:`bakron.UniformQuantizer.quantize` for a given target;
the targets themselves are sums in another order than the array-API path, so results agree
exactly in float64 and up to near-ties in float32 (SPEC §4).
"""
from __future__ import annotations

import importlib.util

import numpy as np

__all__ = ["available", "supports", "solve_block", "solve", "auto_base", "auto_method",
           "warm_up", "PANEL", "BASE_ELEMENTS"]

#: Panel width (elements) of the triangular products: the zero triangle of a unit-triangular
#: block is skipped except inside the diagonal panels. Measured: see docs/engines.md.
PANEL = 64

#: Side of the base block in elements that ``auto_base`` aims at. Measured: docs/engines.md.
BASE_ELEMENTS = 128

_K = None


def _kernels():
    """The compiled kernels (imports numba; compiles or loads from the on-disk cache)."""
    global _K
    if _K is None:
        from . import _numba_kernels
        _K = _numba_kernels
    return _K


def available() -> bool:
    """numba and SciPy's BLAS import."""
    if importlib.util.find_spec("numba") is None:
        return False
    try:
        import numba  # noqa: F401
        import scipy.linalg.cython_blas  # noqa: F401
    except Exception:
        return False
    return True


def _is_uniform(q) -> bool:
    from bakron.quantizers import UniformQuantizer

    return isinstance(q, UniformQuantizer) and type(q).quantize is UniformQuantizer.quantize


def supports(p) -> bool:
    """numpy arrays, float32/float64, a :class:`bakron.UniformQuantizer` (not a subclass
    that overrides ``quantize``)."""
    from bakron import _xp

    return (_xp.is_numpy(p.xp) and isinstance(p.W, np.ndarray)
            and p.W.dtype in (np.float32, np.float64) and p.W.dtype.isnative
            and _is_uniform(p.quantizer))


# ---------------------------------------------------------------------------------------
class _Args:
    """The arrays and scalars every kernel takes, prepared once per call."""

    def __init__(self, p):
        dt = p.W.dtype
        self.dtype = dt
        self.W = p.W
        self.AO = None if p.A_O is None else np.ascontiguousarray(p.A_O)
        self.AI = np.ascontiguousarray(p.A_I)
        self.dummy = np.zeros((1, 1), dtype=dt)
        if p.codes is None:
            p.codes = np.zeros((p.m, p.n), dtype=np.int16)
        p.codes_seen = True
        self.useT = p.T is not None
        self.T = p.T if self.useT else self.dummy
        q = p.quantizer
        s, z = q.tables(np, "cpu", dt)
        self.s = np.ascontiguousarray(s)
        self.z = self.dummy if z is None else np.ascontiguousarray(z)
        self.gs = q.group_size or 1
        lo, hi = q.code_range
        self.lo, self.hi = dt.type(lo), dt.type(hi)
        self.sym = q.symmetric

    def quant(self):
        return self.s, self.z, self.gs, self.lo, self.hi, self.sym


def solve_block(p, ra: int, rb: int, ca: int, cb: int) -> None:
    """Round tiles ``[ra, rb) x [ca, cb)`` of ``p`` with targets ``W + F + (feedback inside
    the block)``; writes ``p.Wq``, ``p.codes`` (and ``p.T``); ``p.F`` is read, not changed."""
    K = _kernels()
    g = _Args(p)
    R0, R1, C0, C1 = p.rows[ra], p.rows[rb], p.cols[ca], p.cols[cb]
    useF = p.F is not None
    F = p.F if useF else g.dummy
    if g.AO is None:
        base = K.base_one_sided_par if (R1 - R0) * (C1 - C0) ** 2 >= 2 * K.PAR_MIN_WORK else \
            K.base_one_sided
        base(g.W, F, useF, g.AI, p.Wq, p.codes, g.T, g.useT, g.dummy, False,
             R0, R1, C0, C1, p.tx, p.ty, *g.quant())
    else:
        K.base_two_sided(g.W, F, useF, g.AO, g.AI, p.Wq, p.codes, g.T, g.useT, g.dummy, False,
                         R0, R1, C0, C1, p.tx, p.ty, *g.quant())


def plan(p, base: int):
    """The recursion of SPEC §4 (as ``bakron.solvers.recursive``) as an op table.

    Rows ``[op, r0, r_, r1, c0, c_, c1, buffer offset]`` in elements; returns
    ``(ops, scratch size)``. Scratch: one region per recursion level, so that a quadrant node
    keeps ``X = E_D A_I[C2, C1]`` while its B and C are solved.
    """
    R, C = p.rows, p.cols
    two = p.A_O is not None
    ops: list[list[int]] = []
    sizes: dict[int, int] = {}

    def need(level, *sz):
        sizes[level] = max(sizes.get(level, 0), *sz)

    def rec(ra, rb, ca, cb, lev):
        split_r = two and rb - ra > base
        split_c = cb - ca > base
        if not (split_r or split_c):
            ops.append([0, R[ra], 0, R[rb], C[ca], 0, C[cb], -1])
            return
        if split_r and split_c:
            rm, cm = (ra + rb) // 2, (ca + cb) // 2
            r0, r_, r1, c0, c_, c1 = R[ra], R[rm], R[rb], C[ca], C[cm], C[cb]
            need(lev, (r1 - r_) * (c1 - c_), (r1 - r_) * (c_ - c0), (r_ - r0) * (c_ - c0))
            rec(rm, rb, cm, cb, lev + 1)
            ops.append([1, r0, r_, r1, c0, c_, c1, lev])
            rec(ra, rm, cm, cb, lev + 1)
            rec(rm, rb, ca, cm, lev + 1)
            ops.append([2, r0, r_, r1, c0, c_, c1, lev])
            rec(ra, rm, ca, cm, lev + 1)
        elif split_c:
            cm = (ca + cb) // 2
            r0, r1, c0, c_, c1 = R[ra], R[rb], C[ca], C[cm], C[cb]
            if two:
                need(lev, (r1 - r0) * (c_ - c0))
            rec(ra, rb, cm, cb, lev + 1)
            ops.append([3, r0, 0, r1, c0, c_, c1, lev])
            rec(ra, rb, ca, cm, lev + 1)
        else:
            rm = (ra + rb) // 2
            r0, r_, r1, c0, c1 = R[ra], R[rm], R[rb], C[ca], C[cb]
            need(lev, (r1 - r_) * (c1 - c0))
            rec(rm, rb, ca, cb, lev + 1)
            ops.append([4, r0, r_, r1, c0, 0, c1, lev])
            rec(ra, rm, ca, cb, lev + 1)

    rec(0, p.M, 0, p.N, 0)
    offset, total = {}, 0
    for lev in sorted(sizes):
        offset[lev] = total
        total += sizes[lev]
    table = np.array(ops, dtype=np.int64).reshape(-1, 8)
    for row in table:
        row[7] = offset.get(int(row[7]), 0)
    return table, total


def solve(p, method: str, base: int, variant: str) -> bool:
    """Run ``method`` compiled; ``False`` for methods left to the generic driver (naive)."""
    if method not in ("recursive", "antidiagonal"):
        return False
    K = _kernels()
    g = _Args(p)
    useF = p.F is not None
    F = np.ascontiguousarray(p.F) if useF else g.dummy
    two = g.AO is not None
    AO = g.AO if two else g.dummy
    if method == "antidiagonal":
        if variant == "direct":
            E = np.empty((p.m, p.n), dtype=g.dtype)     # the errors, kept in full
            K.antidiagonal_direct(g.W, F, useF, AO, g.AI, two, p.Wq, p.codes, g.T, g.useT, E,
                                  p.tx, p.ty, *g.quant())
        elif two:
            Y = np.empty((p.m, p.n), dtype=g.dtype)     # the accumulator G_O^T Ẽ
            K.antidiagonal_accumulator(g.W, F, useF, AO, g.AI, p.Wq, p.codes, g.T, g.useT, Y,
                                       p.tx, p.ty, *g.quant())
        else:  # one-sided accumulator: the column sweep, row tiles in parallel if it pays
            base = K.base_one_sided_par if p.m * p.n * p.n >= 2 * K.PAR_MIN_WORK else \
                K.base_one_sided
            base(g.W, F, useF, g.AI, p.Wq, p.codes, g.T, g.useT, g.dummy, False,
                 0, p.m, 0, p.n, p.tx, p.ty, *g.quant())
        return True
    ops, scratch = plan(p, base)
    FE = np.array(F, copy=True) if useF else np.zeros((p.m, p.n), dtype=g.dtype)
    buf = np.empty(max(scratch, 1), dtype=g.dtype)
    K.run_plan(ops, g.W, FE, AO, g.AI, two, p.Wq, p.codes, g.T, g.useT, buf, p.tx, p.ty,
               PANEL, *g.quant())
    return True


def auto_base(p) -> int:
    """Base-block size in tiles for ``base=None``: a block of about ``BASE_ELEMENTS``
    elements a side (tiles ``t_x x t_y`` count as ``sqrt(t_x t_y)``)."""
    return max(1, int(round(BASE_ELEMENTS / float(np.sqrt(p.tx * p.ty)))))


#: ``method="auto"`` takes the anti-diagonal accumulator for two-sided problems with tiles of
#: at least this many elements and at most ``ANTIDIAGONAL_MAX_WORK`` = m n (m + n); the
#: recursion otherwise. Measured: docs/engines.md.
ANTIDIAGONAL_MIN_TILE = 256
ANTIDIAGONAL_MAX_WORK = 2 * 512 ** 3


def auto_method(p, base: int) -> str:
    """``method="auto"`` on this engine (measurements in docs/engines.md): the serial
    accumulator wavefront (one small BLAS product per tile and step) is as fast as or faster
    than the recursion up to about 512 x 512 with 16 x 16 tiles, and slower for smaller tiles
    (per-tile overhead) or larger matrices (its products cannot use the second core); the
    recursion everywhere else, and always one-sided."""
    if (p.two_sided and p.tx * p.ty >= ANTIDIAGONAL_MIN_TILE
            and p.m * p.n * (p.m + p.n) <= ANTIDIAGONAL_MAX_WORK):
        return "antidiagonal"
    return "recursive"


def warm_up() -> None:
    """Compile (or load from cache) every kernel for float32 and float64 on a tiny problem."""
    import bakron

    rng = np.random.default_rng(0)
    for dt in (np.float32, np.float64):
        W = rng.standard_normal((8, 8)).astype(dt)
        A = np.tril(rng.standard_normal((8, 8)), -2).astype(dt)
        q = bakron.UniformQuantizer(2, 0.5)
        for A_out in (A, None):
            for method, variant in (("recursive", "accumulator"), ("antidiagonal", "accumulator"),
                                    ("antidiagonal", "direct")):
                bakron.solve(W, A_out, A, q, tile=2, method=method, variant=variant,
                             engine="numba", base=1)
