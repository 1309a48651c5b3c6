"""Benchmark of stacks of layers: ``python -m bakron.bench_stack``.

Measures, in one run and on the same inputs, a stack of ``B`` layers of ``m x n`` (fp32,
tile 16, 2 bits, two-sided, per-item quantizers):

* ``one by one``: ``bakron.solve`` called once per item (what a runner did before stacks);
* ``stack``: ``bakron.solve`` on the whole ``(B, m, n)`` stack (``workers`` threads);
* ``floor``: the floor products ``G_Oᵀ W G_I`` of every item, summed (numpy or cupy, same
  dtype): what any exact method pays.

Each mode writes its section of the page ``stacks.md`` in ``--out`` (default
``docs/benchmarks``; ``bakron.benchmarks._page``: the rest of the page is kept), with the date,
the machine and the command; ``--name`` gives a run a section of its own (e.g. a second size).
Modes and their sections:

* default: the entries above interleaved round by round in this process (a change of the
  machine's load hits them alike); ``--workers 1,2`` lists the stack's thread counts;
  section ``stacks-cpu``;
* ``--threads 1,4,16``: one fresh process per thread count ``t`` with
  ``OPENBLAS_NUM_THREADS = NUMBA_NUM_THREADS = t``; each measures one by one (BLAS and numba
  on ``t`` threads), the stack on 1 worker and on ``t`` workers (1 thread each), and the floor;
  section ``stacks-cpu-threads`` (``--label`` names a variant of the engine measured);
* ``--gpu``: cupy arrays on the current device (TF32 off unless ``--tf32``): one by one, the
  stack with the cuda engine's stack hook off (``stack, items``: one item after the other)
  and on (``stack, antidiagonal``, ``stack, wavefront``, ``stack, auto``: every launch over
  all items), and the floor; section ``stacks-gpu``;
* ``--gpu --block``: the seven linears of a Llama-3-8B block through
  ``bakron.quantize_layers`` (what the runners call) against their summed floor products;
  section ``stacks-gpu-block``;
* ``--gpu --suite``: the same for the workloads of ``GPU_SUITE`` (64 × 1024², an MoE block
  128 × 768×2048 and 128 × 2048×768, 64 × 256²) in one process; section
  ``stacks-gpu-suite``, and its results ``data/stacks-gpu-suite.json``, from which
  ``--render data/stacks-gpu-suite.json`` rewrites the section without measuring.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys

import numpy as np

from .._lib.fs import atomic_write_json
from ._page import page_command, today, write_section
from .cpu import interleaved

__all__ = ["main", "make_stack", "run_point", "GPU_SUITE", "llama_block_layers"]

#: the page of every mode
PAGE = "stacks.md"
#: the GPU workloads of ``--gpu --suite``: (B, m, n)
GPU_SUITE = ((64, 1024, 1024), (128, 768, 2048), (128, 2048, 768), (64, 256, 256))


def make_stack(B: int, m: int, n: int, *, tile: int = 16, bits: int = 2, dtype="float32",
               distinct: int = 8, seed: int = 0):
    """A stack of ``B`` weights with per-item quantizers and ``distinct`` factor pairs cycled
    over the items (Wishart Hessians prepared as by ``quantize_layer``)."""
    import bakron
    from .cpu import make_problem

    dt = np.dtype(dtype)
    probs = [make_problem(m, n, (tile, tile), dt, seed + k) for k in range(min(B, distinct))]
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((B, m, n)).astype(dt)
    A_out = np.stack([probs[i % len(probs)]["A_out"] for i in range(B)])
    A_in = np.stack([probs[i % len(probs)]["A_in"] for i in range(B)])
    qs = bakron.fit_quantizers(W, bits)
    return W, A_out, A_in, qs


def _entries(xp, W, A_out, A_in, qs, tile, workers_list, engine, gpu=False):
    """The callables of one measurement, in W's namespace (numpy or cupy); on the GPU the
    stack as the engine runs it and the stack with its hook declined."""
    import bakron

    B = W.shape[0]
    eye_m = xp.eye(W.shape[1], dtype=W.dtype)
    eye_n = xp.eye(W.shape[2], dtype=W.dtype)
    G_out = [A_out[i] + eye_m for i in range(B)]
    G_in = [A_in[i] + eye_n for i in range(B)]

    def sync():
        if hasattr(xp, "cuda"):
            xp.cuda.get_current_stream().synchronize()

    def floor():
        for i in range(B):
            G_out[i].T @ W[i] @ G_in[i]
        sync()

    def one_by_one():
        for i in range(B):
            bakron.solve(W[i], A_out[i], A_in[i], qs[i], tile=tile, engine=engine)
        sync()

    fns = {"floor": floor, "one by one": one_by_one}
    if gpu:
        def stack(method, hook=True):
            # the engine's option stack=False declines every stack: items one by one
            opts = bakron.CudaOptions.defaults().with_(stack=hook)

            def run():
                bakron.solve_stack(W, A_out, A_in, qs, tile=tile, engine=engine,
                                   method=method, options=opts)
                sync()
            return run
        fns["stack, items"] = stack("auto", hook=False)
        for method in ("antidiagonal", "wavefront", "auto"):
            fns[f"stack, {method}"] = stack(method)
        return fns
    if xp is np:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            threadpool_limits = None
        if threadpool_limits is not None:
            def floor_1():
                with threadpool_limits(limits=1, user_api="blas"):
                    floor()
            # on a loaded machine, a multi-threaded BLAS product of 256² can wait for its
            # helper thread for a scheduler time slice: the floor takes the faster of the two
            fns["floor, 1 BLAS thread"] = floor_1
    for w in workers_list:
        fns[f"stack, {w} worker{'s' if w > 1 else ''}"] = (
            lambda w=w: bakron.solve_stack(W, A_out, A_in, qs, tile=tile, engine=engine,
                                           workers=w))
    return fns


def run_point(B, m, n, *, tile=16, bits=2, dtype="float32", workers=(1,), repeats=5,
              budget=60.0, gpu=False, engine="auto") -> dict:
    """One measurement: median seconds per entry, the stack's ``info`` and the check that
    the stack equals the one-by-one loop bitwise."""
    import bakron

    W, A_out, A_in, qs = make_stack(B, m, n, tile=tile, bits=bits, dtype=dtype)
    xp = np
    if gpu:
        import cupy as xp
        W, A_out, A_in = (xp.asarray(a) for a in (W, A_out, A_in))
    fns = _entries(xp, W, A_out, A_in, qs, tile, workers, engine, gpu=gpu)
    times = interleaved(fns, repeats, budget)
    res = bakron.solve_stack(W, A_out, A_in, qs, tile=tile, engine=engine, workers=workers[-1])
    # bitwise against the single solves of the method the stack ran; and how many entries
    # differ from the single solves of method "auto" (0 in float64; near-ties in float32
    # when the stack ran another method than auto's, docs/stacks.md)
    # (same coarse blocks: the stack's wavefront reports its base, which can differ from the
    # single-layer rule's)
    same, differ = True, 0
    base = {"base": res.info["base"]} if res.info.get("base") else {}
    for i in range(B):
        one = bakron.solve(W[i], A_out[i], A_in[i], qs[i], tile=tile, engine=engine,
                           method=res.method if "," not in res.method else "auto",
                           **base).values
        same = same and bool(xp.all(res.values[i] == one))
        auto = bakron.solve(W[i], A_out[i], A_in[i], qs[i], tile=tile, engine=engine).values
        differ += int(xp.sum(res.values[i] != auto))
    info = {k: v for k, v in res.info.items() if k not in ("stack", "quantizer_calls")}
    return {"median": {k: float(np.median(v)) for k, v in times.items()},
            "runs": {k: len(v) for k, v in times.items()}, "engine": res.engine,
            "method": res.method, "stack": {k: v for k, v in res.info["stack"].items()
                                            if k != "shape"}, "identical": same,
            "differ_from_auto": differ, "info": info}


def _machine(load: bool = True) -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = (f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, numpy "
            f"{np.__version__}")
    return text + (f"; load average {avg:.1f}" if load else "")


def _row(name, t, floor, single):
    return (f"| {name} | {t * 1e3:.1f} ms | {t / floor:.2f}× | "
            f"{t / single:.2f}× |")


def _table(point) -> list[str]:
    med = point["median"]
    floor = min(t for k, t in med.items() if k.startswith("floor"))
    single = med["one by one"]
    lines = ["| entry | time | ÷ summed floor (the faster floor entry) | ÷ one by one |",
             "|---|---|---|---|"]
    for k, t in med.items():
        lines.append(_row(k, t, floor, single))
    return lines


def _shape(B, m, n) -> str:
    return f"{B} × {m}²" if m == n else f"{B} × {m}×{n}"


def _gpu_suite(args, command) -> int:
    """``--gpu --suite``: every workload of ``GPU_SUITE``, one row each."""
    import cupy

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    points = {}
    for B, m, n in GPU_SUITE:
        p = run_point(B, m, n, tile=args.tile, bits=args.bits, dtype=args.dtype,
                      workers=(1,), repeats=args.repeats, budget=args.budget, gpu=True,
                      engine=args.engine)
        points[f"{B}x{m}x{n}"] = p
        print(f"{B} x {m}x{n}: " + ", ".join(f"{k} {v * 1e3:.2f} ms"
                                             for k, v in p["median"].items()), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    data = {"mode": "gpu-suite", "key": args.name or "stacks-gpu-suite", "date": today(),
            "machine": f"one {dev}, TF32 {'on' if args.tf32 else 'off'}, on a host with "
                       f"{_machine(load=False)}",
            "command": command, "dtype": args.dtype, "tile": args.tile, "bits": args.bits,
            "engine": args.engine, "points": points}
    _save(args.out, data["key"], data)
    _publish(args.out, data["key"], suite_section(data))
    return 0


#: the columns of the suite's table: label, entry of ``run_point``'s medians
_SUITE_COLUMNS = (("one by one", "one by one"), ("stack, items", "stack, items"),
                  ("stack, anti-diagonal", "stack, antidiagonal"),
                  ("stack, wavefront", "stack, wavefront"), ("stack, auto", "stack, auto"))


def suite_section(data: dict) -> str:
    """The section of ``--gpu --suite`` from its results (``data/stacks-gpu-suite.json``)."""
    pts = data["points"]
    shapes = {k: tuple(int(v) for v in k.split("x")) for k in pts}
    L = [f"Measured on {data['date']}. Machine: {data['machine']}. {data['dtype']}, tile "
         f"{data['tile']}, {data['bits']}-bit, engine {data['engine']}. Command:", "",
         f"```bash\n{page_command(data['command'])}\n```", "",
         f"Times in ms (the raw rows: `data/{data['key']}.json`):", "",
         "| workload | " + " | ".join(c for c, _ in _SUITE_COLUMNS) + " | summed floor | "
         "auto ÷ one by one | auto ÷ floor | identical |",
         "|---|" + "---:|" * (len(_SUITE_COLUMNS) + 3) + "---|"]
    for k, p in pts.items():
        med = p["median"]
        auto, floor = med["stack, auto"], med["floor"]
        L.append(f"| {_shape(*shapes[k])} | "
                 + " | ".join(f"{med[e] * 1e3:.1f}" for _, e in _SUITE_COLUMNS)
                 + f" | {floor * 1e3:.2f} | {auto / med['one by one']:.2f}× | "
                 f"**{auto / floor:.2f}×** | {p['identical']} |")
    ran = sorted({f"the {p['info'].get('method', p['method'])}"
                  + (f" with coarse blocks of {p['info']['base']} tiles"
                     if p["info"].get("base") else "") for p in pts.values()})
    differ = [str(p["differ_from_auto"]) for p in pts.values()]
    L += ["", "- *one by one*: `bakron.solve` per item (method auto); *stack, items*: the stack "
          "with the cuda engine's stack hook off (the items one after the other); *stack, "
          "anti-diagonal*: one launch over every item's tiles; *stack, wavefront*: per coarse "
          "step one launch over every item's blocks and each feedback GEMM one batched cuBLAS "
          "call over the items; *stack, auto*: what `bakron.solve` runs on the stack (here "
          + " and ".join(ran) + ").",
          "- *identical*: every item of the auto stack equals its single solve of the same "
          "method bitwise. Against the single solves of method `auto` float32 entries differ "
          "on near-ties: " + (", ".join(differ[:-1]) + " and " if len(differ) > 1 else "")
          + differ[-1] + " entries."]
    moe = [k for k, (B, m, n) in shapes.items() if (B, m, n) in ((128, 768, 2048),
                                                              (128, 2048, 768))]
    ratios = {k: pts[k]["median"]["stack, auto"] / pts[k]["median"]["floor"]
              for k in pts if k not in moe}
    if len(moe) == 2:
        auto = sum(pts[k]["median"]["stack, auto"] for k in moe)
        floor = sum(pts[k]["median"]["floor"] for k in moe)
        ratios["the MoE block"] = auto / floor
        L.append(f"- The MoE block (its two stacks of 128 items together: {auto * 1e3:.1f} ms "
                 f"against a summed floor of {floor * 1e3:.1f} ms) takes {auto / floor:.2f}× "
                 "the floor.")
    met = sum(r <= SUITE_TARGET for r in ratios.values())
    L.append(f"- Target auto ÷ floor ≤ {SUITE_TARGET:g}× per workload (the MoE block's two "
             f"stacks as one): met for {met} of {len(ratios)}.")
    return "\n".join(_wrap(x) for x in L)


#: the suite's target: a stack's solve at most this many times its summed floor
SUITE_TARGET = 2.0


def _wrap(line: str) -> str:
    """A prose line of a section in lines of at most 95 characters (tables and code as
    they are; list items keep their hanging indent)."""
    import textwrap

    if not line or line.startswith(("|", "`", "#")) or len(line) <= 95:
        return line
    indent = "  " if line.startswith("- ") else ""
    return textwrap.fill(line, 95, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


def _save(out: str, key: str, data: dict) -> None:
    """A run's results, ``data/KEY.json`` beside the page."""
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    atomic_write_json(os.path.join(out, "data", key + ".json"), data)


def _publish(out: str, key: str, text: str) -> None:
    path = write_section(os.path.join(out, PAGE), key, text, title="Stack benchmarks")
    print("wrote", path, "section", key, flush=True)


#: a Llama-3-8B decoder block (hidden 4096, 8 KV heads of 128, MLP 14336): (name, m, n,
#: which input Hessian, which output Hessian); layers sharing an input share its Hessian
LLAMA3_8B_BLOCK = (("q_proj", 4096, 4096, "attn_in", "q"), ("k_proj", 1024, 4096, "attn_in", "k"),
                   ("v_proj", 1024, 4096, "attn_in", "v"), ("o_proj", 4096, 4096, "o_in", "o"),
                   ("gate_proj", 14336, 4096, "mlp_in", "gate"),
                   ("up_proj", 14336, 4096, "mlp_in", "up"),
                   ("down_proj", 4096, 14336, "down_in", "down"))


def llama_block_layers(rng, dtype="float32") -> list:
    """The layers of :data:`LLAMA3_8B_BLOCK` on the GPU, as ``quantize_layers`` takes them:
    ``(W, H_in, H_out)`` with random weights in ``dtype`` and Wishart Hessians (float32, made
    with the cupy generator ``rng``), one per input or output the block shares."""
    dims = {}
    for _, m, n, hin, hout in LLAMA3_8B_BLOCK:
        dims[hin], dims[hout] = n, m
    hess = {}
    for key, d in dims.items():
        X = rng.standard_normal((d, d + 64), dtype=np.float32)
        hess[key] = (X @ X.T) / X.shape[1]
        del X
    return [(rng.standard_normal((m, n), dtype=np.float32).astype(dtype), hess[hin], hess[hout])
            for _, m, n, hin, hout in LLAMA3_8B_BLOCK]


#: the block's target: its solves at most this many times the summed floor
BLOCK_TARGET = 1.5


def _gpu_block(args, command) -> int:
    """``--gpu --block``: the seven linears of a Llama-3-8B block through
    :func:`bakron.quantize_layers` (the runners' core: factor preparation, same-shape layers
    stacked, metrics off) against the summed floor products of the same shapes."""
    import time

    import cupy

    import bakron

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rng = cupy.random.default_rng(0)
    dt = np.dtype(args.dtype)
    layers = llama_block_layers(rng, dt)
    sync = cupy.cuda.get_current_stream().synchronize

    def run():
        res = bakron.quantize_layers(layers, bits=args.bits, tile=(args.tile, args.tile),
                                     engine=args.engine, metrics="none")
        sync()
        return res

    G = [(cupy.eye(m, dtype=dt) + 0.01 * rng.standard_normal((m, m), dtype=np.float32),
          cupy.eye(n, dtype=dt) + 0.01 * rng.standard_normal((n, n), dtype=np.float32))
         for _, m, n, _, _ in LLAMA3_8B_BLOCK]

    def floor():
        for (GO, GI), (W, _, _) in zip(G, layers):
            GO.T @ W @ GI
        sync()

    run()
    floor()
    walls, solves, floors, infos = [], [], [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        res = run()
        walls.append(time.perf_counter() - t0)
        solves.append(sum(r.seconds_solve for r in res))
        infos = [(r.solve.method, r.solve.info["stack"]["items"], *r.values.shape)
                 for r in res]
        t0 = time.perf_counter()
        floor()
        floors.append(time.perf_counter() - t0)
    wall, solve, fl = (float(np.median(v)) for v in (walls, solves, floors))
    stacks = sorted({f"{b} × {m}×{n}: {meth}" for meth, b, m, n in infos})
    body = ["| block | quantize_layers wall | of which solves | summed floor | wall ÷ floor | "
            "solves ÷ floor |", "|---|---:|---:|---:|---:|---:|",
            f"| Llama-3-8B (7 linears) | {wall * 1e3:.1f} ms | {solve * 1e3:.1f} ms | "
            f"{fl * 1e3:.2f} ms | {wall / fl:.2f}× | {solve / fl:.2f}× |", "",
            f"Target for the solves ≤ {BLOCK_TARGET:g}×: "
            f"{'met' if solve / fl <= BLOCK_TARGET else 'missed'}."]
    print("\n".join(body), flush=True)
    intro = [f"The seven linears of a Llama-3-8B block (q, o: 4096²; k, v: 1024×4096; gate, "
             f"up: 14336×4096; down: 4096×14336), {args.dtype}, tile {args.tile}, "
             f"{args.bits}-bit, two-sided, on {dev} (cupy, engine {args.engine}, TF32 "
             f"{'on' if args.tf32 else 'off'}), through `bakron.quantize_layers` with "
             f"`metrics=\"none\"` (factor preparation from the Hessians, same-shape layers "
             f"solved as one stack).", "",
             f"Stacks solved: {'; '.join(stacks)}. *of which solves*: the stacks' solve times "
             f"(`seconds_solve` summed); the rest of the wall time prepares the factors "
             f"(damping, Cholesky, inverse) and fits the grids. *summed floor*: `G_Oᵀ W G_I` "
             f"of the seven shapes. Medians of {args.repeats} rounds."]
    _write(args, "stacks-gpu-block", "A Llama-3-8B block through the runner on the GPU",
           intro, body, command, {"wall_s": walls, "solves_s": solves, "floor_s": floors,
                                  "stacks": stacks})
    return 0


def _write(args, key, title, intro, body, command, raw):
    """Publish a mode's section ``key`` (``--name`` instead, when given) of the page, its
    heading ``title``, with the date and the command; ``raw``, the measurements, goes to
    ``data/KEY.json`` beside it."""
    key = args.name or key
    _save(args.out, key, {"mode": key, "date": today(), "command": command, "raw": raw})
    text = [f"### {title}", "", f"Measured on {today()}. " + intro[0], *intro[1:], "",
            "Command:", "", f"```bash\n{page_command(command)}\n```", "", *body]
    _publish(args.out, key, "\n".join(_wrap(x) for x in text))


def _threads_point(args) -> dict:
    """Run one ``--threads`` point in a fresh process with its thread environment."""
    t = args.point
    return run_point(args.B, args.m, args.n, tile=args.tile, bits=args.bits, dtype=args.dtype,
                     workers=(1, t) if t > 1 else (1,), repeats=args.repeats,
                     budget=args.budget)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bakron.bench_stack", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=64, help="items in the stack (default 64)")
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--tile", type=int, default=16)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per entry at most")
    ap.add_argument("--workers", default="1,2", help="stack thread counts (default mode)")
    ap.add_argument("--threads", default=None, help="e.g. 1,4,16: fresh process per count")
    ap.add_argument("--label", default="", help="what engine variant --threads measures")
    ap.add_argument("--gpu", action="store_true", help="cupy on the current device")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 (with --gpu)")
    ap.add_argument("--engine", default="auto", help="engine of every solve (default auto)")
    ap.add_argument("--suite", action="store_true",
                    help="with --gpu: every workload of GPU_SUITE, one table")
    ap.add_argument("--block", action="store_true",
                    help="with --gpu: a Llama-3-8B block through quantize_layers")
    ap.add_argument("--name", default=None,
                    help="the run's section of the page and its data file (default by mode)")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="measure nothing: rewrite the section of --gpu --suite in --out from "
                         "its results (data/stacks-gpu-suite.json)")
    ap.add_argument("--out", default=os.path.join("docs", "benchmarks"))
    ap.add_argument("--point", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render, encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("mode") != "gpu-suite":
            ap.error(f"--render {args.render}: not the results of --gpu --suite")
        _publish(args.out, data["key"], suite_section(data))
        return 0
    command = "python -m bakron.bench_stack " + " ".join(shlex.quote(a) for a in (
        sys.argv[1:] if argv is None else argv))
    size = f"{args.B} × {args.m}×{args.n}"
    shape = f"{size}, {args.dtype}, tile {args.tile}, {args.bits}-bit"

    if args.point is not None:  # a child of --threads
        print(json.dumps(_threads_point(args)))
        return 0

    if args.threads:
        counts = [int(t) for t in args.threads.split(",")]
        body = ["| threads t | one by one (t BLAS threads) | stack, 1 worker | stack, t workers "
                "| summed floor (t threads) | one by one ÷ floor | best stack ÷ floor | best "
                "stack ÷ one by one | identical |", "|---|---|---|---|---|---|---|---|---|"]
        raw = {}
        for t in counts:
            env = dict(os.environ, OPENBLAS_NUM_THREADS=str(t), NUMBA_NUM_THREADS=str(t),
                       OMP_NUM_THREADS=str(t))
            child = [a for a in (sys.argv[1:] if argv is None else argv)]
            out = subprocess.run([sys.executable, "-m", "bakron.bench_stack", *child,
                                  "--point", str(t)], env=env, check=True,
                                 capture_output=True, text=True).stdout
            p = json.loads(out.strip().splitlines()[-1])
            raw[t] = p
            med = p["median"]
            one, floor, s1 = med["one by one"], med["floor"], med["stack, 1 worker"]
            st = med.get(f"stack, {t} workers", s1)
            best = min(s1, st)
            body.append(f"| {t} | {one * 1e3:.0f} ms | {s1 * 1e3:.0f} ms | "
                        f"{st * 1e3:.0f} ms | {floor * 1e3:.1f} ms | {one / floor:.2f}× | "
                        f"{best / floor:.2f}× | {best / one:.2f}× | {p['identical']} |")
            print(body[-1], flush=True)
        label = f" ({args.label})" if args.label else ""
        intro = [f"Stack of {shape}, CPU thread counts{label}.", "",
                 f"Machine: {_machine()}.", "",
                 "One fresh process per thread count t (`OPENBLAS_NUM_THREADS` = "
                 "`NUMBA_NUM_THREADS` = t); medians of interleaved rounds. *identical*: the "
                 "stack's values equal the one-by-one solves bitwise."]
        _write(args, "stacks-cpu-threads", f"Stacks of layers on CPU threads: {size}{label}",
               intro, body, command, raw)
        return 0

    if args.gpu:
        if not args.tf32:
            os.environ.setdefault("CUPY_TF32", "0")
        import cupy

        if args.suite:
            return _gpu_suite(args, command)
        if args.block:
            return _gpu_block(args, command)

        p = run_point(args.B, args.m, args.n, tile=args.tile, bits=args.bits, dtype=args.dtype,
                      workers=(1,), repeats=args.repeats, budget=args.budget, gpu=True)
        dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        intro = [f"Stack of {shape} on {dev} (cupy, engine {p['engine']}, method "
                 f"{p['method']}, TF32 {'on' if args.tf32 else 'off'}).", "",
                 f"Stack path: {p['stack']['path']}; identical to one by one: "
                 f"{p['identical']}; medians of {max(p['runs'].values())} interleaved rounds."]
        _write(args, "stacks-gpu", f"Stacks of layers on the GPU: {size}", intro, _table(p),
               command, p)
        print("\n".join(_table(p)))
        return 0

    workers = tuple(int(w) for w in args.workers.split(","))
    load0 = os.getloadavg()[0]
    p = run_point(args.B, args.m, args.n, tile=args.tile, bits=args.bits, dtype=args.dtype,
                  workers=workers, repeats=args.repeats, budget=args.budget)
    load1 = os.getloadavg()[0]
    intro = [f"Stack of {shape} (engine {p['engine']}, method {p['method']}).", "",
             f"Machine: {_machine(load=False)}; load average "
             f"{load0:.1f} at start, {load1:.1f} at the end.", "",
             f"Stack path with {workers[-1]} worker(s): {p['stack']['path']}; identical to "
             f"one by one: {p['identical']}; "
             f"medians of {max(p['runs'].values())} interleaved rounds."]
    _write(args, "stacks-cpu", f"Stacks of layers on the CPU: {size}", intro, _table(p),
           command, p)
    print("\n".join(_table(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
