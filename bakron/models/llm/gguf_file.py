"""Read a Llama-family model from a GGUF file (llama.cpp's format) with the ``gguf`` package.

Every tensor is de-quantized to float (``gguf.quants.dequantize``: F32, F16, BF16, Q4_0, Q4_1,
Q8_0, the K-quants, ...); the result is "the original model" every comparison refers to.

llama.cpp stores the rows of ``attn_q`` and ``attn_k`` of ``llama`` models permuted for its
interleaved rotary layout: within each head the rows come as pairs (i, i + head_dim/2). This
reader undoes that permutation, so the weights follow the Hugging Face ``LlamaForCausalLM``
convention ("rotate_half" RoPE). Qwen3 files keep the Hugging Face order and are not touched.
"""
from __future__ import annotations

import pathlib

import numpy as np

from .._fetch import ModelUnavailableError
from .config import LlamaConfig, UnsupportedModelError, check_weights
from .tokenizer import Tokenizer

__all__ = ["read_gguf", "unpermute_rows", "permute_rows", "GGUFModel"]


class GGUFModel:
    """What :func:`read_gguf` returns: ``config``, ``weights`` (GGUF names, numpy arrays),
    ``tokenizer`` and ``metadata`` (the scalar and string key/values)."""

    def __init__(self, config, weights, tokenizer, metadata):
        self.config, self.weights, self.tokenizer, self.metadata = (config, weights, tokenizer,
                                                                    metadata)


def permute_rows(W, n_heads: int):
    """llama.cpp's row order for Q/K of ``n_heads`` heads (the inverse of
    :func:`unpermute_rows`)."""
    rows = W.shape[0]
    hd = rows // n_heads
    return W.reshape(n_heads, 2, hd // 2, *W.shape[1:]).swapaxes(1, 2).reshape(W.shape)


def unpermute_rows(W, n_heads: int):
    """Hugging Face row order for the Q/K weight ``W`` (rows = n_heads x head_dim) of a
    llama.cpp file: within each head, row ``2j + a`` goes to ``a·head_dim/2 + j``."""
    rows = W.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even size")
    hd = rows // n_heads
    return W.reshape(n_heads, hd // 2, 2, *W.shape[1:]).swapaxes(1, 2).reshape(W.shape)


def _field_value(field):
    """A metadata value as a Python object (works on every gguf release: reads the parts)."""
    from gguf import GGUFValueType

    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    v = field.parts[field.data[0]]
    if v.dtype == np.float32:   # the shortest decimal: 1e-5 stored as float32 reads 1e-05
        return float(str(v.reshape(-1)[0]))
    return v.tolist()[0]


_BIG = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores")


def _config(meta: dict, names: set, n_tokens: int, source: str,
            freq_factors=None) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen3"):
        raise UnsupportedModelError(f"{source}: architecture {arch!r} is not supported (only "
                                    f"llama and qwen3)")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) and not (scaling == "llama3" and freq_factors is not None):
        raise UnsupportedModelError(f"{source}: RoPE scaling {scaling!r} is not implemented "
                                    f"(only Llama 3's, stored as the rope_freqs tensor)")

    def get(key, default=None):
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is None:
            raise ModelUnavailableError(f"{source}: metadata key {full!r} is missing; the "
                                        f"file is incomplete or corrupt")
        return default

    d = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    return LlamaConfig(
        arch=arch, vocab_size=int(get("vocab_size", n_tokens)), hidden_size=d,
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", d // heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names, qk_norm=(arch == "qwen3"),
        max_positions=int(get("context_length", 2048)),
        rope_freq_factors=None if freq_factors is None else tuple(
            float(f) for f in np.asarray(freq_factors, dtype=np.float64).reshape(-1)),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"))


def _dequantize(dequantize, t, source):
    try:
        return dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"{source}: tensor {t.name!r} has type {t.tensor_type.name}, which the gguf "
            f"package cannot de-quantize") from None
    except Exception as exc:
        raise ModelUnavailableError(f"{source}: tensor {t.name!r} is unreadable ({exc}); "
                                    f"the file is corrupt or truncated") from None


def read_gguf(path, *, dtype="float32", tokenizer: bool = True) -> GGUFModel:
    """Config, de-quantized weights (numpy, ``dtype``) and tokenizer of a GGUF file.

    Raises :class:`~bakron.models._fetch.ModelUnavailableError` for a missing, truncated or
    corrupt file and :class:`~bakron.models.llm.config.UnsupportedModelError` for an
    architecture, tensor type or tokenizer it does not implement.
    """
    path = pathlib.Path(path)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    if not path.is_file():
        raise ModelUnavailableError(f"GGUF file {path} does not exist")
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError as exc:
        raise ImportError(f"reading GGUF files needs the gguf package ({exc}); install "
                          f"bakron[llm]") from None
    source = str(path)
    try:
        reader = GGUFReader(str(path), "r")
    except Exception as exc:   # bad magic, truncated header/data, unknown value types
        raise ModelUnavailableError(f"{source} is not a readable GGUF file ({type(exc).__name__}"
                                    f": {exc}); it is corrupt or truncated") from None
    meta, big = {}, {}
    for key, field in reader.fields.items():
        try:
            (big if key in _BIG else meta)[key] = _field_value(field)
        except Exception as exc:
            raise ModelUnavailableError(f"{source}: metadata {key!r} is unreadable ({exc}); "
                                        f"the file is corrupt") from None
    names = {t.name for t in reader.tensors}
    tokens = big.get("tokenizer.ggml.tokens") or []
    factors = None
    for t in reader.tensors:   # Llama 3's RoPE stretch: one divisor per rotary frequency
        if t.name == "rope_freqs.weight":
            factors = _dequantize(dequantize, t, source)
    cfg = _config(meta, names, len(tokens), source, factors)
    weights = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        # np.array copies: F32 tensors come back as views of the memory map
        W = np.array(_dequantize(dequantize, t, source), dtype=dtype)
        if cfg.arch == "llama" and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            W = unpermute_rows(W, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
        weights[t.name] = np.ascontiguousarray(W)
    check_weights(cfg, weights, source=source)
    tok = None
    if tokenizer:
        if not tokens or "tokenizer.ggml.merges" not in big:
            raise UnsupportedModelError(f"{source}: no BPE tokenizer in the metadata "
                                        f"(tokenizer.ggml.tokens / merges)")
        tok = Tokenizer.from_gguf_fields(
            model=meta.get("tokenizer.ggml.model", "?"), pre=meta.get("tokenizer.ggml.pre"),
            tokens=tokens, merges=big["tokenizer.ggml.merges"],
            token_types=big.get("tokenizer.ggml.token_type"), bos_id=cfg.bos_id,
            eos_id=cfg.eos_id, source=source)
    return GGUFModel(cfg, weights, tok, meta)
