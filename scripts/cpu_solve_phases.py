#!/usr/bin/env python
"""Where a numba ``bakron.solve`` spends its time right after a multi-threaded product.

    OPENBLAS_NUM_THREADS=16 NUMBA_NUM_THREADS=16 python scripts/cpu_solve_phases.py 2048

Per round: the floor product ``G_Oᵀ W G_I`` (numpy's BLAS on its threads), then one of three
modes, then a two-sided wavefront solve (float32, tile 16, 2-bit): ``default`` (nothing),
``stop`` (numpy's OpenBLAS's workers ended first, ``blas_thread_shutdown_``), ``sleep``
(0.3 s pause, so that idle workers stop spinning). Prints per mode the medians of the floor,
the whole solve and the engine's ``run`` (the solve without its checks), over 6 rounds each,
the modes interleaved. docs/engines.md, "Many cores", item 3, has a measurement.
"""
from __future__ import annotations

import argparse
import os
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=2048, help="W is n x n")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args(argv)
    import numpy as np

    import bakron
    from bakron.backends import numba_cpu as nc
    from bakron.benchmarks.cpu import floor_product, make_problem

    nc.warm_up()
    K = nc._kernels()
    if getattr(K, "_OPENBLAS", None) is None:
        print("numpy does not use its own OpenBLAS: the 'stop' mode needs it")
        return 2
    P = make_problem(a.n, a.n, (16, 16), np.dtype("float32"))
    W, AO, AI = P["W"], P["A_out"], P["A_in"]
    q = bakron.UniformQuantizer.fit(W, 2)
    GO, GI = np.eye(a.n, dtype=W.dtype) + AO, np.eye(a.n, dtype=W.dtype) + AI
    engine = {}
    run = nc.run

    def timed_run(*args, **kw):
        t = time.perf_counter()
        out = run(*args, **kw)
        engine["t"] = time.perf_counter() - t
        return out

    nc.run = timed_run  # bakron.solve looks the engine's run up per call
    rows: dict = {}
    try:
        for mode in ("default", "stop", "sleep") * a.rounds:
            t = time.perf_counter()
            floor_product(GO, W, GI)
            tf = time.perf_counter() - t
            if mode == "stop":
                K._OPENBLAS.blas_thread_shutdown_()
            elif mode == "sleep":
                time.sleep(0.3)
            t = time.perf_counter()
            bakron.solve(W, AO, AI, q, tile=16, method="wavefront", engine="numba")
            rows.setdefault(mode, []).append((tf, time.perf_counter() - t, engine["t"]))
    finally:
        nc.run = run
    print(f"n = {a.n}, numba threads {nc.numba_threads()}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}, "
          f"threading layer {nc.threading_layer()}")
    print("| mode | floor ms | solve ms | engine run ms |\n|---|---:|---:|---:|")
    for mode, v in rows.items():
        f, s, e = (1e3 * np.median(np.array(v)[:, i]) for i in range(3))
        print(f"| {mode} | {f:.1f} | {s:.1f} | {e:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
