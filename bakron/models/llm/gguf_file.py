"""Read a Llama-family model from a GGUF file (llama.cpp's format).

The header is read and checked by :mod:`~bakron.models.llm.gguf_header` (counts, lengths,
tensor sizes and data offsets), the metadata by :mod:`~bakron.models.llm.schema`, the tensor
table against the configuration before any data is read. Every tensor is then de-quantized to
float (``gguf.quants.dequantize``: F32, F16, BF16, Q4_0, Q4_1, Q8_0, the K-quants, ...) and
checked to be finite in the same pass; the result is "the original model" every comparison
refers to.

llama.cpp stores the rows of ``attn_q`` and ``attn_k`` of ``llama`` models permuted for its
interleaved rotary layout: within each head the rows come as pairs (i, i + head_dim/2). This
reader undoes that permutation, so the weights follow the Hugging Face ``LlamaForCausalLM``
convention ("rotate_half" RoPE). Qwen3 files keep the Hugging Face order and are not touched.
"""
from __future__ import annotations

import pathlib

import numpy as np

from .._fetch import ModelUnavailableError
from .config import LlamaConfig, UnsupportedModelError, check_shapes, weight_shapes
from .gguf_header import read_header
from .schema import FIELDS, ModelFileError, check_tensor_values, check_values, integer
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


_BIG = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores")
_INTEGER_TYPES = ("I8", "I16", "I32", "I64")


def _config(meta: dict, shapes: dict, tokens, source: str, freq_factors=None) -> LlamaConfig:
    arch = meta["general.architecture"]
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) and not (scaling == "llama3" and freq_factors is not None):
        raise UnsupportedModelError(f"{source}: RoPE scaling {scaling!r} is not implemented "
                                    f"(only Llama 3's, stored as the rope_freqs tensor)")

    def key(f):
        k = FIELDS[f][1]
        return k if k.startswith("tokenizer.") else f"{arch}.{k}"

    def get(f, default=None):
        if key(f) in meta:
            return meta[key(f)]
        if default is None:
            raise ModelFileError(f"{source}: metadata key {key(f)!r} is missing; the file is "
                                 f"incomplete or corrupt")
        return default

    d = integer(get("hidden_size"), f"{source}: metadata {key('hidden_size')}")
    heads = integer(get("num_heads"), f"{source}: metadata {key('num_heads')}")
    if key("head_dim") not in meta and d % heads:
        raise ModelFileError(f"{source}: metadata {key('num_heads')}={heads} must divide "
                             f"{key('hidden_size')}={d} (there is no {key('head_dim')})")
    if key("vocab_size") in meta:
        vocab = meta[key("vocab_size")]
    elif tokens is not None:
        vocab = len(tokens)
    else:   # no tokenizer (read with tokenizer=False): the embedding's rows
        vocab = shapes.get("token_embd.weight", (0,))[0]
    values = {
        "vocab_size": vocab, "hidden_size": d, "intermediate_size": get("intermediate_size"),
        "num_layers": get("num_layers"), "num_heads": heads,
        "num_kv_heads": get("num_kv_heads", heads), "head_dim": get("head_dim", d // heads),
        "rope_theta": get("rope_theta", 10000.0), "rms_eps": get("rms_eps"),
        "max_positions": get("max_positions", 2048),
        "bos_id": meta.get(key("bos_id")), "eos_id": meta.get(key("eos_id"))}
    check_values(values, lambda f: f"{source}: metadata {key(f)}")
    if freq_factors is not None and freq_factors.size != values["head_dim"] // 2:
        raise ModelFileError(f"{source}: tensor 'rope_freqs.weight' holds {freq_factors.size} "
                             f"values; head_dim {values['head_dim']} needs "
                             f"{values['head_dim'] // 2}")
    return LlamaConfig(
        arch=arch, tie_embeddings="output.weight" not in shapes, qk_norm=(arch == "qwen3"),
        rope_freq_factors=None if freq_factors is None else tuple(
            float(f) for f in np.asarray(freq_factors, dtype=np.float64).reshape(-1)),
        **values)


_DEQUANTIZABLE: dict = {}


def _check_type(gguf, t, source):
    """Refuse a tensor whose GGML type holds integers or that the gguf package cannot
    de-quantize (a one-block probe, remembered per type)."""
    qtype = gguf.GGMLQuantizationType(t.ggml_type)
    if qtype.name in _INTEGER_TYPES:
        raise ModelFileError(f"{source}: tensor {t.name!r} is stored as {qtype.name}; a "
                             f"model's weights must be floating point (or a GGML "
                             f"quantization type)")
    if qtype not in _DEQUANTIZABLE:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
            _DEQUANTIZABLE[qtype] = True
        except NotImplementedError:
            _DEQUANTIZABLE[qtype] = False
        except Exception:   # other failures show up, named, when the data is read
            _DEQUANTIZABLE[qtype] = True
    if not _DEQUANTIZABLE[qtype]:
        raise UnsupportedModelError(
            f"{source}: tensor {t.name!r} has type {qtype.name}, which the gguf package "
            f"cannot de-quantize")
    return qtype


def _dequantize(gguf, data, t, qtype, source):
    """The float32 values of tensor ``t`` from the file's bytes ``data``."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = data[t.start:t.start + t.nbytes]
    try:
        raw = raw.reshape(*t.shape[:-1], t.shape[-1] // block * size)
        with np.errstate(over="ignore", invalid="ignore"):   # inf/NaN are refused next
            return gguf.quants.dequantize(raw, qtype).reshape(t.shape)
    except Exception as exc:
        raise ModelFileError(f"{source}: tensor {t.name!r} is unreadable ({exc}); the file "
                             f"is corrupt") from None


def read_gguf(path, *, dtype="float32", tokenizer: bool = True) -> GGUFModel:
    """Config, de-quantized weights (numpy, ``dtype``) and tokenizer of a GGUF file.

    Raises :class:`~bakron.models._fetch.ModelUnavailableError` for a missing file,
    :class:`~bakron.models.llm.schema.ModelFileError` (a ``ModelUnavailableError`` and a
    ``ValueError``) for a truncated, corrupt or inconsistent one (bad offsets, counts that
    disagree with the tensors, a tokenizer that does not match the embedding, NaN or
    infinite weights: the message names the key or tensor), and
    :class:`~bakron.models.llm.config.UnsupportedModelError` for an architecture, tensor
    type or tokenizer it does not implement.
    """
    path = pathlib.Path(path)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    if not path.is_file():
        raise ModelUnavailableError(f"GGUF file {path} does not exist")
    try:
        import gguf
        import gguf.quants  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"reading GGUF files needs the gguf package ({exc}); install "
                          f"bakron[llm]") from None
    source = str(path)
    header = read_header(path, source)
    meta = {k: v for k, v in header.metadata.items() if k not in _BIG}
    big = {k: v for k, v in header.metadata.items() if k in _BIG}
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen3"):
        raise UnsupportedModelError(f"{source}: architecture {arch!r} is not supported (only "
                                    f"llama and qwen3)")
    tokens = big.get("tokenizer.ggml.tokens")
    for k, v in big.items():
        if not isinstance(v, list):
            raise ModelFileError(f"{source}: metadata {k!r} must be an array, got "
                                 f"{type(v).__name__}")
    if tokenizer and (tokens is None or "tokenizer.ggml.merges" not in big):
        missing = " and ".join(k for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
                               if k not in big)
        raise ModelFileError(f"{source} has no tokenizer: the metadata lacks {missing} "
                             f"(llama.cpp cannot use it either; read_gguf(..., "
                             f"tokenizer=False) reads the weights alone)")
    by_name = {t.name: t for t in header.tensors}
    qtypes = {t.name: _check_type(gguf, t, source) for t in header.tensors}
    shapes = {t.name: t.shape for t in header.tensors}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    factors = None
    if "rope_freqs.weight" in by_name:   # Llama 3's RoPE stretch: one divisor per frequency
        t = by_name["rope_freqs.weight"]
        factors = _dequantize(gguf, data, t, qtypes[t.name], source).reshape(-1)
        check_tensor_values(factors, t.name, source)
        if not (factors > 0).all():
            raise ModelFileError(f"{source}: tensor 'rope_freqs.weight' holds a divisor <= 0")
    cfg = _config(meta, shapes, tokens, source, factors)
    rows = shapes.get("token_embd.weight", (cfg.vocab_size,))[0]
    if tokens is not None and len(tokens) != rows or rows != cfg.vocab_size:
        key = f"{arch}.vocab_size"
        also = f" and {key} is {cfg.vocab_size}" if key in meta else ""
        raise ModelFileError(
            f"{source}: the tokenizer has {len(tokens) if tokens is not None else 'no'} tokens "
            f"(tokenizer.ggml.tokens), the embedding token_embd.weight {rows} rows{also}; they "
            f"must agree (llama.cpp refuses such a file too)")
    check_shapes(cfg, shapes, source=source, key=f"metadata {arch}.block_count")
    want = weight_shapes(cfg)
    for name in by_name:
        if name.startswith("blk.") and name not in want:
            raise UnsupportedModelError(f"{source}: tensor {name!r} is not part of a {arch} "
                                        f"block as bakron implements it (it would be ignored)")
    weights = {}
    for name in want:
        t = by_name[name]
        # np.array copies: F32 tensors come back as views of the memory map
        W = np.array(_dequantize(gguf, data, t, qtypes[name], source), dtype=dtype)
        check_tensor_values(W, name, source)
        if cfg.arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            W = unpermute_rows(W, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
        weights[name] = np.ascontiguousarray(W)
    del data
    tok = None
    if tokenizer:
        tok = Tokenizer.from_gguf_fields(
            model=meta.get("tokenizer.ggml.model", "?"), pre=meta.get("tokenizer.ggml.pre"),
            tokens=tokens, merges=big["tokenizer.ggml.merges"],
            token_types=big.get("tokenizer.ggml.token_type"), bos_id=cfg.bos_id,
            eos_id=cfg.eos_id, source=source)
    return GGUFModel(cfg, weights, tok, meta)
