"""The CUDA kernel of the ``cuda`` engine: a batch of base blocks, each solved by the tile-level
anti-diagonal wavefront with the scalar quantizer fused, in one cooperative launch.

Imported only by the cuda engine's run context (``_cuda_runtime``, when a kernel is first made).

What one launch does
--------------------
``nblk`` independent blocks of tiles (descriptors in ``desc``, ``DESC`` int64 each with the
fields ``DESC_*`` of ``_cuda_layout``: ``ra, rb, ca, cb`` tile ranges, ``f_off, f_ld`` where the
block's base offsets / local accumulator live, and where its item's arrays start, so that one
launch can mix the items of a stack). The scalars of the launch (sizes, steps, flags, the
quantizer's grid) come in one int64 launch descriptor ``prm`` (fields ``P_*``).
Step ``g = 0, 1, ...`` rounds local anti-diagonal ``s = Mb + Nb - 2 - g`` of every block
(two-sided) or tile column ``s = Nb - 1 - g`` (one-sided), and ``this_grid().sync()``
separates the steps. So a block's whole wavefront, a whole phase of independent blocks, and
the whole anti-diagonal of every item of a stack, is one launch. The variant for launches of
many small blocks (``local``) gives each CTA whole blocks instead: it runs their steps one
after the other, ``syncthreads`` between them, and never synchronises the grid.

The target of tile (a, b) of a block with rows [R0, R1) and columns [C0, C1) (the rounding rule
of docs/algorithm.md in the block-local accumulator form) is::

    T = W + F + Yg + P + sum_{l >= j1, l < C1} Y[rows a, l] A_I[l, cols b]
    P = sum_{k >= i1, k < R1} A_O[k, rows a]^T E[k, cols b]          ("pull", two-sided only)

where ``F`` is the feedback from outside the block (optional), ``Yg`` the global accumulator's
identity term (two-level wavefront, optional), ``E`` the errors of tiles already solved and
``Y = G_O[block]^T E[block]`` the block's local accumulator: ``Y[rows a, cols b] = P + E_ab``.

The step (docs/engines.md, "The GPU tile step"): the two sums are not formed when the tile is
rounded but built up one tile at a time. Every tile of a block keeps two running sums, the
pull ``P`` (stored in ``E`` until the tile is rounded: nobody reads a tile's errors before
that) and ``F`` plus the target terms (stored where ``F`` is, in place). Step ``g`` has one
*item* per tile that receives a contribution from the tiles rounded at step ``g - 1``, i.e.
anti-diagonal ``s + 1``: the tile below it in its column adds ``A_O[k, rows a]^T E[k, cols b]``
to its ``P``, the tile right of it in its row adds ``Y[rows a, l] A_I[l, cols b]`` to its
other sum (at most one of each per tile and step, so no two items write the same sum); the
items on anti-diagonal ``s`` then round, the others store their sums. Step 0 visits every
tile to start its sums (from ``F``, or 0). A step's items are independent and spread over the
CTAs of the grid (one tile per CTA at a time; a thread holds one or more of its elements,
``per_thread``), so a step costs the latency of one tile product with an inner dimension of
one tile; forming the sums when the tile is rounded would cost a chain of up to ``base``
such products instead. After
rounding, a tile's ``Y`` is stored where its ``F`` was (the row contributions read it there).

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
from typing import Any, NamedTuple

from numba import config, cuda, types  # imported lazily, by _cuda_runtime

from ._cuda_layout import (ASYM, DESC, DESC_AI_OFFSET, DESC_AO_OFFSET, DESC_CA, DESC_CB,
                           DESC_E_OFFSET, DESC_F_LD, DESC_F_OFFSET, DESC_OUT_OFFSET, DESC_RA,
                           DESC_RB, DESC_S_OFFSET, DESC_W_OFFSET, DESC_Z_OFFSET, HAS_F, HAS_T,
                           HAS_YG, P_FLAGS, P_GSZ, P_HI, P_LO, P_M, P_N, P_NBLK, P_NSTEPS,
                           P_PERIOD, P_S_COLS, P_S_ROWS, P_Z_COLS, P_Z_ROWS, TWO_SIDED)

_CACHE: dict = {}


@cuda.jit(device=True)
def _step_shape(Mb, Nb, g, two, run):
    """The work of step ``g`` on an ``Mb x Nb`` block (docs/engines.md, "The GPU tile step"):
    ``(count, s, rows, a_lo, b_lo)``, each found in O(1).

    Without running sums (``run`` false) the items are the tiles the step rounds: two-sided,
    rows ``a_lo .. a_lo + count - 1`` of anti-diagonal ``s = Mb + Nb - 2 - g``; one-sided, the
    ``Mb`` tiles of column ``s = Nb - 1 - g``.

    With running sums, two-sided: the items are the tiles not yet rounded (``a + b <= s``)
    that receive a contribution from anti-diagonal ``s + 1`` (rounded at step ``g - 1``):
    a tile to their right exists for rows ``a >= a_lo = s + 2 - Nb``, a tile below them for
    columns ``b >= b_lo = s + 2 - Mb``. They are a rectangle, rows ``0 .. a_lo - 1`` by
    columns ``b_lo .. Nb - 1`` (``a_lo * (Nb - b_lo)`` items), then the ``rows`` rows
    ``a_lo ..`` in which row ``a`` has the ``s - a + 1`` tiles ``0 .. s - a``. Step 0 visits
    every tile (it starts the sums): ``count = Mb Nb``, ``rows = -1``. One-sided: the tiles of
    columns ``0 .. s``. ``count`` is 0 once the block is done."""
    if two:
        s = Mb + Nb - 2 - g
        if s < 0:
            return 0, s, 0, 0, 0
        a_hi = s
        if a_hi > Mb - 1:
            a_hi = Mb - 1
        if not run:
            a_lo = s - Nb + 1
            if a_lo < 0:
                a_lo = 0
            return a_hi - a_lo + 1, s, 0, a_lo, 0
        if g == 0:
            return Mb * Nb, s, -1, 0, 0
        a_lo = s + 2 - Nb
        if a_lo < 0:
            a_lo = 0
        b_lo = s + 2 - Mb
        if b_lo < 0:
            b_lo = 0
        rows = a_hi - a_lo + 1
        # rows a_hi, a_hi - 1, ..., a_lo hold k0, k0 + 1, ... items (k0 = s - a_hi + 1)
        k0 = s - a_hi + 1
        count = a_lo * (Nb - b_lo) + rows * k0 + rows * (rows - 1) // 2
        return count, s, rows, a_lo, b_lo
    s = Nb - 1 - g
    if s < 0:
        return 0, s, 0, 0, 0
    if not run:
        return Mb, s, Mb, 0, 0
    return Mb * (s + 1), s, Mb, 0, 0


@cuda.jit(device=True)
def _item_tile(Nb, s, rows, a_lo, b_lo, rem, two, run):
    """Block-local tile ``(a, b)`` of item ``rem`` of a step (``_step_shape``), in O(1)."""
    if not run:
        if two:
            return a_lo + rem, s - (a_lo + rem)
        return rem, s
    if not two:
        return rem // (s + 1), rem % (s + 1)
    if rows < 0:  # step 0: every tile
        return rem // Nb, rem % Nb
    wb = Nb - b_lo
    if rem < a_lo * wb:  # the rectangle
        return rem // wb, b_lo + rem % wb
    rem -= a_lo * wb
    # row j (from the bottom, a = a_hi - j) starts at j k0 + j (j - 1) / 2
    a_hi = a_lo + rows - 1
    k0 = s - a_hi + 1
    c = 2 * k0 - 1
    j = int((math.sqrt(float(c * c + 8 * rem)) - c) * 0.5)
    if j > rows - 1:
        j = rows - 1
    if j < 0:
        j = 0
    while j > 0 and j * k0 + j * (j - 1) // 2 > rem:
        j -= 1
    while j < rows - 1 and (j + 1) * k0 + (j + 1) * j // 2 <= rem:
        j += 1
    return a_hi - j, rem - (j * k0 + j * (j - 1) // 2)


def threads_for(tx: int, ty: int, per_thread: int = 1) -> int:
    """Threads per CTA for a tx x ty tile: one per ``per_thread`` elements, 32..256."""
    e = math.ceil(tx * ty / per_thread)
    return int(min(256, max(32, 32 * math.ceil(e / 32))))


def chunk_for(tx: int, ty: int, itemsize: int) -> int:
    """K-chunk of the staged products so that the four shared arrays stay within ~40 KiB."""
    kc = 40960 // ((2 * tx + 2 * ty) * itemsize)
    kc = max(8, min(64, kc - kc % 8))
    return int(kc)


class KernelShape(NamedTuple):
    """The compile-time constants of one kernel variant (``kernel_shape``): the working
    dtype (numba type, item size), the tile, threads per CTA, the K-chunk of the staged
    products and its unrolled runs, elements per thread, the shared and register stages'
    sizes, and the variant's switches. Every device function of the kernel is made by a
    factory (``_make_*``) that closes over the constants it uses, so that numba folds them
    into the code as before."""

    dt: Any
    isz: int
    TX: int
    TY: int
    NT: int
    KC: int
    NE: int
    KU: int
    TXY: int
    KTX: int
    KTY: int
    RX: int
    RY: int
    RUN: bool
    ITEMS: bool
    LOCAL: bool
    i16: Any


def kernel_shape(dtype_name: str, tx: int, ty: int, items: bool = False, running: bool = True,
                 per_thread: int = 1, local: bool = False) -> KernelShape:
    """The constants of the kernel variant (``make_kernel``'s arguments)."""
    dt = types.float32 if dtype_name == "float32" else types.float64
    isz = 4 if dtype_name == "float32" else 8
    TX, TY = int(tx), int(ty)
    NT = threads_for(TX, TY, int(per_thread))
    KC = chunk_for(TX, TY, isz)
    if running:  # a running sum's products have an inner dimension of one tile
        KC = min(KC, max(TX, TY))
    NE = (TX * TY + NT - 1) // NT
    KU = math.gcd(KC, 8)  # the products' inner runs (unrolled), dividing KC
    KTX = KC * TX
    KTY = KC * TY
    return KernelShape(dt=dt, isz=isz, TX=TX, TY=TY, NT=NT, KC=KC, NE=NE, KU=KU, TXY=TX * TY,
                       KTX=KTX, KTY=KTY, RX=(KTX + NT - 1) // NT, RY=(KTY + NT - 1) // NT,
                       RUN=bool(running), ITEMS=bool(items), LOCAL=bool(local),
                       i16=types.int16)


def _device():
    """The decorator of the kernel's device functions: inlined into the kernel (LLVM's
    alwaysinline, so that their local arrays stay in registers); the simulator runs them as
    Python functions."""
    return cuda.jit(device=True, **({} if config.ENABLE_CUDASIM else {"forceinline": True}))


def _make_element(k: KernelShape):
    """``element`` of the variant ``k`` (a device function closing over its constants)."""
    NT, TY, TXY = k.NT, k.TY, k.TXY

    @_device()
    def element(e):
        """This thread's ``e``-th element of the tile: ``(in the tile, row, column)``."""
        el = cuda.threadIdx.x + e * NT
        ii = el // TY
        return el < TXY, ii, el - ii * TY
    return element


def _make_item_of(k: KernelShape):
    """``item_of`` of the variant ``k`` (a device function closing over its constants)."""
    TX, TY, RUN, ITEMS = k.TX, k.TY, k.RUN, k.ITEMS

    @_device()
    def item_of(w, per, period, desc, g, two, s0, rows0, a_lo0, b_lo0, m, n):
        """Item ``w`` of step ``g``: its tile and what feeds it, the tuple ``st`` = (i0, j0,
        hx, hy, fb, f_ld, init, rnd, k0, k1, l0, l1, w_off, o_off, e_off, ao_off, ai_off,
        s_off, z_off): the tile's first element and extent, where it is in ``F`` (index of its
        first element, leading dimension), whether its sums start here (from ``F`` or 0) and
        whether it is rounded, the rows ``k0:k1`` of the pull's source and the columns
        ``l0:l1`` of the target terms' source, and its item's offsets."""
        # period rep, block bi of the period, its rem-th item (s0 ...: the period's first
        # block's step shape; with period 1, the usual case, every block has it)
        rep = w // per
        rem = w - rep * per
        bi = 0
        s = s0
        rows = rows0
        a_lo = a_lo0
        b_lo = b_lo0
        if period > 1:
            while bi < period:
                d = bi * DESC
                cnt, s, rows, a_lo, b_lo = _step_shape(
                    desc[d + DESC_RB] - desc[d + DESC_RA],
                    desc[d + DESC_CB] - desc[d + DESC_CA], g, two, RUN)
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
        Mb = rb - ra
        Nb = cb - ca
        la, lb = _item_tile(Nb, s, rows, a_lo, b_lo, rem, two, RUN)
        i0 = (ra + la) * TX
        i1 = i0 + TX
        if i1 > m:
            i1 = m
        j0 = (ca + lb) * TY
        j1 = j0 + TY
        if j1 > n:
            j1 = n
        fb = f_off + (i0 - ra * TX) * f_ld + (j0 - ca * TY)
        # sums start from F (or 0) at step 0, and at every step without running sums
        init = g == 0 or not RUN
        rnd = True
        if RUN:
            if two:
                rnd = la + lb == s
            else:
                rnd = lb == s
        # what feeds this tile at this step. With running sums: the tiles rounded at the
        # previous step below it in its column (two-sided: A_O^T E) and right of it in its
        # row (Y A_I); without: everything below and right of it in the block
        k0 = 0
        k1 = 0
        l0 = 0
        l1 = 0
        if not RUN:
            if two:
                k0 = i1
                k1 = rb * TX
                if k1 > m:
                    k1 = m
            l0 = j1
            l1 = cb * TY
            if l1 > n:
                l1 = n
        elif not init:
            if two:
                src_a = s + 1 - lb
                if src_a < Mb:
                    k0 = (ra + src_a) * TX
                    k1 = k0 + TX
                    if k1 > m:
                        k1 = m
                src_b = s + 1 - la
            else:
                src_b = s + 1
            if src_b < Nb:
                l0 = (ca + src_b) * TY
                l1 = l0 + TY
                if l1 > n:
                    l1 = n
        return (i0, j0, i1 - i0, j1 - j0, fb, f_ld, init, rnd, k0, k1, l0, l1, w_off, o_off,
                e_off, ao_off, ai_off, s_off, z_off)
    return item_of


def _make_load_sums(k: KernelShape, element):
    """``load_sums`` of the variant ``k`` (a device function closing over its constants)."""
    NE, dt = k.NE, k.dt

    @_device()
    def load_sums(st, W, F, E, Yg, S, n, has_f, has_yg, s_rows, s_cols, gsz,
                  accp, acct, pw, ps):
        """The tile's sums so far (the pull ``accp``; ``acct``: the offsets, the target
        terms and, for a tile rounded now, ``Yg``'s term) and, for a tile rounded now, its
        weights ``pw`` and scales ``ps`` (running sums keep the sums in E and where F is
        until the tile is rounded)."""
        (i0, j0, hx, hy, fb, f_ld, init, rnd, k0, k1, l0, l1, w_off, o_off, e_off, ao_off,
         ai_off, s_off, z_off) = st
        for e in range(NE):
            vp = dt(0.0)
            vt = dt(0.0)
            inside, ii, jj = element(e)
            if inside:
                if ii < hx and jj < hy:
                    fi = fb + ii * f_ld + jj
                    gi = (i0 + ii) * n + j0 + jj
                    if not init:
                        vp = E[e_off + gi]
                        vt = F[fi]
                    elif has_f:
                        vt = F[fi]
                    if rnd:  # the rounding's loads, issued with the others
                        pw[e] = W[w_off + gi]
                        if has_yg:
                            vt += Yg[e_off + gi]
                        si = 0
                        if s_rows > 1:
                            si = (i0 + ii) * s_cols
                        if s_cols > 1:
                            si += (j0 + jj) // gsz
                        ps[e] = S[s_off + si]
            accp[e] = vp
            acct[e] = vt
    return load_sums


def _make_load_chunk(k: KernelShape):
    """``load_chunk`` of the variant ``k`` (a device function closing over its constants)."""
    dt, NT, TX, TY, KC = k.dt, k.NT, k.TX, k.TY, k.KC
    RX, RY, KTX, KTY = k.RX, k.RY, k.KTX, k.KTY

    @_device()
    def load_chunk(st, c, AO, F, E, AI, m, n, pa, py, pe, pi):
        """Chunk ``c`` of the two products' operands into registers: rows ``k0 + c KC ..``
        of ``A_O[:, rows]`` and ``E[:, cols]``, columns ``l0 + c KC ..`` of ``Y[rows, :]``
        and rows of ``A_I[:, cols]`` (zeros past their ends). Returns the chunk's depth of
        the pull and of the target terms (``<= 0``: none)."""
        (i0, j0, hx, hy, fb, f_ld, init, rnd, k0, k1, l0, l1, w_off, o_off, e_off, ao_off,
         ai_off, s_off, z_off) = st
        tid = cuda.threadIdx.x
        kk0 = k0 + c * KC
        kc = k1 - kk0
        if kc > KC:
            kc = KC
        ll0 = l0 + c * KC
        lc = l1 - ll0
        if lc > KC:
            lc = KC
        for r in range(RX):
            idx = tid + r * NT
            va = dt(0.0)
            vy = dt(0.0)
            if idx < KTX:
                kk = idx // TX
                ii = idx - kk * TX
                if kk < kc and ii < hx:
                    va = AO[ao_off + (kk0 + kk) * m + i0 + ii]
                ii2 = idx // KC
                kk2 = idx - ii2 * KC
                if ii2 < hx and kk2 < lc:
                    vy = F[fb + ii2 * f_ld + (ll0 - j0) + kk2]
            pa[r] = va
            py[r] = vy
        for r in range(RY):
            idx = tid + r * NT
            ve = dt(0.0)
            vi = dt(0.0)
            if idx < KTY:
                kk = idx // TY
                jj = idx - kk * TY
                if jj < hy:
                    if kk < kc:
                        ve = E[e_off + (kk0 + kk) * n + j0 + jj]
                    if kk < lc:
                        vi = AI[ai_off + (ll0 + kk) * n + j0 + jj]
            pe[r] = ve
            pi[r] = vi
        return kc, lc
    return load_chunk


def _make_to_shared(k: KernelShape):
    """``to_shared`` of the variant ``k`` (a device function closing over its constants)."""
    NT, TX, TY, KC, RX, RY, KTX, KTY = k.NT, k.TX, k.TY, k.KC, k.RX, k.RY, k.KTX, k.KTY

    @_device()
    def to_shared(pa, py, pe, pi, sAO, sY, sE, sAI):
        """The chunk's operands from registers into shared memory."""
        tid = cuda.threadIdx.x
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
    return to_shared


def _make_products(k: KernelShape, element):
    """``products`` of the variant ``k`` (a device function closing over its constants)."""
    dt, NE, KC, KU, RUN = k.dt, k.NE, k.KC, k.KU, k.RUN

    @_device()
    def products(kc, lc, sAO, sE, sY, sAI, accp, acct):
        """Add the chunk's ``A_O^T E`` (depth ``kc``) to the pull and its ``Y A_I`` (depth
        ``lc``) to the target terms, in runs of ``KU`` (the chunk's zeros past the depth are
        left out but for the rest of the last run; adding them changes no sum). Running
        sums have a depth of one tile, ``KC``: a loop of constant length, unrolled (a
        4096² solve took 6 % longer in its tile kernels with the depth's bound)."""
        if RUN:
            nkp = KC // KU
            nkt = KC // KU
        else:
            nkp = (kc + KU - 1) // KU
            nkt = (lc + KU - 1) // KU
        for e in range(NE):
            inside, ii, jj = element(e)
            if inside:
                if kc > 0:
                    sp = dt(0.0)
                    for kb in range(nkp):
                        for ku in range(KU):
                            kk = kb * KU + ku
                            sp += sAO[kk, ii] * sE[kk, jj]
                    accp[e] += sp
                if lc > 0:
                    st_ = dt(0.0)
                    for kb in range(nkt):
                        for ku in range(KU):
                            kk = kb * KU + ku
                            st_ += sY[ii, kk] * sAI[kk, jj]
                    acct[e] += st_
    return products


def _make_finish(k: KernelShape, element):
    """``finish`` of the variant ``k`` (a device function closing over its constants)."""
    dt, NE, i16 = k.dt, k.NE, k.i16

    @_device()
    def finish(st, accp, acct, pw, ps, F, E, Yg, Z, Wq, codes, T, n, has_yg, has_t, asym,
               z_rows, z_cols, gsz, lo, hi):
        """Store the tile's running sums for a later step, or round it: ``Wq``, ``codes``,
        its errors into ``E``, ``Y = pull + E`` where its ``F`` was and, with ``Yg``, the
        errors into the global accumulator."""
        (i0, j0, hx, hy, fb, f_ld, init, rnd, k0, k1, l0, l1, w_off, o_off, e_off, ao_off,
         ai_off, s_off, z_off) = st
        for e in range(NE):
            inside, ii, jj = element(e)
            if inside:
                if ii < hx and jj < hy:
                    i = i0 + ii
                    j = j0 + jj
                    gi = i * n + j
                    fi = fb + ii * f_ld + jj
                    if not rnd:  # keep the running sums for a later step
                        E[e_off + gi] = accp[e]
                        F[fi] = acct[e]
                        continue
                    # round the tile (acct holds Yg's term too)
                    w_ = pw[e]
                    t = w_ + acct[e]
                    t += accp[e]
                    if has_t:
                        T[o_off + gi] = t
                    sc = ps[e]
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
    return finish


def _make_block_kernel(k: KernelShape, element, item_of, load_sums, load_chunk, to_shared,
                       products, finish):
    """The kernel function (not yet compiled) over the device functions of this variant."""
    dt, NE, KC, TX, TY, RX, RY, RUN, LOCAL = (k.dt, k.NE, k.KC, k.TX, k.TY, k.RX, k.RY, k.RUN,
                                              k.LOCAL)
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
        pw = cuda.local.array(NE, dt)
        ps = cuda.local.array(NE, dt)
        pa = cuda.local.array(RX, dt)
        py = cuda.local.array(RX, dt)
        pe = cuda.local.array(RY, dt)
        pi = cuda.local.array(RY, dt)
        grid = cuda.cg.this_grid()
        two = (flags & TWO_SIDED) != 0
        has_f = (flags & HAS_F) != 0
        has_yg = (flags & HAS_YG) != 0
        asym = (flags & ASYM) != 0
        has_t = (flags & HAS_T) != 0
        lo = dt(lo_i)
        hi = dt(hi_i)
        # grid-wide steps: step g's items of all blocks spread over the CTAs, then a grid
        # synchronisation; blocks per CTA (LOCAL): this CTA's blocks one after the other,
        # each step's items of the block in turn, then a synchronisation of the CTA (its
        # stores are then visible to its threads, and blocks of a launch are independent)
        nown = 1
        stride = cuda.gridDim.x
        if LOCAL:
            nown = (nblk - cuda.blockIdx.x + cuda.gridDim.x - 1) // cuda.gridDim.x
            stride = 1
        for ob in range(nown):
            for g in range(nsteps):
                if LOCAL:
                    b = cuda.blockIdx.x + ob * cuda.gridDim.x
                    d = b * DESC
                    per, s0, rows0, a_lo0, b_lo0 = _step_shape(
                        desc[d + DESC_RB] - desc[d + DESC_RA],
                        desc[d + DESC_CB] - desc[d + DESC_CA], g, two, RUN)
                    # item_of's w // per is then b (period 1)
                    w = b * per
                    total = w + per
                    period = 1
                else:
                    # the items of this step over all blocks: the blocks repeat the tile ranges
                    # of the first ``period`` (``_cuda_plans._period``: 1 for equal blocks; a
                    # stack's items repeat one item's), so count one period and multiply; the
                    # shape of the period's first block is kept for ``item_of``
                    per = 0
                    s0 = 0
                    rows0 = 0
                    a_lo0 = 0
                    b_lo0 = 0
                    for bi in range(period):
                        d = bi * DESC
                        cnt, s, rows, a_lo, b_lo = _step_shape(
                            desc[d + DESC_RB] - desc[d + DESC_RA],
                            desc[d + DESC_CB] - desc[d + DESC_CA], g, two, RUN)
                        if bi == 0:
                            s0 = s
                            rows0 = rows
                            a_lo0 = a_lo
                            b_lo0 = b_lo
                        per += cnt
                    total = (nblk // period) * per
                    w = cuda.blockIdx.x
                while w < total:
                    st = item_of(w, per, period, desc, g, two, s0, rows0, a_lo0, b_lo0, m, n)
                    load_sums(st, W, F, E, Yg, S, n, has_f, has_yg, s_rows, s_cols, gsz,
                              accp, acct, pw, ps)
                    k0 = st[8]
                    k1 = st[9]
                    l0 = st[10]
                    l1 = st[11]
                    nch = (k1 - k0 + KC - 1) // KC
                    ntgt = (l1 - l0 + KC - 1) // KC
                    if ntgt > nch:
                        nch = ntgt
                    for c in range(nch):
                        # every global load of the chunk first (registers), then the stores
                        # to shared memory: the loads are in flight together
                        kc, lc = load_chunk(st, c, AO, F, E, AI, m, n, pa, py, pe, pi)
                        to_shared(pa, py, pe, pi, sAO, sY, sE, sAI)
                        cuda.syncthreads()
                        products(kc, lc, sAO, sE, sY, sAI, accp, acct)
                        cuda.syncthreads()
                    finish(st, accp, acct, pw, ps, F, E, Yg, Z, Wq, codes, T, n, has_yg,
                           has_t, asym, z_rows, z_cols, gsz, lo, hi)
                    w += stride
                if LOCAL:
                    cuda.syncthreads()
                else:
                    grid.sync()
    return block_kernel


def make_kernel(dtype_name: str, tx: int, ty: int, mode: str, maxreg: int = 0,
                items: bool = False, running: bool = True, per_thread: int = 1,
                local: bool = False):
    """The block kernel for ``dtype_name`` ('float32'/'float64') and a ``tx x ty`` tile.

    ``mode='ptr'``: compiled eagerly with raw-pointer arguments (launch with integers);
    ``mode='array'``: lazily compiled with flat 1-D array arguments (simulator, or fallback).
    ``maxreg``: register cap per thread (0: the compiler's choice). ``items``: the variant
    for stacks, which reads each block's item offsets from its descriptor; without it the
    offsets are the constant 0 (a single solve), which keeps nine 64-bit offsets out of the
    registers of the tile loop (measured on the H200: the single-solve kernel with the
    offsets read took 4-14 % longer, docs/benchmarks/gpu.md). ``running``: the step of
    running sums (each step adds the contributions of the tiles rounded at the step before,
    over all the tiles that receive one); without it a step's items are the tiles it rounds,
    each forming its whole sums in chunks of ``chunk_for`` (fewer loads per product: better
    when a block's sums fit one chunk, docs/engines.md, "The GPU tile step").
    ``per_thread``: elements of the tile per thread (``threads_for``; a CTA of fewer
    threads, more of them resident). ``local``: each CTA solves whole blocks, one after the
    other, its tile steps separated by ``syncthreads`` instead of grid synchronisations
    (for launches of many small blocks; docs/engines.md, "Blocks per CTA and the depth of
    whole sums"). Returns ``(dispatcher, threads)``.
    """
    key = (dtype_name, tx, ty, mode, maxreg, bool(items), bool(running), int(per_thread),
           bool(local))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    k = kernel_shape(dtype_name, tx, ty, items, running, per_thread, local)
    dt, NT = k.dt, k.NT
    element = _make_element(k)
    block_kernel = _make_block_kernel(
        k, element, _make_item_of(k), _make_load_sums(k, element), _make_load_chunk(k),
        _make_to_shared(k), _make_products(k, element), _make_finish(k, element))
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
