"""The recursive divide-and-conquer solver of SPEC §4.

A block of tiles is split at tile boundaries into quadrants A (top-left), B (top-right),
C (bottom-left), D (bottom-right). D is solved first; its errors are pushed into the offsets
``F`` of B and C by dense products; B and C (independent) are solved; then A receives the
feedback of B, C and D and is solved last. A block that is at most ``base`` tiles on a side
is handed to the base solver (a compiled kernel, or the array-API anti-diagonal wavefront).
Work: ``O(mn(m+n))``, the order of one product ``G_O^T W G_I``.

One-sided problems (``A_O is None``) never split rows (rows are independent problems): the
recursion halves the column range only.
"""
from __future__ import annotations

from typing import Callable

from ._problem import Problem

BaseSolver = Callable[[Problem, int, int, int, int], None]

#: Default base-block size, in tiles per side.
BASE_TILES = 8


def _mul_G_left_T(p: Problem, X, r0: int, r1: int):
    """``G_O[r0:r1, r0:r1]^T X`` (``X`` when one-sided), using ``G = I + A``: a new array
    equal to ``X + A^T X`` (the sum is computed in place on the product)."""
    if not p.two_sided:
        return X
    Y = p.xp.matmul(p.xp.matrix_transpose(p.A_O[r0:r1, r0:r1]), X)
    Y += X
    return Y


def _mul_G_right(p: Problem, X, c0: int, c1: int):
    """``X G_I[c0:c1, c0:c1]``: a new array equal to ``X + X A``."""
    Y = p.xp.matmul(X, p.A_I[c0:c1, c0:c1])
    Y += X
    return Y


def solve_recursive(p: Problem, base_solver: BaseSolver, base: int = BASE_TILES) -> None:
    """Quadrant recursion over ``p`` with ``base_solver`` at the leaves.

    Memory: one m x n buffer ``p.F`` holds the offsets of unsolved blocks and, once a leaf is
    solved, its errors ``E = W - Ŵ`` (so the updates read E in place instead of copies);
    a quadrant node keeps one ``h x h`` product (``E_D A_I[C2, C1]``) while B and C are solved,
    and each update holds at most three ``h x h`` temporaries. Every product and sum is
    the same floating-point operation as in the plain formulation, in the same order.
    """
    if base < 1:
        raise ValueError(f"base must be >= 1 tile, got {base}")
    xp = p.xp
    p.F = xp.zeros((p.m, p.n), dtype=p.dtype, device=p.device)
    R, C = p.rows, p.cols
    AO = p.A_O
    AI = p.A_I
    mm = xp.matmul
    tr = xp.matrix_transpose

    def leaf(ra: int, rb: int, ca: int, cb: int) -> None:
        base_solver(p, ra, rb, ca, cb)
        r0, r1, c0, c1 = R[ra], R[rb], C[ca], C[cb]
        F = p.F
        F[r0:r1, c0:c1] = p.W[r0:r1, c0:c1]        # the block's offsets are spent:
        F[r0:r1, c0:c1] -= p.Wq[r0:r1, c0:c1]      # keep its errors W - Ŵ there

    def rec(ra: int, rb: int, ca: int, cb: int) -> None:
        split_r = p.two_sided and rb - ra > base
        split_c = cb - ca > base
        if not (split_r or split_c):
            leaf(ra, rb, ca, cb)
            return
        F = p.F
        if split_r and split_c:
            rm, cm = (ra + rb) // 2, (ca + cb) // 2
            r0, r_, r1 = R[ra], R[rm], R[rb]
            c0, c_, c1 = C[ca], C[cm], C[cb]
            rec(rm, rb, cm, cb)                                            # D
            ED = F[r_:r1, c_:c1]                                           # E_D (view)
            AO21t = tr(AO[r_:r1, r0:r_])                                   # A_O[R2, R1]^T
            AI21 = AI[c_:c1, c0:c_]
            T = _mul_G_right(p, ED, c_, c1)
            F[r0:r_, c_:c1] += mm(AO21t, T)                                # -> B
            del T
            T = _mul_G_left_T(p, ED, r_, r1)
            F[r_:r1, c0:c_] += mm(T, AI21)                                 # -> C
            del T
            X = mm(ED, AI21)                                               # kept for A
            rec(ra, rm, cm, cb)                                            # B
            rec(rm, rb, ca, cm)                                            # C
            U = _mul_G_left_T(p, F[r0:r_, c_:c1], r0, r_)                  # G_O11^T E_B
            XA = mm(U, AI21)
            del U
            V = _mul_G_right(p, F[r_:r1, c0:c_], c0, c_)                   # E_C G_I11
            V += X
            del X
            XA += mm(AO21t, V)
            del V
            F[r0:r_, c0:c_] += XA                                          # -> A
            del XA
            rec(ra, rm, ca, cm)                                            # A
        elif split_c:
            cm = (ca + cb) // 2
            r0, r1, c0, c_, c1 = R[ra], R[rb], C[ca], C[cm], C[cb]
            rec(ra, rb, cm, cb)                                            # right
            T = _mul_G_left_T(p, F[r0:r1, c_:c1], r0, r1)
            F[r0:r1, c0:c_] += mm(T, AI[c_:c1, c0:c_])
            del T
            rec(ra, rb, ca, cm)                                            # left
        else:
            rm = (ra + rb) // 2
            r0, r_, r1, c0, c1 = R[ra], R[rm], R[rb], C[ca], C[cb]
            rec(rm, rb, ca, cb)                                            # bottom
            T = _mul_G_right(p, F[r_:r1, c0:c1], c0, c1)
            F[r0:r_, c0:c1] += mm(tr(AO[r_:r1, r0:r_]), T)
            del T
            rec(ra, rm, ca, cb)                                            # top

    rec(0, p.M, 0, p.N)
