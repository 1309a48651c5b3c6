"""Incoherence processing: random orthogonal rotations of both sides of a layer before rounding.

With orthogonal ``U`` (m x m) and ``V`` (n x n) the layer ``W`` (m x n) and its Kronecker
factors become

``W' = U W Vᵀ``,  ``H_in' = V H_in Vᵀ``,  ``H_out' = U H_out Uᵀ``,

``W'`` is rounded on the grid under ``H_out' ⊗ H_in'`` and the result is rotated back,
``Ŵ = Uᵀ Ŵ' V``. The proxy error is unchanged by the rotation
(``tr(E H_in Eᵀ H_out) = tr(E' H_in' E'ᵀ H_out')`` with ``E' = U E Vᵀ``), but the rotated
weights and factors are *incoherent*: no weight is much larger than the others and no input
dominates, which is what rounding on a uniform grid likes (QuIP#, YAQA).

Each rotation is ``R = (Q_r ⊗ H_p / sqrt(p)) · diag(s)`` for a size ``N = r · p`` with ``p``
the largest power of two dividing ``N``: ``s`` are random signs, ``H_p`` the Sylvester
Hadamard matrix of order ``p`` (``scipy.linalg.hadamard``'s, applied as a fast
Walsh–Hadamard transform, ``O(N log N)``) and ``Q_r`` a random orthogonal ``r x r`` block
(Haar, from the QR of a Gaussian matrix; ``r = 1`` for a power of two). For example
``576 = 9 · 64`` uses a random 9 x 9 block with ``H_64`` and ``1536 = 3 · 512`` a random
3 x 3 block with ``H_512``. Everything is seeded: the same seed and shape give the same
rotations.

**Where it applies.** ``Ŵ`` is not on the grid in the original basis: only an export that
stores float weights (``bakron quantize-model --format float``) or a runtime that applies the
rotations can use it. GGUF and GPTQ files store codes of ``W`` itself and cannot carry the
rotations, so the option is refused for them.

Example
-------
>>> import numpy as np
>>> from bakron import quantize_layer
>>> rng = np.random.default_rng(0)
>>> W = rng.standard_normal((48, 96)); X = rng.standard_normal((500, 96))
>>> res = quantize_layer(W, X.T @ X, bits=3, incoherence=0)       # seed 0
>>> res.rotation.unrotate_weight(res.rotation.rotate_weight(W)).shape
(48, 96)
"""
from __future__ import annotations

import numpy as np

from . import _xp
from ._lib.symmetric import symmetrize

__all__ = ["Rotation", "Incoherence", "FORMATS_WITHOUT_ROTATIONS", "refusal"]

#: Export formats that store codes of W and cannot carry rotations.
FORMATS_WITHOUT_ROTATIONS = ("gguf-q4_0", "gguf-q4_1", "gguf-q8_0", "gptq")


def refusal(fmt: str) -> str | None:
    """The message refusing incoherence for export format ``fmt``, or ``None`` when it is
    allowed (``float``)."""
    if fmt in FORMATS_WITHOUT_ROTATIONS:
        kind = "a GGUF file" if fmt.startswith("gguf") else "a GPTQ checkpoint"
        return (f"incoherence processing cannot be used with --format {fmt}: {kind} stores "
                f"the codes of W itself on its grid, and the rounded weights "
                f"U^T W'_hat V of the rotated layer are not on that grid; the file cannot "
                f"carry the rotations U, V. Use --format float (it stores W_hat as float)")
    return None


def _split(N: int) -> tuple[int, int]:
    """(r, p): ``N = r · p`` with ``p`` the largest power of two dividing ``N``."""
    p = N & -N
    return N // p, p


#: largest Hadamard block applied as one dense product in :func:`_fwht`
_RADIX = 16


def _sylvester(k: int):
    """The Sylvester Hadamard matrix of order ``k`` (a power of two), float64 numpy."""
    H = np.ones((1, 1))
    while H.shape[0] < k:
        H = np.block([[H, H], [H, -H]])
    return H


def _fwht(xp, X):
    """The Sylvester Walsh–Hadamard transform ``H_p X`` along axis 1 of ``X`` (r, p, c),
    unnormalised.

    ``H_p = H_a ⊗ H_b ⊗ …`` for ``p = a · b · …`` (Sylvester's construction), so the
    transform is a few passes, each multiplying one sub-axis of ``p`` by a dense Hadamard
    block of at most :data:`_RADIX` rows: ``ceil(log_16 p)`` batched products (at most
    ``2 · 16`` flops per entry each) instead of ``log_2 p`` butterfly passes, which are bound
    by memory traffic and were the larger part of a rotated layer's solve.
    """
    r, p, c = X.shape
    outer, rest = r, p
    while rest > 1:
        k = min(_RADIX, rest)
        rest //= k
        H = xp.asarray(_sylvester(k), dtype=X.dtype, device=_xp.device(X))
        X = xp.matmul(H, xp.reshape(X, (outer, k, rest * c)))
        outer *= k
    return xp.reshape(X, (r, p, c))


class Rotation:
    """A seeded orthogonal ``N x N`` matrix ``R = (Q_r ⊗ H_p / sqrt(p)) · diag(s)`` (see the
    module's docstring), applied without forming it.

    Parameters
    ----------
    N : int
        The size.
    seed : int or tuple of ints
        Seed of ``numpy.random.default_rng`` for the signs and the ``r x r`` block.
    """

    def __init__(self, N: int, seed=0):
        if isinstance(N, bool) or not isinstance(N, (int, np.integer)) or N < 1:
            raise ValueError(f"rotation size must be a positive integer, got {N!r}")
        self.N = int(N)
        self.r, self.p = _split(self.N)
        rng = np.random.default_rng(seed)
        self.signs = rng.choice(np.array([-1.0, 1.0]), size=self.N)
        if self.r == 1:
            self.Q = np.ones((1, 1))
        else:
            Q, R = np.linalg.qr(rng.standard_normal((self.r, self.r)))
            self.Q = Q * np.sign(np.diag(R))[None, :]   # Haar-distributed
        self.seed = seed

    def __repr__(self):
        return f"Rotation({self.N} = {self.r} x {self.p}, seed={self.seed!r})"

    def _consts(self, xp, X):
        dev = _xp.device(X)
        return (xp.asarray(self.signs, dtype=X.dtype, device=dev),
                xp.asarray(self.Q, dtype=X.dtype, device=dev))

    def apply(self, X, *, transpose: bool = False):
        """``R X`` (or ``Rᵀ X`` with ``transpose``) for ``X`` of shape ``(N, c)``, in X's
        floating dtype; X is not modified."""
        xp = _xp.namespace(X)
        if len(X.shape) != 2 or X.shape[0] != self.N:
            raise ValueError(f"the rotation of size {self.N} needs an array with {self.N} "
                             f"rows, got shape {tuple(X.shape)}")
        s, Q = self._consts(xp, X)
        c = X.shape[1]
        if not transpose:
            Y = xp.reshape(X * s[:, None], (self.r, self.p, c))
            Y = _fwht(xp, Y) / np.sqrt(self.p)
            if self.r > 1:
                Y = xp.reshape(Q @ xp.reshape(Y, (self.r, self.p * c)), (self.r, self.p, c))
            return xp.reshape(Y, (self.N, c))
        Y = xp.reshape(X, (self.r, self.p, c))
        if self.r > 1:
            Y = xp.reshape(Q.T @ xp.reshape(Y, (self.r, self.p * c)), (self.r, self.p, c))
        Y = _fwht(xp, Y) / np.sqrt(self.p)          # H_p is symmetric
        return xp.reshape(Y, (self.N, c)) * s[:, None]

    def matrix(self, xp=None, dtype="float64"):
        """``R`` itself (dense, for tests and small sizes)."""
        xp = _xp.namespace(np.empty(0)) if xp is None else xp
        return self.apply(xp.eye(self.N, dtype=getattr(xp, dtype)))


class Incoherence:
    """The two rotations of an ``m x n`` layer: ``U`` (outputs, seed ``(seed, 0)``) and ``V``
    (inputs, seed ``(seed, 1)``); see the module's docstring.

    Computations run in float64 and return the input's dtype.
    """

    def __init__(self, m: int, n: int, seed: int = 0):
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"the incoherence seed must be a non-negative integer, got "
                             f"{seed!r}")
        self.seed = int(seed)
        self.U = Rotation(m, (self.seed, 0))
        self.V = Rotation(n, (self.seed, 1))

    def __repr__(self):
        return f"Incoherence(U={self.U!r}, V={self.V!r})"

    @property
    def shape(self):
        return (self.U.N, self.V.N)

    @staticmethod
    def _f64(xp, A):
        return xp.astype(A, xp.float64)

    def rotate_weight(self, W):
        """``U W Vᵀ``."""
        xp = _xp.namespace(W)
        A = self.V.apply(xp.permute_dims(self._f64(xp, W), (1, 0)))        # V Wᵀ = (W Vᵀ)ᵀ
        return xp.astype(self.U.apply(xp.permute_dims(A, (1, 0))), W.dtype)

    def unrotate_weight(self, W_rot):
        """``Uᵀ W' V`` (the inverse of :meth:`rotate_weight`)."""
        xp = _xp.namespace(W_rot)
        A = self.U.apply(self._f64(xp, W_rot), transpose=True)             # Uᵀ W'
        B = self.V.apply(xp.permute_dims(A, (1, 0)), transpose=True)       # Vᵀ (Uᵀ W')ᵀ
        return xp.astype(xp.permute_dims(B, (1, 0)), W_rot.dtype)

    def _sandwich(self, R, H):
        xp = _xp.namespace(H)
        A = R.apply(self._f64(xp, H))                                      # R H
        B = R.apply(xp.permute_dims(A, (1, 0)))                            # R (R H)ᵀ = R H Rᵀ
        B = symmetrize(xp, B)                                              # exactly symmetric
        return xp.astype(B, H.dtype)

    def rotate_in(self, H_in):
        """``V H_in Vᵀ``."""
        return self._sandwich(self.V, H_in)

    def rotate_out(self, H_out):
        """``U H_out Uᵀ`` (``None`` stays ``None``: ``U I Uᵀ = I``; a vector is the diagonal
        of a diagonal factor and becomes a full matrix)."""
        if H_out is None:
            return None
        xp = _xp.namespace(H_out)
        if len(H_out.shape) == 1:
            H_out = xp.eye(H_out.shape[0], dtype=H_out.dtype,
                           device=_xp.device(H_out)) * H_out[None, :]
        return self._sandwich(self.U, H_out)
