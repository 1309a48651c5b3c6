"""The body of one layer task (or of a stack of same-shape layers): read the inputs, solve,
publish each layer file write-once.

The same function runs in-process (``client=None``) and on Dask workers, so the two give the
same bytes. Errors in the *inputs or settings* (bad shapes, NaNs, an indefinite factor, a missing
tensor) are returned as ``status="failed"`` records instead of raised: retrying them elsewhere
cannot help. Anything else (out of memory, a CUDA error, an I/O error) is raised, so that Dask's
``retries`` can run the task again on another worker.
"""
from __future__ import annotations

import os
import socket
import time
import traceback

import numpy as np

from .._lib.errors import InputError
from ..solvers.options import environment
from ._jobs import LayerJob, canonical_settings, load_tensor
from ._outputs import layer_path, now_iso, verify_layer_file, write_layer_file

__all__ = ["run_job", "run_stack", "InputError"]

#: exceptions that mean "this layer's inputs or settings are bad": reported, not retried
_INPUT_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, IsADirectoryError)


def _worker_info() -> dict:
    info = {"host": socket.gethostname(), "pid": os.getpid(), "worker": "in-process"}
    try:
        from distributed import get_worker

        info["worker"] = get_worker().address
    except Exception:  # not inside a Dask worker (or distributed not installed)
        pass
    return info


def _cuda_available() -> bool:
    vis = environment("CUDA_VISIBLE_DEVICES")
    if vis is not None and vis.strip() in ("", "-1"):
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _device(setting: str):
    """(xp module or None for numpy, description)."""
    if setting == "cpu" or (setting == "auto" and not _cuda_available()):
        return None, "cpu"
    if setting == "gpu" and not _cuda_available():
        raise RuntimeError("device='gpu' but this worker sees no CUDA device (cupy missing or "
                           f"CUDA_VISIBLE_DEVICES={environment('CUDA_VISIBLE_DEVICES')!r})")
    import cupy

    dev = cupy.cuda.Device()
    vis = environment("CUDA_VISIBLE_DEVICES") or ""
    try:
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    except Exception:
        name = "GPU"
    return cupy, f"cuda:{dev.id} ({name}; CUDA_VISIBLE_DEVICES={vis or 'unset'})"


def _as_sym(a: np.ndarray, n: int, what: str, allow_diag: bool):
    """A factor as (dense matrix or None, diagonal vector or None)."""
    from ..factor_files import unpack_upper

    if a.ndim == 2:
        if a.shape != (n, n):
            raise InputError(f"{what} has shape {a.shape} but W needs {n} x {n}")
        return a, None
    if a.ndim == 1:
        if a.shape[0] == n * (n + 1) // 2 and n > 1:
            return unpack_upper(a, n), None
        if a.shape[0] == n and allow_diag:
            return None, a
        raise InputError(f"{what} is 1-D of length {a.shape[0]}: neither a packed triangle "
                         f"({n * (n + 1) // 2}) nor{' a diagonal' if allow_diag else ''} ({n})")
    raise InputError(f"{what} must be a matrix, a packed triangle or a diagonal, got shape "
                     f"{a.shape}")


def run_job(job: LayerJob, out_dir: str, file_stem: str, key: str,
            checksums: dict | None = None) -> dict:
    """Run one layer job; see the module docstring. Returns a JSON-friendly record."""
    t_start = time.perf_counter()
    info = _worker_info()
    rec = {"name": job.name, "key": key, **info, "started": now_iso()}
    done = _published(job, out_dir, file_stem, key, rec, t_start)
    if done is not None:  # a twin (or an earlier attempt on a worker that then died) wrote it
        return done
    try:
        return _solve_and_write(job, out_dir, file_stem, key, checksums, rec, t_start)
    except _INPUT_ERRORS as exc:
        return dict(rec, status="failed", error=f"{type(exc).__name__}: {exc}",
                    traceback=traceback.format_exc(limit=6), finished=now_iso(),
                    seconds=time.perf_counter() - t_start)


def _f(x):
    return None if x in (None, "None", "") else float(x)


def run_stack(jobs: list, out_dir: str, file_stems: list, keys: list,
              checksums: list | None = None) -> list[dict]:
    """Run a stack of same-shape layer jobs (one task): the layers whose file is already
    published are skipped, the others are read and solved as one stack
    (:func:`bakron.pipeline.quantize_arrays_stack`, each layer exactly as alone) and
    published one by one, write-once. Returns one record per job, as :func:`run_job` does.

    A layer whose inputs or settings are bad gets a ``failed`` record; any other error
    (out of memory, a CUDA or I/O error) is raised after the layers that did solve are
    published, so that a retry of the task redoes only the rest.
    """
    if len(jobs) == 1:
        return [run_job(jobs[0], out_dir, file_stems[0], keys[0],
                        None if checksums is None else checksums[0])]
    from ..pipeline import quantize_arrays_stack

    t_start = time.perf_counter()
    info = _worker_info()
    recs: list = [None] * len(jobs)
    todo, loaded = [], []
    for i, (job, stem, key) in enumerate(zip(jobs, file_stems, keys)):
        rec = {"name": job.name, "key": key, **info, "started": now_iso()}
        done = _published(job, out_dir, stem, key, rec, t_start)
        if done is not None:
            recs[i] = done
            continue
        try:
            loaded.append(_load(job, None if checksums is None else checksums[i]))
        except _INPUT_ERRORS as exc:
            recs[i] = _failed(rec, exc, t_start)
            continue
        todo.append((i, rec))
    if not todo:
        return recs
    s = canonical_settings(jobs[todo[0][0]].settings)
    xp, device = _device(s["device"])
    got = quantize_arrays_stack([(W, H_in, H_out) for W, H_in, H_out, _ in loaded], s,
                                xp=xp or np, one_sided=s["one_sided"], metrics="basic")
    del loaded
    share = (time.perf_counter() - t_start) / len(todo)
    retry = None
    for (i, rec), res in zip(todo, got):
        if isinstance(res, _INPUT_ERRORS):
            recs[i] = _failed(rec, res, t_start)
        elif isinstance(res, BaseException):
            retry = retry or res
        else:
            tensors, summary, _ = res
            recs[i] = _write(jobs[i], out_dir, file_stems[i], keys[i], rec, tensors, summary,
                             device, time.perf_counter() - share)
    if retry is not None:  # not the inputs' fault: let the task be retried
        raise retry
    return recs


def _published(job, out_dir, file_stem, key, rec, t_start):
    """The record of a layer whose valid file exists already, else ``None``."""
    file_format = canonical_settings(job.settings)["file_format"]
    ok, _, checksum, meta = verify_layer_file(layer_path(out_dir, file_stem, file_format), key)
    if not ok:
        return None
    return dict(rec, status="done", wrote=False, checksum=checksum,
                device=meta.get("device"), worker_written=meta.get("worker"),
                damp_in=_f(meta.get("damp_in")), damp_out=_f(meta.get("damp_out")),
                proxy_error=_f(meta.get("proxy_error")),
                rtn_proxy_error=_f(meta.get("rtn_proxy_error")),
                seconds=time.perf_counter() - t_start, finished=now_iso())


def _failed(rec, exc, t_start):
    return dict(rec, status="failed", error=f"{type(exc).__name__}: {exc}",
                traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__,
                                                             limit=6)),
                finished=now_iso(), seconds=time.perf_counter() - t_start)


def _load(job, checksums):
    """A job's inputs, checked: ``(W, H_in, H_out for the pipeline, (m, n))``."""
    s = canonical_settings(job.settings)
    W, cW = load_tensor(job.W)
    H_in, cI = load_tensor(job.H_in)
    H_out, cO = load_tensor(job.H_out) if job.H_out is not None else (None, None)
    if checksums is not None:  # the driver's key was made from these: refuse changed inputs
        for name, got in (("W", cW), ("H_in", cI), ("H_out", cO)):
            if name in checksums and checksums[name] != got:
                raise InputError(f"{name} ({getattr(job, name)}) changed since the run started "
                                 f"(checksum {got[:19]}... != {checksums[name][:19]}...)")
    if W.ndim != 2:
        raise InputError(f"W must be 2-D, got shape {W.shape}")
    m, n = W.shape
    if W.dtype not in (np.float16, np.float32, np.float64):  # half W: the pipeline computes in
        W = W.astype(np.float32)                              # float32 and records the dtype
    if s["dtype"] is not None:
        W = W.astype(s["dtype"])
    H_in, _ = _as_sym(H_in, n, "H_in", allow_diag=False)
    Ho_dense = Ho_diag = None
    if H_out is not None:
        Ho_dense, Ho_diag = _as_sym(H_out, m, "H_out", allow_diag=True)
    return W, H_in, Ho_diag if Ho_diag is not None else Ho_dense, (m, n)


def _solve_and_write(job, out_dir, file_stem, key, checksums, rec, t_start):
    from ..pipeline import quantize_arrays

    s = canonical_settings(job.settings)
    W, H_in, H_out, _ = _load(job, checksums)
    xp, device = _device(s["device"])
    tensors, summary, _ = quantize_arrays(W, H_in, H_out, s, xp=xp or np,
                                          one_sided=s["one_sided"], metrics="basic")
    return _write(job, out_dir, file_stem, key, rec, tensors, summary, device, t_start)


def _write(job, out_dir, file_stem, key, rec, tensors, summary, device, t_start):
    """Publish a solved layer write-once; its record."""
    from .. import __version__

    s = canonical_settings(job.settings)
    m, n = tensors["W_hat"].shape
    meta = {"name": job.name, "key": key, "bakron_version": __version__,
            "settings": canonical_settings(s), "shape": [m, n],
            "two_sided": summary["two_sided"], "h_out_diagonal": summary["h_out_diagonal"],
            "input_dtype": summary["input_dtype"],
            "worker": rec["worker"], "host": rec["host"], "device": device,
            "created": now_iso(), **{k: summary[k] for k in (
                "method", "engine", "proxy_error", "proxy_error_one_sided", "rtn_proxy_error",
                "damp_in", "damp_out", "seconds_factor", "seconds_solve")}}
    meta_s = {k: (v if isinstance(v, str) else _json(v)) for k, v in meta.items()}
    path, checksum, wrote = write_layer_file(
        out_dir, file_stem, tensors, meta_s,
        journal={"name": job.name, "key": key, "worker": rec["worker"], "pid": rec["pid"],
                 "host": rec["host"], "time": now_iso()}, file_format=s["file_format"])
    return dict(rec, status="done", wrote=wrote, checksum=checksum, device=device,
                damp_in=summary["damp_in"], damp_out=summary["damp_out"],
                proxy_error=summary["proxy_error"], rtn_proxy_error=summary["rtn_proxy_error"],
                method=summary["method"], engine=summary["engine"],
                seconds=time.perf_counter() - t_start, finished=now_iso())


def _json(v) -> str:
    import json

    return json.dumps(v, sort_keys=True)
