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
#: ``input_checks`` stores the first coarse-looking tile ``k`` as ``_FIRST - k`` (an atomic
#: max over a zeroed slot keeps the smallest ``k``)
_FIRST = 1 << 40

_KERNELS: dict = {}


def _build():
    """Compile (once) the two kernels."""
    if _KERNELS:
        return _KERNELS
    nt = THREADS

    @cuda.jit
    def scan(A, item_rows, block, stats, bad, first, col, res, slot):
        """CTA ``r`` reads row ``r`` of ``A`` (rows of a stack of square factors of
        ``item_rows`` rows each): ``bad[r]``, the largest ``|entry|`` from the first column
        of the row's diagonal block on (on or above the diagonal, or inside a diagonal
        block); with ``stats``, ``first[r]``, the first non-zero column left of that (``n``
        if none), and ``col[j] = 1`` for every column with a non-zero there. ``slot >= 0``:
        ``res[slot]`` also counts the rows whose ``bad`` is not zero."""
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
            if slot >= 0 and sb[0] != 0:
                cuda.atomic.add(res, slot, 1)

    @cuda.jit
    def coarse(A, block, first, col, res, slot):
        """CTA ``c`` looks at tile ``k = c + 1`` just left of the diagonal (rows
        ``k * block..``, columns ``(k - 1) * block..``) of a strictly block-lower ``A``
        whose ``scan`` statistics are ``first`` and ``col``: if the tile has live
        entries (row and column live: a non-zero in the row or the column), all of them
        zero, and a row with a non-zero further left, ``res[slot]`` keeps
        ``_FIRST - k`` for the smallest such ``k`` (``bakron._validate.check_factor_block``
        defines the signature)."""
        k = cuda.blockIdx.x + 1
        t = cuda.threadIdx.x
        n = A.shape[0]
        r0 = k * block
        rows = min(block, n - r0)
        start = r0 - block
        e = 0
        z = 0
        f = 0
        i = t
        while i < rows * block:
            r = r0 + i // block
            c = start + i % block
            if (first[r] < n or col[r] != 0) and (first[c] < n or col[c] != 0):
                e = 1
                if A[r, c] != 0:
                    z = 1
            i += nt
        i = t
        while i < rows:
            if first[r0 + i] < start:
                f = 1
            i += nt
        se = cuda.shared.array(nt, int64)
        sz = cuda.shared.array(nt, int64)
        sf = cuda.shared.array(nt, int64)
        se[t] = e
        sz[t] = z
        sf[t] = f
        cuda.syncthreads()
        h = nt // 2
        while h > 0:
            if t < h:
                se[t] |= se[t + h]
                sz[t] |= sz[t + h]
                sf[t] |= sf[t + h]
            cuda.syncthreads()
            h //= 2
        if t == 0 and se[0] != 0 and sz[0] == 0 and sf[0] != 0:
            cuda.atomic.max(res, slot, _FIRST - k)

    @cuda.jit
    def count(x, out, slot):
        """``out[slot] +=`` the number of NaN and Inf entries of the 1-D ``x``
        (grid-stride)."""
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
            cuda.atomic.add(out, slot, sc[0])

    _KERNELS.update(scan=scan, count=count, coarse=coarse)
    return _KERNELS


def _takes(X) -> bool:
    return str(X.dtype) in ("float32", "float64") and X.size > 0


def count_nonfinite(mod, stream, sms: int, X):
    """The number of NaN and Inf entries of ``X`` (any shape; ``mod``: cupy, or numpy under
    the simulator), or ``None`` for a dtype the kernel does not take."""
    if not _takes(X):
        return None
    out = mod.zeros((1,), dtype=mod.int64)
    _count(mod, stream, sms, X, out, 0)
    return int(out[0])


def _count(mod, stream, sms: int, X, out, slot: int) -> None:
    """Launch the count of ``X``'s NaN and Inf entries into ``out[slot]``."""
    x = mod.reshape(mod.ascontiguousarray(X), (-1,))
    ctas = max(1, min(-(-x.shape[0] // THREADS), _COUNT_CTAS_PER_SM * sms))
    _build()["count"][ctas, THREADS, stream](x, out, slot)


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
    unused = mod.zeros((1,), dtype=mod.int64)
    k["scan"][n, THREADS, stream](A, n, int(block), True, bad, first, col, unused, -1)
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
                                         unused_col, mod.zeros((1,), dtype=mod.int64), -1)
    return mod.max(mod.reshape(bad, (k, s)), axis=1)


def input_checks(mod, stream, sms: int, arrays: dict, blocks: dict):
    """The statistics of ``bakron.solve``'s input checks in one go: for each array of
    ``arrays`` (name -> array) the number of NaN and Inf entries; for each factor named in
    ``blocks`` (name -> block) the number of rows with a non-zero where ``L - I`` is zero,
    and the first tile ``k`` that looks made with a coarser block (0: none; only where the
    factor is larger than its block). Every kernel adds into one small array, read back once
    (one synchronisation instead of one per statistic). ``None`` if an array's dtype is not
    one the kernels take. Returns ``(nonfinite, forbidden_rows, coarse_tile)``, dicts."""
    if not all(_takes(X) and X.ndim == 2 for X in arrays.values()):
        return None
    kern = _build()
    names = list(arrays)
    res = mod.zeros((len(names) + 2 * len(blocks),), dtype=mod.int64)
    for i, name in enumerate(names):
        _count(mod, stream, sms, arrays[name], res, i)
    slots = {}
    for j, (name, block) in enumerate(blocks.items()):
        A = mod.ascontiguousarray(arrays[name])
        n, block = A.shape[0], int(block)
        f, c = len(names) + 2 * j, len(names) + 2 * j + 1
        slots[name] = (f, c)
        bad = mod.empty((n,), dtype=mod.float64)
        first = mod.empty((n,), dtype=mod.int64)
        col = mod.zeros((n,), dtype=mod.uint8)
        kern["scan"][n, THREADS, stream](A, n, block, True, bad, first, col, res, f)
        if n > block:
            kern["coarse"][-(-n // block) - 1, THREADS, stream](A, block, first, col, res, c)
    host = res.get() if hasattr(res, "get") else res
    nonfinite = {name: int(host[i]) for i, name in enumerate(names)}
    forbidden = {name: int(host[f]) for name, (f, _) in slots.items()}
    coarse = {name: (_FIRST - int(host[c]) if host[c] else 0) for name, (_, c) in slots.items()}
    return nonfinite, forbidden, coarse
