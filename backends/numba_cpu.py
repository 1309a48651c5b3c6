"""The numba CPU engine: compiled base blocks, the recursion driving BLAS, the baselines.

Selected by ``bakron.solve(..., engine="numba")``, and by ``engine="auto"`` for numpy inputs
with a :class:`bakron.UniformQuantizer` when numba imports (``CAPABILITIES``). numba is
imported only when this engine first runs (``import bakron`` never imports it).

What runs compiled (``backends/_numba_kernels.py``):

* the base block (two-sided: row tiles bottom-up, the rows below pushed through one small
  GEMM, then a one-sided sweep right to left with the quantizer fused; one-sided: every row
  tile in parallel);
* ``method="recursive"``: the recursion plan of ``bakron.solvers.schedule`` as an op table
  of base blocks and feedback updates, executed in one compiled call. Updates are BLAS GEMMs
  accumulating in place (``beta = 1``) into one buffer that holds the offsets ``F`` of
  unsolved blocks and the errors ``E`` of solved ones; products with the unit-triangular
  diagonal blocks of ``G`` skip their zero triangle (panels). Extra memory: that buffer
  (``m n``) plus at most ``m n / 3`` of scratch, besides the outputs;
* ``method="wavefront"``: the two-level wavefront of ``bakron.solvers.schedule.two_level``
  (coarse blocks of ``base`` tiles): per coarse step a task table of its independent blocks,
  solved in a numba ``prange`` (each block by the base-block kernel on one thread), with the
  feedback products between steps cut into pieces (the gathers: partial products over
  chunks of the inner dimension, ``gather_table``; the scatters: row pieces), also in
  ``prange``s, each piece one single-threaded BLAS call (BLAS is set to one thread
  meanwhile, ``_blas_on_one_thread``) (docs/engines.md, "Many cores");
* ``factor_scan``, ``count_nonfinite``: the statistics of ``bakron.solve``'s input and result
  checks in one parallel pass each;
* ``method="antidiagonal"``: the accumulator variant (one step per anti-diagonal, the tiles
  of a diagonal one after the other) and the direct variant (two BLAS products per tile).

Every kernel is compiled with ``nogil=True``: independent solves (the items of a stack) may
run on Python threads at once (``stack_threads``).

Rounding is bit-identical to :meth:`bakron.UniformQuantizer.quantize` for a given target;
the targets themselves are sums in another order than the array-API path, so results agree
exactly in float64 and up to near-ties in float32 (docs/algorithm.md, "float32").
"""
from __future__ import annotations

import functools
import importlib.util
import os
import threading
from contextlib import contextmanager

import numpy as np

__all__ = ["NAME", "CAPABILITIES", "available", "run", "auto_base", "auto_method", "op_table",
           "wavefront_table", "gather_table", "factor_scan", "count_nonfinite", "quiet_blas",
           "stack_threads", "threading_layer", "warm_up", "WAVEFRONT_MIN_THREADS", "WAVEFRONT_ONE_SIDED_MIN_THREADS",
           "WAVEFRONT_MIN_WORK", "STACK_THREADS_MIN_WORK"]

from bakron.solvers.engines import (COUNT_NONFINITE, FACTOR_SCAN, QUIET_BLAS, STACK_THREADS,
                                    UNIFORM_FUSED, Capabilities, EngineResult)
from bakron.solvers.options import NumbaOptions, environment
from bakron.solvers.schedule import (AFTER_BC, AFTER_BOTTOM, AFTER_D, AFTER_RIGHT, Block,
                                     RecursionPlan, two_level)

NAME = "numba"
CAPABILITIES = Capabilities(methods=("antidiagonal", "recursive", "wavefront"),
                            variants=("accumulator", "direct"), namespaces=("numpy",),
                            quantizers=UNIFORM_FUSED,
                            hooks=(QUIET_BLAS, COUNT_NONFINITE, FACTOR_SCAN, STACK_THREADS))

# Tuning (``NumbaOptions``, read from the problem: ``p.options_for(NumbaOptions)``): the
# panel width of the triangular products (``panel``), the base block's side in elements for
# ``base=None`` (``base_elements``), the wavefront's gather pieces (``gather_*``). Measured:
# docs/engines.md.

_kernel_module = None


def _passive_openmp() -> None:
    """Let numba's OpenMP workers sleep, rather than spin, between parallel regions:
    ``OMP_WAIT_POLICY=PASSIVE`` unless the caller set it, before an OpenMP runtime is loaded
    (it reads the variable once, when it loads). Spinning workers took the cores from BLAS's
    threads between the wavefront's steps (docs/engines.md, "Many cores")."""
    if environment("OMP_WAIT_POLICY") is not None:
        return
    try:
        with open("/proc/self/maps") as fh:
            maps = fh.read()
        if "libgomp" in maps or "libiomp" in maps:
            return  # loaded already: the variable would have no effect
    except OSError:
        pass
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _kernels():
    """The compiled kernels (imports numba; compiles or loads from the on-disk cache)."""
    global _kernel_module
    if _kernel_module is None:
        _passive_openmp()
        from . import _numba_kernels
        _kernel_module = _numba_kernels
    return _kernel_module


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


# ---------------------------------------------------------------------------------------
class _Operands:
    """The arrays and scalars every kernel takes, prepared once per solve; the outputs
    (``Wq``, ``codes``, ``T``) are new arrays of this solve."""

    def __init__(self, p):
        dt = p.W.dtype
        self.dtype = dt
        self.W = p.W
        self.AO = None if p.A_O is None else np.ascontiguousarray(p.A_O)
        self.AI = np.ascontiguousarray(p.A_I)
        self.dummy = np.zeros((1, 1), dtype=dt)
        self.Wq = np.empty((p.m, p.n), dtype=dt)
        self.codes = np.empty((p.m, p.n), dtype=np.int16)
        self.record_targets = p.record_targets
        self.T = np.empty((p.m, p.n), dtype=dt) if p.record_targets else self.dummy
        q = p.quantizer
        self.quantizer = q
        self.tile = (p.tx, p.ty)
        s, z = q.tables(np, "cpu", dt)
        self.s = np.ascontiguousarray(s)
        self.z = self.dummy if z is None else np.ascontiguousarray(z)

    def tables(self):
        """The quantizer's tables: scales, zero points (a placeholder when symmetric)."""
        return self.s, self.z

    def params(self, flags: int = 0, panel: int = 0):
        """The kernels' parameter vector ``prm`` (``_numba_kernels.params``) of this solve,
        with ``flags`` besides those of the problem (two-sided, asymmetric grid, targets)."""
        K = _kernels()
        q = self.quantizer
        flags |= (K.TWO_SIDED if self.AO is not None else 0) | \
            (0 if q.symmetric else K.ASYM) | (K.HAS_T if self.record_targets else 0)
        return K.params(flags=flags, tile=self.tile, group_size=q.group_size or 1,
                        code_range=q.code_range, panel=panel)

    def result(self) -> EngineResult:
        return EngineResult(values=self.Wq, codes=self.codes,
                            targets=self.T if self.record_targets else None,
                            info={"quantizer_calls": 0})


def op_table(plan: RecursionPlan):
    """The recursion plan as the op table of ``run_plan``: rows ``[op, r0, r_, r1, c0, c_,
    c1, scratch offset]`` (elements; op ``OP_LEAF`` or the ``OP_*`` of the update kind, defined
    with the kernel), in the plan's depth-first order; returns ``(table, scratch size)``.
    Scratch: one region per recursion level, so that a quadrant node keeps
    ``X = E_D A_I[C2, C1]`` while its B and C are solved."""
    K = _kernels()
    code = {AFTER_D: K.OP_AFTER_D, AFTER_BC: K.OP_AFTER_BC, AFTER_RIGHT: K.OP_AFTER_RIGHT,
            AFTER_BOTTOM: K.OP_AFTER_BOTTOM}
    R, C = plan.rows, plan.cols
    rows: list[list[int]] = []
    levels: list[int] = []
    sizes: dict[int, int] = {}
    for op in plan.sequence:
        if isinstance(op, Block):
            rows.append([K.OP_LEAF, R[op.ra], 0, R[op.rb], C[op.ca], 0, C[op.cb], 0])
            levels.append(-1)
            continue
        r0, r_, r1 = op.rows
        c0, c_, c1 = op.cols
        if op.kind in (AFTER_D, AFTER_BC):
            need = ((r1 - r_) * (c1 - c_), (r1 - r_) * (c_ - c0), (r_ - r0) * (c_ - c0))
        elif op.kind == AFTER_RIGHT:
            need = ((r1 - r0) * (c_ - c0),) if plan.two_sided else (0,)
        else:
            need = ((r1 - r_) * (c1 - c0),)
        sizes[op.level] = max(sizes.get(op.level, 0), *need)
        rows.append([code[op.kind], r0, r_, r1, c0, c_, c1, 0])
        levels.append(op.level)
    offset, total = {}, 0
    for lev in sorted(sizes):
        offset[lev] = total
        total += sizes[lev]
    table = np.array(rows, dtype=np.int64).reshape(-1, 8)
    for row, lev in zip(table, levels):
        row[7] = offset.get(lev, 0)
    return table, total


@functools.lru_cache(maxsize=32)
def _cached_table(m: int, n: int, tx: int, ty: int, base: int, two: bool):
    """``op_table`` of the recursion plan, built once per shape (the kernel only reads it)."""
    from bakron.solvers.schedule import tile_edges

    return op_table(RecursionPlan(tile_edges(m, tx), tile_edges(n, ty), base, two))


def wavefront_table(rows: list, cols: list, base: int, two_sided: bool):
    """The coarse steps of ``schedule.two_level`` over the tiles with edges ``rows`` and
    ``cols`` as the task table of ``run_wavefront``: ``tasks`` rows ``[r0, r1, c0, c1]``
    (elements), one per block, step after step, and ``steps`` (the first task of every
    step, then the number of tasks)."""
    coarse = two_level(len(rows) - 1, len(cols) - 1, base, two_sided)
    tasks = np.array([[rows[b.ra], rows[b.rb], cols[b.ca], cols[b.cb]]
                      for st in coarse for b in st.blocks], dtype=np.int64).reshape(-1, 4)
    steps = np.cumsum([0] + [len(st.blocks) for st in coarse]).astype(np.int64)
    return tasks, steps


def gather_table(tasks, steps, m: int, n: int, two_sided: bool, opts: NumbaOptions = None):
    """The gathers of ``run_wavefront`` as tables, step after step.

    Step ``s`` gathers the offsets of its blocks from every block solved before:
    two-sided ``F_AB = Y[A, cB] + Y[A, c0:] A_I[c0:, cB]`` per block (the accumulator
    ``Y = G_O^T Ẽ``; none at step 0), one-sided ``F[:, cB] = E[:, c1:] A_I[c1:, cB]`` for the
    step's coarse column. Each is cut into *targets* of at most ``opts.gather_rows`` rows
    (fewer while the step has under ``opts.gather_min_pieces`` pieces, down to
    ``opts.gather_min_rows``: a property of the problem, not of the thread count), each
    target's inner dimension into chunks of ``opts.gather_k``: the *pieces*, each a partial
    product on one thread, summed in a fixed order afterwards: large pieces for BLAS, enough
    of them for many threads, the same sums on any number of threads (docs/engines.md,
    "Many cores"). ``opts``: the ``NumbaOptions`` (default: ``NumbaOptions()``).

    Returns ``gt`` (targets: ``[r0, r1, c0, c1, q0, q1]``, their pieces ``gp[q0:q1]``),
    ``gsteps`` (step ``s``'s targets are ``gt[gsteps[s]:gsteps[s + 1]]``), ``gp`` (pieces:
    ``[target, k0, k1, offset]``, the offset of its partial product in the scratch
    buffer, from the step's start), ``psteps`` (the same for pieces) and the scratch size
    in elements (the largest step's).
    """
    opts = NumbaOptions() if opts is None else opts
    gk = opts.gather_k
    gt, gp, gsteps, psteps, size = [], [], [0], [0], 0
    for s in range(len(steps) - 1):
        blocks = tasks[steps[s]:steps[s + 1]]
        if two_sided:
            spans = [] if s == 0 else [(r0, r1, c0, c1, c0) for r0, r1, c0, c1 in blocks]
        else:
            c0, c1 = int(blocks[0, 2]), int(blocks[0, 3])
            spans = [(0, m, c0, c1, c1)] if c1 < n else []
        h = opts.gather_rows
        while h > opts.gather_min_rows and _piece_count(spans, h, n, gk) < opts.gather_min_pieces:
            h //= 2
        off = 0
        for r0, r1, c0, c1, k0 in spans:
            for a in range(int(r0), int(r1), h):
                b = min(a + h, int(r1))
                q0 = len(gp)
                for k in range(int(k0), n, gk):
                    gp.append((len(gt), k, min(k + gk, n), off))
                    off += (b - a) * int(c1 - c0)
                gt.append((a, b, int(c0), int(c1), q0, len(gp)))
        size = max(size, off)
        gsteps.append(len(gt))
        psteps.append(len(gp))
    i64 = functools.partial(np.array, dtype=np.int64)
    return (i64(gt).reshape(-1, 6), i64(gsteps), i64(gp).reshape(-1, 4), i64(psteps),
            max(size, 1))


def _piece_count(spans, h: int, n: int, gk: int) -> int:
    """Pieces of the gathers ``spans`` with targets ``h`` rows high and chunks of ``gk``
    (``gather_table``)."""
    return sum(-(-(int(r1) - int(r0)) // h) * -(-(n - int(k0)) // gk)
               for r0, r1, _, _, k0 in spans)


@functools.lru_cache(maxsize=32)
def _cached_wavefront(m: int, n: int, tx: int, ty: int, base: int, two: bool,
                      opts: NumbaOptions):
    """The wavefront's tables, built once per shape and options."""
    from bakron.solvers.schedule import tile_edges

    rows, cols = tile_edges(m, tx), tile_edges(n, ty)
    tasks, steps = wavefront_table(rows, cols, base, two)
    return (tasks, steps) + gather_table(tasks, steps, m, n, two, opts)


def run(p, method: str, base: int, variant: str) -> EngineResult:
    """Run ``method`` (``recursive``, ``wavefront`` or ``antidiagonal``) compiled; new arrays
    out."""
    if not CAPABILITIES.runs(method, variant):
        raise ValueError(f"method={method!r} is not available on engine {NAME!r}")
    with _parallel_guard():
        return _run(p, method, base, variant)


def _run(p, method: str, base: int, variant: str) -> EngineResult:
    K = _kernels()
    opts = p.options_for(NumbaOptions)
    io = _Operands(p)                          # inputs, outputs and grid of the kernels
    two = io.AO is not None
    AO = io.AO if two else io.dummy
    if method == "antidiagonal":
        prm = io.params()
        if variant == "direct":
            E = np.empty((p.m, p.n), dtype=io.dtype)     # the errors, kept in full
            K.antidiagonal_direct(io.W, io.dummy, AO, io.AI, io.Wq, io.codes, io.T, E,
                                  *io.tables(), prm)
        elif two:
            Y = np.empty((p.m, p.n), dtype=io.dtype)     # the accumulator G_O^T Ẽ
            K.antidiagonal_accumulator(io.W, io.dummy, AO, io.AI, io.Wq, io.codes, io.T, Y,
                                       *io.tables(), prm)
        else:  # one-sided accumulator: the column sweep, row tiles in parallel if it pays
            block = K.base_one_sided_par if p.m * p.n * p.n >= 2 * K.PAR_MIN_WORK else \
                K.base_one_sided
            block(io.W, io.dummy, io.AI, io.Wq, io.codes, io.T, io.dummy, *io.tables(), prm,
                  0, p.m, 0, p.n)
        return io.result()
    if method == "wavefront":
        tasks, steps, gt, gsteps, gp, psteps, size = _cached_wavefront(
            p.m, p.n, p.tx, p.ty, int(base), two, opts)
        FE = np.zeros((p.m, p.n), dtype=io.dtype)  # offsets of unsolved blocks, then errors
        Y = np.zeros((p.m, p.n), dtype=io.dtype) if two else io.dummy  # G_O^T Ẽ
        part = np.empty(size, dtype=io.dtype)      # the gathers' partial products
        with _blas_on_one_thread() as blas1:
            prm = io.params(K.HAS_F | K.WRITE_E | (K.BLAS1 if blas1 else 0))
            K.run_wavefront(tasks, steps, gt, gsteps, gp, psteps, io.W, FE, Y, AO, io.AI,
                            io.Wq, io.codes, io.T, part, *io.tables(), prm)
        out = io.result()
        out.info.update(coarse_steps=int(steps.shape[0] - 1), blocks=int(tasks.shape[0]),
                        numba_threads=numba_threads(), threading_layer=threading_layer())
        return out
    ops, scratch = _cached_table(p.m, p.n, p.tx, p.ty, int(base), two)
    FE = np.zeros((p.m, p.n), dtype=io.dtype)  # offsets F of unsolved blocks, errors E of solved
    buf = np.empty(max(scratch, 1), dtype=io.dtype)
    K.run_plan(ops, io.W, FE, AO, io.AI, io.Wq, io.codes, io.T, buf, *io.tables(),
               io.params(K.HAS_F | K.WRITE_E, panel=opts.panel))
    return io.result()


_PIN_LOCK = threading.Lock()
#: solves inside _blas_on_one_thread, BLAS's thread count before them, whether the first one
#: ended BLAS's workers
_pinned = [0, None, False]


def _alone() -> bool:
    """This is the only Python thread but for the input checks' pool (``bakron._validate``:
    ``bakron-check`` threads, which run numpy reductions, never BLAS), so no other thread
    can be inside a BLAS call while BLAS's workers are ended (``_end_blas_workers``)."""
    from bakron._validate import CHECK_THREADS

    me = threading.current_thread()
    return all(t is me or t.name.startswith(CHECK_THREADS) for t in threading.enumerate())


def _end_blas_workers(K) -> bool:
    """End numpy's OpenBLAS's worker threads now (``blas_thread_shutdown_``) if no other
    thread can be inside BLAS (``_alone``); its next multi-threaded call (or thread-count
    change) starts them again. Returns whether it did. The caller holds
    ``_PIN_LOCK``.

    Why: OpenBLAS's idle workers spin, yielding, for about 2^28 cycles after each
    multi-threaded call (``OPENBLAS_THREAD_TIMEOUT``, read when numpy loads), and meanwhile
    they take the cores from numba's threads: a solve right after a multi-threaded numpy
    product ran several times slower (docs/engines.md, "Many cores")."""
    if K.BLAS_POOL_STOP is None or not _alone():
        return False
    K.BLAS_POOL_STOP()
    return True


def quiet_blas() -> None:
    """Before a solve's compiled checks (``bakron.solve``): end OpenBLAS's idle workers when
    BLAS runs on several threads and no solve is inside ``_blas_on_one_thread``
    (``_end_blas_workers``)."""
    K = _kernels()
    if K.BLAS_THREADS is None:
        return
    with _PIN_LOCK:
        if _pinned[0] == 0 and int(K.BLAS_THREADS[0]()) > 1:
            _end_blas_workers(K)


@contextmanager
def _blas_on_one_thread():
    """BLAS (numpy's OpenBLAS, the kernels' own) set to one thread while the block runs, so
    that the wavefront's gathers and scatters run as single-threaded BLAS calls on numba's
    threads; yields whether it could (else the kernels split their products below
    OpenBLAS's threading threshold). The setting is process-wide: numpy products on other
    threads meanwhile run on one thread too. Nested and concurrent solves count in and out;
    the last restores the count the first found.

    When the count was above one, the first solve in also ends BLAS's idle workers
    (``_end_blas_workers``). Restoring the count starts new ones, which would spin through
    the result check and the next solve's checks, so the last one out ends them again
    (OpenBLAS starts them once more at its next multi-threaded call)."""
    K = _kernels()
    fns = K.BLAS_THREADS
    if fns is None:
        yield False
        return
    get, put = fns
    with _PIN_LOCK:
        if _pinned[0] == 0:
            _pinned[1] = int(get())
            put(1)
            _pinned[2] = _pinned[1] > 1 and _end_blas_workers(K)
        _pinned[0] += 1
    try:
        yield True
    finally:
        with _PIN_LOCK:
            _pinned[0] -= 1
            if _pinned[0] == 0:
                put(_pinned[1])
                if _pinned[2]:
                    _end_blas_workers(K)


def factor_scan(A, block: int):
    """The statistics the input checks of :func:`bakron.solve` need of a numpy factor, in
    one parallel compiled pass (``_numba_kernels.factor_scan``) instead of several numpy
    passes: ``(forbidden, row_any, first, col_any)`` -- the largest ``|entry|`` on or above
    the diagonal or inside a diagonal ``block``, and, over the rest of the matrix, per row
    whether it has a non-zero and its first non-zero column (``n`` if none), per column
    whether it has one. ``None`` for a dtype the kernels do not take; the array-API checks
    compute the same then. Measured: docs/engines.md, "Many cores"."""
    out = _scan_rows("factor_scan", A, int(block))
    if out is None:
        return None
    bad, row_any, first, col_any = out
    return float(bad), row_any, first, col_any


def count_nonfinite(X):
    """The number of NaN and Inf entries of a 2-D float32/float64 numpy array in one parallel
    compiled pass (``_numba_kernels.count_nonfinite``), for the input and result checks of
    :func:`bakron.solve`; ``None`` for other arrays (the array-API check counts then)."""
    out = _scan_rows("count_nonfinite", X)
    return None if out is None else int(out)


def _scan_rows(kernel: str, X, *args):
    """Run the one-pass check kernel ``kernel`` on the rows of a non-empty 2-D float32/64
    ``X`` (C-contiguous, copied if not), its rows in ``8 x`` numba's threads chunks;
    ``None`` for other arrays."""
    if X.dtype not in (np.float32, np.float64) or X.ndim != 2 or X.shape[0] == 0:
        return None
    X = np.ascontiguousarray(X)
    chunks = max(1, min(X.shape[0], 8 * numba_threads()))
    with _parallel_guard():
        return getattr(_kernels(), kernel)(X, *args, chunks)


def auto_base(p) -> int:
    """Base-block size in tiles for ``base=None``: a block of about ``base_elements``
    (``NumbaOptions``) elements a side (tiles ``t_x x t_y`` count as ``sqrt(t_x t_y)``)."""
    be = p.options_for(NumbaOptions).base_elements
    return max(1, int(round(be / float(np.sqrt(p.tx * p.ty)))))


#: ``method="auto"`` takes the anti-diagonal accumulator for two-sided problems with tiles of
#: at least this many elements and at most ``ANTIDIAGONAL_MAX_WORK`` = m n (m + n); the
#: recursion otherwise. Measured: docs/engines.md.
ANTIDIAGONAL_MIN_TILE = 256
ANTIDIAGONAL_MAX_WORK = 2 * 512 ** 3


#: ``method="auto"`` takes the two-level wavefront for two-sided problems when numba has at
#: least ``WAVEFRONT_MIN_THREADS`` threads, for one-sided ones from
#: ``WAVEFRONT_ONE_SIDED_MIN_THREADS``, and m n (m + n) >= ``WAVEFRONT_MIN_WORK`` (and the
#: anti-diagonal rule above has not applied). Measured on the 16-core device host and the
#: 2-core machine (docs/engines.md, "Many cores"), tile 16: two-sided from 1024² up, the
#: wavefront was 1.1-1.4x faster than the recursion on 2 and 4 threads with the previous
#: gathers and scatters, and is 1.5x (1024²) and 2.1x (2048²) faster on 16 now; on 1 thread
#: the recursion is faster at 4096² (2640 vs 2817 ms). One-sided 2048²: the
#: wavefront took 0.79x the recursion's time on 4 threads and 0.43x on 16; on 2 threads, tile
#: 1, shapes 192x576 to 1536x576, 0.7-1.2x (no clear gain), so one-sided problems on 2-3
#: threads keep the recursion.
WAVEFRONT_MIN_THREADS = 2
WAVEFRONT_ONE_SIDED_MIN_THREADS = 4
WAVEFRONT_MIN_WORK = 2 * 512 ** 3


def numba_threads() -> int:
    """numba's thread count for the calling thread (what a ``prange`` uses)."""
    import numba

    return int(numba.get_num_threads())


def auto_method(p, base: int) -> str:
    """``method="auto"`` on this engine (measurements in docs/engines.md): the serial
    accumulator wavefront (one small BLAS product per tile and step) is as fast as or faster
    than the recursion up to about 512 x 512 with 16 x 16 tiles, and slower for smaller tiles
    (per-tile overhead) or larger matrices (its products cannot use the second core); with
    several threads and a large problem the two-level wavefront, whose blocks of one coarse
    step run in parallel (``WAVEFRONT_*``; one-sided problems from more threads than
    two-sided); the recursion everywhere else."""
    if (p.two_sided and p.tx * p.ty >= ANTIDIAGONAL_MIN_TILE
            and p.m * p.n * (p.m + p.n) <= ANTIDIAGONAL_MAX_WORK):
        return "antidiagonal"
    least = WAVEFRONT_MIN_THREADS if p.two_sided else WAVEFRONT_ONE_SIDED_MIN_THREADS
    if p.m * p.n * (p.m + p.n) >= WAVEFRONT_MIN_WORK and numba_threads() >= least:
        return "wavefront"
    return "recursive"


#: Stack items run on several Python threads (the kernels release the GIL) only when one
#: item has at least this much work m n (m + n). Measured on the 16-core device host
#: (docs/stacks.md, "Threads"): 64 x 256² on 4 / 16 workers 2.0x / 1.9x faster than on one;
#: 64 x 128² no faster on 4 (34 vs 35 ms) and slower on 16 (41 vs 35 ms).
STACK_THREADS_MIN_WORK = 2 * 256 ** 3

#: numba threading layers that may run parallel regions from several threads at once
THREAD_SAFE_LAYERS = ("tbb", "omp")

_layer = None        # numba's answer, once a parallel region has run
_predicted = None    # the layer numba will load, before that


def threading_layer() -> str:
    """The threading layer numba runs ``prange`` on: ``tbb``, ``omp`` or ``workqueue``.

    Once a parallel region has run, numba's answer; before, the layer numba will load (its
    ``THREADING_LAYER`` setting and priority, the first whose module imports), so that asking
    does not start a thread pool (an OpenMP pool would make a later ``fork`` unsafe)."""
    global _layer, _predicted
    if _layer is None:
        import numba

        try:
            _layer = numba.threading_layer()
        except ValueError:  # no parallel region has run yet
            if _predicted is None:
                _predicted = _predict_layer(numba)
            return _predicted
    return _layer


def _predict_layer(numba) -> str:
    """The layer numba's first parallel launch will load (a failed import of a missing
    layer costs milliseconds, so ``threading_layer`` keeps the answer). Importing the omp
    layer loads the OpenMP runtime: its wait policy is set first."""
    _passive_openmp()
    want = str(numba.config.THREADING_LAYER).lower()
    candidates = {"safe": ["tbb"], "threadsafe": ["tbb", "omp"],
                  "forksafe": ["tbb", "workqueue"]}.get(
        want, [want] if want in ("tbb", "omp", "workqueue")
        else list(numba.config.THREADING_LAYER_PRIORITY))
    for name in candidates:
        if name == "workqueue":
            return name
        try:
            importlib.import_module("numba.np.ufunc." + ("tbbpool" if name == "tbb"
                                                         else "omppool"))
        except ImportError:
            continue
        return name
    return "workqueue"


_WORKQUEUE_LOCK = threading.Lock()


@contextmanager
def _parallel_guard():
    """numba's ``workqueue`` layer aborts the process when two threads enter parallel regions
    at once: under it a solve holds a lock (solves from several threads, e.g. a stack with an
    explicit ``workers=``, then run one at a time); under tbb and omp nothing is locked."""
    if threading_layer() in THREAD_SAFE_LAYERS:
        yield
        return
    with _WORKQUEUE_LOCK:
        yield


def stack_threads(chunk, cores: int) -> int:
    """Threads on which the stack layer runs the items of ``chunk`` (1: one after the other).

    Several only with at least 2 items, 2 cores, per-item work m n (m + n) of at least
    ``STACK_THREADS_MIN_WORK`` and a thread-safe numba threading layer (tbb or omp; under
    ``workqueue`` two threads in parallel regions at once would abort the process, so the
    items run serially). Every item is solved exactly as alone; numba and BLAS get
    ``cores // threads`` threads each meanwhile."""
    items = int(chunk.stop - chunk.start)
    m, n = (int(s) for s in chunk.W.shape[-2:])
    if items < 2 or cores < 2 or m * n * (m + n) < STACK_THREADS_MIN_WORK:
        return 1
    if threading_layer() not in THREAD_SAFE_LAYERS:
        return 1
    return min(items, cores)


def warm_up() -> None:
    """Compile (or load from cache) every kernel for float32 and float64 on a tiny problem:
    what ``bakron.solve(..., engine="numba")`` runs (the checks' passes, every method),
    called here directly so that the engine does not import the public API above it."""
    from bakron import _xp
    from bakron.quantizers import UniformQuantizer
    from bakron.solvers._problem import Problem

    quiet_blas()
    rng = np.random.default_rng(0)
    for dt in (np.float32, np.float64):
        W = rng.standard_normal((8, 8)).astype(dt)
        A = np.tril(rng.standard_normal((8, 8)), -2).astype(dt)
        q = UniformQuantizer(2, 0.5)
        count_nonfinite(W)
        factor_scan(A, 2)
        for A_out in (A, None):
            for method, variant in (("recursive", "accumulator"), ("antidiagonal", "accumulator"),
                                    ("antidiagonal", "direct"), ("wavefront", "accumulator")):
                p = Problem(_xp.namespace(W), W, A_out, A, q, (2, 2))
                count_nonfinite(run(p, method, 1, variant).values)
