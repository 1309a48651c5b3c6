"""The smoke subset: one small case of each kind, for CI and for histories over many commits.

``asv run --python=same --quick -b Smoke`` (CI, under a minute once numba's kernels are
cached) fails when bakron or a benchmark cannot be imported or raises; ``asv run
main~5..main -b Smoke`` draws a history in a few minutes per commit. Every figure is also in the
full suite (bench_solvers, bench_hessian) at larger sizes.
"""
import numpy as np

import bakron
from bakron.hessian import global_factors
from bakron.hessian._examples import deep_chain

from . import sig3

M = N = 256
TILE, BITS = 16, 2


def _problem(dtype):
    rng = np.random.default_rng(0)
    W = rng.standard_normal((M, N))
    X = rng.standard_normal((N, N + 64))
    Y = rng.standard_normal((M, M + 64))
    f_in = bakron.prepare_factor(X @ X.T / X.shape[1], TILE)
    f_out = bakron.prepare_factor(Y @ Y.T / Y.shape[1], TILE)
    dt = np.dtype(dtype)
    return dict(W=W.astype(dt), A_out=f_out.A.astype(dt), A_in=f_in.A.astype(dt),
                H_in=f_in.H, H_out=f_out.H, q=bakron.UniformQuantizer.fit(W, BITS))


class Smoke:
    """256 x 256, float32, tile 16, 2 bits: the recursive solver on both CPU engines."""

    params = [["numba", "array_api"]]
    param_names = ["engine"]
    number = 1
    repeat = (5, 15, 20.0)
    timeout = 300

    def setup(self, engine):
        if engine == "numba":
            from bakron.backends import numba_cpu

            if not numba_cpu.available():
                raise NotImplementedError("numba is not installed")
            numba_cpu.warm_up()
        self.p = _problem("float32")
        self.kw = dict(tile=TILE, method="recursive", engine=engine)
        self._solve()

    def _solve(self):
        p = self.p
        return bakron.solve(p["W"], p["A_out"], p["A_in"], p["q"], **self.kw)

    def time_solve(self, engine):
        self._solve()

    def track_proxy_over_rtn(self, engine):
        p = self.p
        rtn, _ = p["q"].rtn(p["W"])
        err = bakron.proxy_error(p["W"], self._solve().values, p["H_in"], p["H_out"])
        return sig3(err / bakron.proxy_error(p["W"], rtn, p["H_in"], p["H_out"]))

    track_proxy_over_rtn.unit = "× RTN"


class SmokeHessian:
    """Global factors of an 8 x (Linear 64x64 + GELU) chain, 256 samples, store-all."""

    number = 1
    repeat = (5, 15, 20.0)
    timeout = 300

    def setup(self):
        self.stages = deep_chain(8, 64, seed=0)
        self.X = np.random.default_rng(1).standard_normal((256, 64))

    def time_global_factors(self):
        global_factors(self.stages, self.X, batch_size=128, sink=lambda *a: None)
