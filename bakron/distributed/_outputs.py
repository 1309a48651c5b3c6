"""Output folder: write-once layer files, their verification, the manifest and the lock.

Folder layout (see docs/distributed.md)::

    OUT/
      manifest.json            written only by the driver, atomically
      layers/<name>.safetensors  one per layer, write-once (``.npz`` with file_format="npz")
      .bakron/lock             the driver lock (an flock; the content only says who holds it)
      .bakron/writes.log       one line per layer file actually published (audit)
      .bakron/corrupt/         invalid layer files moved aside by a resuming driver
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import time
import traceback
import uuid

import numpy as np

from .._lib.fs import append_durable, atomic_write_json, is_tmp_name, sha256_file, write_once

__all__ = ["LAYER_FORMAT", "MANIFEST_FORMAT", "layer_path", "write_layer_file", "publish_tensors",
           "verify_layer_file", "read_manifest", "write_manifest", "OutputLock", "LockHeld",
           "append_journal", "read_journal", "quarantine", "clean_tmp"]

LAYER_FORMAT = "bakron-layer"
MANIFEST_FORMAT = "bakron-manifest"
FORMAT_VERSION = "1"
_CHUNK = 8 * 2**20


def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


#: layer file formats (the ``file_format`` setting); safetensors is the default
FILE_FORMATS = ("safetensors", "npz")


def layer_path(out_dir: str, file_stem: str, file_format: str = "safetensors") -> str:
    if file_format not in FILE_FORMATS:
        raise ValueError(f"file_format must be one of {FILE_FORMATS}, got {file_format!r}")
    return os.path.join(out_dir, "layers", f"{file_stem}.{file_format}")


def _meta_dir(out_dir: str) -> str:
    d = os.path.join(out_dir, ".bakron")
    os.makedirs(d, exist_ok=True)
    return d


# --------------------------------------------------------------------------------------------
# layer files


def _data_digest(tensors: dict) -> str:
    """sha256 of the data section exactly as _safetensors.save lays it out (sorted names)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dt = a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype
        h.update(memoryview(np.ascontiguousarray(a.astype(dt, copy=False))).cast("B"))
    return "sha256:" + h.hexdigest()


def write_layer_file(out_dir: str, file_stem: str, tensors: dict, metadata: dict,
                     journal: dict | None = None, file_format: str = "safetensors"
                     ) -> tuple[str, str, bool]:
    """Publish ``OUT/layers/<file_stem>.<file_format>`` write-once (see
    :func:`publish_tensors`). Returns ``(path, file_checksum, wrote)``.
    """
    final = layer_path(out_dir, file_stem, file_format)
    return publish_tensors(final, tensors, metadata, LAYER_FORMAT, out_dir=out_dir,
                           journal=journal, file_format=file_format)


def publish_tensors(final: str, tensors: dict, metadata: dict, fmt: str, *,
                    out_dir: str | None = None, journal: dict | None = None,
                    file_format: str = "safetensors") -> tuple[str, str, bool]:
    """Write a safetensors (or npz) file write-once: temporary name, fsync, link without
    replace. An npz file keeps the metadata as the JSON string member ``__metadata__``
    (as :func:`bakron.io.write_tensors` writes it).

    ``metadata`` must hold ``key``; ``format``, ``format_version`` (unless given),
    ``data_sha256`` and ``write_id`` are added. Returns ``(path, file_checksum, wrote)``: when
    a *valid* file with the same key already exists (a twin task got there first), nothing is
    written and ``wrote`` is False; an invalid file in the way (a corrupt leftover) is
    replaced. A published file is journaled in ``out_dir/.bakron/writes.log``.
    """
    from ..io import write_tensors

    os.makedirs(os.path.dirname(final), exist_ok=True)
    meta = dict(metadata)
    meta.setdefault("format_version", FORMAT_VERSION)
    meta.update(format=fmt, data_sha256=_data_digest(tensors), write_id=uuid.uuid4().hex)
    got: dict = {}

    def check(tmp):
        ok, _, got["checksum"], _ = verify_layer_file(tmp, meta["key"], fmt=fmt,
                                                      file_format=file_format)
        if not ok:  # pragma: no cover - would mean the writer itself is broken
            raise OSError(f"{tmp}: the file just written does not verify")

    def keep_existing(path):  # a valid twin got there first; an invalid leftover is replaced
        ok_old, _, got["old"], _ = verify_layer_file(path, meta["key"], fmt=fmt,
                                                     file_format=file_format)
        return ok_old

    if not write_once(final, lambda tmp: write_tensors(tmp, tensors, file_format, metadata=meta),
                      check=check, keep_existing=keep_existing):
        return final, got["old"], False
    checksum = got["checksum"]
    if journal is not None and out_dir is not None:
        append_journal(out_dir, dict(journal, file=os.path.relpath(final, out_dir),
                                     checksum=checksum, write_id=meta["write_id"]))
    return final, checksum, True


def verify_layer_file(path: str, key: str | None = None, checksum: str | None = None, *,
                      fmt: str = LAYER_FORMAT, file_format: str | None = None
                      ) -> tuple[bool, str, str | None, dict]:
    """Check a file written by :func:`publish_tensors`: it parses, has format ``fmt`` and
    ``key`` (when given), its data matches the ``data_sha256`` in its header and the whole
    file matches ``checksum`` (when given). Returns ``(ok, reason, file_checksum, metadata)``
    in one pass over the file (safetensors). ``file_format`` defaults to the path's suffix."""
    from .. import _safetensors

    if (file_format or ("npz" if str(path).lower().endswith(".npz") else "safetensors")) \
            == "npz":
        return _verify_npz(path, key, checksum, fmt)

    try:
        header, start = _safetensors.read_header(path)
    except FileNotFoundError:
        return False, "missing", None, {}
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        return False, f"unreadable header ({exc})", None, {}
    if not isinstance(header, dict):
        return False, "header is not a JSON object", None, {}
    meta = header.get("__metadata__") or {}
    if meta.get("format") != fmt:
        return False, f"not a {fmt} file (format {meta.get('format')!r})", None, meta
    if key is not None and meta.get("key") != key:
        return False, "key differs (inputs, settings or version changed)", None, meta
    try:
        end = max([info["data_offsets"][1] for k, info in header.items()
                   if k != "__metadata__"] + [0])
    except (KeyError, TypeError, IndexError):
        return False, "malformed tensor entries", None, meta
    size = os.path.getsize(path)
    if size != start + end:
        return False, f"size {size} != {start + end} (truncated or padded)", None, meta
    fh, dh = hashlib.sha256(), hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(start)
        fh.update(head)
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            fh.update(b)
            dh.update(b)
    file_sum = "sha256:" + fh.hexdigest()
    if "sha256:" + dh.hexdigest() != meta.get("data_sha256"):
        return False, "data checksum mismatch (corrupt data)", file_sum, meta
    if checksum is not None and checksum != file_sum:
        return False, "file checksum differs from the manifest", file_sum, meta
    return True, "ok", file_sum, meta


def _verify_npz(path: str, key, checksum, fmt) -> tuple[bool, str, str | None, dict]:
    """:func:`verify_layer_file` for an npz layer file (read with the bounded npz reader)."""
    from ..io import InputError, read_npz

    if not os.path.exists(path):
        return False, "missing", None, {}
    try:
        arrays = read_npz(path)
        meta = json.loads(str(arrays.pop("__metadata__")[()]))
    except (InputError, KeyError, ValueError, TypeError, OSError) as exc:
        return False, f"unreadable npz ({exc})", None, {}
    if not isinstance(meta, dict):
        return False, "metadata is not a JSON object", None, {}
    if meta.get("format") != fmt:
        return False, f"not a {fmt} file (format {meta.get('format')!r})", None, meta
    if key is not None and meta.get("key") != key:
        return False, "key differs (inputs, settings or version changed)", None, meta
    file_sum = sha256_file(path)
    if _data_digest(arrays) != meta.get("data_sha256"):
        return False, "data checksum mismatch (corrupt data)", file_sum, meta
    if checksum is not None and checksum != file_sum:
        return False, "file checksum differs from the manifest", file_sum, meta
    return True, "ok", file_sum, meta


def quarantine(out_dir: str, path: str) -> str | None:
    """Move an invalid layer file aside to ``.bakron/corrupt/`` (never deleted silently)."""
    if not os.path.exists(path):
        return None
    d = os.path.join(_meta_dir(out_dir), "corrupt")
    os.makedirs(d, exist_ok=True)
    dest = os.path.join(d, f"{os.path.basename(path)}.{time.strftime('%Y%m%dT%H%M%S')}-"
                           f"{uuid.uuid4().hex[:6]}")
    os.replace(path, dest)
    return dest


def clean_tmp(out_dir: str, older_than: float, sub: str = "layers") -> list[str]:
    """Remove temporary files under ``OUT/<sub>`` not modified for ``older_than`` seconds
    (leftovers of killed tasks; they are never read)."""
    d = os.path.join(out_dir, sub)
    removed = []
    if not os.path.isdir(d):
        return removed
    now = time.time()
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            if not is_tmp_name(f):
                continue
            try:
                if now - os.path.getmtime(p) >= older_than:
                    os.unlink(p)
                    removed.append(p)
            except OSError:
                pass
    return removed


# --------------------------------------------------------------------------------------------
# the write journal (audit: one line per publication)


def append_journal(out_dir: str, record: dict) -> None:
    line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
    # one write() with O_APPEND: lines do not interleave (local FS)
    append_durable(os.path.join(_meta_dir(out_dir), "writes.log"), line)


def read_journal(out_dir: str) -> list[dict]:
    p = os.path.join(out_dir, ".bakron", "writes.log")
    if not os.path.exists(p):
        return []
    out = []
    with open(p, "rb") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a torn last line after a crash
    return out


# --------------------------------------------------------------------------------------------
# manifest


def manifest_path(out_dir: str) -> str:
    return os.path.join(out_dir, "manifest.json")


def read_manifest(out_dir: str) -> dict | None:
    """The manifest, or ``None`` when there is none or it cannot be parsed (the layer files
    verify themselves, so a lost manifest loses no work)."""
    try:
        with open(manifest_path(out_dir), "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        return None
    if not isinstance(doc.get("layers"), dict):
        return None
    return doc


def write_manifest(out_dir: str, layers: dict, extra: dict | None = None) -> None:
    from .. import __version__

    counts: dict[str, int] = {}
    for rec in layers.values():
        counts[rec.get("status", "?")] = counts.get(rec.get("status", "?"), 0) + 1
    doc = {"format": MANIFEST_FORMAT, "format_version": FORMAT_VERSION,
           "bakron_version": __version__, "updated": now_iso(),
           "counts": counts, "layers": layers}
    if extra:
        doc.update(extra)
    atomic_write_json(manifest_path(out_dir), doc, sort_keys=True)


# --------------------------------------------------------------------------------------------
# the driver lock


class LockHeld(RuntimeError):
    """Another driver holds the output folder."""


class OutputLock:
    """An exclusive lock on an output folder for one driver.

    It is an ``flock`` on ``OUT/.bakron/lock``, held by an open file description: the kernel
    releases it when the driver exits or dies (SIGKILL, crash, node loss with an NFS lease
    expiry), so a stale lock cannot outlive its process. The file's content (host, pid, start
    time) only serves error messages; a leftover file with no lock on it is simply reused.
    Two ``OutputLock`` objects conflict even inside one process.
    """

    def __init__(self, out_dir: str):
        self.path = os.path.join(_meta_dir(out_dir), "lock")
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockHeld(f"{os.path.dirname(os.path.dirname(self.path))} is in use by "
                               f"another bakron driver ({self.holder() or 'unknown holder'}); "
                               f"wait for it to finish, or stop it (its lock is released when "
                               f"it exits)") from None
            if exc.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
                raise OSError(exc.errno, f"the file system of {self.path} does not support "
                                         f"flock; use a local or NFSv4 folder, or pass "
                                         f"lock=False at your own risk") from None
            raise
        info = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "since": now_iso()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        self._fd = fd
        return self

    def holder(self) -> str | None:
        try:
            with open(self.path) as f:
                d = json.loads(f.read() or "{}")
            return f"host {d.get('host')}, pid {d.get('pid')}, since {d.get('since')}"
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            try:
                os.ftruncate(self._fd, 0)
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def failure_record(key, exc, **extra) -> dict:
    """The manifest record of a task that failed with ``exc`` (``None``: no exception object)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=6)) \
        if exc is not None else ""
    return {"status": "failed", "key": key, **extra, "finished": now_iso(),
            "error": f"{type(exc).__name__}: {exc}", "traceback": tb}
