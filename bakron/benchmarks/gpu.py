"""GPU benchmark of the cuda engine: build, time, write its section of docs/benchmarks/gpu.md.

Run on a machine with a CUDA GPU, cupy and numba-cuda::

    python -m bakron.benchmarks.gpu --out DIR [--pytest-log LOG] [--tf32]

writes the results ``DIR/data/gpu.json``, the plot ``DIR/gpu.png`` and the generated section
of the page ``DIR/gpu.md`` (``bakron.benchmarks._page``: the rest of an existing page is
kept; a new page gets the section alone). ``--render DIR/data/gpu.json --out docs/benchmarks``
rewrites the section of the project's page from such a JSON without measuring (copy the plot
and the JSON along).

In one run it (1) compiles the kernels, (2) times every method through ``bakron.solve`` at
1024², 2048², 4096², 4096×11008 and 11008×4096 (float32 without TF32, tile 16, 2-bit per-row
grid; medians of the solver time ``SolveResult.seconds``, device synchronised; ratios to the
floor product ``G_Oᵀ W G_I`` timed in the same run), the float64 times (and whether the methods
agree exactly), TF32 (with its mismatch count against float64) and the peak device memory, and
(3) writes the results, the page's section and the plot. The correctness checks are the GPU tests
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
import textwrap
import time

import numpy as np

import bakron
from bakron import _xp
from bakron._lib.fs import atomic_path, atomic_write_json

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
#: the command whose summary line ``--pytest-log`` quotes
PYTEST_COMMAND = "python -m pytest -q -m gpu tests"
#: the page, its section, the results JSON (under ``--out``) and the plot
PAGE, SECTION, DATA, PLOT = "gpu.md", "gpu", os.path.join("data", "gpu.json"), "gpu.png"


def _size(r) -> str:
    return f"{r['m']}×{r['n']}"


def section(data: dict) -> str:
    """The page's generated section ("Single layers" to "Float32 agreement") from a run's
    results JSON (what :func:`main` writes to ``data/gpu.json``)."""
    from ._page import page_command

    meta, sizes = data["meta"], data["results"]
    L = ["## Single layers\n"]
    host = f" {meta['host']}" if meta.get("host") else ""
    L.append(f"Measured on {meta.get('date', '?')}. Machine: one {meta.get('gpu')} "
             f"({meta.get('sms')} SMs){host}; cupy {meta.get('cupy')}, numba "
             f"{meta.get('numba')}, numba-cuda {meta.get('numba_cuda')}, numpy "
             f"{meta.get('numpy')}, Python {meta.get('python')}. Kernel launch mode "
             f"`{meta.get('launch')}`, register cap {meta.get('maxreg')}, cooperative grid of "
             f"{meta.get('grid')} CTAs of {meta.get('threads')} threads. Problem: W ~ N(0,1), "
             "H_in/H_out = X Xᵀ/k (k = n/2) prepared on the GPU with `prepare_factor` "
             "(damping 0.01), tile 16 × 16, 2-bit symmetric grid with per-row RMS scales, "
             "`engine=\"cuda\"`; times are medians of the solver time of repeated "
             "`bakron.solve` calls, device synchronised. "
             + ("Commands:\n" if data.get("pytest") else "Command:\n"))
    L.append("```bash\n" + (PYTEST_COMMAND + "\n" if data.get("pytest") else "")
             + page_command(data["command"]) + "\n```\n")
    same = all(r["f64_identical"] for r in sizes)
    checks = []
    if data.get("pytest"):
        checks.append("the GPU tests ran (reference cases exact in float64 for every method "
                      "and base, hypothesis properties against the CPU array-API path: "
                      f"{data['pytest']})")
    checks.append("at every size the three methods gave " + ("identical" if same else
                  "**different**") + " Ŵ in float64")
    L.append("In the same run " + ", and ".join(checks) + ".\n")
    auto = ", ".join(f"{r['f32']['wavefront']['ms']:.2f} ms at {_size(r)}" for r in sizes)
    extra = [r["auto"]["wall_ms"] - r["auto"]["solver_ms"] for r in sizes]
    tf = [r for r in sizes if "tf32" in r]
    L.append(f"In short: the wavefront takes {auto} in float32 without TF32"
             + (" (with TF32: " + ", ".join(f"{r['tf32']['ms']:.2f} ms at {_size(r)}"
                                            for r in tf) + ")" if tf else "")
             + f". The whole `bakron.solve` call (`method=\"auto\"`, input checks included) "
             f"adds {min(extra):.1f}–{max(extra):.1f} ms to the solver time (the end-to-end "
             "table below).\n")
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
        L.append(f"| {_size(r)} | {r['floor_ms']:.2f} ms ({r['floor_tflops']:.0f} TFLOP/s) | "
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
            L.append(f"| {_size(r)} | {r['f32']['wavefront']['ms']:.2f} | "
                     f"{r['f32']['recursive']['ms']:.2f} | "
                     + " | ".join(f"{r['f32'][k]['ms']:.2f}" if k in r["f32"] else "–"
                                  for k in keys) + " |")
        L.append("")
    L.append("## Float64\n")
    L.append("| size | " + " | ".join(METHODS) + " |")
    L.append("|---|" + "---|" * len(METHODS))
    for r in sizes:
        L.append(f"| {_size(r)} | "
                 + " | ".join(f"{r['f64'][k]['ms']:.2f} ms" for k in METHODS) + " |")
    L.append("")
    if tf:
        L.append("## TF32 (wavefront; cuBLAS TF32 tensor-core GEMMs)\n")
        L.append("| size | TF32 time | float32 time | Ŵ entries ≠ float64: TF32 | "
                 "Ŵ entries ≠ float64: float32 |")
        L.append("|---|---|---|---|---|")
        for r in tf:
            L.append(f"| {_size(r)} | {r['tf32']['ms']:.2f} ms | "
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
        L.append(f"| {_size(r)} | " + " | ".join(
            f"{r['mem'][k]['peak_extra_bytes'] / 2**20:.0f} MiB "
            f"({r['mem'][k]['beyond_factors_outputs_mn']:.2f}·mn)" for k in METHODS) + " |")
    L.append("")
    if any(r["mem"][k]["beyond_factors_outputs_mn"] < 0 for r in sizes for k in METHODS):
        L.append("(Negative entries: the pool's peak rose by less than the copies and outputs "
                 "that the formula subtracts, presumably because blocks freed by the previous "
                 "solve were reused.)\n")
    L.append("## `method=\"auto\"` end to end (`bakron.solve`, validation included)\n")
    L.append("| size | picked | wall time of `bakron.solve` | solver time |")
    L.append("|---|---|---|---|")
    for r in sizes:
        a = r["auto"]
        L.append(f"| {_size(r)} | {a['engine']}/{a['method']} | {a['wall_ms']:.2f} ms | "
                 f"{a['solver_ms']:.2f} ms |")
    L.append("")
    L.append("## Float32 agreement\n")
    L.append("Entries of Ŵ (float32) that differ from the float64 result, per method (near-ties "
             "flip and the flip propagates; {doc}`../algorithm`, \"float32\"):\n")
    L.append("| size | " + " | ".join(METHODS) + " |")
    L.append("|---|" + "---|" * len(METHODS))
    for r in sizes:
        L.append(f"| {_size(r)} | " + " | ".join(
            str(r["f32_mismatch_vs_f64"][k]) for k in METHODS) + " |")
    L.append("")
    L.append(f"The results of the run: `{DATA}`"
             + (f" ({data['source']})" if data.get("source") else "") + ".\n")
    L.append(f"![time against size]({PLOT})")
    return "\n".join(_wrap(x) for x in L)


def _wrap(block: str) -> str:
    """A paragraph of the page in lines of at most 95 characters (tables, headings, code and
    images as they are)."""
    if block.startswith(("|", "#", "`", "!", "(")) and not block.startswith("(Negative"):
        return block
    start = "\n" if block.startswith("\n") else ""
    end = "\n" if block.endswith("\n") else ""
    return start + textwrap.fill(block.strip(), 95, break_long_words=False,
                                 break_on_hyphens=False) + end


def write_page(data: dict, out) -> str:
    """Write the section of ``out/gpu.md`` from ``data`` (the results JSON); returns the
    page's path."""
    from ._page import write_section
    return write_section(os.path.join(out, PAGE), SECTION, section(data),
                         title="GPU benchmarks")


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
    with atomic_path(path_png) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def _plot_quietly(results, path):
    try:
        plot(results, path)
    except Exception as exc:  # no matplotlib: the page still gets written
        _log("plot failed:", exc)


def _host() -> str:
    """The host of the run in words: its CPU, the cores this process may use, the load."""
    from .cpu import cpu_name
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = (f", the run on cores {cores[0]}–{cores[-1]}" if cores and
              len(cores) < (os.cpu_count() or 0) and cores == list(range(cores[0], cores[-1] + 1))
              else "")
    return (f"on a host with {os.cpu_count()} cores ({cpu_name()}){pinned}, load average "
            f"{os.getloadavg()[0]:.1f} at the start")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/benchmarks",
                    help=f"folder of the page {PAGE} (its section is rewritten, the rest kept), "
                         f"the plot {PLOT} and the results {DATA}")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tf32", action="store_true", help="also time TF32 GEMMs")
    ap.add_argument("--tuning", action="store_true", help="also time base sizes 8 and 32")
    ap.add_argument("--sizes", default="", help="e.g. 1024x1024,4096x11008")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (simulator-friendly)")
    ap.add_argument("--pytest-log", default="", help="pytest output whose summary line to quote")
    ap.add_argument("--render", default="", metavar="JSON",
                    help="measure nothing: rewrite the page's section in --out from a results "
                         "JSON that an earlier run wrote (the plot stays as that run drew it)")
    a = ap.parse_args(argv)
    if a.render:
        with open(a.render, encoding="utf-8") as fh:
            data = json.load(fh)
        _log("wrote", write_page(data, a.out))
        return 0
    command = "python -m bakron.benchmarks.gpu " + " ".join(
        argv if argv is not None else sys.argv[1:])
    from ._page import today
    env = Env()
    NC = env.NC
    meta = {"date": today(), "host": _host(), "python": platform.python_version(),
            "numpy": np.__version__,
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
    out = pathlib.Path(a.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    partial = out / "data" / "gpu.partial.json"
    results = []
    for m, n in sizes:
        t0 = time.perf_counter()
        results.append(bench_size(env, m, n, reps=2 if a.smoke else a.reps, tf32=a.tf32,
                                  tuning=a.tuning and (m, n) in ((1024, 1024), (4096, 4096),
                                                               (4096, 11008), (48, 64))))
        _log(f"size {m}x{n} done in {time.perf_counter() - t0:.1f} s")
        atomic_write_json(partial, results)    # what is measured so far, should a size fail
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
    data = {"meta": meta, "results": results, "command": command, "pytest": pytest_line}
    atomic_write_json(out / DATA, data)
    os.unlink(partial)
    _plot_quietly(results, out / PLOT)
    _log("wrote", write_page(data, out), "and", out / DATA)
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
