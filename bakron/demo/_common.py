"""Pieces shared by the model demos (MiniLM, SmolLM2): progress lines, the array namespace,
the BLAS thread limit, per-phase clocks with peak memory, markdown tables, PNG bytes, the
solver warm-up and a cache of prepared factors."""
from __future__ import annotations

import contextlib
import io as _stdio
import resource
import sys
import time

import numpy as np

__all__ = ["log", "namespace", "blas_limit", "Clock", "PeakMemory", "md_table", "png",
           "warm_up", "prepare_cached", "ProxyPairs"]


def log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def blas_limit(threads):
    """:func:`bakron._lib.threads.blas_limit`, yielding a description for the reports."""
    from .._lib.threads import blas_limit as limit

    with limit(threads, "blas_threads") as applied:
        yield ("library default" if threads is None
               else f"{applied} (threadpoolctl)" if applied is not None
               else "library default (threadpoolctl is not installed)")


class PeakMemory:
    """Peak memory of a phase.

    CPU: the process's peak resident set (Linux ``VmHWM``, reset at each phase start through
    ``/proc/self/clear_refs``; elsewhere ``ru_maxrss``, the peak since the process started,
    which cannot be reset — ``resettable`` says which). GPU (cupy): the bytes held by cupy's
    default memory pool at the end of the phase after freeing its cached blocks at the start
    (the pool keeps what it allocated, so this is the phase's high-water mark of pool memory).
    """

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.resettable = device == "gpu" or self._reset_rss()
        self.what = ("cupy memory pool (device)" if device == "gpu" else
                     "peak resident set of the process (VmHWM, reset per phase)"
                     if self.resettable else "peak resident set since the process started")

    @staticmethod
    def _reset_rss() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _rss_peak() -> int:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(kb) * (1 if sys.platform == "darwin" else 1024)

    def reset(self) -> None:
        if self.device == "gpu":
            import cupy

            cupy.cuda.Device().synchronize()
            cupy.get_default_memory_pool().free_all_blocks()
        elif self.resettable:
            self._reset_rss()

    def peak(self) -> int:
        if self.device == "gpu":
            import cupy

            cupy.cuda.Device().synchronize()
            return int(cupy.get_default_memory_pool().total_bytes())
        return self._rss_peak()


class Clock:
    """Wall and CPU seconds per phase (CPU time counts every thread of this process), and
    the peak memory of each phase when ``memory`` (a :class:`PeakMemory`) is given."""

    def __init__(self, memory: PeakMemory | None = None):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.memory = memory
        self._t = None

    def start(self):
        if self.memory is not None:
            self.memory.reset()
        self._t = (time.perf_counter(), time.process_time())

    def stop(self, name: str) -> float:
        w, c = self._t
        self.wall[name] = time.perf_counter() - w
        self.cpu[name] = time.process_time() - c
        if self.memory is not None:
            self.peak[name] = self.memory.peak()
        return self.wall[name]


def md_table(rows) -> str:
    out = ["| " + " | ".join(map(str, rows[0])) + " |",
           "|" + "|".join("---" for _ in rows[0]) + "|"]
    out += ["| " + " | ".join(map(str, r)) + " |" for r in rows[1:]]
    return "\n".join(out)


def png(fig) -> bytes:
    buf = _stdio.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def warm_up(xp, tile, grid: dict | None = None):
    """Tiny one- and two-sided solves so that compiled engines are built before timing.

    ``grid``: keyword arguments of :meth:`bakron.UniformQuantizer.fit` for the grid the run
    uses (default: per-row symmetric, RMS-fitted), so that the kernels it needs are compiled.

    ``tile=None`` picks the tile: ``(1, 1)`` — exact element-by-element LDLQ, the rule for a
    scalar grid — when a compiled engine (numba on the CPU, CUDA on the GPU) runs it, else
    ``(16, 16)`` (the array-API engine pays Python overhead per tile). A compiled engine that
    fails here (e.g. a numba build that does not match the installed numpy) is replaced by the
    array-API engine for the whole run. Returns ``(tile, engine used, engine argument, note)``.
    """
    from .. import UniformQuantizer, _xp, prepare_factor, solve

    W = xp.asarray(np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64))
    q = UniformQuantizer.fit(W, 2, **(grid or {}))

    def probe(t, engine):
        Ai = xp.astype(prepare_factor(xp.eye(64, dtype=xp.float64), t[1]).A, xp.float32)
        Ao = xp.astype(prepare_factor(xp.eye(64, dtype=xp.float64), t[0]).A, xp.float32)
        solve(W, None, Ai, q, tile=t, engine=engine)
        used = solve(W, Ao, Ai, q, tile=t, engine=engine).engine
        _xp.sync(xp)
        return used

    engine_arg, note = "auto", None
    try:
        used = probe(tile or (1, 1), "auto")
    except Exception as exc:  # noqa: BLE001 - a broken compiled engine, not bad input
        engine_arg = "array_api"
        note = f"compiled engine failed ({type(exc).__name__}: {exc}); array-API engine used"
        used = probe(tile or (16, 16), engine_arg)
    if tile is None:
        tile = (1, 1) if used != "array_api" else (16, 16)
    return tile, used, engine_arg, note


def prepare_cached(cache, H, block, damp, key=None, shrink: float = 0.0):
    """``prepare_factor`` once per (matrix, block): ``(A in float32, seconds, damping)``;
    ``(None, 0.0, None)`` for ``H=None`` (one-sided). ``key`` names the matrix in ``cache``
    (default its ``id``); ``shrink``: see :func:`bakron.prepare_factor`."""
    from .. import _xp, prepare_factor

    if H is None:
        return None, 0.0, None
    key = (id(H) if key is None else key, block)
    if key not in cache:
        xp = _xp.namespace(H)
        t0 = time.perf_counter()
        f = prepare_factor(H, block, damp=damp, shrink=shrink)
        A = xp.astype(f.A, xp.float32)
        _xp.sync(xp)
        cache[key] = (A, time.perf_counter() - t0, f.damp)
    return cache[key]


class ProxyPairs:
    """Proxy errors of one layer under several named (H_I, H_O) pairs, through the library's
    one implementation (:class:`bakron._lib.proxy.ProxyMetrics`) with float32 products (the
    demos' per-layer figures).

    A pair that is the same matrices under two names (e.g. the attention kind's
    ``(H_I, None)`` of a feed-forward layer and the one-sided pair) is computed once per
    weight matrix.
    """

    def __init__(self, xp, W, pairs: dict):
        from .._lib.proxy import ProxyMetrics

        self.pairs, self._by_key, self._memo = {}, {}, {}
        for k, (Hi, Ho) in pairs.items():
            key = (id(Hi), id(Ho))
            if key not in self._by_key:
                self._by_key[key] = ProxyMetrics(xp, W, Hi, Ho, dtype=xp.float32)
            self.pairs[k] = key

    def __call__(self, values, metric: str) -> float:
        key = self.pairs[metric]
        memo = (id(values), key)
        if memo not in self._memo:
            self._memo[memo] = (values, self._by_key[key].error(values, "two"))
        return self._memo[memo][1]
