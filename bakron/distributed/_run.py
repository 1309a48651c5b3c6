"""The driver: ``run_layers`` (in-process or Dask tasks of one layer or a stack of same-shape
layers), resume, manifest."""
from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..layer_groups import STACK_MEMORY, stack_chunks
from ._jobs import (LayerJob, canonical_settings, job_key, safe_file_name, stack_key,
                    tensor_checksum)
from ._outputs import (OutputLock, clean_tmp, failure_record, layer_path, now_iso, quarantine,
                       read_manifest, verify_layer_file, write_manifest)
from ._task import run_job, run_stack

__all__ = ["run_layers", "RunResult", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_LOCKED",
           "EXIT_UNAVAILABLE", "EXIT_WRITE_FAILED", "EXIT_INTERRUPTED"]

#: exit codes of :func:`quantize_folder`, the same table as ``bakron quantize`` (bakron.cli);
#: 3 means here "OUT is held by another driver"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_LOCKED = 0, 1, 2, 3
EXIT_UNAVAILABLE, EXIT_WRITE_FAILED, EXIT_INTERRUPTED = 4, 5, 130

_RECORD_KEYS = ("key", "file", "checksum", "status", "worker", "device", "host", "pid",
                "seconds", "started", "finished", "damp_in", "damp_out", "proxy_error",
                "rtn_proxy_error", "method", "engine", "error", "traceback", "wrote", "reused",
                "stack")


@dataclass
class RunResult:
    """What :func:`run_layers` did.

    ``layers`` holds the manifest record of every job of this run; ``solved`` the layers whose
    file this run published, ``reused`` those whose valid output already existed (not
    submitted, or found by the task before solving), ``failed`` name -> error,
    ``quarantined`` name -> (reason, where the invalid file was moved), ``stacks`` the
    number of stacks (tasks, with a client) that ran the missing layers.
    """

    out_dir: str
    layers: dict = field(default_factory=dict)
    solved: list = field(default_factory=list)
    reused: list = field(default_factory=list)
    failed: dict = field(default_factory=dict)
    quarantined: dict = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False
    stacks: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.interrupted

    @property
    def exit_code(self) -> int:
        """0 when every layer is done, 1 when one or more failed (the others are written)."""
        return EXIT_OK if self.ok else EXIT_FAILED

    def summary(self) -> str:
        s = (f"{len(self.layers)} layers: {len(self.solved)} solved, {len(self.reused)} reused, "
             f"{len(self.failed)} failed")
        if self.quarantined:
            s += f", {len(self.quarantined)} invalid outputs redone"
        if self.stacks:
            s += f"; {self.stacks} stack{'s' if self.stacks != 1 else ''}"
        return s + f" ({self.seconds:.1f} s)"


def _record(rec: dict, file_rel: str, **extra) -> dict:
    out = {k: rec.get(k) for k in _RECORD_KEYS if k in rec}
    out["file"] = file_rel
    out.update(extra)
    return out


def _from_meta(meta: dict, key: str, checksum: str, file_rel: str) -> dict:
    def f(x):
        return None if x in (None, "None", "null", "") else float(x)
    return {"key": key, "file": file_rel, "checksum": checksum, "status": "done",
            "worker": meta.get("worker"), "device": meta.get("device"), "host": meta.get("host"),
            "finished": meta.get("created"), "damp_in": f(meta.get("damp_in")),
            "damp_out": f(meta.get("damp_out")), "proxy_error": f(meta.get("proxy_error")),
            "rtn_proxy_error": f(meta.get("rtn_proxy_error")), "method": meta.get("method"),
            "engine": meta.get("engine"),
            "seconds": f(meta.get("seconds_factor") or 0) + f(meta.get("seconds_solve") or 0)}


def _gpu_resource(client) -> dict | None:
    try:
        workers = client.scheduler_info(n_workers=-1)["workers"]
    except TypeError:  # older distributed
        workers = client.scheduler_info()["workers"]
    if any((w.get("resources") or {}).get("GPU") for w in workers.values()):
        return {"GPU": 1}
    return None


def _progress_printer(total: int):
    done = [0]

    def show(rec):
        done[0] += 1
        what = rec.get("status")
        if rec.get("status") == "done" and rec.get("wrote") is False:
            what = "done (already written)"
        extra = f" -- {rec.get('error')}" if rec.get("error") else ""
        sec = rec.get("seconds")
        print(f"[{done[0]}/{total}] {rec.get('name')}: {what}"
              f"{'' if sec is None else f' {sec:.2f} s'} on {rec.get('worker')}{extra}",
              file=sys.stderr, flush=True)
    return show


def run_layers(jobs: Iterable[LayerJob], out_dir, client=None, *, retries: int = 2,
               resources="auto", lock: bool = True,
               progress: bool | Callable[[dict], None] = False,
               manifest_interval: float = 1.0, tmp_grace: float = 30.0,
               stack_memory: int | None = STACK_MEMORY) -> RunResult:
    """Quantize every job into ``out_dir``: in-process, or Dask tasks of a layer or a stack.

    Parameters
    ----------
    jobs : iterable of LayerJob
        Unique names. Jobs name files; nothing big is pickled.
    out_dir : path
        Output folder (created). Holds ``layers/<name>.safetensors`` (``.npz`` for jobs with
        ``file_format="npz"``), ``manifest.json`` and
        ``.bakron/``; see docs/distributed.md.
    client : distributed.Client or None
        ``None`` runs the jobs one after the other in this process (the reference). With a
        client, each stack of missing layers is one task (``retries`` re-runs after an
        exception that is not an input error, skipping the layers already published; a dead
        worker's tasks are rescheduled by Dask).
    resources : "auto", dict or None
        Task resources. ``"auto"`` asks for ``{"GPU": 1}`` when some worker advertises a GPU
        resource (see :func:`gpu_cluster`), else none.
    lock : bool
        Take the output folder's driver lock (:class:`OutputLock`); ``LockHeld`` is raised
        when another driver holds it.
    progress : bool or callable
        Print one line per finished layer to stderr, or call ``progress(record)``.
    manifest_interval : float
        At most one manifest rewrite per this many seconds while running (always one at the
        end).
    tmp_grace : float
        At start, temporary files older than this are removed (leftovers of killed tasks).
    stack_memory : int or None
        Same-shape jobs with the same settings run as stacks
        (:func:`bakron.layer_groups.stack_chunks`) of at most this many estimated bytes; with
        a client, each such group is also cut into at least two stacks per worker, so that
        every worker gets work. ``None``: one layer per task. Outputs do not depend on it.

    Returns
    -------
    RunResult
        ``exit_code`` is 0 when every layer is done, 1 when some failed; failures never stop
        the other layers.
    """
    t0 = time.perf_counter()
    jobs = list(jobs)
    seen: dict[str, str] = {}
    stems: dict[str, str] = {}
    for j in jobs:
        if not isinstance(j, LayerJob):
            raise TypeError(f"jobs must be LayerJob objects, got {type(j).__name__}")
        if j.name in seen:
            raise ValueError(f"two jobs are named {j.name!r}")
        stem = safe_file_name(j.name)
        if stem.lower() in stems:
            raise ValueError(f"jobs {stems[stem.lower()]!r} and {j.name!r} map to the same file "
                             f"name {stem!r}")
        seen[j.name] = stem
        stems[stem.lower()] = j.name
    fmt_of = {j.name: canonical_settings(j.settings)["file_format"] for j in jobs}
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(os.path.join(out_dir, "layers"), exist_ok=True)
    guard = (os.path.join(out_dir, "layers") + os.sep, os.path.join(out_dir, ".bakron") + os.sep)
    for j in jobs:
        for ref in j.inputs().values():
            if ref.path.startswith(guard):
                raise ValueError(f"input {ref.path} lies inside the output folder's managed "
                                 f"area; move it out of {out_dir}")
    show = _progress_printer(len(jobs)) if progress is True else (progress or None)

    lk = OutputLock(out_dir).acquire() if lock else None
    result = RunResult(out_dir=out_dir)
    records: dict = {}
    try:
        old = read_manifest(out_dir) or {"layers": {}}
        records.update(old["layers"])
        clean_tmp(out_dir, tmp_grace)
        pending = []
        for j in jobs:
            stem = seen[j.name]
            rel = os.path.relpath(layer_path(out_dir, stem, fmt_of[j.name]), out_dir)
            try:
                checks = {k: tensor_checksum(r) for k, r in j.inputs().items()}
                key = job_key(j, checks)
            except Exception as exc:  # a missing or unreadable input fails this layer only
                err = f"{type(exc).__name__}: {exc}"
                records[j.name] = {"status": "failed", "file": rel, "key": None, "error": err,
                                   "finished": now_iso(), "worker": "driver"}
                result.failed[j.name] = err
                if show:
                    show(dict(records[j.name], name=j.name))
                continue
            prev = old["layers"].get(j.name) or {}
            expect = prev.get("checksum") if (prev.get("key") == key
                                              and prev.get("status") == "done") else None
            path = layer_path(out_dir, stem, fmt_of[j.name])
            if os.path.exists(path):
                ok, why, cs, meta = verify_layer_file(path, key, expect)
                if ok:
                    rec = dict(prev, status="done", reused=True, wrote=False, error=None) \
                        if expect else _from_meta(meta, key, cs, rel)
                    rec["reused"] = True
                    records[j.name] = rec
                    result.reused.append(j.name)
                    continue
                result.quarantined[j.name] = (why, quarantine(out_dir, path))
            records[j.name] = {"status": "pending", "key": key, "file": rel}
            pending.append((j, stem, key, checks, rel))
        write_manifest(out_dir, records)
        last = [time.monotonic()]

        def finish(job_name: str, rel: str, rec: dict):
            rec = dict(rec, name=job_name)
            records[job_name] = _record(rec, rel, reused=rec.get("wrote") is False)
            if rec.get("status") == "done":
                (result.solved if rec.get("wrote") else result.reused).append(job_name)
            else:
                result.failed[job_name] = rec.get("error") or "failed"
            if show:
                show(rec)
            if time.monotonic() - last[0] >= manifest_interval:
                write_manifest(out_dir, records)
                last[0] = time.monotonic()

        try:
            parts = 1 if client is None else 2 * max(_n_workers(client), 1)
            chunks = _stacks(pending, stack_memory, parts)
            result.stacks = len(chunks)
            if client is None:
                for chunk in chunks:
                    for (j, stem, key, checks, rel), rec in zip(chunk, _run_here(chunk,
                                                                                 out_dir)):
                        finish(j.name, rel, dict(rec, stack=len(chunk)))
            else:
                _run_dask(client, chunks, out_dir, retries, resources, finish)
        except KeyboardInterrupt:
            result.interrupted = True
            raise
        finally:
            write_manifest(out_dir, records)
        if not result.interrupted:
            clean_tmp(out_dir, 0.0)
    finally:
        if lk is not None:
            lk.release()
        result.layers = {j.name: records.get(j.name) for j in jobs}
        result.seconds = time.perf_counter() - t0
    return result


def _n_workers(client) -> int:
    try:
        return len(client.scheduler_info(n_workers=-1)["workers"])
    except TypeError:  # older distributed
        return len(client.scheduler_info()["workers"])


def _stacks(pending, stack_memory, parts) -> list[list]:
    """``pending`` cut into stacks of same-key jobs (:func:`stack_key`); one job each when
    ``stack_memory`` is None. A job whose key cannot be read runs alone (its task reports
    why)."""
    if stack_memory is None:
        return [[p] for p in pending]
    keys, sizes = [], []
    for p in pending:
        try:
            k, b = stack_key(p[0])
        except Exception:  # noqa: BLE001 - the task reads the inputs again and says why
            k, b = ("alone", p[0].name), 1
        keys.append(k)
        sizes.append(b)
    return [[pending[i] for i in c] for c in stack_chunks(keys, sizes, stack_memory, parts)]


def _stack_args(chunk):
    return ([c[0] for c in chunk], [c[1] for c in chunk], [c[2] for c in chunk],
            [c[3] for c in chunk])


def _run_here(chunk, out_dir) -> list[dict]:
    """Records of a stack run in this process; a stack that raises is run layer by layer,
    and a layer that raises gets a ``failed`` record."""
    if len(chunk) > 1:
        try:
            jobs, stems, keys, checks = _stack_args(chunk)
            return run_stack(jobs, out_dir, stems, keys, checks)
        except Exception:  # noqa: BLE001 - each layer alone says which one fails
            pass
    recs = []
    for j, stem, key, checks, rel in chunk:
        try:
            rec = run_job(j, out_dir, stem, key, checks)
        except Exception as exc:
            rec = {"status": "failed", "key": key, "worker": "in-process",
                   "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc(limit=6), "finished": now_iso()}
        recs.append(rec)
    return recs


def _after_failure(out_dir, j, stem, key, rel, exc) -> dict:
    """A layer of a task that failed for good: done if an attempt published it (write-once
    files are checked, not trusted), else failed with the task's exception."""
    path = layer_path(out_dir, stem, canonical_settings(j.settings)["file_format"])
    ok, _, cs, meta = verify_layer_file(path, key) if os.path.exists(path) else (
        False, None, None, None)
    if ok:
        return dict(_from_meta(meta, key, cs, rel), wrote=True)
    return failure_record(key, exc, worker=None)


def _run_dask(client, chunks, out_dir, retries, resources, finish):
    import hashlib

    from distributed import as_completed

    res = _gpu_resource(client) if resources == "auto" else resources
    futs = {}
    for chunk in chunks:
        if len(chunk) == 1:
            j, stem, key, checks, rel = chunk[0]
            f = client.submit(run_job, j, out_dir, stem, key, checks,
                              key=f"bakron-layer-{key[:16]}-{stem}", retries=retries,
                              resources=res, pure=False)
        else:
            digest = hashlib.sha256("".join(c[2] for c in chunk).encode()).hexdigest()[:16]
            jobs, stems, keys, checks = _stack_args(chunk)
            f = client.submit(run_stack, jobs, out_dir, stems, keys, checks,
                              key=f"bakron-stack-{digest}-{stems[0]}", retries=retries,
                              resources=res, pure=False)
        futs[f] = chunk
    try:
        for f in as_completed(list(futs)):
            chunk = futs[f]
            recs = None
            if f.status == "finished":
                try:
                    recs = f.result()
                    recs = [recs] if isinstance(recs, dict) else recs
                except Exception as exc:  # pragma: no cover - status said finished
                    recs = [failure_record(c[2], exc, worker=None) for c in chunk]
            elif len(chunk) == 1:
                recs = [failure_record(chunk[0][2], f.exception(), worker=None)]
            else:
                exc = f.exception()
                recs = [_after_failure(out_dir, j, stem, key, rel, exc)
                        for j, stem, key, checks, rel in chunk]
            f.release()
            for (j, stem, key, checks, rel), rec in zip(chunk, recs):
                finish(j.name, rel, dict(rec, stack=len(chunk)))
    except BaseException:
        client.cancel(list(futs))
        raise
