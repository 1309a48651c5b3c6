"""One-pass input and result checks on the GPU (numba-cuda): what ``bakron.solve`` and the
stack layer ask of a cupy array before and after a solve, each in one kernel instead of
several cupy passes with their temporaries (docs/engines.md, "Checks on the GPU").

The statistics are those of the numba CPU engine's ``factor_scan`` and ``count_nonfinite``
(``backends/_numba_kernels.py``): the decisions and the messages stay in
``bakron._validate`` and ``bakron.solvers``. Under numba-cuda's simulator the kernels run on
numpy arrays, so CI checks them against the CPU kernels. Imported by ``numba_cuda`` only when
a check runs (importing it imports ``numba.cuda``).
"""
from __future__ import annotations

import math
import os

from numba import cuda, float64, int64

#: threads per CTA of both kernels (a power of two: the CTA reductions halve it); 8 under
#: the simulator, whose threads are Python threads
THREADS = 8 if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else 128
#: at most this many CTAs per SM for the grid-stride count
_COUNT_CTAS_PER_SM = 8

_KERNELS: dict = {}


def _build():
    """Compile (once) the two kernels."""
    if _KERNELS:
        return _KERNELS
    nt = THREADS

    @cuda.jit
    def scan(A, item_rows, block, stats, bad, first, col):
        """CTA ``r`` reads row ``r`` of ``A`` (rows of a stack of square factors of
        ``item_rows`` rows each): ``bad[r]``, the largest ``|entry|`` from the first column
        of the row's diagonal block on (on or above the diagonal, or inside a diagonal
        block); with ``stats``, ``first[r]``, the first non-zero column left of that (``n``
        if none), and ``col[j] = 1`` for every column with a non-zero there."""
        r = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n = A.shape[1]
        lim = ((r % item_rows) // block) * block
        b = 0.0
        f = n
        j = t
        while j < n:
            v = A[r, j]
            if j >= lim:
                a = abs(v)
                if a > b:
                    b = a
            elif v != 0:
                if j < f:
                    f = j
                if stats:
                    col[j] = 1
            j += nt
        sb = cuda.shared.array(nt, float64)
        sf = cuda.shared.array(nt, int64)
        sb[t] = b
        sf[t] = f
        cuda.syncthreads()
        h = nt // 2
        while h > 0:
            if t < h:
                if sb[t + h] > sb[t]:
                    sb[t] = sb[t + h]
                if sf[t + h] < sf[t]:
                    sf[t] = sf[t + h]
            cuda.syncthreads()
            h //= 2
        if t == 0:
            bad[r] = sb[0]
            if stats:
                first[r] = sf[0]

    @cuda.jit
    def count(x, out):
        """``out[0] +=`` the number of NaN and Inf entries of the 1-D ``x`` (grid-stride)."""
        t = cuda.threadIdx.x
        i = cuda.grid(1)
        step = cuda.gridsize(1)
        c = 0
        while i < x.shape[0]:
            v = x[i]
            if v != v or abs(v) == math.inf:
                c += 1
            i += step
        sc = cuda.shared.array(nt, int64)
        sc[t] = c
        cuda.syncthreads()
        h = nt // 2
        while h > 0:
            if t < h:
                sc[t] += sc[t + h]
            cuda.syncthreads()
            h //= 2
        if t == 0 and sc[0] > 0:
            cuda.atomic.add(out, 0, sc[0])

    _KERNELS.update(scan=scan, count=count)
    return _KERNELS


def _takes(X) -> bool:
    return str(X.dtype) in ("float32", "float64") and X.size > 0


def count_nonfinite(mod, stream, sms: int, X):
    """The number of NaN and Inf entries of ``X`` (any shape; ``mod``: cupy, or numpy under
    the simulator), or ``None`` for a dtype the kernel does not take."""
    if not _takes(X):
        return None
    k = _build()
    x = mod.reshape(mod.ascontiguousarray(X), (-1,))
    out = mod.zeros((1,), dtype=mod.int64)
    ctas = max(1, min(-(-x.shape[0] // THREADS), _COUNT_CTAS_PER_SM * sms))
    k["count"][ctas, THREADS, stream](x, out)
    return int(out[0])


def factor_scan(mod, stream, A, block: int):
    """``(forbidden, row_any, first, col_any)`` of a square factor ``A`` as
    ``numba_cpu.factor_scan`` gives them (the arrays in ``mod``), or ``None`` for a dtype the
    kernel does not take."""
    if not _takes(A) or A.ndim != 2:
        return None
    k = _build()
    A = mod.ascontiguousarray(A)
    n = A.shape[0]
    bad = mod.empty((n,), dtype=mod.float64)
    first = mod.empty((n,), dtype=mod.int64)
    col = mod.zeros((n,), dtype=mod.uint8)
    k["scan"][n, THREADS, stream](A, n, int(block), True, bad, first, col)
    return float(mod.max(bad)), first < n, first, col != 0


def stack_forbidden(mod, stream, A, block: int):
    """For each factor of the stack ``A`` (k, s, s): the largest ``|entry|`` on or above its
    diagonal or inside a diagonal ``block`` (``(k,)`` in ``mod``; 0 for ``L - I``), or
    ``None`` for a dtype the kernel does not take."""
    if not _takes(A) or A.ndim != 3:
        return None
    kern = _build()
    k, s = A.shape[0], A.shape[-1]
    A2 = mod.reshape(mod.ascontiguousarray(A), (k * s, s))
    bad = mod.empty((k * s,), dtype=mod.float64)
    unused_first, unused_col = mod.zeros((1,), dtype=mod.int64), mod.zeros((1,), dtype=mod.uint8)
    kern["scan"][k * s, THREADS, stream](A2, s, int(block), False, bad, unused_first,
                                         unused_col)
    return mod.max(mod.reshape(bad, (k, s)), axis=1)
