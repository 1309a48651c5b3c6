"""The causal-LM demo (``bakron demo --model smollm2``): a tiny random Llama offline, the quick
variant on the real SmolLM2 (downloaded once into the cache; skipped, with the reason, when
that is impossible), argument errors, and the driver's K-FAC sink the demo relies on."""
from __future__ import annotations

import json

import numpy as np
import pytest

import bakron.hessian as bh


# -- the driver's kfac_sink ---------------------------------------------------------------------

def _mlp_chain(rng):
    W1 = rng.standard_normal((48, 40)) / 6
    W2 = rng.standard_normal((40, 48)) / 6
    return [bh.Linear(W1, name="fc1"), bh.GELU(), bh.Linear(W2, name="fc2"),
            bh.SoftmaxCrossEntropy()]


@pytest.mark.parametrize("split", [False, True])
def test_kfac_sink_hands_out_the_kfac_factors_of_a_refined_run(split):
    rng = np.random.default_rng(0)
    stages = _mlp_chain(rng)
    X = rng.standard_normal((12, 40))
    kfac, full = bh.global_factors(stages, X, batch_size=4, seed=3)
    budget = None
    if split:   # the smallest budget that still plans: layer ranges are bisected
        budget = full.peak_bytes
        while True:
            try:
                bh.plan_global(stages, X, batch_size=4, budget_bytes=budget - 64)
            except ValueError:
                break
            budget -= 64
        assert len(bh.plan_global(stages, X, batch_size=4, budget_bytes=budget)["leaves"]) > 1
    plain, _ = bh.global_factors(stages, X, batch_size=4, seed=3, refine_iters=1,
                                 budget_bytes=budget)
    seen = {}
    refined, _ = bh.global_factors(stages, X, batch_size=4, seed=3, refine_iters=1,
                                     budget_bytes=budget,
                                     kfac_sink=lambda n, a, b: seen.__setitem__(n, (a, b)))
    assert set(seen) == {"fc1", "fc2"}
    for n in seen:
        for got, want in zip(seen[n], kfac[n]):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
        for got, want in zip(refined[n], plain[n]):     # the hook changes nothing else
            np.testing.assert_array_equal(got, want)
        # and the refinement did move H_in away from the plain input covariance
        assert not np.allclose(refined[n][0] / np.trace(refined[n][0]),
                               kfac[n][0] / np.trace(kfac[n][0]), rtol=1e-3)
    called = []
    bh.global_factors(stages, X, batch_size=4, kfac_sink=lambda *a: called.append(a))
    assert called == []    # without refinement the final factors are the K-FAC ones
