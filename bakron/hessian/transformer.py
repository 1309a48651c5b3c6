"""Stages of a decoder-only transformer (Llama / Qwen3 family) and its language-model head.

The stages follow the protocol of :mod:`bakron.hessian.stages`. A causal LM is the chain

``Embedding → [Residual([RMSNorm, Attention]), Residual([RMSNorm, SwiGLU])] × L → RMSNorm →
LMHead``

whose calibration inputs are **token ids**: integer arrays ``(B, T)``, right-padded with any
negative id (``-1``). :func:`pad_batches` builds them from token lists. The first stage,
:class:`Embedding`, tells the driver which positions are real (``token_mask``); padded
positions count in neither ``H_in`` nor ``H_out`` (their weight is zero and the head gives them
zero gradient), and with the causal mask no real token ever sees a padded one.

Conventions are those of Hugging Face's ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``: RMSNorm
``x / sqrt(mean(x²) + eps) * w``, rotary embeddings in the "rotate half" layout (angles and
their cosines computed in float32, as there), grouped-query attention where query head ``h``
reads key/value head ``h // (num_heads / num_kv_heads)``, softmax scale ``1/sqrt(head_dim)``,
SwiGLU ``down(silu(gate x) * up x)``. Linear weights are ``(out, in)`` like ``nn.Linear``.
See docs/hessian.md (transformer stages) for the derivatives.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _xp
from .stages import HeadContext, _last_axis, stage_label

__all__ = ["Embedding", "RMSNorm", "Attention", "SwiGLU", "LMHead", "pad_batches",
           "rope_inv_freq", "parse_labels", "LABEL_ESTIMATORS"]


def _check_matrix(W, what, owner):
    if not hasattr(W, "shape") or len(W.shape) != 2 or 0 in tuple(W.shape):
        raise ValueError(f"{owner}: {what} must be a non-empty 2-D array, got shape "
                         f"{getattr(W, 'shape', None)}")


def _check_vector(w, n, what, owner):
    if not hasattr(w, "shape") or tuple(w.shape) != (n,):
        raise ValueError(f"{owner}: {what} must have shape ({n},), got "
                         f"{getattr(w, 'shape', None)}")


def _flat(xp, x):
    return xp.reshape(x, (-1, x.shape[-1]))


def _lin(xp, x, W):
    """``x Wᵀ`` over the last axis of ``x`` (any leading axes)."""
    return xp.reshape(_flat(xp, x) @ W.T, tuple(x.shape[:-1]) + (W.shape[0],))


def _lin_t(xp, g, W):
    """``g W`` (the input gradient of ``x Wᵀ``) over the last axis."""
    return xp.reshape(_flat(xp, g) @ W, tuple(g.shape[:-1]) + (W.shape[1],))


# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------
def _rms_forward(xp, x, w, eps):
    r = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)
    xh = x * r
    return (xh if w is None else xh * w), xh, r


def _rms_vjp(xp, x, w, eps, dy, r=None):
    """The VJP of :func:`_rms_forward`; ``r``: its ``1/sqrt(mean(x²) + eps)`` if kept."""
    if r is None:
        _, xh, r = _rms_forward(xp, x, None, eps)
    else:
        xh = x * r
    d = dy if w is None else dy * w
    return r * (d - xh * xp.mean(d * xh, axis=-1, keepdims=True))


class RMSNorm:
    """``x / sqrt(mean(x²) + eps) * weight`` over the last axis, in the input's dtype."""

    def __init__(self, weight, *, eps: float, name: str | None = None):
        if not hasattr(weight, "shape") or len(weight.shape) != 1 or weight.shape[0] == 0:
            raise ValueError(f"RMSNorm {name!r}: weight must be a non-empty 1-D array, got "
                             f"shape {getattr(weight, 'shape', None)}")
        if not eps > 0:
            raise ValueError(f"RMSNorm {name!r}: eps must be > 0, got {eps!r}")
        self.weight, self.eps, self.name = weight, float(eps), name

    def linears(self):
        return {}

    def arrays(self):
        return (self.weight,)

    def out_shape(self, in_shape):
        if _last_axis(in_shape, self) != self.weight.shape[0]:
            raise ValueError(f"stage {stage_label(self)} normalises {self.weight.shape[0]} "
                             f"features but its input has shape {tuple(in_shape)}")
        return tuple(in_shape)

    def forward(self, xp, h):
        return _rms_forward(xp, h, self.weight, self.eps)[0]

    def forward_tape(self, xp, h):
        """The output and the tape of its VJP: the reciprocal RMS per position."""
        y, _, r = _rms_forward(xp, h, self.weight, self.eps)
        return y, r

    def tape_bytes(self, in_shape, itemsize: int) -> int:
        return math.prod(tuple(in_shape)[:-1]) * int(itemsize)

    def vjp(self, xp, h, delta, collect, need_input_grad=True, tape=None):
        if not need_input_grad:
            return None
        return _rms_vjp(xp, h, self.weight, self.eps, delta, tape)


# --------------------------------------------------------------------------------------------
# token embedding
# --------------------------------------------------------------------------------------------
class Embedding:
    """Token ids ``(B, T)`` → rows of ``table`` ``(B, T, d)``; negative ids are padding (zeros).

    The chain's first stage: its inputs are integers, so it has no input gradient (``vjp``
    returns ``None``) and it collects nothing (a tied LM head's weight is not a factor key).
    ``token_mask`` tells the driver which positions are real.
    """

    integer_inputs = True

    def __init__(self, table, *, name: str = "token_embd"):
        _check_matrix(table, "table (vocab x features)", f"Embedding {name!r}")
        self.table, self.name = table, name

    def linears(self):
        return {}

    def arrays(self):
        return (self.table,)

    def out_shape(self, in_shape):
        if len(in_shape) != 2:
            raise ValueError(f"stage {stage_label(self)} takes token ids of shape (batch, "
                             f"tokens), got shape {tuple(in_shape)}")
        return tuple(in_shape) + (self.table.shape[1],)

    def token_mask(self, xp, ids):
        """``ids >= 0``: the real (not padded) positions."""
        return ids >= 0

    def forward(self, xp, ids):
        V, d = self.table.shape
        if not xp.isdtype(ids.dtype, "integral"):
            raise ValueError(f"stage {stage_label(self)} takes integer token ids, got dtype "
                             f"{ids.dtype}")
        flat = xp.reshape(ids, (-1,))
        if flat.shape[0] and int(xp.max(flat)) >= V:
            raise ValueError(f"stage {stage_label(self)}: token id {int(xp.max(flat))} is "
                             f"outside the vocabulary of {V} tokens")
        real = flat >= 0
        idx = xp.where(real, flat, xp.zeros_like(flat))
        rows = xp.take(self.table, xp.astype(idx, xp.int64), axis=0)
        rows = rows * xp.astype(real, rows.dtype)[:, None]
        return xp.reshape(rows, tuple(ids.shape) + (d,))

    def vjp(self, xp, h, delta, collect, need_input_grad=True):
        return None


# --------------------------------------------------------------------------------------------
# rotary position embeddings
# --------------------------------------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """The rotary inverse frequencies ``theta^(-2i/head_dim)`` (float32, like Hugging Face).

    ``scaling={"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` applies Llama 3's frequency-dependent stretch
    (long wavelengths divided by ``factor``, short ones kept, a linear blend between).
    """
    if head_dim % 2 or head_dim < 2:
        raise ValueError(f"head_dim must be even and >= 2 for rotary embeddings, got {head_dim}")
    if not theta > 0:
        raise ValueError(f"rope_theta must be > 0, got {theta!r}")
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (1.0 / (np.float32(theta) ** exps)).astype(np.float32)
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (only 'llama3')")
    try:
        factor = float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        ctx = float(scaling["original_max_position_embeddings"])
    except KeyError as exc:
        raise ValueError(f"llama3 rope scaling needs {exc.args[0]!r}") from None
    wavelen = 2.0 * math.pi / inv.astype(np.float64)
    stretched = np.where(wavelen > ctx / lo, inv / factor, inv)
    smooth = (ctx / wavelen - lo) / (hi - lo)
    blend = (1.0 - smooth) * stretched / factor + smooth * stretched
    medium = (wavelen >= ctx / hi) & (wavelen <= ctx / lo)
    return np.where(medium, blend, stretched).astype(np.float32)


def _rope_tables(xp, inv_freq, T, dtype, device):
    pos = np.arange(T, dtype=np.float32)
    ang = np.outer(pos, inv_freq).astype(np.float32)
    ang = np.concatenate([ang, ang], axis=1)
    cos = xp.asarray(np.cos(ang), device=device)
    sin = xp.asarray(np.sin(ang), device=device)
    return xp.astype(cos, dtype), xp.astype(sin, dtype)


def _rope_apply(xp, x, cos, sin):
    """``x cos + rotate_half(x) sin`` (a new array), with ``rotate_half(x) = [-x₂, x₁]`` for
    the halves ``x₁, x₂`` of the last axis, formed without the rotated copy."""
    h = x.shape[-1] // 2
    out = x * cos
    out[..., :h] -= x[..., h:] * sin[..., :h]
    out[..., h:] += x[..., :h] * sin[..., h:]
    return out


def _rope_apply_t(xp, y, cos, sin):
    """The transpose of :func:`_rope_apply` (its VJP): ``y cos + rotate_halfᵀ(y sin)``."""
    h = y.shape[-1] // 2
    out = y * cos
    out[..., :h] += y[..., h:] * sin[..., h:]
    out[..., h:] -= y[..., :h] * sin[..., :h]
    return out


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------
class Attention:
    """Causal grouped-query self-attention with rotary embeddings (positions ``0..T-1``).

    ``q = x Wqᵀ`` (``num_heads·head_dim`` outputs), ``k = x Wkᵀ``, ``v = x Wvᵀ``
    (``num_kv_heads·head_dim``), optional per-head RMSNorm of q and k (Qwen3, weights
    ``(head_dim,)``) before the rotation, ``softmax(q kᵀ/sqrt(head_dim) + causal) v``, then
    ``Wo``. Right-padded batches need no key mask. Collects ``x``/``g`` for all four weights.
    The scores are formed for ``score_bytes`` worth of sequences at a time.
    """

    def __init__(self, Wq, Wk, Wv, Wo, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, q_norm=None, k_norm=None, eps: float = 1e-6,
                 rope_scaling: dict | None = None,
                 names=("attn_q", "attn_k", "attn_v", "attn_output"),
                 score_bytes: int = 1 << 26):
        own = f"Attention {names!r}"
        for W, nm in ((Wq, "Wq"), (Wk, "Wk"), (Wv, "Wv"), (Wo, "Wo")):
            _check_matrix(W, nm, own)
        H, K, hd = int(num_heads), int(num_kv_heads), int(head_dim)
        if H < 1 or K < 1 or H % K:
            raise ValueError(f"{own}: num_heads ({num_heads}) must be a positive multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        d = Wq.shape[1]
        want = {"Wq": (H * hd, d), "Wk": (K * hd, d), "Wv": (K * hd, d), "Wo": (d, H * hd)}
        for W, nm in ((Wq, "Wq"), (Wk, "Wk"), (Wv, "Wv"), (Wo, "Wo")):
            if tuple(W.shape) != want[nm]:
                raise ValueError(f"{own}: {nm} has shape {tuple(W.shape)}; with {H} heads, "
                                 f"{K} KV heads of size {hd} and {d} features it must be "
                                 f"{want[nm]}")
        for w, nm in ((q_norm, "q_norm"), (k_norm, "k_norm")):
            if w is not None:
                _check_vector(w, hd, nm, own)
        if (q_norm is None) != (k_norm is None):
            raise ValueError(f"{own}: give both q_norm and k_norm or neither")
        if not eps > 0:
            raise ValueError(f"{own}: eps must be > 0, got {eps!r}")
        if len(names) != 4:
            raise ValueError(f"{own}: names must hold 4 names (q, k, v, output)")
        if isinstance(score_bytes, bool) or int(score_bytes) != score_bytes or score_bytes < 1:
            raise ValueError(f"{own}: score_bytes must be a positive integer, got "
                             f"{score_bytes!r}")
        self.Wq, self.Wk, self.Wv, self.Wo = Wq, Wk, Wv, Wo
        self.q_norm, self.k_norm, self.eps = q_norm, k_norm, float(eps)
        self.H, self.K, self.hd, self.d = H, K, hd, d
        self.inv_freq = rope_inv_freq(hd, rope_theta, rope_scaling)
        self.names = tuple(names)
        self.name = None
        self.score_bytes = int(score_bytes)
        self._rope_cache = None

    def linears(self):
        return {n: tuple(W.shape) for n, W in zip(self.names, (self.Wq, self.Wk, self.Wv,
                                                                self.Wo))}

    def arrays(self):
        return tuple(a for a in (self.Wq, self.Wk, self.Wv, self.Wo, self.q_norm, self.k_norm)
                     if a is not None)

    def out_shape(self, in_shape):
        if len(in_shape) != 3 or in_shape[-1] != self.d:
            raise ValueError(f"stage {stage_label(self)} takes (batch, tokens, {self.d}), got "
                             f"shape {tuple(in_shape)}")
        return tuple(in_shape)

    # -- pieces --------------------------------------------------------------------------
    def _rope(self, xp, T, dtype, device):
        """cos/sin tables for positions 0..T-1 (the last ones are kept for the next call)."""
        key = (T, str(dtype), str(device))
        if self._rope_cache is None or self._rope_cache[0] != key:
            self._rope_cache = (key, _rope_tables(xp, self.inv_freq, T, dtype, device))
        return self._rope_cache[1]

    def _heads(self, xp, y, n):
        """(B, T, n·hd) → (B, n, T, hd)."""
        B, T, _ = y.shape
        return xp.permute_dims(xp.reshape(y, (B, T, n, self.hd)), (0, 2, 1, 3))

    def _merge(self, xp, y):
        """(B, n, T, hd) → (B, T, n·hd)."""
        B, n, T, hd = y.shape
        return xp.reshape(xp.permute_dims(y, (0, 2, 1, 3)), (B, T, n * hd))

    def _chunk(self, B, T, itemsize):
        per = self.H * T * T * itemsize * 3   # scores, probabilities, one temporary
        return max(1, min(B, self.score_bytes // max(per, 1)))

    def _prepare(self, xp, x):
        """Projections, q/k norm and rotation: everything before the scores."""
        B, T, _ = x.shape
        q_pre = self._heads(xp, _lin(xp, x, self.Wq), self.H)
        k_pre = self._heads(xp, _lin(xp, x, self.Wk), self.K)
        v = self._heads(xp, _lin(xp, x, self.Wv), self.K)
        if self.q_norm is not None:
            q = _rms_forward(xp, q_pre, self.q_norm, self.eps)[0]
            k = _rms_forward(xp, k_pre, self.k_norm, self.eps)[0]
        else:
            q, k = q_pre, k_pre
        cos, sin = self._rope(xp, T, x.dtype, _xp.device(x))
        q, k = _rope_apply(xp, q, cos, sin), _rope_apply(xp, k, cos, sin)
        return q_pre, k_pre, q, k, v, (cos, sin)

    def _group(self, xp, y):
        """(b, H, T, hd) → (b, K, rep·T, hd): the query heads that share one key/value head
        stacked over the rows (a contiguous copy), so that every product of the scores is one
        GEMM per group and sums over the shared heads happen inside the GEMM."""
        b, _, T, hd = y.shape
        return xp.reshape(y, (b, self.K, (self.H // self.K) * T, hd))

    def _ungroup(self, xp, y):
        b, _, RT, hd = y.shape
        return xp.reshape(y, (b, self.H, RT // (self.H // self.K), hd))

    def _causal(self, xp, T, dtype, device):
        """The additive causal mask of the grouped scores: (rep·T, T), 0 or -inf."""
        key = (T, str(dtype), str(device))
        cache = getattr(self, "_mask_cache", None)
        if cache is None or cache[0] != key:
            i = np.arange(T)
            m = np.where(i[:, None] >= i[None, :], 0.0, -np.inf)
            m = np.tile(m, (self.H // self.K, 1))
            cache = (key, xp.astype(xp.asarray(m, device=device), dtype))
            self._mask_cache = cache
        return cache[1]

    def _probs(self, xp, qg, k):
        """Causal softmax of ``q kᵀ / sqrt(hd)`` per group: (b, K, rep·T, T) for grouped
        queries ``qg`` (:meth:`_group`)."""
        T, hd = k.shape[2], k.shape[3]
        S = qg @ xp.matrix_transpose(k)
        S *= 1.0 / math.sqrt(hd)
        S += self._causal(xp, T, S.dtype, _xp.device(qg))
        S -= xp.max(S, axis=-1, keepdims=True)
        E = xp.exp(S)
        del S
        E /= xp.sum(E, axis=-1, keepdims=True)
        return E

    def _attend(self, xp, q, k, v, keep=None):
        """(B, H, T, hd) outputs of the heads, ``score_bytes`` worth of sequences at a time;
        ``keep``: a list that receives each chunk's probabilities."""
        B, _, T, hd = q.shape
        step = self._chunk(B, T, xp.finfo(q.dtype).bits // 8)
        outs = []
        for s in range(0, B, step):
            b = min(step, B - s)
            qg = self._group(xp, q[s:s + b, ...])
            P = self._probs(xp, qg, k[s:s + b, ...])
            outs.append(self._ungroup(xp, P @ v[s:s + b, ...]))
            if keep is not None:
                keep.append(P)
        return outs[0] if len(outs) == 1 else xp.concat(outs, axis=0)

    def forward(self, xp, h):
        _, _, q, k, v, _ = self._prepare(xp, h)
        return _lin(xp, self._merge(xp, self._attend(xp, q, k, v)), self.Wo)

    def forward_collect(self, xp, h, collect):
        n_q, n_k, n_v, n_o = self.names
        collect(n_q, h)
        collect(n_k, h)
        collect(n_v, h)
        _, _, q, k, v, _ = self._prepare(xp, h)
        O = self._merge(xp, self._attend(xp, q, k, v))
        collect(n_o, O)
        return _lin(xp, O, self.Wo)

    def _tape_probs(self, T: int) -> bool:
        """Whether the tape keeps the probabilities: when they are no larger than the rest
        of the tape (``H·T <= 2 (H + K) hd`` per token: short sequences); else the VJP
        recomputes them."""
        return self.H * int(T) <= 2 * (self.H + self.K) * self.hd

    def forward_tape(self, xp, h):
        """The output and the tape its VJP reads instead of recomputing the forward: the
        rotated ``q`` and ``k``, ``v``, the heads' merged outputs (``Wo``'s input), with q/k
        norms their inputs, and for short sequences the probabilities
        (:meth:`_tape_probs`)."""
        q_pre, k_pre, q, k, v, _ = self._prepare(xp, h)
        probs = [] if self._tape_probs(q.shape[2]) else None
        O = self._merge(xp, self._attend(xp, q, k, v, probs))
        tape = (q, k, v, O, None if probs is None else tuple(probs))
        tape += (q_pre, k_pre) if self.q_norm is not None else ()
        return _lin(xp, O, self.Wo), tape

    def tape_bytes(self, in_shape, itemsize: int) -> int:
        """Bytes of :meth:`forward_tape`'s tape for an input of shape ``in_shape``."""
        T = tuple(in_shape)[-2]
        per = 2 * self.H * self.hd + 2 * self.K * self.hd
        if self.q_norm is not None:
            per += (self.H + self.K) * self.hd
        if self._tape_probs(T):
            per += self.H * T
        return math.prod(tuple(in_shape)[:-1]) * per * int(itemsize)

    def vjp(self, xp, h, delta, collect, need_input_grad=True, tape=None):
        n_q, n_k, n_v, n_o = self.names
        probs = None
        if tape is None:
            q_pre, k_pre, q, k, v, _ = self._prepare(xp, h)
            Om = None
        else:
            q, k, v, Om, probs = tape[:5]
            q_pre, k_pre = tape[5:] if self.q_norm is not None else (None, None)
        del tape
        B, _, T, hd = q.shape
        cos, sin = self._rope(xp, T, q.dtype, _xp.device(q))
        scale = 1.0 / math.sqrt(hd)
        dO = self._heads(xp, _lin_t(xp, delta, self.Wo), self.H)
        O, dq, dk, dv = [], [], [], []
        step = self._chunk(B, T, xp.finfo(q.dtype).bits // 8)
        for s in range(0, B, step):
            b = min(step, B - s)
            qg, ks, vs = self._group(xp, q[s:s + b, ...]), k[s:s + b, ...], v[s:s + b, ...]
            # (b, K, rep·T, T): the forward's chunk (the same step) or recomputed
            P = self._probs(xp, qg, ks) if probs is None else probs[len(dq)]
            if Om is None:
                O.append(self._ungroup(xp, P @ vs))
            dOg = self._group(xp, dO[s:s + b, ...])
            dv.append(xp.matrix_transpose(P) @ dOg)                      # sums the shared heads
            dP = dOg @ xp.matrix_transpose(vs)
            dS = dP
            dS -= xp.sum(dP * P, axis=-1, keepdims=True)
            dS *= P
            dS *= scale
            del P, dP
            dq.append(self._ungroup(xp, dS @ ks))
            dk.append(xp.matrix_transpose(dS) @ qg)
            del dS
        cat = (lambda a: a[0] if len(a) == 1 else xp.concat(a, axis=0))
        collect(n_o, self._merge(xp, cat(O)) if Om is None else Om, delta)
        del O, Om, dO
        dq, dk, dv = cat(dq), cat(dk), cat(dv)
        # back through the rotation (q_r = q cos + R(q) sin) and the optional q/k norm
        dq, dk = _rope_apply_t(xp, dq, cos, sin), _rope_apply_t(xp, dk, cos, sin)
        if self.q_norm is not None:
            dq = _rms_vjp(xp, q_pre, self.q_norm, self.eps, dq)
            dk = _rms_vjp(xp, k_pre, self.k_norm, self.eps, dk)
        gq, gk, gv = (self._merge(xp, dq), self._merge(xp, dk), self._merge(xp, dv))
        collect(n_q, h, gq)
        collect(n_k, h, gk)
        collect(n_v, h, gv)
        if not need_input_grad:
            return None
        return _lin_t(xp, gq, self.Wq) + _lin_t(xp, gk, self.Wk) + _lin_t(xp, gv, self.Wv)


# --------------------------------------------------------------------------------------------
# SwiGLU feed-forward
# --------------------------------------------------------------------------------------------
def _sigmoid(xp, a):
    """``σ(a) = (1 + tanh(a/2)) / 2``: one transcendental pass, no overflow for large
    ``|a|`` (a new array)."""
    s = xp.tanh(a * 0.5)
    s *= 0.5
    s += 0.5
    return s


class SwiGLU:
    """``down(silu(gate x) * up x)`` with ``silu(a) = a·σ(a)``; collects gate, up and down."""

    def __init__(self, W_gate, W_up, W_down, *, names=("ffn_gate", "ffn_up", "ffn_down")):
        own = f"SwiGLU {names!r}"
        for W, nm in ((W_gate, "W_gate"), (W_up, "W_up"), (W_down, "W_down")):
            _check_matrix(W, nm, own)
        f, d = W_gate.shape
        if tuple(W_up.shape) != (f, d) or tuple(W_down.shape) != (d, f):
            raise ValueError(f"{own}: W_gate {tuple(W_gate.shape)}, W_up {tuple(W_up.shape)} "
                             f"and W_down {tuple(W_down.shape)} must be (f, d), (f, d), (d, f)")
        if len(names) != 3:
            raise ValueError(f"{own}: names must hold 3 names (gate, up, down)")
        self.W_gate, self.W_up, self.W_down = W_gate, W_up, W_down
        self.names = tuple(names)
        self.name = None

    def linears(self):
        return {n: tuple(W.shape) for n, W in zip(self.names, (self.W_gate, self.W_up,
                                                                self.W_down))}

    def arrays(self):
        return (self.W_gate, self.W_up, self.W_down)

    def out_shape(self, in_shape):
        d = self.W_gate.shape[1]
        if _last_axis(in_shape, self) != d:
            raise ValueError(f"stage {stage_label(self)} expects {d} features, got shape "
                             f"{tuple(in_shape)}")
        return tuple(in_shape)

    def forward(self, xp, h):
        a, b = _lin(xp, h, self.W_gate), _lin(xp, h, self.W_up)
        s = _sigmoid(xp, a)
        s *= a
        s *= b
        return _lin(xp, s, self.W_down)

    def forward_collect(self, xp, h, collect):
        n_g, n_u, n_d = self.names
        collect(n_g, h)
        collect(n_u, h)
        a, b = _lin(xp, h, self.W_gate), _lin(xp, h, self.W_up)
        s = a * _sigmoid(xp, a)
        s *= b
        collect(n_d, s)
        return _lin(xp, s, self.W_down)

    def forward_tape(self, xp, h):
        """The output and the tape its VJP reads instead of recomputing the gate and up
        projections: ``a = gate x``, ``b = up x`` and ``σ(a)``."""
        a, b = _lin(xp, h, self.W_gate), _lin(xp, h, self.W_up)
        sg = _sigmoid(xp, a)
        s = a * sg
        s *= b
        return _lin(xp, s, self.W_down), (a, b, sg)

    def tape_bytes(self, in_shape, itemsize: int) -> int:
        """Bytes of :meth:`forward_tape`'s tape for an input of shape ``in_shape``."""
        return math.prod(tuple(in_shape)[:-1]) * 3 * self.W_gate.shape[0] * int(itemsize)

    def vjp(self, xp, h, delta, collect, need_input_grad=True, tape=None):
        n_g, n_u, n_d = self.names
        if tape is None:
            a, b = _lin(xp, h, self.W_gate), _lin(xp, h, self.W_up)
            sg = _sigmoid(xp, a)
        else:
            a, b, sg = tape
        s = a * sg
        collect(n_d, s * b, delta)
        dh = _lin_t(xp, delta, self.W_down)
        # da = dh · b · σ'(silu) with silu' = σ (1 + a (1 - σ)), formed in place in a
        da = 1.0 - sg
        da *= a
        da += 1.0
        da *= sg
        da *= b
        da *= dh
        del a, b, sg
        s *= dh
        db = s
        del dh, s
        collect(n_g, h, da)
        collect(n_u, h, db)
        if not need_input_grad:
            return None
        return _lin_t(xp, da, self.W_gate) + _lin_t(xp, db, self.W_up)


# --------------------------------------------------------------------------------------------
# the language-model head
# --------------------------------------------------------------------------------------------
class LMHead:
    """Logits ``z W_outᵀ`` over the vocabulary and the summed next-token cross-entropy.

    ``grad`` returns ``∂loss/∂z = (softmax(z W_outᵀ) − onehot(label)) W_out`` per position,
    computed for ``chunk_bytes`` worth of logits (or ``chunk_tokens`` positions) at a time, so
    a batch never holds more than that of logits. ``W_out`` is ``(vocab, d)``; a tied head
    passes the embedding table.

    ``labels=None`` (default, the same as ``"sample"``): each position's label is drawn from
    the model's own softmax (inverse CDF of ``numpy.random.default_rng((seed, batch_index))``),
    as :class:`~bakron.hessian.SoftmaxCrossEntropy` does: the Fisher of the KL to the model.
    ``labels="true"``: the next token of the same sequence (read from the calibration ids);
    the last real position of each sequence has no label. ``labels=[y_0, y_1, ...]``: one
    integer array ``(B, T)`` per batch, negative entries meaning "no label". Positions without
    a label and padded positions get zero gradient.

    Lower-variance estimators of the same Fisher back-propagate several gradient rows per
    position (``draws`` of them, stacked along the first axis: ``grad`` returns
    ``(draws·B, T, d)`` and the driver averages ``H_out`` over the rows, see
    :func:`~bakron.hessian.global_factors`):

    ``"sample:K"``
        ``K`` labels drawn independently per position (``K`` uniforms per position from the
        same generator; ``"sample:1"`` is the default).
    ``"fisher:K"``
        The exact output Fisher at the logits, ``E_y (p − e_y)(p − e_y)ᵀ = diag(p) − p pᵀ``,
        from its ``K`` most probable terms ``√p_y (p − e_y)`` and one remainder row
        ``√q (m − p)`` for the other labels (``q`` their probability mass, ``m`` their
        distribution normalised to sum 1): this keeps the remainder's mean part exactly and
        drops only the spread of the unlisted labels among themselves,
        ``diag(p_rest) − p_rest p_restᵀ / q`` (PSD, trace below ``q``). ``K + 1`` rows per
        position; with ``K`` at least the vocabulary size it is exact (``V`` rows). Each row
        carries an independent random sign per position: the labels of different positions
        are independent, so the products of two positions' terms (which reach a layer through
        attention) average to zero, as they do for sampled labels, while each position's own
        term is exact.
    """

    is_head = True

    def __init__(self, W_out, *, labels=None, chunk_bytes: int = 1 << 26,
                 chunk_tokens: int | None = None, name: str = "output"):
        _check_matrix(W_out, "W_out (vocab x features)", f"LMHead {name!r}")
        if W_out.shape[0] < 2:
            raise ValueError(f"LMHead {name!r}: the vocabulary needs at least 2 tokens")
        V = W_out.shape[0]
        self.estimator, self.k, self.draws = None, 1, 1
        if isinstance(labels, str):
            self.estimator, self.k, self.draws = parse_labels(labels, V, f"LMHead {name!r}")
            labels = "true" if self.estimator == "true" else None
        elif labels is not None:
            labels = list(labels)
        if isinstance(chunk_bytes, bool) or int(chunk_bytes) != chunk_bytes or chunk_bytes < 1:
            raise ValueError(f"LMHead {name!r}: chunk_bytes must be a positive integer, got "
                             f"{chunk_bytes!r}")
        if chunk_tokens is not None and (isinstance(chunk_tokens, bool)
                                         or int(chunk_tokens) != chunk_tokens
                                         or chunk_tokens < 1):
            raise ValueError(f"LMHead {name!r}: chunk_tokens must be a positive integer or "
                             f"None, got {chunk_tokens!r}")
        self.W_out, self.labels, self.name = W_out, labels, name
        self.chunk_bytes = int(chunk_bytes)
        self.chunk_tokens = None if chunk_tokens is None else int(chunk_tokens)

    def linears(self):
        return {}

    def arrays(self):
        return (self.W_out,)

    def check_input(self, in_shape):
        d = self.W_out.shape[1]
        if _last_axis(in_shape, self, "hidden states") != d:
            raise ValueError(f"head {stage_label(self)} projects {d} features onto the "
                             f"vocabulary, got hidden states of shape {tuple(in_shape)}")

    # -- helpers the model uses --------------------------------------------------------------
    def logits(self, xp, z):
        """``z W_outᵀ`` (all positions at once: shape ``z.shape[:-1] + (vocab,)``)."""
        return _lin(xp, z, self.W_out)

    def log_softmax(self, xp, z):
        """``log softmax(z W_outᵀ)`` over the vocabulary."""
        return _log_softmax(xp, self.logits(xp, z))

    def rows_per_chunk(self, itemsize: int) -> int:
        """Positions whose logits one chunk holds."""
        per_row = self.W_out.shape[0] * int(itemsize)
        rows = max(1, self.chunk_bytes // per_row)
        return rows if self.chunk_tokens is None else min(rows, self.chunk_tokens)

    # -- labels ------------------------------------------------------------------------------
    def _given_labels(self, xp, lead, ctx: HeadContext, device):
        """The (B, T) labels for this batch (negative: none), or ``None`` to sample."""
        V = self.W_out.shape[0]
        if self.labels is None:
            return None
        if self.labels == "true":
            ids = ctx.inputs
            if ids is None or tuple(ids.shape) != lead:
                raise ValueError(f"head {stage_label(self)}: labels='true' reads the next "
                                 f"token from the calibration ids, which must have the shape "
                                 f"{lead} of the hidden states' positions; got "
                                 f"{None if ids is None else tuple(ids.shape)}")
            ids = xp.astype(ids, xp.int64)
            pad = xp.full((lead[0], 1), -1, dtype=xp.int64, device=_xp.device(ids))
            return xp.concat([ids[:, 1:], pad], axis=1)
        if ctx.batch_index >= len(self.labels):
            raise ValueError(f"head {stage_label(self)} has labels for {len(self.labels)} "
                             f"batches, but batch {ctx.batch_index} was requested")
        y = xp.asarray(self.labels[ctx.batch_index], device=device)
        if tuple(y.shape) != lead:
            raise ValueError(f"head {stage_label(self)}: labels of batch {ctx.batch_index} "
                             f"have shape {tuple(y.shape)}, the hidden states need {lead}")
        if not xp.isdtype(y.dtype, "integral"):
            raise ValueError(f"head {stage_label(self)}: labels of batch {ctx.batch_index} "
                             f"must be integers, got dtype {y.dtype}")
        y = xp.astype(y, xp.int64)
        if y.shape[0] and bool(xp.any(y >= V)):
            raise ValueError(f"head {stage_label(self)}: labels of batch {ctx.batch_index} "
                             f"must lie below the vocabulary size {V} (negative: no label)")
        return y

    def grad(self, xp, z, ctx: HeadContext):
        """``∂loss/∂z`` for hidden states ``z`` ``(B, T, d)`` (loss summed over positions)."""
        if self.draws > 1:
            return self._grad_rows(xp, z, ctx)
        lead = tuple(z.shape[:-1])
        d = z.shape[-1]
        dev = _xp.device(z)
        given = self._given_labels(xp, lead, ctx, dev)
        keep = None if ctx.mask is None else xp.reshape(ctx.mask, (-1,))
        u = None
        if given is None:
            u = np.random.default_rng((int(ctx.seed), int(ctx.batch_index))).random(lead)
            u = xp.reshape(xp.asarray(u, device=dev), (-1,))
        else:
            given = xp.reshape(given, (-1,))
            has = given >= 0
            keep = has if keep is None else (keep & has)
        Z = xp.reshape(z, (-1, d))
        n = Z.shape[0]
        step = self.rows_per_chunk(xp.finfo(z.dtype).bits // 8)
        V = self.W_out.shape[0]
        parts = []
        for s in range(0, n, step):   # (p - onehot(y)) W = p W - W[y]: no one-hot matrix
            e = min(n, s + step)
            p = _softmax_(xp, Z[s:e, ...] @ self.W_out.T)
            if given is None:
                y = xp.minimum(_inverse_cdf(xp, p, u[s:e]),
                               xp.asarray(V - 1, dtype=xp.int64, device=dev))
            else:
                y = given[s:e]
                y = xp.where(y >= 0, y, xp.zeros_like(y))
            if keep is not None:
                k = xp.astype(keep[s:e], p.dtype)[:, None]
                g = (p * k) @ self.W_out - xp.take(self.W_out, y, axis=0) * k
            else:
                g = p @ self.W_out - xp.take(self.W_out, y, axis=0)
            del p
            parts.append(g)
        g = parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)
        return xp.reshape(g, tuple(z.shape))

    def _top(self, xp, p, K):
        """The indices of the ``K`` largest entries of each row of ``p`` (any order)."""
        if _xp.is_numpy(xp):
            idx = np.argpartition(np.asarray(p), p.shape[-1] - K, axis=-1)[:, p.shape[-1] - K:]
            return xp.asarray(idx.astype(np.int64))
        return xp.astype(xp.argsort(p, axis=-1, descending=True)[:, :K], xp.int64)

    def _grad_rows(self, xp, z, ctx: HeadContext):
        """``draws`` gradient rows per position (``"sample:K"``, ``"fisher:K"``), stacked
        copy-major along the first axis: ``(draws·B, T, d)``."""
        lead = tuple(z.shape[:-1])
        d = z.shape[-1]
        dev = _xp.device(z)
        R, V, W = self.draws, self.W_out.shape[0], self.W_out
        keep = None if ctx.mask is None else xp.reshape(ctx.mask, (-1,))
        Z = xp.reshape(z, (-1, d))
        n = Z.shape[0]
        rng = np.random.default_rng((int(ctx.seed), int(ctx.batch_index)))
        if self.estimator == "sample":
            u = xp.reshape(xp.asarray(rng.random((R,) + lead), device=dev), (R, -1))
        else:   # a random sign per row and position: the cross-position products average out
            sign = rng.integers(0, 2, size=(R,) + lead).astype(np.float64) * 2.0 - 1.0
            sign = xp.reshape(xp.asarray(sign, dtype=z.dtype, device=dev), (R, -1))
        step = self.rows_per_chunk(xp.finfo(z.dtype).bits // 8)
        top_k = min(self.k, V)
        out = [[] for _ in range(R)]
        for s in range(0, n, step):
            e = min(n, s + step)
            p = _softmax_(xp, Z[s:e, ...] @ W.T)
            k = None if keep is None else xp.astype(keep[s:e], p.dtype)[:, None]
            rows = []
            if self.estimator == "sample":
                ys = [xp.minimum(_inverse_cdf(xp, p, u[r, s:e]),
                                 xp.asarray(V - 1, dtype=xp.int64, device=dev))
                      for r in range(R)]
                pW = p @ W
                del p
                for y in ys:
                    rows.append(pW - xp.take(W, y, axis=0))
            else:   # the top-K terms √p_y (p − e_y), then the remainder's mean row √q (m − p)
                top = self._top(xp, p, top_k)                          # (b, K)
                pt = xp.take_along_axis(p, top, axis=-1)
                vocab = xp.arange(V, dtype=xp.int64, device=dev)
                hit = xp.zeros(p.shape, dtype=xp.bool, device=dev)
                for j in range(top_k):
                    hit = hit | (vocab[None, :] == top[:, j:j + 1])
                p_rest = xp.where(hit, xp.zeros_like(p), p)
                del hit, p
                q = xp.sum(p_rest, axis=-1, keepdims=True)             # (b, 1)
                restW = p_rest @ W
                del p_rest
                Wy = [xp.take(W, top[:, j], axis=0) for j in range(top_k)]
                pW = restW
                for j in range(top_k):
                    pW = pW + pt[:, j:j + 1] * Wy[j]
                c = math.sqrt(R)   # the driver averages the R rows: undo the 1/R
                for j in range(top_k):
                    rows.append((c * xp.sqrt(pt[:, j:j + 1])) * (pW - Wy[j]))
                if R > top_k:
                    q_safe = xp.where(q > 0, q, xp.ones_like(q))
                    rows.append(c * (restW / xp.sqrt(q_safe) - xp.sqrt(q) * pW))
            for r, g in enumerate(rows):
                if self.estimator == "fisher":
                    g = g * sign[r, s:e, None]
                out[r].append(g if k is None else g * k)
        cat = (lambda a: a[0] if len(a) == 1 else xp.concat(a, axis=0))
        g = xp.concat([cat(o) for o in out], axis=0)
        return xp.reshape(g, (R * lead[0],) + lead[1:] + (d,))

    def token_losses(self, xp, z, ctx: HeadContext):
        """``−log softmax(z W_outᵀ)[label]`` per position (``NaN`` where there is no label);
        only for given labels (``"true"`` or a list)."""
        lead = tuple(z.shape[:-1])
        given = self._given_labels(xp, lead, ctx, _xp.device(z))
        if given is None:
            raise ValueError(f"head {stage_label(self)}: token_losses needs given labels")
        lp = self.log_softmax(xp, z)
        V = self.W_out.shape[0]
        y = xp.where(given >= 0, given, xp.zeros_like(given))
        onehot = xp.astype(y[..., None] == xp.arange(V, dtype=xp.int64, device=_xp.device(z)),
                           lp.dtype)
        nll = -xp.sum(lp * onehot, axis=-1)
        ok = given >= 0
        if ctx.mask is not None:
            ok = ok & ctx.mask
        return xp.where(ok, nll, xp.full_like(nll, math.nan))


LABEL_ESTIMATORS = ("sample", "sample:K", "fisher:K", "true")


def parse_labels(spec: str, vocab: int, owner: str = "labels"):
    """``(estimator, K, rows per position)`` of a label estimator ``"sample"``, ``"sample:K"``,
    ``"fisher:K"`` or ``"true"`` (see :class:`LMHead`); a clear error for anything else."""
    if not isinstance(spec, str):
        raise ValueError(f"{owner}: labels must be None, 'true', 'sample', 'sample:K' or "
                         f"'fisher:K' (K a positive integer), got {spec!r}")
    kind, sep, k = spec.partition(":")
    if kind == "true" and not sep:
        return "true", 1, 1
    if kind == "sample" and not sep:
        return "sample", 1, 1
    if kind in ("sample", "fisher") and sep:
        try:
            K = int(k)
        except ValueError:
            K = 0
        if K >= 1 and k.strip() == k and k.isdigit():
            if kind == "sample":
                return "sample", K, K
            return "fisher", K, (K + 1 if K < vocab else vocab)
        raise ValueError(f"{owner}: labels {spec!r}: K must be a positive integer (e.g. "
                         f"'{kind}:8')")
    raise ValueError(f"{owner}: labels must be None, 'true', 'sample', 'sample:K' or "
                     f"'fisher:K' (K a positive integer), got {spec!r}")


def _softmax_(xp, a):
    """Softmax over the last axis of the caller's temporary ``a``, formed in its memory
    (numpy, cupy; ``a`` is overwritten), elsewhere with one array of ``a``'s size more."""
    a -= xp.max(a, axis=-1, keepdims=True)
    if _xp.is_numpy(xp) or _xp.is_cupy(xp):
        xp.exp(a, out=a)
    else:
        a = xp.exp(a)
    a /= xp.sum(a, axis=-1, keepdims=True)
    return a


#: columns per block of :func:`_inverse_cdf`'s two-level running sum
_CDF_BLOCK = 512


def _inverse_cdf(xp, p, u):
    """``#{j : c_j < u_t}`` for every row ``t`` of ``p`` ``(b, V)``, where ``c`` is the float64
    running sum of the row: the count that ``sum(cumulative_sum(astype(p, float64)) < u)``
    gives (the label drawn by the inverse CDF, before clamping to ``V - 1``), without a
    float64 copy of ``p`` or a running sum over the whole vocabulary.

    Two levels: float64 sums of blocks of :data:`_CDF_BLOCK` columns locate the block where
    ``u`` falls, and the running sum inside that block only gives the count. Any two orders
    of summing the same non-negative terms differ by at most about ``V·2⁻⁵³`` times the row
    sum, so the count is the running sum's whenever ``u`` is farther than that from every
    partial sum the two levels look at; a row where it is not (probability of order 1e-11
    per row) is counted from its whole running sum, as before.
    """
    b, V = p.shape
    f64, dev = xp.float64, _xp.device(p)
    blk = min(_CDF_BLOCK, V)
    nf = V // blk                       # full blocks; the rest is one shorter block
    sums = xp.sum(xp.reshape(p[:, :nf * blk], (b, nf, blk)), axis=-1, dtype=f64)
    if nf * blk < V:
        sums = xp.concat([sums, xp.sum(p[:, nf * blk:], axis=-1, dtype=f64,
                                       keepdims=True)], axis=1)
    nb = sums.shape[1]
    ends = xp.cumulative_sum(sums, axis=-1)
    starts = xp.concat([xp.zeros((b, 1), dtype=f64, device=dev), ends[:, :-1]], axis=1)
    uu = u[:, None]
    k = xp.sum(xp.astype(ends < uu, xp.int64), axis=-1)           # blocks wholly below u
    kk = xp.minimum(k, xp.asarray(nb - 1, dtype=xp.int64, device=dev))[:, None]
    cols = kk * blk + xp.arange(blk, dtype=xp.int64, device=dev)[None, :]
    valid = cols < V
    cols = xp.minimum(cols, xp.asarray(V - 1, dtype=xp.int64, device=dev))
    start = xp.take_along_axis(starts, kk, axis=1)
    c = start + xp.cumulative_sum(xp.astype(xp.take_along_axis(p, cols, axis=1), f64), axis=-1)
    y = kk[:, 0] * blk + xp.sum(xp.astype((c < uu) & valid, xp.int64), axis=-1)
    # the margin: twice a bound on either order's rounding (with room for the block levels)
    tol = 2.0 * (V + 2 * blk + nb + 4) * 2.0 ** -53 * (ends[:, -1:] + 1e-300)
    far = xp.where(valid, xp.abs(c - uu), xp.full_like(c, math.inf))
    end = xp.take_along_axis(ends, kk, axis=1)
    ok = ((uu - start > 4 * tol) & ((k[:, None] >= nb) | (end - uu > 4 * tol))
          & (xp.min(far, axis=-1, keepdims=True) > 3 * tol))[:, 0]
    if not bool(xp.all(ok)):
        bad = xp.nonzero(~ok)[0]
        cdf = xp.cumulative_sum(xp.astype(xp.take(p, bad, axis=0), f64), axis=-1)
        y[bad] = xp.sum(xp.astype(cdf < xp.take(u, bad, axis=0)[:, None], xp.int64), axis=-1)
    return y


def _log_softmax(xp, a):
    s = a - xp.max(a, axis=-1, keepdims=True)
    return s - xp.log(xp.sum(xp.exp(s), axis=-1, keepdims=True))


# --------------------------------------------------------------------------------------------
# calibration batches
# --------------------------------------------------------------------------------------------
def pad_batches(sequences, *, batch_size: int, xp=None, device=None, sort: bool = True):
    """Token lists → right-padded id batches ``(B, T)`` (int64, padding ``-1``).

    With ``sort`` (default) the sequences are ordered by length, longest first, so that each
    batch pads little. Returns ``(batches, order)``: ``order[k]`` lists the indices of the
    input sequences in batch ``k``, row by row.
    """
    seqs = [list(s) for s in sequences]
    if not seqs:
        raise ValueError("sequences is empty: give at least one token sequence")
    for i, s in enumerate(seqs):
        if not s:
            raise ValueError(f"sequence {i} is empty")
        if min(s) < 0:
            raise ValueError(f"sequence {i} holds a negative token id ({min(s)})")
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if xp is None:
        import array_api_compat.numpy as xp
    idx = sorted(range(len(seqs)), key=lambda i: -len(seqs[i])) if sort else list(range(len(seqs)))
    batches, order = [], []
    for s in range(0, len(idx), int(batch_size)):
        rows = idx[s:s + int(batch_size)]
        T = max(len(seqs[i]) for i in rows)
        a = np.full((len(rows), T), -1, dtype=np.int64)
        for r, i in enumerate(rows):
            a[r, :len(seqs[i])] = seqs[i]
        batches.append(xp.asarray(a) if device is None else xp.asarray(a, device=device))
        order.append(rows)
    return batches, order
