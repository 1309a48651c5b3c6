"""``input_factors``: H_in from forward passes alone is bitwise the H_in of ``global_factors``
(an MLP, a transformer on padded token ids with weights, float32 sums, cross-fitted folds,
a subset of layers), a stage without ``forward_collect`` falls back to its VJP, and bad input
is refused as ``global_factors`` refuses it."""
from __future__ import annotations

import numpy as np
import pytest

import bakron.hessian as bh
from bakron import _xp
from conftest import to_xp
from test_hessian_transformer import V, _chain, _weights


def _np(a):
    return np.asarray(_xp.to_numpy(a))


def _mlp(rng):
    W1, W2, W3 = rng.normal(size=(16, 8)), rng.normal(size=(12, 16)), rng.normal(size=(5, 12))
    return [bh.Linear(W1, rng.normal(size=16), name="fc1"), bh.ReLU(),
            bh.Linear(W2, name="fc2"), bh.GELU(), bh.Linear(W3, name="out"),
            bh.SoftmaxCrossEntropy()]


def _same(glob, fwd):
    assert list(fwd) == list(glob)
    for key, (Hi, _) in glob.items():
        np.testing.assert_array_equal(_np(fwd[key]), _np(Hi), err_msg=key)


@pytest.mark.parametrize("in_estimator", ["mean", "crossfit", "crossfit:3"])
def test_mlp_input_factors_are_the_global_pass_h_in(in_estimator):
    rng = np.random.default_rng(0)
    stages, X = _mlp(rng), rng.normal(size=(100, 8))
    w = [rng.uniform(0, 2, size=16) for _ in range(6)] + [rng.uniform(0, 2, size=4)]
    glob, _ = bh.global_factors(stages, X, batch_size=16, weights=w, in_estimator=in_estimator)
    fwd, rep = bh.input_factors(stages, X, batch_size=16, weights=w, in_estimator=in_estimator)
    _same(glob, fwd)
    assert rep.vjp_evals == 0 and rep.head_evals == 0 and rep.stage_evals == 5 * 7
    assert "forward only" in str(rep)


@pytest.mark.parametrize("accum", [None, "float32"])
def test_transformer_input_factors_are_the_global_pass_h_in(xp, accum):
    """Padded token ids, per-token weights, float32 activations and sums (quantize-model's
    setting) or float64: the same bits as the K-FAC pass's H_in, on numpy and cupy."""
    dt = np.float32 if accum else np.float64
    w = {k: to_xp(xp, v.astype(dt)) for k, v in _weights(30).items()}
    rng = np.random.default_rng(31)
    seqs = [list(rng.integers(0, V, size=n)) for n in (5, 2, 4, 4, 3, 5)]
    batches = [to_xp(xp, b) for b in bh.pad_batches(seqs, batch_size=2)[0]]
    weights = [to_xp(xp, rng.uniform(0.5, 2.0, size=tuple(b.shape))) for b in batches]
    kw = {"accum_dtype": getattr(xp, accum)} if accum else {}
    glob, _ = bh.global_factors(_chain(w, labels=None), batches, weights=weights, **kw)
    fwd, rep = bh.input_factors(_chain(w, labels=None), batches, weights=weights, **kw)
    _same(glob, fwd)
    assert rep.n_layers == 14 and rep.peak_buffer_bytes > 0
    # what quantize-model checks against --memory-budget bounds what the pass held
    from bakron.hessian.forward import input_peak_bytes

    bound = input_peak_bytes(_chain(w, labels=None), batches, **kw)
    assert rep.peak_bytes <= bound <= 2 * rep.peak_bytes


def test_crossfitted_and_selected_layers():
    """``in_estimator="crossfit"`` (q/k/v and gate/up cross-fitted once, each layer its own
    copy) and ``layers=``: the pass stops after the last stage holding a wanted layer."""
    w = _weights(32)
    rng = np.random.default_rng(33)
    seqs = [list(rng.integers(0, V, size=5)) for _ in range(8)]
    batches, _ = bh.pad_batches(seqs, batch_size=2)
    glob, _ = bh.global_factors(_chain(w), batches, in_estimator="crossfit")
    fwd, _ = bh.input_factors(_chain(w), batches, in_estimator="crossfit")
    _same(glob, fwd)
    assert not np.shares_memory(fwd["blk.0.attn_q"], fwd["blk.0.attn_k"])
    pick = ["blk.0.attn_v", "blk.0.ffn_down"]
    got, rep = bh.input_factors(_chain(w), batches, layers=pick)
    assert list(got) == pick
    assert rep.stage_evals == 3 * len(batches)   # embedding, attention block, ffn block
    handed = []
    out, _ = bh.input_factors(_chain(w), batches, layers=pick,
                              sink=lambda n, Hi, Ho: handed.append((n, Hi, Ho)))
    assert out == {} and [n for n, _, _ in handed] == pick
    assert all(Ho is None for _, _, Ho in handed)
    for n, Hi, _ in handed:
        np.testing.assert_array_equal(Hi, got[n])


class _NoForwardCollect:
    """A linear stage without ``forward_collect``: only the protocol's required methods."""

    def __init__(self, W, name):
        self.lin = bh.Linear(W, name=name)

    def linears(self):
        return self.lin.linears()

    def arrays(self):
        return self.lin.arrays()

    def out_shape(self, in_shape):
        return self.lin.out_shape(in_shape)

    def forward(self, xp, h):
        return self.lin.forward(xp, h)

    def vjp(self, xp, h, delta, collect, need_input_grad=True):
        return self.lin.vjp(xp, h, delta, collect, need_input_grad)


def test_a_stage_without_forward_collect_falls_back_to_its_vjp():
    rng = np.random.default_rng(4)
    stages = _mlp(rng)
    stages[2] = _NoForwardCollect(stages[2].W, "fc2")
    X = rng.normal(size=(40, 8))
    glob, _ = bh.global_factors(stages, X, batch_size=16)
    fwd, _ = bh.input_factors(stages, X, batch_size=16)
    _same(glob, fwd)


def test_bad_input_is_refused_by_name():
    rng = np.random.default_rng(5)
    stages = _mlp(rng)
    with pytest.raises(ValueError, match="ending with a head"):
        bh.input_factors(stages[:-1], rng.normal(size=(4, 8)))
    with pytest.raises(ValueError, match="expects inputs with 8 features"):
        bh.input_factors(stages, rng.normal(size=(4, 7)))
    X = rng.normal(size=(4, 8))
    X[2, 3] = np.nan
    with pytest.raises(ValueError, match="calibration batch 0"):
        bh.input_factors(stages, X)
    with pytest.raises(ValueError, match="in_estimator"):
        bh.input_factors(stages, rng.normal(size=(4, 8)), in_estimator="median")
    with pytest.raises(ValueError, match="'nope' not in the chain"):
        bh.input_factors(stages, rng.normal(size=(4, 8)), layers=["nope"])
    big = _mlp(rng)
    big[0] = bh.Linear(1e308 * np.ones((16, 8)), name="fc1")
    with np.errstate(over="ignore"), pytest.raises(
            ValueError, match="non-finite activation: the output of stage 0"):
        bh.input_factors(big, np.ones((4, 8)))
