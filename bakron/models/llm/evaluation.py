"""Quality of a quantized causal LM against its original: the mean per-token
KL(original ‖ quantized) of the next-token distributions on held-out text, with the standard
error over texts (the measure of ``bakron demo --model smollm2`` and ``bakron evaluate``).

- :func:`evaluation_texts` — the demo's evaluation texts: the first documents of the Lee news
  corpus (another domain than the calibration text) and held-out sentences of the Python
  Language Reference (topics never used for calibration by the demo or by
  ``quantize-model --calib builtin``), each cut to ``max_tokens`` tokens;
- :func:`file_texts` — a user's own held-out text files, each cut into windows of tokens;
- :class:`EvalSet` — right-padded batches of token sequences and the bookkeeping per text;
- :func:`evaluate` — run a chain of stages on an :class:`EvalSet` (NLL, perplexity; with a
  reference: KL, its standard error over texts, top-1 agreement);
- :func:`compare` — the original and any number of quantized models on the evaluation texts.
"""
from __future__ import annotations

import math
import pathlib
import time

import numpy as np

__all__ = ["evaluation_texts", "file_texts", "EvalSet", "evaluate", "compare",
           "check_comparable", "sem"]


def sem(x) -> float:
    """Standard error of the mean of ``x`` (NaN for fewer than 2 values)."""
    x = np.asarray(x, dtype=np.float64)
    return float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else float("nan")


def _to_np(a):
    from ... import _xp

    return _xp.to_numpy(a)


def evaluation_texts(lm, *, cache=None, n_lee: int = 16, n_docs: int = 24,
                     max_tokens: int = 64, seed: int = 0, n_calibration: int = 64) -> dict:
    """``{"lee": (sequences, source), "docs": (sequences, source)}``: token sequences cut to
    ``max_tokens``. ``lee``: the first ``n_lee`` Lee documents (missing from the dict, with
    ``"lee_error"`` saying why, when the corpus cannot be fetched). ``docs``: ``n_docs``
    held-out sentences of :func:`~bakron.models.textdata.calibration_and_heldout` (drawn
    after ``n_calibration`` calibration sentences with ``seed``, as the demo draws them)."""
    from ..textdata import calibration_and_heldout, fetch_lee

    out: dict = {}

    def seqs(texts):
        s = [t[:max_tokens] for t in lm.tokenize(texts)]
        return [t for t in s if len(t) >= 2]

    if n_lee:
        try:
            corpus = fetch_lee(cache)
        except (RuntimeError, OSError, ValueError) as exc:
            out["lee_error"] = str(exc)
        else:
            out["lee"] = (seqs(corpus.documents[:n_lee]),
                          f"the first {n_lee} documents of the Lee news corpus")
    if n_docs:
        _, held = calibration_and_heldout(n_calibration, n_docs, seed=seed)
        out["docs"] = (seqs(held), f"{n_docs} held-out sentences of the Python Language "
                                   f"Reference (topics never used for calibration)")
    return out


def file_texts(lm, paths, *, window: int = 64) -> dict:
    """``{name: (sequences, source)}`` for each UTF-8 text file of ``paths``, in the form of
    :func:`evaluation_texts`: the whole file tokenized and cut into consecutive windows of
    ``window`` tokens (a last, shorter window is kept if it has at least 2 tokens), each
    window one text of the standard error. ``name`` is the file's stem (``-2``, ``-3``, ...
    appended when two files share one). :class:`~bakron._lib.errors.InputError` names a file
    that is missing, not UTF-8, empty, or too short for two windows."""
    from ..._lib.errors import InputError
    from ..._validate import check_int
    from ..textdata import read_text_file

    window = check_int(window, "window", minimum=2)
    if window > lm.config.max_positions:
        raise InputError(f"--window {window}: longer than the model's context of "
                         f"{lm.config.max_positions} tokens")
    out: dict = {}
    for path in paths:
        ids = lm.tokenize([read_text_file(path, "--text")])[0]
        seqs = [ids[i:i + window] for i in range(0, len(ids), window)]
        seqs = [t for t in seqs if len(t) >= 2]
        if len(seqs) < 2:
            raise InputError(f"--text {path}: {len(ids)} tokens, fewer than two windows of "
                             f"{window} (a standard error needs two texts)")
        stem = pathlib.Path(path).stem or "text"
        name, k = stem, 1
        while name in out:
            k += 1
            name = f"{stem}-{k}"
        out[name] = (seqs, f"{path}: {len(ids):,} tokens in {len(seqs)} windows of at most "
                           f"{window}")
    return out


class EvalSet:
    """Right-padded evaluation batches and, per batch, the real rows, their next tokens and
    the text each row belongs to."""

    def __init__(self, xp, seqs, batch_size, device):
        from ...hessian import pad_batches

        self.batches, order = pad_batches(seqs, batch_size=batch_size, xp=xp, device=device)
        self.rows, self.labels, self.text_of = [], [], []
        for b, rows in zip(self.batches, order):
            ids = np.asarray(_to_np(b))
            mask = ids >= 0
            nxt = np.full_like(ids, -1)
            nxt[:, :-1] = ids[:, 1:]
            flat = mask.reshape(-1)
            self.rows.append(xp.asarray(np.nonzero(flat)[0], device=device))
            self.labels.append(nxt.reshape(-1)[flat])
            self.text_of.append(np.repeat(np.asarray(rows), mask.sum(axis=1)))
        self.n_texts = len(seqs)
        self.tokens = int(sum(len(s) for s in seqs))
        self.predicted = int(sum(len(s) - 1 for s in seqs))


def _hidden(xp, stages, ids):
    """The chain's output before the head: final-norm hidden states (B, T, d)."""
    h = ids
    for st in stages[:-1]:
        h = st.forward(xp, h)
    return h


def _real_rows(xp, z, rows):
    d = z.shape[-1]
    return xp.take(xp.reshape(z, (-1, d)), rows, axis=0)


def _log_softmax64(xp, logits):
    a = xp.astype(logits, xp.float64)
    a = a - xp.max(a, axis=-1, keepdims=True)
    return a - xp.log(xp.sum(xp.exp(a), axis=-1, keepdims=True))


def evaluate(xp, stages, W_out, data: EvalSet, reference=None, *, chunk: int = 128,
             W_ref=None):
    """Run ``stages`` on the evaluation set.

    Without ``reference``: returns the reference (the real rows' hidden states per batch) and
    the figures of this model (NLL, perplexity). With ``reference`` (the original model's):
    also the mean per-token KL(original ‖ this model) over every real position, per-text mean
    KL (for the standard error), and the top-1 agreement with the original.
    Log-softmax in float64 over the vocabulary, ``chunk`` positions at a time. ``W_ref``:
    the original's output head, applied to ``reference`` (default ``W_out``; it differs
    where the quantized model's head or tied embedding was quantized too).
    """
    from ... import _xp

    dev = _xp.device(W_out)
    W_ref = W_out if W_ref is None else W_ref
    kl_sum = nll_sum = 0.0
    agree = n_rows = n_pred = 0
    per_text_kl = np.zeros(data.n_texts)
    per_text_n = np.zeros(data.n_texts)
    hidden = []
    for k, ids in enumerate(data.batches):
        z = _real_rows(xp, _hidden(xp, stages, ids), data.rows[k])
        hidden.append(z)
        labels = data.labels[k]
        for s in range(0, z.shape[0], chunk):
            e = min(z.shape[0], s + chunk)
            lq = _log_softmax64(xp, z[s:e, ...] @ W_out.T)
            y = labels[s:e]
            has = np.nonzero(y >= 0)[0]
            if has.size:
                V = lq.shape[-1]
                flat = xp.asarray(has * V + y[has], device=dev)
                nll_sum -= float(xp.sum(xp.take(xp.reshape(lq, (-1,)), flat)))
                n_pred += int(has.size)
            if reference is not None:
                lo = _log_softmax64(xp, reference[k][s:e, ...] @ W_ref.T)
                kl = _to_np(xp.sum(xp.exp(lo) * (lo - lq), axis=-1))
                kl_sum += float(kl.sum())
                np.add.at(per_text_kl, data.text_of[k][s:e], kl)
                np.add.at(per_text_n, data.text_of[k][s:e], 1)
                agree += int(xp.sum(xp.astype(xp.argmax(lo, axis=-1) == xp.argmax(lq, axis=-1),
                                              xp.int64)))
                del lo
            del lq
            n_rows += e - s
    _xp.sync(xp)
    out = {"nll": nll_sum / max(n_pred, 1), "predicted_tokens": n_pred, "positions": n_rows}
    out["perplexity"] = math.exp(out["nll"])
    if reference is None:
        return out, hidden
    per_text = per_text_kl / np.maximum(per_text_n, 1)
    out.update(kl=kl_sum / n_rows, kl_text_sem=sem(per_text), kl_per_text=per_text.tolist(),
               top1_agreement=agree / n_rows)
    return out, None


def check_comparable(original, model, label) -> None:
    """``ValueError`` naming ``label`` when ``model`` cannot be compared with ``original``
    token by token: another vocabulary (so another tokenizer's ids)."""
    vo, vq = original.config.vocab_size, model.config.vocab_size
    if vo != vq:
        raise ValueError(f"{label}: a vocabulary of {vq:,} tokens, the original's has {vo:,}: "
                         f"not a quantized version of the reference model")


class _Reference:
    """The original model's hidden states on each evaluation set (computed once) and its
    output head."""

    def __init__(self, lm, texts: dict, batch_size: int):
        from ... import _xp

        self.xp = lm.xp if hasattr(lm, "xp") else _xp.namespace(next(iter(lm.weights.values())))
        stages = lm.stages()
        self.W_out = stages[-1].W_out
        dev = _xp.device(self.W_out)
        self.sets, self.hidden, self.original = {}, {}, {}
        for key, val in texts.items():
            if not isinstance(val, tuple):
                continue
            self.sets[key] = EvalSet(self.xp, val[0], batch_size, dev)
            self.original[key], self.hidden[key] = evaluate(self.xp, stages, self.W_out,
                                                            self.sets[key])

    def score(self, lm) -> dict:
        stages = lm.stages()
        return {key: evaluate(self.xp, stages, stages[-1].W_out, data, self.hidden[key],
                              W_ref=self.W_out)[0]
                for key, data in self.sets.items()}


def compare(original, quantized, *, texts: dict | None = None, cache=None,
            batch_size: int = 8, progress=None) -> dict:
    """KL(original ‖ q) ± its standard error over texts, perplexity and top-1 agreement of
    each quantized model on the evaluation texts.

    ``original``: a loaded :class:`~bakron.models.llm.CausalLM`. ``quantized``: a model, a
    ``{linear name: W_hat}`` dict (applied with ``original.with_weights``), or a dict
    ``{label: model or weights}``. ``texts``: the result of :func:`evaluation_texts` (default:
    computed here). ``progress``: called as ``progress(label, i, n, seconds)`` after the
    original (label ``None``, ``i = 0``) and after each quantized model ``i`` of ``n``.
    Returns ``{"original": {set: figures}, "models": {label: {set: figures}}, "sources":
    {set: description}}`` (a single model is labelled ``"quantized"``).
    """
    if texts is None:
        texts = evaluation_texts(original, cache=cache)
    if not isinstance(quantized, dict) or (quantized and not isinstance(
            next(iter(quantized.values())), dict) and all(
            isinstance(k, str) and k in set(original.linear_names()) for k in quantized)):
        quantized = {"quantized": quantized}
    for label, q in quantized.items():   # (before the original's pass; weights: its config)
        if not isinstance(q, dict):
            check_comparable(original, q, label)
    t0 = time.perf_counter()
    ref = _Reference(original, texts, batch_size)
    if progress is not None:
        progress(None, 0, len(quantized), time.perf_counter() - t0)
    models = {}
    for i, (label, q) in enumerate(quantized.items(), 1):
        t0 = time.perf_counter()
        lm = original.with_weights(q) if isinstance(q, dict) else q
        models[label] = ref.score(lm)
        if progress is not None:
            progress(label, i, len(quantized), time.perf_counter() - t0)
    return {"original": ref.original, "models": models,
            "sources": {k: v[1] for k, v in texts.items() if isinstance(v, tuple)},
            **({"lee_error": texts["lee_error"]} if "lee_error" in texts else {})}
