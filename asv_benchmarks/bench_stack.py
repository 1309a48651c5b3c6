"""Stacks of layers on the CPU: ``bakron.solve`` on a ``(B, m, n)`` stack.

* ``time_stack`` / ``time_one_by_one``: the whole stack in one call, and the loop of
  single-layer solves it replaces (same inputs);
* ``track_stack_over_one_by_one``: median stack time ÷ median loop time, measured
  interleaved — lower is better (≤ 1 asked for 64 × 256²);
* ``track_stack_over_floor``: median stack time ÷ the summed floor products
  ``G_Oᵀ W G_I`` of its items — lower is better;
* ``track_extra_memory_bmn``: peak array memory of one stacked solve (tracemalloc), outputs
  included, in units of ``B m n`` elements — at most 4 asked.

fp32, tile 16, 2 bits, two-sided, per-item quantizers, 8 distinct factor pairs cycled over
the items (``bakron.bench_stack.make_stack``).
"""
import time

import numpy as np

import bakron

PARAMS = ["64x256x256", "16x512x512"]


def _parse(s):
    return tuple(int(x) for x in s.split("x"))


class Stack:
    params = [PARAMS, ["numba", "array_api"]]
    param_names = ["stack", "engine"]
    timeout = 900
    number = 1
    repeat = (1, 5, 60.0)

    def setup(self, stack, engine):
        from bakron.bench_stack import make_stack

        if engine == "numba":
            from bakron.backends import numba_cpu

            if not numba_cpu.available():
                raise NotImplementedError("numba is not installed")
            numba_cpu.warm_up()
        elif stack != PARAMS[0]:
            raise NotImplementedError("the array-API engine only on the first stack")
        B, m, n = _parse(stack)
        self.W, self.A_out, self.A_in, self.qs = make_stack(B, m, n)
        self.kw = dict(tile=16, engine=engine)
        self._stack()  # JIT, caches

    def _stack(self):
        return bakron.solve(self.W, self.A_out, self.A_in, self.qs, **self.kw)

    def _one_by_one(self):
        for i in range(self.W.shape[0]):
            bakron.solve(self.W[i], self.A_out[i], self.A_in[i], self.qs[i], **self.kw)

    def _floor(self):
        m, n = self.W.shape[1:]
        for i in range(self.W.shape[0]):
            (np.eye(m, dtype=self.W.dtype) + self.A_out[i]).T @ self.W[i] @ (
                np.eye(n, dtype=self.W.dtype) + self.A_in[i])

    def _ratio(self, f, g):
        tf, tg = [], []
        for _ in range(3):
            for fn, acc in ((f, tf), (g, tg)):
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
        return float(np.median(tf) / np.median(tg))

    def time_stack(self, stack, engine):
        self._stack()

    def time_one_by_one(self, stack, engine):
        self._one_by_one()

    def track_stack_over_one_by_one(self, stack, engine):
        return self._ratio(self._stack, self._one_by_one)

    track_stack_over_one_by_one.unit = "× one by one"

    def track_stack_over_floor(self, stack, engine):
        return self._ratio(self._stack, self._floor)

    track_stack_over_floor.unit = "× floor"

    def track_extra_memory_bmn(self, stack, engine):
        import tracemalloc

        tracemalloc.start()
        try:
            r = self._stack()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del r
        return float(peak / (self.W.size * self.W.dtype.itemsize))

    track_extra_memory_bmn.unit = "B·m·n elements"
