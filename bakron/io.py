"""Reading layer files, writing results, and atomic output (used by ``bakron quantize``).

Input layer files
-----------------
A layer file is ``.npz`` or ``.safetensors`` and holds

- ``W`` (m, n): the weights, float16/bfloat16/float32/float64 (float16 and bfloat16 are
  computed in float32);
- ``H_in`` (n, n): the input-side Hessian factor;
- ``H_out`` (m, m), optional: the output-side factor.

Other tensors are ignored (and listed in the report). A *layer folder* is a folder of such
files (not searched recursively); each file's name without its suffix is the layer name.

Output
------
:func:`atomic_output_dir` builds the output folder in a temporary folder next to it and
renames it into place only when everything has been written and flushed to disk, so an
interrupted run never leaves a partial output folder. :func:`read_tensors`,
:func:`write_tensors` and :func:`dequantize` are reusable by other runners.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _safetensors
from ._lib.errors import InputError, OutputExistsError
from .solvers.options import environment
from ._lib.fs import (atomic_write_bytes, atomic_write_json, atomic_write_text,
                      fsync_path as _fsync_path, umask as _umask)

__all__ = [
    "LAYER_SUFFIXES", "InputError", "OutputExistsError", "LayerInfo", "find_layer_files",
    "read_tensors", "read_layer", "validate_layer", "write_tensors", "dequantize",
    "atomic_output_dir", "atomic_write_bytes", "atomic_write_text", "atomic_write_json",
    "fsync_tree", "check_output_path", "array_module", "read_npz", "npz_names",
    "check_out_name", "is_bakron_output", "clean_stale_tmp",
]

LAYER_SUFFIXES = (".npz", ".safetensors")
FORMATS = ("safetensors", "npz")
_FLOATS = (np.float16, np.float32, np.float64)




# -- reading ------------------------------------------------------------------------------

def read_tensors(path) -> dict[str, np.ndarray]:
    """All arrays of an ``.npz`` or ``.safetensors`` file, as numpy arrays (never pickles).

    Raises :class:`InputError` with the path in the message when the file is missing,
    has another suffix, or cannot be parsed.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return read_npz(path)
    if suffix == ".safetensors":
        try:
            return _safetensors.load(path)
        except KeyError as exc:
            raise InputError(f"{path}: corrupt safetensors header (an entry has no {exc})") \
                from None
        except (ValueError, OSError) as exc:
            msg = str(exc)
            raise InputError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
        except (TypeError, AttributeError) as exc:
            raise InputError(f"{path}: corrupt safetensors header ({exc})") from None
    raise InputError(f"{path}: unsupported file type {path.suffix!r}; a layer file must end "
                     f"in {' or '.join(LAYER_SUFFIXES)}")


#: an npz member that expands to more than this many bytes ...
NPZ_CHECK_ABOVE = 64 * 2**20
#: ... is refused when it expands by more than this factor (a zip bomb), unless the environment
#: variable BAKRON_NPZ_MAX_MEMBER_BYTES allows that many bytes explicitly
NPZ_MAX_EXPANSION = 100


def _npz_member_limit() -> int | None:
    v = environment("BAKRON_NPZ_MAX_MEMBER_BYTES")
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise InputError(f"BAKRON_NPZ_MAX_MEMBER_BYTES must be a number of bytes, got {v!r}") \
            from None


def npz_names(path) -> list[str]:
    """The array names in an ``.npz`` file (``InputError`` for anything that is not one)."""
    return [n[:-4] if n.endswith(".npy") else n for n in _npz_infos(Path(path))[1]]


def _npz_infos(path: Path):
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if magic[:2] != b"PK":  # np.load would try to unpickle anything that is not a zip/npy
        raise InputError(f"{path}: not a readable .npz file (it is not a zip archive)")
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError,
            NotImplementedError) as exc:
        raise InputError(f"{path}: not a readable .npz file ({exc})") from None
    return infos, [i.filename for i in infos]


def read_npz(path, names=None) -> dict[str, np.ndarray]:
    """Arrays of an ``.npz`` file (all, or those in ``names``), read with bounded memory.

    Never unpickles. Before a member is decompressed its declared size is checked: a member
    expanding more than :data:`NPZ_MAX_EXPANSION` times to over :data:`NPZ_CHECK_ABOVE` bytes
    is refused (a zip bomb), and the ``.npy`` header's shape x dtype must match the member's
    size, so nothing larger than the member is ever allocated. Every problem raises
    :class:`InputError` naming the file and the member.
    """
    path = Path(path)
    infos, _ = _npz_infos(path)
    limit = _npz_member_limit()
    out = {}
    try:
        with zipfile.ZipFile(path) as z:
            for info in infos:
                if not info.filename:   # zipfile's is_dir() fails on an empty name
                    raise InputError(f"{path}: a member of the archive has an empty name")
                key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                if names is not None and key not in names:
                    continue
                if info.is_dir():
                    continue
                size, packed = info.file_size, max(info.compress_size, 1)
                if limit is not None:
                    if size > limit:
                        raise InputError(f"{path}: member {key!r} expands to {size} bytes, more "
                                         f"than BAKRON_NPZ_MAX_MEMBER_BYTES={limit}")
                elif size > NPZ_CHECK_ABOVE and size > NPZ_MAX_EXPANSION * packed:
                    raise InputError(
                        f"{path}: member {key!r} expands from {packed} to {size} bytes "
                        f"(x{size // packed}; the limit is x{NPZ_MAX_EXPANSION} above "
                        f"{NPZ_CHECK_ABOVE} bytes): refused as a possible zip bomb; set "
                        f"BAKRON_NPZ_MAX_MEMBER_BYTES to allow it")
                with z.open(info) as f:
                    out[key] = _read_npy_member(f, size, path, key)
    except InputError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError,
            RuntimeError) as exc:  # RuntimeError: encrypted members
        raise InputError(f"{path}: not a readable .npz file ({type(exc).__name__}: {exc})") \
            from None
    if names is not None:
        missing = [n for n in names if n not in out]
        if missing:
            raise InputError(f"{path}: no array named {missing[0]!r} (arrays: "
                             f"{sorted(out) or npz_names(path)})")
    return out


def _read_npy_member(f, size: int, path, key: str) -> np.ndarray:
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
    except ValueError:
        raise InputError(f"{path}: member {key!r} is not a .npy array") from None
    try:
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except ValueError as exc:
        raise InputError(f"{path}: member {key!r} has a corrupt .npy header ({exc})") from None
    if dtype.hasobject:
        raise InputError(f"{path}: member {key!r} holds Python objects, which cannot be read "
                         f"without pickle; store plain numeric arrays")
    count = 1
    for d in shape:
        count *= int(d)
    nbytes = count * dtype.itemsize
    body = size - f.tell()
    if body != nbytes:
        raise InputError(f"{path}: member {key!r} declares shape {tuple(shape)} of {dtype} "
                         f"({nbytes} bytes) but holds {body} bytes of data (truncated or "
                         f"corrupt)")
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise InputError(f"{path}: member {key!r} is truncated")
    arr = np.frombuffer(data, dtype=dtype, count=count)
    arr = arr.reshape(shape, order="F" if fortran else "C")
    return np.array(arr, copy=True)


def find_layer_files(path) -> list[tuple[str, Path]]:
    """``[(layer name, file)]`` for a layer file or a folder of layer files (sorted by name).

    A folder is not searched recursively; files with other suffixes and hidden files are
    skipped. Raises :class:`InputError` for a missing path, a folder without layer files, or
    two files with the same layer name (``a.npz`` and ``a.safetensors``).
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    if path.is_file():
        if path.suffix.lower() not in LAYER_SUFFIXES:
            raise InputError(f"{path}: unsupported file type {path.suffix!r}; a layer file must "
                             f"end in {' or '.join(LAYER_SUFFIXES)}")
        return [(path.stem, path)]
    if not path.is_dir():
        raise InputError(f"{path}: neither a file nor a folder")
    found: dict[str, Path] = {}
    for p in sorted(path.iterdir()):
        if p.name.startswith(".") or not p.is_file() or p.suffix.lower() not in LAYER_SUFFIXES:
            continue
        if p.stem in found:
            raise InputError(f"{path}: two files for layer {p.stem!r} ({found[p.stem].name} and "
                             f"{p.name}); keep one")
        found[p.stem] = p
    if not found:
        raise InputError(f"{path}: folder holds no layer files (*.npz or *.safetensors)")
    return sorted(found.items())


@dataclass
class LayerInfo:
    """What :func:`validate_layer` found in a layer file."""

    name: str
    path: Path
    shape: tuple[int, int]
    dtype: str
    has_H_out: bool
    ignored: list[str] = field(default_factory=list)


def _check_float(path, key, a):
    if a.dtype not in _FLOATS:
        raise InputError(f"{path}: {key} must be a floating-point array (float16, bfloat16, "
                         f"float32 or float64), got dtype {a.dtype}")


def _check_finite(path, key, a):
    if not np.all(np.isfinite(a)):
        bad = int(np.count_nonzero(~np.isfinite(a)))
        raise InputError(f"{path}: {key} contains {bad} NaN or Inf entr"
                         f"{'y' if bad == 1 else 'ies'}")


def _check_factor(path, key, H, size, what, other_key, other_size):
    if H.ndim != 2 or H.shape[0] != H.shape[1]:
        raise InputError(f"{path}: {key} must be a square 2-D array, got shape {H.shape}")
    if H.shape[0] != size:
        hint = ""
        if H.shape[0] == other_size and size != other_size:
            hint = f"; it matches the other side: are {key} and {other_key} swapped?"
        raise InputError(f"{path}: {key} has shape {H.shape} but W has {size} {what}, so {key} "
                         f"must be {size} x {size}{hint}")
    _check_float(path, key, H)
    _check_finite(path, key, H)
    H64 = H.astype(np.float64)
    big = float(np.max(np.abs(H64)))
    asym = float(np.max(np.abs(H64 - H64.T)))
    if asym > 1e-5 * max(big, 1e-300):
        raise InputError(f"{path}: {key} is not symmetric (max |{key} - {key}.T| = {asym:.3g}, "
                         f"largest entry {big:.3g}); a Hessian factor must be symmetric")
    if np.any(np.diagonal(H64) < 0):
        raise InputError(f"{path}: {key} has negative diagonal entries: it is not positive "
                         f"semi-definite")
    if not np.any(np.diagonal(H64) > 0):
        raise InputError(f"{path}: {key} has an all-zero diagonal: there is no signal to weigh "
                         f"the errors by")


def validate_layer(tensors: dict, path, name: str | None = None) -> LayerInfo:
    """Check the arrays of one layer file; raise :class:`InputError` naming file and tensor."""
    path = Path(path)
    for key in ("W", "H_in"):
        if key not in tensors:
            have = ", ".join(sorted(tensors)) or "nothing"
            raise InputError(f"{path}: missing tensor {key!r} (a layer file needs 'W' and "
                             f"'H_in', optionally 'H_out'; found: {have})")
    W = tensors["W"]
    if W.ndim != 2:
        raise InputError(f"{path}: W must be a 2-D array (outputs x inputs), got shape {W.shape}")
    if 0 in W.shape:
        raise InputError(f"{path}: W is empty (shape {W.shape})")
    _check_float(path, "W", W)
    _check_finite(path, "W", W)
    m, n = W.shape
    _check_factor(path, "H_in", tensors["H_in"], n, "columns (inputs)", "H_out", m)
    has_out = "H_out" in tensors
    if has_out and tensors["H_out"].ndim == 1:  # the diagonal of a diagonal H_out
        h = tensors["H_out"]
        if h.shape[0] != m:
            raise InputError(f"{path}: H_out is a vector of length {h.shape[0]} (a diagonal "
                             f"H_out) but W has {m} rows")
        _check_float(path, "H_out", h)
        _check_finite(path, "H_out", h)
        if np.any(h < 0) or not np.any(h > 0):
            raise InputError(f"{path}: H_out (a diagonal) must be >= 0 with a positive entry")
    elif has_out:
        _check_factor(path, "H_out", tensors["H_out"], m, "rows (outputs)", "H_in", n)
    ignored = sorted(k for k in tensors if k not in ("W", "H_in", "H_out"))
    return LayerInfo(name=name or path.stem, path=path, shape=(m, n), dtype=str(W.dtype),
                     has_H_out=has_out, ignored=ignored)


def read_layer(path, name: str | None = None) -> tuple[dict, LayerInfo]:
    """Read and validate one layer file: ``({'W', 'H_in'[, 'H_out']}, LayerInfo)``.

    float16 arrays are returned as float32 (bfloat16 already is). The file is opened read-only.
    """
    tensors = read_tensors(path)
    info = validate_layer(tensors, path, name)
    if Path(path).suffix.lower() == ".safetensors":  # BF16 is read as float32: say what it was
        entry = _safetensors.read_header(path)[0].get("W") or {}
        if entry.get("dtype") == "BF16":
            info.dtype = "bfloat16"
    out = {}
    for k in ("W", "H_in", "H_out"):
        if k in tensors:
            a = tensors[k]
            out[k] = a.astype(np.float32) if a.dtype == np.float16 else a
    return out, info


# -- writing ------------------------------------------------------------------------------

def write_tensors(path, tensors: dict, fmt: str | None = None, metadata: dict | None = None):
    """Write numpy arrays to ``path`` as safetensors or npz (by ``fmt`` or the suffix).

    A plain write: call it inside :func:`atomic_output_dir` (or write to a temporary name
    and rename) when the result must appear atomically. ``metadata`` (strings) goes into the
    safetensors header; npz files store it as a JSON string array ``__metadata__``.
    """
    path = Path(path)
    fmt = fmt or path.suffix.lstrip(".").lower()
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if fmt == "safetensors":
        _safetensors.save(path, arrays, metadata)
    elif fmt == "npz":
        if metadata:
            arrays["__metadata__"] = np.array(json.dumps({str(k): str(v)
                                                          for k, v in metadata.items()}))
        with open(path, "wb") as f:  # a file object: np.savez must not append '.npz'
            np.savez(f, **arrays)
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def dequantize(codes, scale, zero_point=None, group_size: int | None = None, dtype=None):
    """Weights from stored codes: ``scale * (codes - zero_point)`` per element.

    ``scale`` (and ``zero_point``) are the 2-D tables that ``bakron quantize`` writes:
    ``(1, 1)`` per tensor, ``(m, 1)`` per row, ``(m, ceil(n / group_size))`` per group.
    With ``dtype`` equal to the stored weights' dtype this reproduces ``W_hat`` exactly.
    """
    codes = np.asarray(codes)
    scale = np.asarray(scale)
    dtype = np.dtype(dtype or scale.dtype)
    m, n = codes.shape

    def expand(t):
        t = np.asarray(t).astype(dtype)
        t = t.reshape(1, 1) if t.ndim == 0 else t
        if t.shape[1] > 1:  # per group: column j uses entry j // group_size
            if group_size is None:
                raise ValueError("a per-group table needs group_size")
            t = np.repeat(t, group_size, axis=1)[:, :n]
        return t

    c = codes.astype(dtype)
    s = expand(scale)
    return s * c if zero_point is None else s * (c - expand(zero_point))


def fsync_tree(root) -> None:
    """Flush every file and folder under ``root`` (and ``root`` itself) to disk."""
    root = Path(root)
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for f in files:
            _fsync_path(Path(dirpath) / f)
        _fsync_path(Path(dirpath), directory=True)


def check_output_path(out, inputs=()) -> Path:
    """Refuse an output path that is, or would contain, one of the input files.

    Returns the absolute output path; raises :class:`InputError` (so that a ``--force``
    replacement can never delete an input).
    """
    out_abs = Path(os.path.abspath(out))
    out_real = Path(os.path.realpath(out))
    for p in inputs:
        p_real = Path(os.path.realpath(p))
        if p_real == out_real or out_real in p_real.parents:
            raise InputError(f"output {out} would contain or replace the input {p}; choose "
                             f"another output folder")
    return out_abs


def check_out_name(out, what: str = "--out") -> Path:
    """The absolute output path, or :class:`InputError` for a name the file system cannot
    hold: a NUL byte, or a component too long once the temporary suffix is added."""
    text = os.fspath(out)
    if "\x00" in str(text):
        raise InputError(f"{what} {text!r} contains a NUL byte")
    out = Path(os.path.abspath(text))
    try:
        limit = os.pathconf(out.parent if out.parent.exists() else "/", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in out.parts:
        if len(os.fsencode(part)) > limit:
            raise InputError(f"{what}: the name {part[:40]!r}... is {len(os.fsencode(part))} "
                             f"bytes long; this file system allows {limit}")
    if len(os.fsencode(out.name)) + _TMP_EXTRA > limit:
        raise InputError(f"{what}: the name {out.name[:40]!r}... is too long to be built "
                         f"atomically (at most {limit - _TMP_EXTRA} bytes here)")
    return out


#: bytes the temporary name ``.NAME.tmp-<pid>-<random>`` adds to NAME
_TMP_EXTRA = 40
_TMP_MARKER = ".bakron-tmp.json"


def is_bakron_output(out) -> bool:
    """True for an empty folder or a folder that bakron wrote (it holds bakron's
    ``report.json`` or a distributed ``manifest.json``): the only folders ``--force``
    replaces."""
    out = Path(out)
    if not out.is_dir() or out.is_symlink():
        return False
    names = set(os.listdir(out))
    if not names:
        return True
    for fname, key, want in (("report.json", "tool", "bakron quantize"),
                             ("manifest.json", "format", "bakron-manifest")):
        if fname in names:
            try:
                with open(out / fname, "rb") as f:
                    doc = json.loads(f.read(1 << 20))
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and doc.get(key) == want:
                return True
    return False


def clean_stale_tmp(out) -> list[Path]:
    """Remove ``.NAME.tmp-*`` folders next to ``out`` that an earlier bakron run on this host
    left behind when it was killed (its process no longer exists). Returns what was removed."""
    import socket

    out = Path(os.path.abspath(out))
    removed = []
    try:
        cands = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")
                 or p.name.startswith(f".{out.name}.old-")]
    except OSError:
        return removed
    for p in cands:
        try:
            with open(p / _TMP_MARKER) as f:
                who = json.load(f)
        except (OSError, ValueError):
            continue  # not ours (or not readable): leave it
        if not isinstance(who, dict) or who.get("host") != socket.gethostname():
            continue
        pid = who.get("pid")
        if not isinstance(pid, int) or pid == os.getpid() or _pid_alive(pid):
            continue
        _remove(p)
        removed.append(p)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def _mark_tmp(tmp: Path) -> None:
    import socket

    with open(tmp / _TMP_MARKER, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)


@contextlib.contextmanager
def atomic_output_dir(out, *, force: bool = False):
    """Build the folder ``out`` atomically.

    Yields a fresh temporary folder next to ``out`` (same file system, hidden name
    ``.NAME.tmp-*``). When the ``with`` block ends normally, every file in it is flushed to
    disk and the folder is renamed to ``out``; if the block raises (or is interrupted), the
    temporary folder is removed and ``out`` is untouched. An existing ``out`` raises
    :class:`OutputExistsError` unless ``force=True`` *and* it is an empty folder or one that
    bakron wrote (:func:`is_bakron_output`); it is then replaced only after the new folder is
    complete (moved aside, then deleted). A process killed outright can leave a
    ``.NAME.tmp-*`` folder behind, never a partial ``out``; the next run removes it
    (:func:`clean_stale_tmp`).
    """
    out = check_out_name(out)

    def refuse_existing():
        if not (out.exists() or out.is_symlink()):
            return
        if not force:
            raise OutputExistsError(f"{out} already exists; use --force to replace it")
        if not is_bakron_output(out):
            raise OutputExistsError(f"{out} exists and is not a bakron output folder (no bakron "
                                    f"report.json or manifest.json); it is never replaced, "
                                    f"even with --force: remove it yourself or choose another")

    refuse_existing()
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; OUT is an ordinary folder
        _mark_tmp(tmp)
        yield tmp
        os.unlink(tmp / _TMP_MARKER)
        fsync_tree(tmp)
        if out.exists() or out.is_symlink():
            refuse_existing()  # appeared, or changed, while we were working
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            _mark_tmp(old)
            os.rename(out, old / "old")
            os.rename(tmp, out)
            _remove(old)
        else:
            os.rename(tmp, out)
        _fsync_path(out.parent, directory=True)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# -- devices ------------------------------------------------------------------------------

def array_module(device: str = "auto"):
    """``(xp, name)`` for ``device`` in ``auto | cpu | gpu``.

    ``cpu`` is numpy; ``gpu`` is cupy and raises ``RuntimeError`` when cupy or a CUDA device is
    missing; ``auto`` is cupy when it imports and sees a device, else numpy.
    """
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")
    if device == "cpu":
        return np, "cpu"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy, "gpu"
        why = "cupy sees no CUDA device"
    except Exception as exc:  # ImportError, CUDA driver errors
        why = f"cupy is not usable ({type(exc).__name__}: {exc})"
    if device == "gpu":
        raise RuntimeError(f"device='gpu' but {why}; install bakron[cuda12] or bakron[cuda13] "
                           f"on a machine with a GPU, or use --device cpu")
    return np, "cpu"


def array_namespace(device: str = "auto"):
    """``(array-API namespace, "cpu" | "gpu")`` for ``device`` in ``auto | cpu | gpu``: the
    namespace of :func:`array_module`'s choice (array-api-compat's numpy or cupy wrapper),
    as the model pipelines (``quantize_model``, the demos, the Dask model jobs) compute in."""
    xp, dev = array_module(device)
    if dev == "gpu":
        import array_api_compat

        return array_api_compat.array_namespace(xp.zeros(1)), "gpu"
    import array_api_compat.numpy as xpn

    return xpn, "cpu"
