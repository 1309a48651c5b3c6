"""asv benchmarks of bakron; docs/benchmarking.md says how to run, compare and publish them.

``bench_smoke``: one small case of each kind (``-b Smoke``; CI runs it with ``--quick``).
``bench_solvers``: the solvers on the CPU (time, peak memory, time ÷ floor, proxy error ÷
RTN). Set ``BAKRON_ASV_FULL=1`` to include the 4096 x 11008 and 11008 x 4096 MLP shapes
and the slow baselines at every size.
``bench_hessian``: global Hessian factors against a memory budget, checkpoint schedules.
"""
import math


def sig3(x) -> float:
    """``x`` rounded to 3 significant digits, so that asv shows ``1.89`` and not 16 digits (a
    ratio of two timings is not known better than that)."""
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, 2 - int(math.floor(math.log10(abs(x)))))
