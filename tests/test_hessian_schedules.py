"""Checkpoint schedules: the cost formulas, and the driver's counts against them."""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest

import bakron.hessian as bh


@lru_cache(maxsize=None)
def _optimal(l, s):
    """Brute-force dynamic programme: fewest forward evaluations to reverse l stages with s
    snapshots (the segment's input included), gradient at the end given."""
    if l == 1:
        return 0
    if s == 1:
        return l * (l - 1) // 2
    return min(m + _optimal(l - m, s - 1) + _optimal(m, s) for m in range(1, l))


def test_binomial_closed_form_is_optimal():
    for l in range(1, 41):
        for s in range(1, 9):
            assert bh.binomial_cost(l, s) == _optimal(l, s), (l, s)


def test_binomial_steps_bound_the_reversible_length():
    # with r repetitions, C(s + r, s) stages are the most that s snapshots can reverse
    for s in range(1, 6):
        for r in range(0, 5):
            lmax = bh.binomial_steps(s, r)
            assert bh.binomial_cost(lmax, s) <= r * lmax
            if r >= 1:  # one stage more needs a further repetition for some stage
                assert bh.binomial_cost(lmax + 1, s) > bh.binomial_cost(lmax, s) + r


def test_bisection_formulas():
    for l in range(1, 300):
        assert bh.bisection_slots(l) <= math.ceil(math.log2(l)) + 1
        # bisection never beats the optimal schedule with as many snapshots
        assert bh.bisection_cost(l) >= bh.binomial_cost(l, bh.bisection_slots(l))
    for k in range(0, 9):
        assert bh.bisection_cost(2 ** k) == k * 2 ** (k - 1) if k else bh.bisection_cost(1) == 0
        assert bh.bisection_slots(2 ** k) == k + 1


def test_reversal_cost_dispatch():
    assert bh.reversal_cost(9, "store_all") == 8
    assert bh.reversal_cost(9, "store_all", loss=True) == 9
    assert bh.reversal_cost(9, "binomial", 9) == 8            # enough snapshots: store all
    assert bh.reversal_cost(9, "binomial", 1) == 36           # one snapshot: quadratic
    with pytest.raises(ValueError, match="schedule must be one of"):
        bh.reversal_cost(3, "revolve")
    with pytest.raises(ValueError, match="snapshots must be a positive integer"):
        bh.reversal_cost(3, "binomial", 0)


def _chain(L, width=3, seed=0):
    """L stages alternating Linear / GELU (L >= 1), then the head."""
    rng = np.random.default_rng(seed)
    stages = []
    for i in range(L):
        if i % 2 == 0:
            stages.append(bh.Linear(rng.standard_normal((width, width)) / 2, name=f"l{i}"))
        else:
            stages.append(bh.GELU())
    return stages + [bh.SoftmaxCrossEntropy()]


@pytest.mark.parametrize("L", [1, 2, 3, 6, 11])
@pytest.mark.parametrize("schedule,snapshots", [("store_all", None), ("bisection", None),
                                                ("binomial", 1), ("binomial", 2),
                                                ("binomial", 3)])
def test_driver_counts_match_the_formulas(L, schedule, snapshots):
    stages = _chain(L)
    X = np.random.default_rng(1).standard_normal((5, 3))
    batches = [X[:2], X[2:]]
    got, rep = bh.global_factors(stages, batches, checkpoint=schedule, snapshots=snapshots)
    (sweep,) = rep.sweeps
    s = bh.reversal_slots(L, schedule, snapshots)
    assert sweep.snapshots == s
    assert sweep.stage_evals == 2 * bh.reversal_cost(L, schedule, snapshots, loss=True)
    assert sweep.vjp_evals == 2 * L and sweep.head_evals == 2
    # live states: the snapshots other than the input, the state being advanced, and the
    # gradient in and out
    assert rep.peak_states <= s + 2
    ref, _ = bh.global_factors(stages, batches)
    assert got.keys() == ref.keys()
    for name in ref:
        for a, b in zip(got[name], ref[name]):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)


def test_binomial_evaluations_fall_with_snapshots():
    stages = _chain(16, width=2)
    X = np.random.default_rng(2).standard_normal((3, 2))
    evals = []
    for s in range(1, 17):
        _, rep = bh.global_factors(stages, X, snapshots=s)
        evals.append(rep.stage_evals)
        assert rep.stage_evals == bh.binomial_cost(16, s) + 1
    assert evals == sorted(evals, reverse=True) and evals[-1] == 16 and evals[0] == 121
