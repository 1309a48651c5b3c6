"""How the items of a validated stack run: the stack layer's one contact with the
single-layer solve's internals (``Problem``, the engine choice, the engine's own entry
points), kept in this module so that a change of the engine contract touches one file.

``engine_check`` picks each item's engine before any work; ``solve_item`` runs one item the
way :func:`bakron.solve` runs it after its checks; ``ItemRunner`` runs ranges of items (on
the caller's thread or in worker threads) and copies their results into the stack.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

from .. import _xp

__all__ = ["ItemRunner", "engine_check", "solve_item"]


def engine_check(solvers, xp, chunk, engine: str, return_targets: bool) -> dict:
    """Resolve the engine of every distinct quantizer on item 0's shapes, before any work, so
    that an engine that cannot run the stack fails early. Returns ``{id(q): engine}``.

    With :func:`solve_item`, the one place where the stack layer uses the single-layer
    solve's internals (``Problem`` and ``_pick_engine``)."""
    from ._problem import Problem

    W0, A_out0, A_in0, _ = chunk.item(0)
    want = "array_api" if (return_targets and engine == "auto"
                           and chunk.method != "wavefront") else engine
    out, by_type = {}, {}
    for q in chunk.quantizers:
        if id(q) in out:
            continue
        if type(q) in by_type:  # engines choose by the quantizer's type, not its scales
            out[id(q)] = by_type[type(q)]
            continue
        p = Problem(xp, W0, A_out0, A_in0, q, chunk.tile, record_targets=return_targets,
                    options=chunk.options)
        eng = solvers._pick_engine(want, p, chunk.method, chunk.variant)
        solvers.check_wavefront(eng, chunk.method)
        out[id(q)] = by_type[type(q)] = eng
    return out


def solve_item(W, A_out, A_in, quantizer, eng, kw: dict):
    """One item of a validated stack on the engine chosen by ``engine_check``.

    The stack has checked every item already, so the item skips :func:`bakron.solve`'s checks
    (structure of both factors, finiteness: about a quarter of a 256² solve) and runs what
    ``solve`` runs after them, :func:`bakron.solvers._execute.execute`."""
    from ._execute import execute
    from ._problem import Problem

    p = Problem(_xp.namespace(W), W, A_out, A_in, quantizer, kw["tile"],
                record_targets=kw["return_targets"], options=kw["options"])
    return execute(p, eng, kw["method"], kw["base"], kw["variant"], kw.get("max_naive_bytes"))


class ItemRunner:
    """Solves items (``solve_item``) and copies their results into the stacked outputs
    (each item writes only its own rows, so threads never share an output element)."""

    def __init__(self, chunk, kwargs: dict, numba_threads: int | None,
                 engines: dict):
        self.chunk = chunk
        self.chosen = engines  # id(quantizer) -> engine, from engine_check
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
                self.codes = xp.empty(tuple(v.shape), dtype=item_codes.dtype,
                                      device=_xp.device(v))  # every item writes its codes
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
