"""The single-layer solve after its input checks: the engine choice from the capability
tables, the run, the check of the result, and the value checks of the inputs (the
facade :func:`bakron.solvers.solve` and the stack layer :mod:`bakron.solvers.stack` both call
these; neither is imported from here).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .. import _xp
from .._validate import (check_factor_block, check_finite, check_result_finite, map_strips,
                         row_strips)
from . import registry
from ._problem import Problem
from .engines import COUNT_NONFINITE, FACTOR_SCAN, INPUT_CHECKS, offers

__all__ = ["METHODS", "ENGINES", "SolveResult", "execute", "check_wavefront"]

METHODS = ("auto", "naive", "antidiagonal", "recursive", "wavefront")
ENGINES = ("auto", *registry.ENGINE_MODULES)


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
        Method details: ``base``, ``variant``, ``quantizer_calls`` (calls of
        ``quantizer.quantize``; 0 on engines that compile the rounding in) and the engine's
        own counts (the cuda engine: ``launches``, ``gemms``).
    """

    values: Any
    codes: Any
    method: str
    engine: str
    seconds: float
    tile: tuple
    targets: Any = None
    info: dict = field(default_factory=dict)


def _pick_engine(engine: str, p: Problem, method: str, variant: str):
    """The engine module that will run ``p``, from the capability tables.

    ``auto`` takes the first compiled engine (``cuda`` then ``numba`` for cupy, ``numba``
    for numpy) that is available and takes the problem, else the array-API engine; a method
    that engine's table lacks (``naive``, the direct variant on the GPU) goes to the array-API
    engine too. An explicit engine that cannot run here or lacks the method is an error."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "auto":
        for name in ("cuda", "numba") if _xp.is_cupy(p.xp) else ("numba",):
            eng = registry.load(name)
            if eng is not None and eng.CAPABILITIES.refusal(p) is None and (
                    method == "auto" or eng.CAPABILITIES.runs(method, variant)):
                return eng
        return registry.load("array_api")
    eng = registry.load(engine)
    if eng is None:
        raise ValueError(f"engine={engine!r} is not available here (its imports failed or "
                         f"there is no device); use engine='array_api' or 'auto'")
    why = eng.CAPABILITIES.refusal(p)
    if why is not None:
        raise ValueError(f"engine={engine!r} does not support this problem: {why}; use "
                         f"engine='array_api' or 'auto'")
    if method != "auto" and not eng.CAPABILITIES.runs(method, variant):
        what = f"method={method!r}" + (f" with variant={variant!r}"
                                       if method == "antidiagonal" else "")
        raise ValueError(f"{what} is not available on engine {engine!r} (it runs "
                         f"{', '.join(eng.CAPABILITIES.methods)}); use engine='array_api' "
                         f"or 'auto'")
    return eng


def _check_input_values(xp, fast, W, factors) -> None:
    """The checks that read the inputs' values, in this order: ``W`` and each factor finite,
    then each factor ``(A, block, name, recorded block)`` strictly block-lower and not made
    with a coarser block. Their statistics come from the compiled engine ``fast`` when there
    is one: on the GPU one pass for all of them (``input_checks``: every kernel writes its
    part of one array, one synchronisation), on the CPU one compiled pass per array; else from
    array-API passes. The decisions and messages are the same either way."""
    factors = [f for f in factors if f[0] is not None]
    stats = None
    if offers(fast, INPUT_CHECKS):
        stats = fast.input_checks({"W": W, **{name: A for A, _, name, _ in factors}},
                                  {name: block for _, block, name, _ in factors})
    count = fast.count_nonfinite if offers(fast, COUNT_NONFINITE) else None
    for name, x in (("W", W), *((name, A) for A, _, name, _ in factors)):
        check_finite(xp, x, name, count, known=None if stats is None else stats[0][name])
    for A, block, name, recorded in factors:
        if stats is None:
            scan = _factor_scan(fast, A, block)
            _check_strictly_lower(xp, A, block, name, scan)
            check_factor_block(xp, A, block, name, recorded, scan)
            continue
        _refuse_not_strictly_lower(stats[1][name], block, name)
        check_factor_block(xp, A, block, name, recorded, coarse_tile=stats[2][name])


def check_wavefront(eng, method: str) -> None:
    """``method="wavefront"`` on an engine without it (the array-API engine, which ``auto``
    falls back to for a quantizer the compiled engines cannot run): a ``ValueError`` that
    names the argument."""
    if method == "wavefront" and not eng.CAPABILITIES.runs(method, "accumulator"):
        raise ValueError(f"method='wavefront' (the two-level wavefront) is not available on "
                         f"engine {eng.NAME!r}: it runs on the numba engine (numpy arrays) and "
                         f"the cuda engine (cupy arrays), with a bakron.UniformQuantizer; use "
                         f"method='recursive', 'antidiagonal' or 'auto'")


def execute(p: Problem, eng, method: str, base: int | None, variant: str,
            max_naive_bytes: int | None = None) -> SolveResult:
    """Run a checked problem ``p`` on the engine ``eng`` (what :func:`solve` does after its
    checks and engine choice; the stack layer calls it for each item): the engine's measured
    ``auto_base``/``auto_method`` rules, the timed ``run``, the check of the result."""
    xp = p.xp
    if base is None:
        base = int(eng.auto_base(p))
    if method == "auto":
        method = eng.auto_method(p, base)
    info = {"base": base, "variant": variant if method == "antidiagonal" else None}
    kw = {"max_naive_bytes": max_naive_bytes} if eng.NAME == "array_api" else {}

    _xp.sync(xp)
    t0 = time.perf_counter()
    out = eng.run(p, method, base, variant, **kw)
    _xp.sync(xp)
    seconds = time.perf_counter() - t0
    check_result_finite(xp, out.values, p.quantizer,
                        eng.count_nonfinite if offers(eng, COUNT_NONFINITE) else None)
    info.update(out.info)
    return SolveResult(values=out.values, codes=out.codes, method=method, engine=eng.NAME,
                       seconds=seconds, tile=(p.tx, p.ty), targets=out.targets, info=info)


def _compiled(xp, engine: str):
    """The compiled engine's module that may run a solve of these arrays and is available
    (the numba engine for numpy, the cuda engine for cupy; ``engine`` ``auto`` or that
    engine), else ``None``: its one-pass kernels (the hooks its capability table declares:
    ``count_nonfinite``, ``factor_scan``, and on the GPU ``input_checks`` and
    ``stack_checks``) then give the input and result checks their statistics,
    instead of several array-API passes (at 2048² on 16 cores those took about a third of a
    solve, docs/engines.md, "Many cores"; on the H200 about 3 ms of a 5 ms solve at 1024²,
    "Checks on the GPU"). The decisions and messages stay here."""
    if _xp.is_numpy(xp) and engine in ("auto", "numba"):
        return registry.load("numba")
    if _xp.is_cupy(xp) and engine in ("auto", "cuda"):
        return registry.load("cuda")
    return None


def _factor_scan(fast, A, block: int):
    """``fast.factor_scan(A, block)`` (``numba_cpu.factor_scan``), or ``None`` without an
    engine that declares the hook (the checks compute the statistics with array-API
    operations)."""
    return fast.factor_scan(A, block) if offers(fast, FACTOR_SCAN) else None


def _check_strictly_lower(xp, A, block: int, name: str, scan=None) -> None:
    """``A`` must be ``L - I``: zero on and above the diagonal and inside the diagonal blocks.
    ``scan``: ``_factor_scan``'s statistics of ``A``, whose first entry is the largest
    ``|entry|`` there."""
    if scan is not None:
        _refuse_not_strictly_lower(scan[0], block, name)
        return
    n = A.shape[0]
    dev = _xp.device(A)
    zero = xp.zeros((1, 1), dtype=A.dtype, device=dev)

    def strip(r0, r1):
        # a strip of whole diagonal blocks (row_strips): right of it everything is forbidden
        # (max and -min, no temporary); its diagonal square takes the mask
        i = xp.arange(r1 - r0, device=dev)
        blk = i // block
        forbidden = (i[None, :] >= i[:, None]) | (blk[None, :] == blk[:, None])
        bad = xp.max(xp.abs(xp.where(forbidden, A[r0:r1, r0:r1], zero)))
        if r1 < n:
            R = A[r0:r1, r1:]
            bad = xp.maximum(bad, xp.maximum(xp.max(R), -xp.min(R)))
        return bad

    bad = float(xp.max(xp.stack(map_strips(strip, row_strips(xp, n, n, block)))))
    _refuse_not_strictly_lower(bad, block, name)


def _refuse_not_strictly_lower(bad: float, block: int, name: str) -> None:
    if bad != 0.0:
        raise ValueError(
            f"{name} must be strictly block-lower-triangular (A = L - I from prepare_factor "
            f"with block size {block}): found entries up to {bad:.3g} on or above the diagonal "
            f"or inside a {block} x {block} diagonal block; did you pass a Hessian instead of "
            f"its factor, a transposed factor, or a factor made with another block size?")
