"""Built-in calibration token sequences for a causal LM: text the model generates itself, the
Python Language Reference, or a mix of both.

The Hessian factors of :func:`bakron.hessian.global_factors` (labels drawn from the model) are
the Fisher of the KL to the model: an expectation over the model's *own* distribution of
text. Text sampled from the model at temperature 1 is that distribution, offline and
unlimited; the Language Reference sentences (CPython's ``pydoc_data``, calibration topics
only, see :func:`bakron.models.textdata.reference_split`) add real prose.

Generated sequences are cached under ``<cache>/calibration/`` (default ``$BAKRON_CACHE`` or
``~/.cache/bakron``), keyed on the model (the sha256 of its file, or of its weights for a
model built in memory), its dtype and array library, the seed, the sequence length, the
temperature and the prompt; a later call with the same key reads them back (and generates
only what a longer request adds). Files are written atomically.

Example
-------
>>> from bakron.models import load_llm
>>> from bakron.models.llm.calibration import calibration_ids
>>> lm = load_llm("smollm2")                                             # doctest: +SKIP
>>> seqs = calibration_ids(lm, 4096, mix="generated+docs", seed=0)      # 32 x 128 tokens
"""
from __future__ import annotations

import hashlib
import json
import math
import pathlib
import sys
import time

import numpy as np

from ... import _xp
from ..._validate import check_int

__all__ = ["MIXES", "calibration_ids", "generated_sequences", "model_fingerprint",
           "start_token"]

#: The accepted ``mix`` values.
MIXES = ("generated+docs", "generated", "docs")

_FORMAT = 1   # of the cache files; a change of the generation maths bumps it
_fingerprints: dict = {}


def model_fingerprint(lm) -> str:
    """sha256 identifying the model's weights: of its GGUF file, of a Hugging Face folder's
    ``config.json`` and ``*.safetensors`` files, or (a model built in memory) of its config
    and weight arrays."""
    from .._fetch import sha256_file

    src = pathlib.Path(lm.source) if getattr(lm, "source", "") else None
    if src is not None and (src.is_file() or src.is_dir()):
        files = [src] if src.is_file() else sorted(
            [p for p in src.iterdir() if p.suffix == ".safetensors" or p.name == "config.json"])
        stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
        if stamp not in _fingerprints:
            h = hashlib.sha256()
            for p in files:
                h.update(f"{p.name}:{sha256_file(p)}\n".encode())
            _fingerprints[stamp] = h.hexdigest()
        return _fingerprints[stamp]
    h = hashlib.sha256(repr(sorted(vars(lm.config).items())).encode())
    for k in sorted(lm.weights):
        a = np.ascontiguousarray(_xp.to_numpy(lm.weights[k]))
        h.update(f"{k}:{a.dtype}:{a.shape}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def start_token(lm) -> int | None:
    """The token sampling starts from without a prompt: the model's BOS, else its EOS, else
    ``None``."""
    cfg = getattr(lm, "config", None)
    for k in ("bos_id", "eos_id"):
        if getattr(cfg, k, None) is not None:
            return int(getattr(cfg, k))
    return None


def _start_prompt(lm, prompt) -> list[int]:
    if prompt is None:
        start = start_token(lm)
        if start is None:
            raise ValueError("the model has neither a BOS nor an EOS token to start generating "
                             "from; give prompt=[token ids]")
        return [int(start)]
    return lm._check_sequence(prompt, "prompt")


def _cache_file(lm, cache, settings) -> pathlib.Path:
    from .._fetch import cache_dir

    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir(cache) / "calibration" / f"generated-{key}.json"


def _read_cached(path, settings, vocab, seq_len, say) -> list[list[int]]:
    """The sequences of a cache file, or ``[]`` when it is missing or not a valid file of
    these settings (it is then regenerated)."""
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        seqs = data["sequences"]
        ok = (data.get("settings") == settings and isinstance(seqs, list)
              and all(isinstance(s, list) and len(s) == seq_len
                      and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                              for t in s) for s in seqs))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        say(f"calibration cache {path} is unreadable ({exc}); generating again")
        return []
    if not ok:
        say(f"calibration cache {path} does not hold valid sequences of these settings; "
            f"generating again")
        return []
    return seqs


def generated_sequences(lm, n_seqs: int, seq_len: int = 128, *, seed: int = 0,
                        temperature: float = 1.0, prompt=None, cache=None,
                        use_cache: bool = True, batch_size: int = 64,
                        progress: bool = False) -> list[list[int]]:
    """``n_seqs`` sequences of ``seq_len`` tokens sampled from the model itself.

    Each sequence is ``prompt`` (default: the BOS token, else EOS) followed by tokens drawn
    at ``temperature`` with :meth:`~bakron.models.llm.CausalLM.generate` (no early stop: a
    sampled EOS is kept and generation goes on). Sequence ``i`` draws from
    ``numpy.random.default_rng((seed, i))``, so a longer request extends a shorter one.
    With ``use_cache`` the sequences are read from / written to the cache folder (see the
    module's docstring); ``batch_size`` sequences are generated at a time (larger batches
    share each step's weight reads; the key/value cache holds about 46 kB per token for
    SmolLM2-135M in float32); ``progress`` reports on stderr.
    """
    from .generate import _generate_many

    n_seqs = check_int(n_seqs, "n_seqs", minimum=1)
    seq_len = check_int(seq_len, "seq_len", minimum=2)
    seed = check_int(seed, "seed", minimum=0)
    temperature = float(temperature)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    start = _start_prompt(lm, prompt)
    if len(start) >= seq_len:
        raise ValueError(f"the prompt has {len(start)} tokens; seq_len={seq_len} leaves no "
                         f"room to generate")
    if seq_len > lm.config.max_positions:
        raise ValueError(f"seq_len={seq_len} is longer than the model's context of "
                         f"{lm.config.max_positions}")

    def say(msg):
        if progress:
            print(msg, file=sys.stderr, flush=True)

    settings = {"format": _FORMAT, "model": model_fingerprint(lm), "dtype": lm.dtype,
                "xp": getattr(lm.xp, "__name__", str(lm.xp)), "seed": seed,
                "seq_len": seq_len, "temperature": temperature, "prompt": start}
    path = _cache_file(lm, cache, settings) if use_cache else None
    have = _read_cached(path, settings, lm.config.vocab_size, seq_len, say) if use_cache else []
    if len(have) >= n_seqs:
        return [list(s) for s in have[:n_seqs]]
    todo = list(range(len(have), n_seqs))
    t0 = time.perf_counter()
    say(f"generating {len(todo)} calibration sequences of {seq_len} tokens from the model ...")

    def report(done, total):
        dt = time.perf_counter() - t0
        say(f"  {done}/{total} sequences, {done * (seq_len - len(start)) / dt:.1f} tokens/s")

    new, _ = _generate_many(lm, [start] * len(todo), seq_len - len(start),
                            [(seed, i) for i in todo], stops=frozenset(), greedy=False,
                            temperature=temperature,
                            batch_size=check_int(batch_size, "batch_size", minimum=1),
                            progress=report if progress else None)
    seqs = [list(s) for s in have] + [start + [int(t) for t in s] for s in new]
    if use_cache:
        from ..._lib.fs import atomic_write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"settings": settings, "sequences": seqs}))
    return seqs


def calibration_ids(lm, n_tokens: int = 4096, mix: str = "generated+docs", *,
                    seq_len: int = 128, seed: int = 0, generated_share: float = 0.5,
                    docs=None, cache=None, use_cache: bool = True, batch_size: int = 64,
                    progress: bool = False) -> list[list[int]]:
    """Calibration token sequences: ``round(n_tokens / seq_len)`` sequences of ``seq_len``
    tokens (at least one).

    Parameters
    ----------
    lm : CausalLM
    n_tokens : int
        Total tokens asked for.
    mix : {"generated+docs", "generated", "docs"}
        ``generated``: text sampled from the model (:func:`generated_sequences`, temperature
        1, from BOS, cached); ``docs``: the sentences of ``docs`` (default: the Python
        Language Reference's calibration topics) tokenized and laid end to end with EOS
        between them, cut into ``seq_len`` pieces (fewer when the text runs out);
        ``generated+docs``: ``generated_share`` of the sequences (rounded up) generated, the
        rest from the documents; when the documents run out, generated sequences make up
        the count. Generated sequences come first.
    seed : int
        Seed of the generated part (the documents' part does not depend on it).
    docs : list of str, optional
        The documents of the ``docs`` part.
    cache, use_cache, batch_size, progress
        As in :func:`generated_sequences`.

    Deterministic for a seed: a cached generated part is reused bit for bit.
    """
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {', '.join(MIXES)}, got {mix!r}")
    n_tokens = check_int(n_tokens, "n_tokens", minimum=1)
    seq_len = check_int(seq_len, "seq_len", minimum=2)
    share = float(generated_share)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"generated_share must lie in [0, 1], got {generated_share!r}")
    n_seqs = max(1, round(n_tokens / seq_len))
    n_gen = {"generated": n_seqs, "docs": 0}.get(mix, math.ceil(share * n_seqs))
    doc_seqs = _doc_sequences(lm, docs, n_seqs - n_gen, seq_len) if n_seqs > n_gen else []
    if mix == "generated+docs":   # documents that run out: generated text makes up the rest
        n_gen = n_seqs - len(doc_seqs)
    out: list[list[int]] = []
    if n_gen:
        out += generated_sequences(lm, n_gen, seq_len, seed=seed, cache=cache,
                                   use_cache=use_cache, batch_size=batch_size,
                                   progress=progress)
    return out + doc_seqs


def calibration_sequences(lm, docs, n_seqs: int, seq_len: int) -> list[list[int]]:
    """``n_seqs`` token sequences of ``seq_len`` tokens cut from the documents' tokens laid end
    to end (EOS between documents when the model has one); fewer when the text runs out (the
    last one may be shorter, at least 2 tokens)."""
    stream: list[int] = []
    eos = getattr(lm.config, "eos_id", None)
    need = n_seqs * seq_len
    for ids in lm.tokenize(docs):
        stream.extend(ids)
        if eos is not None and 0 <= eos < lm.config.vocab_size:
            stream.append(int(eos))
        if len(stream) >= need:
            break
    seqs = [stream[i:i + seq_len] for i in range(0, min(len(stream), need), seq_len)]
    return [s for s in seqs if len(s) >= 2]


def _doc_sequences(lm, docs, n_seqs, seq_len):
    if docs is None:
        from ..textdata import reference_split

        docs = reference_split(0)[0]
    elif isinstance(docs, str) or not all(isinstance(d, str) for d in docs):
        raise TypeError("docs must be a list of strings")
    seqs = calibration_sequences(lm, list(docs), n_seqs, seq_len)
    if not seqs:
        raise ValueError("the documents give no sequence of at least 2 tokens")
    return seqs
