"""Atomic file writes: a temporary file in the same folder, fsync, rename, fsync the folder.

Every temporary name contains :data:`TMP_MARK` (``".tmp-"``), so that cleaners can recognise
leftovers of a killed writer.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["TMP_MARK", "fsync_path", "atomic_path", "atomic_write_bytes", "atomic_write_text",
           "atomic_write_json", "jsonable", "umask"]

TMP_MARK = ".tmp-"


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
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # a failure here (disk full, I/O error) must reach the caller
        finally:
            os.close(fd)
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
