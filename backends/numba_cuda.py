"""The CUDA engine: numba-cuda kernels for the base blocks, cuBLAS (through cupy) for the GEMMs.

Selected by ``bakron.solve(..., engine="cuda")`` and by ``engine="auto"`` for cupy inputs with a
:class:`bakron.UniformQuantizer`. cupy arrays in, cupy arrays out, on the caller's device and
current stream. ``numba.cuda`` is imported when this engine first loads (``import bakron``
never imports it). Under numba-cuda's simulator (``NUMBA_ENABLE_CUDASIM=1`` set before numba is
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

Which one is fastest is measured (``python -m bakron.bench_gpu``, docs/benchmarks/gpu.md) and
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

The engine is split by role: this module (the capability table, the measured rules, the
hooks of the engine contract), ``_cuda_methods`` (the methods and their stack forms),
``_cuda_plans`` (the schedules as descriptors and GEMM tables, cached), ``_cuda_runtime``
(the run context: kernel variants, launches, GEMMs, streams), over the kernels
(``_cuda_kernels``, ``_cuda_checks``) and the launch path (``_cuda_launch``).
"""
from __future__ import annotations

import numpy as np

__all__ = ["NAME", "CAPABILITIES", "available", "run", "auto_base", "auto_method", "warm_up",
           "DEFAULT_BASE", "solve_stack", "stack_method", "count_nonfinite", "factor_scan",
           "input_checks", "stack_checks"]

from bakron.solvers.engines import (COUNT_NONFINITE, FACTOR_SCAN, INPUT_CHECKS, SOLVE_STACK,
                                    STACK_CHECKS, STACK_METHOD, UNIFORM_FUSED, Capabilities,
                                    EngineResult)
from bakron.solvers.options import CudaOptions, defaults  # noqa: F401

from . import _cuda_methods as _methods
# also read here by the GPU benchmark, the scripts and the tests: the plan and grid caches,
# the kernel variants under options
from ._cuda_plans import _PLANS  # noqa: F401
from ._cuda_runtime import (_MAXGRID, SIM, _check_context, _cuda, _cupy,  # noqa: F401
                            _DeviceSolve, _local, grid_key, kernel_variant, launch_mode,
                            per_thread)

#: Base block (tiles per side) used when ``solve`` is called with the library default ``base``
#: (the recursion's base, the wavefront's coarse block). Measured: docs/benchmarks/gpu.md.
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


def auto_base(p) -> int:
    """Base-block size in tiles for ``base=None`` (measured: docs/benchmarks/gpu.md)."""
    return DEFAULT_BASE


def run(p, method: str, base: int, variant: str) -> EngineResult:
    """Run ``method`` on the GPU; new arrays out (``info``: kernel launches and GEMM calls)."""
    if not CAPABILITIES.runs(method, variant):
        raise ValueError(f"method={method!r} is not available on engine {NAME!r}")
    r = _DeviceSolve(p)
    if method == "antidiagonal":
        _methods._antidiagonal(r)
    elif method == "wavefront":
        _methods._wavefront(r, max(1, int(base)))
    else:
        _methods._recursive(r, max(1, int(base)))
    return EngineResult(values=r.Wq, codes=r.codes, targets=r.T,
                        info={"quantizer_calls": 0, "launches": r.launches, "gemms": r.gemms})


# ------------------------------------------------------------------------------------------
# stacks: the items of a chunk advance together (docs/stacks.md)
# ------------------------------------------------------------------------------------------

#: ``method="auto"`` on a stack: the two-level wavefront in stack form (per coarse step one
#: launch over every item's blocks, batched GEMMs over the items), with coarse blocks of
#: ``CudaOptions.stack_base`` tiles (default 4) when ``base`` is not given. Measured on the
#: H200 (64 x 1024², 128 x 768x2048, 64 x 256²; docs/benchmarks/gpu.md, "Stacks"): the wavefront was as fast as or
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
    tables = _methods._stack_tables(chunk, p)
    outs = [chunk.values] + [a for a in (chunk.codes, chunk.targets) if a is not None]
    if tables is None or not all(a.flags.c_contiguous for a in outs):
        return None
    if chunk.codes is None:  # the stacked codes, allocated by the first chunk (the kernel
        v = chunk.values      # writes every item's codes: no fill)
        chunk.codes = (np if SIM else _cupy()).empty(tuple(v.shape), dtype=np.int16)
    r = _methods._StackSolve(chunk, p, tables)
    base = None
    if method == "antidiagonal":
        ran = _methods._stack_antidiagonal(r)
    else:
        base = max(1, int(stack_base(p, r.opts) if chunk.base is None else chunk.base))
        ran = _methods._stack_wavefront(r, base)
    return [{"quantizer_calls": 0, "launches": r.launches, "gemms": r.gemms, "method": method,
             "base": base,
             "engine": NAME, "stack_run": ran} for _ in range(r.nb)]


# ------------------------------------------------------------------------------------------
# the input and result checks of bakron.solve and the stack layer, one kernel each
# (backends/_cuda_checks.py; the numba CPU engine has the same three functions)
# ------------------------------------------------------------------------------------------

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
    """``method="auto"`` on the GPU, from the measurements in docs/benchmarks/gpu.md: the
    two-level wavefront is the fastest schedule at every measured size, faster than the
    quadrant recursion and the single-launch anti-diagonal, because on the GPU the number of
    dependent grid steps decides."""
    if p.M * p.N <= 4:
        return "antidiagonal"
    return "wavefront"
