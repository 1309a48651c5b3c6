"""The one-call path for a layer: Hessians in, rounded weights and proxy errors out."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from . import _xp
from ._validate import check_factor_shape, check_finite, check_matrix, check_tile
from .factors import Factor, prepare_factor
from .quantizers import UniformQuantizer
from .solvers import SolveResult, solve

__all__ = ["proxy_error", "quantize_layer", "LayerResult"]


def _proxy(xp, E, W, H_in, H_out) -> float:
    """tr(E H_I E^T H_O) / tr(W H_I W^T H_O) in float64 (H_O = I when None)."""
    def quad(X):
        XH = xp.matmul(X, H_in)                       # (m, n)
        if H_out is None:
            return float(xp.sum(XH * X))
        return float(xp.sum(xp.matmul(H_out, XH) * X))
    den = quad(W)
    if den <= 0:
        raise ValueError("tr(W H_in W^T H_out) is not positive: W is zero or the Hessians "
                         "are not positive semi-definite")
    return quad(E) / den


def proxy_error(W, W_hat, H_in, H_out=None) -> float:
    """Normalised proxy error ``tr(E H_I Eᵀ H_O) / tr(W H_I Wᵀ H_O)`` with ``E = W - Ŵ``.

    ``H_out=None`` gives the one-sided error (``H_O = I``). Computed in float64.
    """
    xp = _xp.namespace(W, W_hat, H_in, H_out)
    check_matrix(xp, W, "W")
    check_matrix(xp, W_hat, "W_hat")
    m, n = W.shape
    if tuple(W_hat.shape) != (m, n):
        raise ValueError(f"W_hat has shape {tuple(W_hat.shape)} but W has shape {(m, n)}")
    check_factor_shape(H_in, n, "H_in", "H_out", m, "columns")
    if H_out is not None:
        check_factor_shape(H_out, m, "H_out", "H_in", n, "rows")
    f64 = lambda a: None if a is None else xp.astype(a, xp.float64)  # noqa: E731
    W64 = f64(W)
    return _proxy(xp, W64 - f64(W_hat), W64, f64(H_in), f64(H_out))


@dataclass
class LayerResult:
    """Result of :func:`quantize_layer`.

    ``values``/``codes`` are the rounded weights and codes; ``proxy_error`` is the two-sided
    proxy error (under ``H_out ⊗ H_in``; equal to the one-sided one when ``H_out`` is None),
    ``proxy_error_one_sided`` the error under ``I ⊗ H_in``; the ``rtn_*`` fields are the same
    for round-to-nearest. ``damp_in``/``damp_out`` are the damping actually used.
    """

    values: Any
    codes: Any
    quantizer: Any
    solve: SolveResult
    factor_in: Factor
    factor_out: Factor | None
    proxy_error: float
    proxy_error_one_sided: float
    rtn_values: Any
    rtn_proxy_error: float
    rtn_proxy_error_one_sided: float
    seconds_factor: float
    seconds_solve: float

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
        }


def quantize_layer(W, H_in, H_out=None, *, quantizer=None, bits: int | None = None,
                   tile=(16, 16), method: str = "auto", engine: str = "auto",
                   damp: float = 0.01, symmetric: bool = True, granularity: str = "row",
                   group_size: int | None = None, scale_method: str = "rms") -> LayerResult:
    """Quantize one linear layer from its Hessian factors.

    Parameters
    ----------
    W : array (m, n)
        Weights (m outputs, n inputs), float32 or float64; not modified.
    H_in : array (n, n)
        Input-side factor ``E[x x^T]``.
    H_out : array (m, m), optional
        Output-side factor; ``None`` gives one-sided LDLQ/GPTQ.
    quantizer : optional
        A :class:`UniformQuantizer` or a tile quantizer. When omitted, a uniform grid of
        ``bits`` bits is fitted to W (``symmetric``, ``granularity``, ``group_size``,
        ``scale_method`` as in :meth:`UniformQuantizer.fit`).
    tile, method, engine
        As in :func:`bakron.solve`.
    damp : float
        Relative damping of both factors (escalated if needed; see :func:`prepare_factor`).

    Returns
    -------
    LayerResult
    """
    prep = _prepare(W, H_in, H_out, quantizer=quantizer, bits=bits, tile=tile, damp=damp,
                    symmetric=symmetric, granularity=granularity, group_size=group_size,
                    scale_method=scale_method)
    res = solve(W, None if prep.f_out is None else prep.f_out.A, prep.f_in.A, prep.quantizer,
                tile=prep.tile, method=method, engine=engine)
    return _layer_result(prep, W, H_in, H_out, res)


@dataclass
class _Prepared:
    """A layer's checked inputs: namespace, tile, quantizer, prepared factors."""

    xp: Any
    tile: tuple
    quantizer: Any
    f_in: Factor
    f_out: Factor | None
    seconds_factor: float


def _prepare(W, H_in, H_out, *, quantizer, bits, tile, damp, symmetric, granularity,
             group_size, scale_method, factors: dict | None = None) -> _Prepared:
    """Check one layer's inputs, fit its quantizer when none is given, prepare its factors
    (``factors``: a cache by Hessian object and block, for layers that share a Hessian)."""
    xp = _xp.namespace(W, H_in, H_out)
    check_matrix(xp, W, "W")
    _xp.float_dtype(xp, W, "W")
    check_finite(xp, W, "W")
    m, n = W.shape
    check_matrix(xp, H_in, "H_in")
    check_factor_shape(H_in, n, "H_in", "H_out", m, "columns")
    if H_out is not None:
        check_matrix(xp, H_out, "H_out")
        check_factor_shape(H_out, m, "H_out", "H_in", n, "rows")
    tx, ty = check_tile(tile, m, n)
    if quantizer is None:
        if bits is None:
            raise ValueError("give either quantizer= or bits=")
        quantizer = UniformQuantizer.fit(W, bits, symmetric=symmetric, granularity=granularity,
                                         group_size=group_size, method=scale_method)
    t0 = time.perf_counter()
    factors = {} if factors is None else factors

    def factor(H, block, name):
        key = (id(H), block, damp)
        if key not in factors:
            factors[key] = (H, prepare_factor(H, block, damp=damp, name=name))
        return factors[key][1]

    f_in = factor(H_in, ty, "H_in")
    f_out = None if H_out is None else factor(H_out, tx, "H_out")
    _xp.sync(xp)
    return _Prepared(xp, (tx, ty), quantizer, f_in, f_out, time.perf_counter() - t0)


def _layer_result(prep: _Prepared, W, H_in, H_out, res: SolveResult) -> LayerResult:
    """Round-to-nearest and the proxy errors of a solved layer."""
    xp, quantizer, (tx, ty) = prep.xp, prep.quantizer, prep.tile
    if hasattr(quantizer, "rtn"):
        rtn = quantizer.rtn(W)[0]
    else:  # nearest rounding tile by tile: the same rule with no feedback
        rtn = solve(W, None, xp.zeros_like(prep.f_in.A), quantizer, tile=(tx, ty),
                    method="antidiagonal", engine="array_api").values
    W64 = xp.astype(W, xp.float64)
    Hi = (xp.astype(H_in, xp.float64) + xp.matrix_transpose(xp.astype(H_in, xp.float64))) / 2
    Ho = None if H_out is None else xp.astype(H_out, xp.float64)
    if Ho is not None:
        Ho = (Ho + xp.matrix_transpose(Ho)) / 2
    err = W64 - xp.astype(res.values, xp.float64)
    err_rtn = W64 - xp.astype(rtn, xp.float64)
    pe1, pe1_rtn = _proxy(xp, err, W64, Hi, None), _proxy(xp, err_rtn, W64, Hi, None)
    pe2 = pe1 if Ho is None else _proxy(xp, err, W64, Hi, Ho)
    pe2_rtn = pe1_rtn if Ho is None else _proxy(xp, err_rtn, W64, Hi, Ho)
    return LayerResult(values=res.values, codes=res.codes, quantizer=quantizer, solve=res,
                       factor_in=prep.f_in, factor_out=prep.f_out, proxy_error=pe2,
                       proxy_error_one_sided=pe1, rtn_values=rtn, rtn_proxy_error=pe2_rtn,
                       rtn_proxy_error_one_sided=pe1_rtn, seconds_factor=prep.seconds_factor,
                       seconds_solve=res.seconds)
