"""A float GGUF file from a Hugging Face folder (what llama.cpp's ``convert_hf_to_gguf.py``
writes for ``LlamaForCausalLM`` and ``Qwen3ForCausalLM``), as the source of the GGUF exports.

:func:`gguf_source_from_hf` writes every matrix in its stored type (F32, F16, BF16, same
bits) and every vector (the RMSNorm weights) as F32 (exact, as llama.cpp's converter does:
its CPU kernels have no F16/BF16 form of the norm's multiply and abort on such a file)
under its GGUF name, the rows of ``attn_q`` / ``attn_k`` of ``llama`` models in
llama.cpp's rotary layout (the LLM loader's :func:`~bakron.models.llm.gguf_file.permute_rows`),
the architecture's hyper-parameters, Llama 3's RoPE scaling as llama.cpp's ``rope_freqs``
tensor (:func:`rope_freqs`), and the tokenizer as ``tokenizer.ggml.*``
(:meth:`~bakron.models.llm.tokenizer.Tokenizer.gguf_fields`; the pre-tokenizer's name is
chosen by how ``tokenizer.json`` splits text). :func:`bakron.export.write_gguf` then copies
it with the quantized linears.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from ._files import check_output_file
from ._hf import as_stored, read_folder

__all__ = ["gguf_source_from_hf"]

_FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32}   # gguf.LlamaFileType.ALL_F32, MOSTLY_F16/BF16


def check_tensor_names(folder, names=None) -> None:
    """``UnsupportedModelError`` naming the first tensor of the Hugging Face folder that has
    no GGUF name (a tensor outside a ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``; the
    rotary ``inv_freq`` buffer, which every consumer recomputes, is left out)."""
    from ..models.llm.config import UnsupportedModelError
    from ..models.llm.hf_folder import _shards, gguf_name

    if names is None:
        names = list(_shards(Path(folder)))
    for name in names:
        if gguf_name(name) is None and not name.endswith("rotary_emb.inv_freq"):
            raise UnsupportedModelError(f"{folder}: tensor {name!r} is not part of a llama "
                                        f"or qwen3 model bakron can convert")


def _tensors(gguf, folder, cfg, raw):
    """[(GGUF name, data, GGML type)] of the folder's tensors ``raw`` {HF name: (array,
    dtype)}; the model's own tensors only, checked against the config."""
    from ..models.llm.config import UnsupportedModelError, check_weights
    from ..models.llm.gguf_file import permute_rows
    from ..models.llm.hf_folder import gguf_name

    Q = gguf.GGMLQuantizationType
    check_tensor_names(folder, list(raw))
    named = {}
    for name, (arr, dtype) in raw.items():
        g = gguf_name(name)
        if g is None:   # the rotary inv_freq buffer
            continue
        if dtype not in ("F32", "F16", "BF16"):
            raise UnsupportedModelError(f"{folder}: tensor {name!r} is stored as {dtype}; "
                                        f"only F32, F16 and BF16 can be converted")
        named[g] = (arr, dtype)
    if cfg.tie_embeddings:
        named.pop("output.weight", None)
    check_weights(cfg, {k: a for k, (a, _d) in named.items()}, source=str(folder))
    out = []
    for g, (arr, dtype) in named.items():
        if arr.ndim == 1:   # norms: F32 (exact), as llama.cpp's converter writes them
            out.append((g, np.ascontiguousarray(arr, dtype=np.float32), Q.F32))
            continue
        a = as_stored(arr, dtype)
        if dtype == "F32":
            a = np.asarray(a, dtype=np.float32)
        if cfg.arch == "llama" and g.endswith((".attn_q.weight", ".attn_k.weight")):
            a = permute_rows(a, cfg.num_heads if ".attn_q." in g else cfg.num_kv_heads)
        a = np.ascontiguousarray(a)
        if dtype == "BF16":
            out.append((g, a.view(np.uint8), Q.BF16))
        else:
            out.append((g, a, Q.F32 if dtype == "F32" else Q.F16))
    return out


def rope_freqs(cfg) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor of a config with Llama 3's RoPE scaling: one divisor
    per rotary frequency (1 for short wavelengths, ``factor`` for long ones, the smooth
    blend's between), computed as llama.cpp's converter does (float32 frequencies)."""
    import math

    s = cfg.rope_scaling_dict()
    factor = float(s.get("factor", 8.0))
    lo, hi = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    ctx = float(s.get("original_max_position_embeddings", 8192))
    hd = cfg.head_dim
    exps = np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)
    freqs = (np.float32(1.0) / np.float32(cfg.rope_theta) ** exps).astype(np.float32)
    out = []
    for f in freqs.astype(np.float64):
        wave = 2 * math.pi / f
        if wave < ctx / hi:
            out.append(1.0)
        elif wave > ctx / lo:
            out.append(factor)
        else:
            smooth = (ctx / wave - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _metadata(gguf, folder, config, cfg, tok, others, file_type):
    """[(key, value, vtype, sub_type)] as llama.cpp's converter names them."""
    T = gguf.GGUFValueType
    a = cfg.arch
    kv = [("general.name", Path(folder).name or "model", T.STRING, None),
          ("general.file_type", file_type, T.UINT32, None)]

    def u32(key, v):
        kv.append((key, int(v), T.UINT32, None))

    u32(f"{a}.vocab_size", cfg.vocab_size)
    u32(f"{a}.context_length", cfg.max_positions)
    u32(f"{a}.embedding_length", cfg.hidden_size)
    u32(f"{a}.block_count", cfg.num_layers)
    u32(f"{a}.feed_forward_length", cfg.intermediate_size)
    u32(f"{a}.rope.dimension_count", cfg.head_dim)
    u32(f"{a}.attention.head_count", cfg.num_heads)
    u32(f"{a}.attention.head_count_kv", cfg.num_kv_heads)
    u32(f"{a}.attention.key_length", cfg.head_dim)
    u32(f"{a}.attention.value_length", cfg.head_dim)
    kv.append((f"{a}.rope.freq_base", float(cfg.rope_theta), T.FLOAT32, None))
    kv.append((f"{a}.attention.layer_norm_rms_epsilon", float(cfg.rms_eps), T.FLOAT32, None))
    f = tok.gguf_fields(cfg.vocab_size)
    kv += [("tokenizer.ggml.model", f["model"], T.STRING, None),
           ("tokenizer.ggml.pre", f["pre"], T.STRING, None),
           ("tokenizer.ggml.tokens", f["tokens"], T.ARRAY, T.STRING),
           ("tokenizer.ggml.token_type", f["token_type"], T.ARRAY, T.INT32)]
    if f["merges"]:
        kv.append(("tokenizer.ggml.merges", f["merges"], T.ARRAY, T.STRING))
    if cfg.bos_id is not None:
        u32("tokenizer.ggml.bos_token_id", cfg.bos_id)
    if cfg.eos_id is not None:
        u32("tokenizer.ggml.eos_token_id", cfg.eos_id)
    tconf = {}
    if "tokenizer_config.json" in others:
        try:
            tconf = json.loads(others["tokenizer_config.json"].read_text(encoding="utf-8"))
        except (OSError, ValueError):
            tconf = {}
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    for key, name in (("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        t = tconf.get(key)
        t = t.get("content") if isinstance(t, dict) else t
        if isinstance(t, str) and t in vocab:
            u32(f"tokenizer.ggml.{name}", vocab[t])
    for key in ("add_bos_token", "add_eos_token"):
        if isinstance(tconf.get(key), bool):
            kv.append((f"tokenizer.ggml.{key}", tconf[key], T.BOOL, None))
    if isinstance(tconf.get("chat_template"), str) and tconf["chat_template"]:
        kv.append(("tokenizer.chat_template", tconf["chat_template"], T.STRING, None))
    return kv


def gguf_source_from_hf(hf_dir, path) -> Path:
    """Write the float GGUF ``path`` (``llama`` or ``qwen3`` architecture; must not exist;
    written atomically) of the Hugging Face folder ``hf_dir``. Returns ``path``.

    Raises :class:`~bakron.models.llm.UnsupportedModelError` (a ``ValueError``) for what
    this converter cannot write: no ``tokenizer.json`` (a GGUF carries its tokenizer), a
    tokenizer that is not byte-level BPE or whose pre-tokenizer is unknown, tensors outside
    the model; :class:`~bakron.io.InputError` for a folder that is not a
    model, :class:`~bakron.io.OutputExistsError` when ``path`` exists.
    """
    from .gguf_writer import _gguf, _Tensor, _write_file
    from ..models.llm.config import LlamaConfig, UnsupportedModelError
    from ..models.llm.tokenizer import Tokenizer

    gguf = _gguf()
    folder = Path(hf_dir)
    out = check_output_file(path)
    config, raw, other_files = read_folder(folder)
    cfg = LlamaConfig.from_hf(config)
    others = {p.name: p for p in other_files}
    if "tokenizer.json" not in others:
        raise UnsupportedModelError(f"{folder}: no tokenizer.json; a GGUF file carries its "
                                    f"tokenizer, so it cannot be written without one")
    try:
        tok = Tokenizer.from_file(others["tokenizer.json"], bos_id=cfg.bos_id,
                                  eos_id=cfg.eos_id)
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from None
    tensors = _tensors(gguf, folder, cfg, raw)
    if cfg.rope_scaling is not None:
        tensors.append(("rope_freqs.weight", rope_freqs(cfg), gguf.GGMLQuantizationType.F32))
    mats = Counter(t.name for _n, a, t in tensors if a.ndim == 2)
    file_type = _FILE_TYPES[mats.most_common(1)[0][0]] if mats else 0
    kvs = _metadata(gguf, folder, config, cfg, tok, others, file_type)
    plan = [_Tensor(n, a, t) for n, a, t in tensors]
    return Path(_write_file(gguf, out, cfg.arch, kvs, plan))
