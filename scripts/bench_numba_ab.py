#!/usr/bin/env python
"""A/B timing of the numba CPU engine: two source trees, one run, interleaved.

    python scripts/bench_numba_ab.py --old /tmp/old_tree --new . --cpus 0-15 \\
        --threads 1,4,16 --rounds 5 \\
        --cases floor:1024,rec:1024,wave:1024,wave:2048@4,stack:64x256 --json ab.json

Every point (tree, thread count, case) runs in a fresh ``python`` with ``PYTHONPATH`` at that
tree (a tree as ``git archive HEAD bakron backends pyproject.toml`` unpacks it, or a
checkout), ``OPENBLAS_NUM_THREADS = OMP_NUM_THREADS = NUMBA_NUM_THREADS = MKL_NUM_THREADS =
t``, pinned with ``os.sched_setaffinity`` to the first ``t`` cores of ``--cpus``. Problems:
float32, tile 16, a 2-bit grid (``UniformQuantizer.fit``), Wishart Hessians; every round runs
old and new back to back (the order alternates between rounds); the table gives the medians
over the rounds (each round's figure is the median of ``--inner`` timed calls after one
untimed call in that process).

Cases (``KIND:SIZE[@BASE]``; SIZE ``N`` for N x N or ``MxN``):

``floor``   the product ``G_O^T W G_I`` (numpy, BLAS);
``rec``, ``wave``, ``anti``, ``auto``   ``bakron.solve(engine="numba")`` with method
            ``recursive``, ``wavefront``, ``antidiagonal`` (accumulator) or ``auto``; ``@BASE``
            the base / coarse block in tiles (default: the engine's rule);
``stack``   ``stack:BxN`` or ``stack:BxMxN``: B layers in one ``bakron.solve`` (method auto,
            per-item quantizers); the table notes ``info["stack"]["path"]``;
``floor1``, ``rec1``, ``wave1``   one-sided (``A_out=None``): the product ``W G_I`` and the
            recursion and the wavefront.

A tree whose engine lacks a method reports ``n/a`` for it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS",
               "MKL_NUM_THREADS")
#: ``--clock``: what a timed call measures
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
KINDS = {"floor": None, "rec": "recursive", "wave": "wavefront", "anti": "antidiagonal",
         "auto": "auto", "stack": "auto", "floor1": None, "rec1": "recursive",
         "wave1": "wavefront"}


# -- parsing ----------------------------------------------------------------------------------
def parse_cpus(text: str) -> list[int]:
    """``0-15`` / ``0,2,4-7`` -> sorted core ids."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = (int(x) for x in part.split("-", 1))
            if b < a:
                raise ValueError(f"bad core range {part!r}")
            out.update(range(a, b + 1))
        else:
            out.add(int(part))
    if not out or min(out) < 0:
        raise ValueError(f"--cpus must name cores, got {text!r}")
    return sorted(out)


def parse_ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return vals


def parse_case(text: str) -> dict:
    """``KIND:SIZE[@BASE]`` -> ``{"name", "kind", "items", "m", "n", "base"}``."""
    name = text.strip()
    try:
        kind, rest = name.split(":", 1)
    except ValueError:
        raise ValueError(f"a case is KIND:SIZE[@BASE], got {text!r}") from None
    if kind not in KINDS:
        raise ValueError(f"case kind must be one of {sorted(KINDS)}, got {kind!r}")
    base = None
    if "@" in rest:
        rest, b = rest.split("@", 1)
        base = int(b)
        if base < 1:
            raise ValueError(f"base must be >= 1 tile in {text!r}")
    dims = [int(x) for x in rest.lower().split("x")]
    items = 1
    if kind == "stack":
        if len(dims) not in (2, 3):
            raise ValueError(f"a stack case is stack:BxN or stack:BxMxN, got {text!r}")
        items, dims = dims[0], dims[1:]
    if len(dims) == 1:
        dims = dims * 2
    if len(dims) != 2 or min(dims) < 1 or items < 1:
        raise ValueError(f"bad size in case {text!r}")
    return {"name": name, "kind": kind, "items": items, "m": dims[0], "n": dims[1],
            "base": base}


def parse_cases(text: str) -> list[dict]:
    return [parse_case(c) for c in text.split(",") if c.strip()]


# -- one point, in a fresh process --------------------------------------------------------------
def _factor(rng, size, block):
    import numpy as np

    import bakron

    X = rng.standard_normal((size, size + 64))
    return bakron.prepare_factor(X @ X.T / X.shape[1], block).A.astype(np.float32)


def child(case: dict, tree: str, cores: list[int], inner: int, clock: str = "wall") -> dict:
    """Time ``case`` with the bakron of ``tree`` (run in a fresh process)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    # an editable install of bakron would resolve bakron.backends to its own checkout: drop
    # its finder and resolve bakron.backends inside ``tree`` (its top-level ``backends/``)
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    import numpy as np

    import bakron
    bakron.__path__.append(tree)
    import bakron.backends
    import numba

    here = os.path.realpath(tree)
    for mod in (bakron, bakron.backends):
        if not os.path.realpath(mod.__file__).startswith(here + os.sep):
            raise RuntimeError(f"{mod.__name__} came from {mod.__file__}, not from {tree}")
    rng = np.random.default_rng(0)
    B, m, n, t = case["items"], case["m"], case["n"], 16
    shape = (B, m, n) if case["kind"] == "stack" else (m, n)
    W = rng.standard_normal(shape).astype(np.float32)
    one_sided = case["kind"].endswith("1")
    AO, AI = None if one_sided else _factor(rng, m, t), _factor(rng, n, t)
    info: dict = {}
    if case["kind"] in ("floor", "floor1"):
        GI = np.eye(n, dtype=np.float32) + AI
        GO = None if one_sided else np.eye(m, dtype=np.float32) + AO

        def fn():
            return W @ GI if GO is None else GO.T @ W @ GI
    else:
        q = bakron.fit_quantizers(W, 2) if case["kind"] == "stack" else \
            bakron.UniformQuantizer.fit(W, 2)

        def fn():
            r = bakron.solve(W, AO, AI, q, tile=t, method=KINDS[case["kind"]], engine="numba",
                             base=case["base"])
            info.update(method=r.method, base=r.info.get("base"))
            if "stack" in r.info:
                info["path"] = r.info["stack"]["path"]
            return r
    try:
        fn()  # compile / load the cache, first-touch the buffers
    except ValueError as exc:  # this tree's engine lacks the method
        return {"seconds": None, "error": str(exc).split(";")[0], "info": info}
    now = CLOCKS[clock]
    ts = []
    for _ in range(inner):
        t0 = now()
        fn()
        ts.append(now() - t0)
    return {"seconds": statistics.median(ts), "runs": ts, "info": info,
            "numba_threads": numba.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None}


def parse_env(items: list[str]) -> dict:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise ValueError(f"--env takes KEY=VALUE, got {it!r}")
        out[k] = v
    return out


def run_point(case: dict, tree: str, threads: int, cpus: list[int], inner: int,
              python: str = sys.executable, extra_env: dict | None = None,
              clock: str = "wall") -> dict:
    """One fresh process for (tree, threads, case); its result dict."""
    tree = os.path.abspath(tree)
    # the tree first; the caller's PYTHONPATH after it (packages installed with --target)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [tree] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    env.update({k: str(threads) for k in THREAD_VARS})
    env.update(extra_env or {})  # --env wins, e.g. OPENBLAS_NUM_THREADS=1
    cores = cpus[:threads]
    cmd = [python, os.path.abspath(__file__), "--_child", json.dumps(case), "--_tree", tree,
           "--_cores", ",".join(map(str, cores)), "--inner", str(inner), "--clock", clock]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"point {case['name']} threads={threads} tree={tree} failed:\n"
                           f"{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_ab(trees: dict, cases: list[dict], threads: list[int], cpus: list[int], rounds: int,
           inner: int, log=print, extra_env: dict | None = None,
           clock: str = "wall") -> list[dict]:
    """Every point of every round, old and new back to back (order alternating by round)."""
    rows = []
    names = list(trees)
    for t in threads:  # warm the on-disk kernel caches of both trees (not timed)
        if t > len(cpus):
            raise ValueError(f"--threads {t} needs {t} cores but --cpus has {len(cpus)}")
    for label in names:
        run_point(parse_case("rec:64"), trees[label], 1, cpus, 1, extra_env=extra_env)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for t in threads:
            for case in cases:
                for label in order:
                    res = run_point(case, trees[label], t, cpus, inner,
                                    extra_env=extra_env, clock=clock)
                    rows.append(dict(res, round=r, tree=label, threads=t, case=case["name"]))
                    s = res["seconds"]
                    log(f"round {r} {label:>3} t={t:<3} {case['name']:<18} "
                        f"{'n/a' if s is None else f'{s * 1e3:10.2f} ms'}")
    return rows


def summarize(rows: list[dict], cases: list[dict], threads: list[int], labels) -> list[dict]:
    out = []
    for t in threads:
        for case in cases:
            d = {"case": case["name"], "threads": t}
            for label in labels:
                xs = [r["seconds"] for r in rows if r["threads"] == t and
                      r["case"] == case["name"] and r["tree"] == label and
                      r["seconds"] is not None]
                d[label] = statistics.median(xs) if xs else None
                infos = [r["info"] for r in rows if r["threads"] == t and
                         r["case"] == case["name"] and r["tree"] == label]
                d[f"{label}_ran"] = infos[-1] if infos else {}
            out.append(d)
    return out


def table(summary: list[dict]) -> str:
    def ms(x):
        return "n/a" if x is None else f"{x * 1e3:.2f}"

    lines = ["| case | threads | old ms | new ms | new ÷ old | new ran |",
             "|---|---:|---:|---:|---:|---|"]
    for d in summary:
        ratio = "" if d["old"] is None or d["new"] is None else f"{d['new'] / d['old']:.2f}"
        ran = d["new_ran"]
        what = ", ".join(f"{k} {v}" for k, v in ran.items() if v is not None)
        lines.append(f"| {d['case']} | {d['threads']} | {ms(d['old'])} | {ms(d['new'])} | "
                     f"{ratio} | {what} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="the old source tree (bakron/, backends/)")
    ap.add_argument("--new", help="the new source tree (bakron/, backends/)")
    ap.add_argument("--cpus", default=None, help="cores to pin to, e.g. 0-15 (default: all "
                    "this process may use)")
    ap.add_argument("--threads", default="1", help="thread counts, e.g. 1,4,16")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over them)")
    ap.add_argument("--inner", type=int, default=3,
                    help="timed calls per point and process (their median)")
    ap.add_argument("--cases", default="floor:1024,rec:1024,wave:1024",
                    help="comma-separated KIND:SIZE[@BASE] (see above)")
    ap.add_argument("--json", default=None, help="write every measurement and the summary here")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment of every point (repeatable), e.g. "
                    "OMP_WAIT_POLICY=PASSIVE")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: elapsed time; thread: CPU time of the calling thread "
                    "(time.thread_time), which waiting for a core does not count: for "
                    "--threads 1 on a busy machine (with more threads it misses the workers')")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_tree", help=argparse.SUPPRESS)
    ap.add_argument("--_cores", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args._child is not None:
        res = child(json.loads(args._child), args._tree, parse_cpus(args._cores), args.inner,
                    args.clock)
        print(json.dumps(res))
        return 0
    if not args.old or not args.new:
        ap.error("--old and --new are required")
    try:
        cpus = parse_cpus(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
        threads = parse_ints(args.threads, "--threads")
        cases = parse_cases(args.cases)
        extra_env = parse_env(args.env)
        if args.rounds < 1 or args.inner < 1:
            raise ValueError("--rounds and --inner must be >= 1")
    except ValueError as exc:
        ap.error(str(exc))
    trees = {"old": args.old, "new": args.new}
    rows = run_ab(trees, cases, threads, cpus, args.rounds, args.inner,
                  log=lambda s: print(s, file=sys.stderr, flush=True), extra_env=extra_env,
                  clock=args.clock)
    summary = summarize(rows, cases, threads, list(trees))
    print(table(summary))
    if args.json:
        args.json = os.path.abspath(args.json)
        with open(args.json, "w") as fh:
            json.dump({"command": " ".join(sys.argv), "trees": trees, "cpus": cpus,
                       "threads": threads, "rounds": args.rounds, "inner": args.inner,
                       "env": extra_env, "clock": args.clock,
                       "rows": rows, "summary": summary}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
