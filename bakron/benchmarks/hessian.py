"""Throughput of the global-Hessian passes against their GEMM floor:
``python -m bakron.benchmarks.hessian``.

For each model chain (``smollm2``: SmolLM2-135M on random token ids; ``mlp``: a random
ReLU MLP on Gaussian inputs), each thread count (one fresh process per count, with
``OPENBLAS_NUM_THREADS = OMP_NUM_THREADS = t``) and each schedule (``store_all``: one range,
all activations kept; ``budget``: a memory budget of half the store-all plan, so that the
driver checkpoints; ``forward``: :func:`bakron.hessian.input_factors`, ``H_in`` alone from
forward passes), it runs :func:`bakron.hessian.global_factors` with one refinement step
and reads the wall time of each pass from the report (``kfac``, ``refine_out``,
``refine_in``; ``inputs`` for the forward-only pass), in tokens per second.

The **floor** of a pass is measured in the same process: the matrix products that pass must
do, each timed alone on random data of its shape and dtype at this machine's BLAS rate (into a
preallocated output, so that no allocation or page fault counts) and summed, once before the
passes and once after them, each part's smaller time counting (the load of a shared machine
changes while the passes run) -- the forward (every linear, the attention scores and mixing, the LM head's logits),
the VJP (every input gradient, the attention backward, the LM head's ``p W``), and the factor
products as symmetric rank-k updates (``?syrk``) on the real rows, one ``H_in`` per distinct
input (q/k/v share one, gate/up another) and one ``H_out`` per layer; a refinement pass has,
per layer, the fixed factor's quadratic form (``X H``: a GEMM) and a weighted ``?syrk``
instead; the forward-only pass has the forward without the LM head and the ``H_in`` products.
Recomputation (a residual block's VJP re-runs its forward; checkpointing) is not in
the floor: it is overhead the ratio shows. Peak memory is the driver's own ledger (factor
buffers + caches + activations) and the traced heap peak (``tracemalloc``, which numpy
reports to) over the timed runs.

Writes ``hessian.md`` and ``hessian.json`` into ``--out`` (default ``docs/benchmarks``), with
the machine, the command and the date; ``--name`` renames them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import tracemalloc

import numpy as np

from .._lib.fs import atomic_path
from ..hessian.cost import pass_gemms

__all__ = ["main", "pass_gemms", "floor_seconds", "build_chain"]

PASSES = ("kfac", "refine_out", "refine_in", "inputs")


# --------------------------------------------------------------------------------------------
# the GEMMs of one pass
# --------------------------------------------------------------------------------------------
#: "wall" (perf_counter) or "cpu" (this process's CPU time, all threads): set per run
CLOCK = {"fn": time.perf_counter}


def _timed(fn, repeats):
    clock = CLOCK["fn"]
    fn()
    ts = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return float(np.median(ts))


_FLOOR_CACHE: dict = {}


def floor_seconds(g: dict, dtype="float32", repeats: int = 3, seed: int = 0) -> dict:
    """The floor of a K-FAC pass, of a refinement pass (each side) and of the forward-only
    pass in seconds: every product of ``g`` (:func:`pass_gemms`) timed alone on random data
    and summed, by part."""
    from scipy.linalg import blas

    dt = np.dtype(dtype)
    syrk = blas.ssyrk if dt == np.float32 else blas.dsyrk
    rng = np.random.default_rng(seed)
    cache = _FLOOR_CACHE.setdefault((dt.str, repeats, CLOCK["fn"].__name__), {})

    def t_gemm(M, K, N):
        key = ("gemm", M, K, N)
        if key not in cache:
            A = rng.standard_normal((M, K)).astype(dt)
            B = rng.standard_normal((K, N)).astype(dt)
            C = np.empty((M, N), dtype=dt)
            cache[key] = _timed(lambda: np.matmul(A, B, out=C), repeats)
        return cache[key]

    def t_bmm(c, M, K, N):
        key = ("bmm", c, M, K, N)
        if key not in cache:
            A = rng.standard_normal((c, M, K)).astype(dt)
            B = rng.standard_normal((c, K, N)).astype(dt)
            C = np.empty((c, M, N), dtype=dt)
            cache[key] = _timed(lambda: np.matmul(A, B, out=C), repeats)
        return cache[key]

    def t_syrk(M, n):
        key = ("syrk", M, n)
        if key not in cache:
            X = np.asfortranarray(rng.standard_normal((M, n)).astype(dt))
            C = np.zeros((n, n), dtype=dt, order="F")
            cache[key] = _timed(lambda: syrk(1.0, X, c=C, trans=1, overwrite_c=1), repeats)
        return cache[key]

    def total(items):
        s = 0.0
        for it in items:
            s += t_gemm(*it[1:]) if it[0] == "gemm" else t_bmm(*it[1:])
        return s

    N = g["N"]
    fwd, vjp, head = total(g["fwd"]), total(g["vjp"]), total(g.get("head", ()))
    ins = sum(t_syrk(N, n) for n in g["in"])
    kfac = ins + sum(t_syrk(N, m) for m in g["out"])
    r_out = sum(t_gemm(N, n, n) + t_syrk(N, m) for m, n in g["layers"])
    r_in = sum(t_gemm(N, m, m) + t_syrk(N, n) for m, n in g["layers"])
    return {"forward": fwd, "vjp": vjp, "head": head, "kfac_products": kfac,
            "refine_out_products": r_out, "refine_in_products": r_in, "inputs_products": ins,
            **_passes(fwd, vjp, head, kfac, r_out, r_in, ins)}


def _passes(fwd, vjp, head, kfac, r_out, r_in, ins) -> dict:
    """Each pass's floor from its parts (the forward-only ``inputs`` pass has no head)."""
    return {"kfac": fwd + vjp + kfac, "refine_out": fwd + vjp + r_out,
            "refine_in": fwd + vjp + r_in, "inputs": fwd - head + ins}


# --------------------------------------------------------------------------------------------
# the chains
# --------------------------------------------------------------------------------------------
def build_chain(model: str, tokens: int, seq_len: int, batch_tokens: int, seed: int = 0):
    """``(stages, batches, rows, seqs, label)`` for ``model`` (``smollm2`` or ``mlp``)."""
    import bakron.hessian as bh

    rng = np.random.default_rng(seed)
    if model == "smollm2":
        from ..models import load_llm

        lm = load_llm("smollm2")
        n_seq = max(1, tokens // seq_len)
        V = lm.config.vocab_size
        seqs = [list(rng.integers(0, V, size=seq_len)) for _ in range(n_seq)]
        per = max(1, batch_tokens // seq_len)
        batches, _ = bh.pad_batches(seqs, batch_size=per)
        return (lm.stages(), batches, n_seq * seq_len, (per, seq_len),
                f"SmolLM2-135M, {n_seq} x {seq_len} tokens, {per} sequences per batch")
    if model == "mlp":
        sizes = [784, 1024, 1024, 1024, 10]
        stages = []
        for k in range(len(sizes) - 1):
            W = (rng.standard_normal((sizes[k + 1], sizes[k])) / np.sqrt(sizes[k])).astype(
                np.float32)
            stages.append(bh.Linear(W, np.zeros(sizes[k + 1], np.float32), name=f"fc{k}"))
            if k < len(sizes) - 2:
                stages.append(bh.ReLU())
        stages.append(bh.SoftmaxCrossEntropy())
        X = rng.standard_normal((tokens, sizes[0])).astype(np.float32)
        batches = [X[i:i + batch_tokens] for i in range(0, tokens, batch_tokens)]
        return stages, batches, tokens, None, (f"MLP {'-'.join(map(str, sizes))}, {tokens} "
                                               f"samples, {batch_tokens} per batch")
    raise ValueError(f"unknown model {model!r}: use smollm2 or mlp")


# --------------------------------------------------------------------------------------------
# one process: one thread count
# --------------------------------------------------------------------------------------------
def _one(stages, batches, budget, repeats):
    """Median seconds of each pass over ``repeats`` runs with one refinement step. Under a
    budget that splits the layer range a pass is several sweeps: a kind's time is the sum of
    its sweeps over the leaf ranges, and the split sweeps (which fill the boundary caches)
    count towards ``kfac``."""
    import bakron.hessian as bh

    runs: dict = {}
    rep = None
    for _ in range(repeats):
        _, rep = bh.global_factors(stages, batches, budget_bytes=budget, refine_iters=1,
                                   sink=lambda *a: None)
        total: dict = {}
        for s in rep.sweeps:
            kind = "kfac" if s.kind == "split" else s.kind
            sec = s.cpu_seconds if CLOCK["fn"] is time.process_time else s.seconds
            total[kind] = total.get(kind, 0.0) + sec
        for k, v in total.items():
            runs.setdefault(k, []).append(v)
    return {k: float(np.median(v)) for k, v in runs.items()}, rep


def _forward(stages, batches, repeats):
    """Median seconds of :func:`bakron.hessian.input_factors` over ``repeats`` runs."""
    import bakron.hessian as bh

    runs, rep = [], None
    for _ in range(repeats):
        _, rep = bh.input_factors(stages, batches, sink=lambda *a: None)
        s = rep.sweeps[0]
        runs.append(s.cpu_seconds if CLOCK["fn"] is time.process_time else s.seconds)
    return {"inputs": float(np.median(runs))}, rep


def _budget(bh, stages, batches, buffers, store_all):
    """The smallest of ``buffers + f × activations`` (f = 1/2, 5/8, 3/4, 7/8) that plans."""
    act = max(store_all - buffers, 0)
    for f in (4, 5, 6, 7):
        b = buffers + act * f // 8
        try:
            bh.plan_global(stages, batches, budget_bytes=b)
            return b
        except ValueError:
            continue
    return store_all


def child(args) -> dict:
    import bakron.hessian as bh

    out = {"threads": args.child, "models": {}}
    for model in args.models:
        stages, batches, rows, seqs, label = build_chain(model, args.tokens, args.seq_len,
                                                         args.batch_tokens)
        n_batches = len(batches)
        if args.clock == "cpu":
            CLOCK["fn"] = time.process_time
        def floor():
            fl: dict = {}
            for x in batches:   # the floor of each batch (its rows, its sequences), summed
                B = int(x.shape[0])
                g = pass_gemms(stages, int(np.prod(x.shape)) if seqs is not None else B,
                               None if seqs is None else (B, int(x.shape[1])))
                for k, v in floor_seconds(g, repeats=3).items():
                    fl[k] = fl.get(k, 0.0) + v
            return fl, g

        _FLOOR_CACHE.clear()
        fl, g = floor()
        plan = bh.plan_global(stages, batches)
        # the budget schedule: the factor buffers and half the store-all plan's activations
        buf = sum((m * m + n * n) * 8 for m, n in g["layers"])
        budget = _budget(bh, stages, batches, buf, plan["planned_peak_bytes"])
        res = {"label": label, "tokens": rows, "batches": n_batches, "floor": fl,
               "clock": args.clock,
               "store_all_planned_bytes": plan["planned_peak_bytes"], "schedules": {}}
        # warm-up: imports, BLAS threads and first-call costs, on a few tokens of one batch
        x0 = batches[0][:1, :16] if seqs is not None else batches[0][:16]
        bh.global_factors(stages, [x0], refine_iters=1, sink=lambda *a: None)
        for sched in args.schedules:
            bb = budget if sched == "budget" else None
            tracemalloc.start()   # numpy reports its allocations; few, large: cheap to trace
            if sched == "forward":
                times, rep = _forward(stages, batches, args.repeats)
            else:
                times, rep = _one(stages, batches, bb, args.repeats)
            traced = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            res["schedules"][sched] = {
                "budget_bytes": bb, "seconds": times, "ledger_peak_bytes": rep.peak_bytes,
                "traced_peak_bytes": traced, "passes": rep.passes,
                "recompute_factor": rep.recompute_factor,
                "leaves": [list(r) for r in rep.leaf_ranges],
                "schedule": sorted({s.schedule for s in rep.sweeps})}
            print(f"[{args.child} threads] {model} {sched}: " + ", ".join(
                f"{k} {rows / v:.1f} tok/s ({v / fl[k]:.2f}x floor)" for k, v in times.items()),
                file=sys.stderr, flush=True)
        # the floor again after the passes (a shared machine's load changes while they run):
        # each part's smaller measurement, so that the ratios are not flattered by a slow floor
        _FLOOR_CACHE.clear()
        after, _ = floor()
        res["floor_before"], res["floor_after"] = dict(fl), after
        fl = {k: min(v, after[k]) for k, v in fl.items() if k not in PASSES}
        fl.update(_passes(fl["forward"], fl["vjp"], fl["head"], fl["kfac_products"],
                          fl["refine_out_products"], fl["refine_in_products"],
                          fl["inputs_products"]))
        res["floor"] = fl
        for sched, s in res["schedules"].items():
            print(f"[{args.child} threads] {model} {sched} against the smaller floor: " +
                  ", ".join(f"{k} {v / fl[k]:.2f}x" for k, v in s["seconds"].items()),
                  file=sys.stderr, flush=True)
        out["models"][model] = res
    try:
        import resource

        out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except ImportError:
        pass
    return out


# --------------------------------------------------------------------------------------------
# the page
# --------------------------------------------------------------------------------------------
def _machine() -> str:
    from .cpu import cpu_name

    return (f"{cpu_name()}, {os.cpu_count()} cores; Python {platform.python_version()}, numpy "
            f"{np.__version__}")


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def write_report(results, out_dir, name, command, meta) -> str:
    mib = 2.0 ** 20
    runs = meta.get("runs") or [meta]
    lines = ["# Global Hessians: tokens per second against the GEMM floor", ""]
    for r in runs:
        lines += [f"Command: `{r['command']}`", "",
                  f"Machine: {r['machine']}; load average {r['load_before']} before, "
                  f"{r['load_after']} after (1, 5, 15 min); {r['date']}.", ""]
    lines += [
             "Each pass is a forward, a VJP and the factor products over all calibration "
             "tokens. *Floor*: the matrix products that pass must do, each timed alone at this "
             "machine's BLAS rate in the same process, into a preallocated output, and summed, "
             "measured before and after the passes, the smaller of the two per part "
             "(forward, VJP, factor "
             "products as symmetric rank-k updates; see `bakron/benchmarks/hessian.py`). "
             "*Ratio*: pass time / floor (1.0 = at the floor). The budget schedule holds the "
             "factor buffers and about half the store-all plan's activations, so it "
             "recomputes; when it splits the layer range, a pass is the sum of its sweeps "
             "(the splits' sweeps count towards K-FAC). The forward schedule is "
             "`input_factors`: `H_in` alone from forward passes (pass `inputs`: the forward "
             "without the LM head and the `H_in` products). *Clock*: wall time, or this "
             "process's CPU time (all threads) for passes and floor alike, which a loaded "
             "machine disturbs less. Peak memory: the "
             "driver's ledger (factor buffers, caches, activations) and the traced heap peak "
             "of the run (numpy's allocations).", ""]
    models = []
    for r in results:
        for m in r["models"]:
            if m not in models:
                models.append(m)
    for m in models:
        first = next(r["models"][m] for r in results if m in r["models"])
        lines += [f"## {first['label']}", ""]
        other = [f"{r['threads']} thread(s): {r['models'][m]['label']}" for r in results
                 if m in r["models"] and r["models"][m]["label"] != first["label"]]
        if other:   # runs merged from commands of other sizes
            lines += ["Rows of other sizes: " + "; ".join(other) + ".", ""]
        lines += [
                  "| threads | clock | schedule | pass | tokens/s | ms/token | floor ms/token "
                  "| ratio | ledger peak MiB | traced peak MiB |",
                  "|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in results:
            res = r["models"].get(m)
            if res is None:
                continue
            tok = res["tokens"]
            for sched, s in res["schedules"].items():
                for p in PASSES:
                    if p not in s["seconds"]:
                        continue
                    t = s["seconds"][p]
                    f = res["floor"][p]
                    lines.append(f"| {r['threads']} | {res.get('clock', 'wall')} | {sched} | "
                                 f"{p} | {tok / t:.1f} | "
                                 f"{1e3 * t / tok:.2f} | {1e3 * f / tok:.2f} | {t / f:.2f} | "
                                 f"{s['ledger_peak_bytes'] / mib:.0f} | "
                                 f"{s['traced_peak_bytes'] / mib:.0f} |")
        lines += ["", "Floor by part (ms per token): " + "; ".join(
            f"{r['threads']} thread(s): " + ", ".join(
                f"{k} {1e3 * v / r['models'][m]['tokens']:.2f}"
                for k, v in r["models"][m]["floor"].items()
                if k in ("forward", "vjp", "kfac_products", "refine_out_products",
                         "refine_in_products", "head", "inputs_products"))
            for r in results if m in r["models"]) + ".", ""]
    path = os.path.join(out_dir, f"{name}.md")
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write("\n".join(lines))
    jpath = os.path.join(out_dir, f"{name}.json")
    with atomic_path(jpath) as tmp:
        with open(tmp, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return path


def _shown(raw):
    """The arguments as the page shows them: without ``--out``/``--name`` (where the page
    goes, not what was measured)."""
    out, skip = [], False
    for a in raw:
        if skip:
            skip = False
            continue
        if a in ("--out", "--name"):
            skip = True
            continue
        if a.startswith(("--out=", "--name=")):
            continue
        out.append(a)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bakron.benchmarks.hessian",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,mlp",
                    help="comma-separated: smollm2, mlp (default both)")
    ap.add_argument("--threads", default="1,2", help="BLAS thread counts (default 1,2)")
    ap.add_argument("--schedules", default="store_all,budget,forward",
                    help="store_all, budget (half the store-all plan) and/or forward (the "
                         "forward-only H_in pass of input_factors)")
    ap.add_argument("--tokens", type=int, default=1024, help="calibration tokens (default 1024)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (smollm2)")
    ap.add_argument("--batch-tokens", type=int, default=1024,
                    help="tokens (mlp: samples) per batch (default 1024)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per point (median)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time passes and floor by the wall clock (default) or by this "
                         "process's CPU time (all threads; steadier on a loaded machine)")
    ap.add_argument("--out", default="docs/benchmarks", help="output folder")
    ap.add_argument("--name", default="hessian", help="page name (NAME.md, NAME.json)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="write one page from the .json files of earlier runs (each run's "
                         "command and machine are listed)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = parser()
    raw = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(raw)
    args.models = [m for m in args.models.split(",") if m]
    args.schedules = [s for s in args.schedules.split(",") if s]
    for s in args.schedules:
        if s not in ("store_all", "budget", "forward"):
            ap.error(f"--schedules: unknown schedule {s!r} (store_all, budget, forward)")
    if args.merge:
        runs, merged = [], {}
        for path in args.merge:
            with open(path) as f:
                doc = json.load(f)
            for r in doc["meta"].get("runs") or [doc["meta"]]:
                words = shlex.split(r["command"])
                r["command"] = shlex.join(words[:3] + _shown(words[3:]))
                runs.append(r)
            for r in doc["results"]:
                merged.setdefault(r["threads"], {"threads": r["threads"], "models": {}})
                merged[r["threads"]]["models"].update(r["models"])
        results = [merged[t] for t in sorted(merged)]
        os.makedirs(args.out, exist_ok=True)
        print(f"wrote {write_report(results, args.out, args.name, None, {'runs': runs})}")
        return 0
    if args.child is not None:
        print(json.dumps(child(args)))
        return 0
    threads = [int(t) for t in args.threads.split(",") if t]
    meta = {"machine": _machine(), "load_before": _load(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m bakron.benchmarks.hessian " + shlex.join(_shown(raw))}
    results = []
    for t in threads:
        env = dict(os.environ)
        for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                  "NUMBA_NUM_THREADS"):
            env[k] = str(t)
        cmd = [sys.executable, "-m", "bakron.benchmarks.hessian", *raw, "--child", str(t)]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        if proc.returncode:
            print(f"the {t}-thread run failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    meta["load_after"] = _load()
    os.makedirs(args.out, exist_ok=True)
    path = write_report(results, args.out, args.name, meta["command"], meta)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
