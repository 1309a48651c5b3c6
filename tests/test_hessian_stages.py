"""The ready stages: forward values, VJPs against finite differences, the Fisher head."""
from __future__ import annotations

import math

import numpy as np
import pytest

import bakron.hessian as bh
from bakron import _xp
from bakron.hessian.stages import HeadContext
from conftest import to_xp


def _np(a):
    return np.asarray(_xp.to_numpy(a))


def _stages(rng, d=5):
    return {
        "linear": bh.Linear(rng.standard_normal((4, d)), rng.standard_normal(4), name="w"),
        "bias": bh.Bias(rng.standard_normal(d)),
        "relu": bh.ReLU(),
        "gelu": bh.GELU(),
        "layernorm": bh.LayerNorm(rng.standard_normal(d), rng.standard_normal(d)),
        "layernorm_plain": bh.LayerNorm(),
        "residual": bh.Residual([bh.LayerNorm(), bh.Linear(rng.standard_normal((3, d)), name="a"),
                                 bh.GELU(), bh.Linear(rng.standard_normal((d, 3)), name="b")],
                                name="blk"),
    }


@pytest.mark.parametrize("kind", list(_stages(np.random.default_rng(0))))
def test_vjp_matches_finite_differences(xp, kind):
    rng = np.random.default_rng(1)
    stage = _stages(np.random.default_rng(0))[kind]
    if kind in ("linear", "bias", "layernorm", "residual"):   # parameters into namespace xp
        for attr in ("W", "b", "gamma", "beta"):
            if getattr(stage, attr, None) is not None:
                setattr(stage, attr, to_xp(xp, getattr(stage, attr)))
        for inner in getattr(stage, "stages", []):
            if hasattr(inner, "W"):
                inner.W = to_xp(xp, inner.W)
    h = rng.standard_normal((2, 3, 5))
    out_shape = stage.out_shape(h.shape)
    delta = rng.standard_normal(out_shape)
    v = rng.standard_normal(h.shape)
    got = []
    d = stage.vjp(xp, to_xp(xp, h), to_xp(xp, delta), lambda *a: got.append(a))
    lhs = float(np.sum(_np(d) * v))
    eps = 1e-5

    def f(x):
        return _np(stage.forward(xp, to_xp(xp, x)))

    fd = (f(h + eps * v) - f(h - eps * v)) / (2 * eps)
    assert f(h).shape == out_shape
    assert lhs == pytest.approx(float(np.sum(fd * delta)), rel=1e-7, abs=1e-8)
    collected = {key: (x, g) for key, x, g in got}
    assert len(got) == len(collected) and collected.keys() == stage.linears().keys()
    for name, (m, n) in stage.linears().items():
        x, g = collected[name]
        assert x.shape[-1] == n and g.shape[-1] == m and x.shape[:-1] == g.shape[:-1]
    # need_input_grad=False still collects, returns nothing
    got.clear()
    assert stage.vjp(xp, to_xp(xp, h), to_xp(xp, delta), lambda *a: got.append(a),
                     need_input_grad=False) is None
    assert len(got) == len(stage.linears())


def test_linear_collects_its_input_and_output_gradient():
    rng = np.random.default_rng(2)
    W = rng.standard_normal((3, 4))
    lin = bh.Linear(W, name="fc")
    h, g = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 3))
    seen = []
    d = lin.vjp(np, h, g, lambda k, x, gg: seen.append((k, x, gg)))
    (key, x, gg), = seen
    assert key == "fc" and x is h and gg is g
    np.testing.assert_allclose(d, g @ W)
    np.testing.assert_allclose(lin.forward(np, h), h @ W.T)


def test_gelu_is_the_exact_erf_form(xp):
    x = np.array([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0])
    ref = np.array([x_ * 0.5 * (1 + math.erf(x_ / math.sqrt(2))) for x_ in x])
    got = _np(bh.GELU().forward(xp, to_xp(xp, x[None, :])))[0]
    np.testing.assert_allclose(got, ref, rtol=1e-15, atol=1e-16)
    assert got[4] == pytest.approx(0.8413447460685429, rel=1e-15)   # GELU(1) = Φ(1)


def test_layer_norm_output_is_normalised():
    x = np.random.default_rng(3).standard_normal((4, 7)) * 5 + 2
    y = bh.LayerNorm(eps=1e-12).forward(np, x)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-13)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-10)


def test_residual_names_and_shape_check():
    rng = np.random.default_rng(4)
    res = bh.Residual([bh.Linear(rng.standard_normal((3, 5))), bh.ReLU(),
                       bh.Linear(rng.standard_normal((5, 3)), name="down")], name="blk")
    assert res.linears() == {"blk.0": (3, 5), "blk.down": (5, 3)}
    bad = bh.Residual([bh.Linear(rng.standard_normal((3, 5)), name="up")], name="blk")
    with pytest.raises(ValueError, match="maps shape .* a residual needs them equal"):
        bad.out_shape((2, 5))
    with pytest.raises(ValueError, match="inner stage 0 is a head"):
        bh.Residual([bh.SoftmaxCrossEntropy()], name="x")


def test_stage_constructors_reject_bad_parameters():
    with pytest.raises(ValueError, match="W must be a non-empty 2-D array"):
        bh.Linear(np.ones(3), name="x")
    with pytest.raises(ValueError, match=r"b must have shape \(2,\)"):
        bh.Linear(np.ones((2, 3)), np.ones(3), name="x")
    with pytest.raises(ValueError, match="gamma .* and beta .* must have the same shape"):
        bh.LayerNorm(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="eps must be > 0"):
        bh.LayerNorm(eps=0.0)
    with pytest.raises(ValueError, match="adds a bias of length 3"):
        bh.Bias(np.ones(3)).out_shape((2, 4))


def test_fisher_labels_are_seeded_and_follow_the_model(xp):
    head = bh.SoftmaxCrossEntropy()
    p = np.array([0.1, 0.6, 0.3])
    z = np.tile(np.log(p), (20000, 1))
    y0 = _np(head.labels_for(xp, to_xp(xp, z), HeadContext(0, 7)))
    y1 = _np(head.labels_for(xp, to_xp(xp, z), HeadContext(0, 7)))
    y2 = _np(head.labels_for(xp, to_xp(xp, z), HeadContext(1, 7)))
    assert np.array_equal(y0, y1) and not np.array_equal(y0, y2)
    freq = np.bincount(y0, minlength=3) / len(y0)
    # 5 standard errors of a binomial proportion at n = 20000
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / len(y0)))
    g = _np(head.grad(xp, to_xp(xp, z[:5]), HeadContext(0, 7)))
    onehot = np.eye(3)[y0[:5]]
    np.testing.assert_allclose(g, p - onehot, atol=1e-15)


def test_fixed_labels_and_their_validation():
    z = np.zeros((2, 3, 4))
    head = bh.SoftmaxCrossEntropy(labels=[np.array([[0, 1, 2], [3, 0, 1]])])
    y = head.labels_for(np, z, HeadContext(0, 0))
    np.testing.assert_array_equal(y, [[0, 1, 2], [3, 0, 1]])
    np.testing.assert_allclose(head.token_losses(np, z, y), np.log(4))
    with pytest.raises(ValueError, match="labels for 1 batches, but batch 1"):
        head.labels_for(np, z, HeadContext(1, 0))
    bad = bh.SoftmaxCrossEntropy(labels=[np.array([[0, 1, 4], [0, 0, 0]])])
    with pytest.raises(ValueError, match=r"must lie in 0\.\.3"):
        bad.labels_for(np, z, HeadContext(0, 0))
    bad = bh.SoftmaxCrossEntropy(labels=[np.zeros(3, dtype=int)])
    with pytest.raises(ValueError, match=r"need \(2, 3\)"):
        bad.labels_for(np, z, HeadContext(0, 0))
