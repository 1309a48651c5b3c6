"""Transposed reads of square matrices, tile by tile: symmetrising, the asymmetry check and
mirroring a triangle.

``H + Hᵀ`` on a numpy array reads ``Hᵀ`` with a stride of a whole row, so every element
read pulls in a new cache line: for SmolLM2's 1,536-wide factors it took longer than the
two Hadamard transforms of a rotation together. Here the matrix is visited in square tiles
of :data:`TILE` rows (a tile and its transposed partner fit in the cache), with the same
arithmetic on every element, so the results are bitwise those of the plain expressions.
Other namespaces (cupy, array-api-strict) use the plain expressions.
"""
from __future__ import annotations

from .. import _xp

__all__ = ["symmetrize", "max_asymmetry", "mirror_upper", "TILE"]

#: side of the square tiles (two 64 x 64 float64 tiles are 64 KiB: they stay in the L2 cache)
TILE = 64


def _tiles(n: int):
    """The tiles on and above the diagonal of an ``n x n`` matrix, as ``(a, b, c, d)`` for
    ``H[a:b, c:d]`` with ``c >= a``."""
    for a in range(0, n, TILE):
        b = min(a + TILE, n)
        for c in range(a, n, TILE):
            yield a, b, c, min(c + TILE, n)


def symmetrize(xp, H):
    """``(H + Hᵀ) / 2`` as a new array (``H`` is not modified), bitwise the plain
    expression's."""
    if not _xp.is_numpy(xp):
        return (H + xp.matrix_transpose(H)) / 2
    import numpy as np

    out = np.empty_like(H)
    for a, b, c, d in _tiles(H.shape[0]):
        t = H[a:b, c:d] + H[c:d, a:b].T
        t /= 2
        out[a:b, c:d] = t
        if c != a:
            out[c:d, a:b] = t.T
    return out


def max_asymmetry(xp, H) -> float:
    """``max |H - Hᵀ|`` (0.0 for an exactly symmetric matrix)."""
    if not _xp.is_numpy(xp):
        return float(xp.max(xp.abs(H - xp.matrix_transpose(H))))
    import numpy as np

    # (the tiles' maxima reduced by numpy: a NaN anywhere gives NaN, as the plain one does)
    return float(np.max([np.max(np.abs(H[a:b, c:d] - H[c:d, a:b].T))
                         for a, b, c, d in _tiles(H.shape[0])]))


def mirror_upper(xp, S):
    """``S`` with its lower triangle replaced by the transposed upper one (numpy: in place;
    elsewhere a new array)."""
    if not _xp.is_numpy(xp):
        return xp.triu(S) + xp.matrix_transpose(xp.triu(S, k=1))
    import numpy as np

    for a, b, c, d in _tiles(S.shape[0]):
        if c == a:
            t = S[a:b, a:b]
            t[...] = np.triu(t) + np.triu(t, 1).T
        else:
            S[c:d, a:b] = S[a:b, c:d].T
    return S
