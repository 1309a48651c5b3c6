"""The packed layout of a symmetric matrix (the factor-file layout, docs/distributed.md).

The upper triangle is stored **column by column**: for ``c = 0..n-1``, for ``r = 0..c``,
``H[r, c]``; entry ``(r, c)`` with ``r <= c`` sits at index ``c(c+1)/2 + r``. This is LAPACK's
``UPLO='U'`` packed storage and, for a symmetric matrix, the lower triangle read row by row
(``H[torch.tril_indices(n, n)]``), so vectors packed by other tools in that order load unchanged.

Both functions work on any array-API namespace and keep the dtype.
"""
from __future__ import annotations

import math

from .. import _xp

__all__ = ["PACKING", "packed_length", "packed_size_to_n", "pack_upper", "unpack_upper",
           "unpack_upper_rowmajor"]

PACKING = "upper-colmajor"


def packed_length(n: int) -> int:
    return n * (n + 1) // 2


def packed_size_to_n(length: int, name: str = "packed factor") -> int:
    """``n`` such that ``n(n+1)/2 == length``; ``ValueError`` naming ``name`` otherwise."""
    n = (math.isqrt(8 * int(length) + 1) - 1) // 2
    if packed_length(n) != length or length == 0:
        raise ValueError(f"{name} has length {length}, which is not n(n+1)/2 for any n >= 1: "
                         f"it is not a packed triangle (a diagonal H_O must be stored as "
                         f"'hout_diag')")
    return n


def _lower_rowmajor_index(xp, n: int, device):
    """Flat (row-major) indices of the lower triangle, row by row: the packed order."""
    idx = xp.arange(n * n, device=device)
    i, j = idx // n, idx % n
    return xp.nonzero(j <= i)[0]


def pack_upper(xp, H):
    """Pack the upper triangle of a symmetric ``(n, n)`` ``H`` column by column.

    ``H`` is used as given (callers that hold a not-quite-symmetric matrix symmetrise first);
    the entries read are ``H[r, c]`` with ``r <= c``.
    """
    n = H.shape[0]
    Ht = xp.matrix_transpose(H)  # lower of H.T row by row == upper of H column by column
    return xp.take(xp.reshape(Ht, (n * n,)), _lower_rowmajor_index(xp, n, _xp.device(H)))


def _unpack(xp, packed, n: int, pos_fn, name: str):
    if tuple(packed.shape) != (packed_length(n),):
        raise ValueError(f"{name}: a packed triangle of a {n} x {n} matrix has "
                         f"{packed_length(n)} entries, got shape {tuple(packed.shape)}")
    idx = xp.arange(n * n, device=_xp.device(packed))
    i, j = idx // n, idx % n
    lo, hi = xp.minimum(i, j), xp.maximum(i, j)
    return xp.reshape(xp.take(packed, pos_fn(lo, hi)), (n, n))


def unpack_upper(xp, packed, n: int | None = None, *, name: str = "packed triangle"):
    """Inverse of :func:`pack_upper`: the full symmetric ``(n, n)`` matrix (exact, dtype kept).

    ``n`` defaults to the size implied by the length.
    """
    if len(packed.shape) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(packed.shape)}")
    if n is not None and packed.shape[0] != packed_length(int(n)):
        raise ValueError(f"{name} has shape {tuple(packed.shape)}, expected {n} x {n} packed: "
                         f"a packed triangle of a {n} x {n} matrix has "
                         f"{packed_length(int(n))} entries")
    k = packed_size_to_n(packed.shape[0], name)
    return _unpack(xp, packed, k, lambda lo, hi: (hi * (hi + 1)) // 2 + lo, name)


def unpack_upper_rowmajor(xp, packed, n: int, *, name: str = "packed triangle"):
    """Read the *row-major* upper layout (row by row, ``H[r, c]`` with ``c >= r``) that
    accumulator states written before the layout was unified used."""
    return _unpack(xp, packed, int(n), lambda lo, hi: lo * n - (lo * (lo - 1)) // 2 + (hi - lo),
                   name)
