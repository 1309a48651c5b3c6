"""Dask scale-out of :func:`bakron.quantize_model.quantize_model` (``bakron quantize-model
--scheduler ADDRESS`` / ``--gpus N``; docs/export.md, "Scale-out").

The factor collection stays in the driver (it is the model's forward and backward passes).
Each layer's solve is one Dask task, submitted as soon as the layer's factors are final (the
driver's ``finish`` callback): the task receives ``W``, ``H_in``, ``H_out`` as host arrays,
moves them to its own device and runs :func:`bakron.pipeline.solve_and_publish`, the body the
driver runs without Dask, which publishes the layer file write-once into ``OUT.work/``. The
driver counts a layer when its task has finished, so the progress bar and the resume logic
see the same files either way.
"""
from __future__ import annotations

import hashlib
import time

import numpy as np

from .. import _xp

__all__ = ["ClusterUnavailable", "DaskLayerSolves", "solve_task", "CONNECT_TIMEOUT"]

#: seconds to wait for ``--scheduler ADDRESS`` to answer before giving up (exit code 4)
CONNECT_TIMEOUT = 30.0


class ClusterUnavailable(RuntimeError):
    """Dask is not installed, the scheduler cannot be reached, or fewer GPUs are visible than
    asked for (``bakron quantize-model`` exits 4; nothing was done)."""


def solve_task(work: str, name: str, key: str, W, H_in, H_out, grid: dict, tile, damp,
               device: str, incoherence: int | None = None) -> dict:
    """The body of one layer task (runs on a worker): the arrays on the worker's ``device``,
    then the driver's own solve-and-publish. Returns ``{"name", "seconds", "worker"}``."""
    from ..io import array_namespace as namespace
    from ..pipeline import solve_and_publish

    t = time.perf_counter()
    xp, _ = namespace(device)
    on = [None if a is None else xp.asarray(a) for a in (W, H_in, H_out)]
    solve_and_publish(work, name, key, *on, grid, tile, damp, incoherence=incoherence)
    try:
        from distributed import get_worker

        worker = get_worker().address
    except Exception:  # noqa: BLE001 - not inside a Dask worker
        worker = "in-process"
    return {"name": name, "seconds": time.perf_counter() - t, "worker": worker}


def _host_copy(a):
    """A host numpy copy of ``a`` (the driver may reuse its factor buffers after ``finish``
    returns; the task must not see that)."""
    return None if a is None else np.array(_xp.to_numpy(a), copy=True)


class DaskLayerSolves:
    """The driver's side: submit each layer's solve, collect the finished ones in order of
    completion, hand them to ``on_done`` in the driver's thread."""

    def __init__(self, client, *, cluster=None, owns_client: bool = False, retries: int = 2,
                 device: str = "cpu"):
        self.client = client
        self.cluster = cluster
        self.owns_client = owns_client
        self.retries = int(retries)
        self.device = device
        self._futures: dict = {}   # Dask key -> (future, layer name)
        self._ac = None
        self._settings = None
        self._on_done = None

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def connect(cls, *, scheduler=None, gpus=None, client=None, retries=2,
                device="cpu", timeout=None) -> "DaskLayerSolves":
        """Connect to ``scheduler``, start a loopback cluster of ``gpus`` GPU workers, or use
        the caller's ``client`` (left open at the end). :class:`ClusterUnavailable` when it
        cannot be done."""
        if client is not None:
            return cls(client, retries=retries, device=device)
        try:
            from distributed import Client
        except ImportError:
            raise ClusterUnavailable("--scheduler/--gpus need Dask: pip install "
                                     "'bakron[dask]'") from None
        cluster = None
        try:
            if gpus:
                from .cluster import gpu_cluster, visible_gpus

                have = len(visible_gpus())
                if have < int(gpus):
                    raise ClusterUnavailable(
                        f"--gpus {gpus}: this machine shows {have} GPU"
                        f"{'s' if have != 1 else ''} (CUDA_VISIBLE_DEVICES / nvidia-smi)")
                cluster = gpu_cluster(int(gpus))
                client = Client(cluster)
            else:
                wait = timeout or CONNECT_TIMEOUT
                client = Client(scheduler, timeout=f"{wait}s")
                try:   # a scheduler without workers would leave every task queued for ever
                    client.wait_for_workers(1, timeout=wait)
                except TimeoutError:
                    client.close()
                    raise ClusterUnavailable(f"the scheduler {scheduler} has no worker (none "
                                             f"joined within {wait:g} s)") from None
        except ClusterUnavailable:
            raise
        except ValueError as exc:   # e.g. fewer GPUs visible than asked for, a bad address
            _close(cluster)
            raise ClusterUnavailable(f"cannot start or reach the Dask cluster: {exc}") from None
        except (OSError, TimeoutError) as exc:
            _close(cluster)
            where = f"the scheduler {scheduler}" if scheduler else "a local GPU cluster"
            raise ClusterUnavailable(f"cannot reach {where}: {exc}") from None
        return cls(client, cluster=cluster, owns_client=True, retries=retries, device=device)

    # -- running -------------------------------------------------------------------------
    def start(self, work: str, *, grid: dict, tile, damp, on_done,
              incoherence: int | None = None) -> None:
        """The run's settings (``incoherence``: the rotation seed, or ``None``);
        ``on_done(name, seconds)`` counts a published layer."""
        from distributed import as_completed

        from ._run import _gpu_resource

        self._settings = (work, dict(grid), tuple(tile),
                          dict(damp) if isinstance(damp, dict) else float(damp), incoherence)
        self._on_done = on_done
        self._resources = _gpu_resource(self.client)
        self._ac = as_completed()

    def submit(self, name: str, key: str, W, H_in, H_out) -> None:
        """Submit the solve of layer ``name`` (host copies of its arrays, scattered once)."""
        work, grid, tile, damp, incoherence = self._settings
        arrays = [_host_copy(a) for a in (W, H_in, H_out)]
        present = [a for a in arrays if a is not None]
        scattered = iter(self.client.scatter(present, hash=False)) if present else iter(())
        args = [None if a is None else next(scattered) for a in arrays]
        # the Dask key holds the whole layer key (settings and weights' hash): a resubmitted
        # layer of changed weights is never taken for a task of the old ones
        tag = hashlib.sha256(key.encode()).hexdigest()[:16]
        fut = self.client.submit(solve_task, work, name, key, *args, grid, tile, damp,
                                 self.device, incoherence, key=f"bakron-model-layer-{tag}-{name}",
                                 retries=self.retries, resources=self._resources, pure=False)
        self._futures[fut.key] = (fut, name)
        self._ac.add(fut)
        self._collect(block=False)

    def wait(self) -> None:
        """Wait for every submitted solve; the first failed task's error is raised (after its
        retries), the others are then cancelled."""
        self._collect(block=True)

    def _collect(self, block: bool) -> None:
        if self._ac is None:
            return
        if block:
            for fut in self._ac:   # one at a time: the first failure is raised at once
                self._finished(fut)
            return
        while self._ac.has_ready():
            for fut in self._ac.next_batch(block=False):
                self._finished(fut)

    def _finished(self, fut) -> None:
        _, name = self._futures.pop(fut.key)
        rec = fut.result()   # raises the task's own exception, as the local path would
        fut.release()
        self._on_done(name, float(rec["seconds"]))

    def cancel(self) -> None:
        """Cancel the solves not yet finished (after an error or an interrupt; files already
        published stay, and a task already running may still publish its file, write-once)."""
        futs = [f for f, _ in self._futures.values()]
        self._futures.clear()
        if futs:
            try:
                self.client.cancel(futs)
            except Exception:  # noqa: BLE001 - a closed connection: nothing left to cancel
                pass

    def close(self) -> None:
        """Cancel what is left; close the client and cluster this object opened."""
        self.cancel()
        if self.owns_client:
            try:
                self.client.close()
            finally:
                _close(self.cluster)


def _close(cluster) -> None:
    if cluster is not None:
        cluster.close()
