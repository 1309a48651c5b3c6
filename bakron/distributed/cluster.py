"""Local clusters: one worker per GPU (or a few CPU workers), loopback by default.

Nothing here imports cupy, numba.cuda or any CUDA library: the GPUs are counted from
``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi -L``, so the client process never creates a CUDA
context (a context made before the workers fork or start would pin memory on GPU 0 and, with
``fork``, break CUDA in the children).
"""
from __future__ import annotations

import shutil
import subprocess

from ..solvers.options import environment

__all__ = ["visible_gpus", "gpu_cluster", "cpu_cluster"]


def visible_gpus() -> list[str]:
    """The GPU ids this process may use, without touching CUDA: the entries of
    ``CUDA_VISIBLE_DEVICES`` when it is set (indices or UUIDs; empty or ``-1`` means none),
    otherwise one index per ``GPU`` line of ``nvidia-smi -L`` (none when it is missing)."""
    vis = environment("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        ids = [v.strip() for v in vis.split(",") if v.strip()]
        if not ids or ids[0] == "-1":
            return []
        out = []
        for v in ids:  # CUDA stops at the first invalid entry
            if v.startswith("-"):
                break
            out.append(v)
        return out
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        txt = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    n = sum(1 for line in txt.splitlines() if line.startswith("GPU "))
    return [str(i) for i in range(n)]


def gpu_cluster(gpus=None, *, host: str = "127.0.0.1", threads_per_worker: int = 1,
                memory_limit="auto", use_dask_cuda: bool | None = None,
                dashboard: bool = False, **worker_options):
    """Start a local Dask cluster with one worker process per GPU.

    Parameters
    ----------
    gpus : int, list of ids, or None
        ``None``: every visible GPU (:func:`visible_gpus`); an int N: the first N visible ones
        (an error if fewer are visible, unless ``CUDA_VISIBLE_DEVICES`` is unset and no
        ``nvidia-smi`` exists, in which case ids 0..N-1 are assumed); a list: those ids.
    host : str
        Interface the scheduler and workers listen on; loopback by default (nothing outside
        the machine can connect). Use an external address only on a trusted network.
    threads_per_worker : int
        One by default: one task at a time per GPU.
    use_dask_cuda : bool or None
        Use ``dask_cuda.LocalCUDACluster`` (``None``: when it is installed). Otherwise a
        ``SpecCluster`` of ``Nanny`` workers, each with ``CUDA_VISIBLE_DEVICES`` set to its one
        GPU. Either way every worker advertises the resource ``GPU=1``, which
        :func:`run_layers` requests per task.

    Returns
    -------
    A cluster object (use it with ``distributed.Client(cluster)``; close it when done).
    """
    if isinstance(gpus, (list, tuple)):
        ids = [str(g) for g in gpus]
    else:
        seen = visible_gpus()
        if gpus is None:
            ids = seen
        else:
            n = int(gpus)
            if n < 1:
                raise ValueError(f"gpus must be >= 1, got {gpus!r}")
            if len(seen) >= n:
                ids = seen[:n]
            elif not seen and environment("CUDA_VISIBLE_DEVICES") is None \
                    and shutil.which("nvidia-smi") is None:
                ids = [str(i) for i in range(n)]  # cannot count: trust the caller
            else:
                raise ValueError(f"asked for {n} GPUs but {len(seen)} are visible ({seen})")
    if not ids:
        raise ValueError("no GPU is visible (CUDA_VISIBLE_DEVICES / nvidia-smi -L); pass "
                         "gpus=[ids] explicitly, or use cpu_cluster()")
    if use_dask_cuda is None:
        try:
            import dask_cuda  # noqa: F401

            use_dask_cuda = True
        except ImportError:
            use_dask_cuda = False
    if use_dask_cuda:
        from dask_cuda import LocalCUDACluster

        kw = dict(CUDA_VISIBLE_DEVICES=",".join(ids), threads_per_worker=threads_per_worker,
                  host=host, memory_limit=memory_limit,
                  dashboard_address=_dash(host, dashboard), **worker_options)
        try:
            return LocalCUDACluster(resources={"GPU": 1}, **kw)
        except TypeError:  # a dask-cuda that does not forward resources
            return LocalCUDACluster(**kw)
    from distributed import Nanny, Scheduler, SpecCluster

    scheduler = {"cls": Scheduler, "options": {"host": host,
                                               "dashboard_address": _dash(host, dashboard)}}
    workers = {}
    for gid in ids:
        opts = {"nthreads": threads_per_worker, "host": host, "memory_limit": memory_limit,
                "resources": {"GPU": 1}, "env": {"CUDA_VISIBLE_DEVICES": gid}}
        opts.update(worker_options)
        workers[f"gpu-{gid}"] = {"cls": Nanny, "options": opts}
    return SpecCluster(scheduler=scheduler, workers=workers, name="bakron-gpu")


def cpu_cluster(n_workers: int = 2, *, threads_per_worker: int = 1, host: str = "127.0.0.1",
                memory_limit="auto", dashboard: bool = False, **kwargs):
    """A loopback ``LocalCluster`` of ``n_workers`` processes (for CPU runs and tests)."""
    from distributed import LocalCluster

    return LocalCluster(n_workers=int(n_workers), threads_per_worker=threads_per_worker,
                        processes=True, host=host, memory_limit=memory_limit,
                        dashboard_address=_dash(host, dashboard), **kwargs)


def _dash(host: str, dashboard: bool) -> str:
    """The scheduler's HTTP server always starts; it listens on ``host`` (loopback by default):
    port 8787 when the dashboard is wanted, a free port otherwise (no clash between clusters)."""
    h = "" if host in (None, "0.0.0.0") else host
    return f"{h}:{8787 if dashboard else 0}"
