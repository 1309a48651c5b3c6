"""The proxy error of a rounded layer, one implementation for the whole library.

For weights ``W`` (m, n), a rounding ``Ŵ`` and factors ``H_I`` (n, n), ``H_O`` (m, m), the
normalised proxy error is

    tr(E H_I Eᵀ H_O) / tr(W H_I Wᵀ H_O),     E = W - Ŵ

(docs/algorithm.md); ``H_O = I`` gives the one-sided error. ``H_O`` may also be given by its
diagonal (a vector of length m), which weighs row i by ``H_O[i, i]`` without any m x m matrix.

:class:`ProxyMetrics` shares the work between candidates and sides: each quadratic form costs
one product ``X H_I`` (m n²) plus, for a dense ``H_O``, one ``H_O (X H_I)`` (m² n); the product
``W H_I`` and the denominators are computed once, the one-sided numerator reuses ``X H_I`` of
the two-sided one. Products run in ``dtype`` (float64 by default; the demo uses float32 to stay
fast on large layers), sums in float64.
"""
from __future__ import annotations

from .symmetric import symmetrize

__all__ = ["ProxyMetrics", "SIDES"]

#: "two": under H_O ⊗ H_I (equal to "one" when there is no H_O); "one": under I ⊗ H_I
SIDES = ("two", "one")


class ProxyMetrics:
    """Proxy errors of candidate roundings of one ``W`` under ``(H_in, H_out)``.

    Parameters
    ----------
    xp : namespace
    W : array (m, n)
    H_in : array (n, n)
        Symmetrised here (``(H + Hᵀ)/2``) once.
    H_out : array (m, m), array (m,) or None
        A dense factor, the diagonal of a diagonal one, or ``None`` (one-sided).
    dtype : dtype, optional
        Working dtype of the products (default float64).

    The caller validates shapes and finiteness; a non-positive or non-finite denominator (W is
    zero, or the factors are not positive semi-definite) raises ``ValueError`` when a ratio is
    asked for.
    """

    def __init__(self, xp, W, H_in, H_out=None, *, dtype=None):
        self.xp = xp
        self.dtype = xp.float64 if dtype is None else dtype
        self.W = xp.astype(W, self.dtype)
        Hi = xp.astype(H_in, self.dtype)
        self.H_in = symmetrize(xp, Hi)
        self.H_out = self.h_out_diag = None
        if H_out is not None:
            Ho = xp.astype(H_out, self.dtype)
            if len(Ho.shape) == 1:
                self.h_out_diag = Ho
            else:
                self.H_out = symmetrize(xp, Ho)
        self._den: dict = {}
        self.products = 0  # matrix products computed so far (for tests and reports)

    @property
    def two_sided(self) -> bool:
        return self.H_out is not None or self.h_out_diag is not None

    def _sum(self, X):
        return float(self.xp.sum(self.xp.astype(X, self.xp.float64)))

    def quadratic(self, X, sides=SIDES) -> dict:
        """``{side: tr(X H_I Xᵀ H_side)}`` for the requested sides, from one ``X H_I``."""
        xp = self.xp
        XH = xp.matmul(X, self.H_in)
        self.products += 1
        out = {}
        if "one" in sides or not self.two_sided:
            out["one"] = self._sum(XH * X)
        if "two" in sides:
            if self.H_out is not None:
                out["two"] = self._sum(xp.matmul(self.H_out, XH) * X)
                self.products += 1
            elif self.h_out_diag is not None:
                out["two"] = self._sum(self.h_out_diag[:, None] * XH * X)
            else:
                out["two"] = out["one"]
        return {s: out[s] for s in sides}

    def denominator(self, side: str, *, allow_zero: bool = False) -> float:
        """``tr(W H_I Wᵀ H_side)``, computed once per side (both sides in one pass)."""
        if side not in self._den:
            missing = tuple(s for s in SIDES if s not in self._den)
            self._den.update(self.quadratic(self.W, missing))
        den = self._den[side]
        if allow_zero and den == 0.0:
            return den
        if not den > 0 or den == float("inf"):
            what = "H_out" if side == "two" and self.two_sided else "I"
            raise ValueError(f"tr(W H_in W^T {what}) = {den!r} is not a positive finite number: "
                             f"W is zero or the factors are not positive semi-definite")
        return den

    def errors(self, W_hat, sides=SIDES) -> dict:
        """``{side: normalised proxy error}`` of the rounding ``W_hat``.

        An exact rounding of an all-zero W (a pruned layer) has error 0.
        """
        E = self.W - self.xp.astype(W_hat, self.dtype)
        num = self.quadratic(E, sides)
        out = {}
        for s in sides:
            den = self.denominator(s, allow_zero=num[s] == 0.0)
            out[s] = 0.0 if den == 0.0 else num[s] / den
        return out

    def error(self, W_hat, side: str = "two") -> float:
        return self.errors(W_hat, (side,))[side]
