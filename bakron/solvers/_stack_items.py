"""How the items of a validated stack run: the stack layer's one contact with the
single-layer solve's internals (``Problem``, the engine choice, the engine's own entry
points), kept in this module so that a change of the engine contract touches one file.

``engine_check`` picks each item's engine before any work; ``solve_item`` runs one item the
way :func:`bakron.solve` runs it after its checks; ``ItemRunner`` runs ranges of items (on
the caller's thread or in worker threads) and copies their results into the stack.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

from .. import _xp

__all__ = ["ItemRunner", "blas_threads", "capability", "cores", "engine_check", "solve_item"]


def capability(eng, key: str):
    """An engine's stack capability: the field ``key`` of its capability table
    (``CAPABILITIES``) when it has one, else its attribute ``key`` (``None`` when absent)."""
    caps = getattr(eng, "CAPABILITIES", None)
    if caps is not None and hasattr(caps, key):
        return getattr(caps, key)
    return getattr(eng, key, None)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


@contextmanager
def blas_threads(n: int | None):
    """Limit BLAS to ``n`` threads inside the block (threadpoolctl; a process-wide setting).
    Yields the limit applied, or ``None`` when nothing was changed."""
    if n is None:
        yield None
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield None
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield n


def engine_check(solvers, xp, chunk, engine: str, return_targets: bool) -> dict:
    """Resolve the engine of every distinct quantizer on item 0's shapes, before any work, so
    that an engine that cannot run the stack fails early. Returns ``{id(q): (name, engine)}``
    (``engine`` is ``None`` for the array-API path where the solver package has no engine
    object for it).

    This is the one place where the stack layer uses the single-layer solve's internals
    (``Problem`` and the engine choice, ``_pick_engine`` or the older ``_resolve_engine``)."""
    from ._problem import Problem

    W0, A_out0, A_in0, _ = chunk.item(0)
    want = "array_api" if return_targets and engine == "auto" else engine
    pick = getattr(solvers, "_pick_engine", None)
    out, by_type = {}, {}
    for q in chunk.quantizers:
        if id(q) in out:
            continue
        if type(q) in by_type:  # engines choose by the quantizer's type, not its scales
            out[id(q)] = by_type[type(q)]
            continue
        p = Problem(xp, W0, A_out0, A_in0, q, chunk.tile, record_targets=return_targets)
        if pick is not None:
            eng = pick(want, p, chunk.method, chunk.variant)
            name = eng.NAME
        else:
            name, eng = solvers._resolve_engine(want, p)
        if chunk.method == "wavefront" and name != "cuda":
            raise ValueError("method='wavefront' (the two-level GPU schedule) runs on the cuda "
                             "engine only (cupy arrays); use 'recursive', 'antidiagonal' or "
                             "'auto'")
        out[id(q)] = by_type[type(q)] = (name, eng)
    return out


def solve_item(W, A_out, A_in, quantizer, engine: tuple, kw: dict):
    """One item of a validated stack, with the engine chosen by ``engine_check``.

    The stack has checked every item already, so the item goes straight to its engine
    instead of through :func:`bakron.solve`, whose checks (structure of both factors,
    finiteness) cost about a quarter of a 256² solve. What runs is what ``solve`` runs after
    its checks: the engine's measured ``auto_base``/``auto_method`` rules, then the engine's
    ``run`` (engines with a capability table) or ``solve`` (older engine modules). Anything
    else (the array-API path, a method an engine declines) goes through ``solve`` itself."""
    from . import SolveResult, solve
    from ._problem import Problem

    name, eng = engine
    runs = callable(getattr(eng, "run", None)) and hasattr(eng, "CAPABILITIES")
    if eng is None or name == "array_api" or not (runs or callable(getattr(eng, "solve", None))):
        return solve(W, A_out, A_in, quantizer, **kw)
    xp = _xp.namespace(W)
    p = Problem(xp, W, A_out, A_in, quantizer, kw["tile"], record_targets=kw["return_targets"])
    base = int(eng.auto_base(p)) if kw["base"] is None else int(kw["base"])
    method = eng.auto_method(p, base) if kw["method"] == "auto" else kw["method"]
    variant = kw["variant"]
    info = {"base": base, "variant": variant if method == "antidiagonal" else None}
    _xp.sync(xp)
    t0 = time.perf_counter()
    if runs:
        out = eng.run(p, method, base, variant)
        values, codes, targets = out.values, out.codes, out.targets
        info.update(out.info)
    elif eng.solve(p, method, base, variant):
        values, codes, targets = p.Wq, p.codes, p.T
        info["quantizer_calls"] = p.quantizer_calls
    else:  # a method the engine leaves to the generic drivers
        return solve(W, A_out, A_in, quantizer, **kw)
    _xp.sync(xp)
    return SolveResult(values=values, codes=codes, method=method, engine=name,
                       seconds=time.perf_counter() - t0, tile=kw["tile"], targets=targets,
                       info=info)


class ItemRunner:
    """Solves items (``solve_item``) and copies their results into the stacked outputs
    (each item writes only its own rows, so threads never share an output element)."""

    def __init__(self, chunk, kwargs: dict, numba_threads: int | None,
                 engines: dict):
        self.chunk = chunk
        self.chosen = engines  # id(quantizer) -> (name, engine), from engine_check
        self.kwargs = kwargs
        self.numba_threads = numba_threads
        self.codes = None
        self.codes_none = 0
        self.quantizer_calls = 0
        self.methods: set = set()
        self.engines: set = set()
        self.first_info: dict = {}
        self.lock = threading.Lock()

    @contextmanager
    def _numba_limit(self):
        """numba's thread count belongs to the calling thread: set it for this run and put
        it back afterwards (the first item runs on the caller's thread)."""
        numba = sys.modules.get("numba")
        if self.numba_threads is None or numba is None:
            yield
            return
        before = numba.get_num_threads()
        numba.set_num_threads(min(self.numba_threads, numba.config.NUMBA_NUM_THREADS))
        try:
            yield
        finally:
            numba.set_num_threads(before)

    def run(self, start: int, stop: int) -> None:
        c = self.chunk
        with self._numba_limit():
            for i in range(start, stop):
                W_i, A_out_i, A_in_i, q = c.item(i)
                r = solve_item(W_i, A_out_i, A_in_i, q, self.chosen[id(q)], self.kwargs)
                c.values[i, ...] = r.values
                if c.targets is not None and r.targets is not None:
                    c.targets[i, ...] = r.targets
                codes = self._codes_for(r.codes)
                if codes is not None:
                    codes[i, ...] = r.codes
                self._record(r.method, r.engine, r.info)

    def _codes_for(self, item_codes):
        """The stacked codes array (allocated by the first item that has codes)."""
        with self.lock:
            if item_codes is None:
                self.codes_none += 1
                return None
            if self.codes is None:
                v = self.chunk.values
                xp = _xp.namespace(v)
                self.codes = xp.zeros(tuple(v.shape), dtype=item_codes.dtype,
                                      device=_xp.device(v))
            return self.codes

    def _record(self, method, engine, info) -> None:
        with self.lock:
            self.methods.add(method)
            self.engines.add(engine)
            self.quantizer_calls += int(info.get("quantizer_calls", 0))
            if not self.first_info:
                self.first_info = {k: v for k, v in info.items() if k != "quantizer_calls"}

    def take_engine_infos(self, chunk, infos) -> None:
        if chunk.codes is not None:
            self.codes = chunk.codes
        for info in infos:
            self._record(info.get("method", self.kwargs["method"]),
                         info.get("engine", "?"), info)

    def final_codes(self):
        if self.codes is not None and self.codes_none:
            raise TypeError(f"the quantizers of the stack disagree: {self.codes_none} items "
                            f"returned no codes while others did; a stack needs quantizers "
                            f"that all return codes or all return None")
        return self.codes
