"""Streaming second moments: the accumulators behind ``H_in`` and ``H_out``.

A :class:`FactorAccumulator` holds ``S = Σ_k w_k y_kᵀ M_k y_k`` (an ``n x n`` symmetric sum,
float64 by default) and the total weight ``Σ_k w_k``. Two kinds of update cover the factors
of docs/hessian.md ("The mathematics"):

- :meth:`FactorAccumulator.update`: rows ``y_t`` with weights ``w_t`` and coefficients ``c_t``:
  ``S += Σ_t w_t c_t y_t y_tᵀ`` (K-FAC: ``c_t = 1``; per-token refinement:
  ``c_t = x_tᵀ H x_t``);
- :meth:`FactorAccumulator.update_sequences`: sequences ``Y_s`` (T x n) with a T x T mixing
  matrix ``M_s``: ``S += Σ_s w_s Y_sᵀ M_s Y_s`` (per-sequence refinement:
  ``G_sᵀ H_O G_s = X_sᵀ (g_s H_O g_sᵀ) X_s`` with ``G_s = Σ_t g_t x_tᵀ``, without forming G_s).

Row updates form their products as one symmetric rank-k update on the ``(k, n)`` rows
(``?syrk`` of scipy's BLAS for numpy arrays, written into a reusable buffer from
:func:`gram_buffer` when one is given; ``Yᵀ Y`` elsewhere) and add only the upper triangle to the
sum, in ``products`` precision:
the accumulation dtype by default (rows are cast first: exact products), or the rows' own
float32 (``products=xp.float32``: twice the BLAS rate and half the memory traffic; each batch's
float32 sum is then added to the float64 sum, so only one batch's terms are summed in float32).

``value()`` returns ``S / (Σ w · divisor)`` symmetrised (``divisor`` is ``‖H‖_F²`` of the fixed
factor in a refinement step, 1 otherwise); ``finish()`` returns the same factor formed in place
in the running sum (no copy; the accumulator is spent). Partial accumulators (batches, shards, workers)
combine with :meth:`merge`, which adds the sums in the order given, so the same partials in the
same order give bitwise the same result.
"""
from __future__ import annotations

from .. import _xp
from .._lib import packing as _packing
from .._lib.symmetric import mirror_upper
from .._validate import check_finite, check_real_dtype

#: the upper triangle row by row: accepted in a state's "packing" entry for states packed that way
_ROWMAJOR = "upper-rowmajor"

__all__ = ["FactorAccumulator", "token_quadratic", "sequence_mix", "frobenius_sq",
           "pack_upper", "unpack_upper", "gram_buffer"]

#: rows per block of the blockwise triangle updates (numpy): big enough that the Python loop
#: is negligible, small enough that a block's rows stay in cache
_BLOCK = 256


def _float_dtype(xp, dtype):
    if dtype is None:
        return xp.float64
    if dtype == xp.float64 or dtype == xp.float32:
        return dtype
    raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")


class FactorAccumulator:
    """Streaming weighted second moment ``S / W`` of rows (or sequences) of length ``n``.

    Parameters
    ----------
    n : int
        Size of the factor (``n`` inputs for ``H_in``, ``m`` outputs for ``H_out``).
    xp : namespace
        Array namespace of the sum (``array_api_compat.numpy``, ``cupy``, ...).
    dtype : dtype, optional
        Accumulation dtype, float64 by default (float32 halves memory; rows are cast to it).
    device : optional
        Device of the sum (default: the namespace's default device).
    divisor : float
        Extra normaliser of :meth:`value` (``‖H‖_F²`` of the fixed factor in a refinement
        step). Accumulators that ``merge`` must share it.
    out : array, optional
        An ``n x n`` array of the accumulation dtype to hold the sum instead of a new one
        (zeroed here, then owned by the accumulator: a spent factor's memory).
    """

    def __init__(self, n: int, *, xp, dtype=None, device=None, divisor: float = 1.0,
                 out=None):
        if int(n) != n or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        if not divisor > 0 or divisor != divisor or divisor == float("inf"):
            raise ValueError(f"divisor must be a positive finite number, got {divisor!r}")
        self.xp = xp
        self.n = int(n)
        self.dtype = _float_dtype(xp, dtype)
        self.divisor = float(divisor)
        if out is not None:
            if tuple(getattr(out, "shape", ())) != (self.n, self.n) or out.dtype != self.dtype:
                raise ValueError(f"out must be an array of shape {(self.n, self.n)} and dtype "
                                 f"{self.dtype}, got {getattr(out, 'dtype', None)} of shape "
                                 f"{getattr(out, 'shape', None)}")
            out[...] = 0
            self.sum = out
        else:
            kw = {} if device is None else {"device": device}
            self.sum = xp.zeros((self.n, self.n), dtype=self.dtype, **kw)
        self.weight = 0.0
        self.count = 0

    @property
    def sum(self):
        """The running sum ``S`` (n x n, full). Rank-k updates fill its upper triangle only;
        reading it mirrors that triangle into the lower one first."""
        if self._sum is None:
            raise ValueError("this accumulator is spent: finish() handed its sum out as the "
                             "factor")
        if self._lower_stale:
            S = self._sum
            self._sum = mirror_upper(self.xp, S)
            self._lower_stale = False
        return self._sum

    @sum.setter
    def sum(self, value):
        self._sum = value
        self._lower_stale = False

    @property
    def nbytes(self) -> int:
        return self.n * self.n * (8 if self.dtype == self.xp.float64 else 4)

    # -- updates -----------------------------------------------------------------------------
    def _weights(self, xp, weights, k: int, name: str):
        if weights is None:
            return None
        if not hasattr(weights, "shape"):
            raise ValueError(f"{name} must be an array of {k} weights, got "
                             f"{type(weights).__name__}")
        w = xp.reshape(weights, (-1,)) if len(weights.shape) != 1 else weights
        if w.shape[0] != k:
            raise ValueError(f"{name} has {w.shape[0]} entries but there are {k} "
                             f"{'rows' if name == 'weights' else 'sequences'}; one weight each")
        w = xp.astype(w, self.dtype)
        check_finite(xp, w, name)
        if bool(xp.any(w < 0)):
            raise ValueError(f"{name} must be non-negative")
        return w

    def update(self, rows, weights=None, *, coef=None, products=None) -> "FactorAccumulator":
        """Add ``Σ_t w_t c_t y_t y_tᵀ`` for the rows ``y_t`` of ``rows`` (shape ``(..., n)``).

        ``weights`` ``w_t`` (one per row, any shape with that many entries; default 1) count
        towards the total weight; ``coef`` ``c_t`` (default 1) only scale the rows' terms (the
        quadratic forms of a refinement step). ``products``: the dtype of this batch's
        products (default: the accumulation dtype; ``float32`` sums this batch in float32).
        Inputs are checked (shapes, finiteness) before anything is added.
        """
        return self._update(_xp.namespace(rows, weights, coef, self._sum), rows, weights, coef,
                            products=products)

    def add_product(self, other_sum, k: int, weight: float) -> "FactorAccumulator":
        """Add a batch's product already formed for another accumulator of the same rows and
        weights (``gram`` of :meth:`update` with ``keep=True``; its upper triangle is read):
        layers that read one input (q/k/v, gate/up) form ``Σ w_t x_t x_tᵀ`` once."""
        if self._sum is None:
            raise ValueError("this accumulator is spent: finish() handed its sum out as the "
                             "factor")
        _add_upper(self.xp, self._sum, other_sum)
        self._lower_stale = True
        self.weight += weight
        self.count += k
        return self

    def _update(self, xp, rows, weights=None, coef=None, products=None, keep=False,
                check=True, out=None):
        """``update`` without the namespace lookup. ``check``: ``True`` checks the rows (and
        ``coef``) for NaN/Inf before the product; ``"product"`` checks only the product's
        diagonal (``Σ s_t y_ti²``: NaN or Inf whenever a row is, at ``n`` reads instead of
        ``k n``), the rows only to name the fault; ``False`` checks nothing. ``out``: a
        :func:`gram_buffer` of size ``n`` in the products' dtype that the product is written
        into (it is overwritten by the next update given the same buffer; with ``keep=True``
        the returned product lives there)."""
        if self._sum is None:
            raise ValueError("this accumulator is spent: finish() handed its sum out as the "
                             "factor")
        if not hasattr(rows, "shape") or len(rows.shape) < 1 or rows.shape[-1] != self.n:
            raise ValueError(f"rows must have shape (..., {self.n}), got "
                             f"{getattr(rows, 'shape', None)}")
        check_real_dtype(xp, rows, "rows")
        pdt = self.dtype if products is None else _float_dtype(xp, products)
        Y = xp.reshape(rows, (-1, self.n))
        if Y.dtype != pdt:
            Y = xp.astype(Y, pdt)
        if check is True:
            check_finite(xp, Y, "rows")
        k = Y.shape[0]
        w = self._weights(xp, weights, k, "weights")
        c = None
        if coef is not None:
            c = xp.reshape(xp.astype(coef, self.dtype), (-1,))
            if c.shape[0] != k:
                raise ValueError(f"coef has {c.shape[0]} entries but there are {k} rows")
            if check is True:
                check_finite(xp, c, "coef")
        if k == 0:
            return None if keep else self
        scale = w if c is None else (c if w is None else c * w)
        G = _gram(xp, Y, scale, out=out)
        if check == "product":
            diag = xp.reshape(G, (-1,))[::self.n + 1]
            if not bool(xp.all(xp.isfinite(diag))):
                check_finite(xp, Y, "rows")
                if c is not None:
                    check_finite(xp, c, "coef")
                raise ValueError(f"the rows' products overflow {pdt} (rows of size {self.n} "
                                 f"with entries too large to square)")
        _add_upper(xp, self._sum, G)
        self._lower_stale = True
        wt = float(k) if w is None else float(xp.sum(w))
        self.weight += wt
        self.count += k
        return (G, k, wt) if keep else self

    def update_sequences(self, seqs, mix=None, weights=None, *,
                         weight_total=None) -> "FactorAccumulator":
        """Add ``Σ_s w_s Y_sᵀ M_s Y_s`` for sequences ``Y_s`` (``seqs``: (S, T, n)) and
        mixing matrices ``M_s`` (``mix``: (S, T, T); ``None`` means all ones, i.e.
        ``(Σ_t y_t)(Σ_t y_t)ᵀ``). ``weights``: one per sequence (default 1); the total weight
        grows by ``Σ w_s`` (or by ``weight_total`` when given).
        """
        return self._update_sequences(_xp.namespace(seqs, mix, weights, self.sum), seqs, mix,
                                      weights, weight_total)

    def _update_sequences(self, xp, seqs, mix=None, weights=None, weight_total=None):
        if not hasattr(seqs, "shape") or len(seqs.shape) != 3 or seqs.shape[-1] != self.n:
            raise ValueError(f"seqs must have shape (S, T, {self.n}), got "
                             f"{getattr(seqs, 'shape', None)}")
        S, T, _ = seqs.shape
        check_real_dtype(xp, seqs, "seqs")
        Y = xp.astype(seqs, self.dtype)
        check_finite(xp, Y, "seqs")
        if mix is not None:
            if not hasattr(mix, "shape") or tuple(mix.shape) != (S, T, T):
                raise ValueError(f"mix must have shape {(S, T, T)}, got "
                                 f"{getattr(mix, 'shape', None)}")
            M = xp.astype(mix, self.dtype)
            check_finite(xp, M, "mix")
        w = self._weights(xp, weights, S, "sequence weights")
        if S == 0:
            return self
        Z = xp.sum(Y, axis=1, keepdims=True) if mix is None else M @ Y      # (S, 1|T, n)
        if w is not None:
            Z = Z * w[:, None, None]
        Yf = Y if mix is not None else xp.sum(Y, axis=1, keepdims=True)
        k = Z.shape[0] * Z.shape[1]
        self._sum += xp.reshape(Yf, (k, self.n)).T @ xp.reshape(Z, (k, self.n))
        if weight_total is not None:
            self.weight += float(weight_total)
        else:
            self.weight += float(S) if w is None else float(xp.sum(w))
        self.count += S
        return self

    # -- combining and reading ---------------------------------------------------------------
    def merge(self, *others: "FactorAccumulator") -> "FactorAccumulator":
        """A new accumulator: ``self`` plus ``others``, added left to right (fixed order)."""
        out = FactorAccumulator(self.n, xp=self.xp, dtype=self.dtype,
                                device=_xp.device(self.sum), divisor=self.divisor)
        out.sum = self.xp.asarray(self.sum, copy=True)
        out.weight, out.count = self.weight, self.count
        for i, o in enumerate(others):
            if not isinstance(o, FactorAccumulator):
                raise ValueError(f"merge argument {i} is a {type(o).__name__}, "
                                 f"not a FactorAccumulator")
            if o.n != self.n or o.dtype != self.dtype:
                raise ValueError(f"merge argument {i} has size {o.n} and dtype {o.dtype}; "
                                 f"expected {self.n} and {self.dtype}")
            if o.divisor != self.divisor:
                raise ValueError(f"merge argument {i} has divisor {o.divisor!r} but this one "
                                 f"has {self.divisor!r}: they belong to different refinement "
                                 f"steps")
            out.sum += o.sum
            out.weight += o.weight
            out.count += o.count
        return out

    @staticmethod
    def merge_all(accumulators) -> "FactorAccumulator":
        """Sum a non-empty sequence of accumulators in its order."""
        accumulators = list(accumulators)
        if not accumulators:
            raise ValueError("merge_all needs at least one accumulator")
        return accumulators[0].merge(*accumulators[1:])

    def value(self):
        """The factor ``S / (Σ w · divisor)``, exactly symmetric, as a new array."""
        if self.weight <= 0:
            raise ValueError("the accumulator is empty (total weight 0): no rows were added "
                             "with positive weight")
        H = self.sum + self.sum.T
        H *= 0.5 / (self.weight * self.divisor)
        return H

    def finish(self):
        """The factor of :meth:`value` (bitwise the same), formed in place in the running sum
        and returned without a copy: the accumulator is spent afterwards (any further use
        raises). Cheaper than ``value()`` for a collection that drops its accumulators."""
        if self._sum is None:
            raise ValueError("this accumulator is spent: finish() was called already")
        if self.weight <= 0:
            raise ValueError("the accumulator is empty (total weight 0): no rows were added "
                             "with positive weight")
        xp, H = self.xp, self._sum
        if self._lower_stale:
            H = mirror_upper(xp, H)
        # (S + Sᵀ)·(0.5/x) of value() is S·(1/x) exactly: S is symmetric, halving is exact
        H *= 1.0 / (self.weight * self.divisor)
        self._sum, self._lower_stale = None, False
        return H

    def state_dict(self) -> dict:
        """``{"sum": packed upper triangle, "packing", "n", "weight", "count", "divisor"}``
        (a copy; the packing is the factor-file layout, ``packing = "upper-colmajor"``)."""
        return {"sum": pack_upper(self.xp, self.sum), "packing": _packing.PACKING, "n": self.n,
                "weight": self.weight, "count": self.count, "divisor": self.divisor}

    @classmethod
    def from_state_dict(cls, state: dict, *, xp=None) -> "FactorAccumulator":
        packed = state["sum"]
        xp = xp or _xp.namespace(packed)
        acc = cls(int(state["n"]), xp=xp, dtype=packed.dtype, device=_xp.device(packed),
                  divisor=float(state.get("divisor", 1.0)))
        layout = state.get("packing", _packing.PACKING)
        if layout == _packing.PACKING:
            acc.sum = unpack_upper(xp, packed, acc.n)
        elif layout == _ROWMAJOR:  # a state packed row by row (the layout before it was unified)
            acc.sum = _packing.unpack_upper_rowmajor(xp, packed, acc.n, name="state['sum']")
        else:
            raise ValueError(f"state['packing'] is {layout!r}; expected {_packing.PACKING!r}")
        acc.weight = float(state["weight"])
        acc.count = int(state["count"])
        return acc

    def __repr__(self) -> str:
        return (f"FactorAccumulator(n={self.n}, dtype={self.dtype}, weight={self.weight:g}, "
                f"count={self.count}, divisor={self.divisor:g})")


def gram_buffer(xp, n: int, dtype):
    """A reusable output for the ``n x n`` products of :meth:`FactorAccumulator._update` in
    ``dtype`` (numpy: Fortran order, which ``?syrk`` writes in place), or ``None`` where the
    products are formed by a plain matrix product (other namespaces)."""
    if not _xp.is_numpy(xp):
        return None
    import numpy as np

    return np.zeros((int(n), int(n)), dtype=dtype, order="F")


def _gram(xp, Y, scale=None, out=None):
    """``Σ_t s_t y_t y_tᵀ`` for the rows of ``Y`` (k x n) in ``Y``'s dtype, its upper triangle
    exact (the lower one holds anything): one symmetric rank-k update for numpy (scipy's
    ``?syrk`` on ``√s_t y_t`` when every ``s_t >= 0``, into ``out`` when it is a
    :func:`gram_buffer` of that size and dtype), one GEMM otherwise."""
    if scale is not None:
        scale = xp.astype(scale, Y.dtype)
    if _xp.is_numpy(xp):
        import numpy as np

        blas = _syrk(Y.dtype)
        if blas is not None and (scale is None or bool(np.all(scale >= 0))):
            Ys = Y if scale is None else Y * np.sqrt(scale)[:, None]
            n = Ys.shape[1]
            # the rows as an (n, k) Fortran-order matrix A (no copy): C = A Aᵀ, its lower
            # triangle written, so that Cᵀ (C order, like the sums) holds the upper one
            if (out is not None and out.shape == (n, n) and out.dtype == Ys.dtype
                    and out.flags.f_contiguous):
                C = blas(1.0, np.asarray(Ys).T, c=out, trans=0, lower=1, overwrite_c=1)
            else:
                C = blas(1.0, np.asarray(Ys).T, trans=0, lower=1)
            return C.T
    if scale is None:
        return xp.matrix_transpose(Y) @ Y
    return xp.matrix_transpose(Y) @ (Y * scale[:, None])


def _add_upper(xp, S, G):
    """``S += G`` on the upper triangle at least (numpy: block rows of the upper triangle,
    half the memory traffic; elsewhere the whole matrix). The rest of ``S`` is stale."""
    if not _xp.is_numpy(xp):
        S += G
        return
    import numpy as np

    n = S.shape[0]
    for i in range(0, n, _BLOCK):
        np.add(S[i:i + _BLOCK, i:], G[i:i + _BLOCK, i:], out=S[i:i + _BLOCK, i:])


def _syrk(dtype):
    try:
        from scipy.linalg import blas
    except ImportError:   # pragma: no cover - scipy is a dependency
        return None
    import numpy as np

    if dtype == np.float32:
        return blas.ssyrk
    if dtype == np.float64:
        return blas.dsyrk
    return None


def token_quadratic(xp, rows, H):
    """``y_tᵀ H y_t`` for every row of ``rows`` (shape ``(..., n)``), flattened, in H's dtype
    (the rows are cast only when their dtype differs; one ``(k, n)`` temporary)."""
    n = H.shape[0]
    Y = xp.reshape(rows, (-1, n))
    if Y.dtype != H.dtype:
        Y = xp.astype(Y, H.dtype)
    YH = Y @ H
    YH *= Y
    return xp.sum(YH, axis=1)


def sequence_mix(xp, seqs, H):
    """``Y_s H Y_sᵀ`` for every sequence (``seqs``: (S, T, n)) → (S, T, T), in H's dtype."""
    Y = xp.astype(seqs, H.dtype)
    S, T, n = Y.shape
    YH = xp.reshape(xp.reshape(Y, (S * T, n)) @ H, (S, T, n))
    return YH @ xp.matrix_transpose(Y)


def frobenius_sq(xp, H) -> float:
    return float(xp.sum(H * H))


def pack_upper(xp, H):
    """The upper triangle of ``H`` packed column by column (``n(n+1)/2`` entries): the
    factor-file layout of :mod:`bakron._lib.packing`."""
    return _packing.pack_upper(xp, H)


def unpack_upper(xp, packed, n: int):
    """Inverse of :func:`pack_upper`: the full symmetric ``n x n`` matrix."""
    return _packing.unpack_upper(xp, packed, n, name="packed accumulator sum")
