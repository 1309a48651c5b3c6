"""Global Hessians: memory against recomputation over budgets, for a deep chain.

``GlobalFactorsBudget`` runs ``bakron.hessian.global_factors`` on 32 x (Linear 128x128 + GELU)
with 512 calibration samples at budgets that are fractions of what storing everything needs:
``peakmem_`` is the process peak (asv), ``track_peak_working_mib`` the driver's ledger (what
the budget bounds), ``track_recompute_factor`` the stage evaluations relative to one
store-all pass, ``track_passes`` the passes over the calibration data.
``CheckpointSchedules`` compares the three schedules inside one pass of a 64-stage chain.
``InputFactors`` runs the forward-only ``H_in`` pass (``input_factors``) on the same chain as
the store-all ``GlobalFactorsBudget`` and tracks its time and working memory relative to it.
The figure in docs/hessian.md comes from ``python -m bakron.hessian._plot``.
"""
import numpy as np

from bakron.hessian import global_factors, input_factors, reversal_cost
from bakron.hessian._examples import deep_chain

from . import sig3

DEPTH, WIDTH, SAMPLES, BATCHES = 32, 128, 512, 2
_PROBLEM = {}


def _problem():
    if not _PROBLEM:
        stages = deep_chain(DEPTH, WIDTH, seed=0)
        X = np.random.default_rng(1).standard_normal((SAMPLES, WIDTH))
        bs = SAMPLES // BATCHES
        _, rep = global_factors(stages, X, batch_size=bs, sink=_drop)
        _PROBLEM.update(stages=stages, X=X, bs=bs, top=rep.peak_bytes)
    return _PROBLEM


def _drop(name, H_in, H_out):
    """Finished factors are not kept (a real run writes them out): working memory only."""


class GlobalFactorsBudget:
    params = [[1.0, 0.5, 0.35, 0.25]]
    param_names = ["budget_fraction"]
    timeout = 300
    number = 1
    repeat = (5, 10, 60.0)  # ~0.4 s each on 2 cores: 10 samples per round, 2 rounds

    def setup(self, frac):
        p = _problem()
        self.stages, self.X, self.bs = p["stages"], p["X"], p["bs"]
        self.budget = None if frac >= 1 else int(frac * p["top"])
        self.report = None

    def _run(self):
        _, self.report = global_factors(self.stages, self.X, batch_size=self.bs,
                                        budget_bytes=self.budget, sink=_drop)
        return self.report

    def time_global_factors(self, frac):
        self._run()

    def peakmem_global_factors(self, frac):
        self._run()

    def track_peak_working_mib(self, frac):
        return sig3(self._run().peak_bytes / 2.0 ** 20)
    track_peak_working_mib.unit = "MiB"

    def track_recompute_factor(self, frac):
        return sig3(self._run().recompute_factor)
    track_recompute_factor.unit = "x store-all"

    def track_passes(self, frac):
        return self._run().passes
    track_passes.unit = "passes"


class CheckpointSchedules:
    """One pass over a 64-stage chain (narrow, so the schedule's bookkeeping shows)."""

    params = [["store_all", "bisection", "binomial-4", "binomial-2"]]
    param_names = ["schedule"]
    timeout = 300
    number = 1
    repeat = (5, 10, 60.0)

    def setup(self, schedule):
        self.stages = deep_chain(32, 32, seed=2)
        self.X = np.random.default_rng(3).standard_normal((256, 32))
        name, _, k = schedule.partition("-")
        self.kw = {"checkpoint": name, "snapshots": int(k) if k else None}

    def _run(self):
        _, rep = global_factors(self.stages, self.X, sink=_drop, **self.kw)
        return rep

    def time_pass(self, schedule):
        self._run()

    def track_stage_evals(self, schedule):
        rep = self._run()
        expected = reversal_cost(rep.n_stages, rep.sweeps[0].schedule,
                                 rep.sweeps[0].snapshots, loss=True)
        assert rep.stage_evals == expected, (rep.stage_evals, expected)
        return rep.stage_evals
    track_stage_evals.unit = "stage evaluations"

    def track_peak_states(self, schedule):
        return self._run().peak_states
    track_peak_states.unit = "states"


class InputFactors:
    """``H_in`` alone by forward passes (what one-sided rounding needs) on the chain of
    ``GlobalFactorsBudget``, against the store-all K-FAC pass of both factors."""

    timeout = 300
    number = 1
    repeat = (5, 10, 60.0)

    def setup(self):
        p = _problem()
        self.stages, self.X, self.bs, self.top = p["stages"], p["X"], p["bs"], p["top"]

    def _run(self):
        _, rep = input_factors(self.stages, self.X, batch_size=self.bs, sink=_drop)
        return rep

    def time_input_factors(self):
        self._run()

    def peakmem_input_factors(self):
        self._run()

    def track_working_memory_vs_global(self):
        return sig3(self._run().peak_bytes / self.top)
    track_working_memory_vs_global.unit = "x global store-all"
