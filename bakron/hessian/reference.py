"""Test references: the exact Fisher of one layer by brute force, and its nearest Kronecker
product.

:func:`exact_fisher` differentiates the chain's loss with respect to one linear weight by
finite differences (a fourth-order central stencil on every entry, forward passes only, so it
shares nothing with the stages' VJPs) with the head's labels held fixed as the driver draws
them, and forms ``F = Σ_s w_s vec(G_s) vec(G_s)ᵀ / Σ_s w_s`` over sequences ``s`` (row-major
``vec``, ``F`` is mn x mn, matching ``H = H_out ⊗ H_in``). Tiny layers only: 4·m·n forward
passes per batch.

:func:`nearest_kronecker` is the Frobenius-nearest ``A ⊗ B`` to ``F`` (Van Loan & Pitsianis,
1993): rearrange ``F`` so that ``A ⊗ B`` becomes the rank-one ``vec(A) vec(B)ᵀ`` and take the
leading singular pair.
"""
from __future__ import annotations

import copy

from .. import _xp
from .driver import _as_batches
from .stages import HeadContext, is_head

__all__ = ["exact_fisher", "per_sequence_gradients", "nearest_kronecker", "rearrange"]


def _find_linear(body, layer):
    for i, st in enumerate(body):
        if not hasattr(st, "W"):
            continue
        for key in st.linears():
            if (f"stage{i}" if key is None else key) == layer:
                return i
    raise ValueError(f"layer {layer!r} is not a top-level Linear stage of the chain")


def _chain_losses(xp, body, head, x, labels):
    h = x
    for st in body:
        h = st.forward(xp, h)
    tok = head.token_losses(xp, h, labels)
    B = tok.shape[0]
    return xp.sum(xp.reshape(tok, (B, -1)), axis=1)


def per_sequence_gradients(stages, calib_inputs, layer, *, seed=0, batch_size=None,
                           step=1e-4):
    """``G_s = ∂loss_s/∂W`` (m x n) for every sequence (sample) ``s``, by finite differences.

    Returns a list (one entry per batch) of arrays of shape ``(B, m, n)``. The labels are drawn
    once per batch, exactly as :func:`global_factors` draws them, and held fixed.
    """
    stages = list(stages)
    body, head = stages[:-1], stages[-1]
    if not is_head(head) or not hasattr(head, "token_losses"):
        raise ValueError("the last stage must be a head with labels_for() and token_losses() "
                         "(e.g. SoftmaxCrossEntropy)")
    batches = _as_batches(calib_inputs, batch_size)
    xp = _xp.namespace(*batches)
    i = _find_linear(body, layer)
    lin = body[i]
    W = lin.W
    m, n = W.shape
    coef = ((2.0, -1.0), (1.0, 8.0), (-1.0, -8.0), (-2.0, 1.0))   # f' ≈ Σ c f(x + t h) / 12h
    out = []
    for k, x in enumerate(batches):
        z = x
        for st in body:
            z = st.forward(xp, z)
        labels = head.labels_for(xp, z, HeadContext(k, int(seed)))
        cols = []
        for p in range(m * n):
            e = xp.reshape(xp.astype(xp.arange(m * n, device=_xp.device(W)) == p, W.dtype),
                           (m, n))
            g = 0.0
            for t, c in coef:
                pert = copy.copy(lin)
                pert.W = W + (t * step) * e
                chain = body[:i] + [pert] + body[i + 1:]
                g = g + c * xp.astype(_chain_losses(xp, chain, head, x, labels), xp.float64)
            cols.append(g / (12.0 * step))
        G = xp.stack(cols, axis=1)
        out.append(xp.reshape(G, (x.shape[0], m, n)))
    return out


def exact_fisher(stages, calib_inputs, layer, *, seed=0, batch_size=None, weights=None,
                 step=1e-4):
    """The Fisher ``F = Σ_s w_s vec(G_s) vec(G_s)ᵀ / Σ_s w_s`` (mn x mn, float64) of ``layer``.

    ``weights``: one array ``(B,)`` per batch (per-sequence weights), default 1.
    """
    grads = per_sequence_gradients(stages, calib_inputs, layer, seed=seed,
                                   batch_size=batch_size, step=step)
    xp = _xp.namespace(*grads)
    F, wsum = None, 0.0
    for k, G in enumerate(grads):
        B, m, n = G.shape
        V = xp.reshape(G, (B, m * n))
        w = None if weights is None or weights[k] is None else xp.astype(weights[k], xp.float64)
        part = V.T @ (V if w is None else V * w[:, None])
        F = part if F is None else F + part
        wsum += float(B) if w is None else float(xp.sum(w))
    return F / wsum


def rearrange(xp, F, m: int, n: int):
    """``R(F)`` with ``R(A ⊗ B) = vec(A) vec(B)ᵀ`` (m² x n²)."""
    if tuple(F.shape) != (m * n, m * n):
        raise ValueError(f"F must be {m * n} x {m * n} for m={m}, n={n}, got {tuple(F.shape)}")
    R = xp.permute_dims(xp.reshape(F, (m, n, m, n)), (0, 2, 1, 3))
    return xp.reshape(R, (m * m, n * n))


def nearest_kronecker(F, m: int, n: int):
    """``(A, B, sigma, residual)``: ``A ⊗ B`` (A m x m, B n x n) nearest to ``F`` in Frobenius
    norm, the leading singular value of ``R(F)`` and ``‖F - A ⊗ B‖_F``. For a PSD ``F``,
    ``A`` and ``B`` are symmetric PSD; the sign is fixed so that ``trace(A) >= 0``."""
    xp = _xp.namespace(F)
    R = rearrange(xp, F, m, n)
    U, S, Vt = xp.linalg.svd(R, full_matrices=False)
    s1 = float(S[0])
    a = U[:, 0] * s1 ** 0.5
    b = Vt[0, :] * s1 ** 0.5
    A, B = xp.reshape(a, (m, m)), xp.reshape(b, (n, n))
    if float(xp.sum(xp.linalg.diagonal(A))) < 0:
        A, B = -A, -B
    resid = float(xp.sum(S[1:] ** 2)) ** 0.5
    return (A + A.T) / 2, (B + B.T) / 2, s1, resid
