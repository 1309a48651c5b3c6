"""Synthetic layer files for tests, demos and the multi-GPU benchmark (numpy only)."""
from __future__ import annotations

import os

import numpy as np

from .. import _safetensors
from ..factor_files import save_factors

__all__ = ["write_synthetic_layers"]


def _spd(rng, n: int, rank: int | None = None) -> np.ndarray:
    """A correlated PSD matrix like a real input second moment (low-rank plus a floor)."""
    r = max(2, min(n, rank or n // 2))
    X = rng.standard_normal((r, n)) * np.geomspace(1.0, 0.05, n)[None, :]
    H = X.T @ X / r + 1e-3 * np.eye(n)
    return (H + H.T) / 2


def write_synthetic_layers(folder, shapes, *, seed: int = 0, kinds=None,
                           w_dtype=np.float32, prefix: str = "layer",
                           rank: int | None = None) -> list[dict]:
    """Write one weight file and one factor file per layer into ``folder``.

    ``shapes`` is a list of ``(m, n)``; ``kinds`` (same length, default all ``"dense"``) picks
    the H_out of each layer: ``"dense"`` (packed ``hout``), ``"diag"`` (``hout_diag``) or
    ``"none"`` (one-sided). Weights go to ``<prefix>NN.w.safetensors`` (tensor ``weight``),
    factors to ``<prefix>NN.f.safetensors`` (:mod:`bakron.factor_files` layout, float64).
    Returns one dict per layer: ``name``, ``W``, ``H_in``, ``H_out`` as ``path::tensor``
    references (``H_out`` None for one-sided), for :meth:`LayerJob.make`. ``rank`` caps the
    rank of the low-rank part of the factors (default n/2; smaller is faster to make).
    """
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    kinds = list(kinds) if kinds is not None else ["dense"] * len(shapes)
    if len(kinds) != len(shapes):
        raise ValueError("kinds must have one entry per shape")
    out = []
    for i, ((m, n), kind) in enumerate(zip(shapes, kinds)):
        name = f"{prefix}{i:02d}"
        W = (rng.standard_normal((m, n)) / np.sqrt(n)).astype(w_dtype)
        H_in = _spd(rng, n, rank)
        if kind == "dense":
            H_out = _spd(rng, m, rank)
        elif kind == "diag":
            H_out = rng.uniform(0.1, 2.0, m)
        elif kind == "none":
            H_out = None
        else:
            raise ValueError(f"unknown kind {kind!r}")
        wp = os.path.join(folder, f"{name}.w.safetensors")
        fp = os.path.join(folder, f"{name}.f.safetensors")
        _safetensors.save(wp, {"weight": W})
        save_factors(fp, H_in, H_out, overwrite=True)
        out.append({"name": name, "W": f"{wp}::weight", "H_in": f"{fp}::hin",
                    "H_out": None if H_out is None else
                    f"{fp}::{'hout' if kind == 'dense' else 'hout_diag'}"})
    return out


def synthetic_chain(widths, seed: int = 0, act: str = "gelu"):
    """``(Linear → act) x k → Linear → softmax head`` built from the public
    :mod:`bakron.hessian` stages, layers named ``fc0, fc1, ...`` (a picklable model factory
    for sharded-Hessian tests and demos: ``functools.partial(synthetic_chain, widths, seed)``).
    """
    import bakron.hessian as bh

    rng = np.random.default_rng(seed)
    stages = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        stages.append(bh.Linear(rng.standard_normal((b, a)) / np.sqrt(a),
                                0.1 * rng.standard_normal(b), name=f"fc{i}"))
        if i < len(widths) - 2:
            stages.append(bh.GELU() if act == "gelu" else bh.ReLU())
    stages.append(bh.SoftmaxCrossEntropy())
    return stages
