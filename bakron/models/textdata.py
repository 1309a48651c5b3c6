"""Text for calibration and evaluation.

* :func:`python_reference_sentences` — prose sentences of the Python Language Reference that
  ships with CPython (``pydoc_data.topics``, PSF licence): no download, always there.
  :func:`calibration_and_heldout` splits them *by topic* into a calibration pool and a
  held-out pool (no sentence and no topic is in both); :func:`reference_split` gives the
  two whole pools.
* :func:`fetch_lee` — the Lee news-similarity corpus (50 short news documents and the mean
  human similarity ratings of each of the 1225 pairs; Lee, Pincombe & Welsh, *An empirical
  evaluation of models of text document similarity*, CogSci 2005), taken at run time from the
  test data of the gensim 4.4.0 wheel (``gensim/test/test_data/lee.cor`` and
  ``similarities0-1.txt``), fetched with ``pip download --no-deps`` into the cache. It is never
  committed to this repository; without network it is simply unavailable.
* :func:`read_text_file` — a user's UTF-8 text file (``quantize-model --calib``,
  ``evaluate --text``), with errors that name the option and the file.
"""
from __future__ import annotations

import os
import pathlib
import random
import re
import tempfile
import zipfile

import numpy as np

from .._lib.errors import InputError
from .minilm import ModelUnavailableError, cache_dir, pip_download

__all__ = ["python_reference_sentences", "calibration_and_heldout", "reference_split",
           "fetch_lee", "read_text_file",
           "LeeCorpus", "LEE_SOURCE"]

LEE_SOURCE = ("Lee, Pincombe & Welsh (2005), 'An empirical evaluation of models of text "
              "document similarity', Proc. CogSci 2005; 50 documents and their 50x50 human "
              "similarity ratings as shipped in the test data of the gensim 4.4.0 wheel "
              "(gensim/test/test_data/lee.cor, similarities0-1.txt; gensim is LGPL-2.1), "
              "fetched at run time with `pip download --no-deps gensim==4.4.0` (the "
              "cp311 manylinux_2_28_x86_64 wheel, whatever the host) and never redistributed")

_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def read_text_file(path, option: str) -> str:
    """The text of the UTF-8 file ``path`` with ``\\r\\n`` line ends made ``\\n``;
    :class:`~bakron._lib.errors.InputError` naming ``option`` and the file when it is missing,
    not UTF-8 or holds only white space."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise InputError(f"{option} {path}: no such file (give a UTF-8 text file)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{option} {path}: not UTF-8 text ({exc})") from None
    if not text.strip():
        raise InputError(f"{option} {path}: the file holds no text")
    return text.replace("\r\n", "\n")


def _paragraphs(text: str):
    for para in re.split(r"\n\s*\n", text):
        lines = para.split("\n")
        if not lines or any(ln.startswith((" ", "\t")) for ln in lines if ln.strip()):
            continue  # grammar, code and indented examples
        if len(lines) >= 2 and set(lines[-1].strip()) <= set("*=-^~"):
            continue  # a heading
        yield " ".join(ln.strip() for ln in lines).strip()


def _good(s: str) -> bool:
    if not 40 <= len(s) <= 400 or s[-1] not in ".!?:":
        return False
    if len(s.split()) < 6:
        return False
    letters = sum(ch.isalpha() or ch == " " for ch in s)
    return letters >= 0.8 * len(s) and not s.startswith((">>>", "...", "*"))


def python_reference_sentences() -> dict[str, list[str]]:
    """``{topic: [sentences]}`` from ``pydoc_data.topics`` (prose only, deduplicated)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions split the stdlib
        raise RuntimeError("this Python has no pydoc_data module (part of CPython's standard "
                           "library; some Linux distributions package it separately)") from exc
    seen: set[str] = set()
    out: dict[str, list[str]] = {}
    for topic in sorted(topics):
        sents = []
        for para in _paragraphs(topics[topic]):
            for s in _SENT_SPLIT.split(para):
                s = s.strip()
                if _good(s) and s not in seen:
                    seen.add(s)
                    sents.append(s)
        if sents:
            out[topic] = sents
    return out


def calibration_and_heldout(n_calibration: int, n_heldout: int, *, seed: int = 0):
    """Two disjoint lists of sentences from the Python Language Reference.

    Topics are assigned to the held-out side in a fixed, seeded way (about a quarter of them);
    sentences are then drawn without replacement from each side with ``seed``. Raises
    ``ValueError`` when a side has fewer sentences than asked for.
    """
    rng, cal, held = _split(seed)
    if n_calibration > len(cal) or n_heldout > len(held):
        raise ValueError(f"asked for {n_calibration} calibration and {n_heldout} held-out "
                         f"sentences, but this Python's reference text has {len(cal)} and "
                         f"{len(held)}")
    return rng.sample(cal, n_calibration), rng.sample(held, n_heldout)


def reference_split(seed: int = 0) -> tuple[list[str], list[str]]:
    """All sentences of the calibration topics and all of the held-out topics: the two pools
    :func:`calibration_and_heldout` draws from with the same ``seed``."""
    _, cal, held = _split(seed)
    return cal, held


def _split(seed):
    by_topic = python_reference_sentences()
    topics = sorted(by_topic)
    rng = random.Random(seed)
    held_topics = set(rng.sample(topics, max(1, len(topics) // 4)))
    cal = [s for t in topics if t not in held_topics for s in by_topic[t]]
    held = [s for t in topics if t in held_topics for s in by_topic[t]]
    return rng, cal, held


class LeeCorpus:
    """The 50 Lee documents and the 1225 human pair ratings (upper triangle, row-major)."""

    def __init__(self, documents: list[str], ratings: np.ndarray, source: str):
        if len(documents) != 50 or ratings.shape != (50, 50):
            raise ValueError(f"the Lee corpus must have 50 documents and 50x50 ratings, got "
                             f"{len(documents)} and {ratings.shape}")
        self.documents = documents
        self.ratings = ratings
        self.source = source

    @property
    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        return np.triu_indices(50, 1)

    @property
    def human(self) -> np.ndarray:
        return self.ratings[self.pairs]

    def correlation(self, embeddings: np.ndarray) -> dict:
        """Pearson and Spearman correlation of embedding cosine similarities with the ratings."""
        E = np.asarray(embeddings, dtype=np.float64)
        E = E / np.linalg.norm(E, axis=1, keepdims=True)
        sims = (E @ E.T)[self.pairs]
        from scipy.stats import pearsonr, spearmanr

        return {"pearson": float(pearsonr(sims, self.human)[0]),
                "spearman": float(spearmanr(sims, self.human)[0])}


def fetch_lee(cache=None, *, timeout: float = 120.0) -> LeeCorpus:
    """Fetch (once) and read the Lee corpus from the gensim 4.4.0 wheel's test data.

    The wheel is downloaded with ``pip download --no-deps`` (a fixed platform tag, so the same
    file everywhere; nothing is installed) into ``<cache>/wheels``; only the two data files are
    extracted to ``<cache>/lee``. Raises :class:`ModelUnavailableError` when it cannot be had.
    """
    root = cache_dir(cache)
    folder = root / "lee"
    files = (folder / "lee.cor", folder / "similarities0-1.txt")
    if not all(f.is_file() for f in files):
        wheels = root / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        found = sorted(wheels.glob("gensim-4.4.0-*.whl"))
        if not found:
            with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
                got = pip_download("gensim==4.4.0", tmp, timeout=timeout, extra_args=(
                    "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
                    "--implementation", "cp"))
                os.replace(got, wheels / got.name)
                found = [wheels / got.name]
        folder.mkdir(parents=True, exist_ok=True)
        try:
            with zipfile.ZipFile(found[0]) as zf:
                for f in files:
                    data = zf.read(f"gensim/test/test_data/{f.name}")
                    fd, tmpname = tempfile.mkstemp(dir=folder, prefix=".tmp-")
                    with os.fdopen(fd, "wb") as out:
                        out.write(data)
                    os.replace(tmpname, f)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelUnavailableError(f"{found[0]} does not hold the Lee test data: {exc}") \
                from None
    return read_lee(folder)


def read_lee(folder) -> LeeCorpus:
    """Read ``lee.cor`` (latin-1, one document a line) and ``similarities0-1.txt``."""
    folder = pathlib.Path(folder)
    docs = [ln.strip() for ln in
            (folder / "lee.cor").read_bytes().decode("latin-1").splitlines() if ln.strip()]
    sim = np.loadtxt(folder / "similarities0-1.txt")
    sim = np.triu(sim) + np.triu(sim, 1).T   # the file holds the upper triangle
    return LeeCorpus(docs, sim, LEE_SOURCE)
