"""Small random networks for the tests, the benchmark and the memory plot (not public API)."""
from __future__ import annotations

import numpy as np

from .stages import GELU, LayerNorm, Linear, ReLU, SoftmaxCrossEntropy

__all__ = ["random_mlp", "deep_chain"]

_ACTS = {"gelu": GELU, "relu": ReLU}


def random_mlp(widths, *, act="gelu", layer_norm=False, bias=True, seed=0, xp=None,
               dtype=np.float64, head=None):
    """``Linear → act [→ LayerNorm] → … → Linear → head`` with weights ~ N(0, 1/fan_in).

    ``widths = [d_in, h_1, …, n_classes]``; layers are named ``fc0, fc1, …``. Arrays are made
    with numpy from ``seed`` and moved to ``xp`` (numpy when ``None``).
    """
    rng = np.random.default_rng(seed)
    conv = (lambda a: a) if xp is None else xp.asarray
    stages = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        W = (rng.standard_normal((b, a)) / np.sqrt(a)).astype(dtype)
        bb = (0.1 * rng.standard_normal(b)).astype(dtype) if bias else None
        stages.append(Linear(conv(W), None if bb is None else conv(bb), name=f"fc{i}"))
        if i < len(widths) - 2:
            stages.append(_ACTS[act]())
            if layer_norm:
                stages.append(LayerNorm())
    stages.append(SoftmaxCrossEntropy() if head is None else head)
    return stages


def deep_chain(depth: int, width: int, *, n_classes: int = 10, seed: int = 0, xp=None,
               dtype=np.float64):
    """A deep chain of ``depth`` (Linear, GELU) pairs of one width, plus a classifier."""
    return random_mlp([width] * (depth + 1) + [n_classes], act="gelu", seed=seed, xp=xp,
                      dtype=dtype)
