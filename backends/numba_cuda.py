"""The CUDA engine: numba-cuda kernels for the base blocks, cuBLAS (through cupy) for the GEMMs.

Selected by ``bakron.solve(..., engine="cuda")`` and by ``engine="auto"`` for cupy inputs with a
:class:`bakron.UniformQuantizer`. cupy arrays in, cupy arrays out, on the caller's device and
current stream. This is the one module that imports ``numba.cuda`` (lazily: ``import bakron``
never does). Under numba-cuda's simulator (``NUMBA_ENABLE_CUDASIM=1`` set before numba is
imported) the same kernels run on numpy arrays, with the GEMMs emulated on the host through the
same pointer/leading-dimension arithmetic, so CI without a GPU exercises the code.

Methods (all give the same Ŵ, exactly in float64; see ``backends/_cuda_kernels.py`` for the
kernel and ``bakron/solvers/schedule.py`` for the schedules it executes):

``antidiagonal`` (variant ``accumulator``)
    the tile-level accumulator wavefront over the whole matrix in ONE cooperative launch
    (``M + N - 1`` grid-synchronised steps). The project's anti-diagonal solver on the GPU:
    the baseline the speed-ups are quoted against. ``variant="direct"`` falls back to the
    array-API engine (``solve(engine="auto")``; not in this engine's table).
``wavefront`` (two-level; reached through ``method="auto"``)
    the accumulator anti-diagonal over coarse blocks of ``base`` x ``base`` tiles: per coarse
    diagonal one batched cuBLAS GEMM forms the base targets of all its blocks from the global
    accumulator ``Yg = G_O^T Ẽ``, one launch solves all its blocks (tile wavefront inside,
    quantizer fused), one batched GEMM pushes their errors into ``Yg``. ``M_c + N_c - 1``
    coarse steps, each ``2 base - 1`` grid-synchronised tile steps.
``recursive``
    the recursion plan over blocks of ``base`` tiles, level-synchronous: all
    independent blocks of a phase (B and C, and everything below them) are solved in one launch;
    the feedback updates are cuBLAS GEMMs on views (no copies).

Which one is fastest is measured (``python -m bakron.bench_gpu``, docs/benchmarks/h200.md) and
``method="auto"`` follows those measurements.

Stacks (``solve_stack``, the hook of ``bakron.solvers.stack``; docs/stacks.md): the items of a
stack chunk run ONE schedule together. Every launch covers the blocks of all items (each
block descriptor carries its item's offsets into the stacked arrays, ``_cuda_layout``) and
every feedback GEMM is one batched cuBLAS call over the items (a shared factor: the same
pointer for every item). ``antidiagonal``: one launch for the whole chunk, ``M + N - 1``
steps, each over every item's tiles; ``wavefront``: per coarse step batched GEMMs, one
launch, batched GEMMs, for all items. The recursion has no stack form (its chunks run item by
item). Extra memory: ``E`` and the accumulator per item (``2 m n``), plus one coarse diagonal
of base targets for the wavefront and, for blocks of at least ``gather_min_side``, its partial
products (at most ``m n`` more per item).

Memory beyond the inputs, the factors and the outputs (``Ŵ``, int16 codes): ``E`` (m n) plus
``Yg`` (m n) for the wavefront, ``F`` (m n) for the recursion, a scratch (m n) for the
anti-diagonal; the wavefront adds one coarse diagonal of base targets (at most
``min(M_c, N_c)`` blocks) and, when its gathers are split, their partial products (up to
``gather_split`` times that, at most about m n).

Options: :class:`bakron.CudaOptions` (``solve(..., options=CudaOptions(...))``; its fields
and the environment variables that set their defaults are listed there and in
docs/engine-contract.md). Every solve reads its options from its ``Problem``
(``p.options_for(CudaOptions)``); the kernels, their cooperative grid sizes and the plans are
cached under keys that hold the options they depend on.
"""
from __future__ import annotations

import os

import numpy as np

__all__ = ["NAME", "CAPABILITIES", "available", "run", "auto_base", "auto_method", "warm_up",
           "DEFAULT_BASE", "solve_stack", "stack_method", "count_nonfinite", "factor_scan",
           "input_checks", "stack_checks"]

from bakron.solvers.options import CudaOptions, defaults
from bakron.solvers.engines import (COUNT_NONFINITE, FACTOR_SCAN, INPUT_CHECKS, SOLVE_STACK,
                                    STACK_CHECKS, STACK_METHOD, UNIFORM_FUSED, Capabilities,
                                    EngineResult)
from bakron.solvers.schedule import (AFTER_BC, AFTER_BOTTOM, AFTER_D, AFTER_RIGHT,
                                     RecursionPlan, step_count, step_width, two_level)

from ._cuda_layout import (ASYM, DESC, DESC_AI_OFFSET, DESC_AO_OFFSET, DESC_E_OFFSET,
                           DESC_F_OFFSET, DESC_OUT_OFFSET, DESC_S_OFFSET, DESC_W_OFFSET,
                           DESC_Z_OFFSET, HAS_F, HAS_T, HAS_YG, P_FLAGS, P_GSZ, P_HI, P_LO, P_M,
                           P_N, P_NBLK, P_NSTEPS, P_PERIOD, P_S_COLS, P_S_ROWS, P_Z_COLS, P_Z_ROWS,
                           PRM, TWO_SIDED, block_row)

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"  # numba-cuda's simulator (numba's variable)
#: set when a raw-pointer launch has failed in this process: every launch then wraps arrays
_PTR_FAILED = False

#: Base block (tiles per side) used when ``solve`` is called with the library default ``base``
#: (the recursion's base, the wavefront's coarse block). Measured: docs/benchmarks/h200.md.
DEFAULT_BASE = 16

NAME = "cuda"
#: cupy arrays (numpy ones under the simulator); the kernel holds one tile per CTA of at most
#: 256 threads, each with a few of its elements, so tiles have at most 1024 elements and 64
#: a side
CAPABILITIES = Capabilities(methods=("antidiagonal", "wavefront", "recursive"),
                            namespaces=("numpy",) if SIM else ("cupy",),
                            quantizers=UNIFORM_FUSED, max_tile=(64, 64, 1024),
                            hooks=(COUNT_NONFINITE, FACTOR_SCAN, INPUT_CHECKS, STACK_CHECKS,
                                   SOLVE_STACK, STACK_METHOD))

_STREAMS: dict = {}
_MAXGRID: dict = {}
_PARAMS: dict = {}   # launch descriptors on the device, oldest first
_PARAMS_MAX = 4096


def per_thread(opts: CudaOptions, running: bool) -> int:
    """Elements of a tile per thread of the kernel: ``opts.per_thread``, or when it is 0, 2
    for the running-sum step and 1 for the other (measured on the H200: a 4096² wavefront
    with CTAs of 128 threads, twice as many resident, took 11 % less time,
    docs/benchmarks/h200.md)."""
    return opts.per_thread or (2 if running else 1)


def launch_mode(opts: CudaOptions) -> str:
    """How the kernels get their arrays: ``"ptr"`` (raw device pointers) or ``"array"``
    (wrapped arrays: ``opts.launch``, the simulator, or after a failed pointer launch)."""
    return "array" if (SIM or _PTR_FAILED or opts.launch == "array") else "ptr"


def kernel_variant(dtname: str, tx: int, ty: int, items: bool, running: bool,
                   local: bool = False, opts: CudaOptions | None = None):
    """``(dispatcher, threads)`` of the kernel for a dtype, tile and step under the options
    ``opts`` (default: the defaults; ``launch``, ``maxreg``, ``per_thread``); compiled once
    and cached (``make_kernel``'s cache is keyed on those). ``local``: the variant that
    solves whole blocks per CTA (``local_blocks``)."""
    opts = defaults(CudaOptions) if opts is None else opts
    return _kernels().make_kernel(dtname, tx, ty, launch_mode(opts),
                                  0 if SIM else opts.maxreg, items=items, running=running,
                                  per_thread=per_thread(opts, running), local=local)


def grid_key(dtname: str, tx: int, ty: int, items: bool, running: bool, dev: int,
             local: bool = False, opts: CudaOptions | None = None) -> tuple:
    """The key of a kernel variant's cooperative grid size in ``_MAXGRID`` (filled on its first
    launch; the GPU benchmark reports it): the kernel's options in it."""
    opts = defaults(CudaOptions) if opts is None else opts
    return (dtname, tx, ty, launch_mode(opts), opts.maxreg, bool(items), bool(running),
            per_thread(opts, running), dev, bool(local))


def _cuda():
    from numba import cuda
    return cuda


def _kernels():
    from . import _cuda_kernels
    return _cuda_kernels


def available() -> bool:
    """numba-cuda imports and a CUDA device (with cupy) exists, or the simulator is on."""
    try:
        cuda = _cuda()
    except Exception:
        return False
    if SIM:
        return True
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        return bool(cuda.is_available())
    except Exception:
        return False


# ------------------------------------------------------------------------------------------
# the run context: buffers, stream, kernel launches, GEMMs
# ------------------------------------------------------------------------------------------

class _DeviceSolve:
    """Everything one solve needs on the device; ``Wq``, ``codes`` (and ``T``) are the new
    output arrays of this solve."""

    def __init__(self, p):
        self._setup(p)
        mod = self.mod
        self.W = mod.ascontiguousarray(p.W)
        self.AI = mod.ascontiguousarray(p.A_I)
        self.AO = mod.ascontiguousarray(p.A_O) if p.two_sided else None
        self.Wq = mod.empty((p.m, p.n), dtype=p.W.dtype)
        self.codes = mod.empty((p.m, p.n), dtype=mod.int16)
        self.T = mod.empty((p.m, p.n), dtype=p.W.dtype) if p.record_targets else None
        s_tab, z_tab = p.quantizer.tables(p.xp, p.device, p.dtype)
        self.S = mod.ascontiguousarray(s_tab)
        self.Z = None if z_tab is None else mod.ascontiguousarray(z_tab)
        self.s_shape = tuple(int(v) for v in self.S.shape)
        self.z_shape = (1, 1) if self.Z is None else tuple(int(v) for v in self.Z.shape)

    def _setup(self, p, items: bool = False):
        """What does not depend on the arrays: sizes, the quantizer's kind, the kernel, the
        stream (``p``'s quantizer stands for every item of a stack; ``items``: the kernel
        variant that reads the blocks' item offsets)."""
        self.p = p
        self.opts = p.options_for(CudaOptions)
        self.items = bool(items)
        if SIM:
            self.mod = np
        else:
            import cupy
            self.mod = cupy
        self.dtname = str(p.dtype)
        self.isz = 4 if self.dtname == "float32" else 8
        self.m, self.n = p.m, p.n
        q = p.quantizer
        self.gsz = int(q.group_size or 1)
        self.lo, self.hi = q.code_range
        self.flags0 = ((TWO_SIDED if p.two_sided else 0) | (0 if q.symmetric else ASYM)
                       | (HAS_T if p.record_targets else 0))
        self._kernels: dict = {}
        self.launches = 0
        self.gemms = 0
        if SIM:
            self.stream = None
            self.nstream = None
            self.dev = 0
        else:
            import cupy
            self.stream = cupy.cuda.get_current_stream()
            self.dev = cupy.cuda.Device().id
            self.nstream = _numba_stream(self.stream.ptr, self.dev)
            self.handle = cupy.cuda.device.get_cublas_handle()
        self._wrapped: dict = {}

    # -- kernel --------------------------------------------------------------------------
    def running(self, span) -> bool:
        """Whether a launch whose largest block has ``span = (Mb, Nb)`` tiles uses the step
        of running sums (``CudaOptions.step``; ``auto``: when a tile's sums would need more
        than one chunk of the other step, docs/engines.md, "The GPU tile step")."""
        step = self.opts.step
        if step != "auto":
            return step == "running"
        p = self.p
        Mb, Nb = span
        chain = max((Mb - 1) * p.tx if p.two_sided else 0, (Nb - 1) * p.ty)
        return chain > _kernels().chunk_for(p.tx, p.ty, self.isz)

    def kernel(self, running: bool, local: bool = False):
        """``(dispatcher, threads)`` of the kernel variant for this solve."""
        hit = self._kernels.get((running, local))
        if hit is None:
            p = self.p
            hit = self._kernels[(running, local)] = kernel_variant(
                self.dtname, p.tx, p.ty, self.items, running, local, self.opts)
        return hit

    def max_grid(self, running: bool, local: bool = False) -> int:
        if SIM:
            return 1
        key = grid_key(self.dtname, self.p.tx, self.p.ty, self.items, running, self.dev,
                       local, self.opts)
        g = _MAXGRID.get(key)
        if g is None:
            cuda = _cuda()
            disp, nt = self.kernel(running, local)
            with cuda.gpus[self.dev]:
                if launch_mode(self.opts) == "ptr":
                    kern = next(iter(disp.overloads.values()))
                    g = int(kern.max_cooperative_grid_blocks(nt))
                else:
                    g = int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
            _MAXGRID[key] = g = max(1, g)
        return g

    def _arg(self, x):
        """A kernel argument for array ``x`` (flat): a device pointer or a 1-D array."""
        if SIM:
            return x.reshape(-1)
        if launch_mode(self.opts) == "ptr":
            return int(x.data.ptr)
        key = id(x)
        hit = self._wrapped.get(key)
        if hit is None:
            hit = self._wrapped[key] = (_cuda().as_cuda_array(x.reshape(-1), sync=False), x)
        return hit[0]

    def params(self, nblk: int, nsteps: int, flags: int, period: int = 0):
        """The launch descriptor (``_cuda_layout.P_*``) of a launch of ``nblk`` blocks (the
        tile ranges of the first ``period`` repeating; 0: no repetition) and ``nsteps``
        steps, on the device. Each distinct one is uploaded once and cached (a
        plan has a few kinds of launch), so repeated solves copy nothing to the device."""
        prm = np.zeros(PRM, dtype=np.int64)
        prm[P_M], prm[P_N], prm[P_NBLK], prm[P_NSTEPS] = self.m, self.n, nblk, nsteps
        prm[P_FLAGS] = flags | self.flags0
        prm[P_S_ROWS], prm[P_S_COLS] = self.s_shape
        prm[P_Z_ROWS], prm[P_Z_COLS] = self.z_shape
        prm[P_GSZ], prm[P_LO], prm[P_HI] = self.gsz, self.lo, self.hi
        prm[P_PERIOD] = period if period else max(1, nblk)
        if SIM:
            return prm
        key = (self.dev, prm.tobytes())
        hit = _PARAMS.get(key)
        if hit is None:
            hit = _PARAMS[key] = self.device_table(prm)
            while len(_PARAMS) > _PARAMS_MAX:
                _PARAMS.pop(next(iter(_PARAMS)))
        return hit

    def launch(self, desc, first: int, nblk: int, nsteps: int, grid: tuple, flags: int,
               F, Yg=None, period: int = 0, span=(1, 1)):
        """Solve ``nblk`` blocks (rows ``first..`` of the descriptor table ``desc``; the
        tile ranges of the first ``period`` repeat, see ``params``; ``span``: the largest
        block's tiles ``(Mb, Nb)``, which picks the kernel's step, ``running``; ``grid``:
        the CTAs for each step, ``_widths``). Launches of many small blocks take the kernel
        that solves whole blocks per CTA (``_local``)."""
        W = self.W
        run = self.running(span)
        local = _local(self.opts, nblk, span)
        kernel, nt = self.kernel(run, local)
        width = nblk if local else grid[0] if run else grid[1]
        prm = self.params(nblk, nsteps, flags, period)
        if SIM:
            dsc = desc[first * DESC:]
        elif launch_mode(self.opts) == "ptr":
            dsc = int(desc.data.ptr) + first * DESC * 8
            prm = int(prm.data.ptr)
        else:
            dsc = self._arg(desc)[first * DESC:]
            prm = self._arg(prm)
        a = self._arg
        problem = (a(W), a(self.AO if self.AO is not None else W), a(self.AI))
        buffers = (a(F), a(self.E), a(Yg if Yg is not None else W), a(self.Wq), a(self.codes),
                   a(self.T if self.T is not None else W))
        quant_grid = (a(self.S), a(self.Z if self.Z is not None else self.S))
        args = _kernel_order(problem, buffers, quant_grid, (dsc, prm))
        ctas = max(1, min(width, self.max_grid(run, local)))
        self.launches += 1
        if SIM:
            kernel[1, nt](*args)
            return
        cuda = _cuda()
        with cuda.gpus[self.dev]:
            if launch_mode(self.opts) == "ptr":
                kern = next(iter(kernel.overloads.values()))
                try:
                    from . import _cuda_launch
                    _cuda_launch.launch(kern, self.dev, (ctas, 1, 1), (nt, 1, 1), self.nstream,
                                        args)
                except Exception as exc:  # pointer launch unsupported here: wrap arrays
                    if self.launches > 1:
                        raise
                    _fallback_to_arrays(exc)
                    self._kernels.clear()
                    self.launches -= 1
                    return self.launch(desc, first, nblk, nsteps, grid, flags, F, Yg, period,
                                       span)
            else:
                kernel[ctas, nt, self.nstream](*args)

    # -- tables: planned once per shape, uploaded once, cached --------------------------
    def device_table(self, table: np.ndarray):
        """An int64 host table on the device (plans are cached, so this runs once per
        shape and device: the one host-to-device copy is not inside repeated solves)."""
        if SIM:
            return np.ascontiguousarray(table, dtype=np.int64)
        return self.mod.asarray(np.ascontiguousarray(table, dtype=np.int64))

    # -- GEMMs ---------------------------------------------------------------------------
    def gemm_view(self, C, A, B, ta=False, tb=False, alpha=1.0, beta=1.0):
        """``C = alpha op(A) op(B) + beta C`` on 2-D views with unit column stride."""
        self.gemms += 1
        if SIM:
            oa = A.T if ta else A
            ob = B.T if tb else B
            if beta == 0.0:
                C[...] = alpha * (oa @ ob)
            else:
                C[...] = alpha * (oa @ ob) + beta * C
            return
        M, N = C.shape
        K = A.shape[0] if ta else A.shape[1]
        if M == 0 or N == 0:
            return
        if K == 0:
            if beta != 1.0:
                C *= beta
            return
        self._gemm(ta, tb, M, N, K, alpha, A.data.ptr, _ld(A, self.isz), B.data.ptr,
                   _ld(B, self.isz), beta, C.data.ptr, _ld(C, self.isz))

    def _gemm(self, ta, tb, M, N, K, alpha, pa, lda, pb, ldb, beta, pc, ldc, batch=0):
        """Row-major ``C = alpha op(A) op(B) + beta C`` through column-major cuBLAS
        (``C^T = op(B)^T op(A)^T``); ``batch > 0``: pa/pb/pc are device pointer arrays."""
        from cupy.cuda import cublas
        h = self.handle
        cublas.setStream(h, self.stream.ptr)
        opa = 1 if ta else 0
        opb = 1 if tb else 0
        f32 = self.dtname == "float32"
        mode = None
        if f32 and self.opts.tf32:
            mode = cublas.getMathMode(h)
            cublas.setMathMode(h, 3)  # CUBLAS_TF32_TENSOR_OP_MATH
        if _cublas_scalars_by_pointer(h):
            alpha = _host_scalar(self.dtname, alpha)
            beta = _host_scalar(self.dtname, beta)
        try:
            if batch:
                fn = cublas.sgemmBatched if f32 else cublas.dgemmBatched
                fn(h, opb, opa, N, M, K, alpha, pb, ldb, pa, lda, beta, pc, ldc, batch)
            else:
                fn = cublas.sgemm if f32 else cublas.dgemm
                fn(h, opb, opa, N, M, K, alpha, pb, ldb, pa, lda, beta, pc, ldc)
        finally:
            if mode is not None:
                cublas.setMathMode(h, mode)

    def gemm_batched(self, op, ptrs):
        """Run a planned batched GEMM ``op`` (see :func:`_plan_gemm`); ``ptrs`` is the device
        pointer table (cupy) or the host offset table (simulator)."""
        ta, tb, M, N, K, alpha, beta, (ba, lda), (bb, ldb), (bc, ldc), row, k = op
        self.gemms += 1
        if M == 0 or N == 0 or K == 0 or k == 0:
            return
        if SIM:
            bufs = self.buffers
            for j in range(k):
                oa, ob, oc = (int(v) for v in ptrs[row:row + 3, j])
                A = _strided(bufs[ba], oa, (K, M) if ta else (M, K), lda)
                B = _strided(bufs[bb], ob, (N, K) if tb else (K, N), ldb)
                C = _strided(bufs[bc], oc, (M, N), ldc)
                oa_ = A.T if ta else A
                ob_ = B.T if tb else B
                if beta == 0.0:
                    C[...] = alpha * (oa_ @ ob_)
                else:
                    C[...] = alpha * (oa_ @ ob_) + beta * C
            return
        if k == 1:
            hp = self.host_ptrs
            self._gemm(ta, tb, M, N, K, alpha, int(hp[row, 0]), lda, int(hp[row + 1, 0]), ldb,
                       beta, int(hp[row + 2, 0]), ldc)
            return
        base = int(ptrs.data.ptr)
        stride = ptrs.shape[1] * 8
        self._gemm(ta, tb, M, N, K, alpha, base + row * stride, lda,
                   base + (row + 1) * stride, ldb, beta, base + (row + 2) * stride, ldc,
                   batch=k)


_SCALARS: dict = {}
_BY_POINTER = None


def _host_scalar(dtname: str, v: float) -> int:
    """Address of a host scalar (kept alive here) for cuBLAS in host pointer mode."""
    key = (dtname, float(v))
    a = _SCALARS.get(key)
    if a is None:
        a = _SCALARS[key] = np.array([v], dtype=dtname)
    return int(a.ctypes.data)


def _cublas_scalars_by_pointer(h) -> bool:
    """Whether cupy's ``cublas.sgemm`` & co. take alpha/beta as host pointers (recent cupy) or
    by value (older cupy). Probed once on a 1x1 product: passing a pointer is safe either way
    (by value it is read as a huge float and the product shows it)."""
    global _BY_POINTER
    if _BY_POINTER is None:
        import cupy
        from cupy.cuda import cublas
        a = cupy.asarray([3.0])
        b = cupy.asarray([5.0])
        c = cupy.zeros(1)
        if cublas.getPointerMode(h) != 0:
            cublas.setPointerMode(h, 0)
        cublas.dgemm(h, 0, 0, 1, 1, 1, _host_scalar("float64", 2.0), a.data.ptr, 1,
                     b.data.ptr, 1, _host_scalar("float64", 0.0), c.data.ptr, 1)
        _BY_POINTER = float(c.get()[0]) == 30.0
    return _BY_POINTER


def _ld(X, isz: int) -> int:
    """Leading dimension (elements) of a 2-D row-major view with unit column stride."""
    if X.ndim != 2 or (X.shape[1] > 1 and X.strides[1] != isz):
        raise ValueError("internal: GEMM operand must have unit column stride")
    ld = X.strides[0] // isz if X.shape[0] > 1 else X.shape[1]
    return max(1, ld, X.shape[1])


def _strided(buf, off, shape, ld):
    """A (rows, cols) view of the flat buffer ``buf`` at element ``off`` with leading dim ld."""
    flat = buf.reshape(-1)
    isz = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[off:], shape=shape, strides=(ld * isz, isz))


def _kernel_order(problem, buffers, quant_grid, schedule) -> tuple:
    """The kernel's positional arguments from its four groups (``_cuda_kernels.make_kernel``:
    ``W, AO, AI, F, E, Yg, Wq, codes, S, Z, T, desc, prm``)."""
    W, AO, AI = problem
    F, E, Yg, Wq, codes, T = buffers
    S, Z = quant_grid
    desc, prm = schedule
    return (W, AO, AI, F, E, Yg, Wq, codes, S, Z, T, desc, prm)


def _fallback_to_arrays(exc) -> None:
    global _PTR_FAILED
    import warnings
    warnings.warn(f"bakron cuda engine: raw-pointer kernel launch failed ({exc!r}); "
                  "falling back to wrapped arrays (slower launches)", RuntimeWarning)
    _PTR_FAILED = True


def _numba_stream(ptr: int, dev: int):
    key = (ptr, dev)
    s = _STREAMS.get(key)
    if s is None:
        cuda = _cuda()
        with cuda.gpus[dev]:
            s = cuda.default_stream() if ptr == 0 else cuda.external_stream(ptr)
        _STREAMS[key] = s
    return s


# ------------------------------------------------------------------------------------------
# the methods: each executes a plan of bakron.solvers.schedule
# ------------------------------------------------------------------------------------------

_PLANS: "OrderedDict" = None
_PLAN_MAX = 32
_PTRK = None
_SUMK = None
_BUFS = ("Yg", "AI", "AO", "E", "Fb", "Fp")


def _cached(key, build):
    """Plans (host schedules and their device tables) are built once per shape and device."""
    global _PLANS
    from collections import OrderedDict
    if _PLANS is None:
        _PLANS = OrderedDict()
    hit = _PLANS.get(key)
    if hit is None:
        hit = _PLANS[key] = build()
        while len(_PLANS) > _PLAN_MAX:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return hit


def _widths(shapes, two: bool, copies: int = 1) -> tuple:
    """The CTAs a launch over blocks of ``shapes`` tiles (each ``copies`` times) can use,
    ``(running sums, whole sums)``: every tile at step 0 of running sums
    (``_cuda_kernels._step_shape``), the longest anti-diagonal otherwise. The launch is
    capped at the cooperative limit; CTAs beyond the work only add to every grid
    synchronisation."""
    shapes = list(shapes)
    return (copies * sum(int(a) * int(b) for a, b in shapes),
            copies * sum(step_width(int(a), int(b), two) for a, b in shapes))


def _local(opts: CudaOptions, nblk: int, span) -> bool:
    """Whether a launch of ``nblk`` blocks, the largest ``span = (Mb, Nb)`` tiles, solves
    whole blocks per CTA: at least ``opts.local_blocks`` blocks of at most
    ``opts.local_tiles`` tiles
    (measured on the H200: blocks of 4 x 4 tiles gain, whole 16 x 16-tile matrices per CTA
    took 2.4 times as long as their grid-wide steps; docs/engines.md, "Blocks per CTA and
    the depth of whole sums")."""
    return (0 < opts.local_blocks <= nblk
            and int(span[0]) * int(span[1]) <= opts.local_tiles)


def _period(shapes) -> int:
    """The smallest ``p`` such that the blocks' ``shapes`` (tiles) repeat every ``p`` blocks:
    the launch's ``P_PERIOD``. The kernel counts and locates a step's items over one period
    per item (``_cuda_kernels``), so a launch of equal blocks (a coarse step of the
    wavefront away from a ragged edge) finds each item in O(1) instead of a scan over
    all its blocks."""
    shapes = [tuple(int(v) for v in s) for s in shapes]
    k = len(shapes)
    for p in range(1, k):
        if k % p == 0 and all(shapes[i] == shapes[i % p] for i in range(p, k)):
            return p
    return max(1, k)


def _key(r: _DeviceSolve, method: str, base: int):
    p = r.p
    o = r.opts  # the options the plans depend on
    return (method, base, p.m, p.n, p.tx, p.ty, p.two_sided, r.dev, SIM, o.gather_tiles,
            o.gather_min_side, o.gather_split, o.scatter_rows)


def _antidiagonal(r: _DeviceSolve) -> None:
    """The whole matrix as one block: one launch of the tile wavefront's steps."""
    p = r.p
    mod = r.mod
    two = p.two_sided
    desc = _cached(_key(r, "antidiagonal", 0), lambda: r.device_table(
        np.array(block_row(0, p.M, 0, p.N, 0, p.n), dtype=np.int64)))
    r.E = mod.empty((p.m, p.n), dtype=p.W.dtype)
    Y = mod.empty((p.m, p.n), dtype=p.W.dtype)  # the local accumulator G_O^T Ẽ
    r.launch(desc, 0, 1, step_count(p.M, p.N, two), _widths([(p.M, p.N)], two), 0, Y,
             span=(p.M, p.N))


class _WavePlan:
    """The two-level schedule (``schedule.two_level``) for this engine: per coarse step,
    batched GEMMs that gather the blocks' base targets, one launch, batched GEMMs that
    scatter their errors."""

    def __init__(self, r: _DeviceSolve, cs: int):
        p = r.p
        o = r.opts  # the gathers and scatters follow its gather_* and scatter_rows
        m, n = p.m, p.n
        R, C = p.rows, p.cols
        two = p.two_sided
        coarse = two_level(p.M, p.N, cs, two)
        Sr, Sc = cs * p.tx, cs * p.ty
        per = Sr * Sc
        nblk = max(len(step.blocks) for step in coarse)
        self.fb_size = fb = nblk * per
        steps, desc_rows, entries, ops, counts = [], [], [], [], []

        def plan_gemm(ta, tb, M, N, K, beta, A, B, C_, ent):
            """Row-major C = op(A) op(B) + beta C per entry; A/B/C: (buffer, ld);
            ent: [(offset A, offset B, offset C)] in elements."""
            ops.append([ta, tb, M, N, K, 1.0, beta, A, B, C_, 3 * len(ops), len(ent)])
            entries.append(ent)
            return len(ops) - 1

        for step in coarse:
            shapes: dict = {}
            for j, b in enumerate(step.blocks):
                hw = (R[b.rb] - R[b.ra], C[b.cb] - C[b.ca])
                shapes.setdefault(hw, []).append((j, b))
            before, after, reduce = [], [], None
            if step.gather and two:
                # base targets of every block of the step from Yg (the accumulator form):
                # Fb_j = Yg[rows, c0:] A_I[c0:, cols]; A_I is zero above a block's columns,
                # so one K range (from the group's leftmost block) serves the whole batch
                tiles = sum(-(-h // 128) * -(-w // 128) * len(grp)
                            for (h, w), grp in shapes.items())
                large = min(min(hw) for hw in shapes) >= o.gather_min_side
                split = min(o.gather_split, o.gather_tiles // tiles) if large else 1
                if split >= 2:
                    reduce = len(counts)
                    counts.append(self._split_gather(shapes, split, n, Sc, per, nblk, C, R,
                                                     plan_gemm, before))
                else:
                    for (h, w), grp in shapes.items():
                        c0 = C[min(b.ca for _, b in grp)]
                        ent = [(R[b.ra] * n + c0, c0 * n + C[b.ca], j * per) for j, b in grp]
                        before.append(plan_gemm(False, False, h, w, n - c0, 0.0,
                                                ("Yg", n), ("AI", n), ("Fb", Sc), ent))
            elif step.gather:
                b = step.blocks[0]
                c0, c1 = C[b.ca], C[b.cb]
                # one-sided: Fb (m x w, ld Sc) = E[:, c1:] A_I[c1:, cols], all rows at once
                before.append(plan_gemm(False, False, m, c1 - c0, n - c1, 0.0,
                                        ("E", n), ("AI", n), ("Fb", Sc), [(c1, c1 * n + c0, 0)]))
            flags = (HAS_F if before else 0) | (HAS_YG if two else 0)
            start = len(desc_rows)
            for j, b in enumerate(step.blocks):
                f_off = j * per if two else R[b.ra] * Sc
                desc_rows.append(block_row(b.ra, b.rb, b.ca, b.cb, f_off, Sc))
            if step.scatter:
                # push the errors: Yg[0:Rg, cols] += A_O[rows, 0:Rg]^T E_block (A_O is zero
                # right of a block's rows, so the group's lowest block sets Rg); the kernel
                # has added the identity part E_block already
                for (h, w), grp in shapes.items():
                    if o.scatter_rows:
                        self._split_scatter(grp, h, w, m, n, R, C, cs * o.scatter_rows * p.tx,
                                            plan_gemm, after)
                        continue
                    Rg = R[max(b.rb for _, b in grp)]
                    ent = [(R[b.ra] * m, R[b.ra] * n + C[b.ca], C[b.ca]) for _, b in grp]
                    after.append(plan_gemm(True, False, Rg, w, h, 1.0,
                                           ("AO", m), ("E", n), ("Yg", n), ent))
            nsteps = max(step_count(*b.shape, two) for b in step.blocks)
            grid = _widths((b.shape for b in step.blocks), two)
            span = (max(b.shape[0] for b in step.blocks), max(b.shape[1] for b in step.blocks))
            steps.append((start, len(step.blocks), nsteps, grid, flags, before, after,
                          _period(b.shape for b in step.blocks), span, reduce))
        self.steps = steps
        self.ops = ops
        #: partial products of the split gathers: slices of ``fb`` per item
        self.slices = max([int(c.max()) for c in counts] + [0])
        self.counts = np.array(counts, dtype=np.int64).reshape(len(counts), nblk)
        self.per = per
        kb = max([len(e) for e in entries] + [1])
        offs = np.zeros((3 * len(ops), kb), dtype=np.int64)
        bidx = np.zeros((3 * len(ops), 1), dtype=np.int64)
        for g, (op, ent) in enumerate(zip(ops, entries)):
            for j, e in enumerate(ent):
                offs[3 * g:3 * g + 3, j] = e
            bidx[3 * g:3 * g + 3, 0] = [_BUFS.index(op[7][0]), _BUFS.index(op[8][0]),
                                        _BUFS.index(op[9][0])]
        self.offs = offs
        self.bidx = bidx
        self.batched = any(op[11] > 1 for op in ops)
        self.desc_rows = np.array(desc_rows, dtype=np.int64).reshape(-1, DESC)
        self.desc = r.device_table(self.desc_rows.reshape(-1))
        self.counts_dev = r.device_table(self.counts) if len(counts) and not SIM else None
        if not SIM and self.batched:
            self.offs_dev = r.device_table(offs)
            self.bidx_dev = r.device_table(bidx)

    @staticmethod
    def _split_gather(shapes, split, n, Sc, per, nblk, C, R, plan_gemm, before):
        """The gather of one step as partial products over ``split`` K chunks of whole block
        columns: entry (block j, chunk t) writes slice ``t - first_j`` of ``Fp`` (block j's
        place in it as in ``Fb``), where ``first_j`` is the first chunk that reaches block j's
        columns (``A_I`` is zero above them). Returns the slices per block, which the sum
        kernel adds into ``Fb`` in chunk order."""
        count = np.zeros(nblk, dtype=np.int64)
        for (h, w), grp in shapes.items():
            c0 = C[min(b.ca for _, b in grp)]
            K = n - c0
            cols = -(-K // Sc)  # block columns in the K range (the last may be narrower)
            q = -(-cols // split) * Sc  # chunk length: whole block columns
            by_len: dict = {}
            for t in range(-(-K // q)):
                k0 = t * q
                kl = min(q, K - k0)
                for j, b in grp:
                    first = (C[b.ca] - c0) // q
                    if t < first:
                        continue  # only zeros of A_I in this chunk
                    by_len.setdefault(kl, []).append(
                        (R[b.ra] * n + c0 + k0, (c0 + k0) * n + C[b.ca],
                         (t - first) * nblk * per + j * per))
                    count[j] = t - first + 1
            for kl, ent in by_len.items():
                before.append(plan_gemm(False, False, h, w, kl, 0.0,
                                        ("Yg", n), ("AI", n), ("Fp", Sc), ent))
        return count

    @staticmethod
    def _split_scatter(grp, h, w, m, n, R, C, rows, plan_gemm, after):
        """The scatter of one shape group with its output rows in chunks of ``rows`` rows,
        each block's entries only for the chunks above its last row (``A_O[rows_j, a]`` is
        zero for ``a`` at or below it); every entry's product is the one of the whole-range
        entry, restricted to its rows."""
        by_len: dict = {}
        for _, b in grp:
            top = R[b.rb]
            for r0 in range(0, top, rows):
                ml = min(rows, top - r0)
                by_len.setdefault(ml, []).append((R[b.ra] * m + r0, R[b.ra] * n + C[b.ca],
                                                  r0 * n + C[b.ca]))
        for ml, ent in by_len.items():
            after.append(plan_gemm(True, False, ml, w, h, 1.0, ("AO", m), ("E", n),
                                   ("Yg", n), ent))


def _pointers(r: _DeviceSolve, plan: _WavePlan, bufs: dict):
    """Device pointer table of the planned batched GEMMs for this solve's buffers (one
    element-wise launch with the base addresses as scalars: no host-to-device copy)."""
    global _PTRK
    base = [0 if bufs[b] is None else int(bufs[b].data.ptr) for b in _BUFS]
    # the first entry of each row only: calls of one entry take host pointers (the whole
    # table of a stack with row-split scatters is millions of entries)
    r.host_ptrs = (plan.offs[:, :1] * r.isz
                   + np.array(base, dtype=np.int64)[plan.bidx[:, 0]][:, None])
    if not plan.batched:
        return None
    import cupy
    if _PTRK is None:
        _PTRK = cupy.ElementwiseKernel(
            "int64 off, int64 bi, int64 isz, int64 b0, int64 b1, int64 b2, int64 b3, "
            "int64 b4, int64 b5",
            "int64 ptr",
            "ptr = off * isz + (bi == 0 ? b0 : bi == 1 ? b1 : bi == 2 ? b2 : bi == 3 ? b3 "
            ": bi == 4 ? b4 : b5)",
            "bakron_gemm_pointers")
    return _PTRK(plan.offs_dev, plan.bidx_dev, r.isz, *base)


def _sum_partials(r: _DeviceSolve, plan, reduce: int, items: int) -> None:
    """``Fb`` of every item = the sum of its split gather's partial products in ``Fp``, in
    chunk order (block j of the step adds ``plan.counts[reduce, j]`` slices; 0 gives 0)."""
    global _SUMK
    fb, per, slices = plan.fb_size, plan.per, plan.slices
    Fp, Fb = r.buffers["Fp"], r.buffers["Fb"]
    if SIM:
        cnt = plan.counts[reduce]
        for it in range(items):
            for j, c in enumerate(cnt):
                at = it * fb + j * per
                acc = np.zeros(per, dtype=Fb.dtype)
                for t in range(int(c)):
                    src = it * slices * fb + t * fb + j * per
                    acc += Fp[src:src + per]
                Fb[at:at + per] = acc
        return
    import cupy
    if _SUMK is None:
        _SUMK = cupy.ElementwiseKernel(
            "raw T parts, raw int64 cnt, int64 fb, int64 per, int64 slices", "T out",
            "const long long it = i / fb; const long long pos = i - it * fb; "
            "const long long c = cnt[pos / per]; const long long at = it * slices * fb + pos; "
            "T acc = 0; for (long long t = 0; t < c; ++t) { acc += parts[at + t * fb]; } "
            "out = acc;",
            "bakron_sum_partials")
    _SUMK(Fp, plan.counts_dev[reduce], fb, per, slices, Fb)


def _wave_buffers(r: _DeviceSolve, plan, items: int, stack: bool) -> None:
    """The wavefront's work arrays for ``items`` items: ``E``, the accumulator ``Yg``, the
    base targets ``Fb`` and the split gathers' partial products ``Fp`` (a single solve's
    ``E`` and ``Yg`` as matrices, a stack's flat)."""
    p = r.p
    mod = r.mod
    shape = (items * p.m * p.n,) if stack else (p.m, p.n)
    r.E = mod.empty(shape, dtype=p.W.dtype)
    Yg = mod.zeros(shape, dtype=p.W.dtype) if p.two_sided else None
    Fb = mod.empty((items * plan.fb_size,), dtype=p.W.dtype)
    Fp = (mod.empty((items * plan.slices * plan.fb_size,), dtype=p.W.dtype)
          if plan.slices else None)
    r.buffers = {"Yg": Yg, "AI": r.AI, "AO": r.AO, "E": r.E, "Fb": Fb, "Fp": Fp}


def _run_steps(r: _DeviceSolve, plan, items: int) -> None:
    """Execute a (stack) wavefront plan: per coarse step its gathers (and the sum of split
    ones), one launch, its scatters."""
    ptrs = plan.offs if SIM else _pointers(r, plan, r.buffers)
    Fb, Yg = r.buffers["Fb"], r.buffers["Yg"]
    for start, k, nsteps, grid, flags, before, after, period, span, reduce in plan.steps:
        for g in before:
            r.gemm_batched(plan.ops[g], ptrs)
        if reduce is not None:
            _sum_partials(r, plan, reduce, items)
        r.launch(plan.desc, start, k, nsteps, grid, flags, Fb, Yg, period=period, span=span)
        for g in after:
            r.gemm_batched(plan.ops[g], ptrs)


def _wavefront(r: _DeviceSolve, cs: int) -> None:
    """The two-level wavefront: one launch per coarse step, batched GEMMs around it."""
    plan = _cached(_key(r, "wavefront", cs), lambda: _WavePlan(r, cs))
    _wave_buffers(r, plan, 1, False)
    _run_steps(r, plan, 1)


def _recursive(r: _DeviceSolve, base: int) -> None:
    """The recursion plan level by level: all the leaves of a phase in one launch, the
    updates between them as cuBLAS GEMMs on views (no copies)."""
    p = r.p
    mod = r.mod
    n = p.n
    R, C = p.rows, p.cols
    two = p.two_sided
    r.E = E = mod.empty((p.m, n), dtype=p.W.dtype)
    F = mod.zeros((p.m, n), dtype=p.W.dtype)

    def build():
        plan = RecursionPlan(R, C, base, two)
        desc_rows, program = [], []
        for kind, what in plan.phases:
            if kind == "update":
                program.append((kind, what))
                continue
            start = len(desc_rows)
            for b in what:
                desc_rows.append(block_row(b.ra, b.rb, b.ca, b.cb, R[b.ra] * n + C[b.ca], n))
            program.append((kind, (start, len(what),
                                   max(step_count(*b.shape, two) for b in what),
                                   _widths((b.shape for b in what), two),
                                   _period(b.shape for b in what),
                                   (max(b.shape[0] for b in what),
                                    max(b.shape[1] for b in what)))))
        return program, r.device_table(np.array(desc_rows, dtype=np.int64).reshape(-1))

    program, desc = _cached(_key(r, "recursive", base), build)
    kept: dict = {}  # after_D's X per quadrant node, until its after_BC
    for kind, what in program:
        if kind == "leaves":
            start, k, nsteps, grid, period, span = what
            r.launch(desc, start, k, nsteps, grid, HAS_F, F, period=period, span=span)
        else:
            _update(r, what, E, F, kept)


def _update(r: _DeviceSolve, u, E, F, kept: dict) -> None:
    """One update of the recursion plan (``schedule.Update`` says what each kind adds)."""
    mod = r.mod
    AO, AI = r.AO, r.AI
    gemm = r.gemm_view
    r0, r_, r1 = u.rows
    c0, c_, c1 = u.cols
    if u.kind == AFTER_D:
        ED = E[r_:r1, c_:c1]
        X = mod.empty((r1 - r_, c1 - c_), dtype=E.dtype)
        gemm(X, ED, AI[c_:c1, c_:c1], beta=0.0)
        X += ED                                       # E_D G_I[C2,C2]
        gemm(F[r0:r_, c_:c1], AO[r_:r1, r0:r_], X, ta=True)   # -> B
        Z = mod.empty((r1 - r_, c_ - c0), dtype=E.dtype)
        gemm(Z, ED, AI[c_:c1, c0:c_], beta=0.0)          # E_D A_I[C2,C1]
        FC = F[r_:r1, c0:c_]
        FC += Z
        gemm(FC, AO[r_:r1, r_:r1], Z, ta=True)            # -> C
        kept[u.block] = Z
    elif u.kind == AFTER_BC:
        EB = E[r0:r_, c_:c1]
        EC = E[r_:r1, c0:c_]
        FA = F[r0:r_, c0:c_]
        U = mod.empty((r_ - r0, c_ - c0), dtype=E.dtype)
        gemm(U, EB, AI[c_:c1, c0:c_], beta=0.0)          # E_B A_I[C2,C1]
        FA += U
        gemm(FA, AO[r0:r_, r0:r_], U, ta=True)
        V = kept.pop(u.block)                         # E_D A_I[C2,C1]
        V += EC
        gemm(V, EC, AI[c0:c_, c0:c_])                    # + E_C G_I[C1,C1]
        gemm(FA, AO[r_:r1, r0:r_], V, ta=True)
    elif u.kind == AFTER_RIGHT:
        Er = E[r0:r1, c_:c1]
        Z = mod.empty((r1 - r0, c_ - c0), dtype=E.dtype)
        gemm(Z, Er, AI[c_:c1, c0:c_], beta=0.0)
        FL = F[r0:r1, c0:c_]
        FL += Z
        if r.p.two_sided:
            gemm(FL, AO[r0:r1, r0:r1], Z, ta=True)
    elif u.kind == AFTER_BOTTOM:
        Eb = E[r_:r1, c0:c1]
        X = mod.empty((r1 - r_, c1 - c0), dtype=E.dtype)
        gemm(X, Eb, AI[c0:c1, c0:c1], beta=0.0)
        X += Eb
        gemm(F[r0:r_, c0:c1], AO[r_:r1, r0:r_], X, ta=True)
    else:  # pragma: no cover - the plan makes only these
        raise AssertionError(f"unknown update {u.kind!r}")


def auto_base(p) -> int:
    """Base-block size in tiles for ``base=None`` (measured: docs/benchmarks/h200.md)."""
    return DEFAULT_BASE


def run(p, method: str, base: int, variant: str) -> EngineResult:
    """Run ``method`` on the GPU; new arrays out (``info``: kernel launches and GEMM calls)."""
    if not CAPABILITIES.runs(method, variant):
        raise ValueError(f"method={method!r} is not available on engine {NAME!r}")
    r = _DeviceSolve(p)
    if method == "antidiagonal":
        _antidiagonal(r)
    elif method == "wavefront":
        _wavefront(r, max(1, int(base)))
    else:
        _recursive(r, max(1, int(base)))
    return EngineResult(values=r.Wq, codes=r.codes, targets=r.T,
                        info={"quantizer_calls": 0, "launches": r.launches, "gemms": r.gemms})


# ------------------------------------------------------------------------------------------
# stacks: the items of a chunk advance together (docs/stacks.md)
# ------------------------------------------------------------------------------------------

#: ``method="auto"`` on a stack: the two-level wavefront in stack form (per coarse step one
#: launch over every item's blocks, batched GEMMs over the items), with coarse blocks of
#: ``CudaOptions.stack_base`` tiles (default 4) when ``base`` is not given. Measured on the
#: H200 (64 x 1024², 128 x 768x2048, 64 x 256²; docs/benchmarks/h200.md, "Stacks"): the wavefront was as fast as or
#: faster than the one-launch anti-diagonal at every size (1.7x at 1024²), and base 4 the
#: fastest of 2, 4, 8, 16 on all three. Matrices of at most 4 tiles take the anti-diagonal.
#: ... for items of fewer than ``STACK_LARGE`` tiles a side; larger items take the single
#: layer's ``DEFAULT_BASE``. Measured on the H200 (float32, tile 16): base 4 against 16 for
#: 64 x 1024² 26.7 against 36.0 ms, for 128 x 768x2048 80.3 against 110.6 ms; for the stacks
#: of a Llama-3-8B block (2 x 4096², 2 x 1024x4096, 2 x 14336x4096, 1 x 4096x14336) 348 ms
#: of solves with base 4 against 292 ms with 16 (docs/stacks.md)
STACK_LARGE = 256
#: ... and when the stack has at least this many items (one item: the single-layer rule)
STACK_MIN_ITEMS = 2


def stack_base(p, opts: CudaOptions) -> int:
    """The coarse block of a stack's wavefront when ``base`` is not given (``p``: the first
    item's ``Problem``): ``opts.stack_base``, or ``DEFAULT_BASE`` for items with a side of
    ``STACK_LARGE`` tiles or more (where one item's blocks already fill the GPU and fewer,
    larger GEMMs pay)."""
    return DEFAULT_BASE if max(p.M, p.N) >= STACK_LARGE else opts.stack_base


class _StackSolve(_DeviceSolve):
    """One launch context for items ``[start, stop)`` of a stack chunk: the kernel's arrays
    hold every item (inputs as the stack layer flattened them, the chunk's outputs in place,
    ``E`` and the accumulator per item), and each block descriptor says where its item
    starts in each (``_cuda_layout.block_row``)."""

    def __init__(self, chunk, p, tables):
        self._setup(p, items=True)
        mod = self.mod
        m, n = p.m, p.n
        items = np.arange(chunk.start, chunk.stop)
        self.nb = nb = len(items)

        def rows_of(flat, index):
            """The rows of ``flat`` that the chunk's items use, contiguous, and each item's
            row in that range (a shared factor: the same row for every item)."""
            idx = np.asarray(index)[items]
            lo, hi = int(idx.min()), int(idx.max())
            return mod.ascontiguousarray(flat[lo:hi + 1]), idx - lo

        self.W, w_row = rows_of(chunk.W, chunk.w_index)
        self.AI, ai_row = rows_of(chunk.A_in, chunk.in_index)
        if p.two_sided:
            self.AO, ao_row = rows_of(chunk.A_out, chunk.out_index)
        else:
            self.AO, ao_row = None, np.zeros(nb, dtype=np.int64)
        self.Wq = chunk.values
        self.codes = chunk.codes
        self.T = chunk.targets
        # the quantizer tables (_stack_tables): one shared table, or one per item stacked
        S, Z, shared = tables
        self.S = mod.ascontiguousarray(S)
        self.Z = None if Z is None else mod.ascontiguousarray(Z)
        self.s_shape = tuple(int(v) for v in S.shape[-2:])
        self.z_shape = (1, 1) if Z is None else tuple(int(v) for v in Z.shape[-2:])
        s_size = 0 if shared else self.s_shape[0] * self.s_shape[1]
        z_size = 0 if shared else self.z_shape[0] * self.z_shape[1]
        mn = m * n
        # each item's offsets as descriptor fields (the tile ranges and F left 0)
        j = np.arange(nb, dtype=np.int64)
        off = np.zeros((nb, DESC), dtype=np.int64)
        off[:, DESC_W_OFFSET] = np.asarray(w_row, dtype=np.int64) * mn
        off[:, DESC_OUT_OFFSET] = items * mn
        off[:, DESC_E_OFFSET] = j * mn
        off[:, DESC_AO_OFFSET] = np.asarray(ao_row, dtype=np.int64) * m * m
        off[:, DESC_AI_OFFSET] = np.asarray(ai_row, dtype=np.int64) * n * n
        off[:, DESC_S_OFFSET] = j * s_size
        off[:, DESC_Z_OFFSET] = j * z_size
        self.item_desc = off

    def blocks(self, rows: np.ndarray, f_stride: int) -> np.ndarray:
        """The descriptors of one item's blocks ``rows`` (k, DESC) for every item, item after
        item (nb k, DESC): the item's offsets added, its ``F`` region ``f_stride`` further."""
        d = np.repeat(self.item_desc[:, None, :], len(rows), axis=1)
        d[:, :, :DESC_W_OFFSET] = rows[None, :, :DESC_W_OFFSET]
        d[:, :, DESC_F_OFFSET] += np.arange(self.nb, dtype=np.int64)[:, None] * f_stride
        return d.reshape(-1, DESC)


def _stack_antidiagonal(r: _StackSolve) -> str:
    """Every item's whole tile wavefront in ONE launch: step ``g`` solves anti-diagonal
    ``g`` of all items (period 1: the items' blocks have one shape)."""
    p = r.p
    mod = r.mod
    two = p.two_sided
    mn = p.m * p.n
    one = np.array([block_row(0, p.M, 0, p.N, 0, p.n)], dtype=np.int64)
    desc = r.device_table(r.blocks(one, mn).reshape(-1))
    r.E = mod.empty((r.nb * mn,), dtype=p.W.dtype)
    Y = mod.empty((r.nb * mn,), dtype=p.W.dtype)  # each item's local accumulator G_O^T Ẽ
    nsteps = step_count(p.M, p.N, two)
    r.launch(desc, 0, r.nb, nsteps, _widths([(p.M, p.N)], two, r.nb), 0, Y, period=1,
             span=(p.M, p.N))
    if _local(r.opts, r.nb, (p.M, p.N)):
        return (f"one launch for {r.nb} items: each CTA solves whole items, {nsteps} tile "
                f"steps each")
    return (f"one launch for {r.nb} items: {nsteps} grid-synchronised tile steps, each over "
            f"the tiles of every item")


class _StackWavePlan:
    """The two-level plan of one item (``_WavePlan``) repeated over the items of a stack
    chunk: each coarse step's descriptors hold every item's blocks (item after item, so the
    launch's period is one item's blocks) and each planned GEMM's batch holds every item's
    entries, shifted by the item's offsets in ``E``/``Yg``/``Fb``/``Fp``/``A_I``/``A_O``."""

    def __init__(self, r: "_StackSolve", plan: _WavePlan):
        nb, mn, fb = r.nb, r.m * r.n, plan.fb_size
        j = np.arange(nb, dtype=np.int64)
        item_off = {"Yg": j * mn, "E": j * mn, "Fb": j * fb, "Fp": j * plan.slices * fb,
                    "AI": r.item_desc[:, DESC_AI_OFFSET], "AO": r.item_desc[:, DESC_AO_OFFSET]}
        self.fb_size, self.per, self.slices = fb, plan.per, plan.slices
        self.counts, self.counts_dev = plan.counts, plan.counts_dev
        desc, steps, first = [], [], 0
        for start, k, nsteps, grid, flags, before, after, period, span, reduce in plan.steps:
            desc.append(r.blocks(plan.desc_rows[start:start + k], fb))
            # the items repeat one item's blocks, so the item's period is the stack's
            steps.append((first, k * nb, nsteps, (grid[0] * nb, grid[1] * nb), flags, before,
                          after, period, span, reduce))
            first += k * nb
        self.steps = steps
        self.ops = []
        kb = max([op[11] for op in plan.ops] + [1]) * nb
        offs = np.zeros((3 * len(plan.ops), kb), dtype=np.int64)
        for op in plan.ops:
            ta, tb, M, N, K, alpha, beta, A, B, C, row, k = op
            for t, buf in enumerate((A, B, C)):
                shift = np.asarray(item_off[buf[0]], dtype=np.int64)
                offs[row + t, :k * nb] = (plan.offs[row + t, :k][None, :]
                                          + shift[:, None]).reshape(-1)
            self.ops.append([ta, tb, M, N, K, alpha, beta, A, B, C, row, k * nb])
        self.offs = offs
        self.bidx = plan.bidx
        self.batched = any(op[11] > 1 for op in self.ops)
        self.desc = r.device_table(np.concatenate(desc).reshape(-1))
        if not SIM and self.batched:
            self.offs_dev = r.device_table(offs)
            self.bidx_dev = r.device_table(self.bidx)


def _stack_wavefront(r: "_StackSolve", cs: int) -> str:
    """The two-level wavefront of every item at once: per coarse step, batched GEMMs over
    every item's blocks, one launch, batched GEMMs."""
    plan = _cached(_key(r, "wavefront", cs), lambda: _WavePlan(r, cs))
    # the stack plan depends on the items' offsets too: cached for repeated stacks alike
    sp = _cached(_key(r, "wavefront", cs) + (r.item_desc.tobytes(),),
                 lambda: _StackWavePlan(r, plan))
    _wave_buffers(r, sp, r.nb, True)
    _run_steps(r, sp, r.nb)
    return (f"one launch per coarse step for {r.nb} items: {len(sp.steps)} coarse steps of "
            f"base {cs}, each batched GEMMs over every item's blocks, one launch, batched "
            f"GEMMs")


def _stack_tables(chunk, p):
    """The quantizer tables of the chunk's items in W's dtype on the device, ``(S, Z,
    shared)``: one quantizer's tables when every item shares it (``shared``), else every
    item's tables stacked ``(k, r, g)`` (one host-to-device copy); ``None`` when the items'
    quantizers differ in kind (:meth:`bakron.UniformQuantizer.table_kind`) or one is not a
    plain :class:`bakron.UniformQuantizer` (the chunk is then declined)."""
    from bakron.solvers.engines import is_plain_uniform

    qs = chunk.quantizers[chunk.start:chunk.stop]
    q0 = qs[0]
    # is_plain_uniform looks at the type only: one instance of each type
    if not all(is_plain_uniform(q) for q in {type(q): q for q in qs}.values()):
        return None
    if all(q is q0 for q in qs):
        return (*q0.tables(p.xp, p.device, p.dtype), True)
    kind = q0.table_kind()
    if not all(q.table_kind() == kind for q in qs):
        return None
    return (*type(q0).stacked_tables(qs, p.xp, p.device, p.dtype), False)


def stack_method(p, items: int, method: str) -> str | None:
    """The method the chunks of a stack of ``items`` items like ``p`` run with every launch
    covering all of a chunk's items (every chunk of a stack decides alike), or ``None`` to
    decline (the stack layer then solves its items one by one). ``antidiagonal`` and
    ``wavefront`` have stack forms, the recursion not; ``"auto"`` (for at least
    ``STACK_MIN_ITEMS`` items) takes the two-level wavefront (the anti-diagonal for
    matrices of at most 4 tiles)."""
    if not p.options_for(CudaOptions).stack:
        return None
    if method in ("antidiagonal", "wavefront"):
        return method
    if method != "auto" or items < STACK_MIN_ITEMS:
        return None
    return "antidiagonal" if p.M * p.N <= 4 else "wavefront"


def solve_stack(chunk):
    """The stack hook (``bakron.solvers.stack.StackChunk``; docs/stacks.md): solve items
    ``[chunk.start, chunk.stop)`` with every launch covering all of them, writing into the
    chunk's outputs; one ``info`` dict per item, or ``None`` to decline.

    Declines when the method has no stack form here (:func:`stack_method`), for the
    ``direct`` variant, when the items' quantizers differ in kind, or when the outputs are
    not contiguous. Extra memory: ``E`` and the local accumulator, ``2 m n`` per item, and
    the wavefront's base targets with their partial products (at most about ``m n`` more)."""
    from bakron import _xp
    from bakron.solvers._problem import Problem

    if chunk.variant != "accumulator" or chunk.stop <= chunk.start:
        return None
    W0, A_out0, A_in0, q0 = chunk.item(chunk.start)
    p = Problem(_xp.namespace(W0), W0, A_out0, A_in0, q0, chunk.tile,
                record_targets=chunk.targets is not None, options=chunk.options)
    if CAPABILITIES.refusal(p) is not None:
        return None
    method = stack_method(p, int(chunk.values.shape[0]), chunk.method)  # the whole stack's
    if method is None:
        return None
    tables = _stack_tables(chunk, p)
    outs = [chunk.values] + [a for a in (chunk.codes, chunk.targets) if a is not None]
    if tables is None or not all(a.flags.c_contiguous for a in outs):
        return None
    if chunk.codes is None:  # the stacked codes, allocated by the first chunk (the kernel
        v = chunk.values      # writes every item's codes: no fill)
        chunk.codes = (np if SIM else _cupy()).empty(tuple(v.shape), dtype=np.int16)
    r = _StackSolve(chunk, p, tables)
    base = None
    if method == "antidiagonal":
        ran = _stack_antidiagonal(r)
    else:
        base = max(1, int(stack_base(p, r.opts) if chunk.base is None else chunk.base))
        ran = _stack_wavefront(r, base)
    return [{"quantizer_calls": 0, "launches": r.launches, "gemms": r.gemms, "method": method,
             "base": base,
             "engine": NAME, "stack_run": ran} for _ in range(r.nb)]


def _cupy():
    import cupy
    return cupy


# ------------------------------------------------------------------------------------------
# the input and result checks of bakron.solve and the stack layer, one kernel each
# (backends/_cuda_checks.py; the numba CPU engine has the same three functions)
# ------------------------------------------------------------------------------------------

_SMS: dict = {}


def _check_context():
    """``(array module, numba stream, SM count, device)`` for a check kernel on the current
    stream."""
    if SIM:
        return np, 0, 1, 0
    cupy = _cupy()
    dev = cupy.cuda.Device().id
    if dev not in _SMS:
        _SMS[dev] = int(cupy.cuda.Device(dev).attributes["MultiProcessorCount"])
    return cupy, _numba_stream(cupy.cuda.get_current_stream().ptr, dev), _SMS[dev], dev


def count_nonfinite(X):
    """The number of NaN and Inf entries of a float32/float64 array in one kernel, for the
    input and result checks (``None`` for other arrays: the array-API check counts then)."""
    from . import _cuda_checks
    return _cuda_checks.count_nonfinite(_check_context(), X)


def factor_scan(A, block: int):
    """The statistics the factor checks of ``bakron.solve`` need, in one kernel:
    ``(forbidden, row_any, first, col_any)`` as ``numba_cpu.factor_scan`` defines them."""
    from . import _cuda_checks
    return _cuda_checks.factor_scan(_check_context(), A, block)


def input_checks(arrays: dict, blocks: dict):
    """The statistics of ``bakron.solve``'s input checks, every kernel writing its part of
    one float64 array read back once: ``(nonfinite, forbidden, coarse_tile)``, dicts by name
    (``_cuda_checks.input_checks``), or ``None`` for dtypes the kernels do not take."""
    from . import _cuda_checks
    return _cuda_checks.input_checks(_check_context(), arrays, blocks)


def stack_checks(arrays: dict, blocks: dict):
    """The statistics of the stack layer's input checks: launches the kernels and returns a
    function that reads them back once, ``(nonfinite, forbidden)``, dicts by name
    (``_cuda_checks.stack_checks``); ``None`` for arrays the kernels do not take."""
    from . import _cuda_checks
    return _cuda_checks.stack_checks(_check_context(), arrays, blocks)


def warm_up(dtypes=("float32", "float64"), tiles=((16, 16),),
            options: CudaOptions | None = None) -> None:
    """Compile the kernels (a few seconds each) so that the first solve is not slower
    (``options``: the options the solves will run with; default the defaults)."""
    for dt in dtypes:
        for tx, ty in tiles:
            for running in (True, False):
                kernel_variant(dt, tx, ty, False, running, opts=options)


def auto_method(p, base: int) -> str:
    """``method="auto"`` on the GPU, from the measurements in docs/benchmarks/h200.md: the
    two-level wavefront is the fastest schedule at every measured size, faster than the
    quadrant recursion and the single-launch anti-diagonal, because on the GPU the number of
    dependent grid steps decides."""
    if p.M * p.N <= 4:
        return "antidiagonal"
    return "wavefront"
