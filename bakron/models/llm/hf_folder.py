"""Read a Hugging Face model folder of ``LlamaForCausalLM`` or ``Qwen3ForCausalLM``.

The folder holds ``config.json``, the weights (``model.safetensors``, or shards listed in
``model.safetensors.index.json``; F32, F16 or BF16) and ``tokenizer.json``. Tensors are renamed
to the GGUF names the rest of bakron uses (``model.layers.3.self_attn.q_proj.weight`` →
``blk.3.attn_q.weight``; see :data:`HF_NAMES`) and converted to float32/float64. A Hugging Face
checkpoint already has the rotary row order the forward pass expects (nothing to un-permute).

Before any tensor data is read, ``config.json`` and the index are checked against the schema
of :mod:`~bakron.models.llm.schema`, every shard's header is validated
(:func:`bakron._safetensors.read_header`), the block count and every shape against the config
and the tokenizer's ids against the vocabulary; each tensor is checked to be finite as it is
read.
"""
from __future__ import annotations

import pathlib
import re

import numpy as np

from ... import _safetensors
from .._fetch import ModelUnavailableError
from .config import LlamaConfig, UnsupportedModelError, check_shapes, weight_shapes
from .schema import ModelFileError, check_tensor_values, read_json, weight_map
from .tokenizer import Tokenizer

__all__ = ["read_hf_folder", "HF_NAMES", "gguf_name", "hf_name"]

#: Per-block tensor names: Hugging Face suffix -> GGUF suffix.
HF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
_TO_HF = {v: k for k, v in HF_NAMES.items()}


def gguf_name(hf: str) -> str | None:
    """The GGUF name of a Hugging Face tensor name (``None`` for tensors the model does not
    use, such as ``rotary_emb.inv_freq``)."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    m = _BLOCK.match(hf)
    if m and m.group(2) in HF_NAMES:
        return f"blk.{m.group(1)}.{HF_NAMES[m.group(2)]}.weight"
    return None


def hf_name(gguf: str) -> str:
    """The Hugging Face name of a GGUF tensor name (the inverse of :func:`gguf_name`)."""
    for k, v in _GLOBAL.items():
        if v == gguf:
            return k
    parts = gguf.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _TO_HF:
        return f"model.layers.{parts[1]}.{_TO_HF[parts[2]]}.weight"
    raise KeyError(f"no Hugging Face name for {gguf!r}")


def _shards(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{tensor name: safetensors file}`` for a single file or a sharded index."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        out = weight_map(read_json(index, "a safetensors index"), index, folder)
        for f in sorted(set(out.values())):
            if not f.is_file():
                raise ModelUnavailableError(f"{index} lists shard {f.name!r}, which is missing")
        return out
    if single.is_file():
        header, _ = _read_header(single)
        return {k: single for k in header if k != "__metadata__"}
    raise ModelUnavailableError(f"{folder} has neither model.safetensors nor "
                                f"model.safetensors.index.json")


def _read_header(path):
    try:
        return _safetensors.read_header(path)
    except OSError as exc:
        raise ModelUnavailableError(f"{path} cannot be read ({exc})") from None
    except ValueError as exc:
        if "unsupported dtype" in str(exc):
            raise UnsupportedModelError(str(exc)) from None
        raise ModelFileError(f"{path} is not a readable safetensors file ({exc})") from None


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def read_hf_folder(folder, *, dtype="float32", tokenizer: bool = True):
    """``(config, weights, tokenizer)`` of a Hugging Face folder; weights under GGUF names as
    numpy arrays of ``dtype``; ``tokenizer`` is ``None`` when the folder has no
    ``tokenizer.json`` (or ``tokenizer=False``).

    Raises :class:`~bakron.models._fetch.ModelUnavailableError` for a missing file or shard,
    :class:`~bakron.models.llm.schema.ModelFileError` (also a ``ValueError``) for an
    invalid, inconsistent or non-finite one (naming the file and the key or tensor) and
    :class:`~bakron.models.llm.config.UnsupportedModelError` for what is not implemented."""
    folder = pathlib.Path(folder)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelUnavailableError(f"{folder} has no config.json (not a Hugging Face model "
                                    f"folder)")
    cfg = LlamaConfig.from_hf(read_json(cfg_path, "config.json"), str(cfg_path))
    where = _shards(folder)
    for name in where:
        if name.endswith(".bias") and gguf_name(name[:-5] + ".weight"):
            raise UnsupportedModelError(f"{folder}: tensor {name!r} is a bias; linear biases "
                                        f"are not implemented")
    # every shard's header once: the names, dtypes and shapes before any data
    headers = {p: _read_header(p)[0] for p in sorted(set(where.values()))}
    infos = {}
    for name, path in where.items():
        info = headers[path].get(name)
        if name == "__metadata__" or info is None:
            raise ModelFileError(f"{folder / 'model.safetensors.index.json'} lists tensor "
                                 f"{name!r} in {path.name}, which does not hold it")
        g = gguf_name(name)
        if g is not None:
            infos[g] = (name, path, info)
    if cfg.tie_embeddings:
        infos.pop("output.weight", None)
    elif "output.weight" not in infos:
        raise ModelFileError(f"{folder}: config.json sets tie_word_embeddings=false but there "
                             f"is no lm_head.weight")
    check_shapes(cfg, {g: tuple(info["shape"]) for g, (_n, _p, info) in infos.items()},
                 source=str(folder), key="config.json num_hidden_layers")
    want = weight_shapes(cfg)
    by_file: dict[pathlib.Path, dict[str, str]] = {}
    for g in want:
        name, path, info = infos[g]
        if info["dtype"] not in _FLOAT_DTYPES:
            raise ModelFileError(f"{path}: tensor {name!r} is stored as {info['dtype']}; a "
                                 f"model's weights must be floating point "
                                 f"({', '.join(_FLOAT_DTYPES)})")
        by_file.setdefault(path, {})[name] = g
    tok = None
    if tokenizer and (folder / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(folder / "tokenizer.json", bos_id=cfg.bos_id,
                                  eos_id=cfg.eos_id)
        top = tok.max_id()
        if top >= cfg.vocab_size:
            raise ModelFileError(
                f"{folder}: tokenizer.json holds token id {top} but config.json's vocab_size "
                f"(the embedding's rows) is {cfg.vocab_size}; llama.cpp refuses such a model "
                f"too")
    weights = {}
    for path, names in by_file.items():
        try:
            got = _safetensors.load(path, list(names))
        except OSError as exc:
            raise ModelUnavailableError(f"cannot read {path}: {exc}") from None
        except (ValueError, KeyError) as exc:
            raise ModelFileError(f"cannot read {path}: {exc}") from None
        for name, arr in got.items():
            with np.errstate(over="ignore"):   # F64 beyond float32's range: inf, refused next
                W = np.ascontiguousarray(arr, dtype=dtype)
            check_tensor_values(W, name, str(path))
            weights[names[name]] = W
    return cfg, weights, tok
