"""The one-call path for a layer: Hessians in, rounded weights and proxy errors out."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from . import _xp
from ._lib.proxy import ProxyMetrics
from ._validate import (check_array_kind, check_damp, check_factor_shape, check_finite,
                        check_matrix, check_quantizer, check_real_dtype, check_tile, native)
from .factors import Factor, check_shrink, prepare_factor
from .quantizers import UniformQuantizer
from .solvers import SolveResult, solve
from .solvers.options import as_options

__all__ = ["proxy_error", "quantize_layer", "LayerResult", "METRICS"]


def proxy_error(W, W_hat, H_in, H_out=None) -> float:
    """Normalised proxy error ``tr(E H_I Eᵀ H_O) / tr(W H_I Wᵀ H_O)`` with ``E = W - Ŵ``.

    ``H_out=None`` gives the one-sided error (``H_O = I``); a vector ``H_out`` (length m) is
    the diagonal of a diagonal ``H_O``. Computed in float64. An all-zero W rounded to zeros
    has error 0.
    """
    xp = _xp.namespace(W, W_hat, H_in, H_out)
    W, W_hat, H_in, H_out = (native(xp, a) for a in (W, W_hat, H_in, H_out))
    check_matrix(xp, W, "W")
    check_matrix(xp, W_hat, "W_hat")
    m, n = W.shape
    if tuple(W_hat.shape) != (m, n):
        raise ValueError(f"W_hat has shape {tuple(W_hat.shape)} but W has shape {(m, n)}")
    check_matrix(xp, H_in, "H_in")
    check_factor_shape(H_in, n, "H_in", "H_out", m, "columns")
    _check_h_out(xp, H_out, m, n)
    for name, a in (("W", W), ("W_hat", W_hat), ("H_in", H_in), ("H_out", H_out)):
        if a is not None:
            check_real_dtype(xp, a, name)
            check_finite(xp, a, name)
    return ProxyMetrics(xp, W, H_in, H_out).error(W_hat, "two")


def _check_h_out(xp, H_out, m: int, n: int) -> None:
    """``H_out``: None, an (m, m) matrix or the length-m diagonal of a diagonal factor."""
    if H_out is None:
        return
    check_array_kind(H_out, "H_out")
    if len(getattr(H_out, "shape", ())) == 1:
        if H_out.shape[0] != m:
            raise ValueError(f"H_out is a vector of length {H_out.shape[0]} (the diagonal of a "
                             f"diagonal H_out) but W has {m} rows")
        return
    check_matrix(xp, H_out, "H_out")
    check_factor_shape(H_out, m, "H_out", "H_in", n, "rows")


@dataclass
class LayerResult:
    """Result of :func:`quantize_layer`.

    ``values``/``codes`` are the rounded weights and codes; ``proxy_error`` is the two-sided
    proxy error (under ``H_out ⊗ H_in``; equal to the one-sided one when ``H_out`` is None),
    ``proxy_error_one_sided`` the error under ``I ⊗ H_in``; the ``rtn_*`` fields are the same
    for round-to-nearest. ``damp_in``/``damp_out`` are the damping actually used.
    ``input_dtype`` is W's dtype as given (``values`` are in the working dtype: float32 for a
    half-precision W). Figures that ``metrics`` did not ask for are ``None``.

    With incoherence processing (``quantize_layer(..., incoherence=seed)``) ``rotation`` is
    the :class:`~bakron.incoherence.Incoherence` used: ``codes`` and ``quantizer`` are those
    of the rotated weights ``W' = U W Vᵀ`` and ``values`` / ``rtn_values`` are rotated back,
    ``Uᵀ Ŵ' V`` (not on the grid); the proxy errors are the same in both bases.
    """

    values: Any
    codes: Any
    quantizer: Any
    solve: SolveResult
    factor_in: Factor
    factor_out: Factor | None
    proxy_error: float | None
    proxy_error_one_sided: float | None
    rtn_values: Any
    rtn_proxy_error: float | None
    rtn_proxy_error_one_sided: float | None
    seconds_factor: float
    seconds_solve: float
    seconds_metrics: float = 0.0
    input_dtype: str = ""
    metrics: str = "full"
    rotation: Any = None

    @property
    def damp_in(self) -> float:
        return self.factor_in.damp

    @property
    def damp_out(self) -> float | None:
        return None if self.factor_out is None else self.factor_out.damp

    def summary(self) -> dict:
        """A JSON-friendly dictionary of the figures."""
        return {
            "method": self.solve.method, "engine": self.solve.engine,
            "tile": list(self.solve.tile), "quantizer": repr(self.quantizer),
            "proxy_error": self.proxy_error, "proxy_error_one_sided": self.proxy_error_one_sided,
            "rtn_proxy_error": self.rtn_proxy_error,
            "rtn_proxy_error_one_sided": self.rtn_proxy_error_one_sided,
            "damp_in": self.damp_in, "damp_out": self.damp_out,
            "seconds_factor": self.seconds_factor, "seconds_solve": self.seconds_solve,
            "seconds_metrics": self.seconds_metrics, "input_dtype": self.input_dtype,
            "values_dtype": str(self.values.dtype), "metrics": self.metrics,
        }


METRICS = ("none", "basic", "full")


def _working_dtype(xp, W):
    """(W in its working dtype, the input dtype's name): half precisions (float16, bfloat16)
    are computed in float32; float32/float64 are kept; anything else raises ``TypeError``."""
    name = str(W.dtype).split(".")[-1]
    if name in ("float16", "bfloat16"):
        return xp.astype(W, xp.float32), name
    check_real_dtype(xp, W, "W")
    _xp.float_dtype(xp, W, "W")
    return W, name


def quantize_layer(W, H_in, H_out=None, *, quantizer=None, bits: int | None = None,
                   tile=(16, 16), method: str = "auto", engine: str = "auto",
                   damp: float = 0.01, symmetric: bool = True, granularity: str = "row",
                   group_size: int | None = None, scale_method: str = "rms",
                   metrics: str = "full", progress=None, damp_out: float | None = None,
                   shrink_out: float = 0.0, incoherence=None, options=None) -> LayerResult:
    """Quantize one linear layer from its Hessian factors.

    Parameters
    ----------
    W : array (m, n)
        Weights (m outputs, n inputs): float32 or float64, or a half precision (float16,
        bfloat16), which is computed in float32: ``values`` are then float32 (exactly the
        grid points; ``result.input_dtype`` records the dtype given). Not modified.
    H_in : array (n, n)
        Input-side factor ``E[x x^T]``.
    H_out : array (m, m) or (m,), optional
        Output-side factor; ``None`` gives one-sided LDLQ/GPTQ; a vector is the diagonal of a
        diagonal ``H_out`` (its block LDL is the identity, so the rounding is the one-sided
        rule and only the two-sided proxy errors are weighted by it; no m x m matrix is built).
    quantizer : optional
        A :class:`UniformQuantizer` or a tile quantizer. When omitted, a uniform grid of
        ``bits`` bits is fitted to W (``symmetric``, ``granularity``, ``group_size``,
        ``scale_method`` as in :meth:`UniformQuantizer.fit`).
    tile, method, engine, options
        As in :func:`bakron.solve` (``options``: :class:`bakron.CudaOptions`,
        :class:`bakron.NumbaOptions` or a sequence of them).
    damp : float
        Relative damping of both factors (escalated if needed; see :func:`prepare_factor`).
    damp_out, shrink_out : float, optional
        Regularisation of a full ``H_out`` alone: its relative damping (default ``damp``) and
        its shrinkage toward its diagonal, ``(1 - s) H_out + s diag(H_out)`` (default 0;
        ``1`` gives the one-sided rounding). A sampled ``H_out`` underestimates what errors in
        its small eigen-directions cost: :func:`bakron.factors.auto_regularization` gives the
        rule ``bakron quantize-model --damp-out auto`` uses (docs/hessian.md).
    metrics : {"full", "basic", "none"}
        Proxy errors to compute: ``full`` all four (the layer's loss and the one-sided one, for
        the result and for round-to-nearest); ``basic`` the layer's loss only (``proxy_error``,
        ``rtn_proxy_error``); ``none`` no RTN and no proxy errors (the fastest).
    progress : callable, optional
        Called with a short message before each phase (factor preparation, solve, metrics).
    incoherence : int or Incoherence, optional
        Incoherence processing (:mod:`bakron.incoherence`): with a seed (or an
        :class:`~bakron.incoherence.Incoherence` of W's shape) the layer is rotated on both
        sides, ``W' = U W Vᵀ``, ``H_in' = V H_in Vᵀ``, ``H_out' = U H_out Uᵀ``, rounded there
        (the grid is fitted to ``W'``; a given ``quantizer`` must be one for ``W'``), and the
        result rotated back: ``values = Uᵀ Ŵ' V``, which is not on the grid, so only a float
        export (or a runtime that applies the rotations) can use it. ``None`` (default): off.

    Returns
    -------
    LayerResult
    """
    if metrics not in METRICS:
        raise ValueError(f"metrics must be one of {METRICS}, got {metrics!r}")
    options = as_options(options)  # checked before the factors are prepared
    if incoherence is not None:
        return _incoherent(W, H_in, H_out, incoherence, quantizer=quantizer, bits=bits,
                           tile=tile, method=method, engine=engine, damp=damp,
                           symmetric=symmetric, granularity=granularity,
                           group_size=group_size, scale_method=scale_method,
                           metrics=metrics, progress=progress, damp_out=damp_out,
                           shrink_out=shrink_out, options=options)
    say = progress if callable(progress) else (lambda msg: None)
    prep = _prepare(W, H_in, H_out, quantizer=quantizer, bits=bits, tile=tile, damp=damp,
                    symmetric=symmetric, granularity=granularity, group_size=group_size,
                    scale_method=scale_method, say=say, damp_out=damp_out,
                    shrink_out=shrink_out)
    (tx, ty), (m, n) = prep.tile, prep.W.shape
    say(f"solving ({m} x {n}, tile {tx}x{ty})")
    res = solve(prep.W, feedback(prep.f_out), prep.f_in.A, prep.quantizer, tile=prep.tile,
                method=method, engine=engine, options=options)
    return _layer_result(prep, res, metrics=metrics, say=say)


def _checked_layer(W, H_in, H_out):
    """``(xp, W, H_in, H_out, input_dtype)``: the layer's arrays as native arrays of one
    namespace, ``W`` in its working dtype and finite, the factors' shapes checked."""
    xp = _xp.namespace(W, H_in, H_out)
    W, H_in, H_out = native(xp, W), native(xp, H_in), native(xp, H_out)
    check_matrix(xp, W, "W")
    W, input_dtype = _working_dtype(xp, W)
    check_finite(xp, W, "W")
    m, n = W.shape
    check_matrix(xp, H_in, "H_in")
    check_factor_shape(H_in, n, "H_in", "H_out", m, "columns")
    _check_h_out(xp, H_out, m, n)
    return xp, W, H_in, H_out, input_dtype


def _incoherent(W, H_in, H_out, incoherence, **kw) -> LayerResult:
    """:func:`quantize_layer` of the rotated layer, its values rotated back."""
    from .incoherence import Incoherence

    xp, W, H_in, H_out, input_dtype = _checked_layer(W, H_in, H_out)
    m, n = W.shape
    if isinstance(incoherence, Incoherence):
        rot = incoherence
        if rot.shape != (m, n):
            raise ValueError(f"incoherence: the rotations are for a {rot.shape[0]} x "
                             f"{rot.shape[1]} layer, W is {m} x {n}")
    else:
        rot = Incoherence(m, n, incoherence)
    for name, a in (("H_in", H_in), ("H_out", H_out)):
        if a is not None:
            check_real_dtype(xp, a, name)
            check_finite(xp, a, name)
    res = quantize_layer(rot.rotate_weight(W), rot.rotate_in(H_in), rot.rotate_out(H_out),
                         **kw)
    res.values = rot.unrotate_weight(res.values)
    if res.rtn_values is not None:
        res.rtn_values = rot.unrotate_weight(res.rtn_values)
    res.rotation, res.input_dtype = rot, input_dtype
    return res


@dataclass
class _Prepared:
    """A layer's checked inputs (W in its working dtype, the Hessians in native byte order),
    its quantizer and prepared factors."""

    xp: Any
    W: Any
    H_in: Any
    H_out: Any
    input_dtype: str
    tile: tuple
    quantizer: Any
    f_in: Factor
    f_out: Factor | None
    seconds_factor: float


def feedback(f_out: Factor | None):
    """The ``A_out`` a solve takes for a prepared output factor: ``None`` for one-sided and for
    a diagonal ``H_out`` (its block LDL is the identity)."""
    return None if f_out is None else f_out.A


def _prepare(W, H_in, H_out, *, quantizer, bits, tile, damp, symmetric, granularity,
             group_size, scale_method, factors: dict | None = None, say=None,
             damp_out=None, shrink_out=0.0) -> _Prepared:
    """Check one layer's inputs, fit its quantizer when none is given, prepare its factors
    (``factors``: a cache by Hessian object and block, for layers that share a Hessian)."""
    say = say or (lambda msg: None)
    xp, W, H_in, H_out, input_dtype = _checked_layer(W, H_in, H_out)
    m, n = W.shape
    diag_out = H_out is not None and len(H_out.shape) == 1
    tx, ty = check_tile(tile, m, n)
    damp = check_damp(damp)
    damp_out = damp if damp_out is None else check_damp(damp_out)
    shrink_out = check_shrink(shrink_out, "shrink_out")
    if quantizer is None:
        if bits is None:
            raise ValueError("give either quantizer= or bits=")
        quantizer = UniformQuantizer.fit(W, bits, symmetric=symmetric, granularity=granularity,
                                         group_size=group_size, method=scale_method)
    else:
        check_quantizer(quantizer, m, n, W.dtype)
    t0 = time.perf_counter()
    factors = {} if factors is None else factors

    def factor(H, block, name, prep):
        key = (id(H), block, damp, name) if name == "H_in" else (id(H), block, damp_out,
                                                                 shrink_out, name)
        if key not in factors:
            factors[key] = (H, prep(H, block, name))
        return factors[key][1]

    say(f"preparing the factors (block LDL of H_in {n} x {n}"
        f"{'' if H_out is None or diag_out else f' and H_out {m} x {m}'})")
    full = lambda H, block, name: prepare_factor(H, block, damp=damp, name=name)  # noqa: E731
    f_in = factor(H_in, ty, "H_in", full)
    if H_out is None:
        f_out = None
    elif diag_out:
        f_out = factor(H_out, tx, "H_out",
                       lambda H, block, name: _diagonal_factor(xp, H, damp_out, block))
    else:
        f_out = factor(H_out, tx, "H_out",
                       lambda H, block, name: prepare_factor(H, block, damp=damp_out,
                                                             name=name, shrink=shrink_out))
    _xp.sync(xp)
    return _Prepared(xp, W, H_in, H_out, input_dtype, (tx, ty), quantizer, f_in, f_out,
                     time.perf_counter() - t0)


def _layer_result(prep: _Prepared, res: SolveResult, *, metrics: str = "full",
                  say=None) -> LayerResult:
    """Round-to-nearest and the proxy errors (as many as ``metrics`` asks) of a solved layer."""
    say = say or (lambda msg: None)
    xp, quantizer, W = prep.xp, prep.quantizer, prep.W
    figures = dict.fromkeys(("pe2", "pe1", "rtn2", "rtn1"))
    rtn = None
    t2 = time.perf_counter()
    if metrics != "none":
        say("computing the proxy errors")
        if hasattr(quantizer, "rtn"):
            rtn = quantizer.rtn(W)[0]
        else:  # nearest rounding tile by tile: the same rule with no feedback
            rtn = solve(W, None, xp.zeros_like(prep.f_in.A), quantizer, tile=prep.tile,
                        method="antidiagonal", engine="array_api").values
        pm = ProxyMetrics(xp, W, prep.H_in, prep.H_out)
        sides = ("two", "one") if metrics == "full" else ("two",)
        got, got_rtn = pm.errors(res.values, sides), pm.errors(rtn, sides)
        figures.update(pe2=got["two"], rtn2=got_rtn["two"])
        if metrics == "full" or not pm.two_sided:
            figures.update(pe1=got.get("one", got["two"]), rtn1=got_rtn.get("one", got_rtn["two"]))
        _xp.sync(xp)
    t3 = time.perf_counter()
    return LayerResult(values=res.values, codes=res.codes, quantizer=quantizer, solve=res,
                       factor_in=prep.f_in, factor_out=prep.f_out, proxy_error=figures["pe2"],
                       proxy_error_one_sided=figures["pe1"], rtn_values=rtn,
                       rtn_proxy_error=figures["rtn2"],
                       rtn_proxy_error_one_sided=figures["rtn1"],
                       seconds_factor=prep.seconds_factor, seconds_solve=res.seconds,
                       seconds_metrics=t3 - t2, input_dtype=prep.input_dtype, metrics=metrics)


def _diagonal_factor(xp, h, damp: float, block: int) -> Factor:
    """The prepared form of a diagonal H_out given as its diagonal ``h``: ``A = None`` (zero),
    ``D``/``H`` the normalised, damped diagonal (a vector)."""
    check_real_dtype(xp, h, "H_out")
    h64 = xp.astype(h, xp.float64)
    check_finite(xp, h64, "H_out")
    if bool(xp.any(h64 < 0)):
        raise ValueError("H_out (a diagonal) has negative entries: it is not positive "
                         "semi-definite")
    dead_mask = h64 == 0
    live = int(h64.shape[0]) - int(xp.sum(xp.astype(dead_mask, xp.int64)))
    if live == 0:
        raise ValueError("H_out (a diagonal) is all zeros")
    scale = float(xp.sum(h64)) / live
    Hd = xp.where(dead_mask, xp.ones_like(h64), h64 / scale) + damp
    return Factor(A=None, D=Hd, H=Hd, damp=damp, scale=scale, dead=xp.nonzero(dead_mask)[0],
                  tries=1, block=block)
