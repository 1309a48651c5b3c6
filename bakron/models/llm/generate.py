"""Text generation for :class:`~bakron.models.llm.CausalLM` with a key/value cache.

The prompt goes once through the model's own stages (the :mod:`bakron.hessian.transformer`
chain; each attention stage's keys and values are kept); after that every step sends only
the new token of each sequence through the stages and attends to the cached keys and values,
so a step costs one token's forward pass. Many sequences run at once: the prompts of a batch
may have different lengths, each row writes its keys at its own positions and a row's query
sees only its own positions ``0..p``.

The maths is the stages' own: projections, q/k norm, rotary tables, softmax scale and the
SwiGLU/RMSNorm stages are those of :class:`~bakron.hessian.Attention` and friends, so the
cached step gives the full forward pass's logits (to float rounding).

Example
-------
>>> from bakron.models import load_llm
>>> lm = load_llm("smollm2")                                         # doctest: +SKIP
>>> ids = lm.tokenize(["The capital of France is"])                  # doctest: +SKIP
>>> lm.decode(lm.generate(ids, 8, greedy=True)[0])                   # doctest: +SKIP
' Paris. It is the largest city in'
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ... import _xp

__all__ = ["generate"]


def _check_count(v, what, minimum=0):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def _stop_set(lm, stop) -> frozenset:
    if stop is None:
        eos = lm.config.eos_id
        return frozenset() if eos is None else frozenset([int(eos)])
    if isinstance(stop, (int, np.integer)) and not isinstance(stop, bool):
        return frozenset([int(stop)])
    items = list(stop) if not isinstance(stop, (str, bytes)) and hasattr(stop, "__iter__") \
        else None
    if items is None or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                for t in items):
        raise ValueError(f"stop must be None (the EOS id), a token id or a list of ids, got "
                         f"{stop!r}")
    return frozenset(int(t) for t in items)


class _Cache:
    """Keys and values of every attention stage for one batch: ``(B, K, T_max, hd)`` each,
    written at absolute positions, and the rotary tables for positions ``0..T_max-1``."""

    def __init__(self, xp, attentions, B, T_max, dtype, device):
        from ...hessian.transformer import _rope_tables

        dev = {} if device is None else {"device": device}
        self.k = [xp.zeros((B, a.K, T_max, a.hd), dtype=dtype, **dev) for a in attentions]
        self.v = [xp.zeros((B, a.K, T_max, a.hd), dtype=dtype, **dev) for a in attentions]
        self.rope = [_rope_tables(xp, a.inv_freq, T_max, dtype, device) for a in attentions]


def _attention_prefill(xp, attn, x, cache, slot):
    """The stage's own forward pass over positions ``0..T-1``, keeping its keys and values."""
    from ...hessian.transformer import _lin

    _, _, q, k, v, _ = attn._prepare(xp, x)
    T = x.shape[1]
    cache.k[slot][:, :, :T, :] = k
    cache.v[slot][:, :, :T, :] = v
    return _lin(xp, attn._merge(xp, attn._attend(xp, q, k, v)), attn.Wo)


def _attention_step(xp, attn, x, cache, slot, pos, rows):
    """One new token per row ``(B, 1, d)`` at positions ``pos`` (``(B,)`` ints of ``xp``)."""
    from ...hessian.transformer import _lin, _rms_forward, _rope_apply

    B = x.shape[0]
    q = attn._heads(xp, _lin(xp, x, attn.Wq), attn.H)          # (B, H, 1, hd)
    k = attn._heads(xp, _lin(xp, x, attn.Wk), attn.K)
    v = attn._heads(xp, _lin(xp, x, attn.Wv), attn.K)
    if attn.q_norm is not None:
        q = _rms_forward(xp, q, attn.q_norm, attn.eps)[0]
        k = _rms_forward(xp, k, attn.k_norm, attn.eps)[0]
    cos_t, sin_t = cache.rope[slot]
    cos = xp.reshape(xp.take(cos_t, pos, axis=0), (B, 1, 1, attn.hd))
    sin = xp.reshape(xp.take(sin_t, pos, axis=0), (B, 1, 1, attn.hd))
    q, k = _rope_apply(xp, q, cos, sin), _rope_apply(xp, k, cos, sin)
    _write_step(xp, cache.k, slot, rows, pos, k)
    _write_step(xp, cache.v, slot, rows, pos, v)
    Tc = int(xp.max(pos)) + 1
    K_, V_ = cache.k[slot][:, :, :Tc, :], cache.v[slot][:, :, :Tc, :]
    rep, hd = attn.H // attn.K, attn.hd
    qg = xp.reshape(q, (B, attn.K, rep, 1, hd))
    S = (qg @ xp.permute_dims(K_, (0, 1, 3, 2))[:, :, None, ...]) * (1.0 / math.sqrt(hd))
    j = xp.arange(Tc, device=_xp.device(x))
    seen = xp.reshape(j[None, :] <= pos[:, None], (B, 1, 1, 1, Tc))
    zero = xp.zeros(seen.shape, dtype=S.dtype, device=_xp.device(x))
    S = S + xp.where(seen, zero, zero - math.inf)
    S = S - xp.max(S, axis=-1, keepdims=True)
    E = xp.exp(S)
    P = E / xp.sum(E, axis=-1, keepdims=True)
    O = xp.reshape(P @ V_[:, :, None, ...], (B, attn.H, 1, hd))
    return _lin(xp, attn._merge(xp, O), attn.Wo)


def _write_step(xp, bufs, slot, rows, pos, new):
    """``bufs[slot][b, :, pos[b], :] = new[b, :, 0, :]`` for every row ``b`` (``rows`` is
    every row, ``0..B-1``). numpy and cupy write the rows in place; the Array API has no
    integer-array assignment, so any other namespace selects the new values with a one-hot
    mask of the positions (a whole-cache ``where``: slower, but standard)."""
    if _xp.is_numpy(xp) or _xp.is_cupy(xp):
        bufs[slot][rows, :, pos, :] = new[:, :, 0, :]
        return
    buf = bufs[slot]
    T = buf.shape[2]
    at = xp.reshape(xp.arange(T, device=_xp.device(buf))[None, :] == pos[:, None],
                    (buf.shape[0], 1, T, 1))
    bufs[slot] = xp.where(at, new, buf)


def _walk(lm, x, cache, attend):
    """The model's body (``lm._body``) on ``x`` with every attention stage replaced by
    ``attend(attn, h, slot)``; returns the final-norm hidden states."""
    from ...hessian import Attention, Residual

    xp, slot = lm.xp, 0
    for st in lm._body:
        if isinstance(st, Residual):
            y = x
            for s in st.stages:
                if isinstance(s, Attention):
                    y = attend(s, y, slot)
                    slot += 1
                else:
                    y = s.forward(xp, y)
            x = x + y
        else:
            x = st.forward(xp, x)
    return x


def _attentions(lm) -> list:
    from ...hessian import Attention, Residual

    return [s for st in lm._body if isinstance(st, Residual) for s in st.stages
            if isinstance(s, Attention)]


def _choose(logits, rngs, greedy, temperature):
    """Next token per row (host ``int64`` ids) from float logits ``(B, V)`` of any namespace:
    argmax, or a draw from ``softmax(logits / temperature)`` by the inverse CDF of one uniform
    per row (from the row's generator). The work stays where the logits are; only the ``B``
    ids are copied to the host. (A device's float64 sums may round differently from numpy's,
    so a draw can differ from the host's when a uniform falls within rounding of a CDF step.)"""
    xp = _xp.namespace(logits)
    if greedy:
        return np.asarray(_xp.to_numpy(xp.argmax(logits, axis=-1)), dtype=np.int64)
    if _xp.is_numpy(xp):   # the same draws in place, each row's step found by bisection
        z = np.array(logits, dtype=np.float64)
        z /= temperature
        z -= np.max(z, axis=-1, keepdims=True)
        np.exp(z, out=z)
        np.cumsum(z, axis=-1, out=z)
        u = np.array([r.random() for r in rngs])
        y = [np.searchsorted(z[b], u[b] * z[b, -1], side="right") for b in range(z.shape[0])]
        return np.minimum(np.asarray(y, dtype=np.int64), logits.shape[-1] - 1)
    z = xp.astype(logits, xp.float64) / temperature
    z = z - xp.max(z, axis=-1, keepdims=True)
    cdf = xp.cumulative_sum(xp.exp(z), axis=-1)
    u = np.array([r.random() for r in rngs])
    thr = xp.asarray(u, device=_xp.device(logits))[:, None] * cdf[:, -1:]
    y = xp.sum(xp.astype(cdf <= thr, xp.int64), axis=-1)   # searchsorted(cdf, thr, "right")
    return np.minimum(_xp.to_numpy(y), logits.shape[-1] - 1)


def generate(lm, prompts, max_new_tokens: int, *, temperature: float = 1.0,
             greedy: bool = False, seed: int = 0, stop=None, batch_size: int = 16,
             return_logits: bool = False):
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    Parameters
    ----------
    lm : CausalLM
    prompts : list of token-id lists, or a right-padded ``(B, T)`` id batch (padding < 0)
        Non-empty prompts (e.g. ``[[lm.config.bos_id]]`` to start from BOS).
    max_new_tokens : int
        At most this many new tokens per prompt (fewer at a stop token or the context limit).
    temperature : float
        Sampling temperature (> 0); ignored with ``greedy``.
    greedy : bool
        Take the most probable token at every step instead of sampling.
    seed : int
        Sequence ``i`` (input order) draws from ``numpy.random.default_rng((seed, i))``: the
        same prompts and seed give the same tokens whatever ``batch_size``.
    stop : None, int or list of ints
        Tokens that end a sequence (kept as its last new token). ``None``: the model's EOS
        id; ``()``: never stop early.
    batch_size : int
        Sequences run together (the key/value cache holds
        ``2 · layers · batch_size · kv_heads · head_dim · (prompt + new)`` numbers).
    return_logits : bool
        Also return, per prompt, the float logits ``(n_new, vocab)`` (numpy) each new token
        was chosen from.

    Returns
    -------
    list of lists of int
        The new tokens of each prompt, in input order; with ``return_logits`` the pair
        ``(tokens, logits)``.
    """
    if hasattr(prompts, "shape") and len(prompts.shape) == 2:   # a right-padded id batch
        prompts = [r[r >= 0] for r in np.asarray(_xp.to_numpy(prompts), dtype=np.int64)]
    if isinstance(prompts, str) or not hasattr(prompts, "__len__"):
        raise TypeError("prompts must be a list of token-id lists")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    n_new = _check_count(max_new_tokens, "max_new_tokens")
    batch_size = _check_count(batch_size, "batch_size", 1)
    if not greedy:
        try:
            temperature = float(temperature)
        except (TypeError, ValueError):
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}") from None
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r} "
                             f"(use greedy=True for the most probable tokens)")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    stops = _stop_set(lm, stop)
    seqs = [lm._check_sequence(p, f"prompt {i}") for i, p in enumerate(prompts)]
    if n_new == 0:
        out = [[] for _ in seqs]
        return (out, [np.zeros((0, lm.config.vocab_size), np.float32) for _ in seqs]) \
            if return_logits else out
    keys = [(int(seed), i) for i in range(len(seqs))]
    out, out_logits = _generate_many(lm, seqs, n_new, keys, stops=stops, greedy=bool(greedy),
                                     temperature=temperature, batch_size=batch_size,
                                     keep_logits=return_logits)
    return (out, out_logits) if return_logits else out


def _generate_many(lm, seqs, n_new, rng_keys, *, stops, greedy, temperature, batch_size,
                   keep_logits=False, progress=None):
    """The checked prompts ``seqs``, sequence ``i`` drawing from
    ``default_rng(rng_keys[i])``; ``progress(done, total)`` after each batch."""
    out: list = [None] * len(seqs)
    out_logits: list = [None] * len(seqs)
    batches, order = lm.pad(seqs, batch_size=batch_size)
    done = 0
    for rows, ids in zip(order, batches):
        toks, lgs = _generate_batch(lm, [seqs[i] for i in rows], ids, n_new, stops,
                                    [np.random.default_rng(rng_keys[i]) for i in rows],
                                    greedy, temperature, keep_logits)
        for r, i in enumerate(rows):
            out[i] = toks[r]
            out_logits[i] = lgs[r] if keep_logits else None
        done += len(rows)
        if progress is not None:
            progress(done, len(seqs))
    return out, out_logits


def _generate_batch(lm, seqs, ids, n_new, stops, rngs, greedy, temperature, keep_logits):
    xp, dev = lm.xp, lm.device
    devkw = {} if dev is None else {"device": dev}
    B = len(seqs)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    limit = lm.config.max_positions
    T_max = min(int(lengths.max()) + n_new, limit)
    head = lm._head()
    cache = _Cache(xp, _attentions(lm), B, T_max, getattr(xp, lm.dtype), dev)

    z = _walk(lm, ids, cache, lambda a, h, s: _attention_prefill(xp, a, h, cache, s))
    last = xp.asarray(lengths - 1, **devkw)
    z_last = xp.take_along_axis(z, xp.reshape(last, (B, 1, 1)) * xp.ones(
        (1, 1, z.shape[-1]), dtype=last.dtype, **devkw), axis=1)       # (B, 1, d)
    # logits stay on the device (a step copies back B token ids, not B x vocab logits) unless
    # they live on the host anyway or are kept for the caller
    on_device = not (_xp.is_numpy(xp) or keep_logits)

    def step_logits(z):
        lg = head.logits(xp, z)[:, 0, :]
        return lg if on_device else _xp.to_numpy(lg)

    logits = step_logits(z_last)

    new = [[] for _ in range(B)]
    kept = [[] for _ in range(B)]
    done = lengths >= limit          # a full context has no room for a new token
    pos = lengths.copy()             # where each row's next token goes
    rows = xp.asarray(np.arange(B, dtype=np.int64), **devkw)
    for step in range(n_new):
        y = _choose(logits, rngs, greedy, temperature)
        for b in range(B):
            if done[b]:
                continue
            new[b].append(int(y[b]))
            if keep_logits:
                kept[b].append(np.array(logits[b], copy=True))
            if int(y[b]) in stops or pos[b] + 1 > limit - 1 or len(new[b]) >= n_new:
                done[b] = True
        if done.all():
            break
        # finished rows keep running on a harmless token at a clamped position; their
        # outputs are ignored and they never write beyond the cache
        tok = np.where(done, 0, y).astype(np.int64)
        p = np.minimum(pos, T_max - 1)
        tok_x, pos_x = xp.asarray(tok[:, None], **devkw), xp.asarray(p, **devkw)
        z = _walk(lm, tok_x, cache,
                  lambda a, h, s: _attention_step(xp, a, h, cache, s, pos_x, rows))
        logits = step_logits(z)
        pos = np.where(done, pos, pos + 1)
    host_dtype = logits.dtype if isinstance(logits, np.ndarray) else np.float32
    lgs = [np.stack(k) if k else np.zeros((0, logits.shape[-1]), host_dtype) for k in kept]
    return new, lgs
