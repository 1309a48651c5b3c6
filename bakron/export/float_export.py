"""A Hugging Face model folder whose quantized linears hold ``W_hat`` as plain floats.

:func:`write_dequantized` stores each ``W_hat`` in the dtype its source tensor was stored in
(BF16 stays BF16, F16 stays F16, F32 stays F32), rounded to nearest-even where ``W_hat`` is
not representable there, and copies every other tensor and file unchanged. The folder loads
anywhere the original did (no quantization kernel needed).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from .. import _safetensors, _xp
from ..io import InputError, atomic_output_dir
from ._files import check_output_folder
from ._hf import as_stored, hf_linear_name, read_folder

__all__ = ["write_dequantized", "to_bf16_bits"]

_CASTS = {"F32": np.float32, "F16": np.float16}


def to_bf16_bits(x) -> np.ndarray:
    """Round ``x`` to the nearest bfloat16 (ties to even): uint16 bit patterns."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float64).astype(np.float32))
    if not np.all(np.isfinite(f)):
        raise ValueError("cannot store NaN or Inf as bfloat16 weights here")
    u = f.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def _values(key, layer) -> np.ndarray:
    v = layer.values if hasattr(layer, "values") else (
        layer[0] if isinstance(layer, tuple) else layer)
    W_hat = np.asarray(_xp.to_numpy(v))
    if W_hat.ndim != 2 or W_hat.dtype.kind != "f":
        raise ValueError(f"layer {key!r}: W_hat must be a 2-D floating-point array, got shape "
                         f"{W_hat.shape} and dtype {W_hat.dtype}")
    if not np.all(np.isfinite(W_hat)):
        raise ValueError(f"layer {key!r}: W_hat contains NaN or Inf")
    return W_hat


def write_dequantized(out, source, layers: dict, *, force: bool = False) -> dict:
    """Write the folder ``out``: ``source`` with each layer's weight replaced by ``W_hat``.

    ``layers`` maps HF module names (``model.layers.0.mlp.up_proj``) or GGUF names
    (``blk.0.ffn_up``) to a LayerResult, a pair ``(W_hat, quantizer)`` or ``W_hat`` itself.
    Returns ``{module name: largest |stored - W_hat|}`` (0.0 where the dtype holds ``W_hat``
    exactly).
    """
    if not isinstance(layers, dict) or not layers:
        raise ValueError("layers must be a non-empty dict {name: W_hat or LayerResult}")
    src = Path(source)
    out_path = check_output_folder(out, src, force=force)
    config, tensors, others = read_folder(src)
    arrays, bf16, rounding = {}, set(), {}
    replaced = {}
    for key, layer in layers.items():
        name = hf_linear_name(str(key)) + ".weight"
        if name not in tensors:
            raise InputError(f"layer {key!r}: the source has no tensor {name!r}")
        if name in replaced:
            raise ValueError(f"layer {key!r} is given twice")
        W_hat = _values(key, layer)
        stored, dtype = tensors[name]
        if W_hat.shape != stored.shape:
            raise ValueError(f"layer {key!r}: W_hat has shape {W_hat.shape} but {name!r} is "
                             f"{stored.shape}")
        if dtype == "BF16":
            bits = to_bf16_bits(W_hat)
            back = (bits.astype(np.uint32) << 16).view(np.float32)
            replaced[name] = bits
        elif dtype in _CASTS:
            with np.errstate(over="ignore"):
                replaced[name] = back = W_hat.astype(_CASTS[dtype])
            if not np.all(np.isfinite(back)):
                raise ValueError(f"layer {key!r}: W_hat overflows {dtype}")
        else:
            raise ValueError(f"layer {key!r}: {name!r} is stored as {dtype}; a float export "
                             f"keeps BF16, F16 or F32")
        rounding[name[:-len(".weight")]] = float(np.max(np.abs(back.astype(np.float64)
                                                               - W_hat.astype(np.float64))))
    for name, (arr, dtype) in tensors.items():
        if name in replaced:
            arrays[name] = replaced[name]
        else:
            arrays[name] = as_stored(arr, dtype)
        if dtype == "BF16":
            bf16.add(name)
    with atomic_output_dir(out_path, force=force) as tmp:
        _safetensors.save(tmp / "model.safetensors", arrays, {"format": "pt"}, bf16=bf16)
        shutil.copy2(src / "config.json", tmp / "config.json")
        for f in others:
            shutil.copy2(f, tmp / f.name)
    return rounding
