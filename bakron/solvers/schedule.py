"""The order of operations of every solver, written once.

This module decides *what* is solved and updated, in which order, and what may run together;
it holds no arrays. The executors carry the plans out with their own arithmetic:

* the array-API executor (``bakron.solvers.recursive``, ``antidiagonal``), on any namespace;
* the numba CPU engine (``backends/numba_cpu.py``): the recursion plan as an op table run by
  one compiled call, the two-level wavefront as a task table (the blocks of a coarse step in
  a ``prange``), the tile wavefront inside its base-block kernels;
* the CUDA engine (``backends/numba_cuda.py``): the recursion plan level by level (all the
  leaves of a phase in one launch), the two-level wavefront (one launch per coarse step),
  the tile wavefront inside its kernel.

Three schedules, all orders that respect the dominance order of docs/algorithm.md ("The
rounding rule"), so all give the same Ŵ:

``tile_wavefront``
    inside a block of ``Mb x Nb`` tiles: two-sided, the anti-diagonals ``a + b = s`` from
    ``s = Mb + Nb - 2`` down to ``0`` (the tiles of a diagonal are independent); one-sided,
    the tile columns from the right, all row tiles of a column together (docs/algorithm.md,
    "The anti-diagonal wavefront").
``RecursionPlan``
    the quadrant recursion (docs/algorithm.md, "The quadrant recursion"): a block larger than
    ``base`` tiles is split into quadrants A (top-left), B (top-right), C (bottom-left) and D
    (bottom-right); D is solved first, its errors are pushed into B and C (``after_D``), B and
    C are solved (independently), their errors and D's are pushed into A (``after_BC``), A is
    solved last. One-sided problems (and blocks only wider than ``base``) split the columns
    only (``after_right``); blocks only taller than ``base`` split the rows (``after_bottom``).
``two_level``
    the anti-diagonal over coarse blocks of ``cs x cs`` tiles (docs/algorithm.md, "Choosing a
    method"): every block of one coarse diagonal is independent; before a step its blocks
    gather the feedback of all solved blocks, after it they scatter their errors.

A later batch (stack) axis adds one dimension to the blocks of a step: items of a stack are
independent, so they join every step of the same plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


def tile_edges(size: int, t: int) -> list[int]:
    """Tile boundaries ``[0, t, 2t, ..., size]``; the last tile is smaller when t does not
    divide ``size``."""
    return list(range(0, size, t)) + [size]


# ------------------------------------------------------------------------------------------
# the tile wavefront inside one block
# ------------------------------------------------------------------------------------------

def diagonal(Mb: int, Nb: int, s: int) -> list[tuple[int, int]]:
    """The tiles ``(a, b)`` with ``a + b = s`` of an ``Mb x Nb`` block, top row first."""
    return [(a, s - a) for a in range(max(0, s - Nb + 1), min(Mb - 1, s) + 1)]


def tile_wavefront(Mb: int, Nb: int, two_sided: bool) -> list[list[tuple[int, int]]]:
    """The steps of the tile wavefront over an ``Mb x Nb`` block (block-local tiles); the
    tiles of one step are independent. Compiled kernels enumerate the same steps with
    :func:`step_count` and the index arithmetic of :func:`diagonal`."""
    if two_sided:
        return [diagonal(Mb, Nb, s) for s in reversed(range(Mb + Nb - 1))]
    return [[(a, b) for a in range(Mb)] for b in reversed(range(Nb))]


def step_count(Mb: int, Nb: int, two_sided: bool) -> int:
    """Number of dependent steps of the tile wavefront over an ``Mb x Nb`` block."""
    return Mb + Nb - 1 if two_sided else Nb


def step_width(Mb: int, Nb: int, two_sided: bool) -> int:
    """Most tiles in one step of that wavefront."""
    return min(Mb, Nb) if two_sided else Mb


# ------------------------------------------------------------------------------------------
# the quadrant recursion
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    """Tiles ``[ra, rb) x [ca, cb)``."""

    ra: int
    rb: int
    ca: int
    cb: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rb - self.ra, self.cb - self.ca


@dataclass(frozen=True)
class Update:
    """A feedback update of the recursion, after some children of ``block`` are solved.

    ``kind`` and what it adds (element ranges ``rows = (r0, r_, r1)``, ``cols = (c0, c_,
    c1)``: the split points; ``R1 = [r0, r_)``, ``R2 = [r_, r1)``, likewise ``C1``, ``C2``;
    ``E`` the errors of solved tiles, ``F`` the offsets of unsolved ones)::

        after_D       F_B += A_O[R2,R1]^T (E_D G_I[C2,C2])
                      F_C += G_O[R2,R2]^T X,   X = E_D A_I[C2,C1]   (X kept for after_BC)
        after_BC      F_A += G_O[R1,R1]^T (E_B A_I[C2,C1]) + A_O[R2,R1]^T (E_C G_I[C1,C1] + X)
        after_right   F_left += G_O[R,R]^T (E_right A_I[C2,C1])     (G_O = I one-sided)
        after_bottom  F_top  += A_O[R2,R1]^T (E_bottom G_I[C,C])

    (``after_right`` has no row split: ``r_ = r0``; ``after_bottom`` no column split:
    ``c_ = c0``.) ``level`` is the depth of ``block`` (the root is 0): a node's ``X`` lives
    while deeper levels run, so executors give each level its own scratch.
    """

    kind: str
    block: Block
    rows: tuple[int, int, int]
    cols: tuple[int, int, int]
    level: int


AFTER_D, AFTER_BC, AFTER_RIGHT, AFTER_BOTTOM = "after_D", "after_BC", "after_right", "after_bottom"


class RecursionPlan:
    """The quadrant recursion over tiles ``rows`` x ``cols`` (tile edges, elements) with
    leaves of at most ``base`` tiles a side.

    ``sequence``
        depth-first, one operation at a time: :class:`Block` (solve this leaf) or
        :class:`Update`; the order of the array-API and numba executors.
    ``phases`` (built on first use)
        level-synchronous: ``("leaves", [Block, ...])`` (independent leaves, solvable
        together) or ``("update", Update)``; the order of the CUDA engine. Every ``F``
        region receives the same updates in the same order as in ``sequence``.
    """

    def __init__(self, rows: list[int], cols: list[int], base: int, two_sided: bool):
        if base < 1:
            raise ValueError(f"base must be >= 1 tile, got {base}")
        self.rows, self.cols = list(rows), list(cols)
        self.base = int(base)
        self.two_sided = bool(two_sided)
        self.M, self.N = len(self.rows) - 1, len(self.cols) - 1
        self.root = Block(0, self.M, 0, self.N)
        self.sequence: list = []
        self._depth_first(self.root, 0)

    @cached_property
    def phases(self) -> list:
        out: list = []
        self._level_synchronous([self.root], 0, out)
        return out

    # -- the tree ------------------------------------------------------------------------
    def split(self, blk: Block) -> str:
        """``"quad"``, ``"col"`` (columns only), ``"row"`` (rows only) or ``"leaf"``."""
        sr = self.two_sided and blk.rb - blk.ra > self.base
        sc = blk.cb - blk.ca > self.base
        return "quad" if (sr and sc) else "col" if sc else "row" if sr else "leaf"

    def children(self, blk: Block) -> list[list[Block]]:
        """The children in solving order, grouped by phase (the blocks of a phase are
        independent): quad ``[[D], [B, C], [A]]``, col ``[[right], [left]]``, row
        ``[[bottom], [top]]``, a leaf ``[[itself]]``."""
        ra, rb, ca, cb = blk.ra, blk.rb, blk.ca, blk.cb
        rm, cm = (ra + rb) // 2, (ca + cb) // 2
        k = self.split(blk)
        if k == "quad":
            return [[Block(rm, rb, cm, cb)], [Block(ra, rm, cm, cb), Block(rm, rb, ca, cm)],
                    [Block(ra, rm, ca, cm)]]
        if k == "col":
            return [[Block(ra, rb, cm, cb)], [Block(ra, rb, ca, cm)]]
        if k == "row":
            return [[Block(rm, rb, ca, cb)], [Block(ra, rm, ca, cb)]]
        return [[blk]]

    def update(self, blk: Block, phase: int, level: int) -> Update:
        """The update of ``blk`` after its children of ``phase`` are solved."""
        R, C = self.rows, self.cols
        rm, cm = (blk.ra + blk.rb) // 2, (blk.ca + blk.cb) // 2
        k = self.split(blk)
        r0, r1, c0, c1 = R[blk.ra], R[blk.rb], C[blk.ca], C[blk.cb]
        if k == "quad":
            kind = AFTER_D if phase == 0 else AFTER_BC
            return Update(kind, blk, (r0, R[rm], r1), (c0, C[cm], c1), level)
        if k == "col":
            return Update(AFTER_RIGHT, blk, (r0, r0, r1), (c0, C[cm], c1), level)
        return Update(AFTER_BOTTOM, blk, (r0, R[rm], r1), (c0, c0, c1), level)

    # -- the two orders --------------------------------------------------------------------
    def _depth_first(self, blk: Block, level: int) -> None:
        if self.split(blk) == "leaf":
            self.sequence.append(blk)
            return
        phases = self.children(blk)
        for ph, group in enumerate(phases):
            for child in group:
                self._depth_first(child, level + 1)
            if ph < len(phases) - 1:
                self.sequence.append(self.update(blk, ph, level))

    def _level_synchronous(self, blocks: list[Block], level: int, out: list) -> None:
        if all(self.split(b) == "leaf" for b in blocks):
            out.append(("leaves", blocks))
            return
        kids = [self.children(b) for b in blocks]
        for ph in range(3):
            sub = [c for ch in kids for c in (ch[ph] if ph < len(ch) else [])]
            if sub:
                self._level_synchronous(sub, level + 1, out)
            for ch, b in zip(kids, blocks):
                if ph < len(ch) - 1 and self.split(b) != "leaf":
                    out.append(("update", self.update(b, ph, level)))

    def leaves(self) -> list[Block]:
        return [op for op in self.sequence if isinstance(op, Block)]


# ------------------------------------------------------------------------------------------
# the two-level wavefront
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CoarseStep:
    """One step of the two-level wavefront: ``blocks`` (tile ranges) are independent and
    solved together. ``gather``: their targets first receive the feedback of every block
    solved before (all steps but the first); ``scatter``: afterwards their errors are pushed
    to the blocks of later steps (two-sided, all steps but the last; one-sided the next step
    gathers from the errors directly)."""

    blocks: tuple[Block, ...]
    gather: bool
    scatter: bool


def two_level(M: int, N: int, cs: int, two_sided: bool) -> list[CoarseStep]:
    """The coarse steps over ``M x N`` tiles in blocks of ``cs x cs`` tiles (the last block
    row / column smaller): two-sided, the coarse anti-diagonals from the bottom-right; one-sided,
    the coarse columns from the right with all their blocks."""
    if cs < 1:
        raise ValueError(f"coarse block must be >= 1 tile, got {cs}")
    Mc, Nc = -(-M // cs), -(-N // cs)

    def blk(A: int, B: int) -> Block:
        return Block(A * cs, min(M, (A + 1) * cs), B * cs, min(N, (B + 1) * cs))

    if two_sided:
        diags = [[blk(A, B) for A, B in diagonal(Mc, Nc, s)]
                 for s in reversed(range(Mc + Nc - 1))]
    else:
        diags = [[blk(A, B) for A in range(Mc)] for B in reversed(range(Nc))]
    last = len(diags) - 1
    return [CoarseStep(tuple(d), gather=i > 0, scatter=two_sided and i < last)
            for i, d in enumerate(diags)]
