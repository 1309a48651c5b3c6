"""Cross-fitted eigenvalues of a second-moment factor estimated from two halves of the data.

A sample second moment ``H = mean_t g_t g_tᵀ`` of ``m``-vectors from ``N`` rows puts too
little weight on its bottom eigen-directions and too much on its top ones: its eigenvectors
are fitted to the same rows its eigenvalues are measured on. With the rows split into two
independent halves ``a`` and ``b``, the eigenvectors of one half measured on the other,
``λ_i = u_iᵀ H_b u_i`` for the eigenvectors ``u_i`` of ``H_a``, are unbiased estimates of
the true quadratic form along those directions (Lam 2016, "nonparametric eigenvalue-
regularized covariance matrix estimator"). :func:`crossfit` averages the two ways round;
:func:`crossfit_folds` does the same with ``K`` folds, each fold's eigenvalues measured
along the eigenvectors of the other ``K - 1`` together (eigenvectors from more rows, at
``K`` eigendecompositions).
"""
from __future__ import annotations

from .._lib.lapack import eigh
from .._lib.symmetric import symmetrize

__all__ = ["crossfit", "crossfit_folds"]


def _one_way(xp, H_fit, H_measure, weight):
    """``√weight U diag(√λ)`` with ``λ_i = u_iᵀ H_measure u_i`` for the eigenvectors ``u_i``
    of ``H_fit``: the factor ``V`` of this way's ``weight · U diag(λ) Uᵀ = V Vᵀ``."""
    _, U = eigh(xp, H_fit)   # (in H_fit's precision, the GIL released: layers run in threads)
    lam = xp.sum(U * (H_measure @ U), axis=0)   # u_iᵀ H_measure u_i >= 0 (PSD)
    return U * xp.sqrt(xp.clip(lam, 0.0, None) * weight)


def crossfit(xp, H_a, w_a: float, H_b, w_b: float, *, dtype=None):
    """The cross-fitted factor of two halves' means ``H_a``, ``H_b`` of weights ``w_a``,
    ``w_b`` (``> 0``): each half's eigenvectors with eigenvalues measured on the other, each
    way weighted by the weight of the half it measured on; symmetric, positive
    semi-definite, with the trace of the pooled mean ``(w_a H_a + w_b H_b) / (w_a + w_b)``.
    Equal halves give ``H_a`` back.

    ``dtype``: the precision of the eigendecompositions and products (default ``H_a``'s;
    :func:`~bakron.hessian.global_factors` uses its products' precision, float32 for
    float32 activations); the result has ``H_a``'s dtype.
    """
    if not (w_a > 0 and w_b > 0):
        raise ValueError(f"both halves need a positive weight, got {w_a!r} and {w_b!r}")
    out = H_a.dtype
    if dtype is not None and dtype != out:
        H_a, H_b = xp.astype(H_a, dtype), xp.astype(H_b, dtype)
    total = float(w_a + w_b)
    V = xp.concat([_one_way(xp, H_a, H_b, w_b / total), _one_way(xp, H_b, H_a, w_a / total)],
                  axis=1)
    H = V @ xp.matrix_transpose(V)   # (one symmetric rank-2m product: numpy's syrk)
    H = xp.astype(H, out) if H.dtype != out else H
    return symmetrize(xp, H)   # ((H + Hᵀ) / 2: bitwise (H + Hᵀ) · 0.5)


def crossfit_folds(xp, Hs, ws, *, dtype=None):
    """The cross-fitted factor of ``K >= 2`` folds' means ``Hs`` of weights ``ws`` (``> 0``):
    for each fold ``j``, the eigenvectors of the other folds' pooled mean with eigenvalues
    measured on fold ``j``, weighted by ``ws[j]``. Symmetric, positive semi-definite, with
    the trace of the pooled mean; two folds are :func:`crossfit` (bit for bit), equal folds
    give ``Hs[0]`` back. ``dtype``: as in :func:`crossfit`.
    """
    Hs, ws = list(Hs), [float(w) for w in ws]
    if len(Hs) != len(ws) or len(Hs) < 2:
        raise ValueError(f"need K >= 2 folds and one weight each, got {len(Hs)} folds and "
                         f"{len(ws)} weights")
    if not all(w > 0 for w in ws):
        raise ValueError(f"every fold needs a positive weight, got {ws!r}")
    if len(Hs) == 2:
        return crossfit(xp, Hs[0], ws[0], Hs[1], ws[1], dtype=dtype)
    out = Hs[0].dtype
    if dtype is not None and dtype != out:
        Hs = [xp.astype(H, dtype) for H in Hs]
    total = sum(ws)
    Vs = []
    for j, (H_j, w_j) in enumerate(zip(Hs, ws)):
        rest = None
        for i, (H_i, w_i) in enumerate(zip(Hs, ws)):
            if i != j:   # (the rest's weighted sum; its scale does not move the eigenvectors)
                rest = w_i * H_i if rest is None else rest + w_i * H_i
        Vs.append(_one_way(xp, rest, H_j, w_j / total))
    V = xp.concat(Vs, axis=1)
    H = V @ xp.matrix_transpose(V)
    H = xp.astype(H, out) if H.dtype != out else H
    return symmetrize(xp, H)
