#!/usr/bin/env python
"""Where a GPU solve's time goes: the tile kernel's launches, the cuBLAS GEMMs, the rest.

    python scripts/gpu_time_split.py [--reps 5] [--out split.md]

Runs ``bakron.solve`` (cupy, engine ``cuda``, method ``auto``, float32 without TF32, tile 16,
2-bit grid, two-sided) on single layers and on stacks, and brackets every kernel launch and
every GEMM call of the engine with CUDA events on the solve's stream. Per workload: the wall
time of the solve (device synchronised), the summed GPU time inside kernel launches and inside
GEMM calls (with their counts), and the rest (host work between calls that the GPU does not
hide: planning, Python, launch overhead, validation). The events add a few microseconds per
call; the wall time is measured in separate runs without them. Medians over ``--reps``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

#: (label, B, m, n); B = 0: a single layer
WORKLOADS = (("1024²", 0, 1024, 1024), ("4096²", 0, 4096, 4096),
             ("64 × 1024²", 64, 1024, 1024), ("128 × 768×2048", 128, 768, 2048),
             ("64 × 256²", 64, 256, 256))


class Split:
    """Wraps ``_DeviceSolve.launch`` and ``gemm_batched``/``gemm_view`` with events."""

    def __init__(self, cupy, numba_cuda):
        self.cupy, self.cls = cupy, numba_cuda._DeviceSolve
        self.pairs = {"kernel": [], "gemm": []}
        self.saved = {}

    def _wrap(self, name, kind):
        fn = getattr(self.cls, name)
        cupy, pairs = self.cupy, self.pairs

        def wrapped(obj, *a, **k):
            s = cupy.cuda.get_current_stream()
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(s)
            out = fn(obj, *a, **k)
            e1.record(s)
            pairs[kind].append((e0, e1))
            return out
        self.saved[name] = fn
        setattr(self.cls, name, wrapped)

    def __enter__(self):
        self._wrap("launch", "kernel")
        self._wrap("gemm_batched", "gemm")
        self._wrap("gemm_view", "gemm")
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.cls, name, fn)

    def totals(self):
        self.cupy.cuda.get_current_stream().synchronize()
        out = {}
        for kind, pairs in self.pairs.items():
            ms = sum(self.cupy.cuda.get_elapsed_time(a, b) for a, b in pairs)
            out[kind] = (ms, len(pairs))
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stack-bases", default="",
                    help="also run the stacks with these coarse block sizes, e.g. 2,8")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args(argv)

    import cupy

    import bakron
    from bakron.backends import numba_cuda
    from bakron.benchmarks.cpu import make_problem
    from bakron.benchmarks.stack import make_stack

    bases = [int(b) for b in args.stack_bases.split(",") if b.strip()]
    rows = ["| workload | method ran | wall ms | kernel ms (launches) | GEMM ms (calls) | "
            "rest ms | summed floor ms |", "|---|---|---:|---:|---:|---:|---:|"]
    runs = [(label, B, m, n, None) for label, B, m, n in WORKLOADS]
    runs += [(f"{label}, base {b}", B, m, n, b) for label, B, m, n in WORKLOADS if B
             for b in bases]
    for label, B, m, n, base in runs:
        if B:
            W, AO, AI, qs = make_stack(B, m, n)
            q = qs
        else:
            P = make_problem(m, n)
            W, AO, AI = P["W"], P["A_out"], P["A_in"]
            q = bakron.UniformQuantizer.fit(W, 2)
        W, AO, AI = (cupy.asarray(a) for a in (W, AO, AI))
        sync = cupy.cuda.get_current_stream().synchronize

        def solve():
            return bakron.solve(W, AO, AI, q, tile=16, engine="cuda", base=base)

        res = solve()
        sync()
        walls, ks, gs = [], [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            solve()
            sync()
            walls.append(time.perf_counter() - t0)
            with Split(cupy, numba_cuda) as sp:
                solve()
                tot = sp.totals()
            ks.append(tot["kernel"])
            gs.append(tot["gemm"])
        Ws = W if B else W[None]
        AOs, AIs = (AO, AI) if B else (AO[None], AI[None])
        GO = [a + cupy.eye(m, dtype=W.dtype) for a in AOs]
        GI = [a + cupy.eye(n, dtype=W.dtype) for a in AIs]
        fl = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for i in range(Ws.shape[0]):
                GO[i].T @ Ws[i] @ GI[i]
            sync()
            fl.append(time.perf_counter() - t0)
        wall = statistics.median(walls) * 1e3
        kms = statistics.median(k[0] for k in ks)
        gms = statistics.median(g[0] for g in gs)
        rows.append(f"| {label} | {res.method} | {wall:.2f} | {kms:.2f} ({ks[0][1]}) | "
                    f"{gms:.2f} ({gs[0][1]}) | {wall - kms - gms:.2f} | "
                    f"{statistics.median(fl) * 1e3:.2f} |")
        print(rows[-1], flush=True)
        del W, AO, AI, Ws, AOs, AIs, GO, GI
        cupy.get_default_memory_pool().free_all_blocks()
    text = "\n".join(rows) + "\n"
    if args.out:
        from bakron._lib.fs import atomic_path

        with atomic_path(args.out) as tmp:
            tmp.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
