"""The CUDA engine's plans: the schedules of ``bakron.solvers.schedule`` as launch
descriptors (``_cuda_layout``) and batched GEMM tables, built once per shape, device and
options and cached (``_cached``), for one solve (``_WavePlan``) and for a stack chunk
(``_StackWavePlan``)."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from bakron.solvers.schedule import step_count, step_width, two_level

from ._cuda_layout import DESC, DESC_AI_OFFSET, DESC_AO_OFFSET, HAS_F, HAS_YG, block_row
from ._cuda_runtime import SIM, _DeviceSolve

#: plans (host schedules and their device tables), least recently used first
_PLANS: OrderedDict = OrderedDict()
_PLAN_MAX = 32
_BUFS = ("Yg", "AI", "AO", "E", "Fb", "Fp")


def _cached(key, build):
    """Plans (host schedules and their device tables) are built once per key (``_key``:
    shape, device and the options the plan depends on)."""
    hit = _PLANS.get(key)
    if hit is None:
        hit = _PLANS[key] = build()
        while len(_PLANS) > _PLAN_MAX:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return hit


def _widths(shapes, two: bool, copies: int = 1) -> tuple:
    """The CTAs a launch over blocks of ``shapes`` tiles (each ``copies`` times) can use,
    ``(running sums, whole sums)``: every tile at step 0 of running sums
    (``_cuda_kernels._step_shape``), the longest anti-diagonal otherwise. The launch is
    capped at the cooperative limit; CTAs beyond the work only add to every grid
    synchronisation."""
    shapes = list(shapes)
    return (copies * sum(int(a) * int(b) for a, b in shapes),
            copies * sum(step_width(int(a), int(b), two) for a, b in shapes))


def _period(shapes) -> int:
    """The smallest ``p`` such that the blocks' ``shapes`` (tiles) repeat every ``p`` blocks:
    the launch's ``P_PERIOD``. The kernel counts and locates a step's items over one period
    per item (``_cuda_kernels``), so a launch of equal blocks (a coarse step of the
    wavefront away from a ragged edge) finds each item in O(1) instead of a scan over
    all its blocks."""
    shapes = [tuple(int(v) for v in s) for s in shapes]
    k = len(shapes)
    for p in range(1, k):
        if k % p == 0 and all(shapes[i] == shapes[i % p] for i in range(p, k)):
            return p
    return max(1, k)


def _key(r: _DeviceSolve, method: str, base: int):
    p = r.p
    o = r.opts  # the options the plans depend on
    return (method, base, p.m, p.n, p.tx, p.ty, p.two_sided, r.dev, SIM, o.gather_tiles,
            o.gather_min_side, o.gather_split, o.scatter_rows)


class _WavePlan:
    """The two-level schedule (``schedule.two_level``) for this engine: per coarse step,
    batched GEMMs that gather the blocks' base targets, one launch, batched GEMMs that
    scatter their errors."""

    def __init__(self, r: _DeviceSolve, cs: int):
        p = r.p
        o = r.opts  # the gathers and scatters follow its gather_* and scatter_rows
        m, n = p.m, p.n
        R, C = p.rows, p.cols
        two = p.two_sided
        coarse = two_level(p.M, p.N, cs, two)
        Sr, Sc = cs * p.tx, cs * p.ty
        per = Sr * Sc
        nblk = max(len(step.blocks) for step in coarse)
        self.fb_size = fb = nblk * per
        steps, desc_rows, entries, ops, counts = [], [], [], [], []

        def plan_gemm(ta, tb, M, N, K, beta, A, B, C_, ent):
            """Row-major C = op(A) op(B) + beta C per entry; A/B/C: (buffer, ld);
            ent: [(offset A, offset B, offset C)] in elements."""
            ops.append([ta, tb, M, N, K, 1.0, beta, A, B, C_, 3 * len(ops), len(ent)])
            entries.append(ent)
            return len(ops) - 1

        for step in coarse:
            shapes: dict = {}
            for j, b in enumerate(step.blocks):
                hw = (R[b.rb] - R[b.ra], C[b.cb] - C[b.ca])
                shapes.setdefault(hw, []).append((j, b))
            before, after, reduce = [], [], None
            if step.gather and two:
                # base targets of every block of the step from Yg (the accumulator form):
                # Fb_j = Yg[rows, c0:] A_I[c0:, cols]; A_I is zero above a block's columns,
                # so one K range (from the group's leftmost block) serves the whole batch
                tiles = sum(-(-h // 128) * -(-w // 128) * len(grp)
                            for (h, w), grp in shapes.items())
                large = min(min(hw) for hw in shapes) >= o.gather_min_side
                split = min(o.gather_split, o.gather_tiles // tiles) if large else 1
                if split >= 2:
                    reduce = len(counts)
                    counts.append(self._split_gather(shapes, split, n, Sc, per, nblk, C, R,
                                                     plan_gemm, before))
                else:
                    for (h, w), grp in shapes.items():
                        c0 = C[min(b.ca for _, b in grp)]
                        ent = [(R[b.ra] * n + c0, c0 * n + C[b.ca], j * per) for j, b in grp]
                        before.append(plan_gemm(False, False, h, w, n - c0, 0.0,
                                                ("Yg", n), ("AI", n), ("Fb", Sc), ent))
            elif step.gather:
                b = step.blocks[0]
                c0, c1 = C[b.ca], C[b.cb]
                # one-sided: Fb (m x w, ld Sc) = E[:, c1:] A_I[c1:, cols], all rows at once
                before.append(plan_gemm(False, False, m, c1 - c0, n - c1, 0.0,
                                        ("E", n), ("AI", n), ("Fb", Sc), [(c1, c1 * n + c0, 0)]))
            flags = (HAS_F if before else 0) | (HAS_YG if two else 0)
            start = len(desc_rows)
            for j, b in enumerate(step.blocks):
                f_off = j * per if two else R[b.ra] * Sc
                desc_rows.append(block_row(b.ra, b.rb, b.ca, b.cb, f_off, Sc))
            if step.scatter:
                # push the errors: Yg[0:Rg, cols] += A_O[rows, 0:Rg]^T E_block (A_O is zero
                # right of a block's rows, so the group's lowest block sets Rg); the kernel
                # has added the identity part E_block already
                for (h, w), grp in shapes.items():
                    if o.scatter_rows:
                        self._split_scatter(grp, h, w, m, n, R, C, cs * o.scatter_rows * p.tx,
                                            plan_gemm, after)
                        continue
                    Rg = R[max(b.rb for _, b in grp)]
                    ent = [(R[b.ra] * m, R[b.ra] * n + C[b.ca], C[b.ca]) for _, b in grp]
                    after.append(plan_gemm(True, False, Rg, w, h, 1.0,
                                           ("AO", m), ("E", n), ("Yg", n), ent))
            nsteps = max(step_count(*b.shape, two) for b in step.blocks)
            grid = _widths((b.shape for b in step.blocks), two)
            span = (max(b.shape[0] for b in step.blocks), max(b.shape[1] for b in step.blocks))
            steps.append((start, len(step.blocks), nsteps, grid, flags, before, after,
                          _period(b.shape for b in step.blocks), span, reduce))
        self.steps = steps
        self.ops = ops
        #: partial products of the split gathers: slices of ``fb`` per item
        self.slices = max([int(c.max()) for c in counts] + [0])
        self.counts = np.array(counts, dtype=np.int64).reshape(len(counts), nblk)
        self.per = per
        kb = max([len(e) for e in entries] + [1])
        offs = np.zeros((3 * len(ops), kb), dtype=np.int64)
        bidx = np.zeros((3 * len(ops), 1), dtype=np.int64)
        for g, (op, ent) in enumerate(zip(ops, entries)):
            for j, e in enumerate(ent):
                offs[3 * g:3 * g + 3, j] = e
            bidx[3 * g:3 * g + 3, 0] = [_BUFS.index(op[7][0]), _BUFS.index(op[8][0]),
                                        _BUFS.index(op[9][0])]
        self.offs = offs
        self.bidx = bidx
        self.batched = any(op[11] > 1 for op in ops)
        self.desc_rows = np.array(desc_rows, dtype=np.int64).reshape(-1, DESC)
        self.desc = r.device_table(self.desc_rows.reshape(-1))
        self.counts_dev = r.device_table(self.counts) if len(counts) and not SIM else None
        if not SIM and self.batched:
            self.offs_dev = r.device_table(offs)
            self.bidx_dev = r.device_table(bidx)

    @staticmethod
    def _split_gather(shapes, split, n, Sc, per, nblk, C, R, plan_gemm, before):
        """The gather of one step as partial products over ``split`` K chunks of whole block
        columns: entry (block j, chunk t) writes slice ``t - first_j`` of ``Fp`` (block j's
        place in it as in ``Fb``), where ``first_j`` is the first chunk that reaches block j's
        columns (``A_I`` is zero above them). Returns the slices per block, which the sum
        kernel adds into ``Fb`` in chunk order."""
        count = np.zeros(nblk, dtype=np.int64)
        for (h, w), grp in shapes.items():
            c0 = C[min(b.ca for _, b in grp)]
            K = n - c0
            cols = -(-K // Sc)  # block columns in the K range (the last may be narrower)
            q = -(-cols // split) * Sc  # chunk length: whole block columns
            by_len: dict = {}
            for t in range(-(-K // q)):
                k0 = t * q
                kl = min(q, K - k0)
                for j, b in grp:
                    first = (C[b.ca] - c0) // q
                    if t < first:
                        continue  # only zeros of A_I in this chunk
                    by_len.setdefault(kl, []).append(
                        (R[b.ra] * n + c0 + k0, (c0 + k0) * n + C[b.ca],
                         (t - first) * nblk * per + j * per))
                    count[j] = t - first + 1
            for kl, ent in by_len.items():
                before.append(plan_gemm(False, False, h, w, kl, 0.0,
                                        ("Yg", n), ("AI", n), ("Fp", Sc), ent))
        return count

    @staticmethod
    def _split_scatter(grp, h, w, m, n, R, C, rows, plan_gemm, after):
        """The scatter of one shape group with its output rows in chunks of ``rows`` rows,
        each block's entries only for the chunks above its last row (``A_O[rows_j, a]`` is
        zero for ``a`` at or below it); every entry's product is the one of the whole-range
        entry, restricted to its rows."""
        by_len: dict = {}
        for _, b in grp:
            top = R[b.rb]
            for r0 in range(0, top, rows):
                ml = min(rows, top - r0)
                by_len.setdefault(ml, []).append((R[b.ra] * m + r0, R[b.ra] * n + C[b.ca],
                                                  r0 * n + C[b.ca]))
        for ml, ent in by_len.items():
            after.append(plan_gemm(True, False, ml, w, h, 1.0, ("AO", m), ("E", n),
                                   ("Yg", n), ent))


class _StackWavePlan:
    """The two-level plan of one item (``_WavePlan``) repeated over the items of a stack
    chunk: each coarse step's descriptors hold every item's blocks (item after item, so the
    launch's period is one item's blocks) and each planned GEMM's batch holds every item's
    entries, shifted by the item's offsets in ``E``/``Yg``/``Fb``/``Fp``/``A_I``/``A_O``."""

    def __init__(self, r: _DeviceSolve, plan: _WavePlan):
        nb, mn, fb = r.nb, r.m * r.n, plan.fb_size
        j = np.arange(nb, dtype=np.int64)
        item_off = {"Yg": j * mn, "E": j * mn, "Fb": j * fb, "Fp": j * plan.slices * fb,
                    "AI": r.item_desc[:, DESC_AI_OFFSET], "AO": r.item_desc[:, DESC_AO_OFFSET]}
        self.fb_size, self.per, self.slices = fb, plan.per, plan.slices
        self.counts, self.counts_dev = plan.counts, plan.counts_dev
        desc, steps, first = [], [], 0
        for start, k, nsteps, grid, flags, before, after, period, span, reduce in plan.steps:
            desc.append(r.blocks(plan.desc_rows[start:start + k], fb))
            # the items repeat one item's blocks, so the item's period is the stack's
            steps.append((first, k * nb, nsteps, (grid[0] * nb, grid[1] * nb), flags, before,
                          after, period, span, reduce))
            first += k * nb
        self.steps = steps
        self.ops = []
        kb = max([op[11] for op in plan.ops] + [1]) * nb
        offs = np.zeros((3 * len(plan.ops), kb), dtype=np.int64)
        for op in plan.ops:
            ta, tb, M, N, K, alpha, beta, A, B, C, row, k = op
            for t, buf in enumerate((A, B, C)):
                shift = np.asarray(item_off[buf[0]], dtype=np.int64)
                offs[row + t, :k * nb] = (plan.offs[row + t, :k][None, :]
                                          + shift[:, None]).reshape(-1)
            self.ops.append([ta, tb, M, N, K, alpha, beta, A, B, C, row, k * nb])
        self.offs = offs
        self.bidx = plan.bidx
        self.batched = any(op[11] > 1 for op in self.ops)
        self.desc = r.device_table(np.concatenate(desc).reshape(-1))
        if not SIM and self.batched:
            self.offs_dev = r.device_table(offs)
            self.bidx_dev = r.device_table(self.bidx)
