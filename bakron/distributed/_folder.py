"""``quantize_folder``: the distributed mode of ``bakron quantize IN --out OUT``."""
from __future__ import annotations

import os
import sys

from ._jobs import jobs_from_path
from ._outputs import LockHeld
from ._run import EXIT_LOCKED, EXIT_USAGE, run_layers

__all__ = ["quantize_folder"]


def _err(msg: str) -> None:
    print(f"bakron: error: {msg}", file=sys.stderr, flush=True)


def quantize_folder(in_path, out_dir, *, scheduler: str | None = None, gpus: int = 0,
                    workers: int = 0, retries: int = 2, progress: bool = True,
                    quiet: bool = False, **settings) -> int:
    """Quantize a layer file or a folder of layer files into ``out_dir``; returns an exit code.

    ``scheduler``: address of a running Dask scheduler (``tcp://host:8786``) -- its workers must
    see the same file paths; ``gpus``: start a local cluster with one worker per GPU (N GPUs);
    ``workers``: start a local CPU cluster of that many processes; none of them: run in this
    process. ``settings`` are the solve settings (``bits``, ``tile``, ``method``, ``engine``,
    ``damp``, ``symmetric``, ``granularity``, ``group_size``, ``scale_method``, ``device``,
    ``dtype``). Re-running with the same OUT resumes: only missing or invalid layers are solved.

    Exit codes: 0 all layers done; 1 some layers failed (the others are written, see
    ``OUT/manifest.json``); 2 bad input, settings or options; 3 OUT is in use by another
    driver.
    """
    if sum(bool(x) for x in (scheduler, gpus, workers)) > 1:
        _err("give at most one of --scheduler, --gpus and --workers")
        return EXIT_USAGE
    try:
        jobs = jobs_from_path(in_path, **settings)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.isfile(out_dir):
        _err(f"--out {out_dir} is a file; give a folder")
        return EXIT_USAGE
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not (
            os.path.exists(os.path.join(out_dir, "manifest.json"))
            or os.path.isdir(os.path.join(out_dir, ".bakron"))):
        _err(f"--out {out_dir} is a non-empty folder that is not a bakron output; choose an "
             f"empty or new folder (an earlier bakron output folder is resumed)")
        return EXIT_USAGE
    client = cluster = None
    if scheduler or gpus or workers:
        try:
            from distributed import Client
        except ImportError:
            _err("--scheduler/--gpus/--workers need Dask: pip install 'bakron[dask]'")
            return EXIT_USAGE
        from .cluster import cpu_cluster, gpu_cluster

        try:
            if scheduler:
                client = Client(scheduler, timeout="30s")
            else:
                cluster = gpu_cluster(int(gpus)) if gpus else cpu_cluster(int(workers))
                client = Client(cluster)
        except (ValueError, OSError, TimeoutError) as exc:
            _err(f"cannot start or reach the Dask cluster: {exc}")
            if cluster is not None:
                cluster.close()
            return EXIT_USAGE
    try:
        res = run_layers(jobs, out_dir, client, retries=retries,
                         progress=progress and not quiet)
    except LockHeld as exc:
        _err(str(exc))
        return EXIT_LOCKED
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
    if not quiet:
        print(f"bakron: {res.summary()}; manifest: {os.path.join(out_dir, 'manifest.json')}",
              file=sys.stderr)
        for name, err in res.failed.items():
            print(f"bakron: layer {name} failed: {err}", file=sys.stderr)
    return res.exit_code
