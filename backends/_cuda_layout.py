"""The launch layout shared by the CUDA engine and its kernel (no numba import here).

A launch of the kernel (``backends/_cuda_kernels.py``) gets two int64 tables besides the
arrays: the *launch descriptor* ``prm`` (``PRM`` fields ``P_*``: sizes, the step count, the
flags, the quantizer's grid) and the *block descriptors* ``desc`` (``DESC`` fields ``DESC_*``
per block: its tile ranges and where its item's arrays start). Flag bits of a launch
(``prm[P_FLAGS]``):
"""
from __future__ import annotations

#: the blocks' targets include offsets ``F`` received from outside the block
HAS_F = 1
#: the two-level wavefront's global accumulator ``Yg`` adds to the targets and receives errors
HAS_YG = 2
#: two-sided problem (``A_O`` is given): the tile wavefront runs over anti-diagonals
TWO_SIDED = 4
#: asymmetric grid (zero points)
ASYM = 8
#: record every target into ``T``
HAS_T = 16

#: fields of the launch descriptor (int64 each): the matrix size ``m x n``, the blocks of
#: the launch ``nblk``, its grid-synchronised steps ``nsteps``, the flag bits, the shapes of
#: the quantizer's scale table ``s_rows x s_cols`` and zero-point table ``z_rows x z_cols``,
#: its group size ``gsz`` and code range ``lo .. hi``, and the ``period``: the blocks repeat
#: the tile ranges of the first ``period`` blocks (``nblk`` a multiple of it; a single
#: solve: ``nblk``; a stack: the blocks of one item, its items in turn), so the kernel finds
#: a tile's block by a division and a scan of one period instead of all the descriptors
(P_M, P_N, P_NBLK, P_NSTEPS, P_FLAGS, P_S_ROWS, P_S_COLS, P_Z_ROWS, P_Z_COLS, P_GSZ, P_LO,
 P_HI, P_PERIOD) = range(13)
#: launch descriptor width
PRM = 13

#: fields of a block descriptor (int64 each): tile ranges ``[ra, rb) x [ca, cb)``; where the
#: block's offsets / local accumulator live in the ``F`` buffer (element offset of the
#: block's first element, leading dimension); and the element offsets of its item (a stack
#: solves several matrices in one launch, docs/stacks.md; 0 for a single solve) in ``W``,
#: in the outputs ``Wq``/``codes``/``T``, in ``E`` and ``Yg``, in ``A_O``, ``A_I`` and in
#: the quantizer's tables ``S`` and ``Z``
(DESC_RA, DESC_RB, DESC_CA, DESC_CB, DESC_F_OFFSET, DESC_F_LD, DESC_W_OFFSET,
 DESC_OUT_OFFSET, DESC_E_OFFSET, DESC_AO_OFFSET, DESC_AI_OFFSET, DESC_S_OFFSET,
 DESC_Z_OFFSET) = range(13)
#: descriptor width
DESC = 13


def block_row(ra: int, rb: int, ca: int, cb: int, f_off: int, f_ld: int, *, w: int = 0,
              out: int = 0, e: int = 0, ao: int = 0, ai: int = 0, s: int = 0,
              z: int = 0) -> list[int]:
    """One block descriptor (``DESC`` ints in field order); the item offsets default to 0
    (a single solve)."""
    return [ra, rb, ca, cb, f_off, f_ld, w, out, e, ao, ai, s, z]
