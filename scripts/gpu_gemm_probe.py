#!/usr/bin/env python
"""Time the wavefront's planned gather and scatter GEMMs one by one, and the gathers as
partial products over K chunks (docs/engines.md, "Zeros and parallelism in the wavefront's
GEMMs").

    BAKRON_CUDA_GATHER_TILES=0 BAKRON_CUDA_SCATTER_ROWS=0 \\
        python scripts/gpu_gemm_probe.py [4096] [14336] [stack1024] [moe]

Solves each workload once (cupy, engine ``cuda``, float32, tile 16, 2-bit, two-sided), records
every batched GEMM the engine calls (shape, entries, device pointers), then replays each one
alone between CUDA events (medians of 7): the call as planned, and for each gather (``op(A)
= A``, long K) the same products cut into ``S`` = 2, 4, 8 chunks of K written to ``S`` partial
buffers and summed by ``cupy.sum``, with and without the chunks that meet only zeros of
``A_I`` (above the block's columns). With the two variables above the engine plans its GEMMs
as before the split (one entry per block); the table of docs/engines.md came from that plan.
Prints, per workload, the summed time and FLOP of the gathers and scatters and the summed
time of each variant. Needs a GPU.
"""
from __future__ import annotations

import statistics
import sys

import numpy as np


def main(argv=None) -> int:
    import cupy

    import bakron
    from bakron.backends import numba_cuda as nc
    from bakron.benchmarks.stack import make_stack

    names = (argv if argv is not None else sys.argv[1:]) or ["4096", "stack1024", "moe"]
    sync = cupy.cuda.get_current_stream().synchronize
    calls = []
    planned = nc._DeviceSolve.gemm_batched

    def recording(self, op, ptrs):
        ta, tb, M, N, K, alpha, beta, A, B, C, row, k = op
        if k > 0 and M and N and K:
            hp = (self.host_ptrs[row:row + 3, :1] if k == 1
                  else cupy.asnumpy(ptrs[row:row + 3, :k]))
            calls.append((self, self.buffers, tuple(op), np.array(hp)))
        return planned(self, op, ptrs)

    def problem(m, n, seed=0):
        rng = cupy.random.default_rng(seed)

        def factor(d):
            X = rng.standard_normal((d, d + 64), dtype=np.float64)
            return bakron.prepare_factor(X @ X.T / X.shape[1], 16).A.astype(cupy.float32)
        W = rng.standard_normal((m, n), dtype=np.float32)
        return W, factor(m), factor(n), bakron.UniformQuantizer.fit(W, 2)

    def timed(fn, reps=7):
        ts = []
        for _ in range(reps):
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(e0, e1))
        return statistics.median(ts)

    def dev(a):
        return cupy.asarray(np.asarray(a, dtype=np.int64))

    def probe(label, args):
        bakron.solve(*args, tile=(16, 16))
        sync()
        calls.clear()
        nc._DeviceSolve.gemm_batched = recording
        try:
            bakron.solve(*args, tile=(16, 16))
            sync()
        finally:
            nc._DeviceSolve.gemm_batched = planned
        total = {"gather": [0.0, 0.0], "scatter": [0.0, 0.0]}
        variants: dict = {}
        for r, bufs, op, hp in calls:
            ta, tb, M, N, K, alpha, beta, A, B, C, row, k = op
            lda, ldb, ldc, isz = A[1], B[1], C[1], r.isz
            pa, pb, pc = dev(hp[0]), dev(hp[1]), dev(hp[2])
            kind = "scatter" if ta else "gather"
            if k > 1:
                t = timed(lambda: r._gemm(ta, tb, M, N, K, alpha, int(pa.data.ptr), lda,
                                          int(pb.data.ptr), ldb, beta, int(pc.data.ptr), ldc,
                                          batch=k))
            else:
                t = timed(lambda: r._gemm(ta, tb, M, N, K, alpha, int(hp[0][0]), lda,
                                          int(hp[1][0]), ldb, beta, int(hp[2][0]), ldc))
            total[kind][0] += t
            total[kind][1] += 2.0 * M * N * K * k
            if kind != "gather" or C[0] != "Fb":
                continue
            n = r.p.n
            off = ((hp[1] - int(bufs["AI"].data.ptr)) // isz) % (n * n)
            zeros = off % n - off // n  # K rows above block j's columns: zeros of A_I
            for S in (2, 4, 8):
                Kc = -(-K // S)
                parts = cupy.zeros((S, k, M, N), dtype=bufs["AI"].dtype)
                out = cupy.empty((k, M, N), dtype=parts.dtype)
                for skip in (False, True):
                    plan = []
                    for Kp, chunks in ((Kc, [s for s in range(S) if (s + 1) * Kc <= K]),
                                       (K % Kc, [K // Kc] if K % Kc else [])):
                        ea, eb, ec = [], [], []
                        for s in chunks:
                            for j in range(k):
                                if skip and s * Kc + Kp <= zeros[j]:
                                    continue
                                ea.append(hp[0][j] + s * Kc * isz)
                                eb.append(hp[1][j] + s * Kc * ldb * isz)
                                ec.append(int(parts.data.ptr) + (s * k + j) * M * N * isz)
                        if ea:
                            plan.append((Kp, dev(ea), dev(eb), dev(ec), len(ea)))

                    def run(plan=plan):
                        for Kp, da, db, dc, kk in plan:
                            r._gemm(False, False, M, N, Kp, 1.0, int(da.data.ptr), lda,
                                    int(db.data.ptr), ldb, 0.0, int(dc.data.ptr), N,
                                    batch=kk)
                        cupy.sum(parts, axis=0, out=out)
                    variants[(S, skip)] = variants.get((S, skip), 0.0) + timed(run)
        print(f"{label}: {len(calls)} GEMM calls")
        for kind, (t, flop) in total.items():
            rate = flop / t / 1e9 if t else 0.0
            print(f"  {kind}: {t:.2f} ms, {flop / 1e9:.1f} GFLOP ({rate:.1f} TFLOP/s)")
        for (S, skip), t in sorted(variants.items()):
            print(f"  gathers in {S} partial products, zero chunks "
                  f"{'left out' if skip else 'kept'}: {t:.2f} ms")

    for name in names:
        if name == "4096":
            probe("4096²", problem(4096, 4096))
        elif name == "14336":
            probe("14336×4096", problem(14336, 4096))
        elif name in ("stack1024", "moe"):
            B, m, n = (64, 1024, 1024) if name == "stack1024" else (128, 768, 2048)
            Wn, AOn, AIn, qs = make_stack(B, m, n)
            probe(f"{B} × {m}×{n}", (cupy.asarray(Wn), cupy.asarray(AOn), cupy.asarray(AIn),
                                     qs))
        else:
            raise SystemExit(f"unknown workload {name!r}: 4096, 14336, stack1024 or moe")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
