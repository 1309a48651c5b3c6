"""The CUDA engine's methods: each executes a plan (``_cuda_plans``) on the run context
(``_cuda_runtime._DeviceSolve``): the anti-diagonal (one launch), the two-level wavefront
(per coarse step batched GEMMs, one launch, batched GEMMs), the recursion (level by level),
and the stack forms of the first two (``_StackSolve``: every launch and GEMM covers all
items of a stack chunk)."""
from __future__ import annotations

import numpy as np

from bakron.solvers.schedule import (AFTER_BC, AFTER_BOTTOM, AFTER_D, AFTER_RIGHT,
                                     RecursionPlan, step_count)

from ._cuda_layout import (DESC, DESC_AI_OFFSET, DESC_AO_OFFSET, DESC_E_OFFSET, DESC_F_OFFSET,
                           DESC_OUT_OFFSET, DESC_S_OFFSET, DESC_W_OFFSET, DESC_Z_OFFSET, HAS_F,
                           block_row)
from ._cuda_plans import (_BUFS, _cached, _key, _period, _StackWavePlan, _WavePlan, _widths)
from ._cuda_runtime import SIM, _DeviceSolve, _local

_PTRK = None
_SUMK = None


def _antidiagonal(r: _DeviceSolve) -> None:
    """The whole matrix as one block: one launch of the tile wavefront's steps."""
    p = r.p
    mod = r.mod
    two = p.two_sided
    desc = _cached(_key(r, "antidiagonal", 0), lambda: r.device_table(
        np.array(block_row(0, p.M, 0, p.N, 0, p.n), dtype=np.int64)))
    r.E = mod.empty((p.m, p.n), dtype=p.W.dtype)
    Y = mod.empty((p.m, p.n), dtype=p.W.dtype)  # the local accumulator G_O^T Ẽ
    r.launch(desc, 0, 1, step_count(p.M, p.N, two), _widths([(p.M, p.N)], two), 0, Y,
             span=(p.M, p.N))


def _pointers(r: _DeviceSolve, plan: _WavePlan, bufs: dict):
    """Device pointer table of the planned batched GEMMs for this solve's buffers (one
    element-wise launch with the base addresses as scalars: no host-to-device copy)."""
    global _PTRK
    base = [0 if bufs[b] is None else int(bufs[b].data.ptr) for b in _BUFS]
    # the first entry of each row only: calls of one entry take host pointers (the whole
    # table of a stack with row-split scatters is millions of entries)
    r.host_ptrs = (plan.offs[:, :1] * r.isz
                   + np.array(base, dtype=np.int64)[plan.bidx[:, 0]][:, None])
    if not plan.batched:
        return None
    import cupy
    if _PTRK is None:
        _PTRK = cupy.ElementwiseKernel(
            "int64 off, int64 bi, int64 isz, int64 b0, int64 b1, int64 b2, int64 b3, "
            "int64 b4, int64 b5",
            "int64 ptr",
            "ptr = off * isz + (bi == 0 ? b0 : bi == 1 ? b1 : bi == 2 ? b2 : bi == 3 ? b3 "
            ": bi == 4 ? b4 : b5)",
            "bakron_gemm_pointers")
    return _PTRK(plan.offs_dev, plan.bidx_dev, r.isz, *base)


def _sum_partials(r: _DeviceSolve, plan, reduce: int, items: int) -> None:
    """``Fb`` of every item = the sum of its split gather's partial products in ``Fp``, in
    chunk order (block j of the step adds ``plan.counts[reduce, j]`` slices; 0 gives 0)."""
    global _SUMK
    fb, per, slices = plan.fb_size, plan.per, plan.slices
    Fp, Fb = r.buffers["Fp"], r.buffers["Fb"]
    if SIM:
        cnt = plan.counts[reduce]
        for it in range(items):
            for j, c in enumerate(cnt):
                at = it * fb + j * per
                acc = np.zeros(per, dtype=Fb.dtype)
                for t in range(int(c)):
                    src = it * slices * fb + t * fb + j * per
                    acc += Fp[src:src + per]
                Fb[at:at + per] = acc
        return
    import cupy
    if _SUMK is None:
        _SUMK = cupy.ElementwiseKernel(
            "raw T parts, raw int64 cnt, int64 fb, int64 per, int64 slices", "T out",
            "const long long it = i / fb; const long long pos = i - it * fb; "
            "const long long c = cnt[pos / per]; const long long at = it * slices * fb + pos; "
            "T acc = 0; for (long long t = 0; t < c; ++t) { acc += parts[at + t * fb]; } "
            "out = acc;",
            "bakron_sum_partials")
    _SUMK(Fp, plan.counts_dev[reduce], fb, per, slices, Fb)


def _wave_buffers(r: _DeviceSolve, plan, items: int, stack: bool) -> None:
    """The wavefront's work arrays for ``items`` items: ``E``, the accumulator ``Yg``, the
    base targets ``Fb`` and the split gathers' partial products ``Fp`` (a single solve's
    ``E`` and ``Yg`` as matrices, a stack's flat)."""
    p = r.p
    mod = r.mod
    shape = (items * p.m * p.n,) if stack else (p.m, p.n)
    r.E = mod.empty(shape, dtype=p.W.dtype)
    Yg = mod.zeros(shape, dtype=p.W.dtype) if p.two_sided else None
    Fb = mod.empty((items * plan.fb_size,), dtype=p.W.dtype)
    Fp = (mod.empty((items * plan.slices * plan.fb_size,), dtype=p.W.dtype)
          if plan.slices else None)
    r.buffers = {"Yg": Yg, "AI": r.AI, "AO": r.AO, "E": r.E, "Fb": Fb, "Fp": Fp}


def _run_steps(r: _DeviceSolve, plan, items: int) -> None:
    """Execute a (stack) wavefront plan: per coarse step its gathers (and the sum of split
    ones), one launch, its scatters."""
    ptrs = plan.offs if SIM else _pointers(r, plan, r.buffers)
    Fb, Yg = r.buffers["Fb"], r.buffers["Yg"]
    for start, k, nsteps, grid, flags, before, after, period, span, reduce in plan.steps:
        for g in before:
            r.gemm_batched(plan.ops[g], ptrs)
        if reduce is not None:
            _sum_partials(r, plan, reduce, items)
        r.launch(plan.desc, start, k, nsteps, grid, flags, Fb, Yg, period=period, span=span)
        for g in after:
            r.gemm_batched(plan.ops[g], ptrs)


def _wavefront(r: _DeviceSolve, cs: int) -> None:
    """The two-level wavefront: one launch per coarse step, batched GEMMs around it."""
    plan = _cached(_key(r, "wavefront", cs), lambda: _WavePlan(r, cs))
    _wave_buffers(r, plan, 1, False)
    _run_steps(r, plan, 1)


def _recursive(r: _DeviceSolve, base: int) -> None:
    """The recursion plan level by level: all the leaves of a phase in one launch, the
    updates between them as cuBLAS GEMMs on views (no copies)."""
    p = r.p
    mod = r.mod
    n = p.n
    R, C = p.rows, p.cols
    two = p.two_sided
    r.E = E = mod.empty((p.m, n), dtype=p.W.dtype)
    F = mod.zeros((p.m, n), dtype=p.W.dtype)

    def build():
        plan = RecursionPlan(R, C, base, two)
        desc_rows, program = [], []
        for kind, what in plan.phases:
            if kind == "update":
                program.append((kind, what))
                continue
            start = len(desc_rows)
            for b in what:
                desc_rows.append(block_row(b.ra, b.rb, b.ca, b.cb, R[b.ra] * n + C[b.ca], n))
            program.append((kind, (start, len(what),
                                   max(step_count(*b.shape, two) for b in what),
                                   _widths((b.shape for b in what), two),
                                   _period(b.shape for b in what),
                                   (max(b.shape[0] for b in what),
                                    max(b.shape[1] for b in what)))))
        return program, r.device_table(np.array(desc_rows, dtype=np.int64).reshape(-1))

    program, desc = _cached(_key(r, "recursive", base), build)
    kept: dict = {}  # after_D's X per quadrant node, until its after_BC
    for kind, what in program:
        if kind == "leaves":
            start, k, nsteps, grid, period, span = what
            r.launch(desc, start, k, nsteps, grid, HAS_F, F, period=period, span=span)
        else:
            _update(r, what, E, F, kept)


def _update(r: _DeviceSolve, u, E, F, kept: dict) -> None:
    """One update of the recursion plan (``schedule.Update`` says what each kind adds)."""
    mod = r.mod
    AO, AI = r.AO, r.AI
    gemm = r.gemm_view
    r0, r_, r1 = u.rows
    c0, c_, c1 = u.cols
    if u.kind == AFTER_D:
        ED = E[r_:r1, c_:c1]
        X = mod.empty((r1 - r_, c1 - c_), dtype=E.dtype)
        gemm(X, ED, AI[c_:c1, c_:c1], beta=0.0)
        X += ED                                       # E_D G_I[C2,C2]
        gemm(F[r0:r_, c_:c1], AO[r_:r1, r0:r_], X, ta=True)   # -> B
        Z = mod.empty((r1 - r_, c_ - c0), dtype=E.dtype)
        gemm(Z, ED, AI[c_:c1, c0:c_], beta=0.0)          # E_D A_I[C2,C1]
        FC = F[r_:r1, c0:c_]
        FC += Z
        gemm(FC, AO[r_:r1, r_:r1], Z, ta=True)            # -> C
        kept[u.block] = Z
    elif u.kind == AFTER_BC:
        EB = E[r0:r_, c_:c1]
        EC = E[r_:r1, c0:c_]
        FA = F[r0:r_, c0:c_]
        U = mod.empty((r_ - r0, c_ - c0), dtype=E.dtype)
        gemm(U, EB, AI[c_:c1, c0:c_], beta=0.0)          # E_B A_I[C2,C1]
        FA += U
        gemm(FA, AO[r0:r_, r0:r_], U, ta=True)
        V = kept.pop(u.block)                         # E_D A_I[C2,C1]
        V += EC
        gemm(V, EC, AI[c0:c_, c0:c_])                    # + E_C G_I[C1,C1]
        gemm(FA, AO[r_:r1, r0:r_], V, ta=True)
    elif u.kind == AFTER_RIGHT:
        Er = E[r0:r1, c_:c1]
        Z = mod.empty((r1 - r0, c_ - c0), dtype=E.dtype)
        gemm(Z, Er, AI[c_:c1, c0:c_], beta=0.0)
        FL = F[r0:r1, c0:c_]
        FL += Z
        if r.p.two_sided:
            gemm(FL, AO[r0:r1, r0:r1], Z, ta=True)
    elif u.kind == AFTER_BOTTOM:
        Eb = E[r_:r1, c0:c1]
        X = mod.empty((r1 - r_, c1 - c0), dtype=E.dtype)
        gemm(X, Eb, AI[c0:c1, c0:c1], beta=0.0)
        X += Eb
        gemm(F[r0:r_, c0:c1], AO[r_:r1, r0:r_], X, ta=True)
    else:  # pragma: no cover - the plan makes only these
        raise AssertionError(f"unknown update {u.kind!r}")


class _StackSolve(_DeviceSolve):
    """One launch context for items ``[start, stop)`` of a stack chunk: the kernel's arrays
    hold every item (inputs as the stack layer flattened them, the chunk's outputs in place,
    ``E`` and the accumulator per item), and each block descriptor says where its item
    starts in each (``_cuda_layout.block_row``)."""

    def __init__(self, chunk, p, tables):
        self._setup(p, items=True)
        mod = self.mod
        m, n = p.m, p.n
        items = np.arange(chunk.start, chunk.stop)
        self.nb = nb = len(items)

        def rows_of(flat, index):
            """The rows of ``flat`` that the chunk's items use, contiguous, and each item's
            row in that range (a shared factor: the same row for every item)."""
            idx = np.asarray(index)[items]
            lo, hi = int(idx.min()), int(idx.max())
            return mod.ascontiguousarray(flat[lo:hi + 1]), idx - lo

        self.W, w_row = rows_of(chunk.W, chunk.w_index)
        self.AI, ai_row = rows_of(chunk.A_in, chunk.in_index)
        if p.two_sided:
            self.AO, ao_row = rows_of(chunk.A_out, chunk.out_index)
        else:
            self.AO, ao_row = None, np.zeros(nb, dtype=np.int64)
        self.Wq = chunk.values
        self.codes = chunk.codes
        self.T = chunk.targets
        # the quantizer tables (_stack_tables): one shared table, or one per item stacked
        S, Z, shared = tables
        self.S = mod.ascontiguousarray(S)
        self.Z = None if Z is None else mod.ascontiguousarray(Z)
        self.s_shape = tuple(int(v) for v in S.shape[-2:])
        self.z_shape = (1, 1) if Z is None else tuple(int(v) for v in Z.shape[-2:])
        s_size = 0 if shared else self.s_shape[0] * self.s_shape[1]
        z_size = 0 if shared else self.z_shape[0] * self.z_shape[1]
        mn = m * n
        # each item's offsets as descriptor fields (the tile ranges and F left 0)
        j = np.arange(nb, dtype=np.int64)
        off = np.zeros((nb, DESC), dtype=np.int64)
        off[:, DESC_W_OFFSET] = np.asarray(w_row, dtype=np.int64) * mn
        off[:, DESC_OUT_OFFSET] = items * mn
        off[:, DESC_E_OFFSET] = j * mn
        off[:, DESC_AO_OFFSET] = np.asarray(ao_row, dtype=np.int64) * m * m
        off[:, DESC_AI_OFFSET] = np.asarray(ai_row, dtype=np.int64) * n * n
        off[:, DESC_S_OFFSET] = j * s_size
        off[:, DESC_Z_OFFSET] = j * z_size
        self.item_desc = off

    def blocks(self, rows: np.ndarray, f_stride: int) -> np.ndarray:
        """The descriptors of one item's blocks ``rows`` (k, DESC) for every item, item after
        item (nb k, DESC): the item's offsets added, its ``F`` region ``f_stride`` further."""
        d = np.repeat(self.item_desc[:, None, :], len(rows), axis=1)
        d[:, :, :DESC_W_OFFSET] = rows[None, :, :DESC_W_OFFSET]
        d[:, :, DESC_F_OFFSET] += np.arange(self.nb, dtype=np.int64)[:, None] * f_stride
        return d.reshape(-1, DESC)


def _stack_antidiagonal(r: _StackSolve) -> str:
    """Every item's whole tile wavefront in ONE launch: step ``g`` solves anti-diagonal
    ``g`` of all items (period 1: the items' blocks have one shape)."""
    p = r.p
    mod = r.mod
    two = p.two_sided
    mn = p.m * p.n
    one = np.array([block_row(0, p.M, 0, p.N, 0, p.n)], dtype=np.int64)
    desc = r.device_table(r.blocks(one, mn).reshape(-1))
    r.E = mod.empty((r.nb * mn,), dtype=p.W.dtype)
    Y = mod.empty((r.nb * mn,), dtype=p.W.dtype)  # each item's local accumulator G_O^T Ẽ
    nsteps = step_count(p.M, p.N, two)
    r.launch(desc, 0, r.nb, nsteps, _widths([(p.M, p.N)], two, r.nb), 0, Y, period=1,
             span=(p.M, p.N))
    if _local(r.opts, r.nb, (p.M, p.N)):
        return (f"one launch for {r.nb} items: each CTA solves whole items, {nsteps} tile "
                f"steps each")
    return (f"one launch for {r.nb} items: {nsteps} grid-synchronised tile steps, each over "
            f"the tiles of every item")


def _stack_wavefront(r: "_StackSolve", cs: int) -> str:
    """The two-level wavefront of every item at once: per coarse step, batched GEMMs over
    every item's blocks, one launch, batched GEMMs."""
    plan = _cached(_key(r, "wavefront", cs), lambda: _WavePlan(r, cs))
    # the stack plan depends on the items' offsets too: cached for repeated stacks alike
    sp = _cached(_key(r, "wavefront", cs) + (r.item_desc.tobytes(),),
                 lambda: _StackWavePlan(r, plan))
    _wave_buffers(r, sp, r.nb, True)
    _run_steps(r, sp, r.nb)
    return (f"one launch per coarse step for {r.nb} items: {len(sp.steps)} coarse steps of "
            f"base {cs}, each batched GEMMs over every item's blocks, one launch, batched "
            f"GEMMs")


def _stack_tables(chunk, p):
    """The quantizer tables of the chunk's items in W's dtype on the device, ``(S, Z,
    shared)``: one quantizer's tables when every item shares it (``shared``), else every
    item's tables stacked ``(k, r, g)`` (one host-to-device copy); ``None`` when the items'
    quantizers differ in kind (:meth:`bakron.UniformQuantizer.table_kind`) or one is not a
    plain :class:`bakron.UniformQuantizer` (the chunk is then declined)."""
    from bakron.solvers.engines import is_plain_uniform

    qs = chunk.quantizers[chunk.start:chunk.stop]
    q0 = qs[0]
    # is_plain_uniform looks at the type only: one instance of each type
    if not all(is_plain_uniform(q) for q in {type(q): q for q in qs}.values()):
        return None
    if all(q is q0 for q in qs):
        return (*q0.tables(p.xp, p.device, p.dtype), True)
    kind = q0.table_kind()
    if not all(q.table_kind() == kind for q in qs):
        return None
    return (*type(q0).stacked_tables(qs, p.xp, p.device, p.dtype), False)
