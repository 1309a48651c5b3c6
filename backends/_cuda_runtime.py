"""The CUDA engine's device runtime: the kernel variants under a ``CudaOptions``, the run
context of one solve (``_DeviceSolve``: buffers, stream, launch descriptors, kernel launches,
cuBLAS GEMMs through cupy, and their host emulation under numba-cuda's simulator), and the
context of the check kernels. The plans (``_cuda_plans``) and the methods
(``_cuda_methods``) are built on it; ``numba_cuda`` is the engine."""
from __future__ import annotations


import numpy as np

from bakron.solvers.options import CudaOptions, defaults, environment

from ._cuda_layout import (ASYM, DESC, HAS_T, P_FLAGS, P_GSZ, P_HI, P_LO, P_M, P_N, P_NBLK,
                           P_NSTEPS, P_PERIOD, P_S_COLS, P_S_ROWS, P_Z_COLS, P_Z_ROWS, PRM,
                           TWO_SIDED)

SIM = environment("NUMBA_ENABLE_CUDASIM") == "1"  # numba-cuda's simulator (numba's variable)
#: set when a raw-pointer launch has failed in this process: every launch then wraps arrays
_PTR_FAILED = False

_STREAMS: dict = {}
_MAXGRID: dict = {}
_PARAMS: dict = {}   # launch descriptors on the device, oldest first
_PARAMS_MAX = 4096


def per_thread(opts: CudaOptions, running: bool) -> int:
    """Elements of a tile per thread of the kernel: ``opts.per_thread``, or when it is 0, 2
    for the running-sum step and 1 for the other (measured on the H200: a 4096² wavefront
    with CTAs of 128 threads, twice as many resident, took 11 % less time,
    docs/benchmarks/gpu.md)."""
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


def _cupy():
    import cupy
    return cupy


def _local(opts: CudaOptions, nblk: int, span) -> bool:
    """Whether a launch of ``nblk`` blocks, the largest ``span = (Mb, Nb)`` tiles, solves
    whole blocks per CTA: at least ``opts.local_blocks`` blocks of at most
    ``opts.local_tiles`` tiles
    (measured on the H200: blocks of 4 x 4 tiles gain, whole 16 x 16-tile matrices per CTA
    took 2.4 times as long as their grid-wide steps; docs/engines.md, "Blocks per CTA and
    the depth of whole sums")."""
    return (0 < opts.local_blocks <= nblk
            and int(span[0]) * int(span[1]) <= opts.local_tiles)


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
            _host_gemm(C, A, B, ta, tb, alpha, beta)
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
                _host_gemm(C, A, B, ta, tb, alpha, beta)
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


def _host_gemm(C, A, B, ta, tb, alpha, beta):
    """The simulator's ``C = alpha op(A) op(B) + beta C`` in numpy (``beta = 0`` ignores C's
    contents, as cuBLAS does)."""
    prod = (A.T if ta else A) @ (B.T if tb else B)
    if beta == 0.0:
        C[...] = alpha * prod
    else:
        C[...] = alpha * prod + beta * C


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
