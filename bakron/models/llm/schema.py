"""What bakron reads from a causal LM's files, checked in one place: model files are untrusted.

Every value the loaders take from ``config.json``, from ``model.safetensors.index.json`` or
from a GGUF file's metadata goes through this module before it sizes, allocates or loops over
anything: its type (an integer is a JSON/GGUF integer, never a float, a string or a bool), its
range (counts and dimensions are positive and below 2**31, as llama.cpp's fields are; numbers
are finite) and the relations between values (heads divide the hidden size, key/value heads
divide the heads, head_dim is even, token ids lie in the vocabulary). The same rules guard a
:class:`~bakron.models.llm.config.LlamaConfig` built by hand (``ValueError`` naming the field).

Errors from files are :class:`ModelFileError` (a
:class:`~bakron.models._fetch.ModelUnavailableError` and a ``ValueError``: ``bakron
quantize-model`` exits 4) naming the file and the key; unsupported but well-formed models
get :class:`~bakron.models.llm.config.UnsupportedModelError` from the loaders.
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Callable

import numpy as np

from .._fetch import ModelUnavailableError

__all__ = ["ModelFileError", "MAX_COUNT", "MAX_JSON_BYTES", "FIELDS", "integer", "number",
           "flag", "check_values", "read_json", "hf_values", "rope_scaling", "weight_map",
           "check_tensor_values", "shown"]

#: the largest count or dimension accepted (llama.cpp's hyper-parameters are 32-bit)
MAX_COUNT = 2 ** 31 - 1
#: the largest config.json / shard index read (real ones are a few kB to a few hundred kB)
MAX_JSON_BYTES = 64 << 20

#: LlamaConfig field -> (config.json key, GGUF metadata key after "{arch}.")
FIELDS = {
    "vocab_size": ("vocab_size", "vocab_size"),
    "hidden_size": ("hidden_size", "embedding_length"),
    "intermediate_size": ("intermediate_size", "feed_forward_length"),
    "num_layers": ("num_hidden_layers", "block_count"),
    "num_heads": ("num_attention_heads", "attention.head_count"),
    "num_kv_heads": ("num_key_value_heads", "attention.head_count_kv"),
    "head_dim": ("head_dim", "attention.key_length"),
    "rope_theta": ("rope_theta", "rope.freq_base"),
    "rms_eps": ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    "max_positions": ("max_position_embeddings", "context_length"),
    "bos_id": ("bos_token_id", "tokenizer.ggml.bos_token_id"),
    "eos_id": ("eos_token_id", "tokenizer.ggml.eos_token_id"),
}
_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
           "num_kv_heads", "head_dim", "max_positions")


class ModelFileError(ModelUnavailableError, ValueError):
    """A model file (``config.json``, the shard index, a safetensors shard, a GGUF file, the
    tokenizer) holds an invalid, inconsistent or non-finite value. The message names the file
    and the key or tensor. ``bakron quantize-model`` answers it with exit code 4."""


def shown(v, limit: int = 60) -> str:
    """``v`` for a message: its type and a repr cut to ``limit`` characters."""
    r = repr(v)
    if len(r) > limit:
        r = r[:limit] + f"... ({len(r)} characters)"
    return f"{type(v).__name__} {r}"


def integer(v, key: str, *, lo: int = 1, hi: int = MAX_COUNT, error=ModelFileError) -> int:
    """``v`` if it is an integer in ``[lo, hi]`` (numpy integers accepted, bools, floats and
    strings refused), else ``error`` naming ``key``."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise error(f"{key} must be an integer, got {shown(v)}")
    v = int(v)
    if not lo <= v <= hi:
        raise error(f"{key} must be an integer in {lo}..{hi}, got {v}")
    return v


def number(v, key: str, *, error=ModelFileError) -> float:
    """``v`` as a float if it is a finite number > 0, else ``error`` naming ``key``."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                             np.floating)):
        raise error(f"{key} must be a number, got {shown(v)}")
    f = float(v)
    if not (math.isfinite(f) and f > 0):
        raise error(f"{key} must be a finite number > 0, got {f!r}")
    return f


def flag(v, key: str, default: bool = False, *, error=ModelFileError) -> bool:
    """``v`` if it is a bool (``None``: ``default``), else ``error`` naming ``key``."""
    if v is None:
        return default
    if not isinstance(v, (bool, np.bool_)):
        raise error(f"{key} must be true or false, got {shown(v)}")
    return bool(v)


def check_values(values: dict, name: Callable[[str], str], *, error=ModelFileError) -> None:
    """The rules every configuration obeys, on the LlamaConfig fields in ``values``;
    ``name(field)`` is how a message names a field (its key in the file)."""
    for f in _COUNTS:
        values[f] = integer(values[f], name(f), error=error)
    for f in ("rope_theta", "rms_eps"):
        values[f] = number(values[f], name(f), error=error)
    heads, kv = values["num_heads"], values["num_kv_heads"]
    if heads % kv:
        raise error(f"{name('num_heads')}={heads} must be a multiple of "
                    f"{name('num_kv_heads')}={kv} (grouped-query attention)")
    if values["head_dim"] % 2:
        raise error(f"{name('head_dim')} must be even for RoPE, got {values['head_dim']}")
    for f in ("bos_id", "eos_id"):
        if values.get(f) is not None:
            values[f] = integer(values[f], name(f), lo=0, hi=values["vocab_size"] - 1,
                                error=error)


def read_json(path, what: str):
    """The JSON value of the file ``path`` (at most :data:`MAX_JSON_BYTES`; ``NaN`` and
    ``Infinity`` are read as floats and refused later by the schema)."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ModelFileError(f"{path}: {size} bytes is too large for {what} (the limit is "
                             f"{MAX_JSON_BYTES})")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as exc:   # UnicodeDecodeError is a ValueError
        raise ModelFileError(f"{path} is not valid JSON ({type(exc).__name__}: "
                             f"{str(exc)[:200]})") from None


def _get(cfg: dict, key: str, where: str, *, kind: type | tuple = dict):
    v = cfg.get(key)
    if v is not None and not isinstance(v, kind):
        what = "an object" if kind is dict else "a list"
        raise ModelFileError(f"{where}: {key} must be {what} or null, got {shown(v)}")
    return v


def rope_scaling(scaling: dict, where: str) -> tuple:
    """Llama 3's RoPE stretch as sorted (key, value) pairs, its four numbers checked."""
    out = {}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in scaling:
            raise ModelFileError(f"{where}: llama3 rope scaling needs {key!r}")
        out[key] = number(scaling[key], f"{where}: rope_scaling.{key}")
    if "original_max_position_embeddings" not in scaling:
        raise ModelFileError(f"{where}: llama3 rope scaling needs "
                             f"'original_max_position_embeddings'")
    out["original_max_position_embeddings"] = integer(
        scaling["original_max_position_embeddings"],
        f"{where}: rope_scaling.original_max_position_embeddings")
    if not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ModelFileError(f"{where}: rope_scaling.high_freq_factor "
                             f"({out['high_freq_factor']}) must be larger than "
                             f"low_freq_factor ({out['low_freq_factor']})")
    return tuple(sorted({**{k: v for k, v in scaling.items() if isinstance(v, str)},
                         **out}.items()))


def hf_values(cfg, where: str, unsupported) -> dict:
    """The LlamaConfig fields (``arch`` included) of a Hugging Face ``config.json`` value
    ``cfg``; ``where`` names the file in messages, ``unsupported`` is the error class for
    well-formed models bakron does not implement."""
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{where} must hold a JSON object, got {shown(cfg)}")
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, list)
                              or not all(isinstance(a, str) for a in archs)):
        raise ModelFileError(f"{where}: architectures must be a list of class names such as "
                             f"[\"LlamaForCausalLM\"], got {shown(archs)}")
    model_type = cfg.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelFileError(f"{where}: model_type must be a string, got {shown(model_type)}")
    kind = archs[0] if archs else (model_type or "?")
    if kind in ("LlamaForCausalLM", "llama"):
        arch = "llama"
    elif kind in ("Qwen3ForCausalLM", "qwen3"):
        arch = "qwen3"
    else:
        raise unsupported(f"{where} describes {kind!r}; only LlamaForCausalLM and "
                          f"Qwen3ForCausalLM are supported")
    # transformers >= 5 keeps theta and the scaling in "rope_parameters"; older configs
    # have "rope_theta" and "rope_scaling" at the top level
    params = cfg.get("rope_parameters") or None
    if params is not None and not isinstance(params, dict):
        raise unsupported(f"{where}: rope_parameters is not one dict (per layer-type RoPE is "
                          f"not implemented)")
    scaling = _get(cfg, "rope_scaling", where) or None
    theta = cfg.get("rope_theta", 10000.0)
    if params is not None:
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type")) not in (None, "default"):
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
        elif kind != "llama3":
            raise unsupported(f"{where} asks for RoPE scaling {scaling!r}; only plain RoPE and "
                              f"Llama 3's 'llama3' scaling are implemented")
        else:
            scaling = rope_scaling(scaling, where)
    if flag(cfg.get("use_sliding_window"), f"{where}: use_sliding_window"):
        raise unsupported(f"{where} sets use_sliding_window=true; only full causal attention "
                          f"is implemented")
    for key in ("attention_bias", "mlp_bias"):
        if flag(cfg.get(key), f"{where}: {key}"):
            raise unsupported(f"{where} sets {key}=true; biases are not implemented")
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
              "num_heads"):
        if cfg.get(FIELDS[f][0]) is None:
            raise ModelFileError(f"{where} has no {FIELDS[f][0]!r}")

    def key(f):
        return f"{where}: {FIELDS[f][0]}"

    d = integer(cfg["hidden_size"], key("hidden_size"))
    heads = integer(cfg["num_attention_heads"], key("num_heads"))
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if d % heads:
            raise ModelFileError(f"{key('num_heads')}={heads} must divide "
                                 f"{key('hidden_size')}={d} (there is no head_dim)")
        head_dim = d // heads
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):   # several end tokens: the first stops generation
        for i, e in enumerate(eos):
            integer(e, f"{key('eos_id')}[{i}]", lo=0)
        eos = eos[0] if eos else None
    values = {
        "arch": arch, "vocab_size": cfg["vocab_size"], "hidden_size": d,
        "intermediate_size": cfg["intermediate_size"], "num_layers": cfg["num_hidden_layers"],
        "num_heads": heads, "num_kv_heads": heads if cfg.get("num_key_value_heads") is None
        else cfg["num_key_value_heads"],
        "head_dim": head_dim, "rope_theta": theta, "rms_eps": cfg.get("rms_norm_eps", 1e-6),
        "tie_embeddings": flag(cfg.get("tie_word_embeddings"), f"{where}: tie_word_embeddings"),
        "qk_norm": arch == "qwen3",
        "max_positions": cfg.get("max_position_embeddings", 2048),
        "bos_id": cfg.get("bos_token_id"), "eos_id": eos, "rope_scaling": scaling}
    check_values(values, key)
    return values


def weight_map(index, path, folder) -> dict[str, pathlib.Path]:
    """``{tensor name: shard path}`` of a ``model.safetensors.index.json`` value: an object
    whose ``weight_map`` maps names to file names inside ``folder`` (a path that is absolute
    or climbs out with ``..`` is refused)."""
    if not isinstance(index, dict):
        raise ModelFileError(f"{path} must hold a JSON object, got {shown(index)}")
    wmap = index.get("weight_map")
    if not isinstance(wmap, dict):
        raise ModelFileError(f"{path}: weight_map must be an object mapping tensor names to "
                             f"shard files, got {shown(wmap)}")
    out, seen = {}, {}
    for name, f in wmap.items():
        if not isinstance(f, str) or not f:
            raise ModelFileError(f"{path}: weight_map[{name!r}] must be a shard file name, "
                                 f"got {shown(f)}")
        if f not in seen:
            p = pathlib.PurePosixPath(f.replace("\\", "/"))
            if (p.is_absolute() or pathlib.PureWindowsPath(f).drive or ".." in p.parts
                    or "\0" in f):
                raise ModelFileError(f"{path}: weight_map[{name!r}] = {f!r} leaves the model "
                                     f"folder; shard files must lie inside {folder}")
            seen[f] = pathlib.Path(folder) / p
        out[name] = seen[f]
    return out


def check_tensor_values(a: np.ndarray, name: str, source: str) -> None:
    """``ModelFileError`` naming the tensor unless every entry of the float array ``a`` is
    finite and its square is finite in ``a``'s dtype (RMSNorm squares the residual stream
    and attention multiplies q by k, so a larger weight overflows the forward pass).

    Two reductions, the minimum and the maximum (NaN propagates through both); the entries
    are located only when one of them fails."""
    if a.size == 0:
        return
    lo, hi = a.min(), a.max()
    bound = math.sqrt(float(np.finfo(a.dtype).max))
    if math.isfinite(lo) and math.isfinite(hi) and max(-float(lo), float(hi)) < bound:
        return
    bad = ~np.isfinite(a)
    n = int(bad.sum())
    if n:
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ModelFileError(f"{source}: tensor {name!r} holds {n} NaN or infinite "
                             f"value{'s' if n > 1 else ''} (the first at index {where}, "
                             f"{float(a[where])}) in {a.dtype}")
    big = float(max(-float(lo), float(hi)))
    raise ModelFileError(f"{source}: tensor {name!r} holds a value of magnitude {big:.3g}; "
                         f"its square overflows {a.dtype} (the limit is {bound:.3g}), so the "
                         f"forward pass cannot be computed")
