"""A post-LN BERT encoder in the array API (numpy, cupy, any array-API namespace).

The forward pass is written for inference and for collecting Hessian factors:

- every linear layer is one 2-D GEMM ``(tokens, n) @ W.T`` over the padded batch;
- the weights of any linear layer can be replaced (``weights={name: W_hat}``) without
  touching the model's own arrays;
- an *observer* sees, for each transformer layer of each batch, the intermediate arrays that
  the quantization factors need (see :class:`Observer`).

Linear layers are named ``layer.{i}.{query,key,value,attn_out,ffn_in,ffn_out}``; their
weights ``W`` have shape ``(out, in)`` as in the checkpoint, and ``y = x @ W.T + b``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import numpy as np

from .. import _xp
from .._lib.special import gelu, gelu_derivative  # noqa: F401 (part of this module's API)

__all__ = ["BertConfig", "BertEncoder", "Observer", "LINEAR_KINDS", "linear_name", "gelu"]

#: the six linear layers of one transformer layer, in forward order
LINEAR_KINDS = ("query", "key", "value", "attn_out", "ffn_in", "ffn_out")

_HF_NAMES = {
    "query": "attention.self.query", "key": "attention.self.key",
    "value": "attention.self.value", "attn_out": "attention.output.dense",
    "ffn_in": "intermediate.dense", "ffn_out": "output.dense",
}


def linear_name(layer: int, kind: str) -> str:
    """``layer.{layer}.{kind}`` — the name used for the linear layers everywhere in bakron."""
    if kind not in LINEAR_KINDS:
        raise ValueError(f"kind must be one of {LINEAR_KINDS}, got {kind!r}")
    return f"layer.{layer}.{kind}"


@dataclass(frozen=True)
class BertConfig:
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    layer_norm_eps: float = 1e-12
    max_position_embeddings: int = 512
    vocab_size: int = 30522

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "BertConfig":
        """From a Hugging Face ``config.json`` dictionary (post-LN BERT with exact GELU only)."""
        act = cfg.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"only hidden_act='gelu' (exact erf) is implemented, got {act!r}")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are implemented")
        c = cls(hidden_size=int(cfg["hidden_size"]), num_layers=int(cfg["num_hidden_layers"]),
                num_heads=int(cfg["num_attention_heads"]),
                intermediate_size=int(cfg["intermediate_size"]),
                layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
                vocab_size=int(cfg["vocab_size"]))
        if c.hidden_size % c.num_heads:
            raise ValueError(f"hidden_size {c.hidden_size} is not a multiple of "
                             f"num_attention_heads {c.num_heads}")
        return c


class Observer(Protocol):
    """Receives the intermediate arrays of one transformer layer for one batch.

    ``observe(layer, taps)`` is called once per layer and batch, with ``taps`` a dict of arrays
    in the model's namespace (do not modify them):

    ``mask`` (B, T) bool
        real tokens; ``valid`` (B*T,) bool is the same flattened;
    ``x_attn`` (N, D)
        input of the query/key/value projections (N = number of real tokens);
    ``q``, ``k``, ``v`` (B, H, T, d)
        the heads' queries, keys and values (biases included);
    ``probs`` (B, H, T, T)
        attention probabilities (zero on padded keys);
    ``x_attn_out`` (N, D)
        input of the attention output projection (the concatenated heads' outputs);
    ``ln1_hat``, ``ln1_rstd`` (N, D), (N, 1)
        the normalised pre-LN sum and its reciprocal standard deviation after the attention
        block (``ln1_gamma`` its weight); likewise ``ln2_*`` after the feed-forward block;
    ``x_ffn_in`` (N, D)
        input of the intermediate projection (= the attention block's output);
    ``z_ffn`` (N, F)
        pre-activation of the intermediate layer; ``x_ffn_out`` (N, F) = GELU of it, the input
        of the output projection.
    """

    def observe(self, layer: int, taps: dict) -> None:  # pragma: no cover - protocol
        ...


def _layer_norm(xp, x, gamma, beta, eps):
    """Returns (y, xhat, rstd) with xhat the normalised input and rstd = 1/sqrt(var+eps)."""
    mu = xp.mean(x, axis=-1, keepdims=True)
    xc = x - mu
    var = xp.mean(xc * xc, axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + eps)
    xhat = xc * rstd
    return xhat * gamma + beta, xhat, rstd


class BertEncoder:
    """Post-LN BERT encoder with mean pooling and L2 normalisation (sentence-transformers).

    Parameters
    ----------
    params : mapping
        Hugging Face ``BertModel`` tensor names (``embeddings.word_embeddings.weight``,
        ``encoder.layer.{i}.attention.self.query.weight``, …) to numpy arrays.
    config : BertConfig
    xp : array namespace, optional
        Where to run (default numpy); the parameters are copied there once, as float32.
    device : optional
        Device for ``xp.asarray``.
    """

    def __init__(self, params: Mapping[str, np.ndarray], config: BertConfig, *, xp=None,
                 device=None, dtype: str = "float32"):
        if xp is None:
            import array_api_compat.numpy as xp
        self.xp, self.config, self.device = xp, config, device
        self.dtype = getattr(xp, dtype)
        c = config

        def get(name):
            if name not in params:
                raise KeyError(f"the checkpoint has no tensor {name!r}")
            a = np.asarray(_xp.to_numpy(params[name]), dtype=np.float32)
            return xp.asarray(a, dtype=self.dtype, device=device)

        def check(name, arr, shape):
            if tuple(arr.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {shape}")
            return arr

        D, F = c.hidden_size, c.intermediate_size
        self.word = check("word_embeddings", get("embeddings.word_embeddings.weight"),
                          (c.vocab_size, D))
        self.pos = get("embeddings.position_embeddings.weight")
        self.tok_type = get("embeddings.token_type_embeddings.weight")
        self.emb_ln = (get("embeddings.LayerNorm.weight"), get("embeddings.LayerNorm.bias"))
        shapes = {"query": (D, D), "key": (D, D), "value": (D, D), "attn_out": (D, D),
                  "ffn_in": (F, D), "ffn_out": (D, F)}
        #: linear name -> (W (out, in), b (out,))
        self.linears: dict[str, tuple[Any, Any]] = {}
        self.ln: list[tuple] = []
        for i in range(c.num_layers):
            pre = f"encoder.layer.{i}."
            for kind in LINEAR_KINDS:
                hf = pre + _HF_NAMES[kind]
                W = check(hf + ".weight", get(hf + ".weight"), shapes[kind])
                self.linears[linear_name(i, kind)] = (W, get(hf + ".bias"))
            self.ln.append(((get(pre + "attention.output.LayerNorm.weight"),
                             get(pre + "attention.output.LayerNorm.bias")),
                            (get(pre + "output.LayerNorm.weight"),
                             get(pre + "output.LayerNorm.bias"))))

    # ---------------------------------------------------------------------------------------
    @property
    def linear_names(self) -> list[str]:
        return list(self.linears)

    def weight(self, name: str):
        """The original weight ``W`` (out, in) of a linear layer (the model's array: copy it
        before modifying)."""
        return self.linears[name][0]

    def _check_weights(self, weights):
        if not weights:
            return {}
        out = {}
        for name, W in weights.items():
            if name not in self.linears:
                raise KeyError(f"no linear layer named {name!r}; names are like "
                               f"{self.linear_names[0]!r}")
            ref = self.linears[name][0]
            if tuple(W.shape) != tuple(ref.shape):
                raise ValueError(f"replacement weight for {name} has shape {tuple(W.shape)}, "
                                 f"expected {tuple(ref.shape)}")
            out[name] = self.xp.asarray(W, dtype=self.dtype, device=self.device)
        return out

    def forward(self, ids, mask, *, weights: Mapping | None = None,
                observer: Observer | None = None):
        """Pooled, L2-normalised embeddings ``(B, D)`` of a padded batch.

        ``ids`` (B, T) int and ``mask`` (B, T) bool (numpy or the model's namespace);
        ``weights`` replaces linear weights by name; ``observer`` sees the taps of every layer.
        """
        xp, c = self.xp, self.config
        W_over = self._check_weights(weights)
        ids = xp.asarray(np.asarray(_xp.to_numpy(ids), dtype=np.int64), device=self.device)
        mask = xp.asarray(np.asarray(_xp.to_numpy(mask), dtype=bool), device=self.device)
        B, T = ids.shape
        if T > c.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds {c.max_position_embeddings}")
        H, d, D = c.num_heads, c.head_dim, c.hidden_size
        eps = c.layer_norm_eps

        def lin(name, x):
            W, b = self.linears[name]
            y = xp.matmul(x, xp.matrix_transpose(W_over.get(name, W)))
            y += b
            return y

        x = xp.take(self.word, xp.reshape(ids, (-1,)), axis=0)
        x = xp.reshape(x, (B, T, D)) + self.pos[:T, :][None, :, :] + self.tok_type[0, :]
        h, _, _ = _layer_norm(xp, x, *self.emb_ln, eps)
        h = xp.reshape(h, (B * T, D))
        maskf = xp.astype(mask, self.dtype)
        neg = xp.asarray(np.finfo(np.float32).min, dtype=self.dtype, device=self.device)
        key_bias = xp.where(mask, xp.zeros_like(maskf), neg)[:, None, None, :]   # (B,1,1,T)
        valid = xp.reshape(mask, (-1,))
        scale = 1.0 / math.sqrt(d)

        def heads(y):  # (B*T, D) -> (B, H, T, d)
            return xp.permute_dims(xp.reshape(y, (B, T, H, d)), (0, 2, 1, 3))

        for i in range(c.num_layers):
            (g1, b1), (g2, b2) = self.ln[i]
            q = heads(lin(f"layer.{i}.query", h))
            k = heads(lin(f"layer.{i}.key", h))
            v = heads(lin(f"layer.{i}.value", h))
            s = xp.matmul(q * scale, xp.matrix_transpose(k))
            s += key_bias
            s -= xp.max(s, axis=-1, keepdims=True)
            p = xp.exp(s)
            p /= xp.sum(p, axis=-1, keepdims=True)
            ctx = xp.matmul(p, v)                                         # (B, H, T, d)
            ctx = xp.reshape(xp.permute_dims(ctx, (0, 2, 1, 3)), (B * T, D))
            a_pre = lin(f"layer.{i}.attn_out", ctx) + h
            a, ln1_hat, ln1_rstd = _layer_norm(xp, a_pre, g1, b1, eps)
            z = lin(f"layer.{i}.ffn_in", a)
            g = gelu(xp, z)
            o_pre = lin(f"layer.{i}.ffn_out", g) + a
            h_new, ln2_hat, ln2_rstd = _layer_norm(xp, o_pre, g2, b2, eps)
            if observer is not None:
                sel = (lambda t: t[valid]) if not bool(xp.all(valid)) else (lambda t: t)
                observer.observe(i, {
                    "mask": mask, "valid": valid, "x_attn": sel(h), "q": q, "k": k, "v": v,
                    "probs": p, "x_attn_out": sel(ctx), "ln1_hat": sel(ln1_hat),
                    "ln1_rstd": sel(ln1_rstd), "ln1_gamma": g1, "x_ffn_in": sel(a),
                    "z_ffn": sel(z), "x_ffn_out": sel(g), "ln2_hat": sel(ln2_hat),
                    "ln2_rstd": sel(ln2_rstd), "ln2_gamma": g2,
                })
            h = h_new
        hs = xp.reshape(h, (B, T, D)) * maskf[:, :, None]
        pooled = xp.sum(hs, axis=1) / xp.clip(xp.sum(maskf, axis=1), 1e-9, None)[:, None]
        norm = xp.sqrt(xp.sum(pooled * pooled, axis=1, keepdims=True))
        return pooled / xp.clip(norm, 1e-12, None)
