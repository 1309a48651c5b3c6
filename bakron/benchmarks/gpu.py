"""GPU benchmark of the cuda engine: build, time, write docs/benchmarks/gpu.md + plot.

Run on a machine with a CUDA GPU, cupy and numba-cuda::

    python -m bakron.benchmarks.gpu --out docs/benchmarks [--pytest-log LOG] [--tf32]

In one run it (1) compiles the kernels, (2) times every method through ``bakron.solve`` at
1024², 2048², 4096², 4096×11008 and 11008×4096 (float32 without TF32, tile 16, 2-bit per-row
grid; medians of the solver time ``SolveResult.seconds``, device synchronised; ratios to the
floor product ``G_Oᵀ W G_I`` timed in the same run), the float64 times (and whether the methods
agree exactly), TF32 (with its mismatch count against float64) and the peak device memory, and
(3) writes the markdown page and the plot. The correctness checks are the GPU tests
(``pytest -m gpu tests/test_cuda.py tests/test_engines.py``), whose summary line the page quotes
with ``--pytest-log``.

``--smoke`` runs the same code on tiny sizes (also under numba-cuda's simulator with numpy
arrays: ``NUMBA_ENABLE_CUDASIM=1 python -m bakron.benchmarks.gpu --smoke --out /tmp/x``).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

import bakron
from bakron import _xp

SIZES = [(1024, 1024), (2048, 2048), (4096, 4096), (4096, 11008), (11008, 4096)]
TARGET_MS = {(1024, 1024): 3.0, (4096, 4096): 20.0, (4096, 11008): 100.0, (11008, 4096): 100.0}
METHODS = ("wavefront", "recursive", "antidiagonal")
#: exllamav3 1.6.5 ``ldlq_2hess`` on an H200 (ms), published figures quoted for orientation
ANCHORS = {(1024, 1024): 64.0, (2048, 2048): 100.0, (4096, 4096): 656.0, (4096, 11008): 3630.0}


def _log(*a):
    print(*a, flush=True)


class Env:
    """cupy + the cuda engine, or numpy under the simulator (--smoke only)."""

    def __init__(self):
        from bakron.backends import numba_cuda as NC
        self.NC = NC  # the engine module: its kernels and launch settings
        self.sim = NC.SIM
        if self.sim:
            import array_api_compat.numpy as xp
            self.cp = None
            self.xp = xp
        else:
            import cupy
            import array_api_compat.cupy as xp
            self.cp = cupy
            self.xp = xp

    def asarray(self, a, dtype=None):
        a = np.asarray(a) if dtype is None else np.asarray(a, dtype=dtype)
        return a if self.sim else self.cp.asarray(a)

    def sync(self):
        if not self.sim:
            self.cp.cuda.get_current_stream().synchronize()

    def host(self, a):
        return _xp.to_numpy(a)


def _spd_factor(env, rng, n, block):
    """A well-conditioned random Hessian factor on the device and its prepared factor."""
    k = max(8, n // 2)
    if env.sim:
        X = rng.standard_normal((n, k))
        H = X @ X.T / k
    else:
        cp = env.cp
        X = cp.random.default_rng(int(rng.integers(1 << 30))).standard_normal((n, k))
        H = X @ X.T / k
        H = (H + H.T) / 2
    return bakron.prepare_factor(H, block)


def make_problem(env, m, n, t, seed):
    rng = np.random.default_rng(seed)
    W64 = rng.standard_normal((m, n))
    f_in = _spd_factor(env, rng, n, t)
    f_out = _spd_factor(env, rng, m, t)
    q = bakron.UniformQuantizer.fit(W64, 2, granularity="row")
    return env.asarray(W64), f_out.A, f_in.A, q


def timeit(env, fn, reps):
    """Median wall time of ``fn()`` (device synchronised), or of the seconds it returns when it
    returns a float (a solve's ``SolveResult.seconds``)."""
    env.sync()
    fn()
    env.sync()
    ts = []
    for _ in range(reps):
        env.sync()
        t0 = time.perf_counter()
        own = fn()
        env.sync()
        ts.append(own if isinstance(own, float) else time.perf_counter() - t0)
    return statistics.median(ts), ts


def solve_cuda(W, AO, AI, q, method, base=None, tile=16, options=None):
    """One solve on the cuda engine through the public entry point (``options``: a
    :class:`bakron.CudaOptions`, default the defaults)."""
    return bakron.solve(W, AO, AI, q, tile=tile, method=method, base=base, engine="cuda",
                        options=options)


class PeakMemory:
    """Peak bytes in use in cupy's memory pool while active (all our buffers go through it)."""

    def __init__(self, env):
        self.env = env
        self.peak = 0

    def __enter__(self):
        if self.env.sim:
            return self
        cp = self.env.cp
        self.pool = cp.get_default_memory_pool()
        self.base = self.pool.used_bytes()
        self.peak = self.base

        def malloc(size):
            mem = self.pool.malloc(size)
            u = self.pool.used_bytes()
            if u > self.peak:
                self.peak = u
            return mem
        cp.cuda.set_allocator(malloc)
        return self

    def __exit__(self, *exc):
        if not self.env.sim:
            self.env.cp.cuda.set_allocator(self.pool.malloc)
        return False


# ------------------------------------------------------------------------------------------
def bench_size(env, m, n, *, reps, tf32, tuning, seed=1):
    NC = env.NC
    t = 16
    W64, AO64, AI64, q = make_problem(env, m, n, t, seed)
    xp = env.xp
    W32 = xp.astype(W64, xp.float32)
    AO32 = xp.astype(AO64, xp.float32)
    AI32 = xp.astype(AI64, xp.float32)
    out = {"m": m, "n": n, "tile": t}
    # floor product G_O^T W G_I (float32, no TF32), same backend
    eye_m = xp.eye(m, dtype=xp.float32)
    eye_n = xp.eye(n, dtype=xp.float32)
    GOt = xp.matrix_transpose(eye_m + AO32)
    GI = eye_n + AI32
    if not env.sim:
        GOt = env.cp.ascontiguousarray(GOt)
    floor, _ = timeit(env, lambda: xp.matmul(xp.matmul(GOt, W32), GI), max(reps, 5))
    del GOt, GI, eye_m, eye_n
    out["floor_ms"] = floor * 1e3
    out["floor_tflops"] = 2.0 * m * n * (m + n) / floor / 1e12
    res32, res64 = {}, {}
    out["f32"], out["f64"], out["mem"] = {}, {}, {}
    variants = [(mt, None) for mt in METHODS]
    if tuning:
        variants += [("wavefront", 8), ("wavefront", 32), ("recursive", 8), ("recursive", 32)]
    for method, base in variants:
        key = method if base is None else f"{method}/{base}"
        holder = {}

        def run32():
            holder["r"] = solve_cuda(W32, AO32, AI32, q, method, base, t)
            return holder["r"].seconds
        r_reps = reps if not (method == "antidiagonal" and m * n > 2 ** 24) else max(3, reps // 2)
        med, ts = timeit(env, run32, r_reps)
        out["f32"][key] = {"ms": med * 1e3, "all_ms": [x * 1e3 for x in ts],
                           "ratio": med / floor, "launches": holder["r"].info["launches"]}
        res32[key] = env.host(holder["r"].values)
        _log(f"  {m}x{n} f32 {key:16s} {med * 1e3:9.2f} ms  ratio {med / floor:6.2f}")
        if base is None:
            with PeakMemory(env) as pm:
                solve_cuda(W32, AO32, AI32, q, method, base, t)
                env.sync()
            extra = pm.peak - getattr(pm, "base", 0)
            isz = 4
            factor_copies = (m * m + n * n) * isz  # the solver's working-dtype copies of A
            outputs = m * n * (isz + 2)             # Ŵ and int16 codes
            out["mem"][key] = {"peak_extra_bytes": int(extra),
                               "beyond_factors_outputs_mn": (extra - factor_copies - outputs)
                               / (m * n * isz)}
    for method in METHODS:
        holder = {}

        def run64():
            holder["r"] = solve_cuda(W64, AO64, AI64, q, method, None, t)
            return holder["r"].seconds
        med, _ = timeit(env, run64, max(1, reps // 3))
        out["f64"][method] = {"ms": med * 1e3}
        res64[method] = env.host(holder["r"].values)
        _log(f"  {m}x{n} f64 {method:16s} {med * 1e3:9.2f} ms")
    ref = res64["wavefront"]
    out["f64_identical"] = all(np.array_equal(v, ref) for v in res64.values())
    out["f32_mismatch_vs_f64"] = {k: int(np.sum(v != ref.astype(np.float32)))
                                  for k, v in res32.items()}
    out["f32_mismatch_between_methods"] = int(sum(np.sum(v != res32["wavefront"])
                                                  for v in res32.values()))
    if tf32:
        tf = bakron.CudaOptions.defaults().with_(tf32=True)
        holder = {}

        def runtf():
            holder["r"] = solve_cuda(W32, AO32, AI32, q, "wavefront", None, t, tf)
            return holder["r"].seconds
        med, _ = timeit(env, runtf, reps)
        v = env.host(holder["r"].values)
        out["tf32"] = {"ms": med * 1e3, "ratio_to_fp32_floor": med / floor,
                       "mismatch_vs_f64": int(np.sum(v != ref.astype(np.float32)))}
        _log(f"  {m}x{n} tf32 wavefront {med * 1e3:9.2f} ms  mismatches vs f64 "
             f"{out['tf32']['mismatch_vs_f64']}")
    # auto, end to end through bakron.solve
    holder = {}

    def runauto():
        holder["r"] = bakron.solve(W32, AO32, AI32, q, tile=t)
    med, _ = timeit(env, runauto, max(1, reps // 2))
    out["auto"] = {"method": holder["r"].method, "engine": holder["r"].engine,
                   "wall_ms": med * 1e3, "solver_ms": holder["r"].seconds * 1e3}
    return out


# ------------------------------------------------------------------------------------------
def write_page(results, path_md, path_png, command, pytest_line, meta):
    sizes = results
    L = []
    L.append("# GPU benchmark: NVIDIA H200 (cuda engine)\n")
    L.append("Produced by one run of `python -m bakron.benchmarks.gpu` on the device machine; "
             "every number below comes from that run (medians of the solver time of repeated "
             "`bakron.solve(..., engine=\"cuda\")` calls, device synchronised; ratios to the "
             "floor product timed in the same run).\n")
    L.append("## How it was run\n")
    L.append("```\n" + command + "\n```\n")
    L.append(f"- machine: {meta.get('gpu')}, {meta.get('sms')} SMs; cupy {meta.get('cupy')}, "
             f"numba {meta.get('numba')}, numba-cuda {meta.get('numba_cuda')}, numpy "
             f"{meta.get('numpy')}, Python {meta.get('python')}")
    L.append(f"- kernel launch mode `{meta.get('launch')}`, register cap {meta.get('maxreg')}, "
             f"cooperative grid {meta.get('grid')} CTAs of {meta.get('threads')} threads; "
             f"kernel build (compile) {meta.get('build_s', 0):.1f} s")
    L.append("- problem: W ~ N(0,1), H_in/H_out = X Xᵀ/k (k = n/2) prepared on the GPU with "
             "`prepare_factor` (damping 0.01), float32 without TF32, tile 16×16, 2-bit "
             "symmetric grid with per-row RMS scales, `engine=\"cuda\"`")
    L.append("")
    L.append("## Checks (same run)\n")
    if pytest_line:
        L.append(f"- GPU tests (reference cases exact in float64 for every method and base, "
                 f"hypothesis properties against the CPU array-API path): `{pytest_line}`")
    L.append(f"- at every benchmark size the three methods give identical Ŵ in float64: "
             f"**{all(r['f64_identical'] for r in sizes)}**\n")
    L.append("## Float32 (no TF32): time and ratio to the floor product\n")
    L.append("| size | floor `G_Oᵀ W G_I` | wavefront | recursive | anti-diagonal (1 launch) | "
             "best / target | speed-up of best over anti-diagonal | exllamav3 (for "
             "orientation) |")
    L.append("|---|---|---|---|---|---|---|---|")
    for r in sizes:
        key = (r["m"], r["n"])
        f = r["f32"]
        best = min(METHODS, key=lambda k: f[k]["ms"])
        tgt = TARGET_MS.get(key)
        verdict = "–" if tgt is None else (f"{f[best]['ms']:.2f} ms ≤ {tgt:g} ms: **met**"
                                           if f[best]["ms"] <= tgt else
                                           f"{f[best]['ms']:.2f} ms > {tgt:g} ms: **missed**")
        anchor = ANCHORS.get(key)
        L.append(f"| {r['m']}×{r['n']} | {r['floor_ms']:.2f} ms ({r['floor_tflops']:.0f} TFLOP/s) | "
                 + " | ".join(f"{f[k]['ms']:.2f} ms ({f[k]['ratio']:.1f}×)" for k in METHODS)
                 + f" | {best}: {verdict} | {f['antidiagonal']['ms'] / f[best]['ms']:.1f}× | "
                 + (f"{anchor:g} ms" if anchor else "–") + " |")
    L.append("\n(ratio = time ÷ floor product in the same run.)\n")
    if any(len(r["f32"]) > len(METHODS) for r in sizes):
        L.append("### Base-block size (tiles per side), float32\n")
        keys = sorted({k for r in sizes for k in r["f32"] if "/" in k})
        L.append("| size | wavefront/16 (default) | recursive/16 (default) | "
                 + " | ".join(keys) + " |")
        L.append("|---|---|---|" + "---|" * len(keys))
        for r in sizes:
            if not any("/" in k for k in r["f32"]):
                continue
            L.append(f"| {r['m']}×{r['n']} | {r['f32']['wavefront']['ms']:.2f} | "
                     f"{r['f32']['recursive']['ms']:.2f} | "
                     + " | ".join(f"{r['f32'][k]['ms']:.2f}" if k in r["f32"] else "–"
                                  for k in keys) + " |")
        L.append("")
    L.append("## Float64\n")
    L.append("| size | " + " | ".join(METHODS) + " |")
    L.append("|---|" + "---|" * len(METHODS))
    for r in sizes:
        L.append(f"| {r['m']}×{r['n']} | "
                 + " | ".join(f"{r['f64'][k]['ms']:.2f} ms" for k in METHODS) + " |")
    L.append("")
    if any("tf32" in r for r in sizes):
        L.append("## TF32 (wavefront; cuBLAS TF32 tensor-core GEMMs)\n")
        L.append("| size | TF32 time | float32 time | Ŵ entries ≠ float64: TF32 | "
                 "Ŵ entries ≠ float64: float32 |")
        L.append("|---|---|---|---|---|")
        for r in sizes:
            if "tf32" in r:
                L.append(f"| {r['m']}×{r['n']} | {r['tf32']['ms']:.2f} ms | "
                         f"{r['f32']['wavefront']['ms']:.2f} ms | "
                         f"{r['tf32']['mismatch_vs_f64']} of {r['m'] * r['n']} | "
                         f"{r['f32_mismatch_vs_f64']['wavefront']} |")
        L.append("")
    L.append("## Peak device memory (float32)\n")
    L.append("Peak bytes in cupy's pool during one solve, above what was allocated before it "
             "(inputs and prepared factors); then, in units of m·n elements, what remains after "
             "subtracting the solver's working-dtype copies of the factors (`Problem` casts "
             "them) and the outputs Ŵ and codes. Target: ≤ 4·m·n.\n")
    L.append("| size | " + " | ".join(METHODS) + " |")
    L.append("|---|" + "---|" * len(METHODS))
    for r in sizes:
        L.append(f"| {r['m']}×{r['n']} | " + " | ".join(
            f"{r['mem'][k]['peak_extra_bytes'] / 2**20:.0f} MiB "
            f"({r['mem'][k]['beyond_factors_outputs_mn']:.2f}·mn)" for k in METHODS) + " |")
    L.append("")
    L.append("## `method=\"auto\"` end to end (`bakron.solve`, validation included)\n")
    L.append("| size | picked | wall time of `bakron.solve` | solver time |")
    L.append("|---|---|---|---|")
    for r in sizes:
        a = r["auto"]
        L.append(f"| {r['m']}×{r['n']} | {a['engine']}/{a['method']} | {a['wall_ms']:.2f} ms | "
                 f"{a['solver_ms']:.2f} ms |")
    L.append("")
    L.append("## Float32 agreement\n")
    L.append("Entries of Ŵ (float32) that differ from the float64 result, per method (near-ties "
             "flip and the flip propagates; docs/algorithm.md, \"float32\"):\n")
    L.append("| size | " + " | ".join(METHODS) + " |")
    L.append("|---|" + "---|" * len(METHODS))
    for r in sizes:
        L.append(f"| {r['m']}×{r['n']} | " + " | ".join(
            str(r["f32_mismatch_vs_f64"][k]) for k in METHODS) + " |")
    L.append("")
    if path_png:
        L.append(f"![time vs size]({os.path.basename(path_png)})\n")
    pathlib.Path(path_md).write_text("\n".join(L) + "\n")


def plot(results, path_png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [2.0 * r["m"] * r["n"] * (r["m"] + r["n"]) / 1e9 for r in results]
    lab = [f"{r['m']}×{r['n']}" for r in results]
    order = np.argsort(x)
    xs = [x[i] for i in order]
    for k, mk in zip(METHODS, "osd"):
        ax.plot(xs, [results[i]["f32"][k]["ms"] for i in order], marker=mk, label=k)
    ax.plot(xs, [results[i]["floor_ms"] for i in order], "k--", label="floor G_Oᵀ W G_I")
    for xi, i in zip(xs, order):
        ax.annotate(lab[i], (xi, results[i]["floor_ms"]), fontsize=7, rotation=30,
                    textcoords="offset points", xytext=(0, -14))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("floor product work 2mn(m+n) [GFLOP]")
    ax.set_ylabel("time [ms] (median, float32)")
    ax.set_title("bakron cuda engine on an H200 (tile 16, 2-bit)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/benchmarks", help="folder for h200.md/png/json")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tf32", action="store_true", help="also time TF32 GEMMs")
    ap.add_argument("--tuning", action="store_true", help="also time base sizes 8 and 32")
    ap.add_argument("--sizes", default="", help="e.g. 1024x1024,4096x11008")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (simulator-friendly)")
    ap.add_argument("--pytest-log", default="", help="pytest output whose summary line to quote")
    ap.add_argument("--name", default="h200")
    a = ap.parse_args(argv)
    command = "python -m bakron.benchmarks.gpu " + " ".join(
        argv if argv is not None else sys.argv[1:])
    env = Env()
    NC = env.NC
    meta = {"python": platform.python_version(), "numpy": np.__version__,
            "launch": NC.launch_mode(NC.defaults(NC.CudaOptions)),
            "maxreg": NC.defaults(NC.CudaOptions).maxreg}
    import numba
    meta["numba"] = numba.__version__
    try:
        import importlib.metadata as im
        meta["numba_cuda"] = im.version("numba-cuda")
    except Exception:
        meta["numba_cuda"] = "?"
    if not env.sim:
        cp = env.cp
        meta["cupy"] = cp.__version__
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        meta["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        meta["sms"] = props["multiProcessorCount"]
    else:
        meta.update(cupy="-", gpu="simulator", sms=1)
    t0 = time.perf_counter()
    NC.warm_up(tiles=((16, 16),))
    meta["build_s"] = time.perf_counter() - t0
    _log(f"build (kernel compile) {meta['build_s']:.1f} s")
    if a.smoke:
        sizes = [(48, 64), (64, 40)]
    elif a.sizes:
        sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    else:
        sizes = SIZES
    results = []
    for m, n in sizes:
        t0 = time.perf_counter()
        results.append(bench_size(env, m, n, reps=2 if a.smoke else a.reps, tf32=a.tf32,
                                  tuning=a.tuning and (m, n) in ((1024, 1024), (4096, 4096),
                                                               (4096, 11008), (48, 64))))
        _log(f"size {m}x{n} done in {time.perf_counter() - t0:.1f} s")
        pathlib.Path(a.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(a.out) / f"{a.name}.partial.json").write_text(
            json.dumps(results, indent=1, default=str))
    try:
        kern, nt = NC.kernel_variant("float32", 16, 16, False, True)
        meta["threads"] = nt
        meta["grid"] = NC._MAXGRID.get(NC.grid_key("float32", 16, 16, False, True, 0), "?")
    except Exception:
        pass
    pytest_line = ""
    if a.pytest_log and os.path.exists(a.pytest_log):
        lines = [ln.strip() for ln in open(a.pytest_log).read().splitlines() if ln.strip()]
        cand = [ln for ln in lines if (" passed" in ln or " failed" in ln) and " in " in ln]
        pytest_line = cand[-1] if cand else (lines[-1] if lines else "")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(
        {"meta": meta, "results": results,
         "command": command, "pytest": pytest_line}, indent=1, default=str))
    png = str(out / f"{a.name}.png")
    try:
        plot(results, png)
    except Exception as exc:  # no matplotlib: the page still gets written
        _log("plot failed:", exc)
        png = ""
    write_page(results, out / f"{a.name}.md", png, command, pytest_line, meta)
    _log("")
    _log("size         floor    wavefront  recursive  antidiag   (ms, float32)")
    for r in results:
        f = r["f32"]
        _log(f"{r['m']}x{r['n']:<7d} {r['floor_ms']:8.2f} {f['wavefront']['ms']:10.2f} "
             f"{f['recursive']['ms']:10.2f} {f['antidiagonal']['ms']:10.2f}")
    ok = all(r["f64_identical"] for r in results)
    _log("CHECKS", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
