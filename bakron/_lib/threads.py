"""Threads and cores: the one wrapper of ``threadpoolctl`` that the demo, ``quantize_model``
and the stacked solver use (BLAS thread limits), and the cores this process may use."""
from __future__ import annotations

import os
from contextlib import contextmanager

__all__ = ["blas_limit", "cores"]


def cores() -> int:
    """The cores this process may run on (its CPU affinity where the system reports it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


@contextmanager
def blas_limit(threads: int | None, name: str = "threads"):
    """Limit BLAS to ``threads`` threads inside the block (``threadpoolctl``; a process-wide
    setting, restored on exit). Yields the limit applied, or ``None`` when nothing was
    changed: ``threads`` is ``None``, or ``threadpoolctl`` is not installed. scipy's own BLAS
    is loaded first (compiled numba code calls it) so that the limit covers it too.

    Raises ``ValueError`` naming ``name`` for a ``threads`` that is not a positive integer."""
    if threads is None:
        yield None
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {threads!r}")
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield None
        return
    try:
        import scipy.linalg  # noqa: F401
    except Exception:  # noqa: BLE001 - a missing or broken scipy only loses the limit
        pass
    with threadpool_limits(limits=threads, user_api="blas"):
        yield threads
