"""Cross-fitted H_out: the estimator itself and the Hessian pass that splits its batches."""
from __future__ import annotations

import array_api_compat.numpy as xp
import numpy as np
import pytest

import bakron.hessian as bh
from bakron.hessian._examples import random_mlp
from bakron.factors import estimator_folds
from bakron.hessian.crossfit import crossfit, crossfit_folds


def _second_moment(rng, L, n):
    g = rng.standard_normal((n, L.shape[0])) @ L.T
    return g.T @ g / n


@pytest.fixture(scope="module")
def halves():
    rng = np.random.default_rng(0)
    m = 40
    L = rng.standard_normal((m, m)) * np.linspace(0.05, 1.0, m)   # a spread spectrum
    return L @ L.T, _second_moment(rng, L, 60), _second_moment(rng, L, 90)


def test_identical_halves_give_the_factor_back(halves):
    _, H, _ = halves
    np.testing.assert_allclose(crossfit(xp, H, 3.0, H.copy(), 5.0), H, atol=1e-12)


def test_symmetric_psd_trace_and_order_of_halves(halves):
    _, Ha, Hb = halves
    H = crossfit(xp, Ha, 60.0, Hb, 90.0)
    np.testing.assert_array_equal(H, H.T)
    assert np.linalg.eigvalsh(H).min() > 0
    # the trace is that of the pooled mean: each way keeps the measuring half's trace
    np.testing.assert_allclose(np.trace(H), np.trace((60 * Ha + 90 * Hb) / 150), rtol=1e-12)
    np.testing.assert_allclose(crossfit(xp, Hb, 90.0, Ha, 60.0), H, rtol=1e-12, atol=1e-14)


def test_each_way_measures_one_half_along_the_other_halfs_eigenvectors(halves):
    _, Ha, Hb = halves
    H = crossfit(xp, Ha, 1e-12, Hb, 1.0)   # (b's eigenvectors measured on a weigh nothing)
    _, U = np.linalg.eigh(Ha)
    np.testing.assert_allclose(U.T @ H @ U, np.diag(np.diag(U.T @ Hb @ U)), atol=1e-9)


def test_small_eigenvalues_are_not_underestimated(halves):
    """The solver puts its error in the directions a factor calls cheapest. The pooled
    sample factor underestimates what its ten smallest directions are worth; the
    cross-fitted factor, measured on rows its directions were not fitted to, does not."""
    S, Ha, Hb = halves

    def log_said_over_true(H):
        w, U = np.linalg.eigh(H)
        bottom = U[:, :10]
        return np.mean(np.log(w[:10] / np.diag(bottom.T @ S @ bottom)))

    assert log_said_over_true((60 * Ha + 90 * Hb) / 150) < -0.3
    assert log_said_over_true(crossfit(xp, Ha, 60.0, Hb, 90.0)) > 0.0


def test_halves_need_weight(halves):
    _, Ha, Hb = halves
    with pytest.raises(ValueError, match="positive weight"):
        crossfit(xp, Ha, 0.0, Hb, 1.0)


def _split_reference(make, batches, labels):
    """global_factors on the even and the odd batches apart, crossfitted."""
    ev, od = batches[0::2], batches[1::2]
    Fa, _ = bh.global_factors(make(labels[0::2]), ev)
    Fb, _ = bh.global_factors(make(labels[1::2]), od)
    wa, wb = sum(len(b) for b in ev), sum(len(b) for b in od)
    return {n: crossfit(xp, Fa[n][1], wa, Fb[n][1], wb) for n in Fa}


@pytest.mark.parametrize("budget", [None, 0.75])
def test_pass_crossfits_the_even_and_odd_batches(budget):
    rng = np.random.default_rng(3)
    sizes = [16] * 6
    batches = [rng.standard_normal((n, 16)) for n in (5, 4, 6, 3, 5)]
    labels = [rng.integers(0, 4, size=len(b)) for b in batches]

    def make(lab):
        return random_mlp(sizes + [4], seed=2, head=bh.SoftmaxCrossEntropy(labels=list(lab)))

    if budget is not None:   # a fraction of the whole run's peak: a split plan
        _, rep = bh.global_factors(make(labels), batches, out_estimator="crossfit")
        budget = int(budget * rep.peak_bytes)
    got, rep = bh.global_factors(make(labels), batches, out_estimator="crossfit",
                                 budget_bytes=budget)
    mean, _ = bh.global_factors(make(labels), batches)
    ref = _split_reference(make, batches, labels)
    assert list(got) == list(mean)
    for n in mean:
        np.testing.assert_allclose(got[n][0], mean[n][0], rtol=1e-12)   # H_in: all batches
        np.testing.assert_allclose(got[n][1], ref[n], rtol=1e-10, atol=1e-12)
        assert not np.allclose(got[n][1], mean[n][1], rtol=1e-3)
    if budget is not None:
        assert len(rep.leaf_ranges) > 1   # (a split plan finalises its layers leaf by leaf)
        assert rep.peak_bytes <= budget


def test_crossfit_buffers_count_in_the_budget():
    rng = np.random.default_rng(6)
    stages = random_mlp([24, 24, 24, 4], seed=7)
    X = [rng.standard_normal((4, 24)) for _ in range(2)]
    plain = bh.global_factors(stages, X)[1].peak_buffer_bytes
    split = bh.global_factors(stages, X, out_estimator="crossfit")[1].peak_buffer_bytes
    assert split == plain + 8 * (24 * 24 + 24 * 24 + 4 * 4)   # a second H_out per layer


def test_one_batch_has_nothing_to_crossfit_with():
    X = np.random.default_rng(4).standard_normal((6, 5))
    stages = random_mlp([5, 4, 3], seed=5, head=bh.SoftmaxCrossEntropy(labels=[[0, 1, 2] * 2]))
    got, _ = bh.global_factors(stages, [X], out_estimator="crossfit")
    ref, _ = bh.global_factors(stages, [X])
    for n in ref:
        np.testing.assert_array_equal(got[n][1], ref[n][1])


def test_unknown_estimator_is_refused():
    stages = random_mlp([5, 3], seed=5)
    with pytest.raises(ValueError, match="out_estimator"):
        bh.global_factors(stages, np.ones((4, 5)), out_estimator="median")


@pytest.mark.parametrize("estimator, extra", [("crossfit", 1), ("crossfit:4", 3)])
def test_plan_counts_every_fold_buffer(estimator, extra):
    rng = np.random.default_rng(8)
    stages = random_mlp([24, 24, 24, 4], seed=7)
    X = [rng.standard_normal((4, 24)) for _ in range(4)]
    plain = bh.plan_global(stages, X)["planned_peak_bytes"]
    split = bh.plan_global(stages, X, out_estimator=estimator)["planned_peak_bytes"]
    assert split == plain + extra * 8 * (24 * 24 + 24 * 24 + 4 * 4)   # a buffer per fold
    with pytest.raises(ValueError, match="out_estimator"):
        bh.plan_global(stages, X, out_estimator="median")


def test_float32_products_agree_with_float64(halves):
    _, Ha, Hb = halves
    H64 = crossfit(xp, Ha, 60.0, Hb, 90.0)
    H32 = crossfit(xp, Ha, 60.0, Hb, 90.0, dtype=np.float32)
    assert H32.dtype == np.float64
    np.testing.assert_array_equal(H32, H32.T)
    np.testing.assert_allclose(H32, H64, rtol=0, atol=2e-5 * np.abs(H64).max())
    assert not np.array_equal(H32, H64)


def test_sink_gets_every_crossfitted_layer_in_order():
    rng = np.random.default_rng(9)
    batches = [rng.standard_normal((5, 16)) for _ in range(4)]
    stages = random_mlp([16] * 5 + [4], seed=4)
    ref, _ = bh.global_factors(stages, batches, out_estimator="crossfit")
    seen = []
    got, _ = bh.global_factors(stages, batches, out_estimator="crossfit",
                               sink=lambda n, Hi, Ho: seen.append((n, Hi, Ho)))
    assert got == {} and [n for n, _, _ in seen] == list(ref)
    for n, Hi, Ho in seen:
        np.testing.assert_array_equal(Hi, ref[n][0])
        np.testing.assert_array_equal(Ho, ref[n][1])


def test_an_error_in_the_sink_stops_the_pass():
    rng = np.random.default_rng(9)
    batches = [rng.standard_normal((5, 16)) for _ in range(4)]
    stages = random_mlp([16] * 5 + [4], seed=4)
    seen = []

    def sink(n, Hi, Ho):
        seen.append(n)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bh.global_factors(stages, batches, out_estimator="crossfit", sink=sink)
    assert len(seen) == 2


def test_a_half_with_no_weight_gives_the_other_halfs_mean():
    rng = np.random.default_rng(10)
    batches = [rng.standard_normal((4, 6)) for _ in range(2)]
    stages = random_mlp([6, 5, 3], seed=5, head=bh.SoftmaxCrossEntropy(labels=[[0, 1, 2, 0]] * 2))
    w = [np.zeros(4), np.ones(4)]   # the even half (batch 0) weighs nothing
    got, _ = bh.global_factors(stages, batches, weights=w, out_estimator="crossfit")
    ref, _ = bh.global_factors(stages, batches, weights=w)
    for n in ref:
        np.testing.assert_array_equal(got[n][1], ref[n][1])


def test_one_core_gives_the_same_factors(monkeypatch):
    """The layers' eigendecompositions in a pool of two threads or one after the other."""
    import bakron.hessian.driver as drv

    rng = np.random.default_rng(11)
    batches = [rng.standard_normal((5, 16)) for _ in range(4)]
    stages = random_mlp([16] * 4 + [4], seed=6)
    pooled, _ = bh.global_factors(stages, batches, out_estimator="crossfit")
    monkeypatch.setattr(drv, "cores", lambda: 1)
    seen = []
    alone, _ = bh.global_factors(stages, batches, out_estimator="crossfit")
    bh.global_factors(stages, batches, out_estimator="crossfit",
                      sink=lambda n, Hi, Ho: seen.append((n, Ho)))
    assert list(alone) == list(pooled) == [n for n, _ in seen]
    for (n, Ho) in seen:
        np.testing.assert_array_equal(alone[n][1], pooled[n][1])
        np.testing.assert_array_equal(Ho, pooled[n][1])


# -- K folds ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folds():
    rng = np.random.default_rng(12)
    m = 30
    L = rng.standard_normal((m, m)) * np.linspace(0.05, 1.0, m)
    return [_second_moment(rng, L, n) for n in (40, 50, 60, 45)], [40.0, 50.0, 60.0, 45.0]


def test_two_folds_are_the_halves_bit_for_bit(halves):
    _, Ha, Hb = halves
    np.testing.assert_array_equal(crossfit_folds(xp, [Ha, Hb], [60.0, 90.0]),
                                  crossfit(xp, Ha, 60.0, Hb, 90.0))


def test_k_folds_measure_each_fold_along_the_others_eigenvectors(folds):
    """Independently of the implementation: each fold's eigenvalues along the eigenvectors
    of the other folds' pooled mean, weighted by the fold's weight."""
    Hs, ws = folds
    total = sum(ws)
    ref = np.zeros_like(Hs[0])
    for j in range(len(Hs)):
        rest = sum(w * H for i, (w, H) in enumerate(zip(ws, Hs)) if i != j) / (total - ws[j])
        _, U = np.linalg.eigh(rest)
        ref += ws[j] / total * U @ np.diag(np.diag(U.T @ Hs[j] @ U)) @ U.T
    got = crossfit_folds(xp, Hs, ws)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-13)
    np.testing.assert_array_equal(got, got.T)
    assert np.linalg.eigvalsh(got).min() > 0
    np.testing.assert_allclose(np.trace(got), np.trace(sum(w * H for w, H in zip(ws, Hs)))
                               / total, rtol=1e-12)
    same = crossfit_folds(xp, [Hs[0]] * 3, [1.0, 2.0, 3.0])   # equal folds: the factor back
    np.testing.assert_allclose(same, Hs[0], atol=1e-12)


def test_folds_need_weights_and_two_folds(folds):
    Hs, ws = folds
    with pytest.raises(ValueError, match="positive weight"):
        crossfit_folds(xp, Hs, [1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="K >= 2"):
        crossfit_folds(xp, Hs[:1], ws[:1])
    with pytest.raises(ValueError, match="K >= 2"):
        crossfit_folds(xp, Hs, ws[:3])


def test_estimator_folds_parses_the_estimator():
    assert [estimator_folds(e)
            for e in ("mean", "crossfit", "crossfit:2", "crossfit:5")] == [1, 2, 2, 5]
    for bad in ("crossfit:1", "crossfit:", "crossfit:x", "median", "mean:2", 3, None):
        with pytest.raises(ValueError, match="out_estimator must be one of"):
            estimator_folds(bad)


def test_pass_crossfits_k_folds_of_batches():
    """``crossfit:3``: batch k's H_out rows in fold k mod 3, each fold's pass alone gives
    the same sums."""
    rng = np.random.default_rng(13)
    batches = [rng.standard_normal((n, 12)) for n in (5, 4, 6, 3, 5, 4, 2)]
    labels = [rng.integers(0, 4, size=len(b)) for b in batches]

    def make(lab):
        return random_mlp([12] * 4 + [4], seed=3, head=bh.SoftmaxCrossEntropy(labels=list(lab)))

    got, _ = bh.global_factors(make(labels), batches, out_estimator="crossfit:3")
    two, _ = bh.global_factors(make(labels), batches, out_estimator="crossfit:2")
    half, _ = bh.global_factors(make(labels), batches, out_estimator="crossfit")
    mean, _ = bh.global_factors(make(labels), batches)
    parts = [bh.global_factors(make(labels[j::3]), batches[j::3])[0] for j in range(3)]
    ws = [float(sum(len(b) for b in batches[j::3])) for j in range(3)]
    for n in mean:
        np.testing.assert_allclose(got[n][0], mean[n][0], rtol=1e-12)
        ref = crossfit_folds(xp, [p[n][1] for p in parts], ws)
        np.testing.assert_allclose(got[n][1], ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(two[n][1], half[n][1])
        assert not np.allclose(got[n][1], half[n][1], rtol=1e-3)



def test_fewer_batches_than_folds_crossfit_the_folds_there_are():
    rng = np.random.default_rng(14)
    batches = [rng.standard_normal((5, 8)) for _ in range(2)]
    stages = random_mlp([8, 8, 4], seed=2)
    four, _ = bh.global_factors(stages, batches, out_estimator="crossfit:4")
    two, _ = bh.global_factors(stages, batches, out_estimator="crossfit")
    for n in two:
        np.testing.assert_array_equal(four[n][1], two[n][1])


@pytest.mark.parametrize("out_estimator", ["mean", "crossfit:3"])
def test_pass_crossfits_h_in_of_k_folds_of_batches(out_estimator):
    """``in_estimator="crossfit:2"``: batch k's H_in rows in fold k mod 2, each fold's pass
    alone gives the same sums; H_out is what ``out_estimator`` alone gives."""
    rng = np.random.default_rng(15)
    batches = [rng.standard_normal((n, 12)) for n in (5, 4, 6, 3, 5, 4, 2)]
    labels = [rng.integers(0, 4, size=len(b)) for b in batches]

    def make(lab):
        return random_mlp([12] * 4 + [4], seed=3, head=bh.SoftmaxCrossEntropy(labels=list(lab)))

    got, _ = bh.global_factors(make(labels), batches, in_estimator="crossfit:2",
                               out_estimator=out_estimator)
    out_only, _ = bh.global_factors(make(labels), batches, out_estimator=out_estimator)
    parts = [bh.global_factors(make(labels[j::2]), batches[j::2])[0] for j in range(2)]
    ws = [float(sum(len(b) for b in batches[j::2])) for j in range(2)]
    for n in out_only:
        ref = crossfit_folds(xp, [p[n][0] for p in parts], ws)
        np.testing.assert_allclose(got[n][0], ref, rtol=1e-10, atol=1e-12)
        assert not np.allclose(got[n][0], out_only[n][0], rtol=1e-3)
        np.testing.assert_array_equal(got[n][1], out_only[n][1])


def test_unknown_in_estimator_is_refused():
    with pytest.raises(ValueError, match="in_estimator must be one of"):
        bh.global_factors(random_mlp([8, 8, 4], seed=2), [np.ones((3, 8))], in_estimator="x")
