"""Atomic file writes: a temporary file in the same folder, fsync, rename, fsync the folder;
write-once publication (link without replace), durable appends, checksums.

Every temporary name contains :data:`TMP_MARK` (``".tmp-"``), so that cleaners can recognise
leftovers of a killed writer. The file mechanics of bakron's outputs live here: the reports
and manifests, the factor files, and the write-once layer files of ``bakron quantize-model``
and the Dask runner (:mod:`bakron.distributed._outputs` keeps only their format and checks).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np

__all__ = ["TMP_MARK", "fsync_path", "fsync_file", "fsync_dir", "atomic_path",
           "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "append_json_row",
           "atomic_save_tensors",
           "tmp_name", "is_tmp_name", "publish_once", "write_once", "append_durable",
           "sha256_file", "jsonable", "umask"]

TMP_MARK = ".tmp-"

_CHUNK = 8 * 2**20


def umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def fsync_path(path, directory: bool = False) -> None:
    """fsync a file or (``directory=True``) a folder; a no-op where the platform refuses."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path) -> None:
    """fsync a file; unlike :func:`fsync_path` a failure (disk full, I/O error) raises."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path) -> None:
    """fsync a directory so that a rename in it survives a crash (no-op where unsupported)."""
    fsync_path(path, directory=True)


def tmp_name(final: str) -> str:
    """A unique temporary name next to ``final`` (same directory, so ``rename`` is atomic)."""
    return f"{final}{TMP_MARK}{uuid.uuid4().hex}"


def is_tmp_name(name: str) -> bool:
    return TMP_MARK in os.path.basename(name)


@contextlib.contextmanager
def atomic_path(path, *, before_replace=None):
    """Yield a temporary path beside ``path`` for the block to write; then flush it to disk,
    rename it over ``path`` and flush the folder: readers see the old file or the whole new
    one.

    The temporary file ``.NAME.tmp-*`` lives in the same folder (so the rename is atomic) and
    gets the permissions of an ordinary new file (umask applied). ``before_replace()``, when
    given, runs just before the rename and may raise (e.g. ``path`` appeared meanwhile). On any
    error (or interrupt) the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes it private
        yield Path(tmp)
        fsync_file(tmp)  # a failure here (disk full, I/O error) must reach the caller
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent, directory=True)


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path, text: str) -> None:
    """:func:`atomic_write_bytes` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path, obj, *, sort_keys: bool = False) -> None:
    """:func:`atomic_write_text` of ``obj`` as indented JSON (non-finite floats as null)."""
    atomic_write_text(path, json.dumps(jsonable(obj), indent=2, allow_nan=False,
                                       sort_keys=sort_keys) + "\n")


def append_json_row(path, row) -> None:
    """Append ``row`` to the JSON list in ``path`` (created when missing) and write the list
    back atomically, so that a killed run leaves the rows written before it (the experiment
    scripts' result files)."""
    path = Path(path)
    rows = json.loads(path.read_text()) if path.exists() else []
    if not isinstance(rows, list):
        raise ValueError(f"{path}: not a JSON list of rows")
    atomic_write_json(path, rows + [row])


def atomic_save_tensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write a safetensors file atomically (temporary name, fsync, rename, fsync folder)."""
    from .. import _safetensors

    path = os.fspath(path)
    tmp = tmp_name(path)
    try:
        _safetensors.save(tmp, tensors, metadata)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def publish_once(tmp: str, final: str) -> bool:
    """Give the finished, fsynced file ``tmp`` the name ``final`` unless ``final`` exists.

    Uses ``link`` + ``unlink`` (an atomic "rename without replace"): returns ``True`` when this
    call created ``final``, ``False`` when ``final`` already existed (``tmp`` is then left for the
    caller to decide). File systems without hard links fall back to ``os.replace`` after an
    existence check (atomic, but a concurrent twin could then replace an equal file).
    """
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                             errno.EMLINK, errno.ENOSYS):
            raise
        if os.path.exists(final):
            return False
        os.replace(tmp, final)
        fsync_dir(os.path.dirname(os.path.abspath(final)))
        return True
    _unlink_quiet(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    return True


def write_once(final: str, write, *, check=None, keep_existing=None) -> bool:
    """Publish a file write-once: ``write(tmp)`` writes it under a temporary name beside
    ``final``; it is fsynced, ``check(tmp)`` (when given) may refuse it by raising, then
    :func:`publish_once` gives it the name ``final``.

    When ``final`` exists already, ``keep_existing(final)`` decides: true keeps it and nothing
    is written (returns ``False``); false (or no ``keep_existing``) replaces it (an invalid
    leftover in the way). Returns ``True`` when this call published ``final``. The temporary
    file never outlives the call.
    """
    tmp = tmp_name(final)
    try:
        write(tmp)
        fsync_file(tmp)
        if check is not None:
            check(tmp)
        if not publish_once(tmp, final):
            if keep_existing is not None and keep_existing(final):
                return False
            os.replace(tmp, final)
            fsync_dir(os.path.dirname(final))
    finally:
        _unlink_quiet(tmp)
    return True


def append_durable(path: str, data: bytes, mode: int = 0o644) -> None:
    """Append ``data`` to ``path`` with one ``write`` (``O_APPEND``: concurrent appenders'
    records do not interleave on a local file system) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str) -> str:
    """``"sha256:<hex>"`` of a file's bytes (read in chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
    return "sha256:" + h.hexdigest()


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def jsonable(obj):
    """``obj`` with numpy scalars/arrays, paths and tuples turned into JSON types; NaN and
    infinities become ``None``."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if np.isfinite(f) else None
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    return obj
