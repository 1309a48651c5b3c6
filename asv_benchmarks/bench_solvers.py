"""The rounding solvers on the CPU: method x shape x dtype x engine.

* ``time_solve`` / ``peakmem_solve``: wall time and process peak memory (asv) of one solve
  (tile 16 x 16, 2-bit grid with per-row RMS scales, Wishart Hessians);
* ``track_time_over_floor``: median solve time ÷ median time of the floor product
  ``G_Oᵀ W G_I`` (numpy, same dtype), 7 of each, interleaved — lower is better;
* ``track_proxy_over_rtn``: proxy error ``tr(E H_I Eᵀ H_O) / tr(W H_I Wᵀ H_O)`` of the result
  ÷ that of round-to-nearest — lower is better (> 1 happens at 2 bits);
* ``track_extra_memory_mn``: peak array memory allocated by one solve (tracemalloc), in
  units of ``m n`` elements of the dtype, outputs included — lower is better; the project's
  budget is ≤ 3 for the recursive solver (the factors are passed in W's dtype, so no cast counts).

The ``track_`` ratios are rounded to 3 significant digits (asv runs a ``track_`` once per
commit: it has no rounds).

Default run: 256² … 2048², float32 and float64, engines numba and array_api; slow
combinations (the O(n⁴) direct anti-diagonal beyond 1024², the array-API engine beyond
1024², float64 beyond 1024²) and the MLP shapes 4096 x 11008 / 11008 x 4096 are skipped
unless ``BAKRON_ASV_FULL=1``. numba's JIT is warmed up in ``setup``.

``OneSided``: one-sided problems (``A_out=None``) on the numba engine, the recursion and the
wavefront, 512² … 2048², float32, against the floor ``W G_I``.
"""
import os
import time

import numpy as np

import bakron

from . import sig3

FULL = os.environ.get("BAKRON_ASV_FULL", "") not in ("", "0")
TILE = 16
BITS = 2
SHAPES = ["256x256", "512x512", "1024x1024", "2048x2048", "4096x11008", "11008x4096"]
METHODS = ["recursive", "wavefront", "antidiagonal", "antidiagonal-direct"]
_CACHE = {}


def _shape(s):
    m, n = (int(x) for x in s.split("x"))
    return m, n


def _hessian(rng, n):
    """A Wishart-like SPD matrix; low-rank-plus-identity above 4096 (cheaper to form)."""
    if n <= 4096:
        X = rng.standard_normal((n, n + 64))
        return X @ X.T / X.shape[1]
    X = rng.standard_normal((n, 256))
    return X @ X.T / 256 + np.eye(n)


def _problem(shape, dtype):
    key = (shape, dtype)
    if key not in _CACHE:
        m, n = _shape(shape)
        rng = np.random.default_rng(0)
        W = rng.standard_normal((m, n))
        f_in = bakron.prepare_factor(_hessian(rng, n), TILE)
        f_out = bakron.prepare_factor(_hessian(rng, m), TILE)
        dt = np.dtype(dtype)
        _CACHE.clear()  # one problem at a time (the MLP shapes are large)
        _CACHE[key] = dict(W=W.astype(dt), A_out=f_out.A.astype(dt), A_in=f_in.A.astype(dt),
                           H_in=f_in.H, H_out=f_out.H,
                           q=bakron.UniformQuantizer.fit(W, BITS))
    return _CACHE[key]


def _over_floor(floor, solve, rounds=7):
    """Median time of ``solve()`` ÷ median time of ``floor()``, ``rounds`` of each
    interleaved, to 3 significant digits."""
    tf, ts = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        floor()
        tf.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        solve()
        ts.append(time.perf_counter() - t0)
    return sig3(np.median(ts) / np.median(tf))


def _skip(method, shape, dtype, engine):
    m, n = _shape(shape)
    big = max(m, n)
    if method == "wavefront" and engine == "array_api":
        return True  # the two-level wavefront runs on the compiled engines only
    if FULL:
        return method == "antidiagonal-direct" and big > 2048
    if big > 2048:
        return True
    if dtype == "float64" and big > 1024:
        return True
    if engine == "array_api" and big > 1024:
        return True
    if method == "antidiagonal-direct" and big > (1024 if engine == "numba" else 256):
        return True
    return False


class Solvers:
    params = [METHODS, SHAPES, ["float32", "float64"], ["numba", "array_api"]]
    param_names = ["method", "shape", "dtype", "engine"]
    timeout = 900
    number = 1
    repeat = (3, 10, 60.0)  # 3 to 10 samples per round (2 rounds), until 60 s

    def setup(self, method, shape, dtype, engine):
        if _skip(method, shape, dtype, engine):
            raise NotImplementedError("skipped by default (set BAKRON_ASV_FULL=1)")
        if engine == "numba":
            from bakron.backends import numba_cpu

            if not numba_cpu.available():
                raise NotImplementedError("numba is not installed")
            numba_cpu.warm_up()
        self.p = _problem(shape, dtype)
        meth, _, variant = method.partition("-")
        self.kw = dict(tile=TILE, method=meth, variant=variant or "accumulator", engine=engine)
        self._solve()  # JIT, BLAS buffers, caches

    def _solve(self):
        p = self.p
        return bakron.solve(p["W"], p["A_out"], p["A_in"], p["q"], **self.kw)

    def time_solve(self, method, shape, dtype, engine):
        self._solve()

    def peakmem_solve(self, method, shape, dtype, engine):
        self._solve()

    def track_time_over_floor(self, method, shape, dtype, engine):
        p = self.p
        m, n = p["W"].shape
        GO = np.eye(m, dtype=p["W"].dtype) + p["A_out"]
        GI = np.eye(n, dtype=p["W"].dtype) + p["A_in"]
        return _over_floor(lambda: GO.T @ p["W"] @ GI, self._solve)

    track_time_over_floor.unit = "× floor"

    def track_proxy_over_rtn(self, method, shape, dtype, engine):
        p = self.p
        Wq = self._solve().values
        rtn, _ = p["q"].rtn(p["W"])
        err = bakron.proxy_error(p["W"], Wq, p["H_in"], p["H_out"])
        return sig3(err / bakron.proxy_error(p["W"], rtn, p["H_in"], p["H_out"]))

    track_proxy_over_rtn.unit = "× RTN"

    def track_extra_memory_mn(self, method, shape, dtype, engine):
        """Peak of the array memory allocated during one solve (tracemalloc sees numpy's
        allocations; the numba engine allocates its large buffers through numpy), outputs
        included, in units of m n elements."""
        import tracemalloc

        p = self.p
        m, n = p["W"].shape
        tracemalloc.start()
        try:
            r = self._solve()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del r
        return sig3(peak / (m * n * p["W"].dtype.itemsize))

    track_extra_memory_mn.unit = "m·n elements"


class OneSided:
    """One-sided problems (``A_out=None``, LDLQ/GPTQ) on the numba engine: the recursion and
    the two-level wavefront (which ``auto`` takes from ``WAVEFRONT_ONE_SIDED_MIN_THREADS``
    numba threads), float32; ``track_time_over_floor`` against ``W G_I``."""

    params = [["recursive", "wavefront"], ["512x512", "1024x1024", "2048x2048"]]
    param_names = ["method", "shape"]
    timeout = 600
    number = 1
    repeat = (3, 10, 60.0)

    def setup(self, method, shape):
        from bakron.backends import numba_cpu

        if not numba_cpu.available():
            raise NotImplementedError("numba is not installed")
        numba_cpu.warm_up()
        self.p = _problem(shape, "float32")
        self.kw = dict(tile=TILE, method=method, engine="numba")
        self._solve()

    def _solve(self):
        p = self.p
        return bakron.solve(p["W"], None, p["A_in"], p["q"], **self.kw)

    def time_solve(self, method, shape):
        self._solve()

    def track_time_over_floor(self, method, shape):
        p = self.p
        GI = np.eye(p["W"].shape[1], dtype=p["W"].dtype) + p["A_in"]
        return _over_floor(lambda: p["W"] @ GI, self._solve)

    track_time_over_floor.unit = "× floor"
