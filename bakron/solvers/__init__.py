"""The rounding solvers and the public ``solve`` entry point."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .. import _xp
from .._validate import check_factor_shape, check_finite, check_matrix, check_tile
from ._problem import Problem
from .antidiagonal import solve_accumulator, solve_block_accumulator, solve_direct
from .naive import solve_naive
from .recursive import BASE_TILES, solve_recursive

__all__ = ["solve", "SolveResult", "METHODS", "ENGINES"]

METHODS = ("auto", "naive", "antidiagonal", "recursive", "wavefront")
ENGINES = ("auto", "array_api", "numba", "cuda")


@dataclass
class SolveResult:
    """What a solve returns.

    Attributes
    ----------
    values : array (m, n)
        The rounded weights Ŵ, in W's namespace, device and dtype.
    codes : array (m, n) or None
        Integer codes from the quantizer (``None`` if it returned none).
    method, engine : str
        What actually ran (``auto`` resolved).
    seconds : float
        Wall time of the solve (device synchronised).
    tile : tuple
        ``(t_x, t_y)``.
    targets : array or None
        Every tile's target ``T_ab`` when ``return_targets=True``.
    info : dict
        Method details (variant, base block size, quantizer calls).
    """

    values: Any
    codes: Any
    method: str
    engine: str
    seconds: float
    tile: tuple
    targets: Any = None
    info: dict = field(default_factory=dict)


def _resolve_engine(engine: str, p: Problem):
    """Return (name, module or None) of the engine that will run ``p``."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "array_api":
        return "array_api", None
    from .. import backends

    if engine == "auto":
        for name in ("cuda", "numba") if _xp.is_cupy(p.xp) else ("numba",):
            mod = backends.load(name)
            if mod is not None and mod.supports(p):
                return name, mod
        return "array_api", None
    mod = backends.load(engine)
    if mod is None:
        raise ValueError(f"engine={engine!r} is not available here (its imports failed or "
                         f"there is no device); use engine='array_api' or 'auto'")
    if not mod.supports(p):
        raise ValueError(f"engine={engine!r} does not support this problem (array type "
                         f"{p.xp.__name__}, dtype {p.dtype}, quantizer "
                         f"{type(p.quantizer).__name__}); use engine='array_api' or 'auto'")
    return engine, mod


def _auto_base(p: Problem, eng) -> int:
    """Base-block size (tiles per side) when ``base`` is not given: the engine's measured rule
    (``auto_base``; docs/engines.md, docs/benchmarks/h200.md), ``BASE_TILES`` otherwise."""
    if eng is not None and hasattr(eng, "auto_base"):
        return int(eng.auto_base(p))
    return BASE_TILES


def _auto_method(p: Problem, base: int, eng=None) -> str:
    """The schedule for ``method='auto'``: the engine's measured rule (``auto_method``; numba:
    docs/engines.md, cuda: docs/benchmarks/h200.md), otherwise the recursion for anything
    larger than one base block."""
    if eng is not None and hasattr(eng, "auto_method"):
        return eng.auto_method(p, base)
    return "recursive" if (p.M > base or p.N > base) else "antidiagonal"


def solve(W, A_out, A_in, quantizer, *, tile=(16, 16), method: str = "auto",
          engine: str = "auto", variant: str = "accumulator", base: int | None = None,
          return_targets: bool = False, max_naive_bytes: int | None = None) -> SolveResult:
    """Round ``W`` with the two-sided block-LDL feedback rule (docs/algorithm.md).

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
        rules. ``wavefront`` (two-level, docs/algorithm.md) runs on the cuda engine only.
    engine : {"auto", "array_api", "numba", "cuda"}
        Where the base case runs. ``auto``: numba for numpy inputs with a uniform quantizer
        when numba imports, the CUDA kernels for cupy inputs, else the array-API path.
    variant : {"accumulator", "direct"}
        For ``method="antidiagonal"``: how targets are formed (docs/algorithm.md).
    base : int
        Base-block size in tiles for the recursive solver (default: the engine's measured
        rule, docs/engines.md; 8 on the array-API engine).
    return_targets : bool
        Record every tile's target (for the loss identity); forces the array-API engine
        unless the engine records them too.

    Returns
    -------
    SolveResult
    """
    xp = _xp.namespace(W, A_out, A_in)
    check_matrix(xp, W, "W")
    dtype = _xp.float_dtype(xp, W, "W")
    check_finite(xp, W, "W")
    m, n = W.shape
    check_matrix(xp, A_in, "A_in")
    check_factor_shape(A_in, n, "A_in", "A_out", m, "columns")
    check_finite(xp, A_in, "A_in")
    if A_out is not None:
        check_matrix(xp, A_out, "A_out")
        check_factor_shape(A_out, m, "A_out", "A_in", n, "rows")
        check_finite(xp, A_out, "A_out")
    tx, ty = check_tile(tile, m, n)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if variant not in ("accumulator", "direct"):
        raise ValueError(f"variant must be 'accumulator' or 'direct', got {variant!r}")
    auto_base = base is None
    base = BASE_TILES if base is None else int(base)
    if base < 1:
        raise ValueError(f"base must be a positive number of tiles, got {base}")
    if hasattr(quantizer, "check_shape"):
        quantizer.check_shape(m, n)
    _check_strictly_lower(xp, A_in, ty, "A_in")
    if A_out is not None:
        _check_strictly_lower(xp, A_out, tx, "A_out")

    p = Problem(xp, W, A_out, A_in, quantizer, (tx, ty), record_targets=return_targets)
    eng_name, eng = ("array_api", None) if return_targets and engine == "auto" else \
        _resolve_engine(engine, p)
    if method == "wavefront" and eng_name != "cuda":
        raise ValueError("method='wavefront' (the two-level GPU schedule) runs on the cuda "
                         "engine only (cupy arrays); use 'recursive', 'antidiagonal' or 'auto'")
    if auto_base:
        base = _auto_base(p, eng)
    if method == "auto":
        method = _auto_method(p, base, eng)
    info = {"base": base, "variant": variant if method == "antidiagonal" else None}

    _xp.sync(xp)
    t0 = time.perf_counter()
    done = False
    if eng is not None and hasattr(eng, "solve"):
        done = eng.solve(p, method, base, variant)
    if not done:
        block = solve_block_accumulator if eng is None else eng.solve_block
        if method == "naive":
            solve_naive(p, max_naive_bytes)
        elif method == "antidiagonal":
            if variant == "direct":
                solve_direct(p)
            elif eng is None:
                solve_accumulator(p)
            else:
                block(p, 0, p.M, 0, p.N)
        elif method == "recursive":
            solve_recursive(p, block, base)
        else:  # an engine's own method that it declined to run
            raise ValueError(f"method={method!r} is not available on engine {eng_name!r}")
    _xp.sync(xp)
    seconds = time.perf_counter() - t0
    info["quantizer_calls"] = p.quantizer_calls
    return SolveResult(values=p.Wq, codes=p.codes, method=method, engine=eng_name,
                       seconds=seconds, tile=(tx, ty), targets=p.T, info=info)


def _check_strictly_lower(xp, A, block: int, name: str) -> None:
    """``A`` must be ``L - I``: zero on and above the diagonal and inside the diagonal blocks."""
    n = A.shape[0]
    i = xp.arange(n, device=_xp.device(A))
    blk = i // block
    forbidden = (i[None, :] >= i[:, None]) | (blk[None, :] == blk[:, None])
    bad = float(xp.max(xp.abs(xp.where(forbidden, A, xp.zeros_like(A)))))
    if bad != 0.0:
        raise ValueError(
            f"{name} must be strictly block-lower-triangular (A = L - I from prepare_factor "
            f"with block size {block}): found entries up to {bad:.3g} on or above the diagonal "
            f"or inside a {block} x {block} diagonal block; did you pass a Hessian instead of "
            f"its factor, a transposed factor, or a factor made with another block size?")
