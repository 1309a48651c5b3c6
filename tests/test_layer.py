"""quantize_layer: the one-call path and what it reports."""
import numpy as np
import pytest

import bakron
from _problems import spd
from conftest import to_xp


def test_quantize_layer_reports_and_beats_rtn(xp):
    rng = np.random.default_rng(5)
    m, n = 32, 48
    W = rng.standard_normal((m, n))
    H_in, H_out = spd(rng, n), spd(rng, m)
    r = bakron.quantize_layer(to_xp(xp, W), to_xp(xp, H_in), to_xp(xp, H_out), bits=3,
                              tile=(8, 8))
    assert type(r.values) is type(to_xp(xp, W))
    v = bakron._xp.to_numpy(r.values)
    assert v.shape == (m, n) and v.dtype == np.float64
    assert r.proxy_error == pytest.approx(bakron.proxy_error(W, v, H_in, H_out))
    assert r.proxy_error_one_sided == pytest.approx(bakron.proxy_error(W, v, H_in))
    assert r.rtn_proxy_error == pytest.approx(
        bakron.proxy_error(W, bakron._xp.to_numpy(r.rtn_values), H_in, H_out))
    assert r.proxy_error < r.rtn_proxy_error
    assert r.damp_in == 0.01 and r.damp_out == 0.01
    s = r.summary()
    auto = ("antidiagonal", "recursive") + (("wavefront",) if bakron._xp.is_cupy(xp) else ())
    assert s["method"] in auto and s["tile"] == [8, 8]  # wavefront: the cuda engine's auto


def test_quantize_layer_one_sided_is_gptq_like():
    rng = np.random.default_rng(6)
    W = rng.standard_normal((16, 40)).astype(np.float32)
    H_in = spd(rng, 40)
    r = bakron.quantize_layer(W, H_in, bits=4, tile=(16, 8))
    assert r.values.dtype == np.float32 and r.factor_out is None and r.damp_out is None
    assert r.proxy_error == r.proxy_error_one_sided
    assert r.proxy_error_one_sided < r.rtn_proxy_error_one_sided


def test_quantize_layer_with_custom_tile_quantizer():
    class Sign:
        def quantize(self, targets):
            v = np.where(targets >= 0, 0.8, -0.8)
            return v, (v > 0).astype(np.int16)

    rng = np.random.default_rng(7)
    W = rng.standard_normal((8, 12))
    r = bakron.quantize_layer(W, spd(rng, 12), spd(rng, 8), quantizer=Sign(), tile=(4, 4))
    assert set(np.unique(r.values)) <= {-0.8, 0.8}
    np.testing.assert_array_equal(r.rtn_values, np.where(W >= 0, 0.8, -0.8))


def test_shrink_out_one_is_the_one_sided_rounding():
    rng = np.random.default_rng(7)
    W = rng.standard_normal((24, 48)).astype(np.float32)
    X = rng.standard_normal((300, 48))
    G = rng.standard_normal((60, 24))
    H_in, H_out = X.T @ X, G.T @ G
    quantize_layer = bakron.quantize_layer
    kw = dict(bits=3, tile=(1, 1), metrics="none")
    one = quantize_layer(W, H_in, None, **kw)
    full = quantize_layer(W, H_in, H_out, shrink_out=1.0, **kw)
    assert np.array_equal(full.codes, one.codes)
    half = quantize_layer(W, H_in, H_out, shrink_out=0.5, damp_out=0.2, **kw)
    assert half.damp_out == pytest.approx(0.2) and half.damp_in == pytest.approx(0.01)
    with pytest.raises(ValueError, match="shrink"):
        quantize_layer(W, H_in, H_out, shrink_out=-0.1, **kw)
