"""File-system primitives: atomic writes, write-once publication, checksums, fsync.

Nothing here imports dask: these are shared by the driver, the tasks and :mod:`bakron.factor_files`.
"""
from __future__ import annotations

import errno
import hashlib
import os
import uuid

from .._lib.fs import TMP_MARK, atomic_write_bytes, fsync_path
from .._lib.fs import atomic_write_json as _atomic_write_json

__all__ = ["fsync_dir", "atomic_write_bytes", "atomic_write_json", "atomic_save_tensors",
           "publish_once", "sha256_file", "tmp_name", "is_tmp_name", "TMP_MARK"]

_CHUNK = 8 * 2**20


def tmp_name(final: str) -> str:
    """A unique temporary name next to ``final`` (same directory, so ``rename`` is atomic)."""
    return f"{final}{TMP_MARK}{uuid.uuid4().hex}"


def is_tmp_name(name: str) -> bool:
    return TMP_MARK in os.path.basename(name)


def fsync_dir(path: str) -> None:
    """fsync a directory so that a rename in it survives a crash (no-op where unsupported)."""
    fsync_path(path, directory=True)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: str, obj) -> None:
    """The manifest writer: :func:`bakron._lib.fs.atomic_write_json` with sorted keys."""
    _atomic_write_json(path, obj, sort_keys=True)


def atomic_save_tensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write a safetensors file atomically (temporary name, fsync, rename, fsync folder)."""
    from .. import _safetensors

    path = os.fspath(path)
    tmp = tmp_name(path)
    try:
        _safetensors.save(tmp, tensors, metadata)
        _fsync_file(tmp)
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


def sha256_file(path: str) -> str:
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
