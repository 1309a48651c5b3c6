"""The launch layout shared by the CUDA engine and its kernel (no numba import here).

Flag bits of a launch (``flags`` argument of the kernel):
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

#: fields of a block descriptor (int64 each): tile ranges ``[ra, rb) x [ca, cb)`` and where
#: the block's offsets / local accumulator live in the ``F`` buffer (element offset of the
#: block's first element, leading dimension)
DESC_RA, DESC_RB, DESC_CA, DESC_CB, DESC_F_OFFSET, DESC_F_LD = range(6)
#: descriptor width
DESC = 6
