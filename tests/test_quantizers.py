"""The uniform grid (docs/conventions.md, "Quantizers") and its fitting helper."""
import numpy as np
import pytest

import bakron
from conftest import to_xp


def test_symmetric_grid_matches_formula(xp):
    q = bakron.UniformQuantizer(3, 0.5)
    t = np.array([[-3.0, -2.25, -0.25, 0.25, 0.75, 1.25, 1.75, 9.0]])
    v, c = q.quantize(to_xp(xp, t[None]))
    expect_c = np.clip(np.round(t / 0.5), -4, 3)
    np.testing.assert_array_equal(bakron._xp.to_numpy(c)[0], expect_c)
    np.testing.assert_array_equal(bakron._xp.to_numpy(v)[0], 0.5 * expect_c)
    # ties to even: 0.25/0.5 = 0.5 -> 0, 0.75/0.5 = 1.5 -> 2, 1.25/0.5 = 2.5 -> 2
    assert bakron._xp.to_numpy(c)[0, 0].tolist() == [-4, -4, 0, 0, 2, 2, 3, 3]


def test_asymmetric_grid_matches_formula():
    q = bakron.UniformQuantizer(2, 0.5, symmetric=False, zero_point=1)
    t = np.array([[[-2.0, -0.5, 0.0, 0.6, 1.0, 5.0]]])
    v, c = q.quantize(t)
    expect = np.clip(np.round(t / 0.5) + 1, 0, 3)
    np.testing.assert_array_equal(c, expect)
    np.testing.assert_array_equal(v, 0.5 * (expect - 1))


def test_per_row_and_per_group_scales_follow_tile_positions(xp):
    m, n, g = 6, 10, 4
    rng = np.random.default_rng(0)
    scale = rng.uniform(0.1, 1.0, size=(m, 3))
    q = bakron.UniformQuantizer(4, scale, group_size=g)
    W = rng.standard_normal((m, n))
    full = np.repeat(scale, g, axis=1)[:, :n]
    expect = full * np.clip(np.round(W / full), -8, 7)
    v, _ = q.rtn(to_xp(xp, W))
    np.testing.assert_array_equal(bakron._xp.to_numpy(v), expect)
    # a tile at an offset sees its own scales
    tile = W[None, 2:5, 3:9]
    v, _ = q.quantize(to_xp(xp, tile), rows=to_xp(xp, np.array([2])), cols=to_xp(xp, np.array([3])))
    np.testing.assert_array_equal(bakron._xp.to_numpy(v)[0], expect[2:5, 3:9])
    qr = bakron.UniformQuantizer(4, scale[:, 0])
    v, _ = qr.rtn(W)
    np.testing.assert_array_equal(v, scale[:, :1] * np.clip(np.round(W / scale[:, :1]), -8, 7))


@pytest.mark.parametrize("granularity", ["tensor", "row", "group"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("method", ["rms", "minmax"])
def test_fit_gives_a_working_grid(granularity, symmetric, method):
    rng = np.random.default_rng(1)
    W = rng.standard_normal((8, 20))
    q = bakron.UniformQuantizer.fit(W, 3, symmetric=symmetric, granularity=granularity,
                                    group_size=6, method=method)
    assert q.granularity == granularity
    v, c = q.rtn(W)
    lo, hi = q.code_range
    assert c.min() >= lo and c.max() <= hi
    assert np.mean((W - v) ** 2) < 0.1 * np.mean(W ** 2)  # 3 bits: well below the signal
    if method == "minmax":  # the range is covered: only rounding error, at most half a step
        s = q.tables(np, None, np.float64)[0]
        assert np.max(np.abs(W - v)) <= 0.5 * s.max() * (1 + 1e-12) or symmetric


def test_fit_handles_zero_rows():
    W = np.zeros((3, 4))
    W[1] = [1.0, -2.0, 0.5, 0.0]
    q = bakron.UniformQuantizer.fit(W, 2)
    v, _ = q.rtn(W)
    np.testing.assert_array_equal(v[0], 0.0)


@pytest.mark.parametrize("bits", [1, 9, 0, 2.5, "4", True])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        bakron.UniformQuantizer(bits, 1.0)


def test_bad_scales():
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        bakron.UniformQuantizer(4, 0.0)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        bakron.UniformQuantizer(4, np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match=r"per-group\) but group_size is not set"):
        bakron.UniformQuantizer(4, np.ones((2, 2)))
    with pytest.raises(ValueError, match="zero_point is only used with symmetric=False"):
        bakron.UniformQuantizer(4, 1.0, zero_point=3)
    q = bakron.UniformQuantizer(4, np.ones(5))
    with pytest.raises(ValueError, match=r"scale has 5 rows but W has 4 rows"):
        q.rtn(np.zeros((4, 3)))
    q = bakron.UniformQuantizer(4, np.ones((4, 2)), group_size=2)
    with pytest.raises(ValueError, match=r"per-group scale must have shape \(4, 3\)"):
        q.rtn(np.zeros((4, 6)))


def test_quantize_without_offsets_needs_tensor_scale():
    q = bakron.UniformQuantizer(4, np.ones(3))
    with pytest.raises(ValueError, match="needs the tiles' rows and cols"):
        q.quantize(np.zeros((1, 3, 3)))
