"""The CUDA kernel of the ``cuda`` engine: a batch of base blocks, each solved by the tile-level
anti-diagonal wavefront with the scalar quantizer fused, in one cooperative launch.

Imported only by :mod:`bakron.backends.numba_cuda` (which imports ``numba.cuda`` lazily).

What one launch does
--------------------
``nblk`` independent blocks of tiles (descriptors in ``desc``, ``DESC`` int64 each with the
fields ``DESC_*`` of ``_cuda_layout``: ``ra, rb, ca, cb`` tile ranges, ``f_off, f_ld`` where the
block's base offsets / local accumulator live, and where its item's arrays start, so that one
launch can mix the items of a stack). The scalars of the launch (sizes, steps, flags, the
quantizer's grid) come in one int64 launch descriptor ``prm`` (fields ``P_*``).
Step ``g = 0, 1, ...`` handles local anti-diagonal ``Mb + Nb - 2 - g`` of every block
(two-sided) or tile column ``Nb - 1 - g`` (one-sided); all the tiles of a step, over all
blocks, are spread over the CTAs of the grid (one 16 x 16 tile per CTA at a time, one thread
per element), and ``this_grid().sync()`` separates the steps. So a block's whole wavefront, a
whole phase of independent blocks, and the whole anti-diagonal of every item of a stack, is
one launch.

The target of tile (a, b) of a block with rows [R0, R1) and columns [C0, C1) (the rounding rule
of docs/algorithm.md in the block-local accumulator form) is::

    T = W + F + Yg + P + sum_{l >= j1, l < C1} Y[rows a, l] A_I[l, cols b]
    P = sum_{k >= i1, k < R1} A_O[k, rows a]^T E[k, cols b]          ("pull", two-sided only)

where ``F`` is the feedback from outside the block (optional), ``Yg`` the global accumulator's
identity term (two-level wavefront, optional), ``E`` the errors of tiles already solved and
``Y = G_O[block]^T E[block]`` the block's local accumulator, built row by row: after rounding,
``Y[rows a, cols b] = P + E_ab``. ``Y`` is stored where ``F`` is (``F`` of an element is read
before its ``Y`` is written, and neither is needed after the block is solved), so a block needs
no scratch beyond ``E``.

The rounding is the one of :meth:`bakron.UniformQuantizer.quantize`: ``round(t / s)`` half to
even (``cvt.rni``), clip, ``s * c`` (symmetric) or ``s * (c - z)``, in the working dtype, so a
given target rounds bit-identically; the targets are sums in another order than the array-API
path, so results agree exactly in float64 and up to near-ties in float32 (docs/algorithm.md).

The same Python source runs compiled (arguments are raw device pointers, ``CPointer``, so a
launch wraps nothing) and under numba-cuda's simulator (arguments are flat numpy arrays; the
simulator supports cooperative grids of one block).
"""
from __future__ import annotations

import math

from numba import cuda, types  # this module is imported lazily, by numba_cuda only

from ._cuda_layout import (ASYM, DESC, DESC_AI_OFFSET, DESC_AO_OFFSET, DESC_CA, DESC_CB,
                           DESC_E_OFFSET, DESC_F_LD, DESC_F_OFFSET, DESC_OUT_OFFSET, DESC_RA,
                           DESC_RB, DESC_S_OFFSET, DESC_W_OFFSET, DESC_Z_OFFSET, HAS_F, HAS_T,
                           HAS_YG, P_FLAGS, P_GSZ, P_HI, P_LO, P_M, P_N, P_NBLK, P_NSTEPS,
                           P_PERIOD, P_S_COLS, P_S_ROWS, P_Z_COLS, P_Z_ROWS, TWO_SIDED)

_CACHE: dict = {}


@cuda.jit(device=True)
def _step_tiles(Mb, Nb, g, two):
    """The tiles of step ``g`` of the tile wavefront over an ``Mb x Nb`` block
    (``bakron.solvers.schedule.tile_wavefront``): ``(count, alo, s)``. Two-sided: the
    anti-diagonal ``s = Mb + Nb - 2 - g``, rows ``alo .. alo + count - 1``; one-sided: tile
    column ``Nb - 1 - g``, all ``Mb`` row tiles (``count`` 0 once the block is done)."""
    if two:
        s = Mb + Nb - 2 - g
        if s < 0:
            return 0, 0, s
        alo = s - Nb + 1
        if alo < 0:
            alo = 0
        ahi = s
        if ahi > Mb - 1:
            ahi = Mb - 1
        return ahi - alo + 1, alo, s
    if g < Nb:
        return Mb, 0, 0
    return 0, 0, 0


def threads_for(tx: int, ty: int) -> int:
    """Threads per CTA for a tx x ty tile: one per element, 32..256."""
    e = tx * ty
    return int(min(256, max(32, 32 * math.ceil(e / 32))))


def chunk_for(tx: int, ty: int, itemsize: int) -> int:
    """K-chunk of the staged products so that the four shared arrays stay within ~40 KiB."""
    kc = 40960 // ((2 * tx + 2 * ty) * itemsize)
    kc = max(8, min(64, kc - kc % 8))
    return int(kc)


def make_kernel(dtype_name: str, tx: int, ty: int, mode: str, maxreg: int = 0,
                items: bool = False):
    """The block kernel for ``dtype_name`` ('float32'/'float64') and a ``tx x ty`` tile.

    ``mode='ptr'``: compiled eagerly with raw-pointer arguments (launch with integers);
    ``mode='array'``: lazily compiled with flat 1-D array arguments (simulator, or fallback).
    ``maxreg``: register cap per thread (0: the compiler's choice). ``items``: the variant
    for stacks, which reads each block's item offsets from its descriptor; without it the
    offsets are the constant 0 (a single solve), which keeps nine 64-bit offsets out of the
    registers of the tile loop (measured on the H200: the single-solve kernel with the
    offsets read took 4-14 % longer, docs/benchmarks/h200.md). Returns
    ``(dispatcher, threads)``.
    """
    key = (dtype_name, tx, ty, mode, maxreg, bool(items))
    ITEMS = bool(items)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    dt = types.float32 if dtype_name == "float32" else types.float64
    isz = 4 if dtype_name == "float32" else 8
    TX, TY = int(tx), int(ty)
    NT = threads_for(TX, TY)
    KC = chunk_for(TX, TY, isz)
    NE = (TX * TY + NT - 1) // NT
    TXY = TX * TY
    KTX = KC * TX
    KTY = KC * TY
    i16 = types.int16
    RX = (KTX + NT - 1) // NT
    RY = (KTY + NT - 1) // NT

    def block_kernel(W, AO, AI, F, E, Yg, Wq, codes, S, Z, T, desc, prm):
        """Solve ``prm[P_NBLK]`` blocks. Arguments (flat row-major arrays):

        * the problem: ``W`` (m x n), ``AO`` (m x m; unused one-sided), ``AI`` (n x n);
        * the buffers: ``F`` (offsets, then each block's local accumulator; where a block's
          live is in its descriptor), ``E`` (errors, m x n), ``Yg`` (the two-level wavefront's
          global accumulator, used with ``HAS_YG``), the outputs ``Wq``, ``codes``, ``T``
          (targets, with ``HAS_T``);
        * the grid of the quantizer: scales ``S``, zero points ``Z`` (with ``ASYM``);
        * the schedule: ``desc`` (``DESC`` fields per block, ``_cuda_layout.DESC_*``) and the
          launch descriptor ``prm`` (``_cuda_layout.P_*``: sizes, steps, flags, the shapes of
          the quantizer's tables, its group size and code range).

        In a stack (docs/stacks.md) the arrays hold several items: each block's descriptor
        says where its item starts in every array, so one launch mixes items.
        """
        m = prm[P_M]
        n = prm[P_N]
        nblk = prm[P_NBLK]
        nsteps = prm[P_NSTEPS]
        flags = prm[P_FLAGS]
        s_rows = prm[P_S_ROWS]
        s_cols = prm[P_S_COLS]
        z_rows = prm[P_Z_ROWS]
        z_cols = prm[P_Z_COLS]
        gsz = prm[P_GSZ]
        lo_i = prm[P_LO]
        hi_i = prm[P_HI]
        period = prm[P_PERIOD]
        sAO = cuda.shared.array((KC, TX), dt)
        sE = cuda.shared.array((KC, TY), dt)
        sY = cuda.shared.array((TX, KC), dt)
        sAI = cuda.shared.array((KC, TY), dt)
        accp = cuda.local.array(NE, dt)
        acct = cuda.local.array(NE, dt)
        pa = cuda.local.array(RX, dt)
        py = cuda.local.array(RX, dt)
        pe = cuda.local.array(RY, dt)
        pi = cuda.local.array(RY, dt)
        grid = cuda.cg.this_grid()
        tid = cuda.threadIdx.x
        two = (flags & TWO_SIDED) != 0
        has_f = (flags & HAS_F) != 0
        has_yg = (flags & HAS_YG) != 0
        asym = (flags & ASYM) != 0
        has_t = (flags & HAS_T) != 0
        lo = dt(lo_i)
        hi = dt(hi_i)
        zero = dt(0.0)
        for g in range(nsteps):
            # tiles of this step over all blocks: the blocks repeat the tile ranges of the first ``period``
            # (a stack: one period per item), so count one period and multiply
            per = 0
            for bi in range(period):
                d = bi * DESC
                cnt, alo, s = _step_tiles(desc[d + DESC_RB] - desc[d + DESC_RA],
                                          desc[d + DESC_CB] - desc[d + DESC_CA], g, two)
                per += cnt
            total = (nblk // period) * per
            w = cuda.blockIdx.x
            while w < total:
                # locate work item w: period rep, block bi of the period, its rem-th tile
                rep = w // per
                rem = w - rep * per
                bi = 0
                alo = 0
                s = 0
                while bi < period:
                    d = bi * DESC
                    cnt, alo, s = _step_tiles(desc[d + DESC_RB] - desc[d + DESC_RA],
                                              desc[d + DESC_CB] - desc[d + DESC_CA], g, two)
                    if rem < cnt:
                        break
                    rem -= cnt
                    bi += 1
                bi += rep * period
                d = bi * DESC
                ra = desc[d + DESC_RA]
                rb = desc[d + DESC_RB]
                ca = desc[d + DESC_CA]
                cb = desc[d + DESC_CB]
                f_off = desc[d + DESC_F_OFFSET]
                f_ld = desc[d + DESC_F_LD]
                w_off = 0
                o_off = 0
                e_off = 0
                ao_off = 0
                ai_off = 0
                s_off = 0
                z_off = 0
                if ITEMS:  # a compile-time constant: single solves fold the offsets to 0
                    w_off = desc[d + DESC_W_OFFSET]
                    o_off = desc[d + DESC_OUT_OFFSET]
                    e_off = desc[d + DESC_E_OFFSET]
                    ao_off = desc[d + DESC_AO_OFFSET]
                    ai_off = desc[d + DESC_AI_OFFSET]
                    s_off = desc[d + DESC_S_OFFSET]
                    z_off = desc[d + DESC_Z_OFFSET]
                if two:  # tile rem of the block's anti-diagonal s (top row first)
                    a = ra + alo + rem
                    b = ca + (s - (alo + rem))
                else:  # row tile rem of the block's column Nb - 1 - g
                    a = ra + rem
                    b = ca + (cb - ca - 1 - g)
                R0 = ra * TX
                R1 = rb * TX
                if R1 > m:
                    R1 = m
                C0 = ca * TY
                C1 = cb * TY
                if C1 > n:
                    C1 = n
                i0 = a * TX
                i1 = i0 + TX
                if i1 > m:
                    i1 = m
                hx = i1 - i0
                j0 = b * TY
                j1 = j0 + TY
                if j1 > n:
                    j1 = n
                hy = j1 - j0
                npull = 0
                if two:
                    npull = (R1 - i1 + KC - 1) // KC
                ntgt = (C1 - j1 + KC - 1) // KC
                nch = npull
                if ntgt > nch:
                    nch = ntgt
                for e in range(NE):
                    accp[e] = zero
                    acct[e] = zero
                for c in range(nch):
                    # issue every global load of the chunk first (registers), then store to
                    # shared memory: the loads are in flight together instead of one by one
                    k0 = i1 + c * KC
                    kc = R1 - k0
                    if kc > KC:
                        kc = KC
                    if c >= npull:
                        kc = 0
                    l0 = j1 + c * KC
                    lc = C1 - l0
                    if lc > KC:
                        lc = KC
                    if c >= ntgt:
                        lc = 0
                    for r in range(RX):
                        idx = tid + r * NT
                        va = zero
                        vy = zero
                        if idx < KTX:
                            kk = idx // TX
                            ii = idx - kk * TX
                            if kk < kc and ii < hx:
                                va = AO[ao_off + (k0 + kk) * m + i0 + ii]
                            ii2 = idx // KC
                            kk2 = idx - ii2 * KC
                            if ii2 < hx and kk2 < lc:
                                vy = F[f_off + (i0 + ii2 - R0) * f_ld + (l0 + kk2 - C0)]
                        pa[r] = va
                        py[r] = vy
                    for r in range(RY):
                        idx = tid + r * NT
                        ve = zero
                        vi = zero
                        if idx < KTY:
                            kk = idx // TY
                            jj = idx - kk * TY
                            if jj < hy:
                                if kk < kc:
                                    ve = E[e_off + (k0 + kk) * n + j0 + jj]
                                if kk < lc:
                                    vi = AI[ai_off + (l0 + kk) * n + j0 + jj]
                        pe[r] = ve
                        pi[r] = vi
                    for r in range(RX):
                        idx = tid + r * NT
                        if idx < KTX:
                            kk = idx // TX
                            sAO[kk, idx - kk * TX] = pa[r]
                            ii2 = idx // KC
                            sY[ii2, idx - ii2 * KC] = py[r]
                    for r in range(RY):
                        idx = tid + r * NT
                        if idx < KTY:
                            kk = idx // TY
                            sE[kk, idx - kk * TY] = pe[r]
                            sAI[kk, idx - kk * TY] = pi[r]
                    cuda.syncthreads()
                    for e in range(NE):
                        el = tid + e * NT
                        if el < TXY:
                            ii = el // TY
                            jj = el - ii * TY
                            if c < npull:
                                sp = zero
                                for kk in range(KC):
                                    sp += sAO[kk, ii] * sE[kk, jj]
                                accp[e] += sp
                            if c < ntgt:
                                st = zero
                                for kk in range(KC):
                                    st += sY[ii, kk] * sAI[kk, jj]
                                acct[e] += st
                    cuda.syncthreads()
                # round the tile
                for e in range(NE):
                    el = tid + e * NT
                    if el < TXY:
                        ii = el // TY
                        jj = el - ii * TY
                        if ii < hx and jj < hy:
                            i = i0 + ii
                            j = j0 + jj
                            gi = i * n + j
                            fi = f_off + (i - R0) * f_ld + (j - C0)
                            w_ = W[w_off + gi]
                            t = w_
                            if has_f:
                                t += F[fi]
                            if has_yg:
                                t += Yg[e_off + gi]
                            t += accp[e]
                            t += acct[e]
                            if has_t:
                                T[o_off + gi] = t
                            si = 0
                            if s_rows > 1:
                                si = i * s_cols
                            if s_cols > 1:
                                si += j // gsz
                            sc = S[s_off + si]
                            q = dt(round(t / sc))
                            if asym:
                                zi = 0
                                if z_rows > 1:
                                    zi = i * z_cols
                                if z_cols > 1:
                                    zi += j // gsz
                                zp = Z[z_off + zi]
                                cq = q + zp
                                if cq < lo:
                                    cq = lo
                                if cq > hi:
                                    cq = hi
                                val = sc * (cq - zp)
                            else:
                                cq = q
                                if cq < lo:
                                    cq = lo
                                if cq > hi:
                                    cq = hi
                                val = sc * cq
                            err = w_ - val
                            Wq[o_off + gi] = val
                            codes[o_off + gi] = i16(cq)
                            E[e_off + gi] = err
                            F[fi] = accp[e] + err
                            if has_yg:
                                Yg[e_off + gi] += err
                w += cuda.gridDim.x
            grid.sync()

    if mode == "ptr":
        P = types.CPointer(dt)
        I64 = types.CPointer(types.int64)
        sig = (P, P, P, P, P, P, P, types.CPointer(types.int16), P, P, P, I64, I64)
        opts = {"max_registers": int(maxreg)} if maxreg else {}
        disp = cuda.jit(sig, **opts)(block_kernel)
    else:
        disp = cuda.jit(block_kernel)
    out = (disp, NT)
    _CACHE[key] = out
    return out
