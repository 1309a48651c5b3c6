"""Random test problems: weights, Hessians of several conditions, quantizers."""
from __future__ import annotations

import numpy as np

import bakron


def spd(rng, n, kind="well"):
    """A symmetric positive semi-definite n x n matrix of the given condition."""
    if kind == "well":
        X = rng.standard_normal((n, 2 * n + 4))
        return X @ X.T / X.shape[1] + 0.1 * np.eye(n)
    if kind == "ill":
        Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
        ev = np.logspace(-9, 0, n)
        return (Q * ev) @ Q.T
    if kind == "rank":  # rank-deficient, with a dead channel when n > 2
        k = max(1, n // 3)
        X = rng.standard_normal((n, k))
        H = X @ X.T
        if n > 2:
            H[1, :] = 0.0
            H[:, 1] = 0.0
        return H
    raise ValueError(kind)


def make_quantizer(rng, W, bits, symmetric, granularity, group_size):
    if granularity == "group":
        return bakron.UniformQuantizer.fit(W, bits, symmetric=symmetric, granularity="group",
                                           group_size=group_size)
    return bakron.UniformQuantizer.fit(W, bits, symmetric=symmetric, granularity=granularity)


def problem(seed, m, n, tx, ty, *, kind="well", two_sided=True, damp=0.01):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((m, n))
    H_in = spd(rng, n, kind)
    H_out = spd(rng, m, kind) if two_sided else None
    f_in = bakron.prepare_factor(H_in, ty, damp=damp)
    f_out = bakron.prepare_factor(H_out, tx, damp=damp) if two_sided else None
    return W, f_in, f_out
