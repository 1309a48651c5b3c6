"""The anti-diagonal solvers on the Array API (docs/algorithm.md, "The anti-diagonal wavefront").

They execute :func:`bakron.solvers.schedule.tile_wavefront`: all tiles of one step (an
anti-diagonal ``a + b = s``) are independent, so their targets are computed in one batched
product and rounded in one quantizer call (one per tile shape where the edges are ragged).
Two variants:

* ``accumulator`` keeps ``Y = G_O^T Ẽ`` and reads targets as ``W + (Y G_I)`` — about
  ``mn(m+n)`` work; ``solve_block_accumulator`` also serves as the base case of the recursion
  (a block, with the feedback ``F`` received from outside it).
* ``direct`` recomputes each target from (1) over the dominating region, ``O(m^2 n^2 / t)``
  work — the baseline that published speed-ups are quoted against.

One-sided problems (``A_O is None``) degenerate to a sweep over column tiles: all tiles of one
column are independent, so each step rounds a whole column of tiles.
"""
from __future__ import annotations

from ._problem import Workspace
from .schedule import tile_wavefront


def solve_block_accumulator(p: Workspace, ra: int, rb: int, ca: int, cb: int) -> None:
    """Solve tiles ``[ra, rb) x [ca, cb)``; targets are ``W + F + (feedback inside the block)``."""
    xp = p.xp
    R0, R1, C0, C1 = p.rows[ra], p.rows[rb], p.cols[ca], p.cols[cb]
    base = p.W[R0:R1, C0:C1]
    if p.F is not None:
        base = base + p.F[R0:R1, C0:C1]
    if not p.two_sided:
        _column_sweep(p, ra, rb, ca, cb, base)
        return
    G_I = p.eye(C1 - C0) + p.A_I[C0:C1, C0:C1]
    G_Ot = xp.matrix_transpose(p.eye(R1 - R0) + p.A_O[R0:R1, R0:R1])   # (bm, bm)
    Y = xp.zeros((R1 - R0, C1 - C0), dtype=p.dtype, device=p.device)  # G_O^T Ẽ, block-local
    for step in tile_wavefront(rb - ra, cb - ca, True):
        for group in p.group_by_shape([(ra + a, ca + b) for a, b in step]):
            rs = [slice(p.rows[a] - R0, p.rows[a + 1] - R0) for a, _ in group]
            cs = [slice(p.cols[b] - C0, p.cols[b + 1] - C0) for _, b in group]
            Yr = xp.stack([Y[r, :] for r in rs])                  # (k, tx, bn)
            Gc = xp.stack([G_I[:, c] for c in cs])                # (k, bn, ty)
            Wt = p.tiles_of(p.W, group)
            T = p.tiles_of(base, group, R0, C0) + xp.matmul(Yr, Gc)
            Et = p.round_batch(group, T, Wt)
            Go = xp.stack([G_Ot[:, r] for r in rs])               # (k, bm, tx)
            U = xp.matmul(Go, Et)                                 # (k, bm, ty)
            for i, c in enumerate(cs):                            # column blocks are disjoint
                Y[:, c] = Y[:, c] + U[i, ...]


def _column_sweep(p: Workspace, ra: int, rb: int, ca: int, cb: int, base) -> None:
    """One-sided block: column tiles from right to left, all row tiles of a column at once."""
    xp = p.xp
    R0, R1, C0, C1 = p.rows[ra], p.rows[rb], p.cols[ca], p.cols[cb]
    A_I = p.A_I[C0:C1, C0:C1]
    Z = xp.zeros((R1 - R0, C1 - C0), dtype=p.dtype, device=p.device)  # Ẽ A_I, block-local
    for step in tile_wavefront(rb - ra, cb - ca, False):
        b = ca + step[0][1]
        c = slice(p.cols[b] - C0, p.cols[b + 1] - C0)
        Tcol = base[:, c] + Z[:, c]
        Ecol = xp.zeros_like(Tcol)
        for group in p.group_by_shape([(ra + a, b) for a, _ in step]):
            T = p.tiles_of(Tcol, group, R0, p.cols[b])
            Wt = p.tiles_of(p.W, group)
            Et = p.round_batch(group, T, Wt)
            for i, (a, _) in enumerate(group):
                Ecol[p.rows[a] - R0:p.rows[a + 1] - R0, :] = Et[i, ...]
        if b > ca:
            Z[:, :c.start] = Z[:, :c.start] + xp.matmul(Ecol, A_I[c, :c.start])


def solve_accumulator(p: Workspace) -> None:
    solve_block_accumulator(p, 0, p.M, 0, p.N)


def solve_direct(p: Workspace) -> None:
    """Each target from (1) over the dominating region; E is kept in full."""
    xp = p.xp
    E = xp.zeros((p.m, p.n), dtype=p.dtype, device=p.device)
    G_I = p.eye(p.n) + p.A_I
    if not p.two_sided:
        for step in tile_wavefront(p.M, p.N, False):
            b = step[0][1]
            c0, c1 = p.cols[b], p.cols[b + 1]
            Tcol = p.W[:, c0:c1] + xp.matmul(E[:, c1:], G_I[c1:, c0:c1])
            for group in p.group_by_shape(step):
                Et = p.round_batch(group, p.tiles_of(Tcol, group, 0, c0), p.tiles_of(p.W, group))
                for i, (a, _) in enumerate(group):
                    E[p.rows[a]:p.rows[a + 1], c0:c1] = Et[i, ...]
        return
    G_O = p.eye(p.m) + p.A_O
    for step in tile_wavefront(p.M, p.N, True):
        for group in p.group_by_shape(step):
            r0 = p.rows[min(a for a, _ in group)]      # the dominating region of the batch
            c0 = p.cols[min(b for _, b in group)]
            Go = xp.stack([xp.matrix_transpose(G_O[r0:, p.rows[a]:p.rows[a + 1]])
                           for a, _ in group])         # (k, tx, m - r0)
            Gi = xp.stack([G_I[c0:, p.cols[b]:p.cols[b + 1]] for _, b in group])  # (k, n-c0, ty)
            Wt = p.tiles_of(p.W, group)
            T = Wt + xp.matmul(xp.matmul(Go, E[r0:, c0:]), Gi)
            Et = p.round_batch(group, T, Wt)
            for i, (a, b) in enumerate(group):
                E[p.rows[a]:p.rows[a + 1], p.cols[b]:p.cols[b + 1]] = Et[i, ...]
