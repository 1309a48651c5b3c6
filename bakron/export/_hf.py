"""Hugging Face model folders as the exports read them: config, tensors in their stored dtype."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .. import _safetensors
from ..io import InputError
from ..models.llm.hf_folder import HF_NAMES

# the linears of the LLM loaders' name table (GGUF block name -> Hugging Face module name)
_GGUF_TO_HF = {g: h for h, g in HF_NAMES.items() if h.endswith("_proj")}
HF_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                       r"\.weight$")


def hf_linear_name(name: str) -> str:
    """The Hugging Face module name of a linear given by its GGUF name.

    ``blk.3.attn_q`` (or ``blk.3.attn_q.weight``) -> ``model.layers.3.self_attn.q_proj``;
    other names come back unchanged (without ``.weight``).
    """
    name = name[:-len(".weight")] if name.endswith(".weight") else name
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", name)
    if m and m.group(2) in _GGUF_TO_HF:
        return f"model.layers.{m.group(1)}.{_GGUF_TO_HF[m.group(2)]}"
    return name


def read_folder(src: Path, *, quantized: bool = False):
    """(config dict, {name: (array, dtype string)}, other files) of a HF model folder.

    A folder whose config has a ``quantization_config`` is refused unless ``quantized``.
    """
    src = Path(src)
    if not src.is_dir():
        raise InputError(f"{src}: not a model folder")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{src}: no config.json")
    from ..models.llm import schema   # the loaders' checks of config.json and the index

    try:
        config = schema.read_json(cfg_path, "config.json")
        if not isinstance(config, dict):
            raise schema.ModelFileError(f"{cfg_path} must hold a JSON object, got "
                                        f"{schema.shown(config)}")
        index = src / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(schema.weight_map(
                schema.read_json(index, "a safetensors index"), index, src).values()))
    except schema.ModelFileError as exc:
        raise InputError(str(exc)) from None
    if "quantization_config" in config and not quantized:
        raise InputError(f"{src}: the model is already quantized "
                         f"({config['quantization_config'].get('quant_method', '?')})")
    if index.is_file():
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{src}: shard(s) {missing} named in {index.name} are missing")
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        raise InputError(f"{src}: no *.safetensors weights")
    tensors = {}
    for f in files:
        try:
            header, _ = _safetensors.read_header(f)
            data = _safetensors.load(f)
        except (ValueError, KeyError) as exc:
            raise InputError(f"{f}: {exc}") from None
        for name, arr in data.items():
            tensors[name] = (arr, header[name]["dtype"])
    skip = {f.name for f in files} | {"model.safetensors.index.json", "config.json",
                                     "quantize_config.json"}
    others = [p for p in sorted(src.iterdir()) if p.is_file() and p.name not in skip
              and not p.name.startswith(".")]
    return config, tensors, others


def as_stored(arr, dtype):
    """A loaded tensor back in its stored form: BF16 -> uint16 bit patterns (exact)."""
    if dtype == "BF16":
        return (np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32) >> 16
                ).astype(np.uint16)
    return arr
