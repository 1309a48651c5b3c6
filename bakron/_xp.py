"""Array-API plumbing: namespace resolution, devices, host transfer, synchronisation.

Every public function resolves the namespace once (``xp = namespace(W, ...)``) and passes
``xp`` down; nothing below the public layer calls ``array_namespace`` again.
"""
from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace, device as _device, is_cupy_namespace
from array_api_compat import is_numpy_namespace, to_device as _to_device  # noqa: F401

__all__ = ["namespace", "device", "to_numpy", "sync", "is_numpy", "is_cupy", "float_dtype"]


def namespace(*arrays):
    """The array-API namespace shared by ``arrays`` (``None`` entries are ignored)."""
    arrays = [a for a in arrays if a is not None]
    return array_namespace(*arrays)


def device(x):
    return _device(x)


def is_numpy(xp) -> bool:
    return is_numpy_namespace(xp)


def is_cupy(xp) -> bool:
    return is_cupy_namespace(xp)


def to_numpy(x) -> np.ndarray:
    """Copy any supported array to a host numpy array (no copy for numpy inputs)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):  # cupy
        return x.get()
    try:
        return np.from_dlpack(x)
    except Exception:  # array-api-strict and others that may not export to host via DLPack
        return np.asarray(x)


def sync(xp) -> None:
    """Wait for queued device work (so that timings are honest); a no-op on the CPU."""
    if is_cupy(xp):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def float_dtype(xp, x, name: str):
    """Return the floating dtype of ``x`` (float32 or float64), or raise a clear error."""
    if x.dtype == xp.float32 or x.dtype == xp.float64:
        return x.dtype
    raise TypeError(
        f"{name} must be float32 or float64, got dtype {x.dtype}; convert it first "
        f"(e.g. {name}.astype(float32))"
    )
