"""The factor pipeline (docs/algorithm.md, "Factors"): symmetrise, normalise, damp, block LDL.

``prepare_factor`` turns a raw Hessian factor into ``A = L - I`` (strictly block-lower
triangular) with ``H = L D L^T``. Factorisations always run in float64, on the caller's device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from . import _xp
from ._lib.symmetric import symmetrize
from ._validate import (check_damp, check_finite, check_int, check_matrix, check_real_dtype,
                        check_symmetric, native)

__all__ = ["block_ldl", "prepare_factor", "Factor", "NotPositiveDefiniteError", "check_shrink",
           "auto_regularization", "AUTO_DAMP_OUT",
           "AUTO_DAMP_OUT_ROTATED", "AUTO_DAMP_OUT_CROSSFIT", "OUT_ESTIMATORS", "estimator_folds"]


class NotPositiveDefiniteError(ValueError):
    """The (damped) factor has no finite Cholesky factorisation."""


def _block_edges(n: int, block: int) -> list[int]:
    return list(range(0, n, block)) + [n]


def _cholesky(xp, H):
    """Lower Cholesky factor, or ``None`` if it fails or is not finite (cupy returns NaNs)."""
    try:
        C = xp.linalg.cholesky(H)
    except Exception as exc:  # numpy raises LinAlgError; other libraries raise their own
        if "definite" in str(exc).lower() or type(exc).__name__ == "LinAlgError":
            return None
        raise
    if not bool(xp.all(xp.isfinite(C))):
        return None
    if not bool(xp.all(xp.linalg.diagonal(C) > 0)):
        return None
    return C


def _ldl_from_cholesky(xp, C, block: int):
    """``L = C blockdiag(C_kk)^-1`` and ``D = blockdiag(C_kk C_kk^T)`` (dense n x n)."""
    n = C.shape[0]
    dev = _xp.device(C)
    nb = -(-n // block)
    npad = nb * block
    if npad != n:  # pad with an identity block so that every diagonal block is block x block
        Cp = xp.eye(npad, dtype=C.dtype, device=dev)
        Cp[:n, :n] = C
    else:
        Cp = C
    # diagonal blocks (nb, b, b), gathered in one take: element (k, r, c) is
    # Cp[k b + r, k b + c]
    k = xp.reshape(xp.arange(nb, device=dev), (nb, 1, 1)) * block
    r = xp.reshape(xp.arange(block, device=dev), (1, block, 1))
    c = xp.reshape(xp.arange(block, device=dev), (1, 1, block))
    at = xp.reshape((k + r) * npad + (k + c), (-1,))
    diag = xp.reshape(xp.take(xp.reshape(Cp, (-1,)), at), (nb, block, block))
    inv = xp.linalg.inv(diag)                                   # (nb, b, b)
    C3 = xp.reshape(Cp, (npad, nb, block))                      # rows, block col, col in block
    L3 = xp.matmul(xp.permute_dims(C3, (1, 0, 2)), inv)         # (nb, npad, b)
    Dblk = xp.matmul(diag, xp.permute_dims(diag, (0, 2, 1)))    # (nb, b, b)
    # assembled through a (nb, b, nb, b) view in which block (k, l) is [k, :, l, :], one
    # pass each: L is block-lower with diagonal blocks exactly the identity, so A keeps the
    # blocks below the diagonal (k > l) and has exact zeros elsewhere; D is block-diagonal
    kb = xp.arange(nb, device=dev)
    below = xp.reshape(kb[:, None] > kb[None, :], (nb, 1, nb, 1))
    same = xp.reshape(kb[:, None] == kb[None, :], (nb, 1, nb, 1))
    zero = xp.zeros((), dtype=C.dtype, device=dev)
    L4 = xp.reshape(xp.permute_dims(L3, (1, 0, 2)), (nb, block, nb, block))
    A = xp.reshape(xp.where(below, L4, zero), (npad, npad))[:n, :n]
    D = xp.reshape(xp.where(same, xp.reshape(Dblk, (nb, block, 1, block)), zero), (npad, npad))
    return A, D[:n, :n]


def block_ldl(H, block: int):
    """Block LDL of a symmetric positive-definite ``H``: returns ``(A, D)``.

    ``H = (I + A) D (I + A)^T`` with ``A`` strictly block-lower-triangular (its ``block x block``
    diagonal blocks are zero; the last block is smaller when ``block`` does not divide n) and
    ``D`` block diagonal (returned dense). Computed in float64. Raises
    ``NotPositiveDefiniteError`` when ``H`` has no finite Cholesky factor.
    """
    xp = _xp.namespace(H)
    H = native(xp, H)
    check_matrix(xp, H, "H", square=True)
    check_real_dtype(xp, H, "H")
    block = _check_block(block, H.shape[0])
    H64 = xp.astype(H, xp.float64)
    check_finite(xp, H64, "H")  # the Cholesky reads one triangle: check the whole matrix
    check_symmetric(xp, H64, "H")
    C = _cholesky(xp, H64)
    if C is None:
        raise NotPositiveDefiniteError("H is not positive definite (Cholesky failed or is not "
                                       "finite); damp it, e.g. with prepare_factor")
    return _ldl_from_cholesky(xp, C, block)


def _check_block(block, n: int) -> int:
    return min(check_int(block, "block", minimum=1, what="a positive integer"), n)


@dataclass
class Factor:
    """A prepared Hessian factor.

    Attributes
    ----------
    A : array (n, n)
        ``L - I``, strictly block-lower-triangular, float64.
    D : array (n, n)
        Block-diagonal ``D`` of ``H = L D L^T`` (dense), float64.
    H : array (n, n)
        The symmetrised, normalised and damped matrix that was factorised.
    damp : float
        Total damping added (relative to the mean diagonal when normalised).
    scale : float
        Mean diagonal that ``H`` was divided by (1.0 when not normalised).
    dead : Any
        Indices of dead channels (zero row and column) whose diagonal was set to 1.
    tries : int
        Factorisation attempts (1 = no escalation needed).
    """

    A: Any
    D: Any
    H: Any
    damp: float
    scale: float
    dead: Any
    tries: int
    block: int


def prepare_factor(H, block: int, *, damp: float = 0.01, max_tries: int = 8,
                   normalize: bool = True, name: str = "H", check_symmetry: bool = True,
                   shrink: float = 0.0) -> Factor:
    """Symmetrise, normalise, handle dead channels, damp and block-LDL-factorise ``H``.

    Parameters
    ----------
    H : array (n, n)
        A Hessian factor (``H_in`` or ``H_out``), any float dtype, numpy/cupy/array-API.
    block : int
        LDL block size: ``t_y`` for ``H_in``, ``t_x`` for ``H_out``, 1 for scalar rounding
        without tiles.
    damp : float
        Relative damping ``delta``: ``H <- H / mean(diag H) + delta * I``. If the block LDL
        fails (not positive definite or not finite), ``delta`` doubles, up to ``max_tries``
        attempts in all; when ``damp == 0`` the escalation starts at ``1e-6``.
    normalize : bool
        Divide by the mean diagonal first (off: the matrix is used as given, plus damping).
    shrink : float
        Shrinkage toward the diagonal, in [0, 1], applied before the damping:
        ``H <- (1 - shrink) H + shrink diag(H)``. ``shrink=1`` keeps only the diagonal (for
        ``H_out`` that is the one-sided rounding); see :func:`auto_regularization`.
    name : str
        The argument name used in error messages.

    Returns
    -------
    Factor
        ``A = L - I``, ``D``, the damped ``H``, the total damping used, and diagnostics.
    """
    xp = _xp.namespace(H)
    H = native(xp, H)
    check_matrix(xp, H, name, square=True)
    check_real_dtype(xp, H, name)
    check_finite(xp, H, name)
    damp = check_damp(damp)
    shrink = check_shrink(shrink)
    max_tries = check_int(max_tries, "max_tries", minimum=1)
    n = H.shape[0]
    block = _check_block(block, n)
    H64 = xp.astype(H, xp.float64, copy=True)
    # a matrix with huge (or tiny) entries is first scaled by a power of two that brings its
    # largest entry near 1: exact, and the mean diagonal of entries near 1e307 cannot overflow
    big = float(xp.max(xp.abs(H64)))
    if big == 0.0:
        raise ValueError(f"{name} is all zeros: there is no input signal to weigh the errors by")
    p2 = math.frexp(big)[1]
    if abs(p2) > 64:
        H64 = H64 * math.ldexp(1.0, -p2)
    if check_symmetry:
        check_symmetric(xp, H64, name)
    H64 = symmetrize(xp, H64)
    diag = xp.linalg.diagonal(H64)
    if bool(xp.any(diag < 0)):
        raise ValueError(f"{name} has negative diagonal entries: it is not positive "
                         f"semi-definite")
    dead_mask = diag == 0
    dead = xp.nonzero(dead_mask)[0]
    live = n - int(dead.shape[0])
    if live == 0:
        raise ValueError(f"{name} is all zeros: there is no input signal to weigh the errors by")
    scale = 1.0
    if normalize:
        scale = float(xp.sum(diag)) / live  # mean over live channels
        H64 = H64 / scale
        if abs(p2) > 64:
            scale = math.ldexp(scale, p2)  # in the caller's units
    elif abs(p2) > 64:
        H64 = H64 * math.ldexp(1.0, p2)  # not normalised: back to the caller's units
    if live < n:
        if bool(xp.any(dead_mask & (xp.sum(xp.abs(H64), axis=1) > 0))):
            raise ValueError(f"{name} has zero diagonal entries with non-zero off-diagonal "
                             f"entries: it is not positive semi-definite")
        H64 = H64 + _diag_matrix(xp, xp.astype(dead_mask, xp.float64))
    if shrink > 0:
        H64 = (1.0 - shrink) * H64 + shrink * _diag_matrix(xp, xp.linalg.diagonal(H64))
    eye = xp.eye(n, dtype=xp.float64, device=_xp.device(H64))
    delta = float(damp)
    for attempt in range(1, int(max_tries) + 1):
        Hd = H64 + delta * eye if delta > 0 else H64
        C = _cholesky(xp, Hd)
        if C is not None:
            A, D = _ldl_from_cholesky(xp, C, block)
            if bool(xp.all(xp.isfinite(A))):
                return Factor(A=A, D=D, H=Hd, damp=delta, scale=scale, dead=dead,
                              tries=attempt, block=block)
        delta = 2.0 * delta if delta > 0 else 1e-6
    raise NotPositiveDefiniteError(
        f"{name} is not positive definite even with damping {delta / 2:.3g} after {max_tries} "
        f"tries: it is indefinite beyond the damping limit (check how it was accumulated)")


#: ``auto_regularization``'s relative damping of ``H_out`` (normalised to mean diagonal 1)
AUTO_DAMP_OUT = 1.0
#: the same for a layer rotated by incoherence processing (:mod:`bakron.incoherence`)
AUTO_DAMP_OUT_ROTATED = 3.0
#: the same for a rotated layer whose ``H_out`` is cross-fitted
#: (:func:`bakron.hessian.crossfit.crossfit`)
AUTO_DAMP_OUT_CROSSFIT = 0.1
#: how a global ``H_out`` (``out_estimator``) or ``H_in`` (``in_estimator``) is formed from its
#: rows (:func:`bakron.hessian.global_factors`): the K-FAC mean, or the cross-fitted halves
#: (:func:`bakron.hessian.crossfit.crossfit`); ``"crossfit:K"`` cross-fits K folds
#: (:func:`bakron.hessian.crossfit.crossfit_folds`)
OUT_ESTIMATORS = ("mean", "crossfit")


def estimator_folds(estimator, argument: str = "out_estimator") -> int:
    """The number of sums a factor estimator keeps apart: 1 for ``"mean"``, 2 for
    ``"crossfit"``, ``K`` for ``"crossfit:K"`` (``K >= 2``); ``ValueError`` naming
    ``argument`` for any other value."""
    if estimator == "mean":
        return 1
    if estimator == "crossfit":
        return 2
    head, _, k = str(estimator).partition(":") if isinstance(estimator, str) else ("", "", "")
    if head == "crossfit" and k.isdigit() and int(k) >= 2:
        return int(k)
    raise ValueError(f"{argument} must be one of {OUT_ESTIMATORS} or 'crossfit:K' with an "
                     f"integer K >= 2, got {estimator!r}")


def auto_regularization(width: int, tokens: int, *, rotated: bool = False,
                        estimator: str = "mean") -> tuple[float, float]:
    """``(shrink_out, damp_out)`` for a global ``H_out`` of ``width`` outputs estimated from
    ``tokens`` calibration tokens (K-FAC, one sampled label each): ``(0, AUTO_DAMP_OUT)``,
    ``(0, AUTO_DAMP_OUT_ROTATED)`` for a layer ``rotated`` by incoherence processing, and
    ``(0, AUTO_DAMP_OUT_CROSSFIT)`` for a rotated layer whose ``H_out`` was cross-fitted
    (``estimator="crossfit"`` or ``"crossfit:K"``, :func:`bakron.hessian.crossfit.crossfit`).

    The two-sided rounding puts its error in the directions that ``H_out`` calls cheap, and
    the K-FAC factor underestimates what errors there cost (docs/hessian.md, "Regularising
    H_out"). The rule damps ``H_out`` (normalised to mean diagonal 1) toward the identity,
    ``H_out + δ I``, and does not shrink it toward its diagonal. The constants were chosen
    by the KL of the whole quantized SmolLM2 on text sampled from the model with an unused
    seed (never an evaluation text): without rotations damping 1 was the best of 0.3, 1, 2
    and 3 (and of two rules proportional to ``width / tokens``) at 3 and 4 bits (4,096
    tokens); with rotations 3 beat 1 at both widths over three rotation seeds (and 0.3 on
    one); a cross-fitted ``H_out`` no longer underestimates its small directions, and with
    rotations 0.1 was the best of 3, 1, 0.3, 0.1 and 0.03 (16,384 tokens). So the rule does
    not depend on ``width`` or ``tokens`` at these sizes (both are checked and kept for the
    rule's signature); a cross-fitted factor without rotations was not measured and gets
    the unrotated rule.
    """
    check_int(width, "width", minimum=1)
    check_int(tokens, "tokens", minimum=1)
    folds = estimator_folds(estimator)
    if not rotated:
        return 0.0, AUTO_DAMP_OUT
    return 0.0, AUTO_DAMP_OUT_CROSSFIT if folds > 1 else AUTO_DAMP_OUT_ROTATED


def check_shrink(shrink, name: str = "shrink") -> float:
    """``shrink`` as a float in [0, 1], or ``ValueError`` naming it."""
    if isinstance(shrink, bool) or not isinstance(shrink, (int, float)) \
            or not 0.0 <= float(shrink) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {shrink!r}")
    return float(shrink)


def _diag_matrix(xp, v):
    n = v.shape[0]
    return xp.eye(n, dtype=v.dtype, device=_xp.device(v)) * v[None, :]
