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


def _fit_definition(x, bits, symmetric, method):
    """Scale and zero point of one row or group ``x`` (1-D float64), from the definitions of
    ``UniformQuantizer.fit`` (docs: RMS-scaled Gaussian step, or the covered range)."""
    from bakron.quantizers import _GAUSS_STEP
    tiny = np.finfo(np.float64).tiny
    if symmetric:
        s = (_GAUSS_STEP[bits] * np.sqrt(np.mean(x * x)) if method == "rms"
             else np.max(np.abs(x)) / max(2 ** (bits - 1) - 1, 1))
        return (s if s > tiny else 1.0), None
    if method == "rms":
        mu, sd = np.mean(x), np.std(x)
        s = _GAUSS_STEP[bits] * sd
        s = s if s > tiny else max(abs(mu), 1.0)
        z = 2 ** (bits - 1) - np.round(mu / s)
    else:
        lo, hi = min(np.min(x), 0.0), max(np.max(x), 0.0)
        s = (hi - lo) / (2 ** bits - 1)
        s = s if s > tiny else 1.0
        z = np.round(-lo / s)
    return s, float(np.clip(z, 0, 2 ** bits - 1))


@pytest.mark.parametrize("chunk", [1, 37, 1 << 18])
@pytest.mark.parametrize("seed", range(6))
def test_fit_equals_the_definition_row_by_row(monkeypatch, chunk, seed):
    """``fit`` goes through W in chunks of rows (``_FIT_CHUNK`` elements converted to float64
    at a time) and reduces whole groups side by side: every scale and zero point equals the
    definition applied to its own row or group, exactly, whatever the chunk."""
    import bakron.quantizers as Q
    monkeypatch.setattr(Q, "_FIT_CHUNK", chunk)
    rng = np.random.default_rng(seed)
    m, n = int(rng.integers(1, 40)), int(rng.integers(1, 70))
    W = (rng.standard_normal((m, n)) * rng.uniform(0.1, 10, (m, 1))).astype(
        [np.float32, np.float64][seed % 2])
    W[0, :] = 0.0  # a zero row
    bits = int(rng.integers(2, 9))
    g = int(rng.integers(1, n + 3))
    W64 = W.astype(np.float64)
    for symmetric in (True, False):
        for method in ("rms", "minmax"):
            for gran in ("row", "group"):
                q = bakron.UniformQuantizer.fit(W, bits, symmetric=symmetric, granularity=gran,
                                                group_size=g, method=method)
                width = n if gran == "row" else g
                want = [[_fit_definition(W64[i, j:j + width], bits, symmetric, method)
                         for j in range(0, n, width)] for i in range(m)]
                scale = np.asarray(q.scale).reshape(m, -1)
                np.testing.assert_array_equal(scale, [[w[0] for w in r] for r in want])
                if not symmetric:
                    np.testing.assert_array_equal(np.asarray(q.zero_point).reshape(m, -1),
                                                  [[w[1] for w in r] for r in want])
            q = bakron.UniformQuantizer.fit(W, bits, symmetric=symmetric, granularity="tensor",
                                            method=method)
            s, z = _fit_definition(W64.reshape(-1), bits, symmetric, method)
            assert q.scale == s and (symmetric or q.zero_point == z)


def test_fit_reduces_w_where_it_lives(xp, monkeypatch):
    """``fit`` on host arrays (numpy, array-api-strict) is the numpy definition, exactly; on a
    device (cupy) the same float64 reductions run there, in chunks of rows, and only the
    scales come to the host: they agree with the host fit to the last bits."""
    import bakron.quantizers as Q
    monkeypatch.setattr(Q, "_FIT_CHUNK_DEVICE", 7 * 23)  # several chunks of rows
    moved = []
    to_numpy = bakron._xp.to_numpy
    monkeypatch.setattr(bakron._xp, "to_numpy", lambda a: moved.append(a.shape) or to_numpy(a))
    rng = np.random.default_rng(3)
    W = (rng.standard_normal((40, 23)) * rng.uniform(0.1, 10, (40, 1))).astype(np.float32)
    W[0, :] = 0.0
    W[1, :] = 1e-42  # subnormal in float32: its scale underflows, as for a zero row
    Wx = to_xp(xp, W)
    on_device = bakron._xp.is_cupy(xp)
    for symmetric in (True, False):
        for method in ("rms", "minmax"):
            for gran, g in (("row", None), ("group", 5), ("tensor", None)):
                want = bakron.UniformQuantizer.fit(W, 3, symmetric=symmetric, granularity=gran,
                                                   group_size=g, method=method)
                moved.clear()
                got = bakron.UniformQuantizer.fit(Wx, 3, symmetric=symmetric,
                                                  granularity=gran, group_size=g,
                                                  method=method)
                s_got, s_want = (np.asarray(q.scale) for q in (got, want))
                if on_device:
                    assert moved and all(np.prod(sh) < W.size for sh in moved), moved
                    np.testing.assert_allclose(s_got, s_want, rtol=1e-13, atol=0)
                else:
                    np.testing.assert_array_equal(s_got, s_want)
                assert gran == "tensor" or np.all(s_got[:2] == 1.0)
                if not symmetric:
                    # a GPU flushes float32 subnormals to zero: there row 1 is a zero row and
                    # may get another zero point; its values are zero either way
                    rows = slice(2, None) if on_device and gran != "tensor" else slice(None)
                    np.testing.assert_array_equal(np.atleast_1d(got.zero_point)[rows],
                                                  np.atleast_1d(want.zero_point)[rows])
                for q in (got, want):
                    np.testing.assert_array_equal(bakron._xp.to_numpy(q.rtn(Wx)[0])[:2], 0.0)


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


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_stacked_tables_equal_each_quantizers_tables(xp, dtype):
    """``UniformQuantizer.stacked_tables`` (what the GPU engine rounds a stack with) holds
    item ``i``'s ``tables`` at index ``i``, per-row symmetric and per-group asymmetric, and
    ``table_kind`` tells the two kinds (and the group sizes) apart."""
    from bakron._xp import to_numpy
    rng = np.random.default_rng(5)
    W = rng.standard_normal((3, 6, 10))
    dt = getattr(xp, dtype)
    for kw in ({}, {"symmetric": False, "granularity": "group", "group_size": 4}):
        qs = bakron.fit_quantizers(W, 3, **kw)
        assert len({q.table_kind() for q in qs}) == 1
        S, Z = bakron.UniformQuantizer.stacked_tables(qs, xp, None, dt)
        assert S.dtype == dt and tuple(S.shape) == (3, *qs[0].tables(xp, None, dt)[0].shape)
        for i, q in enumerate(qs):
            s_i, z_i = q.tables(xp, None, dt)
            np.testing.assert_array_equal(to_numpy(S[i, ...]), to_numpy(s_i))
            if z_i is None:
                assert Z is None
            else:
                np.testing.assert_array_equal(to_numpy(Z[i, ...]), to_numpy(z_i))
    row = bakron.fit_quantizers(W[:1], 3)[0]
    group = bakron.fit_quantizers(W[:1], 3, granularity="group", group_size=4)[0]
    group5 = bakron.fit_quantizers(W[:1], 3, granularity="group", group_size=5)[0]
    assert len({row.table_kind(), group.table_kind(), group5.table_kind()}) == 3
