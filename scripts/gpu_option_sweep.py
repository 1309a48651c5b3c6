#!/usr/bin/env python
"""Time the cuda engine's wavefront under its options, one setting per process.

    BAKRON_CUDA_PER_THREAD=2 python scripts/gpu_option_sweep.py float32 \\
        1024x1024,4096x4096 [--stacks]

The environment variables (``BAKRON_CUDA_MAXREG``, ``BAKRON_CUDA_PER_THREAD``,
``BAKRON_CUDA_STEP``, ...) set the defaults of :class:`bakron.CudaOptions`, which every solve
here runs with; a sweep runs this script once per setting (a fresh process: fresh kernels and
caches). Per size: the median solver time of 11 float32/float64 two-sided solves
(``SolveResult.seconds``; the problem of ``bakron.benchmarks.gpu``), the floor product
``G_Oᵀ W G_I`` in the same process, the cooperative grid of each kernel variant used and a
checksum of Ŵ (equal checksums across settings: same results). ``--stacks`` adds the stacks
64 × 1024² and 128 × 768×2048 of ``bakron.benchmarks.stack.make_stack`` (medians of 3);
``--shapes 2x4096x4096,...`` stacks of B items made on the GPU (one factor pair per shape,
W per item), ``--base`` passes a coarse block to every solve, single layers and stacks
(default: the engine's rules, ``auto_base`` and ``stack_base``). Needs cupy and a CUDA device.
"""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dtype", choices=("float32", "float64"))
    ap.add_argument("sizes", help="e.g. 1024x1024,4096x11008 ('' for none)")
    ap.add_argument("--stacks", action="store_true")
    ap.add_argument("--shapes", default="", help="stacks BxMxN made on the GPU")
    ap.add_argument("--base", type=int, default=None, help="coarse block of every solve")
    a = ap.parse_args(argv)
    import cupy as cp

    import bakron
    from bakron.backends import numba_cuda as NC
    from bakron.benchmarks.gpu import Env, make_problem, solve_cuda, timeit
    env = Env()
    o = bakron.CudaOptions.defaults()
    tag = (f"{a.dtype} maxreg={o.maxreg} per_thread={o.per_thread} step={o.step} "
           f"stack_base={o.stack_base} base={a.base}")
    for sz in filter(None, a.sizes.split(",")):
        m, n = map(int, sz.split("x"))
        W, AO, AI, q = make_problem(env, m, n, 16, 1)
        W, AO, AI = (x.astype(a.dtype) for x in (W, AO, AI))
        t, _ = timeit(env, lambda: solve_cuda(W, AO, AI, q, "wavefront", a.base).seconds,
                      11)
        r = solve_cuda(W, AO, AI, q, "wavefront", a.base)
        G_out = AO + cp.eye(m, dtype=a.dtype)
        G_in = AI + cp.eye(n, dtype=a.dtype)
        fl, _ = timeit(env, lambda: G_out.T @ W @ G_in, 11)
        grids = {f"running={k[6]} per_thread={k[7]}": v for k, v in NC._MAXGRID.items()}
        print(f"{tag} {sz}: {1e3 * t:.2f} ms floor {1e3 * fl:.2f} ms ({t / fl:.2f}x) "
              f"grids {grids} checksum {float(cp.abs(r.values).sum()):.9e}", flush=True)
    if a.stacks:
        from bakron.benchmarks.stack import make_stack
        for B, m, n in ((64, 1024, 1024), (128, 768, 2048)):
            W, A_out, A_in, qs = make_stack(B, m, n, dtype=a.dtype)
            W, A_out, A_in = cp.asarray(W), cp.asarray(A_out), cp.asarray(A_in)
            _time_stack(env, tag, W, A_out, A_in, qs, a.base)
    for spec in filter(None, a.shapes.split(",")):
        B, m, n = map(int, spec.split("x"))
        _, AO, AI, _ = make_problem(env, m, n, 16, 1)  # one factor pair, shared (2-D)
        W = cp.random.default_rng(2).standard_normal((B, m, n)).astype(a.dtype)
        qs = bakron.fit_quantizers(cp.asnumpy(W), 2)
        _time_stack(env, tag, W, AO.astype(a.dtype), AI.astype(a.dtype), qs, a.base)
    return 0


def _time_stack(env, tag, W, A_out, A_in, qs, base):
    import bakron
    from bakron.benchmarks.gpu import timeit

    def run():
        return bakron.solve_stack(W, A_out, A_in, qs, tile=16, engine="cuda", base=base)
    t, _ = timeit(env, run, 3)
    r = run()
    B, m, n = W.shape
    print(f"{tag} stack {B}x{m}x{n} base {r.info.get('base')}: {1e3 * t:.1f} ms checksum "
          f"{float(abs(r.values).sum()):.9e}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
