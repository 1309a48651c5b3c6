"""The quadrant recursion on the Array API (docs/algorithm.md, "The quadrant recursion").

Executes :class:`bakron.solvers.schedule.RecursionPlan` depth-first: each leaf is solved by
the anti-diagonal accumulator (``solve_block_accumulator``) with the offsets ``F`` it has
received from outside; each update is a few dense products. Work: ``O(mn(m+n))``, the order
of one product ``G_O^T W G_I``.
"""
from __future__ import annotations

from ._problem import Workspace
from .antidiagonal import solve_block_accumulator
from .schedule import AFTER_BC, AFTER_BOTTOM, AFTER_D, AFTER_RIGHT, Block, RecursionPlan

#: Default base-block size, in tiles per side.
BASE_TILES = 8


def _mul_G_left_T(p: Workspace, X, r0: int, r1: int):
    """``G_O[r0:r1, r0:r1]^T X`` (``X`` when one-sided), using ``G = I + A``: a new array
    equal to ``X + A^T X`` (the sum is computed in place on the product)."""
    if not p.two_sided:
        return X
    Y = p.xp.matmul(p.xp.matrix_transpose(p.A_O[r0:r1, r0:r1]), X)
    Y += X
    return Y


def _mul_G_right(p: Workspace, X, c0: int, c1: int):
    """``X G_I[c0:c1, c0:c1]``: a new array equal to ``X + X A``."""
    Y = p.xp.matmul(X, p.A_I[c0:c1, c0:c1])
    Y += X
    return Y


def solve_recursive(p: Workspace, base: int = BASE_TILES) -> None:
    """Run the recursion plan over ``p`` with ``base`` tiles per leaf side.

    Memory: one m x n buffer ``p.F`` holds the offsets of unsolved blocks and, once a leaf is
    solved, its errors ``E = W - Ŵ`` (so the updates read E in place instead of copies);
    a quadrant node keeps one ``h x h`` product (``X = E_D A_I[C2, C1]``) while B and C are
    solved, and each update holds at most three ``h x h`` temporaries.
    """
    plan = RecursionPlan(p.rows, p.cols, base, p.two_sided)
    xp = p.xp
    p.F = xp.zeros((p.m, p.n), dtype=p.dtype, device=p.device)
    kept: dict = {}  # after_D's X per quadrant node, until its after_BC
    for op in plan.sequence:
        if isinstance(op, Block):
            _leaf(p, op)
        else:
            _update(p, op, kept)


def _leaf(p: Workspace, blk: Block) -> None:
    solve_block_accumulator(p, blk.ra, blk.rb, blk.ca, blk.cb)
    r0, r1, c0, c1 = p.rows[blk.ra], p.rows[blk.rb], p.cols[blk.ca], p.cols[blk.cb]
    F = p.F
    F[r0:r1, c0:c1] = p.W[r0:r1, c0:c1]        # the block's offsets are spent:
    F[r0:r1, c0:c1] -= p.Wq[r0:r1, c0:c1]      # keep its errors W - Ŵ there


def _update(p: Workspace, u, kept: dict) -> None:
    """One update of the plan (what each kind adds: :class:`bakron.solvers.schedule.Update`)."""
    xp = p.xp
    mm, tr = xp.matmul, xp.matrix_transpose
    F, AO, AI = p.F, p.A_O, p.A_I
    r0, r_, r1 = u.rows
    c0, c_, c1 = u.cols
    if u.kind == AFTER_D:
        ED = F[r_:r1, c_:c1]                                           # E_D (view)
        AO21t = tr(AO[r_:r1, r0:r_])                                   # A_O[R2, R1]^T
        AI21 = AI[c_:c1, c0:c_]
        T = _mul_G_right(p, ED, c_, c1)
        F[r0:r_, c_:c1] += mm(AO21t, T)                                # -> B
        del T
        T = _mul_G_left_T(p, ED, r_, r1)
        F[r_:r1, c0:c_] += mm(T, AI21)                                 # -> C
        del T
        kept[u.block] = mm(ED, AI21)                                   # X, kept for A
    elif u.kind == AFTER_BC:
        AO21t = tr(AO[r_:r1, r0:r_])
        AI21 = AI[c_:c1, c0:c_]
        U = _mul_G_left_T(p, F[r0:r_, c_:c1], r0, r_)                  # G_O11^T E_B
        XA = mm(U, AI21)
        del U
        V = _mul_G_right(p, F[r_:r1, c0:c_], c0, c_)                   # E_C G_I11
        V += kept.pop(u.block)
        XA += mm(AO21t, V)
        del V
        F[r0:r_, c0:c_] += XA                                          # -> A
    elif u.kind == AFTER_RIGHT:
        T = _mul_G_left_T(p, F[r0:r1, c_:c1], r0, r1)
        F[r0:r1, c0:c_] += mm(T, AI[c_:c1, c0:c_])
    elif u.kind == AFTER_BOTTOM:
        T = _mul_G_right(p, F[r_:r1, c0:c1], c0, c1)
        F[r0:r_, c0:c1] += mm(tr(AO[r_:r1, r0:r_]), T)
    else:  # pragma: no cover - the plan makes only these
        raise AssertionError(f"unknown update {u.kind!r}")
