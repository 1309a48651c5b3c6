"""GPTQ's grid and its packed safetensors checkpoint (the layout transformers and vLLM load).

Grid (GPTQ's ``Quantizer.find_params`` per group of ``group_size`` inputs, ``maxq = 2**b - 1``):
the range is widened to contain 0 (``xmin = min(min w, 0)``, ``xmax = max(max w, 0)``; both 0
gives ``[-1, 1]``); symmetric grids use ``xmax = max(|xmin|, xmax)``, ``xmin = -xmax``;
``scale = (xmax - xmin) / maxq``, stored in fp16; ``zero = 2**(b-1)`` (symmetric) or
``round(-xmin / scale)``; codes ``q = clamp(round(w / scale) + zero, 0, maxq)`` and
``w_hat = scale * (q - zero)``.

Checkpoint (``checkpoint_format="gptq"``, GPTQ's original "v1" layout): for a linear
``P`` of ``out x in`` weights, ``P.qweight`` int32 ``(in * b / 32, out)`` packs 32/b codes of
consecutive inputs per word, input ``i`` of word row ``i // (32/b)`` in bits
``b * (i % (32/b))`` upwards; ``P.qzeros`` int32 ``(groups, out * b / 32)`` packs the zero
points *minus one* the same way along the outputs; ``P.scales`` fp16 ``(groups, out)``;
``P.g_idx`` int32 ``(in,)`` with ``g_idx[i] = i // group_size`` (``desc_act=false``). The
``gptq_v2`` layout stores the zero points themselves. docs/export.md has the details.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from .. import __version__, _safetensors, _xp
from ..io import InputError, atomic_output_dir
from ..quantizers import UniformQuantizer
from ._files import check_output_folder, encode_on_grid, layer_parts
from ._hf import HF_LINEAR, as_stored, hf_linear_name, read_folder

__all__ = ["GPTQGrid", "as_gptq_grid", "pack_rows", "unpack_rows", "write_gptq", "read_gptq",
           "GPTQ_BITS", "CHECKPOINT_FORMATS"]

GPTQ_BITS = (2, 4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_FP16_TINY = float(np.float16(2.0 ** -24))


def _check_bits(bits) -> int:
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ packing is exported for bits in {GPTQ_BITS}, got {bits!r} "
                         f"(3-bit GPTQ packs codes across int32 words; not supported here)")
    return int(bits)


class GPTQGrid(UniformQuantizer):
    """GPTQ's asymmetric-form grid: ``w = scale * (q - zero)``, ``q`` in ``0 .. 2**bits - 1``.

    ``scale`` (fp16 values) and ``zero`` (integers) are ``(rows, groups)`` tables; a
    symmetric grid is the one with every zero equal to ``2**(bits-1)``.
    """

    format = "GPTQ"

    def encode(self, W_hat, name: str = "W_hat") -> np.ndarray:
        """Codes (0 .. 2**bits - 1) of ``W_hat``, which must lie exactly on this grid."""
        return encode_on_grid(self, W_hat, name)

    def __init__(self, bits, scale, zero, group_size: int | None):
        """``group_size`` None (GPTQ's -1) means one group per row (tables of one column)."""
        bits = _check_bits(bits)
        scale = np.asarray(scale, dtype=np.float64)
        zero = np.asarray(zero, dtype=np.float64)
        if scale.ndim != 2 or zero.shape != scale.shape:
            raise ValueError(f"scale and zero must be (rows, groups) tables of one shape, got "
                             f"{scale.shape} and {zero.shape}")
        if np.any(scale.astype(np.float16).astype(np.float64) != scale):
            raise ValueError("scale must hold float16 values (GPTQ stores its scales in fp16)")
        if np.any(zero != np.round(zero)) or zero.min() < 0 or zero.max() > 2 ** bits - 1:
            raise ValueError(f"zero must hold integers in [0, {2 ** bits - 1}]")
        if group_size in (None, -1):
            if scale.shape[1] != 1:
                raise ValueError("group_size=None (one group per row) needs one-column tables")
            super().__init__(bits, scale[:, 0], symmetric=False, zero_point=zero[:, 0])
            self.gptq_group_size = -1
        else:
            super().__init__(bits, scale, symmetric=False, zero_point=zero,
                             group_size=group_size)
            self.gptq_group_size = self.group_size

    @property
    def sym(self) -> bool:
        return bool(np.all(self._zero == 2 ** (self.bits - 1)))

    @classmethod
    def fit(cls, W, bits: int = 4, *, group_size: int | None = 128, sym: bool = True,
            min_zero: int = 1):
        """Fit GPTQ's min/max grid to ``W`` (m outputs x n inputs) per group of inputs.

        ``group_size=None`` (GPTQ's -1) is one group per row. ``min_zero=1`` keeps every
        asymmetric zero point >= 1, which the v1 checkpoint layout needs (it stores
        ``zero - 1`` in ``bits`` bits): a group whose rule gives zero 0 gets zero 1 and the
        step ``max / (2**bits - 2)``. Pass 0 for a ``gptq_v2`` export.
        """
        bits = _check_bits(bits)
        Wn = np.asarray(_xp.to_numpy(W))
        if Wn.ndim != 2 or 0 in Wn.shape or Wn.dtype.kind != "f":
            raise ValueError(f"W must be a non-empty 2-D floating-point array, got shape "
                             f"{Wn.shape} and dtype {Wn.dtype}")
        W32 = Wn.astype(np.float32)
        if not np.all(np.isfinite(W32)):
            raise ValueError("W contains NaN or Inf entries")
        m, n = W32.shape
        per_row = group_size in (None, -1)
        g = n if per_row else int(group_size)
        if g < 1 or n % g:
            raise ValueError(f"group_size must divide the {n} inputs of W, got {group_size!r}")
        maxq = 2 ** bits - 1
        b = W32.reshape(m, n // g, g)
        xmin = np.minimum(b.min(axis=-1), 0)
        xmax = np.maximum(b.max(axis=-1), 0)
        if sym:
            # (GPTQ's reference code keeps xmin = 0 in a group without negative weights,
            # which halves its range there; the symmetric grid here always spans +-xmax)
            xmax = np.maximum(-xmin, xmax)
            xmin = -xmax
        both = (xmin == 0) & (xmax == 0)
        xmin, xmax = np.where(both, -1, xmin), np.where(both, 1, xmax)
        scale = (xmax - xmin) / np.float32(maxq)
        if sym:
            zero = np.full(scale.shape, 2.0 ** (bits - 1))
        else:
            zero = np.round(-xmin / scale)
            # a group with (almost) no negative weight would get zero 0; with min_zero = 1 it
            # gets zero 1 and the step that still reaches its largest weight
            low = zero < min_zero
            scale = np.where(low, xmax / np.float32(maxq - min_zero), scale)
            zero = np.where(low, float(min_zero), zero)
        with np.errstate(over="ignore"):
            s16 = scale.astype(np.float16).astype(np.float64)
        if not np.all(np.isfinite(s16)):
            raise ValueError("W has a group whose GPTQ scale overflows float16")
        s16 = np.where(s16 > 0, s16, _FP16_TINY)
        return cls(bits, s16, zero, None if per_row else g)


def as_gptq_grid(quantizer, n: int, *, checkpoint_format: str = "gptq") -> GPTQGrid:
    """``quantizer`` as a :class:`GPTQGrid` for a layer of ``n`` inputs, or ``ValueError``
    saying why the GPTQ checkpoint cannot store it."""
    if isinstance(quantizer, GPTQGrid):
        grid = quantizer
    elif type(quantizer) is UniformQuantizer:
        q = quantizer
        why = None
        if q.bits not in GPTQ_BITS:
            why = f"it has {q.bits} bits (GPTQ packing is exported for {GPTQ_BITS})"
        s = q._scale
        if why is None and np.any(s.astype(np.float16).astype(np.float64) != s):
            why = "its scales are not float16 numbers (GPTQ stores fp16 scales)"
        if why is None and q.symmetric:
            z = np.full(s.shape, 2.0 ** (q.bits - 1))
        elif why is None:
            z = np.broadcast_to(q._zero, np.broadcast_shapes(q._zero.shape, s.shape))
            if np.any(z != np.round(z)):
                why = "its zero points are not integers"
        if why is not None:
            raise ValueError(f"the GPTQ checkpoint cannot store {q!r}: {why}")
        rows = max(s.shape[0], z.shape[0])
        s, z = np.broadcast_to(s, (rows, s.shape[1])), np.broadcast_to(z, (rows, s.shape[1]))
        gs = q.group_size if s.shape[1] > 1 else None
        if gs is not None and n % gs:
            raise ValueError(f"the GPTQ checkpoint cannot store {q!r}: its group size {gs} "
                             f"does not divide the {n} inputs")
        grid = GPTQGrid(q.bits, s, z, gs)  # a symmetric grid: the same values, zero 2**(b-1)
    else:
        raise ValueError(f"the GPTQ checkpoint stores a uniform grid with fp16 scales per group "
                         f"of inputs; {type(quantizer).__name__} is not one (fit with "
                         f"bakron.export.GPTQGrid.fit)")
    if checkpoint_format == "gptq" and grid._zero.min() < 1:
        raise ValueError("GPTQ's v1 checkpoint layout stores zero - 1 in an unsigned field, so "
                         "it cannot hold a zero point of 0 (a group with no negative weight); "
                         "write checkpoint_format='gptq_v2' or fit with min_zero=1")
    return grid


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``bits``-bit integers along axis 0: (k, c) -> int32 (k * bits / 32, c)."""
    v = np.asarray(values).astype(np.uint32)
    per = 32 // bits
    k, c = v.shape
    if k % per:
        raise ValueError(f"{k} entries cannot be packed {per} to an int32 word")
    words = np.zeros((k // per, c), dtype=np.uint32)
    for j in range(per):
        words |= v[j::per] << np.uint32(bits * j)
    return words.view(np.int32)


def unpack_rows(words: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of :func:`pack_rows`: int32 (k, c) -> unsigned int64 (k * 32 / bits, c)."""
    u = np.asarray(words).astype(np.int64) & 0xFFFFFFFF
    per = 32 // bits
    out = np.empty((u.shape[0] * per,) + u.shape[1:], dtype=np.int64)
    for j in range(per):
        out[j::per] = (u >> (bits * j)) & ((1 << bits) - 1)
    return out


def _pack_layer(prefix, W_hat, grid, checkpoint_format, key):
    codes = grid.encode(W_hat, name=f"layer {key!r}: W_hat")
    m, n = codes.shape
    per = 32 // grid.bits
    if m % per:
        raise ValueError(f"layer {key!r}: its {m} outputs cannot be packed {per} to an int32 "
                         f"word (GPTQ's qzeros)")
    if n % per:
        raise ValueError(f"layer {key!r}: its {n} inputs cannot be packed {per} to an int32 "
                         f"word (GPTQ's qweight)")
    zeros = grid._zero.astype(np.int64) - (1 if checkpoint_format == "gptq" else 0)
    return {
        f"{prefix}.qweight": pack_rows(codes.T, grid.bits),
        f"{prefix}.qzeros": np.ascontiguousarray(pack_rows(zeros, grid.bits).T),
        f"{prefix}.scales": np.ascontiguousarray(grid._scale.T).astype(np.float16),
        f"{prefix}.g_idx": (np.arange(n) // grid.group_size if grid.group_size else
                            np.zeros(n, np.int64)).astype(np.int32),
    }


def write_gptq(out, source, layers: dict, *, checkpoint_format: str = "gptq",
               force: bool = False) -> Path:
    """Write a GPTQ-packed Hugging Face model folder ``out`` from ``source`` and ``layers``.

    Parameters
    ----------
    out : path
        The folder to create (atomically; ``OutputExistsError`` if it exists, unless
        ``force``).
    source : path
        A Hugging Face model folder (``config.json``, ``*.safetensors``, tokenizer files).
    layers : dict
        ``{name: LayerResult or (W_hat, quantizer)}`` for *every* linear of the decoder
        blocks, keyed by HF module name (``model.layers.0.self_attn.q_proj``) or GGUF name
        (``blk.0.attn_q``); one bit width, group size and symmetry for all (GPTQ's config is
        global). Quantizers are :class:`GPTQGrid` or uniform grids it can store.
    checkpoint_format : {"gptq", "gptq_v2"}
        How zero points are stored (``zero - 1`` or ``zero``).

    Every other tensor is copied in its stored dtype (BF16 stays BF16), every other file is
    copied, and ``config.json`` gets GPTQ's ``quantization_config`` (also written as
    ``quantize_config.json``). Returns the output folder.
    """
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got "
                         f"{checkpoint_format!r}")
    if not isinstance(layers, dict) or not layers:
        raise ValueError("layers must be a non-empty dict {name: LayerResult or (W_hat, "
                         "quantizer)}")
    src = Path(source)
    out_path = check_output_folder(out, src, force=force)
    config, tensors, others = read_folder(src)

    # -- check and pack every layer before anything is written -----------------------------
    packed, settings = {}, set()
    for key, layer in layers.items():
        prefix = hf_linear_name(str(key))
        if prefix in packed:
            raise ValueError(f"layer {key!r} is given twice")
        wname = prefix + ".weight"
        if wname not in tensors:
            raise InputError(f"layer {key!r}: the source has no tensor {wname!r}")
        W_hat, quantizer = layer_parts(key, layer)
        shape = tuple(tensors[wname][0].shape)
        if tuple(W_hat.shape) != shape:
            raise ValueError(f"layer {key!r}: W_hat has shape {W_hat.shape} but {wname!r} is "
                             f"{shape}")
        grid = as_gptq_grid(quantizer, shape[1], checkpoint_format=checkpoint_format)
        grid.check_shape(*shape)
        if shape[1] % (32 // grid.bits):
            raise ValueError(f"layer {key!r}: its {shape[1]} inputs cannot be packed "
                             f"{32 // grid.bits} to an int32 word")
        settings.add((grid.bits, grid.gptq_group_size, grid.sym))
        packed[prefix] = _pack_layer(prefix, W_hat, grid, checkpoint_format, key)
    missing = sorted(n[:-len(".weight")] for n in tensors
                     if HF_LINEAR.match(n) and n[:-len(".weight")] not in packed)
    if missing:
        raise ValueError(f"a GPTQ checkpoint quantizes every linear of the decoder blocks; "
                         f"{len(missing)} have no result (first: {missing[:3]})")
    bits_set = {s[0] for s in settings}
    groups = {s[1] for s in settings}
    sym_set = {s[2] for s in settings}
    if len(bits_set) > 1 or len(sym_set) > 1 or len(groups) > 1:
        raise ValueError(f"GPTQ's quantization_config is one setting for the whole model; the "
                         f"layers mix bits {sorted(bits_set)}, group sizes {sorted(groups)} "
                         f"and sym {sorted(sym_set)}")
    qcfg = {"quant_method": "gptq", "bits": bits_set.pop(), "group_size": groups.pop(),
            "desc_act": False, "sym": sym_set.pop(), "true_sequential": True,
            "static_groups": False, "lm_head": False, "checkpoint_format": checkpoint_format,
            "pack_dtype": "int32", "meta": {"quantizer": [f"bakron:{__version__}"]}}

    arrays, bf16 = {}, set()
    for name, (arr, dtype) in tensors.items():
        if name.endswith(".weight") and name[:-len(".weight")] in packed:
            continue
        arrays[name] = as_stored(arr, dtype)
        if dtype == "BF16":
            bf16.add(name)
    for p in packed.values():
        arrays.update(p)
    config = dict(config, quantization_config=qcfg)

    with atomic_output_dir(out_path, force=force) as tmp:
        _safetensors.save(tmp / "model.safetensors", arrays, {"format": "pt"}, bf16=bf16)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "quantize_config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
        for f in others:
            shutil.copy2(f, tmp / f.name)
    return out_path


def read_gptq(folder) -> dict:
    """The weights of a GPTQ-packed folder as float32 arrays, quantized linears de-quantized.

    ``{name: array}`` under the Hugging Face names, each packed linear ``P`` as
    ``P.weight = scale * (q - zero)`` (exact in float32; the layout of :func:`write_gptq`, v1
    or v2 zero points, any ``g_idx``); every other tensor as stored (BF16 widened exactly to
    float32).
    """
    folder = Path(folder)
    config, tensors, _ = read_folder(folder, quantized=True)
    qcfg = config.get("quantization_config") or {}
    if qcfg.get("quant_method") != "gptq":
        raise InputError(f"{folder}: config.json has no GPTQ quantization_config")
    bits = qcfg.get("bits")
    fmt = qcfg.get("checkpoint_format", "gptq")
    if bits not in GPTQ_BITS or fmt not in CHECKPOINT_FORMATS:
        raise InputError(f"{folder}: GPTQ with bits={bits!r} and checkpoint_format={fmt!r} is "
                         f"not readable here (bits {GPTQ_BITS}, formats {CHECKPOINT_FORMATS})")
    out = {}
    packed = {n[:-len(".qweight")] for n in tensors if n.endswith(".qweight")}
    for p in sorted(packed):
        try:
            q = unpack_rows(tensors[p + ".qweight"][0], bits)             # (in, out)
            z = unpack_rows(tensors[p + ".qzeros"][0].T, bits).T          # (groups, out)
            s = np.asarray(tensors[p + ".scales"][0], dtype=np.float32)   # (groups, out)
            g = np.asarray(tensors[p + ".g_idx"][0], dtype=np.int64)      # (in,)
        except KeyError as exc:
            raise InputError(f"{folder}: packed linear {p!r} lacks {exc}") from None
        if fmt == "gptq":
            z = z + 1
        if q.shape[0] != g.shape[0] or g.min() < 0 or g.max() >= s.shape[0] or \
                z.shape != s.shape or q.shape[1] != s.shape[1]:
            raise InputError(f"{folder}: packed linear {p!r} has inconsistent shapes "
                             f"(qweight {q.shape}, qzeros {z.shape}, scales {s.shape}, "
                             f"g_idx {g.shape})")
        out[p + ".weight"] = np.ascontiguousarray((s[g] * (q - z[g]).astype(np.float32)).T)
    for name, (arr, _dtype) in tensors.items():
        base, _, leaf = name.rpartition(".")
        if base in packed and leaf in ("qweight", "qzeros", "scales", "g_idx"):
            continue
        out[name] = np.asarray(arr, dtype=np.float32) if arr.dtype.kind == "f" else arr
    return out
