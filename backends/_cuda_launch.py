"""Launch a compiled numba-cuda kernel with raw arguments, without numba's per-launch Python.

A numba-cuda launch (``_Kernel.launch``) looks the context up, converts every argument by
type and builds a launch configuration each time: under cProfile on the H200 about 0.1 ms a
launch, and 0.1 ms more when a dispatcher infers the types of cupy arrays (docs/engines.md,
"Launching without numba's dispatch"). The GPU engine and its checks launch kernels compiled
for raw pointers and int64 scalars, whose arguments need no conversion: this module hands
them to ``cuda.core.launch`` (the call numba itself ends in) with the kernel handle and the
launch configuration cached. If that path fails once (another numba-cuda or cuda.core
version), a warning says so and every later launch goes through numba's own ``launch``.
Imported by the CUDA engine only when it launches (never under the simulator).
"""
from __future__ import annotations

_HANDLES: dict = {}   # (id(overload), device) -> (overload, kernel, launch, cooperative)
_CONFIGS: dict = {}   # (grid, block, cooperative) -> LaunchConfig
_STREAMS: dict = {}   # id(numba stream) -> (numba stream, cuda.core Stream)
_DIRECT = [True]      # False after the direct path failed once


def _config(grid: tuple, block: tuple, cooperative: bool):
    key = (grid, block, cooperative)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        from cuda.core import LaunchConfig
        try:
            cfg = LaunchConfig(grid=grid, block=block, shmem_size=0, is_cooperative=cooperative)
        except TypeError:  # cuda.core before 1.0
            cfg = LaunchConfig(grid=grid, block=block, shmem_size=0,
                               cooperative_launch=cooperative)
        _CONFIGS[key] = cfg
    return cfg


def _core_stream(stream):
    """The cuda.core ``Stream`` of a numba stream (made once from its handle: passing foreign
    stream objects to ``cuda.core.launch`` is deprecated there)."""
    hit = _STREAMS.get(id(stream))
    if hit is None:
        from cuda.core import Stream
        try:
            core = Stream.from_handle(int(stream.__cuda_stream__()[1]))
        except Exception:  # noqa: BLE001 -- e.g. a handle it does not take: the object itself
            core = stream
        hit = _STREAMS[id(stream)] = (stream, core)
    return hit[1]


def launch(overload, dev: int, grid: tuple, block: tuple, stream, args: tuple) -> None:
    """Launch ``overload`` (a compiled ``_Kernel`` of a dispatcher with an explicit
    signature of pointers and integers) on device ``dev``'s current context with ``args``
    (Python ints: device addresses and int64 values) on the numba ``stream``."""
    if _DIRECT[0]:
        try:
            key = (id(overload), dev)
            hit = _HANDLES.get(key)
            if hit is None:
                from cuda.core import launch as core_launch
                hit = _HANDLES[key] = (overload, overload._codelibrary.get_cufunc().kernel,
                                       core_launch, bool(overload.cooperative))
            hit[2](_core_stream(stream), _config(grid, block, hit[3]), hit[1], *args)
            return
        except Exception as exc:  # noqa: BLE001 -- any failure: numba's own launch from now on
            _DIRECT[0] = False
            import warnings
            warnings.warn(f"bakron cuda engine: direct kernel launch failed ({exc!r}); "
                          "launching through numba-cuda from now on (slower launches)",
                          RuntimeWarning)
    overload.launch(args, grid, block, stream, 0)
