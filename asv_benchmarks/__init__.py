"""asv benchmarks of bakron (``asv run --python=same``; ``asv check --python=same``).

``bench_solvers``: the solvers on the CPU (time, peak memory, time ÷ floor, proxy error ÷
RTN). Set ``BAKRON_ASV_FULL=1`` to include the 4096 x 11008 and 11008 x 4096 MLP shapes
and the slow baselines at every size.
"""
