"""FactorAccumulator: weighted second moments, sequence updates, fixed-order merge."""
from __future__ import annotations

import numpy as np
import pytest

import bakron.factor_files

from bakron import _xp
from bakron.hessian import FactorAccumulator, pack_upper, sequence_mix, unpack_upper
from conftest import to_xp


def _np(a):
    return np.asarray(_xp.to_numpy(a))


def test_update_is_weighted_mean_of_outer_products(xp):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((3, 5, 4)).astype(np.float32)        # rows of a (3, 5) batch
    w = rng.random((3, 5))
    acc = FactorAccumulator(4, xp=xp)
    acc.update(to_xp(xp, X), to_xp(xp, w))
    Xd = X.reshape(-1, 4).astype(np.float64)
    ref = (Xd * w.reshape(-1, 1)).T @ Xd / w.sum()
    H = acc.value()
    assert H.dtype == xp.float64
    np.testing.assert_allclose(_np(H), ref, rtol=1e-13, atol=1e-15)
    assert acc.count == 15 and acc.weight == pytest.approx(w.sum())


def test_coefficients_scale_terms_but_not_the_total_weight(xp):
    rng = np.random.default_rng(1)
    X = rng.standard_normal((6, 3))
    c = rng.random(6) + 0.5
    acc = FactorAccumulator(3, xp=xp, divisor=2.0)
    acc.update(to_xp(xp, X), coef=to_xp(xp, c))
    ref = (X * c[:, None]).T @ X / (6 * 2.0)
    np.testing.assert_allclose(_np(acc.value()), ref, rtol=1e-13)


def test_update_sequences_matches_explicit_sum(xp):
    rng = np.random.default_rng(2)
    S, T, n = 4, 3, 5
    Y = rng.standard_normal((S, T, n))
    H = rng.standard_normal((n, n))
    H = H @ H.T
    w = rng.random(S)
    acc = FactorAccumulator(n, xp=xp)
    M = sequence_mix(xp, to_xp(xp, Y), to_xp(xp, H))
    acc.update_sequences(to_xp(xp, Y), M, to_xp(xp, w))
    ref = sum(w[s] * Y[s].T @ (Y[s] @ H @ Y[s].T) @ Y[s] for s in range(S)) / w.sum()
    np.testing.assert_allclose(_np(acc.value()), ref, rtol=1e-12)
    # mix=None: the outer product of each sequence's sum
    acc2 = FactorAccumulator(n, xp=xp).update_sequences(to_xp(xp, Y))
    ref2 = sum(np.outer(Y[s].sum(0), Y[s].sum(0)) for s in range(S)) / S
    np.testing.assert_allclose(_np(acc2.value()), ref2, rtol=1e-12)


def test_value_is_exactly_symmetric(xp):
    rng = np.random.default_rng(3)
    acc = FactorAccumulator(7, xp=xp)
    for _ in range(3):
        acc.update(to_xp(xp, rng.standard_normal((11, 7))), to_xp(xp, rng.random(11)))
    H = _np(acc.value())
    assert np.array_equal(H, H.T)


def test_merge_is_a_fixed_order_sum(xp):
    rng = np.random.default_rng(4)
    shards = [rng.standard_normal((int(k), 6)) * 10.0 ** rng.integers(-3, 3)
              for k in rng.integers(1, 20, size=7)]
    parts = [FactorAccumulator(6, xp=xp).update(to_xp(xp, s)) for s in shards]
    merged = FactorAccumulator.merge_all(parts)
    again = parts[0].merge(*parts[1:])
    assert np.array_equal(_np(merged.sum), _np(again.sum))       # same order: same bits
    one = FactorAccumulator(6, xp=xp).update(to_xp(xp, np.concatenate(shards)))
    np.testing.assert_allclose(_np(merged.value()), _np(one.value()), rtol=1e-12)
    assert merged.count == one.count and merged.weight == one.weight
    # merging does not touch the parts
    np.testing.assert_allclose(_np(parts[0].sum), shards[0].T @ shards[0], rtol=1e-13)


def test_merge_rejects_incompatible_partials(xp):
    a = FactorAccumulator(3, xp=xp)
    with pytest.raises(ValueError, match="size 4"):
        a.merge(FactorAccumulator(4, xp=xp))
    with pytest.raises(ValueError, match="divisor"):
        a.merge(FactorAccumulator(3, xp=xp, divisor=2.0))
    with pytest.raises(ValueError, match="not a FactorAccumulator"):
        a.merge(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="at least one"):
        FactorAccumulator.merge_all([])


def test_bad_updates_leave_the_state_untouched(xp):
    rng = np.random.default_rng(5)
    acc = FactorAccumulator(3, xp=xp).update(to_xp(xp, rng.standard_normal((4, 3))))
    before = (_np(acc.sum).copy(), acc.weight, acc.count)
    bad = rng.standard_normal((4, 3))
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match="rows contains 1 NaN"):
        acc.update(to_xp(xp, bad))
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 3\)"):
        acc.update(to_xp(xp, rng.standard_normal((4, 2))))
    with pytest.raises(ValueError, match="weights has 3 entries but there are 4 rows"):
        acc.update(to_xp(xp, rng.standard_normal((4, 3))), to_xp(xp, np.ones(3)))
    with pytest.raises(ValueError, match="non-negative"):
        acc.update(to_xp(xp, rng.standard_normal((4, 3))), to_xp(xp, -np.ones(4)))
    with pytest.raises(ValueError, match="mix must have shape"):
        acc.update_sequences(to_xp(xp, rng.standard_normal((2, 4, 3))),
                             to_xp(xp, np.ones((2, 3, 3))))
    assert np.array_equal(_np(acc.sum), before[0])
    assert (acc.weight, acc.count) == before[1:]


def test_empty_accumulator_and_bad_construction(xp):
    with pytest.raises(ValueError, match="empty"):
        FactorAccumulator(2, xp=xp).value()
    with pytest.raises(ValueError, match="positive integer"):
        FactorAccumulator(0, xp=xp)
    with pytest.raises(ValueError, match="divisor"):
        FactorAccumulator(2, xp=xp, divisor=0.0)
    with pytest.raises(ValueError, match="float32 or float64"):
        FactorAccumulator(2, xp=xp, dtype=xp.int64)


def test_float32_accumulation_is_allowed_and_smaller(xp):
    acc = FactorAccumulator(8, xp=xp, dtype=xp.float32)
    acc.update(to_xp(xp, np.ones((2, 8))))
    assert acc.sum.dtype == xp.float32 and acc.nbytes == 8 * 8 * 4


def test_packed_upper_triangle_round_trip(xp):
    rng = np.random.default_rng(6)
    H = rng.standard_normal((5, 5))
    H = H + H.T
    p = pack_upper(xp, to_xp(xp, H))
    # the factor-file layout: upper triangle column by column == lower triangle row by row
    assert _np(p).tolist() == H[np.tril_indices(5)].tolist()
    assert _np(p).tolist() == bakron.factor_files.pack_upper(H).tolist()
    np.testing.assert_array_equal(_np(unpack_upper(xp, p, 5)), H)
    with pytest.raises(ValueError, match="15 entries"):
        unpack_upper(xp, p[:-1], 5)


def test_state_packing_entry_selects_the_layout(xp):
    """States packed row by row (the layout before it was unified) load when they say so;
    the default is the factor-file layout."""
    rng = np.random.default_rng(8)
    S = rng.standard_normal((5, 5))
    S = S + S.T
    old = {"sum": to_xp(xp, S[np.triu_indices(5)]), "n": 5, "weight": 2.0, "count": 3,
           "packing": "upper-rowmajor"}
    acc = FactorAccumulator.from_state_dict(old, xp=xp)
    np.testing.assert_array_equal(_np(acc.sum), S)
    new = acc.state_dict()
    assert new["packing"] == "upper-colmajor"
    np.testing.assert_array_equal(_np(FactorAccumulator.from_state_dict(new, xp=xp).sum), S)
    no_entry = {k: v for k, v in new.items() if k != "packing"}
    np.testing.assert_array_equal(_np(FactorAccumulator.from_state_dict(no_entry, xp=xp).sum), S)
    with pytest.raises(ValueError, match="packing"):
        FactorAccumulator.from_state_dict(dict(new, packing="lower-diag"), xp=xp)


def test_state_dict_round_trip(xp):
    rng = np.random.default_rng(7)
    acc = FactorAccumulator(4, xp=xp, divisor=3.0).update(to_xp(xp, rng.standard_normal((9, 4))))
    back = FactorAccumulator.from_state_dict(acc.state_dict(), xp=xp)
    np.testing.assert_array_equal(_np(back.value()), _np(acc.value()))
    assert (back.weight, back.count, back.divisor) == (acc.weight, acc.count, acc.divisor)


def _filled(xp, n, out=None, seed=20):
    """An accumulator after three float32-product updates (weights, a kept product added to
    a second one) and that second accumulator."""
    rng = np.random.default_rng(seed)
    a = FactorAccumulator(n, xp=xp)
    b = FactorAccumulator(n, xp=xp)
    for k in range(3):
        X = to_xp(xp, rng.standard_normal((40, n)).astype(np.float32))
        w = to_xp(xp, rng.random(40))
        kept = a._update(xp, X, w, products=xp.float32, keep=True, check="product", out=out)
        b.add_product(*kept)
    return a, b


def test_finish_is_value_bitwise_without_a_copy(xp):
    """finish() forms value()'s factor in the running sum itself (the blockwise mirror and
    add span more than one block at n = 300), and the accumulator is spent afterwards."""
    from bakron.hessian.accumulate import gram_buffer

    n = 300
    out = gram_buffer(xp, n, xp.float32)
    a, b = _filled(xp, n, out)
    a2, b2 = _filled(xp, n)          # no buffer: the same products, freshly allocated
    want = _np(a2.value())
    assert np.array_equal(_np(b2.value()), want)
    got = a.finish()
    assert np.array_equal(_np(got), want) and np.array_equal(_np(got), _np(got).T)
    assert np.array_equal(_np(b.finish()), want)
    with pytest.raises(ValueError, match="spent"):
        a.update(to_xp(xp, np.ones((2, n))))
    with pytest.raises(ValueError, match="spent"):
        a.finish()
    if _xp.is_numpy(xp):              # ?syrk wrote the products into the buffer
        kept = FactorAccumulator(n, xp=xp)._update(
            xp, np.ones((3, n), np.float32), products=np.float32, keep=True, out=out)
        assert np.shares_memory(kept[0], out)


def test_product_check_names_bad_rows_and_leaves_the_state(xp):
    rng = np.random.default_rng(21)
    acc = FactorAccumulator(3, xp=xp).update(to_xp(xp, rng.standard_normal((4, 3))))
    before = (_np(acc.sum).copy(), acc.weight, acc.count)
    bad = rng.standard_normal((4, 3)).astype(np.float32)
    bad[1, 2] = np.inf
    with pytest.raises(ValueError, match="rows contains 1 NaN or Inf"):
        acc._update(xp, to_xp(xp, bad), products=xp.float32, check="product")
    big = np.full((2, 3), 1e30, dtype=np.float32)     # finite, but its squares overflow
    with pytest.raises(ValueError, match="overflow"), np.errstate(over="ignore"):
        acc._update(xp, to_xp(xp, big), products=xp.float32, check="product")
    assert np.array_equal(_np(acc.sum), before[0]) and (acc.weight, acc.count) == before[1:]


def test_out_holds_the_sum(xp):
    """``out``: a spent factor's memory holds the new sum (zeroed first); a wrong shape or
    dtype is refused by name."""
    rng = np.random.default_rng(22)
    X = to_xp(xp, rng.standard_normal((7, 4)))
    buf = to_xp(xp, np.full((4, 4), 5.0))
    acc = FactorAccumulator(4, xp=xp, out=buf).update(X)
    assert np.array_equal(_np(acc.value()), _np(FactorAccumulator(4, xp=xp).update(X).value()))
    with pytest.raises(ValueError, match=r"out must be an array of shape \(4, 4\)"):
        FactorAccumulator(4, xp=xp, out=to_xp(xp, np.zeros((3, 3))))
    with pytest.raises(ValueError, match="out must be"):
        FactorAccumulator(4, xp=xp, dtype=xp.float32, out=to_xp(xp, np.zeros((4, 4))))
