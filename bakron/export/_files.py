"""Helpers shared by the writers: one output file built atomically, layer arguments."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from .. import _xp
from .._lib.fs import atomic_path
from ..io import InputError, OutputExistsError, check_output_path


def check_output_file(out, source=None, *, force: bool = False) -> Path:
    """Refuse an existing ``out`` (unless ``force``) and an ``out`` that is the source."""
    out = Path(os.path.abspath(out))
    if source is not None and os.path.exists(out) and \
            os.path.realpath(out) == os.path.realpath(source):
        raise InputError(f"output {out} is the source file; choose another output path")
    if out.is_dir():
        raise InputError(f"output {out} is a folder; give a file name")
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputExistsError(f"{out} already exists; use force=True (--force) to replace it")
    if not out.parent.is_dir():
        raise InputError(f"output folder {out.parent} does not exist")
    return out


def check_output_folder(out, source: Path, *, force: bool = False) -> Path:
    """Refuse an output folder ``out`` that is (or holds) the source, or that exists (unless
    ``force``)."""
    out_path = check_output_path(out, [source])
    if (out_path.exists() or out_path.is_symlink()) and not force:
        raise OutputExistsError(f"{out_path} already exists; use force=True (--force) to "
                                f"replace it")
    return out_path


@contextlib.contextmanager
def atomic_output_file(out, *, force: bool = False):
    """Yield a temporary path next to ``out``; rename it to ``out`` once written and flushed
    (:func:`bakron._lib.fs.atomic_path`), refusing an ``out`` that appeared meanwhile unless
    ``force``.

    If the block raises (or is interrupted) the temporary file is removed and ``out`` is
    untouched; a process killed outright can leave a hidden ``.NAME.tmp-*`` file, never a
    partial ``out``.
    """
    out = Path(os.path.abspath(out))

    def still_new():
        if (out.exists() or out.is_symlink()) and not force:  # appeared while we worked
            raise OutputExistsError(f"{out} already exists; use force=True (--force) to "
                                    f"replace it")

    with atomic_path(out, before_replace=still_new) as tmp:
        yield tmp


def layer_parts(name: str, layer):
    """``(W_hat as numpy, quantizer)`` from a :class:`~bakron.LayerResult` or a pair."""
    if hasattr(layer, "values") and hasattr(layer, "quantizer"):
        values, quantizer = layer.values, layer.quantizer
    else:
        try:
            values, quantizer = layer
        except (TypeError, ValueError):
            raise TypeError(f"layer {name!r} must be a LayerResult or a pair (W_hat, quantizer), "
                            f"got {type(layer).__name__}") from None
    W_hat = np.asarray(_xp.to_numpy(values))
    if W_hat.ndim != 2:
        raise ValueError(f"layer {name!r}: W_hat must be a 2-D array, got shape {W_hat.shape}")
    if W_hat.dtype.kind != "f":
        raise ValueError(f"layer {name!r}: W_hat must be floating point, got {W_hat.dtype}")
    return W_hat, quantizer


def encode_on_grid(quantizer, W_hat, name: str = "W_hat") -> np.ndarray:
    """Codes of ``W_hat`` under ``quantizer``, which must reproduce ``W_hat`` exactly.

    ``ValueError`` (naming the first entry off the grid) otherwise: the export stores codes,
    so only a ``W_hat`` on the quantizer's grid can be written without loss.
    """
    Wn = np.asarray(_xp.to_numpy(W_hat))
    if Wn.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array, got shape {Wn.shape}")
    m, n = Wn.shape
    quantizer.check_shape(m, n)
    W64 = Wn.astype(np.float64)
    zero = np.zeros((1,), dtype=np.int64)
    values, codes = quantizer.quantize(W64[None], rows=zero, cols=zero)
    bad = values[0] != W64
    if np.any(bad):
        i, j = np.argwhere(bad)[0]
        raise ValueError(
            f"{name} is not on this {quantizer.format} grid at {int(bad.sum())} entries (first "
            f"[{i}, {j}]: {W64[i, j]!r}, nearest grid value {values[0, i, j]!r}); export the "
            f"W_hat that this quantizer produced, in float32 or float64")
    return codes[0].astype(np.int64)
