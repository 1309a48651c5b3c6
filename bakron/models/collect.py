"""Hessian factors of a BERT encoder's linear layers, from the forward pass alone.

:class:`FactorCollector` is an observer for :meth:`bakron.models.bert.BertEncoder.forward`
(and :meth:`bakron.models.minilm.MiniLM.encode`). It accumulates, over the real tokens of
every calibration batch, the statistics behind three kinds of factors; :meth:`factors`
returns them as ``{linear name: (H_in, H_out or None)}``.

``"input"`` — one-sided (LDLQ / GPTQ)
    ``H_I = E[x xᵀ]`` of the layer's input, ``H_O = None`` (``= I``).

``"attention"`` — two-sided, attention-aware (what the attention scores and outputs see)
    * query projection: ``H_O`` is block diagonal over heads, each block the covariance of the
      same head's keys, centred per sequence (softmax ignores a shift common to all the
      scores of a query, so the mean key is invisible): a query error ``δq`` changes the
      scores by ``δq·(k_j − k̄)``, whose sum of squares over the keys is ``δqᵀ C_k δq``;
      ``H_I = E[x xᵀ]``.
    * key projection: ``H_O`` block diagonal over heads, each block ``E[q qᵀ]`` of the same
      head's queries (a key error ``δk_j`` changes the scores by ``q_i·δk_j``);
      ``H_I = E[x xᵀ]``.
    * value projection: attention-weighted ``H_I = (1/H) Σ_h E[x̃_h x̃_hᵀ]`` with
      ``x̃_h,i = Σ_j a_h,ij x_j`` — the error reaching the attention output of head h is
      ``δW_h x̃_h``; one ``H_I`` serves all heads, so it is averaged over them; ``H_O = None``.
    * attention output, intermediate and output projections: ``H_O = None`` (one-sided, the
      same result as ``"input"``).

``"local"`` — two-sided, one operation ahead (Gauss–Newton of the next operation's output)
    * query and key projections: as ``"attention"``;
    * value projection: attention-weighted ``H_I`` as above and ``H_O = W_oᵀ J₁ W_o``, where
      ``W_o`` is the attention output projection and ``J₁ = E[J_tᵀ J_t]`` the mean Gram matrix
      of the Jacobian of the layer norm that follows it
      (``J_t = diag(γ) σ_t⁻¹ (I − 11ᵀ/D − x̂_t x̂_tᵀ/D)``);
    * attention output projection: ``H_O = J₁``; output projection: ``H_O = J₂`` (its layer
      norm);
    * intermediate projection: ``H_O = (W_outᵀ J₂ W_out) ⊙ E[g′ g′ᵀ]`` with ``g′`` the GELU
      derivative at the pre-activation (the Gauss–Newton matrix of ``W_out·GELU(z)`` through
      the next layer norm, with the usual Kronecker decoupling of tokens).

All factors are Kronecker (K-FAC-style) approximations: averages over tokens of the two sides
taken separately. Sums are accumulated in float64 from float32 GEMMs on the model's device.
"""
from __future__ import annotations

import math

from .. import _xp
from .bert import LINEAR_KINDS, gelu_derivative, linear_name

__all__ = ["FactorCollector", "FACTOR_KINDS"]

FACTOR_KINDS = ("input", "attention", "local")


class FactorCollector:
    """Observer that accumulates the statistics of the factors of ``FACTOR_KINDS``.

    Parameters
    ----------
    encoder : BertEncoder
        The model (its weights ``W_o``/``W_out`` enter the ``"local"`` factors).
    kinds : sequence of str
        Which kinds will be asked for (``"input"`` is always collected); leaving out
        ``"local"`` skips its extra statistics.
    layers : iterable of int, optional
        Transformer layers to collect (default all).
    """

    def __init__(self, encoder, kinds=FACTOR_KINDS, layers=None):
        bad = [k for k in kinds if k not in FACTOR_KINDS]
        if bad:
            raise ValueError(f"unknown factor kind(s) {bad}; choose from {FACTOR_KINDS}")
        self.encoder = encoder
        self.xp = encoder.xp
        self.kinds = tuple(dict.fromkeys(("input", *kinds)))
        self.layers = set(range(encoder.config.num_layers) if layers is None else layers)
        self._acc: dict[tuple[int, str], object] = {}
        self._mean: dict[tuple[int, str], tuple] = {}
        self.tokens = 0
        self.sequences = 0

    # -- accumulation --------------------------------------------------------------------
    def _add(self, layer, key, value):
        xp = self.xp
        v = xp.astype(value, xp.float64)
        k = (layer, key)
        if k in self._acc:
            self._acc[k] = self._acc[k] + v
        else:
            self._acc[k] = v

    @staticmethod
    def _gram(xp, X):
        return xp.matmul(xp.matrix_transpose(X), X)

    def observe(self, layer: int, taps: dict) -> None:
        if layer not in self.layers:
            return
        xp = self.xp
        two = "attention" in self.kinds or "local" in self.kinds
        local = "local" in self.kinds
        if layer == min(self.layers):
            self.tokens += int(taps["x_attn"].shape[0])
            self.sequences += int(taps["mask"].shape[0])
        self._add(layer, "xx_attn", self._gram(xp, taps["x_attn"]))
        self._add(layer, "xx_ctx", self._gram(xp, taps["x_attn_out"]))
        self._add(layer, "xx_a", self._gram(xp, taps["x_ffn_in"]))
        self._add(layer, "xx_g", self._gram(xp, taps["x_ffn_out"]))
        if two:
            self._attention(layer, taps)
        if local:
            for ln in ("ln1", "ln2"):
                self._add(layer, ln, _ln_jacobian_gram(xp, taps[f"{ln}_hat"],
                                                       taps[f"{ln}_rstd"], taps[f"{ln}_gamma"]))
            gp = gelu_derivative(xp, taps["z_ffn"])
            self._add(layer, "gg", self._gram(xp, gp))

    def _attention(self, layer, taps):
        xp = self.xp
        mask = taps["mask"]                                   # (B, T)
        mf = xp.astype(mask, taps["q"].dtype)
        q, k, p = taps["q"], taps["k"], taps["probs"]         # (B,H,T,d), (B,H,T,T)
        B, H, T, d = q.shape
        # queries: sum over real tokens of q q^T per head
        qm = q * mf[:, None, :, None]
        self._add(layer, "qq", xp.sum(xp.matmul(xp.matrix_transpose(qm), qm), axis=0))
        # keys: per-sequence centred scatter per head
        n = xp.sum(mf, axis=1)[:, None, None, None]           # (B,1,1,1)
        km = k * mf[:, None, :, None]
        kbar = xp.sum(km, axis=2, keepdims=True) / n
        kc = (k - kbar) * mf[:, None, :, None]
        self._add(layer, "kk", xp.sum(xp.matmul(xp.matrix_transpose(kc), kc), axis=0))
        # value: (1/H) sum_h X^T P_h^T P_h X per sequence, padded query rows removed
        pm = p * mf[:, None, :, None]
        M = xp.sum(xp.matmul(xp.matrix_transpose(pm), pm), axis=1) / H   # (B, T, T)
        X = taps["x_attn"]
        D = X.shape[-1]
        if X.shape[0] != B * T:  # taps hold real tokens only: scatter back to (B, T, D)
            full = xp.zeros((B * T, D), dtype=X.dtype, device=_xp.device(X))
            full[taps["valid"]] = X
            X = full
        X3 = xp.reshape(X, (B, T, D))
        MX = xp.matmul(M, X3)                                  # (B, T, D)
        self._add(layer, "xx_v", xp.matmul(xp.matrix_transpose(xp.reshape(X3, (B * T, D))),
                                           xp.reshape(MX, (B * T, D))))

    # -- results -----------------------------------------------------------------------------
    def _get(self, layer, key):
        """The mean statistic (one array object per key, so that identical factors of
        different kinds are the same object)."""
        if (layer, key) not in self._acc:
            raise RuntimeError(f"no statistics {key!r} for layer {layer}: run the calibration "
                               f"forward pass with this collector (and the needed kinds) first")
        hit = self._mean.get((layer, key))
        if hit is None or hit[0] != self.tokens:
            hit = self._mean[(layer, key)] = (self.tokens,
                                              self._acc[(layer, key)] / max(self.tokens, 1))
        return hit[1]

    def _blockdiag(self, blocks):
        xp = self.xp
        H, d, _ = blocks.shape
        out = xp.zeros((H * d, H * d), dtype=blocks.dtype, device=_xp.device(blocks))
        for h in range(H):
            out[h * d:(h + 1) * d, h * d:(h + 1) * d] = blocks[h, ...]
        return out

    def factors(self, kind: str) -> dict:
        """``{linear name: (H_in, H_out or None)}`` (float64) for every collected layer.

        The same matrix is the same array object across kinds (e.g. ``H_in`` of the query
        projection in ``"input"`` and ``"attention"``), so callers can share work by identity.
        """
        if kind not in self.kinds:
            raise ValueError(f"factor kind {kind!r} was not collected (have {self.kinds})")
        if self.tokens == 0:
            raise RuntimeError("no calibration data was observed")
        out = {}
        for i in sorted(self.layers):
            a = self._arrays(i)
            Hin = {"query": a["xx"], "key": a["xx"], "value": a["xx"], "attn_out": a["xx_ctx"],
                   "ffn_in": a["xx_a"], "ffn_out": a["xx_g"]}
            Hout = dict.fromkeys(LINEAR_KINDS)
            if kind in ("attention", "local"):
                Hout["query"], Hout["key"], Hin["value"] = a["kk"], a["qq"], a["xx_v"]
            if kind == "local":
                Hout.update(value=a["v_out"], attn_out=a["J1"], ffn_out=a["J2"],
                            ffn_in=a["ffn_in_out"])
            for kk in LINEAR_KINDS:
                out[linear_name(i, kk)] = (Hin[kk], Hout[kk])
        return out

    def _arrays(self, i: int) -> dict:
        """Every distinct factor matrix of layer ``i`` (built once per token count)."""
        key = ("arrays", i)
        hit = self._mean.get(key)
        if hit is not None and hit[0] == self.tokens:
            return hit[1]
        xp = self.xp
        a = {"xx": self._get(i, "xx_attn"), "xx_ctx": self._get(i, "xx_ctx"),
             "xx_a": self._get(i, "xx_a"), "xx_g": self._get(i, "xx_g")}
        if "attention" in self.kinds or "local" in self.kinds:
            a["kk"] = self._blockdiag(self._get(i, "kk"))
            a["qq"] = self._blockdiag(self._get(i, "qq"))
            a["xx_v"] = self._get(i, "xx_v")
        if "local" in self.kinds:
            enc = self.encoder
            J1, J2 = self._get(i, "ln1"), self._get(i, "ln2")
            Wo = xp.astype(enc.weight(linear_name(i, "attn_out")), xp.float64)
            Wout = xp.astype(enc.weight(linear_name(i, "ffn_out")), xp.float64)
            a["J1"], a["J2"] = J1, J2
            a["v_out"] = xp.matmul(xp.matmul(xp.matrix_transpose(Wo), J1), Wo)
            a["ffn_in_out"] = xp.matmul(xp.matmul(xp.matrix_transpose(Wout), J2), Wout) \
                * self._get(i, "gg")
        self._mean[key] = (self.tokens, a)
        return a


def _ln_jacobian_gram(xp, xhat, rstd, gamma):
    """``Σ_t J_tᵀ J_t`` for the layer norm ``y = γ ⊙ x̂``, ``x̂ = (x − μ)·rstd`` (closed form).

    ``J_t = Γ rstd_t P_t`` with ``P_t = I − e eᵀ − u_t u_tᵀ``, ``e = 1/√D``, ``u_t = x̂_t/√D``;
    so ``J_tᵀ J_t = rstd_t² P_t Γ² P_t``, expanded into a few D × D GEMMs over the tokens.
    """
    N, D = xhat.shape
    w = xp.reshape(rstd * rstd, (N,))                          # (N,)
    g2 = gamma * gamma                                         # (D,)
    U = xhat * (1.0 / math.sqrt(D))                            # rows u_t
    e = xp.ones((D,), dtype=xhat.dtype, device=_xp.device(xhat)) * (1.0 / math.sqrt(D))
    sw = xp.sum(w)
    Su = xp.matmul(xp.matrix_transpose(U * w[:, None]), U)      # Σ w u uᵀ
    E = e[:, None] * e[None, :]
    S_EU = sw * E + Su                                         # Σ w (E + U_t)
    c = xp.matmul(U, g2 * e)                                   # eᵀΓ²u_t  (N,)
    r = xp.matmul(xp.matrix_transpose(U), w * c)               # Σ w c_t u_t  (D,)
    uGu = xp.matmul(U * U, g2)                                 # u_tᵀΓ²u_t  (N,)
    Suu = xp.matmul(xp.matrix_transpose(U * (w * uGu)[:, None]), U)
    mean_g2 = xp.sum(g2 * e * e)
    G2 = sw * xp.eye(D, dtype=xhat.dtype, device=_xp.device(xhat)) * g2[None, :]
    B = S_EU * g2[None, :]                                     # (Σ w (E+U)) Γ²
    cross = e[:, None] * r[None, :]
    return (G2 - B - xp.matrix_transpose(B) + sw * mean_g2 * E + cross
            + xp.matrix_transpose(cross) + Suu)
