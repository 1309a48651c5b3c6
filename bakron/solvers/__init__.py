"""The rounding solvers and the public ``solve`` entry point.

``solve`` validates a single layer's inputs and hands them to :mod:`._execute` (engine choice,
the run, the result's checks); a stack ``(..., m, n)`` goes to :mod:`.stack`, which uses
:mod:`._execute` the same way, so neither imports this package.
"""
from __future__ import annotations

from .. import _xp
from .._validate import (check_factor_shape, check_int, check_matrix, check_quantizer,
                         check_real_dtype, check_tile, factor_array, native)
from . import _execute
from ._execute import (ENGINES, METHODS, SolveResult, _check_input_values, _pick_engine,
                       check_wavefront, execute)
from ._problem import Problem
from .engines import QUIET_BLAS, Capabilities, Engine, EngineResult, offers
from .options import CudaOptions, NumbaOptions, as_options
from .recursive import BASE_TILES

__all__ = ["solve", "SolveResult", "METHODS", "ENGINES", "Engine", "Capabilities", "EngineResult",
           "CudaOptions", "NumbaOptions"]


def solve(W, A_out, A_in, quantizer, *, tile=(16, 16), method: str = "auto",
          engine: str = "auto", variant: str = "accumulator", base: int | None = None,
          return_targets: bool = False, max_naive_bytes: int | None = None,
          options=None) -> SolveResult:
    """Round ``W`` with the two-sided rule (docs/algorithm.md, "The rounding rule").

    A stack of layers — ``W`` of shape ``(..., m, n)``, factors ``(..., m, m)``/``(..., n, n)``
    that broadcast against it, or a sequence of per-item quantizers — goes to
    :func:`bakron.solve_stack` (docs/stacks.md); every item equals its own single solve.

    Parameters
    ----------
    W : array (m, n), float32 or float64
        Weights (numpy, cupy or any array-API array). Not modified.
    A_out : array (m, m) or None
        ``L_O - I`` from :func:`bakron.prepare_factor` on ``H_out`` with block ``t_x``;
        ``None`` means one-sided (``H_O = I``: LDLQ/GPTQ).
    A_in : array (n, n)
        ``L_I - I`` from :func:`bakron.prepare_factor` on ``H_in`` with block ``t_y``.
    quantizer : UniformQuantizer or tile quantizer
        Anything with ``quantize(targets) -> (values, codes)`` over ``(k, t_x, t_y)`` batches.
    tile : int or (t_x, t_y)
        Tile shape; the last tile row/column is smaller when it does not divide W.
    method : {"auto", "naive", "antidiagonal", "recursive", "wavefront"}
        All give the same Ŵ (exactly in float64). ``auto`` picks by the engine's measured
        rules. ``wavefront`` (the two-level schedule) runs on the numba and cuda engines.
    engine : {"auto", "array_api", "numba", "cuda"}
        Which executor runs the schedule (docs/architecture.md). ``auto``: the CUDA engine
        for cupy inputs, numba for numpy inputs, when their capability tables take the
        problem (a plain :class:`bakron.UniformQuantizer`, float32/float64), else the
        array-API engine. An explicit engine that cannot run the problem is an error.
    variant : {"accumulator", "direct"}
        For ``method="antidiagonal"``: how targets are formed (docs/algorithm.md).
    base : int
        Base-block size in tiles for the recursive solver (default: the engine's measured
        rule, docs/engines.md; 8 on the array-API engine).
    return_targets : bool
        Record every tile's target (for the loss identity). With ``engine="auto"`` the
        array-API engine runs (its targets are the reference's sums), except for
        ``method="wavefront"``, which it does not have.
    options : CudaOptions, NumbaOptions or a sequence of them
        The engines' options (at most one object per engine; docs/engine-contract.md). The
        engine that runs uses its own, or its defaults when none is given; the others are
        not used.

    Returns
    -------
    SolveResult
    """
    if isinstance(quantizer, (list, tuple)) or any(getattr(a, "ndim", 2) > 2 for a in (W, A_in, A_out)):  # noqa: E501
        from .stack import solve_stack  # a stack (..., m, n) of layers: docs/stacks.md
        return solve_stack(W, A_out, A_in, quantizer, tile=tile, method=method, engine=engine,
                           variant=variant, base=base, return_targets=return_targets,
                           max_naive_bytes=max_naive_bytes, options=options)
    options = as_options(options)
    (A_out, blk_out), (A_in, blk_in) = factor_array(A_out), factor_array(A_in)
    xp = _xp.namespace(W, A_out, A_in)
    W, A_out, A_in = native(xp, W), native(xp, A_out), native(xp, A_in)
    check_matrix(xp, W, "W")
    dtype = _xp.float_dtype(xp, W, "W")
    fast = _execute._compiled(xp, engine)  # a compiled engine's one-pass checks, or None
    if offers(fast, QUIET_BLAS):
        fast.quiet_blas()  # BLAS's spinning idle threads would slow the compiled checks
    m, n = W.shape
    check_matrix(xp, A_in, "A_in")
    check_factor_shape(A_in, n, "A_in", "A_out", m, "columns")
    check_real_dtype(xp, A_in, "A_in")
    if A_out is not None:
        check_matrix(xp, A_out, "A_out")
        check_factor_shape(A_out, m, "A_out", "A_in", n, "rows")
        check_real_dtype(xp, A_out, "A_out")
    tx, ty = check_tile(tile, m, n)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if variant not in ("accumulator", "direct"):
        raise ValueError(f"variant must be 'accumulator' or 'direct', got {variant!r}")
    auto_base = base is None
    base = BASE_TILES if base is None else check_int(base, "base", minimum=1,
                                                      what="a positive number of tiles")
    check_quantizer(quantizer, m, n, dtype)
    _check_input_values(xp, fast, W, ((A_in, ty, "A_in", blk_in), (A_out, tx, "A_out", blk_out)))

    p = Problem(xp, W, A_out, A_in, quantizer, (tx, ty), record_targets=return_targets,
                options=options)
    if return_targets and engine == "auto" and method != "wavefront":
        engine = "array_api"  # the reference's sums (the array-API engine has no wavefront)
    eng = _pick_engine(engine, p, method, variant)
    check_wavefront(eng, method)
    return execute(p, eng, method, None if auto_base else base, variant, max_naive_bytes)
