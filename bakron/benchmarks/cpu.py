"""CPU benchmark of the solvers: ``python -m bakron.benchmarks.cpu`` (``bakron bench`` in the
CLI, ``python -m bakron.bench``).

Measures, in one run and on the same inputs:

* the floor product ``G_Oᵀ W G_I`` (numpy, same dtype): what any exact method pays;
* every method's median time and its ratio to that floor: ``recursive`` (numba engine),
  ``antidiagonal`` accumulator and direct variants (numba engine, each as fast as it can be
  made: fused compiled kernels, parallel over the tiles of a diagonal or BLAS per tile), and
  the array-API engine's recursive solver for reference;
* the speed-up of the recursive solver over both anti-diagonal variants;
* the one-sided solver (``A_out=None``, tile ``(16, 1)``: GPTQ's column-by-column rule) against
  a classic lazy-batch GPTQ loop (block 128, numpy) on the same inputs — the two give the same
  Ŵ, which is checked.

and writes its section of the page ``cpu.md`` (date, machine, command, the tables, fitted
slopes; ``bakron.benchmarks._page``: the rest of the page is kept), ``cpu.png`` (log-log time
against size) and the results ``data/cpu.json`` to the output directory (default
``docs/benchmarks``). ``--threads`` writes the section ``cpu-threads`` of the same page
instead; ``--render data/cpu.json`` (or ``data/cpu-threads.json``) rewrites a section from a
stored run without measuring.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

import numpy as np

from ..solvers.options import environment

#: the engines' options of every solve of this run (``--option``; ``bakron.solve(options=)``)
_OPTIONS: tuple = ()


def options_for(engine: str):
    """This run's options object of ``engine`` (``--option``, else the defaults)."""
    from bakron.solvers.options import OPTION_CLASSES, pick

    return pick(_OPTIONS, OPTION_CLASSES[engine])

__all__ = ["main", "gptq_loop", "floor_product", "make_problem", "cpu_methods",
           "parse_threads_table"]

#: the project's targets: recursive time / floor, per size (float32, tile 16, 2 bits)
TARGETS = {1024: 3.0, 2048: 2.5}


def make_problem(n_rows: int, n_cols: int, tile=(16, 16), dtype=np.float32, seed: int = 0):
    """Weights and K-FAC-like factors (Wishart Hessians, prepared as by quantize_layer)."""
    import bakron

    rng = np.random.default_rng(seed)
    W = rng.standard_normal((n_rows, n_cols))
    X = rng.standard_normal((n_cols, n_cols + 64))
    Y = rng.standard_normal((n_rows, n_rows + 64))
    H_in = X @ X.T / X.shape[1]
    H_out = Y @ Y.T / Y.shape[1]
    f_in = bakron.prepare_factor(H_in, tile[1])
    f_out = bakron.prepare_factor(H_out, tile[0])
    f_in1 = bakron.prepare_factor(H_in, 1)
    return dict(W=W.astype(dtype), A_out=f_out.A.astype(dtype), A_in=f_in.A.astype(dtype),
                A_in1=f_in1.A.astype(dtype), H_in=f_in1.H, H_out=f_out.H)


def floor_product(G_out, W, G_in):
    """The floor: ``G_Oᵀ W G_I``, two dense GEMMs."""
    return G_out.T @ W @ G_in


def gptq_loop(W, U, quantizer, block: int = 128):
    """Classic lazy-batch GPTQ (first column first): ``U`` is the upper Cholesky factor of
    ``H⁻¹``; within a block of columns, rank-1 updates after each column; after the block, one
    GEMM pushes its scaled errors to the remaining columns. Returns Ŵ."""
    W = np.array(W, copy=True)
    m, n = W.shape
    Q = np.zeros_like(W)
    zero = np.zeros(1, dtype=np.int64)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1 = W[:, i1:i2].copy()
        Err1 = np.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            v, _ = quantizer.quantize(w[None, :, None], rows=zero, cols=np.array([i1 + i]))
            q = v[0, :, 0]
            Q[:, i1 + i] = q
            err = (w - q) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return Q


def interleaved(fns: dict, repeats: int, budget: float) -> dict:
    """Wall times of every callable over ``repeats`` rounds, interleaved (each round runs
    each one once, after one warm-up call each), so that a change of the machine's load hits
    all entries alike; an entry stops after ``budget`` seconds in all. ``None`` entries are
    skipped."""
    fns = {k: f for k, f in fns.items() if f is not None}
    for f in fns.values():
        f()  # warm: allocations, caches, first-call costs
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            if sum(times[k]) > budget:
                continue
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``), else what :mod:`platform` says."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu


def _machine() -> str:
    import numba

    cpu = cpu_name()
    from bakron.backends import _numba_kernels

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),)
    blas_threads = environment("OPENBLAS_NUM_THREADS") or "default"
    # how long OpenBLAS's idle threads spin before they sleep: they take cores from numba's
    # threads after every threaded BLAS call (docs/engines.md, "Many cores")
    timeout = environment("OPENBLAS_THREAD_TIMEOUT") or "default"
    return (f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, numpy "
            f"{np.__version__}, numba {numba.__version__} ({numba.get_num_threads()} threads), "
            f"BLAS: {_numba_kernels.BLAS}, OPENBLAS_NUM_THREADS={blas_threads}, "
            f"OPENBLAS_THREAD_TIMEOUT={timeout}; load average at start {load[0]:.1f}")


def _fit_slope(sizes, times):
    s = [(np.log(a), np.log(b)) for a, b in zip(sizes, times) if b is not None]
    if len(s) < 2:
        return None
    x, y = np.array(s).T
    return float(np.polyfit(x, y, 1)[0])


def run(sizes, repeats=5, dtype="float32", tile=16, bits=2, direct_max=1024,
        array_api_max=1024, gptq_max=4096, budget=60.0, log=print):
    """Run the benchmark; returns a list of per-size rows (dicts of seconds)."""
    import bakron
    from bakron.backends import numba_cpu

    dt = np.dtype(dtype)
    numba_cpu.warm_up()
    rows = []
    for n in sizes:
        P = make_problem(n, n, (tile, tile), dt)
        W, AO, AI = P["W"], P["A_out"], P["A_in"]
        q = bakron.UniformQuantizer.fit(W, bits)
        GO = np.eye(n, dtype=dt) + AO
        GI = np.eye(n, dtype=dt) + AI
        row = {"n": n}

        def solve(method, variant="accumulator", engine="numba", A_out=AO, A_in=AI, t=tile):
            return bakron.solve(W, A_out, A_in, q, tile=t, method=method, variant=variant,
                                engine=engine, options=_OPTIONS)

        cases = [("floor", lambda: floor_product(GO, W, GI)),
                 ("recursive", lambda: solve("recursive")),
                 ("antidiagonal_acc", lambda: solve("antidiagonal")),
                 ("antidiagonal_direct", (lambda: solve("antidiagonal", "direct"))
                  if n <= direct_max else None),
                 ("recursive_array_api", (lambda: solve("recursive", engine="array_api"))
                  if n <= array_api_max else None),
                 ("one_sided", lambda: solve("recursive", A_out=None, A_in=P["A_in1"],
                                             t=(tile, 1))),
                 ]
        Hr = P["H_in"][::-1, ::-1]
        U = np.linalg.cholesky(np.linalg.inv(Hr)).T.astype(dt)
        Wr = np.ascontiguousarray(W[:, ::-1])
        cases.append(("gptq_loop", (lambda: gptq_loop(Wr, U, q)) if n <= gptq_max else None))
        times = interleaved(dict(cases), repeats, budget)
        for name, fn in cases:
            ts = times.get(name)
            row[name] = None if not ts else float(np.median(ts))
            if ts:
                log(f"  {n:5d}  {name:20s} {row[name] * 1e3:10.1f} ms  ({len(ts)} runs)")
        # the one-sided solver and the GPTQ loop solve the same problem: check it
        if row["gptq_loop"] is not None:
            ours = solve("recursive", A_out=None, A_in=P["A_in1"], t=(tile, 1)).values
            theirs = gptq_loop(Wr, U, q)[:, ::-1]
            row["gptq_agree"] = float(np.mean(ours == theirs))
        rows.append(row)
    return rows


def run_shapes(shapes, repeats=2, dtype="float32", tile=16, bits=2, budget=60.0, log=print):
    """Rectangular shapes (e.g. the MLP layers 4096 x 11008 and 11008 x 4096): the floor and
    the recursive solver only (the baselines would take minutes each)."""
    import bakron

    dt = np.dtype(dtype)
    rows = []
    for m, n in shapes:
        rng = np.random.default_rng(0)
        W = rng.standard_normal((m, n)).astype(dt)

        def factor(k):  # low rank + identity: cheap to form at these sizes
            X = rng.standard_normal((k, 256))
            return bakron.prepare_factor(X @ X.T / 256 + np.eye(k), tile).A.astype(dt)

        AI, AO = factor(n), factor(m)
        q = bakron.UniformQuantizer.fit(W, bits)
        GO = np.eye(m, dtype=dt) + AO
        GI = np.eye(n, dtype=dt) + AI
        row = {"shape": (m, n)}
        times = interleaved({"floor": lambda: floor_product(GO, W, GI),
                              "recursive": lambda: bakron.solve(W, AO, AI, q, tile=tile,
                                                                method="recursive",
                                                                engine="numba",
                                                                options=_OPTIONS)},
                             repeats, budget)
        for name, ts in times.items():
            row[name] = float(np.median(ts))
            log(f"  {m}x{n}  {name:20s} {row[name] * 1e3:10.1f} ms  ({len(ts)} runs)")
        rows.append(row)
        del GO, GI, AO, AI, W
    return rows


def _fmt_ms(x):
    return "—" if x is None else (f"{x * 1e3:.1f}" if x < 10 else f"{x:.2f} s")


def _ratio(a, b, unit=""):
    return "—" if a is None or b is None else f"{a / b:.2f}{unit}"


#: the page of both modes and their sections (``bakron.benchmarks._page``)
PAGE, SECTION, THREADS_SECTION = "cpu.md", "cpu", "cpu-threads"


def write_report(rows, out_dir, command, machine, dtype, tile, bits, repeats, shape_rows=()):
    """Write the results ``data/cpu.json``, the plot ``cpu.png`` and the section ``cpu`` of
    the page ``cpu.md`` in ``out_dir`` (the rest of the page kept)."""
    from bakron._lib.fs import atomic_write_json

    from ._page import today
    data = {"date": today(), "command": command, "machine": machine, "dtype": dtype,
            "tile": tile, "bits": bits, "repeats": repeats, "rows": rows,
            "shape_rows": [dict(r, shape=list(r["shape"])) for r in shape_rows]}
    os.makedirs(os.path.join(out_dir, "data"), exist_ok=True)
    atomic_write_json(os.path.join(out_dir, "data", "cpu.json"), data)
    try:
        _plot(rows, os.path.join(out_dir, "cpu.png"), dtype, tile, bits)
        plotted = True
    except ImportError:
        plotted = False
        print("bakron bench: matplotlib is not installed: no cpu.png", file=sys.stderr)
    from ._page import write_section
    return write_section(os.path.join(out_dir, PAGE), SECTION, report_section(data, plotted),
                         title="CPU benchmarks")


def report_section(data: dict, plotted: bool = True) -> str:
    """The section ``cpu`` of the page from a run's results (``data/cpu.json``)."""
    from ._page import page_command

    rows, shape_rows = data["rows"], data["shape_rows"]
    lines = [
        f"Measured on {data['date']}. Machine: {data['machine']}. dtype {data['dtype']}, tile "
        f"{data['tile']} × {data['tile']}, {data['bits']}-bit grid (per-row RMS scales), "
        f"Wishart Hessians; medians of up to {data['repeats']} runs per entry, interleaved "
        "round by round with the floor. Command:", "",
        f"```bash\n{page_command(data['command'])}\n```", "", "Times in ms:", "",
        "| n × n | floor `G_Oᵀ W G_I` | recursive | ÷ floor | target | anti-diag acc. | "
        "÷ floor | rec. speed-up | anti-diag direct | rec. speed-up | recursive (array API) | "
        "one-sided (t=16×1) | GPTQ loop (block 128) | GPTQ ÷ one-sided |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        f = r["floor"]
        tgt = TARGETS.get(r["n"])
        ratio = r["recursive"] / f
        met = "" if tgt is None else (f"≤ {tgt} {'met' if ratio <= tgt else 'missed'}")
        lines.append(
            f"| {r['n']} | {_fmt_ms(f)} | {_fmt_ms(r['recursive'])} | {ratio:.2f} | {met} | "
            f"{_fmt_ms(r['antidiagonal_acc'])} | {_ratio(r['antidiagonal_acc'], f)} | "
            f"{_ratio(r['antidiagonal_acc'], r['recursive'], '×')} | "
            f"{_fmt_ms(r['antidiagonal_direct'])} | "
            f"{_ratio(r['antidiagonal_direct'], r['recursive'], '×')} | "
            f"{_fmt_ms(r['recursive_array_api'])} | {_fmt_ms(r['one_sided'])} | "
            f"{_fmt_ms(r['gptq_loop'])} | {_ratio(r['gptq_loop'], r['one_sided'], '×')} |")
    if shape_rows:
        lines += ["", "Rectangular (MLP) shapes, recursive solver only:", "",
                  "| m × n | floor `G_Oᵀ W G_I` | recursive | ÷ floor |", "|---|---:|---:|---:|"]
        for r in shape_rows:
            m, n = r["shape"]
            lines.append(f"| {m} × {n} | {_fmt_ms(r['floor'])} | {_fmt_ms(r['recursive'])} | "
                         f"{r['recursive'] / r['floor']:.2f} |")
    sizes = [r["n"] for r in rows]
    slopes = [(label, _fit_slope(sizes, [r.get(key) for r in rows])) for key, label in _SERIES]
    slopes = [f"{label} {v:.2f}" for label, v in slopes if v is not None]
    if slopes:
        lines += ["", "Fitted slopes of log time against log n (square n × n; the floor and "
                  "every exact method are O(n³) but for the direct anti-diagonal, O(n⁴)): "
                  + ", ".join(slopes) + "."]
    agree = [r.get("gptq_agree") for r in rows if r.get("gptq_agree") is not None]
    if agree:
        lines += ["", f"The one-sided solver and the GPTQ loop (on the column-reversed problem, "
                  f"GPTQ's first-to-last order) agree on {min(agree) * 100:.2f} % or more of the "
                  f"entries at every size (float32 near-ties aside they are the same rule)."]
    lines += ["", "![time against size](cpu.png)" if plotted else
              "(no plot: matplotlib is not installed; pip install 'bakron[bench]')"]
    return "\n".join(_wrap(x) for x in lines)


def _wrap(line: str) -> str:
    """A prose line of a section in lines of at most 95 characters (tables, code and images
    as they are)."""
    import textwrap

    if not line or line.startswith(("|", "`", "!", "#")) or len(line) <= 95:
        return line
    return textwrap.fill(line, 95, break_long_words=False, break_on_hyphens=False)


_SERIES = [("floor", "floor"), ("recursive", "recursive (numba)"),
           ("antidiagonal_acc", "anti-diagonal accumulator"),
           ("antidiagonal_direct", "anti-diagonal direct"),
           ("recursive_array_api", "recursive (array API)"),
           ("one_sided", "one-sided"), ("gptq_loop", "GPTQ loop")]


def _plot(rows, path, dtype, tile, bits):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    sizes = [r["n"] for r in rows]
    for key, label in _SERIES:
        pts = [(n, r.get(key)) for n, r in zip(sizes, rows) if r.get(key) is not None]
        if not pts:
            continue
        x, y = zip(*pts)
        s = _fit_slope(x, y)
        ax.loglog(x, y, "o-" if key != "floor" else "k--",
                  label=f"{label} (slope {s:.2f})" if s is not None else label)
    ax.set_xlabel("n (matrix n × n)")
    ax.set_ylabel("median time [s]")
    ax.set_title(f"bakron on the CPU: {dtype}, tile {tile}, {bits}-bit grid")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    from bakron._lib.fs import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def tune(sizes=(512, 1024, 2048), repeats=5, dtype="float32", log=print) -> str:
    """The measurements behind the numba engine's auto rules (docs/engines.md): base-block
    size per tile, one-sided base size, triangular panel width, and recursive vs
    anti-diagonal on small problems. Every entry is a median ratio to the floor product
    measured alongside (interleaved). Returns a markdown report."""
    import bakron
    from bakron.backends import numba_cpu as nc

    dt = np.dtype(dtype)
    nc.warm_up()
    out = []

    def solver(W, AO, AI, q, tile, **kw):
        return lambda: bakron.solve(W, AO, AI, q, tile=tile, engine="numba", options=_OPTIONS,
                                    **kw)

    # 1. base size (two-sided), tiles 16 and 8
    for t, bases in ((16, (2, 4, 8, 16, 32)), (8, (4, 8, 16, 32, 64))):
        out += [f"### Base size, two-sided, tile {t}x{t} (time ÷ floor)", "",
                "| n | floor ms | " + " | ".join(f"base {b} ({b * t})" for b in bases) + " |",
                "|---:|---:|" + "---:|" * len(bases)]
        for n in sizes:
            P = make_problem(n, n, (t, t), dt)
            W, AO, AI = P["W"], P["A_out"], P["A_in"]
            q = bakron.UniformQuantizer.fit(W, 2)
            cfg = {b: solver(W, AO, AI, q, t, method="recursive", base=b) for b in bases}
            f, r, _ = _interleave(W, AO, AI, cfg, repeats)
            out.append(f"| {n} | {f * 1e3:.1f} | " + " | ".join(f"{r[b]:.2f}" for b in bases)
                       + " |")
            log(out[-1])
        out.append("")
    # 2. panel width of the triangular products
    panels = (64, 128, 256, 1 << 30)
    out += ["### Panel width of the unit-triangular products, tile 16, auto base "
            "(time ÷ floor; 'dense' = no skipping)", "",
            "| n | " + " | ".join("dense" if w == 1 << 30 else str(w) for w in panels) + " |",
            "|---:|" + "---:|" * len(panels)]
    for n in sizes:
        P = make_problem(n, n, (16, 16), dt)
        W, AO, AI = P["W"], P["A_out"], P["A_in"]
        q = bakron.UniformQuantizer.fit(W, 2)

        def with_panel(w):
            o = options_for("numba").with_(panel=w)
            return lambda: bakron.solve(W, AO, AI, q, tile=16, method="recursive",
                                        engine="numba", options=o)
        f, r, _ = _interleave(W, AO, AI, {w: with_panel(w) for w in panels}, repeats)
        out.append(f"| {n} | " + " | ".join(f"{r[w]:.2f}" for w in panels) + " |")
        log(out[-1])
    out.append("")
    # 3. one-sided base size, tile (16, 1) (GPTQ's rule)
    bases = (16, 32, 64, 128, 256)
    out += ["### Base size, one-sided, tile 16x1 (time ÷ one-sided floor `W G_I`)", "",
            "| n | floor ms | " + " | ".join(f"base {b}" for b in bases) + " |",
            "|---:|---:|" + "---:|" * len(bases)]
    for n in sizes:
        P = make_problem(n, n, (16, 1), dt)
        W, AI = P["W"], P["A_in1"]
        q = bakron.UniformQuantizer.fit(W, 2)
        cfg = {b: solver(W, None, AI, q, (16, 1), method="recursive", base=b) for b in bases}
        f, r, _ = _interleave(W, None, AI, cfg, repeats)
        out.append(f"| {n} | {f * 1e3:.1f} | " + " | ".join(f"{r[b]:.2f}" for b in bases) + " |")
        log(out[-1])
    out.append("")
    # 4. small problems: one base block / recursion vs the anti-diagonal kernels
    out += ["### Small problems, tile 16, two-sided: milliseconds", "",
            "| n | recursive (auto base) | anti-diagonal accumulator | anti-diagonal direct |",
            "|---:|---:|---:|---:|"]
    for n in (32, 64, 128, 256):
        P = make_problem(n, n, (16, 16), dt)
        W, AO, AI = P["W"], P["A_out"], P["A_in"]
        q = bakron.UniformQuantizer.fit(W, 2)
        cfg = {"rec": solver(W, AO, AI, q, 16, method="recursive"),
               "acc": solver(W, AO, AI, q, 16, method="antidiagonal"),
               "dir": solver(W, AO, AI, q, 16, method="antidiagonal", variant="direct")}
        f, r, _ = _interleave(W, AO, AI, cfg, max(repeats, 9))
        out.append(f"| {n} | " + " | ".join(f"{r[c] * f * 1e3:.2f}" for c in cfg) + " |")
        log(out[-1])
    out.append("")
    return "\n".join(out)


def _interleave(W, A_out, A_in, configs, repeats):
    """Median time of each config ÷ median floor (``G_Oᵀ W G_I``, or ``W G_I`` one-sided),
    all interleaved so that load changes hit every entry alike."""
    dt = W.dtype
    m, n = W.shape
    GI = np.eye(n, dtype=dt) + A_in
    GO = None if A_out is None else np.eye(m, dtype=dt) + A_out
    floor = (lambda: W @ GI) if GO is None else (lambda: floor_product(GO, W, GI))
    for fn in configs.values():
        fn()
    fl, ts = [], {c: [] for c in configs}
    for _ in range(repeats):
        t0 = time.perf_counter()
        floor()
        fl.append(time.perf_counter() - t0)
        for c, fn in configs.items():
            t0 = time.perf_counter()
            fn()
            ts[c].append(time.perf_counter() - t0)
    f = float(np.median(fl))
    return f, {c: float(np.median(v)) / f for c, v in ts.items()}, None


# -- thread scaling: one fresh process per thread count -------------------------------------

#: sizes of ``--threads`` (default) and of ``--threads --quick``
THREAD_SIZES, THREAD_QUICK_SIZES = (1024, 2048, 4096), (64, 128)
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS",
                "MKL_NUM_THREADS")


def cpu_methods() -> list[tuple[str, str]]:
    """Every (method, variant) the numba CPU engine declares (its ``CAPABILITIES``): a method
    added to the engine is measured without a change here."""
    from bakron.backends import numba_cpu

    caps = numba_cpu.CAPABILITIES
    out = []
    for m in caps.methods:  # variants are the anti-diagonal's (Capabilities.runs)
        for v in (caps.variants if m == "antidiagonal" else ("accumulator",)):
            if caps.runs(m, v):
                out.append((m, v))
    return out


def _method_label(method: str, variant: str) -> str:
    return method if variant == "accumulator" else f"{method}/{variant}"


def thread_child(threads: int, sizes, repeats: int, dtype: str, tile: int, bits: int,
                 direct_max: int, budget: float, methods=None) -> dict:
    """One thread count, in this (fresh) process: the floor and every CPU method per size
    (``methods``: only those labels, e.g. ``["recursive", "wavefront"]``).
    The environment's thread variables were set by the parent before Python started; the
    process pins itself to ``threads`` cores when it may run on that many."""
    pinned = False
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= threads:
            os.sched_setaffinity(0, cores[:threads])
            pinned = True
    import bakron
    from bakron.backends import numba_cpu

    import numba

    numba_cpu.warm_up()
    dt = np.dtype(dtype)
    rows = []
    for n in sizes:
        P = make_problem(n, n, (tile, tile), dt)
        W, AO, AI = P["W"], P["A_out"], P["A_in"]
        q = bakron.UniformQuantizer.fit(W, bits)
        GO, GI = np.eye(n, dtype=dt) + AO, np.eye(n, dtype=dt) + AI
        fns = {"floor": lambda: floor_product(GO, W, GI)}
        for m, v in cpu_methods():
            if v == "direct" and n > direct_max:  # O(n^4): minutes at 4096
                continue
            if methods is not None and _method_label(m, v) not in methods:
                continue
            fns[_method_label(m, v)] = (lambda m=m, v=v: bakron.solve(
                W, AO, AI, q, tile=tile, method=m, variant=v, engine="numba",
                options=_OPTIONS))
        times = interleaved(fns, repeats, budget)
        floor = float(np.median(times["floor"]))
        for name, ts in times.items():
            if name != "floor" and ts:
                rows.append({"threads": threads, "size": n, "method": name,
                             "median": float(np.median(ts)), "floor": floor, "runs": len(ts)})
        del P, W, AO, AI, GO, GI
    return {"threads": threads, "pinned": pinned,
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None, "numba_threads": numba.get_num_threads(),
            "env": {k: environment(k) for k in _THREAD_VARS}, "machine": _machine(),
            "rows": rows}


def run_threads(thread_counts, sizes, *, repeats, dtype, tile, bits, direct_max, budget,
                workdir, methods=None, log=print) -> list[dict]:
    """:func:`thread_child` in a fresh ``python`` per thread count, with
    OPENBLAS/NUMBA/OMP/MKL_NUM_THREADS set to it; their results in order."""
    import subprocess

    results = []
    for t in thread_counts:
        env = dict(os.environ, **{k: str(t) for k in _THREAD_VARS})
        path = os.path.join(workdir, f".threads-{t}.json")
        cmd = [sys.executable, "-m", "bakron.benchmarks.cpu", "--_thread-child", str(t),
               "--_child-out", path, "--sizes", ",".join(map(str, sizes)),
               "--repeats", str(repeats), "--dtype", dtype, "--tile", str(tile),
               "--bits", str(bits), "--direct-max", str(direct_max), "--budget", str(budget)]
        if methods is not None:
            cmd += ["--methods", ",".join(methods)]
        for o in _OPTIONS:
            cmd += [f"--option={a}" for a in _option_args(o)]
        log(f"bakron bench --threads: {t} thread{'s' if t > 1 else ''} (fresh process)")
        p = subprocess.run(cmd, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"the {t}-thread run failed (exit {p.returncode}): "
                               f"{' '.join(cmd)}")
        with open(path) as fh:
            results.append(json.load(fh))
        os.unlink(path)
    return results


def _ms4(seconds: float) -> str:
    """Milliseconds to 4 significant digits (one decimal from 100 ms on)."""
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 100 else f"{ms:.4g}"


THREADS_HEADER = "| threads | size | method | median ms | floor ms | ratio |"


def write_threads_report(results, out_dir, command, dtype, tile, bits, repeats) -> str:
    """Write the results ``data/cpu-threads.json``, the plot ``cpu-threads.png`` and the
    section ``cpu-threads`` of the page ``cpu.md`` in ``out_dir``; returns the page's path."""
    from bakron._lib.fs import atomic_write_json

    from ._page import today, write_section
    data = {"date": today(), "command": command, "dtype": dtype, "tile": tile, "bits": bits,
            "repeats": repeats, "processes": results}
    os.makedirs(os.path.join(out_dir, "data"), exist_ok=True)
    atomic_write_json(os.path.join(out_dir, "data", "cpu-threads.json"), data)
    png = os.path.join(out_dir, "cpu-threads.png")
    try:
        _plot_threads(results, png, dtype, tile, bits)
        plotted = True
    except ImportError:
        plotted = False
        print("bakron bench: matplotlib is not installed: no cpu-threads.png", file=sys.stderr)
    return write_section(os.path.join(out_dir, PAGE), THREADS_SECTION,
                         threads_section(data, plotted), title="CPU benchmarks")


def threads_section(data: dict, plotted: bool = True) -> str:
    """The section ``cpu-threads`` of the page from a run's results
    (``data/cpu-threads.json``)."""
    from ._page import page_command

    results = data["processes"]
    lines = [f"Measured on {data['date']}. dtype {data['dtype']}, tile {data['tile']} × "
             f"{data['tile']}, {data['bits']}-bit grid (per-row RMS scales), Wishart Hessians; "
             f"medians of up to {data['repeats']} runs per entry, interleaved with the floor "
             "`G_Oᵀ W G_I` measured alongside in the same process. Each thread count T runs in "
             "a fresh process with `OPENBLAS_NUM_THREADS`, `NUMBA_NUM_THREADS`, "
             "`OMP_NUM_THREADS` and `MKL_NUM_THREADS` set to T, pinned to T cores when the "
             "machine has them. Command:", "",
             f"```bash\n{page_command(data['command'])}\n```", "",
             THREADS_HEADER, "|---:|---:|---|---:|---:|---:|"]
    for res in results:
        for r in res["rows"]:
            lines.append(f"| {r['threads']} | {r['size']} | {r['method']} | "
                         f"{_ms4(r['median'])} | {_ms4(r['floor'])} | "
                         f"{r['median'] / r['floor']:.2f} |")
    lines += ["", ("![ratio to the floor against threads](cpu-threads.png)" if plotted else
                   "(no plot: matplotlib is not installed; pip install 'bakron[bench]')"), "",
              "The processes (the raw rows: `data/cpu-threads.json`):", ""]
    for res in results:
        where = "pinned to" if res["pinned"] else \
            "not pinned (fewer cores allowed than threads), on"
        lines.append(f"- {res['threads']} threads: {where} {res['affinity']} cores, numba "
                     f"{res['numba_threads']} threads. Machine: {res['machine']}.")
    return "\n".join(_wrap(x) if not x.startswith("- ") else x for x in lines)


def parse_threads_table(text: str) -> list[dict]:
    """The rows of a ``cpu-threads.md`` table (what :func:`write_threads_report` wrote)."""
    lines = text.splitlines()
    start = lines.index(THREADS_HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        c = [x.strip() for x in line.strip("|").split("|")]
        rows.append({"threads": int(c[0]), "size": int(c[1]), "method": c[2],
                     "median_ms": float(c[3]), "floor_ms": float(c[4]), "ratio": float(c[5])})
    return rows


def _plot_threads(results, path, dtype, tile, bits):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for res in results for r in res["rows"]]
    sizes = sorted({r["size"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 4), squeeze=False)
    for ax, n in zip(axes[0], sizes):
        for m in methods:
            pts = sorted((r["threads"], r["median"] / r["floor"]) for r in rows
                         if r["size"] == n and r["method"] == m)
            if pts:
                x, y = zip(*pts)
                ax.plot(x, y, "o-", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("threads")
        ax.set_title(f"{n} × {n}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("median time ÷ floor G_Oᵀ W G_I")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"bakron CPU methods vs threads: {dtype}, tile {tile}, {bits}-bit grid")
    fig.tight_layout()
    from bakron._lib.fs import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    """The command line of ``bakron bench`` / ``python -m bakron.benchmarks.cpu``."""
    ap = argparse.ArgumentParser(prog="bakron bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256,512,1024,2048",
                    help="comma-separated square sizes n (default 256,512,1024,2048)")
    ap.add_argument("--repeats", type=int, default=7,
                    help="runs per entry; the table shows the median (default 7)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="working dtype of W and the factors (default float32)")
    ap.add_argument("--tile", type=int, default=16,
                    help="square tile side t, tiles t x t (default 16)")
    ap.add_argument("--bits", type=int, default=2,
                    help="bits of the uniform grid (per-row RMS scales; default 2)")
    ap.add_argument("--direct-max", type=int, default=2048,
                    help="largest n for the O(n^4) direct anti-diagonal (default 2048)")
    ap.add_argument("--array-api-max", type=int, default=1024,
                    help="largest n for the array-API recursive solver (default 1024)")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="seconds per entry: an entry whose runs have taken this long stops "
                         "before --repeats (default 60)")
    ap.add_argument("--out", default=os.path.join("docs", "benchmarks"),
                    help="output directory (default docs/benchmarks): the run's section of the "
                         "page cpu.md (the rest of the page kept), its plot and its results "
                         "under data/")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="measure nothing: rewrite the section of a stored run (data/cpu.json "
                         "or data/cpu-threads.json) of the page in --out")
    ap.add_argument("--tune", action="store_true",
                    help="measure the numba engine's auto rules (base size, panel width, "
                         "small problems) and print a markdown report instead")
    ap.add_argument("--mlp", action="store_true",
                    help="also time the floor and the recursive solver on the MLP shapes "
                         "4096x11008 and 11008x4096 (about 3 minutes more)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: sizes 128,256, 2 repeats (overrides --sizes/--repeats); "
                         "with --threads: sizes 64,128")
    ap.add_argument("--threads", default=None, metavar="T[,T...]",
                    help="thread scaling instead: for each T a fresh process with "
                         "OPENBLAS/NUMBA/OMP_NUM_THREADS=T (pinned to T cores when there are "
                         "that many) times the floor and every CPU method at --sizes (default "
                         "1024,2048,4096); writes cpu-threads.md/.png/.json to --out")
    ap.add_argument("--methods", default=None, metavar="M[,M...]",
                    help="with --threads: only these methods (labels of the table, e.g. "
                         "recursive,wavefront; default every method of the engine)")
    ap.add_argument("--option", action="append", default=[], metavar="ENGINE.FIELD=VALUE",
                    help="an engine option of every solve, e.g. numba.panel=128 (repeatable; "
                         "the fields of bakron.NumbaOptions and bakron.CudaOptions, "
                         "docs/engine-contract.md)")
    ap.add_argument("--_thread-child", dest="thread_child", type=int, default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--_child-out", dest="child_out", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    raw = sys.argv[1:] if argv is None else list(argv)
    global _OPTIONS
    from bakron.solvers.options import from_cli

    try:
        _OPTIONS = from_cli(args.option)
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))
    if args.render:
        return _render(args.render, args.out)
    if args.threads is not None or args.thread_child is not None:
        return _main_threads(ap, args, raw)
    if args.quick:
        args.sizes, args.repeats = "128,256", 2
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < args.tile:
        ap.error(f"--sizes must be at least the tile ({args.tile})")
    from bakron.backends import numba_cpu

    if not numba_cpu.available():
        print("bakron bench needs numba (pip install 'bakron[bench]')", file=sys.stderr)
        return 2
    if args.tune:
        print(f"bakron bench --tune: {_machine()}")
        report = tune(sizes=[s for s in sizes if s >= 256], repeats=args.repeats,
                      dtype=args.dtype)
        print(report)
        return 0
    command = "python -m bakron.benchmarks.cpu " + " ".join(shlex.quote(a) for a in (
        sys.argv[1:] if argv is None else argv))
    machine = _machine()
    print(f"bakron bench: {machine}")
    rows = run(sizes, repeats=args.repeats, dtype=args.dtype, tile=args.tile, bits=args.bits,
               direct_max=args.direct_max, array_api_max=args.array_api_max,
               budget=args.budget)
    shape_rows = run_shapes([(4096, 11008), (11008, 4096)], dtype=args.dtype, tile=args.tile,
                            bits=args.bits) if args.mlp else []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    machine += f", at the end {load:.1f}"
    write_report(rows, args.out, command.strip(), machine, args.dtype, args.tile, args.bits,
                 args.repeats, shape_rows)
    for r in rows:
        tgt = TARGETS.get(r["n"])
        ratio = r["recursive"] / r["floor"]
        verdict = "" if tgt is None else ("  target ≤ %.1f %s" % (tgt, "met" if ratio <= tgt
                                                                  else "MISSED"))
        print(f"n={r['n']}: recursive {r['recursive'] * 1e3:.1f} ms = {ratio:.2f} x floor"
              f"{verdict}")
    png = os.path.exists(os.path.join(args.out, "cpu.png"))
    print(f"wrote {os.path.join(args.out, 'cpu.md')}" + (" and cpu.png" if png else ""))
    return 0


def _option_args(o) -> list[str]:
    """``ENGINE.FIELD=VALUE`` of every field of the options object ``o`` that differs from
    the defaults (to hand a run's options to its child processes)."""
    from dataclasses import fields

    from bakron.solvers.options import OPTION_CLASSES, defaults

    eng = next(k for k, c in OPTION_CLASSES.items() if c is type(o))
    d = defaults(type(o))
    return [f"{eng}.{f.name}={int(v) if isinstance(v, bool) else v}"
            for f in fields(o) if (v := getattr(o, f.name)) != getattr(d, f.name)]


def _prog() -> str:
    """How this run was started, for the page's command line."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if name in ("bakron.bench", "bakron.benchmarks.cpu"):
        return f"python -m {name}"
    if name in ("bakron", "bakron.__main__") or os.path.basename(sys.argv[0]) == "bakron":
        return "bakron bench"
    return "python -m bakron.bench"


def _main_threads(ap, args, raw) -> int:
    """``--threads T,...`` (the parent) and ``--_thread-child T`` (one fresh process)."""
    methods = None
    if args.methods is not None:
        methods = [x.strip() for x in args.methods.split(",") if x.strip()]
        known = [_method_label(m, v) for m, v in cpu_methods()]
        unknown = [x for x in methods if x not in known]
        if unknown or not methods:
            ap.error(f"--methods must name methods of the table ({', '.join(known)}), "
                     f"got {args.methods!r}")
    if args.thread_child is not None:
        sizes = [int(x) for x in args.sizes.split(",")]
        res = thread_child(args.thread_child, sizes, args.repeats, args.dtype, args.tile,
                           args.bits, args.direct_max, args.budget, methods)
        from bakron._lib.fs import atomic_path

        with atomic_path(args.child_out) as tmp, open(tmp, "w") as fh:
            json.dump(res, fh)
        return 0
    try:
        counts = [int(x) for x in args.threads.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--threads must be comma-separated integers, got {args.threads!r}")
    if not counts or min(counts) < 1:
        ap.error(f"--threads must be positive integers, got {args.threads!r}")
    given = any(a == "--sizes" or a.startswith("--sizes=") for a in raw)
    if args.quick:
        sizes, args.repeats = list(THREAD_QUICK_SIZES), 2
    elif given:
        try:
            sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
        except ValueError:
            ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    else:
        sizes = list(THREAD_SIZES)
    if not sizes or min(sizes) < args.tile:
        ap.error(f"--sizes must be at least the tile ({args.tile})")
    from bakron.backends import numba_cpu

    if not numba_cpu.available():
        print("bakron bench needs numba (pip install 'bakron[bench]')", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    try:
        results = run_threads(counts, sizes, repeats=args.repeats, dtype=args.dtype,
                              tile=args.tile, bits=args.bits, direct_max=args.direct_max,
                              budget=args.budget, workdir=args.out, methods=methods)
    except RuntimeError as exc:
        print(f"bakron bench --threads: {exc}", file=sys.stderr)
        return 1
    command = _prog() + " " + " ".join(shlex.quote(a) for a in raw)
    md = write_threads_report(results, args.out, command.strip(), args.dtype, args.tile,
                              args.bits, args.repeats)
    print(f"wrote {md}")
    return 0


def _render(path: str, out: str) -> int:
    """``--render JSON``: rewrite the section of a stored run (``data/cpu.json`` or
    ``data/cpu-threads.json``) in ``out``'s page, measuring nothing."""
    from ._page import write_section

    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if "processes" in data:
        key, text = THREADS_SECTION, threads_section(data)
    else:
        key, text = SECTION, report_section(data)
    print("wrote", write_section(os.path.join(out, PAGE), key, text, title="CPU benchmarks"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
