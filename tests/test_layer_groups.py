"""quantize_layers: same-shape layers solved as stacks, results as quantize_layer one by one."""
from __future__ import annotations

import numpy as np
import pytest

import bakron
from _problems import spd


def _layers(seed=0):
    rng = np.random.default_rng(seed)
    H16, H24 = spd(rng, 16), spd(rng, 24)         # shared input Hessians (q/k/v-like)
    out = []
    for m, n, H_in, two in [(24, 16, H16, True), (12, 24, H24, False), (24, 16, H16, True),
                            (24, 16, spd(rng, 16), True), (12, 24, H24, False),
                            (24, 16, H16, False), (12, 16, H16, True)]:
        W = rng.standard_normal((m, n))
        out.append((W, H_in, spd(rng, m)) if two else (W, H_in))
    return out


@pytest.mark.parametrize("engine", ["array_api", "auto"])
def test_each_layer_equals_quantize_layer(engine):
    layers = _layers()
    copies = [tuple(a.copy() for a in layer) for layer in layers]
    got = bakron.quantize_layers(layers, bits=3, tile=4, engine=engine)
    assert len(got) == len(layers)
    sizes = []
    for layer, c, r in zip(layers, copies, got):
        one = bakron.quantize_layer(*layer, bits=3, tile=4, engine=engine)
        np.testing.assert_array_equal(r.values, one.values)
        np.testing.assert_array_equal(r.codes, one.codes)
        np.testing.assert_array_equal(r.rtn_values, one.rtn_values)
        assert r.proxy_error == one.proxy_error
        assert r.rtn_proxy_error_one_sided == one.rtn_proxy_error_one_sided
        assert r.damp_in == one.damp_in and r.damp_out == one.damp_out
        for a, a0 in zip(layer, c):
            np.testing.assert_array_equal(a, a0)
        sizes.append(r.solve.info["stack"]["items"])
    # groups: 24x16 two-sided (layers 0, 2, 3), 12x24 one-sided (1, 4), then singletons
    assert sizes == [3, 2, 3, 3, 2, 1, 1]
    assert [r.solve.info["stack"]["index"] for r in got[:5]] == [0, 0, 1, 2, 1]


def test_shared_hessian_is_prepared_once():
    layers = _layers()
    got = bakron.quantize_layers(layers, bits=2, tile=4)
    assert got[0].factor_in is got[2].factor_in       # same H16 object, same block
    assert got[3].factor_in is not got[0].factor_in   # another Hessian


def test_per_layer_quantizers_and_errors():
    layers = _layers()[:3]
    qs = [bakron.UniformQuantizer.fit(layer[0], 4) for layer in layers]
    got = bakron.quantize_layers(layers, quantizer=qs, tile=4)
    for layer, q, r in zip(layers, qs, got):
        assert r.quantizer is q
        np.testing.assert_array_equal(
            r.values, bakron.quantize_layer(*layer, quantizer=q, tile=4).values)
    with pytest.raises(ValueError, match="quantizer is a sequence of 2 quantizers but there "
                                         "are 3 layers"):
        bakron.quantize_layers(layers, quantizer=qs[:2], tile=4)
    bad = layers + [(layers[0][0], layers[1][1])]   # H_in of the wrong size
    with pytest.raises(ValueError, match=r"layers\[3\]: H_in has shape \(24, 24\) but W has 16 "
                                         r"columns"):
        bakron.quantize_layers(bad, bits=2, tile=4)
    with pytest.raises(ValueError, match=r"layers\[0\] must be a tuple \(W, H_in\) or "
                                         r"\(W, H_in, H_out\), got 1 entries"):
        bakron.quantize_layers([(layers[0][0],)], bits=2)


def test_errors_return_isolates_the_bad_layers():
    layers = _layers()[:4]
    H_bad = -np.eye(16)                              # not a Hessian: its preparation fails
    nan_W = layers[2][0].copy()
    nan_W[0, 0] = np.nan                             # rejected by the layer's checks
    bad = [layers[0], (layers[1][0], layers[1][1]), (nan_W, layers[2][1], layers[2][2]),
           (layers[3][0], H_bad, layers[3][2])]
    with pytest.raises(ValueError, match=r"layers\[2\]: W contains 1 NaN"):
        bakron.quantize_layers(bad, bits=2, tile=4)
    got = bakron.quantize_layers(bad, bits=2, tile=4, errors="return")
    assert isinstance(got[2], ValueError) and "layers[2]: W contains 1 NaN" in str(got[2])
    assert isinstance(got[3], ValueError) and "layers[3]: H_in has negative diagonal" in str(got[3])
    for k in (0, 1):
        np.testing.assert_array_equal(got[k].values,
                                      bakron.quantize_layer(*bad[k], bits=2, tile=4).values)


def test_a_failing_stack_is_retried_layer_by_layer():
    class FailsOnBigValues:
        """A tile quantizer that refuses targets beyond 4 (as a custom grid may)."""

        def quantize(self, targets):
            if float(np.max(np.abs(targets))) > 4:
                raise ValueError("target out of range")
            return np.round(targets), None

    layers = _layers()[:3]
    big = (layers[2][0] * 100, layers[2][1], layers[2][2])
    got = bakron.quantize_layers([layers[0], big], quantizer=FailsOnBigValues(), tile=4,
                                 errors="return")
    assert isinstance(got[1], ValueError) and "layers[1]: target out of range" in str(got[1])
    one = bakron.quantize_layer(*layers[0], quantizer=FailsOnBigValues(), tile=4)
    np.testing.assert_array_equal(got[0].values, one.values)
