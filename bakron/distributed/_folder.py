"""``quantize_folder``: the distributed mode of ``bakron quantize IN --out OUT``."""
from __future__ import annotations

import os
import sys

from ..layer_groups import STACK_MEMORY
from ._jobs import jobs_from_path, tensor_shape
from ._outputs import LockHeld
from ._run import (EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_UNAVAILABLE, EXIT_USAGE,
                   EXIT_WRITE_FAILED, run_layers)

__all__ = ["quantize_folder"]


def _err(msg: str) -> None:
    print(f"bakron quantize: {msg}", file=sys.stderr, flush=True)


def quantize_folder(in_path, out_dir, *, scheduler: str | None = None, gpus: int = 0,
                    workers: int = 0, retries: int = 2, quiet: bool = False,
                    stack_memory: int | None = STACK_MEMORY, **settings) -> int:
    """Quantize a layer file or a folder of layer files into ``out_dir``; return an exit code.

    ``scheduler``: address of a running Dask scheduler (``tcp://host:8786``), whose workers
    must see the same paths; ``gpus=N``: start a loopback cluster with one worker per GPU (the
    first N visible); ``workers=N``: a loopback CPU cluster of N processes; none of them: run in
    this process. ``stack_memory``: same-shape layers run as stacks of at most this many
    estimated bytes, one task each (:func:`run_layers`; ``None``: one layer per task).
    ``settings`` are the solve settings of :data:`DEFAULT_SETTINGS` (``bits``,
    ``tile``, ``method``, ``engine``, ``damp``, ``symmetric``, ``granularity``,
    ``group_size``, ``scale_method``, ``device``, ``dtype``, ``one_sided``).

    OUT is resumable: run the same command again and only missing or invalid layers are
    solved. A non-empty OUT that is not a bakron output folder is refused (exit 3).

    Exit codes (those of ``bakron quantize``): 0 every layer done; 1 some layers failed (the
    others are written; ``OUT/manifest.json`` says which and why); 2 bad input, settings or
    options (nothing solved); 3 OUT is in use by another driver, or is a non-empty folder
    that bakron did not write; 4 Dask, or the GPUs asked
    for, are not available; 5 the output could not be written (I/O error); 130 interrupted
    (finished layers are kept; re-run to resume).
    """
    if sum(bool(x) for x in (scheduler, gpus, workers)) > 1:
        _err("give at most one of --scheduler, --gpus and --workers")
        return EXIT_USAGE
    try:
        jobs = jobs_from_path(in_path, **settings)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    tile = (jobs[0].settings.get("tile") if jobs else None) or [16, 16]
    for j in jobs:  # a tile larger than a layer: a usage error before anything is written
        try:
            m, n = tensor_shape(j.W)[:2]
        except (ValueError, KeyError, FileNotFoundError) as exc:
            _err(str(exc))
            return EXIT_USAGE
        if tile[0] > m or tile[1] > n:
            _err(f"--tile {tile[0]}x{tile[1]} is larger than layer {j.name} ({m} x {n}); use a "
                 f"tile no larger than the smallest layer")
            return EXIT_USAGE
    if gpus:
        from .cluster import visible_gpus

        have = len(visible_gpus())
        if have < int(gpus):
            _err(f"--gpus {gpus}: this machine shows {have} GPU{'s' if have != 1 else ''} "
                 f"(CUDA_VISIBLE_DEVICES / nvidia-smi)")
            return EXIT_UNAVAILABLE
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.isfile(out_dir):
        _err(f"--out {out_dir} is a file; give a folder")
        return EXIT_USAGE
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not (
            os.path.exists(os.path.join(out_dir, "manifest.json"))
            or os.path.isdir(os.path.join(out_dir, ".bakron"))):
        _err(f"{out_dir} is a non-empty folder that is not a bakron output; choose an empty "
             f"or new folder (an earlier distributed bakron output folder is resumed)")
        return EXIT_LOCKED  # 3, as `bakron quantize` for an OUT it may not replace
    client = cluster = None
    if scheduler or gpus or workers:
        try:
            from distributed import Client
        except ImportError:
            _err("--scheduler/--gpus need Dask: pip install 'bakron[dask]'")
            return EXIT_UNAVAILABLE
        from .cluster import cpu_cluster, gpu_cluster

        try:
            if scheduler:
                client = Client(scheduler, timeout="30s")
            elif gpus:
                cluster = gpu_cluster(int(gpus))
            else:
                cluster = cpu_cluster(int(workers))
            if cluster is not None:
                client = Client(cluster)
        except ValueError as exc:  # e.g. fewer GPUs visible than asked for
            _err(str(exc))
            return EXIT_UNAVAILABLE
        except (OSError, TimeoutError) as exc:
            _err(f"cannot start or reach the Dask cluster: {exc}")
            if cluster is not None:
                cluster.close()
            return EXIT_UNAVAILABLE
    try:
        res = run_layers(jobs, out_dir, client, retries=retries, progress=not quiet,
                         stack_memory=stack_memory)
    except LockHeld as exc:
        _err(str(exc))
        return EXIT_LOCKED
    except KeyboardInterrupt:
        _err("interrupted; finished layers are kept, run the same command again to resume")
        return EXIT_INTERRUPTED
    except OSError as exc:
        _err(f"could not write the output ({exc}); finished layers are kept")
        return EXIT_WRITE_FAILED
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
    if not quiet:
        print(f"bakron quantize: {res.summary()}; manifest: "
              f"{os.path.join(out_dir, 'manifest.json')}", file=sys.stderr)
        for name, err in res.failed.items():
            print(f"bakron quantize: layer {name} failed: {err}", file=sys.stderr)
    return res.exit_code
