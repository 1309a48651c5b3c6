"""global_factors: same factors for every budget and schedule, counts equal to the schedules'
formulas, memory within the budget, clear errors."""
from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

import bakron.hessian as bh
from bakron import _xp
from bakron.hessian._examples import random_mlp
from conftest import to_xp


def _np(a):
    return np.asarray(_xp.to_numpy(a))


def _assert_same(got, ref, rtol=1e-12):
    assert list(got) == list(ref)
    for name in ref:
        for a, b in zip(got[name], ref[name]):
            a, b = _np(a), _np(b)
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


@pytest.fixture(scope="module")
def net():
    """7 linear layers of width 32 (13 stages), two calibration batches of 8."""
    stages = random_mlp([32] * 7 + [5], seed=0)
    X = np.random.default_rng(1).standard_normal((16, 32))
    return stages, [X[:8], X[8:]]


@pytest.fixture(scope="module")
def full(net):
    stages, batches = net
    return bh.global_factors(stages, batches, refine_iters=1)


def _expected_counts(rep, L, n_batches):
    """Stage evaluations and VJPs of every sweep from the schedule formulas."""
    for sw in rep.sweeps:
        loss = sw.stop == L
        if sw.kind == "split":
            ev = (sw.cut - sw.start) + bh.reversal_cost(sw.stop - sw.cut, sw.schedule,
                                                        sw.snapshots, loss=loss)
            vj = sw.stop - sw.cut
        else:
            ev = bh.reversal_cost(sw.stop - sw.start, sw.schedule, sw.snapshots, loss=loss)
            vj = sw.stop - sw.start
        yield sw, n_batches * ev, n_batches * vj, (n_batches if loss else 0)


BUDGET_FRACTIONS = [1.0, 0.8, 0.6, 0.45, 0.4]


@pytest.mark.parametrize("checkpoint", ["auto", "store_all", "bisection", "binomial"])
@pytest.mark.parametrize("frac", BUDGET_FRACTIONS)
def test_same_factors_for_every_budget_and_schedule(net, full, checkpoint, frac):
    stages, batches = net
    ref, ref_rep = full
    budget = int(frac * ref_rep.peak_bytes)
    got, rep = bh.global_factors(stages, batches, budget_bytes=budget, checkpoint=checkpoint,
                                 refine_iters=1)
    _assert_same(got, ref)
    # memory: measured <= planned <= budget (equal-sized batches: measured == planned)
    assert rep.peak_bytes <= budget
    assert rep.peak_bytes == rep.planned_peak_bytes
    kinds = (rep.peak_activation_bytes, rep.peak_buffer_bytes, rep.peak_cache_bytes)
    assert max(kinds) <= rep.peak_bytes <= sum(kinds)
    # counts: every sweep as the formulas say; splits run once, leaves 1 + 2 k times
    L = ref_rep.n_stages
    for sw, ev, vj, hd in _expected_counts(rep, L, 2):
        assert (sw.stage_evals, sw.vjp_evals, sw.head_evals) == (ev, vj, hd), sw
    n_split = sum(sw.kind == "split" for sw in rep.sweeps)
    assert rep.passes == n_split + 3 * len(rep.leaf_ranges)
    # the leaves tile the chain's linear layers: every layer is collected exactly once
    covered = sorted(i for a, b in rep.leaf_ranges for i in range(a, b))
    assert len(covered) == len(set(covered))
    assert rep.stage_evals >= ref_rep.stage_evals


def test_bisection_engages_and_reuses_cached_boundaries(net):
    stages, batches = net
    _, big = bh.global_factors(stages, batches)
    budget = int(0.4 * big.peak_bytes)
    passes = {}
    for k in (0, 2):
        _, rep = bh.global_factors(stages, batches, budget_bytes=budget, refine_iters=k)
        splits = [sw for sw in rep.sweeps if sw.kind == "split"]
        assert len(rep.leaf_ranges) >= 3 and len(splits) == len(rep.leaf_ranges) - 1
        passes[k] = rep.passes
        assert rep.peak_cache_bytes > 0
    # refinement re-sweeps only the leaves (4 more passes each), never the split passes
    assert passes[2] - passes[0] == 4 * len(rep.leaf_ranges)


def test_balanced_bisection_evaluations_closed_form():
    """A chain of L equal linear stages cut into K = 2^d equal leaves, store-all inside every
    pass: (d + 1)(L + 1) - 2K + 1 stage evaluations per batch (docs/hessian.md: ~1 + log2 K passes)."""
    L, w = 16, 24
    rng = np.random.default_rng(3)
    stages = [bh.Linear(rng.standard_normal((w, w)) / 5, name=f"l{i}") for i in range(L)]
    stages.append(bh.SoftmaxCrossEntropy())
    X = rng.standard_normal((4, w))
    seen = set()
    for budget in range(200_000, 10_000, -2_000):
        try:
            plan = bh.plan_global(stages, X, budget_bytes=budget, checkpoint="store_all")
        except ValueError:
            break
        K = len(plan["leaves"])
        if K in seen or K & (K - 1) or any(b - a != L // K for a, b, *_ in plan["leaves"]):
            continue
        seen.add(K)
        _, rep = bh.global_factors(stages, X, budget_bytes=budget, checkpoint="store_all")
        d = int(math.log2(K))
        assert rep.stage_evals == (d + 1) * (L + 1) - 2 * K + 1
        assert rep.passes == 2 * K - 1
        assert rep.peak_bytes <= budget
    assert {1, 2, 4, 8} <= seen


def test_real_memory_follows_the_budget():
    """tracemalloc sees numpy's buffers: the real peak of the working memory (the sink drops
    finished factors) is the ledger's plus a few states of stage temporaries, and it falls
    with the budget."""
    stages = random_mlp([64] * 9 + [10], seed=4)
    X = np.random.default_rng(5).standard_normal((128, 64))
    state = X.nbytes
    _, rep0 = bh.global_factors(stages, X)
    peaks = []
    for frac in (1.0, 0.6, 0.45):
        budget = int(frac * rep0.peak_bytes)
        tracemalloc.start()
        try:
            _, rep = bh.global_factors(stages, X, budget_bytes=budget, sink=lambda *a: None)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert rep.peak_bytes <= budget
        assert peak <= rep.peak_bytes + 5 * state, (frac, peak, rep.peak_bytes)
        peaks.append(peak)
    assert peaks[2] < 0.75 * peaks[0]


def test_unequal_batches_and_planned_bound():
    stages = random_mlp([6, 8, 8, 3], seed=6)
    X = np.random.default_rng(7).standard_normal((11, 6))
    ref, _ = bh.global_factors(stages, X, batch_size=4)        # batches of 4, 4, 3
    _, big = bh.global_factors(stages, X, batch_size=4)
    budget = int(0.9 * big.peak_bytes)
    got, rep = bh.global_factors(stages, X, batch_size=4, budget_bytes=budget)
    _assert_same(got, ref)
    assert rep.n_batches == 3 and rep.peak_bytes <= rep.planned_peak_bytes <= budget
    assert rep.stage_evals > big.stage_evals           # the budget made it recompute


def test_namespaces_agree(xp):
    stages_np = random_mlp([5, 7, 6, 4], layer_norm=True, seed=8)
    X = np.random.default_rng(9).standard_normal((2, 3, 5))    # sequences of 3 tokens
    ref, ref_rep = bh.global_factors(stages_np, [X], refine_iters=1, refine="sequence")
    stages = random_mlp([5, 7, 6, 4], layer_norm=True, seed=8, xp=xp)
    budget = int(0.8 * ref_rep.peak_bytes)
    got, rep = bh.global_factors(stages, [to_xp(xp, X)], refine_iters=1, refine="sequence",
                                 budget_bytes=budget)
    _assert_same(got, ref, rtol=1e-11)
    assert rep.peak_bytes <= budget and rep.stage_evals > ref_rep.stage_evals
    for Hi, Ho in got.values():
        assert Hi.dtype == xp.float64 and _xp.namespace(Hi) is _xp.namespace(to_xp(xp, X))


def test_float32_inputs_accumulate_in_float64():
    """float32 activations: float32 products per batch, summed in float64 (relative error of
    float32 rounding); ``products=float64`` casts the rows first (exact products)."""
    stages = random_mlp([6, 8, 4], seed=10, dtype=np.float32)
    X = np.random.default_rng(11).standard_normal((20, 6)).astype(np.float32)
    Xd = X.astype(np.float64)
    exact, _ = bh.global_factors(stages, [X[:10], X[10:]], products=np.float64)
    Hi, Ho = exact["fc0"]
    assert Hi.dtype == np.float64
    np.testing.assert_allclose(Hi, Xd.T @ Xd / 20, rtol=1e-12)
    fast, _ = bh.global_factors(stages, [X[:10], X[10:]])
    Hi32 = fast["fc0"][0]
    assert Hi32.dtype == np.float64 and not np.array_equal(Hi32, Hi)
    ref = Xd.T @ Xd / 20
    assert np.linalg.norm(Hi32 - ref) <= 1e-6 * np.linalg.norm(ref)
    for name in exact:
        for a, b in zip(exact[name], fast[name]):
            assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a), name
    with pytest.raises(ValueError, match="products must be"):
        bh.global_factors(stages, X, products=np.int32)


def test_zero_weights_drop_samples():
    rng = np.random.default_rng(12)
    labels = rng.integers(0, 3, size=6)
    X = rng.standard_normal((6, 4))
    w = np.array([1.0, 0.0, 2.0, 1.0, 0.0, 1.0])
    stages = random_mlp([4, 5, 3], seed=13, head=bh.SoftmaxCrossEntropy(labels=[labels]))
    got, _ = bh.global_factors(stages, X, weights=[w])
    # the same with the zero-weight samples removed and weight 2 as a duplicate
    idx = np.repeat(np.arange(6), w.astype(int))
    stages2 = random_mlp([4, 5, 3], seed=13, head=bh.SoftmaxCrossEntropy(labels=[labels[idx]]))
    ref, _ = bh.global_factors(stages2, X[idx])
    _assert_same(got, ref)


def test_sink_receives_every_layer(net, full):
    stages, batches = net
    seen = {}
    got, rep = bh.global_factors(stages, batches, refine_iters=1,
                                 budget_bytes=int(0.45 * full[1].peak_bytes),
                                 sink=lambda name, Hi, Ho: seen.__setitem__(name, (Hi, Ho)))
    assert got == {}
    _assert_same({k: seen[k] for k in full[0]}, full[0])


def test_inputs_are_not_modified(net):
    stages, batches = net
    before = [b.copy() for b in batches] + [s.W.copy() for s in stages if hasattr(s, "W")]
    bh.global_factors(stages, batches, budget_bytes=80_000, refine_iters=1)
    after = list(batches) + [s.W for s in stages if hasattr(s, "W")]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_residual_and_layer_norm_chain_with_budget():
    rng = np.random.default_rng(14)
    d = 6
    blocks = []
    for k in range(3):
        blocks.append(bh.Residual([bh.LayerNorm(), bh.Linear(rng.standard_normal((9, d)) / 3,
                                                             name="up"), bh.GELU(),
                                   bh.Linear(rng.standard_normal((d, 9)) / 3, name="down")],
                                  name=f"block{k}"))
    stages = [bh.Linear(rng.standard_normal((d, 4)), name="embed"), *blocks, bh.LayerNorm(),
              bh.Linear(rng.standard_normal((3, d)), name="head"), bh.SoftmaxCrossEntropy()]
    X = rng.standard_normal((5, 2, 4))
    ref, rep = bh.global_factors(stages, X)
    assert list(ref) == ["embed", "block0.up", "block0.down", "block1.up", "block1.down",
                         "block2.up", "block2.down", "head"]
    got, rep2 = bh.global_factors(stages, X, budget_bytes=int(0.6 * rep.peak_bytes))
    _assert_same(got, ref)
    assert len(rep2.leaf_ranges) > 1


# ------------------------------------------------------------------------------ bad input
class _NaNGrad:
    """A stage whose VJP produces NaN on batches of two (a broken custom stage)."""
    name = "broken"

    def linears(self):
        return {}

    def out_shape(self, s):
        return s

    def forward(self, xp, h):
        return h

    def vjp(self, xp, h, d, collect, need_input_grad=True):
        return d * float("nan") if h.shape[0] == 2 else d


def test_shape_mismatch_between_stages_is_named():
    rng = np.random.default_rng(15)
    stages = [bh.Linear(rng.standard_normal((8, 4)), name="fc1"), bh.ReLU(),
              bh.Linear(rng.standard_normal((3, 6)), name="fc2"), bh.SoftmaxCrossEntropy()]
    with pytest.raises(ValueError, match=r"shape mismatch at stage 2: stage 'fc2' \(Linear\) "
                                         r"expects inputs with 6 features.*got shape \(5, 8\)"):
        bh.global_factors(stages, rng.standard_normal((5, 4)))
    with pytest.raises(ValueError, match="shape mismatch at stage 0.*expects inputs with 4"):
        bh.global_factors(stages[:1] + stages[-1:], rng.standard_normal((5, 7)))
    with pytest.raises(ValueError, match="head.*at least 2 classes"):
        bh.global_factors([bh.Linear(np.ones((1, 4)), name="x"), bh.SoftmaxCrossEntropy()],
                          np.ones((2, 4)))


def test_non_finite_activation_and_gradient_are_named():
    rng = np.random.default_rng(16)
    W = rng.standard_normal((5, 4))
    W[1, 2] = np.inf
    stages = [bh.Linear(rng.standard_normal((4, 4)), name="ok"), bh.Linear(W, name="bad"),
              bh.SoftmaxCrossEntropy()]
    X = rng.standard_normal((3, 4))
    with pytest.raises(ValueError, match=r"non-finite activation: the output of stage 1 'bad' "
                                         r"\(Linear\) on calibration batch 0"):
        bh.global_factors(stages, X)
    stages = [bh.Linear(rng.standard_normal((4, 4)), name="a"), _NaNGrad(),
              bh.Linear(rng.standard_normal((3, 4)), name="b"), bh.SoftmaxCrossEntropy()]
    with pytest.raises(ValueError, match=r"non-finite gradient: ∂loss/∂\(input of stage 1 "
                                         r"'broken'.*batch 1"):
        bh.global_factors(stages, [X[:1], X[1:]])
    Xbad = X.copy()
    Xbad[0, 0] = np.nan
    with pytest.raises(ValueError, match="calibration batch 1 contains 1 NaN"):
        bh.global_factors(stages, [X, Xbad])


def test_non_finite_checks_counted_per_batch_name_the_same_stage(monkeypatch):
    """On a GPU the checks are counted on the device and read once per batch: the error names
    the first non-finite stage as the per-stage check does."""
    monkeypatch.setattr(bh.driver, "_defer_checks", lambda xp: True)
    with np.errstate(all="ignore"):   # the later stages now run on the NaN (cupy: silently)
        test_non_finite_activation_and_gradient_are_named()


def test_budget_too_small_is_a_clear_error_and_nothing_is_written(net):
    stages, batches = net
    calls = []
    with pytest.raises(ValueError, match=r"budget_bytes=1000 is too small: collecting "
                                         r"layer\(s\) .* needs \d+ bytes of factor buffers"):
        bh.global_factors(stages, batches, budget_bytes=1000, sink=lambda *a: calls.append(a))
    assert calls == []
    # a single layer whose buffers alone exceed the budget cannot be split further
    one = [bh.Linear(np.ones((40, 40)), name="big"), bh.SoftmaxCrossEntropy()]
    with pytest.raises(ValueError, match="'big'.*25600 bytes of factor buffers"):
        bh.global_factors(one, np.ones((2, 40)), budget_bytes=20_000)


@pytest.mark.parametrize("kwargs,match", [
    (dict(budget_bytes=0), "budget_bytes must be a positive integer"),
    (dict(checkpoint="revolve"), "checkpoint must be"),
    (dict(checkpoint="bisection", snapshots=2), "snapshots applies to"),
    (dict(snapshots=0), "snapshots must be a positive integer"),
    (dict(refine="layer"), "refine must be"),
    (dict(refine_iters=-1), "refine_iters must be"),
    (dict(batch_size=0), "batch_size must be a positive integer"),
    (dict(weights=[np.ones(3)]), r"weights\[0\] has shape \(3,\)"),
    (dict(weights=np.ones(4)), "weights must be a list"),
    (dict(weights=[np.ones(4), np.ones(4)]), "weights has 2 entries but there are 1"),
    (dict(weights=[-np.ones(4)]), "negative"),
    (dict(accum_dtype=np.int32), "accum_dtype must be"),
])
def test_bad_arguments(kwargs, match):
    stages = random_mlp([3, 4, 2], seed=17)
    with pytest.raises(ValueError, match=match):
        bh.global_factors(stages, np.ones((4, 3)), **kwargs)


def test_bad_chains_and_inputs():
    lin = bh.Linear(np.ones((2, 3)), name="a")
    with pytest.raises(ValueError, match="ending with a head"):
        bh.global_factors([lin], np.ones((4, 3)))
    with pytest.raises(ValueError, match="only the last stage may be a head"):
        bh.global_factors([bh.SoftmaxCrossEntropy(), lin, bh.SoftmaxCrossEntropy()],
                          np.ones((4, 3)))
    with pytest.raises(ValueError, match="both named 'a'"):
        bh.global_factors([lin, bh.Linear(np.ones((2, 2)), name="a"), bh.SoftmaxCrossEntropy()],
                          np.ones((4, 3)))
    with pytest.raises(ValueError, match="no linear layers"):
        bh.global_factors([bh.ReLU(), bh.SoftmaxCrossEntropy()], np.ones((4, 3)))
    with pytest.raises(ValueError, match="list of arrays"):
        bh.global_factors([lin, bh.SoftmaxCrossEntropy()], (x for x in [np.ones((4, 3))]))
    with pytest.raises(ValueError, match="calib_inputs is empty"):
        bh.global_factors([lin, bh.SoftmaxCrossEntropy()], [])
    with pytest.raises(ValueError, match="batch 1 has shape"):
        bh.global_factors([lin, bh.SoftmaxCrossEntropy()], [np.ones((4, 3)), np.ones((4, 2))])
    with pytest.raises(TypeError, match="float32 or float64"):
        bh.global_factors([lin, bh.SoftmaxCrossEntropy()], np.ones((4, 3), dtype=np.int64))
    per_token = [np.ones((2, 5))]
    with pytest.raises(ValueError, match="per-sequence refinement needs one weight per sequence"):
        bh.global_factors([lin, bh.SoftmaxCrossEntropy()], np.ones((2, 5, 3)), weights=per_token,
                          refine="sequence", refine_iters=1)


def test_report_text(net):
    stages, batches = net
    _, rep = bh.global_factors(stages, batches, budget_bytes=60_000)
    text = str(rep)
    assert "7 linear layers" in text and f"passes {rep.passes}" in text
    assert rep.recompute_factor > 1.0


def test_progress_reports_tokens_passes_and_time_left():
    stages = random_mlp([6, 8, 4], seed=20)
    X = np.random.default_rng(21).standard_normal((30, 6))
    seen = []
    got, rep = bh.global_factors(stages, X, batch_size=10, refine_iters=1,
                                 progress=seen.append)
    assert len(seen) == 3 * 3                          # 3 passes x 3 batches
    assert [p.kind for p in seen[::3]] == ["kfac", "refine_out", "refine_in"]
    assert [p.tokens_done for p in seen] == list(range(10, 91, 10))
    assert all(p.tokens_total == 90 and p.passes == 3 == rep.passes for p in seen)
    assert [p.pass_index for p in seen[::3]] == [1, 2, 3]
    assert seen[-1].seconds_left == 0 and seen[0].tokens_per_second > 0
    assert "pass 3/3 (refine_in): 90/90 tokens" in str(seen[-1])
    assert [s.tokens for s in rep.sweeps] == [30, 30, 30]
    quiet, _ = bh.global_factors(stages, X, batch_size=10, refine_iters=1, progress=True)
    for name in got:          # the bar changes nothing (stderr is no terminal under pytest)
        assert all(np.array_equal(a, b) for a, b in zip(got[name], quiet[name]))
    with pytest.raises(ValueError, match="progress must be"):
        bh.global_factors(stages, X, progress="yes")
