"""The naive reference solver: the vec-form LDLQ recurrence, obviously correct
(docs/algorithm.md, "The rounding rule").

With ``K = G_O ⊗ G_I`` (row-major vec), tiles are processed from the last to the first and
each tile's target is ``w_p + sum_{q > p} K[q, p] (w_q - ŵ_q)``. Only the columns of K that the
current tile needs are built (``G_O[:, rows] ⊗ G_I[:, cols]``), but the work is still
``O(m^2 n^2)``: this solver exists for tests, and refuses sizes whose full K would exceed
``max_bytes``.
"""
from __future__ import annotations

from ._problem import Workspace

#: The naive solver refuses problems whose full Kronecker matrix would exceed this many bytes.
MAX_KRON_BYTES = 2 ** 31


def solve_naive(p: Workspace, max_bytes: int | None = None) -> None:
    xp = p.xp
    m, n = p.m, p.n
    limit = MAX_KRON_BYTES if max_bytes is None else max_bytes
    need = (m * n) ** 2 * (4 if p.dtype == xp.float32 else 8)
    if need > limit:
        raise ValueError(
            f"method='naive' would build a {m * n} x {m * n} Kronecker matrix "
            f"({need / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB budget); it is a test "
            f"reference: use method='recursive' or 'antidiagonal' for a {m} x {n} matrix")
    G_O = p.eye(m) if p.A_O is None else p.eye(m) + p.A_O
    G_I = p.eye(n) + p.A_I
    e = xp.zeros((m * n,), dtype=p.dtype, device=p.device)  # vec(E) over rounded tiles
    for a in reversed(range(p.M)):
        r0, r1 = p.rows[a], p.rows[a + 1]
        for b in reversed(range(p.N)):
            c0, c1 = p.cols[b], p.cols[b + 1]
            tx, ty = r1 - r0, c1 - c0
            # K[:, P_ab] for the tile's positions P_ab: K[(k,l), (i,j)] = G_O[k,i] G_I[l,j]
            Kcols = G_O[:, None, r0:r1, None] * G_I[None, :, None, c0:c1]
            Kcols = xp.reshape(Kcols, (m * n, tx * ty))
            feedback = xp.reshape(xp.matmul(e[None, :], Kcols), (tx, ty))
            Wt = p.W[r0:r1, c0:c1]
            T = Wt + feedback
            Et = p.round_batch([(a, b)], T[None, ...], Wt[None, ...])[0, ...]
            E2 = xp.reshape(e, (m, n))
            E2[r0:r1, c0:c1] = Et
            e = xp.reshape(E2, (m * n,))
