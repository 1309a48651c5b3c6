"""A Llama-family causal LM (Llama, SmolLM2, Qwen3) in numpy/cupy: full-sequence forward passes
and key/value-cached generation (:mod:`~bakron.models.llm.generate`).

The forward pass *is* the chain of :mod:`bakron.hessian.transformer` stages (one
implementation for inference and for the global Hessian factors):

``Embedding → [Residual([RMSNorm, Attention]), Residual([RMSNorm, SwiGLU])] × L → RMSNorm →
LMHead``

Batches are right-padded with ``-1`` and sorted by length; with the causal mask a real token
never sees padding, so a padded batch gives the same numbers as one sequence at a time.

Example
-------
>>> from bakron.models import load_llm
>>> lm = load_llm("smollm2")                            # doctest: +SKIP
>>> ids = lm.tokenize(["The capital of France is"])[0]  # doctest: +SKIP
>>> lp = lm.log_probs(ids)                              # (T, vocab) log-softmax   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import numpy as np

from ... import _xp
from .config import LINEAR_KINDS, LlamaConfig, check_weights, linear_names

__all__ = ["CausalLM"]


def _namespace(xp):
    if xp is None:
        import array_api_compat.numpy as xp
        return xp
    return _xp.namespace(xp.empty((0,)))   # plain numpy / cupy modules -> their compat namespace


class CausalLM:
    """The model: ``config`` (:class:`LlamaConfig`), ``weights`` (GGUF names, arrays of ``xp``
    in ``dtype``), ``tokenizer`` and the forward pass.

    Parameters
    ----------
    config : LlamaConfig
    weights : mapping
        ``{GGUF tensor name: array}`` (numpy or ``xp`` arrays; converted once, never modified).
    tokenizer : :class:`~bakron.models.llm.tokenizer.Tokenizer`, optional
    xp : array namespace, optional
        numpy (default) or cupy; ``device`` places the weights.
    dtype : {"float32", "float64"}
    chunk_bytes : int
        The LM head's logits buffer for the Hessian passes (see
        :class:`bakron.hessian.LMHead`).
    """

    def __init__(self, config: LlamaConfig, weights: Mapping, tokenizer=None, *, xp=None,
                 device=None, dtype="float32", chunk_bytes: int = 1 << 26, source: str = ""):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        if str(dtype) not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        check_weights(config, weights, source=source or "weights")
        xp = _namespace(xp)
        self.config, self.tokenizer, self.xp, self.device = config, tokenizer, xp, device
        self.dtype = str(dtype)
        self.source = source
        self.chunk_bytes = int(chunk_bytes)
        dt = getattr(xp, self.dtype)
        self.weights = {k: self._convert(v, dt) for k, v in weights.items()
                        if k in _wanted(config)}
        self._body = self._build_body()

    def __repr__(self):
        c = self.config
        return (f"CausalLM({c.arch}, {c.num_layers} blocks, d={c.hidden_size}, "
                f"heads={c.num_heads}/{c.num_kv_heads}, vocab={c.vocab_size}, {self.dtype}, "
                f"xp={getattr(self.xp, '__name__', self.xp)}"
                + (f", source={self.source!r})" if self.source else ")"))

    # -- construction --------------------------------------------------------------------
    def _convert(self, a, dt):
        xp = self.xp
        try:
            same = _xp.namespace(a) is xp
        except TypeError:
            same = False
        if same and (self.device is None or _xp.device(a) == self.device):
            return a if a.dtype == dt else xp.astype(a, dt)
        host = np.asarray(_xp.to_numpy(a), dtype=self.dtype)
        return xp.asarray(host) if self.device is None else xp.asarray(host, device=self.device)

    def _build_body(self):
        from ...hessian import Attention, Embedding, Residual, RMSNorm, SwiGLU

        c, w = self.config, self.weights
        body = [Embedding(w["token_embd.weight"], name="token_embd")]
        for i in range(c.num_layers):
            b = f"blk.{i}."
            attn = Attention(
                w[b + "attn_q.weight"], w[b + "attn_k.weight"], w[b + "attn_v.weight"],
                w[b + "attn_output.weight"], num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                q_norm=w.get(b + "attn_q_norm.weight"), k_norm=w.get(b + "attn_k_norm.weight"),
                eps=c.rms_eps, rope_scaling=c.rope_scaling_dict(),
                names=LINEAR_KINDS[:4])
            if c.rope_freq_factors is not None:   # llama.cpp's form of Llama 3's RoPE stretch
                attn.inv_freq = (attn.inv_freq / np.asarray(c.rope_freq_factors,
                                                            dtype=np.float32)).astype(np.float32)
            body.append(Residual([RMSNorm(w[b + "attn_norm.weight"], eps=c.rms_eps,
                                          name=b + "attn_norm"), attn], name=f"blk.{i}"))
            ffn = SwiGLU(w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"],
                         w[b + "ffn_down.weight"], names=LINEAR_KINDS[4:])
            body.append(Residual([RMSNorm(w[b + "ffn_norm.weight"], eps=c.rms_eps,
                                          name=b + "ffn_norm"), ffn], name=f"blk.{i}"))
        body.append(RMSNorm(w["output_norm.weight"], eps=c.rms_eps, name="output_norm"))
        return body

    @property
    def output_weight(self):
        """The LM head's ``(vocab, d)`` matrix (the embedding table when tied)."""
        return self.weights["token_embd.weight" if self.config.tie_embeddings
                            else "output.weight"]

    def _head(self, labels=None):
        from ...hessian import LMHead

        return LMHead(self.output_weight, labels=labels, chunk_bytes=self.chunk_bytes,
                      name="output")

    def stages(self, labels=None) -> list:
        """The chain for :func:`bakron.hessian.global_factors`: Embedding, two Residual blocks
        per layer, the final RMSNorm and the LM head (``labels``: ``None`` samples from the
        model, the Fisher of the KL; ``"true"`` uses the next tokens; see
        :class:`bakron.hessian.LMHead`). Factor keys are :meth:`linear_names`."""
        return list(self._body) + [self._head(labels)]

    def linear_names(self) -> list[str]:
        """``blk.{i}.attn_q`` ... ``blk.{i}.ffn_down`` for every block, in forward order."""
        return linear_names(self.config)

    def linear_weight(self, name: str):
        """The ``(out, in)`` weight of linear layer ``name`` (e.g. ``"blk.0.attn_q"``)."""
        key = name if name.endswith(".weight") else name + ".weight"
        if name.removesuffix(".weight") not in set(self.linear_names()):
            raise KeyError(f"no linear layer named {name!r} (names look like 'blk.0.attn_q')")
        return self.weights[key]

    def with_weights(self, new_weights: Mapping) -> "CausalLM":
        """A model with some linear weights replaced (``{"blk.0.attn_q": W_hat, ...}``); the
        other arrays are shared with this model, nothing is modified."""
        names = set(self.linear_names())
        merged = dict(self.weights)
        for k, W in new_weights.items():
            base = k.removesuffix(".weight")
            if base not in names:
                raise KeyError(f"new_weights: {k!r} is not a linear layer of this model "
                               f"(names look like 'blk.0.attn_q')")
            want = tuple(self.weights[base + ".weight"].shape)
            if tuple(W.shape) != want:
                raise ValueError(f"new_weights[{k!r}] has shape {tuple(W.shape)}, the layer "
                                 f"needs {want}")
            merged[base + ".weight"] = W
        return CausalLM(self.config, merged, self.tokenizer, xp=self.xp, device=self.device,
                        dtype=self.dtype, chunk_bytes=self.chunk_bytes, source=self.source)

    # -- tokens --------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no BOS or other special tokens added)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids instead")
        return self.tokenizer.encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return self.tokenizer.decode(ids)

    def _check_sequence(self, ids, what="ids") -> list[int]:
        if isinstance(ids, str):
            raise TypeError(f"{what} must be token ids, not a string; use tokenize() first")
        seq = [int(t) for t in np.asarray(_xp.to_numpy(ids) if hasattr(ids, "shape") else ids,
                                          dtype=np.int64).reshape(-1)]
        if len(seq) == 0:
            raise ValueError(f"{what} is empty: give at least one token")
        if len(seq) > self.config.max_positions:
            raise ValueError(f"{what} has {len(seq)} tokens, longer than the model's context "
                             f"of {self.config.max_positions}")
        lo, hi = min(seq), max(seq)
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"{what} holds token id {lo if lo < 0 else hi}, outside the "
                             f"vocabulary 0..{self.config.vocab_size - 1}")
        return seq

    def pad(self, sequences, *, batch_size: int = 8):
        """Right-padded id batches sorted by length (longest first) and, per batch, the indices
        of its rows in ``sequences``: see :func:`bakron.hessian.pad_batches`."""
        from ...hessian import pad_batches

        if isinstance(sequences, str) or not hasattr(sequences, "__len__"):
            raise TypeError("sequences must be a list of token-id lists")
        if len(sequences) == 0:
            raise ValueError("sequences is empty: give at least one token sequence")
        seqs = [self._check_sequence(s, f"sequence {i}") for i, s in enumerate(sequences)]
        return pad_batches(seqs, batch_size=batch_size, xp=self.xp, device=self.device)

    # -- forward -------------------------------------------------------------------------
    def _batch(self, ids):
        """A (B, T) id batch of ``xp`` (padding -1) from one sequence or a padded batch."""
        xp = self.xp
        if hasattr(ids, "shape") and len(ids.shape) == 2:
            a = np.asarray(_xp.to_numpy(ids), dtype=np.int64)
            if a.shape[0] == 0 or a.shape[1] == 0:
                raise ValueError(f"ids batch of shape {a.shape} is empty")
            if a.shape[1] > self.config.max_positions:
                raise ValueError(f"ids batch has {a.shape[1]} positions, longer than the "
                                 f"model's context of {self.config.max_positions}")
            if a.max() >= self.config.vocab_size:
                raise ValueError(f"ids batch holds token id {a.max()}, outside the vocabulary "
                                 f"0..{self.config.vocab_size - 1}")
            if (a[:, 0] < 0).any():
                raise ValueError("ids batch has a row that starts with padding (rows must be "
                                 "right-padded and non-empty)")
            single = False
        else:
            a = np.asarray([self._check_sequence(ids)], dtype=np.int64)
            single = True
        dev = {} if self.device is None else {"device": self.device}
        return xp.asarray(a, **dev), single

    def hidden(self, ids):
        """The final-norm hidden states ``(B, T, d)`` (``(T, d)`` for one sequence)."""
        batch, single = self._batch(ids)
        h = batch
        for st in self._body:
            h = st.forward(self.xp, h)
        return h[0, ...] if single else h

    def logits(self, ids):
        """Logits over the vocabulary: ``(T, vocab)`` for one sequence, ``(B, T, vocab)`` for
        a right-padded batch (rows of padded positions are meaningless)."""
        return self._head().logits(self.xp, self.hidden(ids))

    def log_probs(self, ids):
        """``log softmax`` of the logits: ``(T, vocab)`` for one sequence; row ``t`` is the
        distribution of token ``t + 1`` given tokens ``0..t``."""
        return self._head().log_softmax(self.xp, self.hidden(ids))

    def batch_log_probs(self, sequences, *, batch_size: int = 8) -> Iterator:
        """Yield ``(rows, ids, log_probs)`` per right-padded batch sorted by length:
        ``rows`` the indices into ``sequences``, ``ids`` ``(B, T)`` (padding -1),
        ``log_probs`` ``(B, T, vocab)``."""
        batches, order = self.pad(sequences, batch_size=batch_size)
        for rows, ids in zip(order, batches):
            yield rows, ids, self._head().log_softmax(self.xp, self.hidden(ids))

    def next_token_log_probs(self, sequences, *, batch_size: int = 8) -> list[np.ndarray]:
        """``log p(ids[t+1] | ids[:t+1])`` for every sequence: numpy float64 arrays of length
        ``len(ids) - 1``, in input order."""
        xp = self.xp
        out: list = [None] * len(sequences)
        for rows, ids, lp in self.batch_log_probs(sequences, batch_size=batch_size):
            nxt = xp.where(ids[:, 1:] >= 0, ids[:, 1:], xp.zeros_like(ids[:, 1:]))
            got = xp.take_along_axis(lp[:, :-1, :], nxt[..., None], axis=-1)[..., 0]
            got = _xp.to_numpy(got).astype(np.float64)
            for r, i in enumerate(rows):
                out[i] = got[r, :len(sequences[i]) - 1].copy()
        return out

    def generate(self, prompts, max_new_tokens: int = 32, *, temperature: float = 1.0,
                 greedy: bool = False, seed: int = 0, stop=None, batch_size: int = 16,
                 return_logits: bool = False):
        """Continue token-id prompts with a key/value cache (one token's forward pass per
        step): see :func:`bakron.models.llm.generate.generate` for the parameters.

        ``prompts`` is one token-id sequence (the result is then its list of new tokens) or
        a list of them (a list of lists, in input order). Sampling at ``temperature`` with
        ``seed`` is reproducible; ``greedy=True`` takes the argmax at every step.
        """
        from .generate import generate

        single = _is_one_sequence(prompts)
        res = generate(self, [prompts] if single else prompts, max_new_tokens,
                       temperature=temperature, greedy=greedy, seed=seed, stop=stop,
                       batch_size=batch_size, return_logits=return_logits)
        if not single:
            return res
        return (res[0][0], res[1][0]) if return_logits else res[0]

    def greedy(self, ids, max_new_tokens: int = 16, *, stop=None) -> list[int]:
        """Greedy continuation of ``ids`` (key/value-cached, see :meth:`generate`); stops at
        ``stop`` (default the EOS id) or the context length."""
        return self.generate(self._check_sequence(ids), max_new_tokens, greedy=True, stop=stop)


def _is_one_sequence(prompts) -> bool:
    """A flat token-id sequence (list of ints, 1-D array) rather than a list of them."""
    if hasattr(prompts, "shape"):
        return len(prompts.shape) == 1
    if isinstance(prompts, str) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        return False
    return isinstance(prompts[0], (int, np.integer)) and not isinstance(prompts[0], bool)


def _wanted(config: LlamaConfig) -> set:
    from .config import weight_shapes

    return set(weight_shapes(config))
