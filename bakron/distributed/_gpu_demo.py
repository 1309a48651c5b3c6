"""Multi-GPU scale-out measurement: large synthetic layers, one Dask worker per GPU.

    python -m bakron.distributed._gpu_demo --gpus 2 --out gpu-scaleout

1. writes ``--layers`` synthetic two-sided layers of ``--shape`` (weights float32 safetensors,
   factors as packed float64 factor files) into a scratch folder;
2. hashes the inputs once (the job keys; timed separately);
3. for k = 1 and k = N GPUs: starts a loopback cluster with one single-threaded worker per GPU
   (``gpu_cluster``), warms every worker up (cupy context, CUDA kernels compiled on a small
   layer), then times ``run_layers`` over all layers into a fresh output folder;
4. checks that both runs wrote bitwise-identical layers, and writes ``result.json`` and
   ``result.md`` (the table for docs/distributed.md) into ``--out``.

The client process never imports cupy: the GPUs are counted with ``nvidia-smi``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

from ..solvers.options import environment


def _warm(tile, bits, dry=False):
    """Run on every worker before timing: CUDA context and kernel compilation."""
    import numpy as np

    if dry:
        return {"device": "cpu (dry run)", "engine": "array_api", "method": None,
                "cuda_visible_devices": environment("CUDA_VISIBLE_DEVICES")}

    import cupy as cp

    from bakron import quantize_layer

    rng = np.random.default_rng(0)
    n = 512
    W = cp.asarray(rng.standard_normal((n, n)).astype(np.float32))
    X = rng.standard_normal((n, n))
    H = cp.asarray(X.T @ X)
    r = quantize_layer(W, H, H, bits=bits, tile=tile)
    cp.cuda.get_current_stream().synchronize()
    return {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
            "engine": r.solve.engine, "method": r.solve.method,
            "cuda_visible_devices": environment("CUDA_VISIBLE_DEVICES")}


def _timed_run(jobs, out, ids, tile, bits, log, dry=False):
    from distributed import Client

    from bakron.distributed import gpu_cluster, run_layers

    t0 = time.perf_counter()
    cluster = gpu_cluster(list(ids))
    client = Client(cluster)
    try:
        client.wait_for_workers(len(ids), timeout=300)
        t_start = time.perf_counter() - t0
        warm = client.run(_warm, tile, bits, dry)
        t1 = time.perf_counter()
        res = run_layers(jobs, out, client, retries=1)
        wall = time.perf_counter() - t1
    finally:
        client.close()
        cluster.close()
    if not res.ok:
        raise SystemExit(f"run on GPUs {ids} failed: {res.failed}")
    per_layer = [r["seconds"] for r in res.layers.values()]
    workers = sorted({r["worker"] for r in res.layers.values()})
    log(f"  {len(ids)} GPU(s): {wall:.2f} s wall for {len(jobs)} layers "
        f"(cluster start {t_start:.1f} s, not counted), {len(workers)} workers used")
    return {"gpus": len(ids), "ids": list(ids), "wall_s": wall, "cluster_start_s": t_start,
            "layer_seconds_sum": sum(per_layer), "layer_seconds_max": max(per_layer),
            "workers_used": len(workers), "warmup": list(warm.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bakron.distributed._gpu_demo",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=None, help="GPUs for the scaled run (default: "
                   "all visible)")
    p.add_argument("--layers", type=int, default=16, help="number of layers (default 16)")
    p.add_argument("--shape", default="4096x4096", help="m x n of every layer (default "
                   "4096x4096)")
    p.add_argument("--tile", type=int, default=16)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--rank", type=int, default=512, help="rank of the synthetic factors")
    p.add_argument("--out", default="gpu-scaleout", help="folder for result.json/result.md")
    p.add_argument("--workdir", default=None, help="scratch folder for data and outputs "
                   "(default: a temporary folder, removed at the end)")
    p.add_argument("--dry-run", action="store_true", help="check the plumbing on a CPU "
                   "machine: two fake GPU ids, CPU solves (the timings mean nothing)")
    args = p.parse_args(argv)

    def log(msg):
        print(msg, flush=True)

    try:
        import distributed  # noqa: F401
    except ImportError:
        log("error: dask.distributed is not installed here (pip install 'bakron[dask]', or put "
            "an installed copy on PYTHONPATH)")
        return 4
    from bakron import __version__
    from bakron import _safetensors
    from bakron.distributed import LayerJob, tensor_checksum, visible_gpus
    from bakron.distributed._synthetic import write_synthetic_layers

    ids = ["0", "1"] if args.dry_run else visible_gpus()
    n_gpus = args.gpus or len(ids)
    if n_gpus < 2 or len(ids) < n_gpus:
        log(f"error: need at least 2 visible GPUs for a speed-up (visible: {ids}, asked for "
            f"{args.gpus})")
        return 4
    ids = ids[:n_gpus]
    m, n = (int(v) for v in args.shape.lower().split("x"))
    work = args.workdir or tempfile.mkdtemp(prefix="bakron-gpu-demo-")
    os.makedirs(work, exist_ok=True)
    try:
        t0 = time.perf_counter()
        layers = write_synthetic_layers(os.path.join(work, "in"), [(m, n)] * args.layers,
                                        seed=0, rank=args.rank)
        t_data = time.perf_counter() - t0
        log(f"wrote {args.layers} layers of {m} x {n} (two-sided, dense factors) in "
            f"{t_data:.1f} s")
        jobs = [LayerJob.make(d["name"], d["W"], d["H_in"], d["H_out"], bits=args.bits,
                              tile=args.tile, device="cpu" if args.dry_run else "gpu",
                              engine="array_api" if args.dry_run else "auto")
                for d in layers]
        t0 = time.perf_counter()
        for j in jobs:
            for ref in j.inputs().values():
                tensor_checksum(ref)
        t_hash = time.perf_counter() - t0
        log(f"hashed the inputs (job keys) in {t_hash:.1f} s (cached for both runs)")
        runs = []
        for k in (1, n_gpus):
            out = os.path.join(work, f"out{k}")
            shutil.rmtree(out, ignore_errors=True)
            runs.append(_timed_run(jobs, out, ids[:k], args.tile, args.bits, log,
                                   args.dry_run))
        same = True
        for j in jobs:
            a = _safetensors.load(os.path.join(work, "out1", "layers", f"{j.name}.safetensors"))
            b = _safetensors.load(os.path.join(work, f"out{n_gpus}", "layers",
                                               f"{j.name}.safetensors"))
            same &= all((a[t] == b[t]).all() for t in a)
        speedup = runs[0]["wall_s"] / runs[1]["wall_s"]
        result = {"bakron": __version__, "python": platform.python_version(),
                  "host": platform.node(), "layers": args.layers, "shape": [m, n],
                  "tile": args.tile, "bits": args.bits, "data_seconds": t_data,
                  "hash_seconds": t_hash, "runs": runs, "speedup": speedup,
                  "ideal_speedup": n_gpus, "efficiency": speedup / n_gpus,
                  "bitwise_identical_outputs": bool(same),
                  "command": "python -m bakron.distributed._gpu_demo " + " ".join(
                      sys.argv[1:] if argv is None else argv)}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
        dev = runs[0]["warmup"][0]["device"] if runs[0]["warmup"] else "?"
        md = [f"{args.layers} layers of {m} x {n}, tile {args.tile}, {args.bits} bits, "
              f"float32 weights, two-sided; {dev}; bakron {__version__}",
              "", "| GPUs | wall (s) | sum of per-layer task time (s) | speed-up |",
              "|---|---|---|---|"]
        for r in runs:
            md.append(f"| {r['gpus']} | {r['wall_s']:.2f} | {r['layer_seconds_sum']:.2f} | "
                      f"{runs[0]['wall_s'] / r['wall_s']:.2f}x |")
        md += ["", f"Outputs of the two runs bitwise identical: {same}. Input hashing "
               f"{t_hash:.1f} s and cluster start-up are not in the wall times.",
               "", f"Command: `{result['command']}`"]
        with open(os.path.join(args.out, "result.md"), "w") as f:
            f.write("\n".join(md) + "\n")
        log("\n".join(md))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
