"""Symmetric eigendecompositions of float32 matrices in float32, with the GIL released (numpy).

``numpy.linalg.eigh`` computes in float64 whatever it is given: a float32 matrix is cast up
and the results cast back, so a float32 factor costs what a float64 one does. For float32
numpy arrays :func:`eigh` calls LAPACK's ``ssyevd`` (the single-precision twin of the
routine ``numpy.linalg.eigh`` runs) through :mod:`scipy.linalg.cython_lapack` — the function
pointers scipy exports for compiled code, called with :mod:`ctypes`, which releases the GIL
during the call (``scipy.linalg.eigh`` runs the same routine but holds the GIL, which would
stall the other threads of a pass). A 1,536-wide float32 factor takes 0.47 s instead of
0.89 s on one core. Everything else (float64, cupy, array-api-strict) goes to the
namespace's ``linalg.eigh``.
"""
from __future__ import annotations

import ctypes
import functools

from .. import _xp

__all__ = ["eigh"]

_INT_P = ctypes.POINTER(ctypes.c_int)


@functools.cache
def _ssyevd():
    """scipy's ``ssyevd`` as a ctypes function (``None`` when it cannot be found)."""
    try:
        from scipy.linalg import cython_lapack

        capsule = cython_lapack.__pyx_capi__["ssyevd"]
    except (ImportError, AttributeError, KeyError):   # pragma: no cover - scipy too old
        return None
    # (prototypes of their own: ctypes.pythonapi's shared attributes are left as they are)
    name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
        ("PyCapsule_GetName", ctypes.pythonapi))
    pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    # ssyevd(jobz, uplo, n, a, lda, w, work, lwork, iwork, liwork, info)
    proto = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, _INT_P, ctypes.c_void_p,
                             _INT_P, ctypes.c_void_p, ctypes.c_void_p, _INT_P, ctypes.c_void_p,
                             _INT_P, _INT_P)
    return proto(pointer(capsule, name(capsule)))


def _ssyevd_eigh(H):
    """``(w, U)`` of a symmetric float32 numpy matrix (one triangle read) by ``ssyevd``, or
    ``None`` when that routine is not available."""
    import numpy as np

    f = _ssyevd()
    n = H.shape[0]
    if f is None or n > np.iinfo(np.intc).max // max(n, 1):   # (LAPACK's 32-bit sizes)
        return None
    # a C-order copy read as a Fortran matrix is Hᵀ = H, whose lower triangle is H's upper
    # one: symmetric, so either triangle is the matrix; the columns of the Fortran result
    # (the rows of this C-order array) are the eigenvectors
    A = np.array(H, order="C", copy=True)
    w = np.empty(n, dtype=H.dtype)
    N, info = ctypes.c_int(n), ctypes.c_int(0)
    size, isize = np.empty(1, dtype=H.dtype), np.empty(1, dtype=np.intc)
    query = ctypes.c_int(-1)   # (lwork = liwork = -1: the workspace query)
    f(b"V", b"L", N, A.ctypes.data, N, w.ctypes.data, size.ctypes.data, query,
      isize.ctypes.data, query, info)
    if info.value != 0:   # pragma: no cover - a query does not fail
        return None
    lwork, liwork = int(size[0]), int(isize[0])
    work = np.empty(max(1, lwork), dtype=H.dtype)
    iwork = np.empty(max(1, liwork), dtype=np.intc)
    f(b"V", b"L", N, A.ctypes.data, N, w.ctypes.data, work.ctypes.data,
      ctypes.c_int(work.size), iwork.ctypes.data, ctypes.c_int(iwork.size), info)
    if info.value != 0:
        raise np.linalg.LinAlgError(f"the eigendecomposition did not converge (ssyevd info "
                                    f"{info.value})")
    return w, A.T


def eigh(xp, H):
    """``(w, U)`` with ``H = U diag(w) Uᵀ`` for a symmetric ``H`` (ascending ``w``), in
    ``H``'s floating dtype; ``H`` is not modified. A float32 numpy matrix: LAPACK ``ssyevd``
    in float32, without the GIL (see the module); else ``xp.linalg.eigh``."""
    if _xp.is_numpy(xp) and len(H.shape) == 2 and H.shape[0] == H.shape[1]:
        import numpy as np

        A = np.asarray(H)
        if A.dtype == np.float32:
            got = _ssyevd_eigh(A)
            if got is not None:
                return xp.asarray(got[0]), xp.asarray(got[1])
    return xp.linalg.eigh(H)
