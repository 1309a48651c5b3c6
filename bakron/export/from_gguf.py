"""A Hugging Face model folder from a GGUF file (the reverse of llama.cpp's converter).

:func:`gguf_to_hf` writes ``config.json`` (:meth:`~bakron.models.llm.LlamaConfig.to_hf`),
``model.safetensors`` under the Hugging Face tensor names, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``. Tensors stored as F32, F16 or BF16
keep their type and bits, except the F32 vectors (norms) of a model whose matrices are F16 or
BF16, which are stored in the matrices' type where that is exact (llama.cpp's converter and
:func:`~bakron.export.gguf_source_from_hf` widen them to F32); quantized tensors (Q4_0, Q8_0, the K-quants, ...) are stored as the
float32 values the ``gguf`` package de-quantizes them to. The rows of ``attn_q`` / ``attn_k``
of ``llama`` files are put back into the Hugging Face order with the LLM loader's own
permutation (:func:`bakron.models.llm.gguf_file.unpermute_rows`).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from .. import _safetensors
from ..io import InputError, atomic_output_dir

__all__ = ["gguf_to_hf"]

_FLOAT_TYPES = {"F32": ("F32", np.float32), "F16": ("F16", np.float16), "BF16": ("BF16", None)}
_TORCH_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def check_tensor_names(path, names=None) -> None:
    """``UnsupportedModelError`` naming the first tensor of the GGUF ``path`` that has no
    Hugging Face name (a tensor outside a ``llama`` / ``qwen3`` model)."""
    from ..models.llm.config import UnsupportedModelError
    from ..models.llm.hf_folder import hf_name

    if names is None:
        from ..models.llm.gguf_header import read_header

        names = [t.name for t in read_header(path).tensors]
    for name in names:
        try:
            hf_name(name)
        except KeyError:
            raise UnsupportedModelError(f"{path}: tensor {name!r} has no Hugging Face "
                                        f"counterpart in a llama or qwen3 model") from None


def _hf_tensors(path, model):
    """{Hugging Face name: (array, safetensors dtype)} of the GGUF ``path`` read as
    ``model`` (:func:`~bakron.models.llm.gguf_file.read_gguf`'s result)."""
    from ..models.llm.gguf_file import unpermute_rows
    from ..models.llm.gguf_header import read_header, type_name
    from ..models.llm.hf_folder import hf_name

    cfg = model.config
    out = {}
    tensors = read_header(path).tensors
    check_tensor_names(path, [t.name for t in tensors])
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in tensors:
        name = hf_name(t.name)
        kind = type_name(t)
        if kind in _FLOAT_TYPES:
            dtype, np_type = _FLOAT_TYPES[kind]
            raw = data[t.start:t.start + t.nbytes]
            a = raw.view(np.uint16) if kind == "BF16" else raw.view(np_type)
            a = a.reshape(model.weights[t.name].shape)
        else:   # quantized: the values the loader de-quantized (float32)
            dtype, a = "F32", model.weights[t.name]
        if cfg.arch == "llama" and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            if kind in _FLOAT_TYPES:   # the loader's weights are already in HF order
                heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
                a = unpermute_rows(a, heads)
        out[name] = (np.ascontiguousarray(a), dtype)
    return out


def _narrow_vectors(tensors, dtype):
    """``tensors`` with each F32 vector (a norm: llama.cpp's converter keeps them in F32 in a
    16-bit model) stored as ``dtype`` (the matrices' F16 or BF16) where that is exact, so a
    Hugging Face folder converted to GGUF and back has its own tensor types again."""
    if dtype == "F32":
        return tensors
    out = dict(tensors)
    for name, (a, d) in tensors.items():
        if d != "F32" or a.ndim != 1:
            continue
        a = np.ascontiguousarray(a, dtype=np.float32)
        if dtype == "BF16":
            bits = a.view(np.uint32)
            if not np.any(bits & 0xFFFF):
                out[name] = ((bits >> 16).astype(np.uint16), "BF16")
        else:
            with np.errstate(over="ignore"):
                h = a.astype(np.float16)
            if np.array_equal(h.astype(np.float32), a):
                out[name] = (h, "F16")
    return out


def _tokenizer_files(model) -> dict:
    """{file name: JSON-able dict or text} of the tokenizer the GGUF metadata describes."""
    tok, cfg, meta = model.tokenizer, model.config, model.metadata
    files = {"tokenizer.json": tok.to_json()}
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_positions,
            "clean_up_tokenization_spaces": False}
    for key, tid in (("bos_token", cfg.bos_id), ("eos_token", cfg.eos_id),
                     ("pad_token", meta.get("tokenizer.ggml.padding_token_id")),
                     ("unk_token", meta.get("tokenizer.ggml.unknown_token_id"))):
        if tid is not None and int(tid) in by_id:
            conf[key] = by_id[int(tid)]
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in meta:
            conf[key] = bool(meta[f"tokenizer.ggml.{key}"])
    if isinstance(meta.get("tokenizer.chat_template"), str):
        conf["chat_template"] = meta["tokenizer.chat_template"]
    files["tokenizer_config.json"] = conf
    return files


def gguf_to_hf(gguf_path, out_dir) -> Path:
    """Write the Hugging Face folder ``out_dir`` (must not exist; built atomically) of the
    ``llama`` or ``qwen3`` GGUF file ``gguf_path``. Returns ``out_dir``.

    Raises :class:`~bakron.models.llm.UnsupportedModelError` (a ``ValueError``) for what has
    no Hugging Face form here (another architecture, llama.cpp's ``rope_freqs`` stretch, a
    tensor outside the model), the loader's errors for an unreadable file, and
    :class:`~bakron.io.OutputExistsError` when ``out_dir`` exists.
    """
    from ..models.llm.gguf_file import read_gguf

    src = Path(gguf_path)
    if not src.is_file():
        raise InputError(f"{src}: no such GGUF file")
    model = read_gguf(src, dtype="float32")
    cfg = model.config
    config = cfg.to_hf()
    tensors = _hf_tensors(src, model)
    mats = Counter(d for a, d in tensors.values() if a.ndim == 2)
    config["torch_dtype"] = _TORCH_DTYPES[mats.most_common(1)[0][0]] if mats else "float32"
    if mats:
        tensors = _narrow_vectors(tensors, mats.most_common(1)[0][0])
    gen = {k: v for k, v in (("bos_token_id", cfg.bos_id), ("eos_token_id", cfg.eos_id))
           if v is not None}
    tok_files = _tokenizer_files(model) if model.tokenizer is not None else {}
    with atomic_output_dir(out_dir) as tmp:
        _safetensors.save(tmp / "model.safetensors", {k: a for k, (a, _d) in tensors.items()},
                          {"format": "pt"}, bf16={k for k, (_a, d) in tensors.items()
                                                  if d == "BF16"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        for name, content in tok_files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=2) + "\n"
            (tmp / name).write_text(text, encoding="utf-8")
    return Path(out_dir)
