"""One-pass input and result checks on the GPU (numba-cuda): what ``bakron.solve`` and the
stack layer ask of a cupy array before and after a solve, each in one kernel instead of
several cupy passes with their temporaries (docs/engines.md, "Checks on the GPU").

The statistics are those of the numba CPU engine's ``factor_scan`` and ``count_nonfinite``
(``backends/_numba_kernels.py``): the decisions and the messages stay in
``bakron._validate`` and ``bakron.solvers``. Under numba-cuda's simulator the kernels run on
numpy arrays, so CI checks them against the CPU kernels. Compiled, the kernels take raw
device pointers and int64 sizes (one compilation per dtype) and are launched through
``_cuda_launch`` (no type inference or argument conversion per launch); under the simulator
they take flat numpy arrays. Imported by ``numba_cuda`` only when a check runs (importing
it imports ``numba.cuda``).
"""
from __future__ import annotations

import math

import numpy as np

from numba import cuda, float64, int64, types

from ._cuda_runtime import SIM

#: threads per CTA of the kernels (a power of two: the CTA reductions halve it); 8 under
#: the simulator, whose threads are Python threads
THREADS = 8 if SIM else 128
#: at most this many CTAs per SM for the grid-stride count
_COUNT_CTAS_PER_SM = 8
#: ``_stack_scan``: threads that read one row together, the rows a CTA reads at once, and
#: the entries a CTA reads at least (its rows: this many entries rounded up to ``GROUPS``
#: rows)
LANES = min(32, THREADS)
GROUPS = THREADS // LANES
_SCAN_CTA_ENTRIES = 1 << 14

_KERNELS: dict = {}


def _scan(A, n, block, bad, first, col):
    """CTA ``r`` reads row ``r`` of the square ``n x n`` factor ``A``: ``bad[r]``, the
    largest ``|entry|`` from the first column of the row's diagonal block on (on or above
    the diagonal, or inside a diagonal block); ``first[r]``, the first non-zero column left
    of that (``n`` if none); and ``col[j] = 1`` for every column with a non-zero there (a
    benign race: every writer writes 1)."""
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    lim = (r // block) * block
    row = r * n
    b = 0.0
    f = n
    j = t
    while j < n:
        v = A[row + j]
        if j >= lim:
            a = abs(v)
            if a > b:
                b = a
        elif v != 0:
            if j < f:
                f = j
            col[j] = 1
        j += THREADS
    sb = cuda.shared.array(THREADS, float64)
    sf = cuda.shared.array(THREADS, int64)
    sb[t] = b
    sf[t] = f
    cuda.syncthreads()
    h = THREADS // 2
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
        first[r] = sf[0]


def _coarse(A, n, block, first, col, flag):
    """CTA ``c`` looks at tile ``k = c + 1`` just left of the diagonal (rows ``k * block..``,
    columns ``(k - 1) * block..``) of a strictly block-lower ``n x n`` ``A`` whose ``_scan``
    statistics are ``first`` and ``col``: if the tile has live entries (row and column live:
    a non-zero in the row or the column), all of them zero, and a row with a non-zero
    further left, ``flag[c] = 1``, else 0 (``bakron._validate.check_factor_block`` defines
    the signature)."""
    k = cuda.blockIdx.x + 1
    t = cuda.threadIdx.x
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
            if A[r * n + c] != 0:
                z = 1
        i += THREADS
    i = t
    while i < rows:
        if first[r0 + i] < start:
            f = 1
        i += THREADS
    se = cuda.shared.array(THREADS, int64)
    sz = cuda.shared.array(THREADS, int64)
    sf = cuda.shared.array(THREADS, int64)
    se[t] = e
    sz[t] = z
    sf[t] = f
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            se[t] |= se[t + h]
            sz[t] |= sz[t + h]
            sf[t] |= sf[t + h]
        cuda.syncthreads()
        h //= 2
    if t == 0:
        flag[k - 1] = 1.0 if (se[0] != 0 and sz[0] == 0 and sf[0] != 0) else 0.0


def _count_kernel(x, size, out):
    """``out[b]``: the number of NaN and Inf entries CTA ``b`` finds in ``x[:size]``
    (grid-stride; the caller sums the CTAs' counts)."""
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    step = cuda.gridsize(1)
    c = 0
    while i < size:
        v = x[i]
        if v != v or abs(v) == math.inf:
            c += 1
        i += step
    sc = cuda.shared.array(THREADS, int64)
    sc[t] = c
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            sc[t] += sc[t + h]
        cuda.syncthreads()
        h //= 2
    if t == 0:
        out[cuda.blockIdx.x] = sc[0]


def _stack_scan(A, s, block, cpi, rows, bad, cnt):
    """One pass over a stack of square ``s x s`` factors (``A``, C order): CTA ``b`` reads
    rows ``c * rows`` … of factor ``b // cpi`` (``c = b % cpi``; ``cpi`` CTAs per factor),
    groups of ``LANES`` threads one row at a time (a row's entries left of its diagonal
    block, then the others: two loops without a branch on the column), and writes
    ``bad[b]``, the largest ``|entry|`` on or above the diagonal or inside a diagonal
    ``block``, and ``cnt[b]``, its NaN and Inf entries. Thread 0 folds the threads'
    partial results in a loop (few CTAs, long ones: the reduction is not on the clock)."""
    b = cuda.blockIdx.x
    t = cuda.threadIdx.x
    item = b // cpi
    r0 = (b - item * cpi) * rows
    r1 = min(s, r0 + rows)
    lane = t % LANES
    mx = 0.0
    c = 0
    r = r0 + t // LANES
    while r < r1:
        lim = (r // block) * block
        at = (item * s + r) * s
        j = lane
        while j < lim:
            v = A[at + j]
            if v != v or abs(v) == math.inf:
                c += 1
            j += LANES
        j = lim + lane
        while j < s:
            a = abs(A[at + j])
            if a > mx:
                mx = a
            if a != a or a == math.inf:
                c += 1
            j += LANES
        r += GROUPS
    smx = cuda.shared.array(THREADS, float64)
    sc = cuda.shared.array(THREADS, int64)
    smx[t] = mx
    sc[t] = c
    cuda.syncthreads()
    if t == 0:
        for u in range(1, THREADS):
            if smx[u] > mx:
                mx = smx[u]
            c += sc[u]
        bad[b] = mx
        cnt[b] = c


def _signature(name: str, dtname: str) -> tuple:
    """The raw-pointer signature of kernel ``name`` for data of dtype ``dtname``."""
    P = types.CPointer(getattr(types, dtname))
    I64, F64 = types.CPointer(types.int64), types.CPointer(types.float64)
    U8, i = types.CPointer(types.uint8), types.int64
    if name == "scan":
        return (P, i, i, F64, I64, U8)
    if name == "coarse":
        return (P, i, i, I64, U8, F64)
    if name == "stack_scan":
        return (P, i, i, i, i, F64, F64)
    return (P, i, F64)


_SOURCES = {"scan": _scan, "coarse": _coarse, "count": _count_kernel,
            "stack_scan": _stack_scan}


def _kernel(name: str, dtname: str):
    """Kernel ``name`` for ``dtname``, made once: under the simulator its dispatcher; else
    the compiled overload of its raw-pointer signature."""
    key = (name, "sim" if SIM else dtname)
    hit = _KERNELS.get(key)
    if hit is None:
        if SIM:
            hit = cuda.jit(_SOURCES[name])
        else:
            disp = cuda.jit(_signature(name, dtname))(_SOURCES[name])
            hit = next(iter(disp.overloads.values()))
        _KERNELS[key] = hit
    return hit


def _launch(ctx, name: str, dtname: str, ctas: int, *args) -> None:
    """Launch kernel ``name`` on ``ctas`` CTAs of ``THREADS`` threads; arrays in ``args``
    go as flat arrays (simulator) or device pointers, everything else as int64."""
    mod, stream, _, dev = ctx
    kern = _kernel(name, dtname)
    if SIM:
        kern[ctas, THREADS, stream](*(a.reshape(-1) if isinstance(a, mod.ndarray) else int(a)
                                      for a in args))
        return
    from . import _cuda_launch
    _cuda_launch.launch(kern, dev, (ctas, 1, 1), (THREADS, 1, 1), stream,
                        tuple(int(a.data.ptr) if isinstance(a, mod.ndarray) else int(a)
                              for a in args))


def _takes(X) -> bool:
    return str(X.dtype) in ("float32", "float64") and X.size > 0


def _host(x):
    """A device array's values on the host (one copy; numpy as it is)."""
    return x.get() if hasattr(x, "get") else x


def _count_ctas(ctx, size: int) -> int:
    """CTAs of the grid-stride count over ``size`` entries (one partial count each)."""
    return max(1, min(-(-size // THREADS), _COUNT_CTAS_PER_SM * ctx[2]))


def count_nonfinite(ctx, X):
    """The number of NaN and Inf entries of ``X`` (any shape; ``ctx``: ``(array module,
    stream, SM count, device)``, the module cupy, or numpy under the simulator), or ``None``
    for a dtype the kernel does not take."""
    if not _takes(X):
        return None
    x = ctx[0].reshape(ctx[0].ascontiguousarray(X), (-1,))
    out = ctx[0].empty((_count_ctas(ctx, x.shape[0]),), dtype=ctx[0].float64)
    _count(ctx, x, out)
    return int(_host(out).sum())


def _count(ctx, x, out) -> None:
    """Launch the count of the flat ``x``'s NaN and Inf entries, one per CTA into ``out``
    (``_count_ctas`` entries)."""
    _launch(ctx, "count", str(x.dtype), out.shape[0], x, x.shape[0], out)


def factor_scan(ctx, A, block: int):
    """``(forbidden, row_any, first, col_any)`` of a square factor ``A`` as
    ``numba_cpu.factor_scan`` gives them (the arrays in ``mod``), or ``None`` for a dtype the
    kernel does not take."""
    if not _takes(A) or A.ndim != 2:
        return None
    mod = ctx[0]
    A = mod.ascontiguousarray(A)
    n = A.shape[0]
    bad = mod.empty((n,), dtype=mod.float64)
    first = mod.empty((n,), dtype=mod.int64)
    col = mod.zeros((n,), dtype=mod.uint8)
    _launch(ctx, "scan", str(A.dtype), n, A, n, int(block), bad, first, col)
    return float(mod.max(bad)), first < n, first, col != 0


def _scan_layout(s: int) -> tuple:
    """``(rows, cpi)`` of ``_stack_scan`` for factors of side ``s``: the rows a CTA reads
    (``_SCAN_CTA_ENTRIES`` entries at least, whole groups of rows, at most ``s``) and the
    CTAs per factor."""
    rows = -(-_SCAN_CTA_ENTRIES // s)  # enough rows for the entries
    rows = min(s, -(-rows // GROUPS) * GROUPS)  # whole groups, at most the factor
    return rows, -(-s // rows)


def input_checks(ctx, arrays: dict, blocks: dict):
    """The statistics of ``bakron.solve``'s input checks in one go: for each array of
    ``arrays`` (name -> array) the number of NaN and Inf entries; for each factor named in
    ``blocks`` (name -> block) the largest ``|entry|`` where ``L - I`` is zero (0 for a
    factor) and the first tile ``k`` that looks made with a coarser block (0: none; only
    where the factor is larger than its block). Every kernel writes its part of one float64
    array (per-CTA counts, per-row maxima, per-tile flags), read back once: one
    synchronisation instead of one per statistic. ``None`` if an array's dtype is not one
    the kernels take. Returns ``(nonfinite, forbidden, coarse_tile)``, dicts by name."""
    if not all(_takes(X) and X.ndim == 2 for X in arrays.values()):
        return None
    mod = ctx[0]
    flat = {name: mod.reshape(mod.ascontiguousarray(X), (-1,)) for name, X in arrays.items()}
    regions, end = {}, 0
    for name, x in flat.items():
        regions[name, "count"] = (end, end + _count_ctas(ctx, x.shape[0]))
        end = regions[name, "count"][1]
    for name, block in blocks.items():
        n = arrays[name].shape[0]
        regions[name, "bad"] = (end, end + n)
        regions[name, "coarse"] = (end + n, end + n + max(0, -(-n // int(block)) - 1))
        end = regions[name, "coarse"][1]
    buf = mod.empty((end,), dtype=mod.float64)
    part = {key: buf[a:b] for key, (a, b) in regions.items()}
    for name, x in flat.items():
        _count(ctx, x, part[name, "count"])
    for name, block in blocks.items():
        A, n, block = flat[name], arrays[name].shape[0], int(block)  # C order, flattened
        first = mod.empty((n,), dtype=mod.int64)
        col = mod.zeros((n,), dtype=mod.uint8)
        _launch(ctx, "scan", str(A.dtype), n, A, n, block, part[name, "bad"], first, col)
        tiles = part[name, "coarse"].shape[0]
        if tiles:
            _launch(ctx, "coarse", str(A.dtype), tiles, A, n, block, first, col,
                    part[name, "coarse"])
    host = _host(buf)
    got = {key: host[a:b] for key, (a, b) in regions.items()}
    nonfinite = {name: int(got[name, "count"].sum()) for name in flat}
    forbidden = {name: float(got[name, "bad"].max()) for name in blocks}
    coarse = {}
    for name in blocks:
        hit = np.flatnonzero(got[name, "coarse"])
        coarse[name] = int(hit[0]) + 1 if hit.size else 0
    return nonfinite, forbidden, coarse


def stack_checks(ctx, arrays: dict, blocks: dict):
    """The statistics of the stack layer's input checks in one go: for each stack of
    ``arrays`` (name -> ``(k, r, c)`` array) the number of NaN and Inf entries; for each
    factor stack named in ``blocks`` (name -> block) the largest ``|entry|`` of each factor
    where ``L - I`` is zero (``(k,)`` on the host, 0 for a factor). A factor stack is read
    once (``_stack_scan`` counts its NaN and Inf entries too), any other stack by the
    grid-stride count; every kernel writes its part of one float64 array, read back once
    (one synchronisation instead of one per statistic). ``None`` if an array is empty or of
    a dtype the kernels do not take. Returns a function that reads the results back,
    ``(nonfinite, forbidden)`` (dicts by name): the caller does its host work while the
    kernels run."""
    if not all(_takes(X) and X.ndim == 3 for X in arrays.values()):
        return None
    mod = ctx[0]
    flat = {name: mod.reshape(mod.ascontiguousarray(X), (-1,)) for name, X in arrays.items()}
    # a factor stack of k factors s x s: k * cpi CTAs of _stack_scan, one result each
    layout = {name: _scan_layout(arrays[name].shape[-1]) for name in blocks}
    regions, end = {}, 0
    for name, x in flat.items():
        k = arrays[name].shape[0]
        size = k * layout[name][1] if name in blocks else _count_ctas(ctx, x.shape[0])
        regions[name, "count"] = (end, end + size)
        end += size
        if name in blocks:
            regions[name, "bad"] = (end, end + size)
            end += size
    buf = mod.empty((end,), dtype=mod.float64)
    part = {key: buf[a:b] for key, (a, b) in regions.items()}
    for name, x in flat.items():
        if name in blocks:
            k, s = arrays[name].shape[0], arrays[name].shape[-1]
            rows, cpi = layout[name]
            _launch(ctx, "stack_scan", str(x.dtype), k * cpi, x, s, int(blocks[name]), cpi,
                    rows, part[name, "bad"], part[name, "count"])
        else:
            _count(ctx, x, part[name, "count"])

    def read():
        host = _host(buf)
        got = {key: host[a:b] for key, (a, b) in regions.items()}
        nonfinite = {name: int(got[name, "count"].sum()) for name in flat}
        forbidden = {name: got[name, "bad"].reshape(arrays[name].shape[0], -1).max(axis=1)
                     for name in blocks}
        return nonfinite, forbidden
    return read
