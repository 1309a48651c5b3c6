"""Compiled kernels of the numba CPU engine (imported only by ``backends/numba_cpu.py``).

Conventions
-----------
* Matrices are C-contiguous 2-D arrays; sub-blocks are addressed by element ranges.
* Rounding is the scalar grid of ``bakron.UniformQuantizer``, fused into the kernels and
  written with the same floating-point operations as its array-API code (``t / s``, round
  half to even, clip, ``s * c`` or ``s * (c - z)``) in the arrays' own dtype, so that a
  given target rounds bit-identically. No fastmath anywhere.
* BLAS: the feedback products call ``cblas_?gemm`` (row-major, with leading dimensions, so
  that products accumulate in place into sub-blocks, ``beta = 1``, without temporaries) of
  the BLAS that numpy itself uses when that is the OpenBLAS of numpy's wheels: one thread
  pool for the solver and the caller's numpy code (two OpenBLAS pools in one process make
  their idle workers spin against each other on a 2-core machine). Otherwise an adapter to
  the ``?gemm`` that numba binds to SciPy's ``cython_blas``. Either is registered under a
  fixed symbol name before any kernel is linked, so the on-disk cache stays valid.

Arguments
---------
The kernels take arrays, then the quantizer's tables ``s_tab, z_tab`` (scales and zero
points, working dtype), then one int64 *parameter vector* ``prm`` (``PRM`` fields ``P_*``,
built by ``params``) with every scalar of a solve: the flag bits ``P_FLAGS`` (``HAS_F``,
``WRITE_E``, ``TWO_SIDED``, ``ASYM``, ``HAS_T``, ``BLAS1``), the tile, the quantizer's group
size and code range, the triangular products' panel width. Each kernel unpacks what it
reads at its top. The arrays come in this order: the problem ``W``, the offsets ``F`` a
block received from outside (read only with ``HAS_F``), the factors ``AO`` (a 1 x 1
placeholder one-sided) and ``AI``, the outputs ``Wq, codes, T`` (targets written only with
``HAS_T``), where a block's errors go, ``FE`` (written only with ``WRITE_E``), and scratch.
What a call covers comes last: a block's element ranges ``R0, R1, C0, C1``, or the range of
a step's rows in a table. ``numba_cpu._Operands`` prepares the arrays. (Named tuples were
tried for the scalars and dropped: numba's on-disk cache crashed when a new process reloaded
kernels compiled with them. The ``P_*`` constants are defined here, not in a module of their
own, because numba's cache is keyed on this file alone: a constant changed elsewhere would
leave stale compiled kernels.)
"""
from __future__ import annotations

import ctypes
import glob
import os

import numpy as np
from llvmlite import binding as _llvm
from numba import cfunc, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# ---------------------------------------------------------------------------------------
# the parameter vector ``prm`` (int64) of every kernel
# ---------------------------------------------------------------------------------------
#: flag bits of ``prm[P_FLAGS]``: the blocks' targets include offsets ``F`` received from
#: outside the block; a block writes its errors to ``FE``; two-sided problem (``AO`` given);
#: asymmetric grid (zero points); record every target into ``T``; BLAS is set to one thread
#: (``numba_cpu._blas_on_one_thread``: a gather or scatter piece is one BLAS call)
HAS_F, WRITE_E, TWO_SIDED, ASYM, HAS_T, BLAS1 = 1, 2, 4, 8, 16, 32
#: fields of ``prm``: the flag bits, the tile ``tx x ty``, the quantizer's group size and code
#: range ``lo .. hi`` (integers; the kernels use them in the working dtype), the panel width
#: of the triangular products (``NumbaOptions.panel``)
(P_FLAGS, P_TX, P_TY, P_GSZ, P_LO, P_HI, P_PANEL) = range(7)
#: length of ``prm``
PRM = 7


def params(*, flags: int, tile: tuple[int, int], group_size: int, code_range: tuple[int, int],
           panel: int = 0) -> np.ndarray:
    """The parameter vector ``prm`` of a solve (``PRM`` int64 in field order)."""
    prm = np.zeros(PRM, np.int64)
    prm[P_FLAGS] = flags
    prm[P_TX], prm[P_TY] = tile
    prm[P_GSZ] = group_size
    prm[P_LO], prm[P_HI] = code_range
    prm[P_PANEL] = panel
    return prm


# int numba_xxgemm(kind, transa, transb, m, n, k, *alpha, *a, lda, *b, ldb, *beta, *c, ldc)
# (column-major, like BLAS); resolved by name in numba's helper library.
_xxgemm = types.ExternalFunction("numba_xxgemm", types.intc(
    types.char, types.char, types.char, types.intp, types.intp, types.intp,
    types.voidptr, types.voidptr, types.intp, types.voidptr, types.intp,
    types.voidptr, types.voidptr, types.intp))


@intrinsic
def _vptr(typingctx, arr, offset):
    """``void*`` to element ``offset`` (in elements, from the array's first element)."""
    sig = types.voidptr(arr, offset)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.bitcast(builder.gep(ary.data, [args[1]]), cgutils.voidptr_t)

    return sig, codegen


def _cblas_sig(ft):
    # void cblas_?gemm(order, transa, transb, M, N, K, alpha, *A, lda, *B, ldb, beta, *C, ldc)
    i32, i64, vp = types.int32, types.int64, types.voidptr
    return types.void(i32, i32, i32, i64, i64, i64, ft, vp, i64, vp, i64, ft, vp, i64)


_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def _numpy_openblas():
    """The OpenBLAS that numpy's wheels ship and use (already loaded by numpy: the same
    library and thread pool), or None when numpy uses another BLAS."""
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "libscipy_openblas64_*.so*"))):
        try:
            lib = ctypes.CDLL(path)
            for name in ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_"):
                getattr(lib, name)
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _numpy_cblas(lib):
    """Addresses of ``cblas_sgemm``/``cblas_dgemm`` (64-bit integers) of ``lib``."""
    return tuple(ctypes.cast(getattr(lib, f"scipy_cblas_{k}gemm64_"), ctypes.c_void_p).value
                 for k in "sd")


def _blas_thread_count(lib):
    """``(get, set)`` of ``lib``'s thread count (process-wide), or None."""
    try:
        get = lib.scipy_openblas_get_num_threads64_
        put = lib.scipy_openblas_set_num_threads64_
    except AttributeError:
        return None
    get.restype, get.argtypes = ctypes.c_int, []
    put.restype, put.argtypes = None, [ctypes.c_int]
    return get, put


def _blas_pool_stop(lib):
    """``lib``'s ``blas_thread_shutdown_``: ends its worker threads at once (also those that
    still spin after a multi-threaded call); the next multi-threaded call or thread-count
    change starts them again. None if ``lib`` does not export it."""
    try:
        stop = lib.blas_thread_shutdown_
    except AttributeError:
        return None
    stop.restype, stop.argtypes = ctypes.c_int, []
    return stop


def _adapter(kind):
    """A C-callable ``cblas_?gemm`` (row-major, 64-bit ints) over numba's SciPy BLAS."""
    ft, dt, code = (types.float32, np.float32, 115) if kind == "s" else \
        (types.float64, np.float64, 100)

    @cfunc(_cblas_sig(ft), cache=True)
    def adapter(order, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        ab = np.empty(2, dt)
        ab[0] = alpha
        ab[1] = beta
        tA = np.int8(116) if ta == _TRANS else np.int8(110)
        tB = np.int8(116) if tb == _TRANS else np.int8(110)
        # row-major C = op(A) op(B)  <=>  column-major C^T = op(B)^T op(A)^T
        _xxgemm(np.int8(code), tB, tA, n, m, k, _vptr(ab, 0), B, ldb, A, lda, _vptr(ab, 1),
                C, ldc)

    return adapter


_OPENBLAS = _numpy_openblas()
_NUMPY_CBLAS = None if _OPENBLAS is None else _numpy_cblas(_OPENBLAS)
#: ``(get, set)`` of the kernels' BLAS thread count when it can be set (numpy's OpenBLAS),
#: else None (``numba_cpu._blas_on_one_thread``)
BLAS_THREADS = None if _OPENBLAS is None else _blas_thread_count(_OPENBLAS)
#: numpy's OpenBLAS's ``blas_thread_shutdown_`` or None (``numba_cpu._blas_on_one_thread``)
BLAS_POOL_STOP = None if BLAS_THREADS is None else _blas_pool_stop(_OPENBLAS)
if _NUMPY_CBLAS is not None:
    BLAS = "numpy's OpenBLAS (cblas, ILP64)"
    _llvm.add_symbol("bakron_cblas_sgemm", _NUMPY_CBLAS[0])
    _llvm.add_symbol("bakron_cblas_dgemm", _NUMPY_CBLAS[1])
else:  # pragma: no cover - numpy with another BLAS
    BLAS = "SciPy's cython_blas (through numba)"
    _ADAPTERS = (_adapter("s"), _adapter("d"))  # kept alive: their code must stay mapped
    _llvm.add_symbol("bakron_cblas_sgemm", _ADAPTERS[0].address)
    _llvm.add_symbol("bakron_cblas_dgemm", _ADAPTERS[1].address)
_sgemm = types.ExternalFunction("bakron_cblas_sgemm", _cblas_sig(types.float32))
_dgemm = types.ExternalFunction("bakron_cblas_dgemm", _cblas_sig(types.float64))


@njit(cache=True, nogil=True)
def _blas(C, oc, ldc, A, oa, lda, ta, B, ob, ldb, tb, m, n, k, beta):
    """One BLAS call: row-major ``C[m x n] = beta * C + op(A) @ op(B)``."""
    if m == 0 or n == 0:
        return
    if k == 0:
        if beta == 0.0:
            Cf = C.reshape(C.size)
            for i in range(m):
                for j in range(n):
                    Cf[oc + i * ldc + j] = 0.0
        return
    tA = np.int32(_TRANS) if ta else np.int32(_NO_TRANS)
    tB = np.int32(_TRANS) if tb else np.int32(_NO_TRANS)
    if C.itemsize == 4:
        _sgemm(np.int32(_ROW_MAJOR), tA, tB, m, n, k, np.float32(1.0), _vptr(A, oa), lda,
               _vptr(B, ob), ldb, np.float32(beta), _vptr(C, oc), ldc)
    else:
        _dgemm(np.int32(_ROW_MAJOR), tA, tB, m, n, k, 1.0, _vptr(A, oa), lda,
               _vptr(B, ob), ldb, np.float64(beta), _vptr(C, oc), ldc)


#: OpenBLAS runs a GEMM on one thread when m n k <= 65536 * 4 (its SMP threshold).
SERIAL_MNK = 1 << 18
#: Products with fewer multiply-adds than this (a few tens of microseconds on one core) are
#: split into pieces below ``SERIAL_MNK`` so that BLAS runs them on the calling thread: a
#: second thread gains little there, and on a machine whose other cores are busy every
#: multi-threaded BLAS call can wait a scheduler time slice for its helper thread. Measured:
#: docs/engines.md ("BLAS and threads").
PARALLEL_MNK = 1 << 21


@njit(cache=True, nogil=True)
def _gemm_k(C, oc, ldc, A, oa, lda, ta, B, ob, ldb, tb, m, n, k, beta):
    """``_blas`` split along ``k`` into single-threaded pieces."""
    kc = max(1, SERIAL_MNK // max(1, m * n))
    k0 = 0
    while k0 < k or k0 == 0:
        k1 = min(k0 + kc, k)
        da = k0 * lda if ta else k0              # op(A)[:, k0:k1]
        db = k0 if tb else k0 * ldb              # op(B)[k0:k1, :]
        _blas(C, oc, ldc, A, oa + da, lda, ta, B, ob + db, ldb, tb, m, n, k1 - k0,
              beta if k0 == 0 else 1.0)
        k0 = k1
        if k == 0:
            break


@njit(cache=True, nogil=True)
def gemm_serial(C, oc, ldc, A, oa, lda, ta, B, ob, ldb, tb, m, n, k, beta):
    """``gemm`` in pieces that BLAS runs single-threaded (rows or columns of C first)."""
    if m * n * k <= SERIAL_MNK:
        _blas(C, oc, ldc, A, oa, lda, ta, B, ob, ldb, tb, m, n, k, beta)
    elif m >= n:
        mc = max(1, SERIAL_MNK // max(1, n * k))
        for i0 in range(0, m, mc):
            i1 = min(i0 + mc, m)
            da = i0 if ta else i0 * lda          # rows i0:i1 of op(A)
            _gemm_k(C, oc + i0 * ldc, ldc, A, oa + da, lda, ta, B, ob, ldb, tb,
                    i1 - i0, n, k, beta)
    else:
        nc = max(1, SERIAL_MNK // max(1, m * k))
        for j0 in range(0, n, nc):
            j1 = min(j0 + nc, n)
            db = j0 * ldb if tb else j0          # columns j0:j1 of op(B)
            _gemm_k(C, oc + j0, ldc, A, oa, lda, ta, B, ob + db, ldb, tb, m, j1 - j0, k, beta)


@njit(cache=True, nogil=True)
def gemm(C, oc, ldc, A, oa, lda, ta, B, ob, ldb, tb, m, n, k, beta):
    """Row-major ``C[m x n] = beta * C + op(A) @ op(B)`` on flat offsets/leading dimensions
    (``op(A)`` is ``m x k``, ``A`` stored ``k x m`` when ``ta``; ``op(B)`` is ``k x n``).
    Multi-threaded BLAS only for products of at least ``PARALLEL_MNK`` multiply-adds."""
    if m * n * k >= PARALLEL_MNK:
        _blas(C, oc, ldc, A, oa, lda, ta, B, ob, ldb, tb, m, n, k, beta)
    else:
        gemm_serial(C, oc, ldc, A, oa, lda, ta, B, ob, ldb, tb, m, n, k, beta)


@njit(cache=True, nogil=True)
def tri_right_acc(C, oc, ldc, X, ox, ldx, L, ol, ldl, p, h, panel):
    """``C[p x h] += X[p x h] @ tril(L[h x h])`` (L's strict upper part is zero), by column
    panels so that the zero upper triangle is mostly skipped."""
    j0 = 0
    while j0 < h:
        j1 = min(j0 + panel, h)
        gemm(C, oc + j0, ldc, X, ox + j0, ldx, False, L, ol + j0 * ldl + j0, ldl, False,
             p, j1 - j0, h - j0, 1.0)
        j0 = j1


@njit(cache=True, nogil=True)
def tri_left_t_acc(C, oc, ldc, L, ol, ldl, X, ox, ldx, h, q, panel):
    """``C[h x q] += tril(L[h x h])^T @ X[h x q]``, by row panels."""
    i0 = 0
    while i0 < h:
        i1 = min(i0 + panel, h)
        gemm(C, oc + i0 * ldc, ldc, L, ol + i0 * ldl + i0, ldl, True, X, ox + i0 * ldx, ldx,
             False, i1 - i0, q, h - i0, 1.0)
        i0 = i1


@njit(cache=True, nogil=True)
def add_into(C, oc, ldc, X, ox, ldx, p, q):
    """``C[p x q] += X[p x q]``."""
    Cf = C.reshape(C.size)
    Xf = X.reshape(X.size)
    for i in range(p):
        for j in range(q):
            Cf[oc + i * ldc + j] += Xf[ox + i * ldx + j]


@njit(cache=True, nogil=True)
def copy_into(C, oc, ldc, X, ox, ldx, p, q):
    """``C[p x q] = X[p x q]``."""
    Cf = C.reshape(C.size)
    Xf = X.reshape(X.size)
    for i in range(p):
        for j in range(q):
            Cf[oc + i * ldc + j] = Xf[ox + i * ldx + j]


# ---------------------------------------------------------------------------------------
# the scalar grid
# ---------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def _quant(t, i, j, s_tab, z_tab, gs, lo, hi, sym):
    """(value, code) of target ``t`` at element (i, j): UniformQuantizer.quantize's rule."""
    ri = i if s_tab.shape[0] > 1 else 0
    gi = j // gs if s_tab.shape[1] > 1 else 0
    s = s_tab[ri, gi]
    q = np.rint(t / s)
    if sym:
        c = min(max(q, lo), hi)
        return s * c, c
    zi = i if z_tab.shape[0] > 1 else 0
    zg = j // gs if z_tab.shape[1] > 1 else 0
    z = z_tab[zi, zg]
    c = min(max(q + z, lo), hi)
    return s * (c - z), c


@njit(cache=True, nogil=True, inline="always")
def _grid(prm, like):
    """The scalar grid of ``prm`` for ``_quant``: group size, code range in the dtype of the
    array ``like``, symmetric."""
    return (prm[P_GSZ], like.dtype.type(prm[P_LO]), like.dtype.type(prm[P_HI]),
            (prm[P_FLAGS] & ASYM) == 0)


# ---------------------------------------------------------------------------------------
# base blocks
# ---------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def _row_tile(W, F, P, usep, AI, Wq, codes, T, E, er0, gr0, h, C0, Sc, s_tab, z_tab, prm):
    """Round rows ``gr0 .. gr0+h`` of W over columns ``[C0, C0+Sc)`` (one row tile of a
    block): column tiles right to left, targets ``W + F + P + (P + E) A_I`` where ``P[:h]``
    (when ``usep``) is the feedback from the rows below before ``G_I``, and ``E`` the row
    tile's own errors (written to ``E[er0 + i, :]``). Loops are ordered so that the inner
    ones are unit-stride updates that vectorise without reassociation."""
    useF = (prm[P_FLAGS] & HAS_F) != 0
    useT = (prm[P_FLAGS] & HAS_T) != 0
    ty = prm[P_TY]
    gs, lo, hi, sym = _grid(prm, W)
    Z = np.empty((h, Sc), W.dtype)
    for i in range(h):
        wr = W[gr0 + i, C0:C0 + Sc]
        zr = Z[i]
        if useF:
            fr = F[gr0 + i, C0:C0 + Sc]
            for j in range(Sc):
                zr[j] = wr[j] + fr[j]
        else:
            for j in range(Sc):
                zr[j] = wr[j]
        if usep:
            pr = P[i]
            for j in range(Sc):
                zr[j] += pr[j]
    nct = (Sc + ty - 1) // ty
    for b in range(nct - 1, -1, -1):
        c0 = b * ty
        c1 = min(c0 + ty, Sc)
        for i in range(h):
            gr = gr0 + i
            er = E[er0 + i]
            zr = Z[i]
            for j in range(c0, c1):
                t = zr[j]
                v, c = _quant(t, gr, C0 + j, s_tab, z_tab, gs, lo, hi, sym)
                Wq[gr, C0 + j] = v
                codes[gr, C0 + j] = np.int16(c)
                if useT:
                    T[gr, C0 + j] = t
                er[j] = W[gr, C0 + j] - v
        if b > 0:
            for l in range(c0, c1):
                arow = AI[C0 + l, C0:C0 + c0]
                for i in range(h):
                    coef = E[er0 + i, l] + P[i, l] if usep else E[er0 + i, l]
                    zr = Z[i]
                    for j in range(c0):
                        zr[j] += coef * arow[j]


@njit(cache=True, nogil=True, inline="always")
def _one_sided_row_tile(W, F, AI, Wq, codes, T, FE, s_tab, z_tab, prm, R0, R1, C0, C1, a):
    tx = prm[P_TX]
    Sc = C1 - C0
    r0 = R0 + a * tx
    h = min(r0 + tx, R1) - r0
    E = np.empty((h, Sc), W.dtype)
    _row_tile(W, F, E, False, AI, Wq, codes, T, E, 0, r0, h, C0, Sc, s_tab, z_tab, prm)
    if (prm[P_FLAGS] & WRITE_E) != 0:
        for i in range(h):
            FE[r0 + i, C0:C1] = E[i]


@njit(cache=True, nogil=True)
def base_one_sided(W, F, AI, Wq, codes, T, FE, s_tab, z_tab, prm, R0, R1, C0, C1):
    """One-sided block ``[R0, R1) x [C0, C1)``: targets ``W + F + E A_I`` inside the block,
    row tiles independent. With ``WRITE_E`` the block's errors are written to ``FE`` (which
    may be ``F`` itself: each row reads its F before). Serial (see ``base_one_sided_par``)."""
    tx = prm[P_TX]
    for a in range((R1 - R0 + tx - 1) // tx):
        _one_sided_row_tile(W, F, AI, Wq, codes, T, FE, s_tab, z_tab, prm, R0, R1, C0, C1, a)


@njit(cache=True, nogil=True, parallel=True)
def base_one_sided_par(W, F, AI, Wq, codes, T, FE, s_tab, z_tab, prm, R0, R1, C0, C1):
    """``base_one_sided`` with the row tiles in parallel (prange): used for blocks with
    enough work to amortise a parallel region on a shared machine (``PAR_MIN_WORK``)."""
    tx = prm[P_TX]
    for a in prange((R1 - R0 + tx - 1) // tx):
        _one_sided_row_tile(W, F, AI, Wq, codes, T, FE, s_tab, z_tab, prm, R0, R1, C0, C1, a)


#: one-sided blocks with at least this many multiply-adds (rows x cols^2 / 2) run their row
#: tiles in parallel; smaller ones serially (a parallel region per small block costs more
#: than it saves when the cores are shared).
PAR_MIN_WORK = 1 << 26


@njit(cache=True, nogil=True)
def base_two_sided(W, F, AO, AI, Wq, codes, T, FE, s_tab, z_tab, prm, R0, R1, C0, C1):
    """Two-sided block ``[R0, R1) x [C0, C1)`` with targets ``W + F + (feedback inside)``.

    Row tiles bottom-up (a dominance-respecting order): the errors of the rows below reach
    row tile ``a`` as ``P = A_O[below, a]^T E_below`` (one small GEMM), then through
    ``G_I``; inside the row tile ``G_O``'s diagonal block is the identity, so the tile row is
    a one-sided sweep right to left with in-row feedback ``(P + E_a) A_I``. Serial: it runs
    between multi-threaded BLAS calls, and tiny parallel regions cost more than they save.
    """
    tx = prm[P_TX]
    writeE = (prm[P_FLAGS] & WRITE_E) != 0
    Sr = R1 - R0
    Sc = C1 - C0
    m = W.shape[0]
    E = np.empty((Sr, Sc), W.dtype)          # block-local errors, rows below the current tile
    P = np.empty((tx, Sc), W.dtype)
    nrt = (Sr + tx - 1) // tx
    for a in range(nrt - 1, -1, -1):
        r0 = a * tx
        r1 = min(r0 + tx, Sr)
        h = r1 - r0
        # P[h x Sc] = A_O[R0+r1:R1, R0+r0:R0+r1]^T @ E[r1:Sr, :]
        gemm_serial(P, 0, Sc, AO, (R0 + r1) * m + R0 + r0, m, True, E, r1 * Sc, Sc, False,
                    h, Sc, Sr - r1, 0.0)
        _row_tile(W, F, P, True, AI, Wq, codes, T, E, r0, R0 + r0, h, C0, Sc, s_tab, z_tab, prm)
        if writeE:
            for i in range(h):
                FE[R0 + r0 + i, C0:C1] = E[r0 + i]


# ---------------------------------------------------------------------------------------
# the recursive solver: the recursion plan (bakron.solvers.schedule) as an op table
# ---------------------------------------------------------------------------------------
#: op codes of the table (``numba_cpu.op_table``): a leaf, or the update of that kind
#: (``bakron.solvers.schedule.Update`` says what each adds)
OP_LEAF, OP_AFTER_D, OP_AFTER_BC, OP_AFTER_RIGHT, OP_AFTER_BOTTOM = 0, 1, 2, 3, 4


@njit(cache=True, nogil=True)
def run_plan(plan, W, FE, AO, AI, Wq, codes, T, buf, s_tab, z_tab, prm):
    """Execute the recursion's op table (``numba_cpu.op_table``). ``FE`` holds the offsets F of
    unsolved blocks and the errors E = W - Wq of solved ones (``prm``: ``HAS_F | WRITE_E``);
    ``buf`` is the scratch space (per-level offsets in the plan)."""
    two_sided = (prm[P_FLAGS] & TWO_SIDED) != 0
    panel = prm[P_PANEL]
    m, n = W.shape
    for q in range(plan.shape[0]):
        op = plan[q, 0]
        r0, r_, r1 = plan[q, 1], plan[q, 2], plan[q, 3]
        c0, c_, c1 = plan[q, 4], plan[q, 5], plan[q, 6]
        o = plan[q, 7]
        if op == OP_LEAF:
            if two_sided:
                base_two_sided(W, FE, AO, AI, Wq, codes, T, FE, s_tab, z_tab, prm, r0, r1, c0, c1)
            elif (r1 - r0) * (c1 - c0) * (c1 - c0) >= 2 * PAR_MIN_WORK:
                base_one_sided_par(W, FE, AI, Wq, codes, T, FE, s_tab, z_tab, prm, r0, r1, c0, c1)
            else:
                base_one_sided(W, FE, AI, Wq, codes, T, FE, s_tab, z_tab, prm, r0, r1, c0, c1)
        elif op == OP_AFTER_D:
            hB, hD, wA, wB = r_ - r0, r1 - r_, c_ - c0, c1 - c_
            # F_B += A_O[R2,R1]^T (E_D G_I[C2,C2])
            copy_into(buf, o, wB, FE, r_ * n + c_, n, hD, wB)
            tri_right_acc(buf, o, wB, FE, r_ * n + c_, n, AI, c_ * n + c_, n, hD, wB, panel)
            gemm(FE, r0 * n + c_, n, AO, r_ * m + r0, m, True, buf, o, wB, False,
                 hB, wB, hD, 1.0)
            # X = E_D A_I[C2,C1], kept in buf until A;  F_C += G_O[R2,R2]^T X
            gemm(buf, o, wA, FE, r_ * n + c_, n, False, AI, c_ * n + c0, n, False,
                 hD, wA, wB, 0.0)
            add_into(FE, r_ * n + c0, n, buf, o, wA, hD, wA)
            tri_left_t_acc(FE, r_ * n + c0, n, AO, r_ * m + r_, m, buf, o, wA, hD, wA, panel)
        elif op == OP_AFTER_BC:
            hB, hD, wA, wB = r_ - r0, r1 - r_, c_ - c0, c1 - c_
            # F_A += A_O[R2,R1]^T (E_C G_I[C1,C1] + X)
            add_into(buf, o, wA, FE, r_ * n + c0, n, hD, wA)
            tri_right_acc(buf, o, wA, FE, r_ * n + c0, n, AI, c0 * n + c0, n, hD, wA, panel)
            gemm(FE, r0 * n + c0, n, AO, r_ * m + r0, m, True, buf, o, wA, False,
                 hB, wA, hD, 1.0)
            # F_A += G_O[R1,R1]^T (E_B A_I[C2,C1])
            gemm(buf, o, wA, FE, r0 * n + c_, n, False, AI, c_ * n + c0, n, False,
                 hB, wA, wB, 0.0)
            add_into(FE, r0 * n + c0, n, buf, o, wA, hB, wA)
            tri_left_t_acc(FE, r0 * n + c0, n, AO, r0 * m + r0, m, buf, o, wA, hB, wA, panel)
        elif op == OP_AFTER_RIGHT:
            h, wA, wB = r1 - r0, c_ - c0, c1 - c_
            if two_sided:
                # F_left += G_O[R,R]^T (E_right A_I[C2,C1])
                gemm(buf, o, wA, FE, r0 * n + c_, n, False, AI, c_ * n + c0, n, False,
                     h, wA, wB, 0.0)
                add_into(FE, r0 * n + c0, n, buf, o, wA, h, wA)
                tri_left_t_acc(FE, r0 * n + c0, n, AO, r0 * m + r0, m, buf, o, wA, h, wA,
                               panel)
            else:
                gemm(FE, r0 * n + c0, n, FE, r0 * n + c_, n, False, AI, c_ * n + c0, n,
                     False, h, wA, wB, 1.0)
        else:  # OP_AFTER_BOTTOM
            hT, hD, w = r_ - r0, r1 - r_, c1 - c0
            # F_top += A_O[R2,R1]^T (E_bottom G_I[C,C])
            copy_into(buf, o, w, FE, r_ * n + c0, n, hD, w)
            tri_right_acc(buf, o, w, FE, r_ * n + c0, n, AI, c0 * n + c0, n, hD, w, panel)
            gemm(FE, r0 * n + c0, n, AO, r_ * m + r0, m, True, buf, o, w, False,
                 hT, w, hD, 1.0)


# ---------------------------------------------------------------------------------------
# the two-level wavefront: the coarse steps of bakron.solvers.schedule.two_level
# ---------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, parallel=True)
def solve_blocks(tasks, W, FE, AO, AI, Wq, codes, T, s_tab, z_tab, prm, t0, t1):
    """Solve the blocks ``tasks[t0:t1]`` (rows ``[r0, r1, c0, c1]``, elements) of one coarse
    step in parallel (prange), each with the base-block kernel on one thread (its small
    products single-threaded, ``gemm_serial``). A block reads its offsets from ``FE`` and
    overwrites them with its errors (``prm``: ``HAS_F | WRITE_E``); blocks of one step are
    disjoint."""
    two_sided = (prm[P_FLAGS] & TWO_SIDED) != 0
    for k in prange(t1 - t0):
        r0, r1 = tasks[t0 + k, 0], tasks[t0 + k, 1]
        c0, c1 = tasks[t0 + k, 2], tasks[t0 + k, 3]
        if two_sided:
            base_two_sided(W, FE, AO, AI, Wq, codes, T, FE, s_tab, z_tab, prm, r0, r1, c0, c1)
        else:
            base_one_sided(W, FE, AI, Wq, codes, T, FE, s_tab, z_tab, prm, r0, r1, c0, c1)


#: Rows per task of the wavefront's scatters: each block's product is cut into row pieces of
#: ``Y`` of this height, run in a ``prange`` on single-threaded BLAS, so that the whole step
#: runs on numba's threads and BLAS's own pool stays idle. A constant, not a function of the
#: thread count, so that every product is summed in the same order on any number of threads
#: (the gathers' pieces: ``numba_cpu.gather_table``). Measured: docs/engines.md.
SCATTER_ROWS = 128


@njit(cache=True, nogil=True)
def _piece_gemm(blas1, C, oc, ldc, A, oa, lda, ta, B, ob, ldb, tb, m, n, k, beta):
    """One piece of a gather or scatter on the calling thread: one BLAS call when BLAS is
    set to one thread (``blas1``, ``numba_cpu._blas_on_one_thread``), else split along
    ``k`` below OpenBLAS's threading threshold (``_gemm_k``)."""
    if blas1:
        _blas(C, oc, ldc, A, oa, lda, ta, B, ob, ldb, tb, m, n, k, beta)
    else:
        _gemm_k(C, oc, ldc, A, oa, lda, ta, B, ob, ldb, tb, m, n, k, beta)


@njit(cache=True, nogil=True)
def _piece_starts(counts):
    """Prefix sums: task ``q`` of a flattened list belongs to entry ``i`` with
    ``starts[i] <= q < starts[i + 1]``."""
    starts = np.zeros(counts.shape[0] + 1, np.int64)
    for i in range(counts.shape[0]):
        starts[i + 1] = starts[i] + counts[i]
    return starts


@njit(cache=True, nogil=True, parallel=True)
def gather_products(gp, gt, SRC, AI, part, prm, p0, p1):
    """The partial products of one step's gathers, ``gp[p0:p1]`` (``numba_cpu.gather_table``:
    target, ``k0``, ``k1``, offset in ``part``), in parallel (prange), each one
    single-threaded BLAS call: ``part[piece] = SRC[r0:r1, k0:k1] A_I[k0:k1, c0:c1]`` for the
    rows ``[r0, r1, c0, c1]`` of its target ``gt``."""
    blas1 = (prm[P_FLAGS] & BLAS1) != 0
    n = AI.shape[0]
    for p in prange(p1 - p0):
        t, k0, k1, off = gp[p0 + p, 0], gp[p0 + p, 1], gp[p0 + p, 2], gp[p0 + p, 3]
        r0, r1, c0, c1 = gt[t, 0], gt[t, 1], gt[t, 2], gt[t, 3]
        _piece_gemm(blas1, part, off, c1 - c0, SRC, r0 * n + k0, n, False, AI, k0 * n + c0, n,
                    False, r1 - r0, c1 - c0, k1 - k0, 0.0)


@njit(cache=True, nogil=True, parallel=True)
def gather_sums(gt, gp, FE, Y, part, prm, t0, t1):
    """The offsets of one step's gather targets ``gt[t0:t1]`` (``[r0, r1, c0, c1, q0, q1]``):
    ``FE[r0:r1, c0:c1] = Y[r0:r1, c0:c1] + part[q0] + ... + part[q1 - 1]`` (without ``Y``
    unless ``TWO_SIDED``), summed in this order on any number of threads (prange over
    targets)."""
    addY = (prm[P_FLAGS] & TWO_SIDED) != 0
    for k in prange(t1 - t0):
        t = t0 + k
        r0, r1, c0, c1 = gt[t, 0], gt[t, 1], gt[t, 2], gt[t, 3]
        w = c1 - c0
        for i in range(r1 - r0):
            for j in range(w):
                FE[r0 + i, c0 + j] = Y[r0 + i, c0 + j] if addY else 0.0
            for q in range(gt[t, 4], gt[t, 5]):
                off = gp[q, 3] + i * w
                for j in range(w):
                    FE[r0 + i, c0 + j] += part[off + j]


@njit(cache=True, nogil=True, parallel=True)
def scatter_two_sided(tasks, FE, Y, AO, prm, t0, t1):
    """Push the errors of the solved blocks ``tasks[t0:t1]`` into the accumulator:
    ``Y[:r1, cB] += G_O[A, :r1]^T E_AB`` (the GEMM, then the identity on the rows of ``A``),
    in row pieces of ``Y`` (prange, single-threaded BLAS). Blocks of a step have disjoint
    columns, pieces of a block disjoint rows."""
    blas1 = (prm[P_FLAGS] & BLAS1) != 0
    m = AO.shape[0]
    n = FE.shape[1]
    counts = np.empty(t1 - t0, np.int64)
    for k in range(t1 - t0):
        counts[k] = (tasks[t0 + k, 1] + SCATTER_ROWS - 1) // SCATTER_ROWS
    starts = _piece_starts(counts)
    for q in prange(starts[t1 - t0]):
        k = np.searchsorted(starts, q, side="right") - 1
        r0, r1 = tasks[t0 + k, 0], tasks[t0 + k, 1]
        c0, c1 = tasks[t0 + k, 2], tasks[t0 + k, 3]
        y0 = (q - starts[k]) * SCATTER_ROWS
        y1 = min(y0 + SCATTER_ROWS, r1)
        _piece_gemm(blas1, Y, y0 * n + c0, n, AO, r0 * m + y0, m, True, FE, r0 * n + c0, n,
                    False, y1 - y0, c1 - c0, r1 - r0, 1.0)
        a0, a1 = max(y0, r0), min(y1, r1)   # the identity: rows of A in this piece
        if a1 > a0:
            add_into(Y, a0 * n + c0, n, FE, a0 * n + c0, n, a1 - a0, c1 - c0)


@njit(cache=True, nogil=True)
def run_wavefront(tasks, steps, gt, gsteps, gp, psteps, W, FE, Y, AO, AI, Wq, codes, T, part,
                  s_tab, z_tab, prm):
    """Execute the two-level wavefront (``numba_cpu.wavefront_table``): step ``s`` is the
    blocks ``tasks[steps[s]:steps[s + 1]]``. Per step, parallel regions on numba's threads:
    gather the offsets (the partial products ``gp[psteps[s]:psteps[s + 1]]`` into ``part``,
    then their sums into the targets ``gt[gsteps[s]:gsteps[s + 1]]``:
    ``numba_cpu.gather_table``), solve the blocks, scatter their errors (row pieces of
    ``Y``). Every product is single-threaded BLAS (``BLAS1``: BLAS is set to one thread).
    ``FE`` (zero on entry) holds the offsets, then the errors; two-sided ``Y`` (zero on
    entry) is the accumulator ``G_O^T Ẽ``, and the gathers read ``Y``; one-sided they read
    the errors to the right in ``FE``."""
    two_sided = (prm[P_FLAGS] & TWO_SIDED) != 0
    ns = steps.shape[0] - 1
    SRC = Y if two_sided else FE
    for s in range(ns):
        t0, t1 = steps[s], steps[s + 1]
        if gsteps[s + 1] > gsteps[s]:
            gather_products(gp, gt, SRC, AI, part, prm, psteps[s], psteps[s + 1])
            gather_sums(gt, gp, FE, Y, part, prm, gsteps[s], gsteps[s + 1])
        solve_blocks(tasks, W, FE, AO, AI, Wq, codes, T, s_tab, z_tab, prm, t0, t1)
        if two_sided and s < ns - 1:
            scatter_two_sided(tasks, FE, Y, AO, prm, t0, t1)


# ---------------------------------------------------------------------------------------
# the input checks' statistics of a factor, in one parallel pass (numba_cpu.factor_scan)
# ---------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, parallel=True)
def factor_scan(A, block, chunks):
    """One pass over a square factor ``A``, rows in ``chunks`` parallel chunks: the largest
    ``|A[r, c]|`` with ``c >= (r // block) * block`` (on or above the diagonal or inside a
    diagonal block of ``block``), and of the part left of that: per row whether it has a
    non-zero and its first non-zero column (``n`` if none), per column whether it has a
    non-zero (each chunk marks its own row of ``col``, reduced afterwards)."""
    n = A.shape[0]
    bad = np.zeros(n, A.dtype)
    first = np.full(n, n, np.int64)
    col = np.zeros((chunks, n), np.uint8)
    per = (n + chunks - 1) // chunks
    for c in prange(chunks):
        for r in range(c * per, min(n, (c + 1) * per)):
            row = A[r]
            s = (r // block) * block
            b = abs(row[s])
            for j in range(s + 1, n):
                b = max(b, abs(row[j]))
            bad[r] = b
            f = n
            for j in range(s):
                if row[j] != 0:
                    f = j
                    break
            first[r] = f
            cr = col[c]
            for j in range(f, s):
                cr[j] |= np.uint8(row[j] != 0)
    col_any = np.zeros(n, np.bool_)
    for c in range(chunks):
        for j in range(n):
            if col[c, j]:
                col_any[j] = True
    return bad.max(), first < n, first, col_any


@njit(cache=True, nogil=True, parallel=True)
def count_nonfinite(X, chunks):
    """The number of NaN and Inf entries of the 2-D ``X``, rows in ``chunks`` parallel
    chunks."""
    n = X.shape[0]
    per = (n + chunks - 1) // chunks
    counts = np.zeros(chunks, np.int64)
    for c in prange(chunks):
        k = 0
        for r in range(c * per, min(n, (c + 1) * per)):
            row = X[r]
            for j in range(row.shape[0]):
                k += np.int64(not np.isfinite(row[j]))
        counts[c] = k
    return counts.sum()


# ---------------------------------------------------------------------------------------
# anti-diagonal solvers (the baselines), whole matrix
# ---------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def _acc_tile(W, F, AO, AI, Wq, codes, T, Y, s_tab, z_tab, prm, a, b):
    """One tile of the accumulator wavefront: target, rounding, and its ``Y`` update."""
    useF = (prm[P_FLAGS] & HAS_F) != 0
    useT = (prm[P_FLAGS] & HAS_T) != 0
    tx, ty = prm[P_TX], prm[P_TY]
    gs, lo, hi, sym = _grid(prm, W)
    m, n = W.shape
    r0 = a * tx
    r1 = min(r0 + tx, m)
    c0 = b * ty
    c1 = min(c0 + ty, n)
    h = r1 - r0
    w = c1 - c0
    Tt = np.empty(h * w, W.dtype)
    Et = np.empty(h * w, W.dtype)
    for i in range(h):
        for j in range(w):
            base = W[r0 + i, c0 + j] + F[r0 + i, c0 + j] if useF else W[r0 + i, c0 + j]
            Tt[i * w + j] = base + Y[r0 + i, c0 + j]
    # T += Y[rows a, c1:] A_I[c1:, cols b]   (G_I's diagonal block is I: Y[a, b] above)
    gemm_serial(Tt, 0, w, Y, r0 * n + c1, n, False, AI, c1 * n + c0, n, False, h, w, n - c1,
                1.0)
    for i in range(h):
        for j in range(w):
            t = Tt[i * w + j]
            v, c = _quant(t, r0 + i, c0 + j, s_tab, z_tab, gs, lo, hi, sym)
            Wq[r0 + i, c0 + j] = v
            codes[r0 + i, c0 + j] = np.int16(c)
            if useT:
                T[r0 + i, c0 + j] = t
            e = W[r0 + i, c0 + j] - v
            Et[i * w + j] = e
            Y[r0 + i, c0 + j] += e
    # Y[:r0, cols b] += A_O[rows a, :r0]^T E_ab
    gemm_serial(Y, c0, n, AO, r0 * m, m, True, Et, 0, w, False, r0, w, h, 1.0)


@njit(cache=True, nogil=True)
def antidiagonal_accumulator(W, F, AO, AI, Wq, codes, T, Y, s_tab, z_tab, prm):
    """Two-sided anti-diagonal wavefront with the accumulator ``Y = G_O^T Ẽ``
    (docs/algorithm.md): the steps of ``schedule.tile_wavefront``, one per anti-diagonal;
    each tile fuses its target ``W + F + Y[a, >=b] G_I[>=b, b]`` (a small BLAS product), its
    rounding and its ``Y`` update (another). Tiles of one
    diagonal write disjoint columns of ``Y`` and read none that another writes, so they
    could run in parallel; on the CPU the tiles of a diagonal run one after the other, as
    a prange over them measured slower (thread hand-offs per diagonal, and BLAS calls from
    worker threads contend with BLAS's own threads; docs/engines.md)."""
    tx, ty = prm[P_TX], prm[P_TY]
    m, n = W.shape
    M = (m + tx - 1) // tx
    N = (n + ty - 1) // ty
    Y[:, :] = 0.0
    for s in range(M + N - 2, -1, -1):
        for a in range(max(0, s - N + 1), min(M - 1, s) + 1):
            _acc_tile(W, F, AO, AI, Wq, codes, T, Y, s_tab, z_tab, prm, a, s - a)


@njit(cache=True, nogil=True)
def antidiagonal_direct(W, F, AO, AI, Wq, codes, T, E, s_tab, z_tab, prm):
    """Anti-diagonal wavefront with every target from (1) over its dominating region:
    ``T_ab = W_ab + G_O[>=a, a]^T (E[>=a, >=b] G_I[>=b, b])`` by two BLAS products per tile
    (``O(m^2 n^2 / t)`` work: the baseline published speed-ups are quoted against).
    One-sided: one product per column of tiles."""
    flags = prm[P_FLAGS]
    useF = (flags & HAS_F) != 0
    useT = (flags & HAS_T) != 0
    two_sided = (flags & TWO_SIDED) != 0
    tx, ty = prm[P_TX], prm[P_TY]
    gs, lo, hi, sym = _grid(prm, W)
    m, n = W.shape
    M = (m + tx - 1) // tx
    N = (n + ty - 1) // ty
    E[:, :] = 0.0
    V = np.empty(m * ty, W.dtype)            # flat buffers, leading dimension = tile width
    Tt = np.empty(tx * ty, W.dtype)
    if not two_sided:
        for b in range(N - 1, -1, -1):
            c0 = b * ty
            c1 = min(c0 + ty, n)
            w = c1 - c0
            # V = E[:, c1:] @ A_I[c1:, c0:c1]
            gemm(V, 0, w, E, c1, n, False, AI, c1 * n + c0, n, False, m, w, n - c1, 0.0)
            for i in range(m):
                for j in range(w):
                    base = W[i, c0 + j] + F[i, c0 + j] if useF else W[i, c0 + j]
                    t = base + V[i * w + j]
                    v, c = _quant(t, i, c0 + j, s_tab, z_tab, gs, lo, hi, sym)
                    Wq[i, c0 + j] = v
                    codes[i, c0 + j] = np.int16(c)
                    if useT:
                        T[i, c0 + j] = t
                    E[i, c0 + j] = W[i, c0 + j] - v
        return
    for s in range(M + N - 2, -1, -1):
        for a in range(max(0, s - N + 1), min(M - 1, s) + 1):
            b = s - a
            r0 = a * tx
            r1 = min(r0 + tx, m)
            c0 = b * ty
            c1 = min(c0 + ty, n)
            h = r1 - r0
            w = c1 - c0
            hr = m - r0
            # V[hr x w] = E[r0:, c0:c1] + E[r0:, c1:] @ A_I[c1:, c0:c1]
            copy_into(V, 0, w, E, r0 * n + c0, n, hr, w)
            gemm(V, 0, w, E, r0 * n + c1, n, False, AI, c1 * n + c0, n, False,
                 hr, w, n - c1, 1.0)
            # T = W + F + V[:h] + A_O[r1:, r0:r1]^T V[h:]
            for i in range(h * w):
                Tt[i] = V[i]
            gemm(Tt, 0, w, AO, r1 * m + r0, m, True, V, h * w, w, False, h, w, m - r1, 1.0)
            for i in range(h):
                for j in range(w):
                    base = W[r0 + i, c0 + j] + F[r0 + i, c0 + j] if useF else W[r0 + i, c0 + j]
                    t = base + Tt[i * w + j]
                    v, c = _quant(t, r0 + i, c0 + j, s_tab, z_tab, gs, lo, hi, sym)
                    Wq[r0 + i, c0 + j] = v
                    codes[r0 + i, c0 + j] = np.int16(c)
                    if useT:
                        T[r0 + i, c0 + j] = t
                    E[r0 + i, c0 + j] = W[r0 + i, c0 + j] - v
