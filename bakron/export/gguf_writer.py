"""Write a GGUF file whose linear layers are bakron's results in a llama.cpp block format.

:func:`write_gguf` copies every other tensor (in its own type, byte for byte) and all metadata
from the source -- a GGUF file, or a :class:`GGUFSource` built from a Hugging Face folder's
weights -- and stores each quantized linear in the format of its grid
(:mod:`bakron.export.grids`). The export is lossless: ``gguf``'s de-quantization of a written
tensor equals the layer's ``W_hat``. The ``gguf`` package (``pip install bakron[export]``)
does the writing.

Row order of Q and K. llama.cpp's ``llama`` architecture keeps the rows of ``attn_q`` and
``attn_k`` in an interleaved rotary layout; bakron's LLM loaders hand out the Hugging Face
order. ``qk_order="hf"`` (the default) says that the layers (and a ``GGUFSource``'s tensors)
are in the Hugging Face order, and the writer permutes them into llama.cpp's; a GGUF file
source's own tensors are always copied in the file's order.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..io import InputError
from ._files import atomic_output_file, check_output_file, layer_parts
from .grids import as_block_grid

__all__ = ["GGUFSource", "write_gguf", "qk_permutation"]

# Architectures whose converters permute the Q/K rows (llama.cpp's convert_hf_to_gguf does it
# for LlamaModel; qwen3 and others use the NEOX rotary layout and keep the HF order).
PERMUTED_ARCHS = ("llama",)
_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # gguf.LlamaFileType.MOSTLY_*
_SKIP_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture")


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("writing GGUF needs the 'gguf' package: pip install 'bakron[export]'"
                          ) from None
    return gguf


@dataclass
class GGUFSource:
    """A model to write as GGUF when there is no source GGUF (e.g. a Hugging Face folder).

    ``tensors`` maps GGUF tensor names (``token_embd.weight``, ``blk.0.attn_q.weight``, ...)
    to numpy arrays (float32, float16, or other types ``gguf`` writes), matrices as
    (out, in), or to pairs ``(data, gguf.GGMLQuantizationType)`` of a tensor already in a
    GGML type (F32/F16 as arrays, every other type as its bytes, uint8); ``metadata`` maps
    GGUF keys to values, either plain (str, bool, float, int -- ints are written as UINT32,
    or INT32 when negative -- or lists of those) or a pair
    ``(value, gguf.GGUFValueType)``. ``qk_order`` is the row order of Q and K in ``tensors``.
    """

    arch: str
    metadata: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    qk_order: str = "hf"


def qk_permutation(rows: int, n_head: int) -> np.ndarray:
    """Row index ``p`` with ``W_llama = W_hf[p]``: llama.cpp's rotary row layout.

    Within each head the Hugging Face order has the first halves of the rotary pairs, then the
    second halves; llama.cpp interleaves them (row 2i from i, row 2i+1 from i + head_dim/2).
    """
    if n_head < 1 or rows % (2 * n_head):
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of rotary pairs")
    hd = rows // n_head
    idx = np.arange(rows).reshape(n_head, 2, hd // 2)
    return idx.swapaxes(1, 2).reshape(rows)


def _metadata_value(gguf, key, value):
    """(value, vtype, sub_type) for a GGUFSource metadata entry."""
    T = gguf.GGUFValueType
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], T):
        value, vtype = value
        sub = None
        if vtype == T.ARRAY and value:
            sub = _scalar_type(T, key, value[0])
        return value, vtype, sub
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"metadata {key!r}: GGUF cannot store an empty array")
        return list(value), T.ARRAY, _scalar_type(T, key, value[0])
    return value, _scalar_type(T, key, value), None


def _scalar_type(T, key, v):
    if isinstance(v, bool):
        return T.BOOL
    if isinstance(v, numbers.Integral):
        return T.UINT32 if v >= 0 else T.INT32
    if isinstance(v, numbers.Real):
        return T.FLOAT32
    if isinstance(v, str):
        return T.STRING
    raise ValueError(f"metadata {key!r}: cannot store a value of type {type(v).__name__} in GGUF")


class _Tensor:
    """One tensor to write: name, numpy data and its GGML type (None: from the dtype)."""

    def __init__(self, name, data, raw_type=None):
        self.name, self.data, self.raw_type = name, data, raw_type


def _read_source(gguf, source):
    """(arch, [(key, value, vtype, sub_type)], [_Tensor], qk_order, alignment or None)."""
    if isinstance(source, GGUFSource):
        if not isinstance(source.arch, str) or not source.arch:
            raise ValueError("GGUFSource.arch must be a non-empty string (e.g. 'llama')")
        if source.qk_order not in ("hf", "gguf"):
            raise ValueError(f"GGUFSource.qk_order must be 'hf' or 'gguf', got "
                             f"{source.qk_order!r}")
        kvs = [(k, *_metadata_value(gguf, k, v)) for k, v in source.metadata.items()
               if k not in _SKIP_KEYS]
        tensors = []
        for name, a in source.tensors.items():
            if isinstance(a, tuple) and len(a) == 2 and isinstance(
                    a[1], gguf.GGMLQuantizationType):   # already in a GGML type: its bytes
                arr = np.ascontiguousarray(a[0])
                if a[1] not in (gguf.GGMLQuantizationType.F32,
                                gguf.GGMLQuantizationType.F16):
                    if arr.dtype != np.uint8:
                        raise ValueError(f"tensor {name!r} of type {a[1].name} must be given "
                                         f"as its bytes (uint8), got dtype {arr.dtype}")
                    try:
                        gguf.quants.quant_shape_from_byte_shape(arr.shape, a[1])
                    except ValueError as exc:
                        raise ValueError(f"tensor {name!r}: {exc}") from None
                tensors.append(_Tensor(name, arr, a[1]))
                continue
            arr = np.asarray(a)
            if arr.dtype not in (np.float32, np.float16, np.int8, np.int16, np.int32):
                raise ValueError(f"tensor {name!r} has dtype {arr.dtype}; a GGUFSource holds "
                                 f"float32, float16, int8, int16 or int32 arrays (or pairs "
                                 f"(bytes, gguf.GGMLQuantizationType))")
            tensors.append(_Tensor(name, arr))
        return source.arch, kvs, tensors, source.qk_order, None
    path = Path(source)
    if not path.is_file():
        raise InputError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, KeyError, ... on bad files
        raise InputError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})"
                         ) from None
    T = gguf.GGUFValueType
    arch = None
    kvs = []
    for key, f in reader.fields.items():
        if key == "general.architecture":
            arch = f.contents()
        if key in _SKIP_KEYS:
            continue
        if not f.types:
            raise InputError(f"{path}: metadata {key!r} has no type")
        vtype = f.types[0]
        sub = f.types[-1] if vtype == T.ARRAY else None
        if vtype == T.ARRAY and (len(f.types) != 2 or len(f.data) == 0):
            raise InputError(f"{path}: metadata {key!r} is a nested or empty array, which the "
                             f"gguf writer cannot copy")
        kvs.append((key, f.contents(), vtype, sub))
    if arch is None:
        raise InputError(f"{path}: no general.architecture in the GGUF metadata")
    tensors = [_Tensor(t.name, t.data, t.tensor_type) for t in reader.tensors]
    align = reader.fields.get("general.alignment")
    return arch, kvs, tensors, "gguf", None if align is None else int(align.contents())


def _shape(gguf, t: _Tensor) -> tuple:
    """The (rows, cols) numpy shape of a tensor in elements (quantized data is bytes)."""
    if t.raw_type is None or t.data.dtype != np.uint8:
        return tuple(t.data.shape)
    return tuple(gguf.quants.quant_shape_from_byte_shape(t.data.shape, t.raw_type))


def _head_counts(arch, kvs):
    meta = {k: v for k, v, _t, _s in kvs}
    return meta.get(f"{arch}.attention.head_count"), meta.get(f"{arch}.attention.head_count_kv")


def write_gguf(out, source, layers: dict, *, qk_order: str = "hf", force: bool = False):
    """Write ``source`` with ``layers`` replaced by their quantized blocks to GGUF ``out``.

    Parameters
    ----------
    out : path
        The GGUF file to write (atomically: a temporary file renamed into place).
    source : path or GGUFSource
        A GGUF file (its tensors and metadata are copied), or a :class:`GGUFSource`.
    layers : dict
        ``{name: LayerResult or (W_hat, quantizer)}`` keyed by the linear's GGUF name
        (``blk.0.attn_q`` or ``blk.0.attn_q.weight``); each quantizer must be one of the
        block grids of :mod:`bakron.export.grids` and ``W_hat`` must lie on it.
    qk_order : {"hf", "gguf"}
        Row order of ``attn_q``/``attn_k`` in ``layers`` (see the module docstring).
    force : bool
        Replace an existing ``out``.

    Returns the output path. Everything is checked before the output is opened; on any error
    nothing is written.
    """
    if qk_order not in ("hf", "gguf"):
        raise ValueError(f"qk_order must be 'hf' or 'gguf', got {qk_order!r}")
    if not isinstance(layers, dict) or not layers:
        raise ValueError("layers must be a non-empty dict {name: LayerResult or (W_hat, "
                         "quantizer)}")
    gguf = _gguf()
    src_path = None if isinstance(source, GGUFSource) else source
    out = check_output_file(out, src_path, force=force)
    arch, kvs, tensors, src_order, alignment = _read_source(gguf, source)
    by_name = {t.name: t for t in tensors}

    n_head, n_kv = _head_counts(arch, kvs)

    def row_perm(tensor_name, rows, order):
        if order != "hf" or arch not in PERMUTED_ARCHS:
            return None
        base = tensor_name.rsplit(".", 2)
        kind = base[-2] if len(base) == 3 else ""
        if kind not in ("attn_q", "attn_k"):
            return None
        heads = n_head if kind == "attn_q" else (n_kv or n_head)
        if not isinstance(heads, numbers.Integral):
            raise InputError(f"{arch}.attention.head_count(_kv) is missing from the metadata "
                             f"or not one number ({heads!r}): cannot permute {tensor_name} "
                             f"into llama.cpp's row order")
        try:
            return qk_permutation(rows, int(heads))
        except ValueError as exc:
            raise InputError(f"{tensor_name}: {exc}") from None

    # -- check and encode every layer before anything is written ---------------------------
    encoded = {}
    formats = set()
    for key, layer in layers.items():
        tname = key if str(key).endswith(".weight") else f"{key}.weight"
        if tname not in by_name:
            raise InputError(f"layer {key!r}: the source has no tensor {tname!r}")
        if tname in encoded:
            raise ValueError(f"layer {key!r} is given twice")
        W_hat, quantizer = layer_parts(key, layer)
        try:
            grid = as_block_grid(quantizer)
        except ValueError as exc:
            raise ValueError(f"layer {key!r}: {exc}") from None
        shape = _shape(gguf, by_name[tname])
        if tuple(W_hat.shape) != shape:
            raise ValueError(f"layer {key!r}: W_hat has shape {W_hat.shape} but the source "
                             f"tensor {tname!r} is {shape}")
        codes = grid.encode(W_hat, name=f"layer {key!r}: W_hat")
        blocks = grid.to_blocks(codes)
        perm = row_perm(tname, blocks.shape[0], qk_order)
        if perm is not None:
            blocks = blocks[perm]
        encoded[tname] = _Tensor(tname, np.ascontiguousarray(blocks),
                                 getattr(gguf.GGMLQuantizationType, grid.format))
        formats.add(grid.format)
    plan = []
    for t in tensors:
        if t.name in encoded:
            plan.append(encoded[t.name])
            continue
        perm = row_perm(t.name, t.data.shape[0], src_order) if t.data.ndim == 2 else None
        plan.append(t if perm is None else _Tensor(t.name, np.ascontiguousarray(t.data[perm]),
                                                   t.raw_type))
    if len(formats) == 1:  # the file type names the format of (most) matrices
        ftype = _FILE_TYPES[formats.pop()]
        kvs = [(k, ftype if k == "general.file_type" else v, vt, st) for k, v, vt, st in kvs]

    return _write_file(gguf, out, arch, kvs, plan, alignment, force=force)


def _write_file(gguf, out, arch, kvs, plan, alignment=None, *, force=False):
    """Write the GGUF ``out`` atomically: metadata ``kvs`` [(key, value, vtype, sub_type)]
    and the tensors of ``plan`` [_Tensor] in order."""
    with atomic_output_file(out, force=force) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            if alignment is not None:
                writer.data_alignment = alignment
            for key, value, vtype, sub in kvs:
                writer.add_key_value(key, value, vtype, sub_type=sub)
            for t in plan:
                if t.raw_type is None:
                    writer.add_tensor(t.name, t.data)
                else:
                    writer.add_tensor(t.name, t.data, raw_dtype=t.raw_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return out
