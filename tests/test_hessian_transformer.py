"""Transformer stages: every VJP against central finite differences (float64, tiny configs),
the LM head, padding, the driver on token ids, and the checkpoint schedules."""
from __future__ import annotations

import math

import numpy as np
import pytest

import bakron.hessian as bh
from bakron import _xp
from bakron.hessian.stages import HeadContext
from bakron.hessian.transformer import _rope_apply, _rope_tables, rope_inv_freq
from conftest import to_xp

D, H, KV, HD, FF, V, T, B = 8, 2, 1, 4, 12, 11, 5, 2
EPS = 1e-5


def _np(a):
    return np.asarray(_xp.to_numpy(a))


def _weights(seed=0, *, n_blocks=2, qk_norm=False):
    rng = np.random.default_rng(seed)
    w = {"token_embd.weight": rng.standard_normal((V, D)),
         "output_norm.weight": 1.0 + 0.1 * rng.standard_normal(D)}
    for i in range(n_blocks):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = 1.0 + 0.1 * rng.standard_normal(D)
        w[p + "attn_q.weight"] = rng.standard_normal((H * HD, D)) / math.sqrt(D)
        w[p + "attn_k.weight"] = rng.standard_normal((KV * HD, D)) / math.sqrt(D)
        w[p + "attn_v.weight"] = rng.standard_normal((KV * HD, D)) / math.sqrt(D)
        w[p + "attn_output.weight"] = rng.standard_normal((D, H * HD)) / math.sqrt(H * HD)
        if qk_norm:
            w[p + "attn_q_norm.weight"] = 1.0 + 0.2 * rng.standard_normal(HD)
            w[p + "attn_k_norm.weight"] = 1.0 + 0.2 * rng.standard_normal(HD)
        w[p + "ffn_norm.weight"] = 1.0 + 0.1 * rng.standard_normal(D)
        w[p + "ffn_gate.weight"] = rng.standard_normal((FF, D)) / math.sqrt(D)
        w[p + "ffn_up.weight"] = rng.standard_normal((FF, D)) / math.sqrt(D)
        w[p + "ffn_down.weight"] = rng.standard_normal((D, FF)) / math.sqrt(FF)
    return w


def _attention(w, i, *, theta=100.0):
    p = f"blk.{i}."
    return bh.Attention(w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"],
                        w[p + "attn_output.weight"], num_heads=H, num_kv_heads=KV, head_dim=HD,
                        rope_theta=theta, q_norm=w.get(p + "attn_q_norm.weight"),
                        k_norm=w.get(p + "attn_k_norm.weight"), eps=EPS)


def _chain(w, *, n_blocks=2, labels="true", **head_kw):
    st = [bh.Embedding(w["token_embd.weight"])]
    for i in range(n_blocks):
        p = f"blk.{i}."
        st.append(bh.Residual([bh.RMSNorm(w[p + "attn_norm.weight"], eps=EPS),
                               _attention(w, i)], name=f"blk.{i}"))
        st.append(bh.Residual([bh.RMSNorm(w[p + "ffn_norm.weight"], eps=EPS),
                               bh.SwiGLU(w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"],
                                         w[p + "ffn_down.weight"])], name=f"blk.{i}"))
    st.append(bh.RMSNorm(w["output_norm.weight"], eps=EPS, name="output_norm"))
    st.append(bh.LMHead(w["token_embd.weight"], labels=labels, **head_kw))
    return st


def _ids(lengths=(T, 3), seed=1):
    rng = np.random.default_rng(seed)
    seqs = [list(rng.integers(0, V, size=n)) for n in lengths]
    return seqs, bh.pad_batches(seqs, batch_size=len(seqs))[0][0]


def _linear_W(stage, key):
    """(object, attribute) of the weight called ``key`` inside ``stage``."""
    if isinstance(stage, bh.Attention):
        return stage, ("Wq", "Wk", "Wv", "Wo")[stage.names.index(key)]
    return stage, ("W_gate", "W_up", "W_down")[stage.names.index(key)]


# --------------------------------------------------------------------------------------------
# single stages
# --------------------------------------------------------------------------------------------
def _stage_cases():
    w = _weights(0, n_blocks=1)
    wq = _weights(0, n_blocks=1, qk_norm=True)
    return {
        "rmsnorm": lambda: bh.RMSNorm(w["blk.0.attn_norm.weight"], eps=EPS),
        "attention": lambda: _attention(w, 0),
        "attention_qk_norm": lambda: _attention(wq, 0),
        "attention_one_sequence_at_a_time": lambda: _chunked(_attention(wq, 0)),
        "attention_mha": lambda: bh.Attention(*(np.random.default_rng(3).standard_normal(s)
                                                for s in ((8, D), (8, D), (8, D), (D, 8))),
                                              num_heads=2, num_kv_heads=2, head_dim=4,
                                              rope_theta=10.0),
        "swiglu": lambda: bh.SwiGLU(w["blk.0.ffn_gate.weight"], w["blk.0.ffn_up.weight"],
                                    w["blk.0.ffn_down.weight"]),
    }


def _chunked(stage):
    stage.score_bytes = 1       # the scores of one sequence at a time
    return stage


def _to(xp, stage):
    for attr in ("weight", "Wq", "Wk", "Wv", "Wo", "q_norm", "k_norm", "W_gate", "W_up",
                 "W_down"):
        if getattr(stage, attr, None) is not None:
            setattr(stage, attr, to_xp(xp, getattr(stage, attr)))
    return stage


@pytest.mark.parametrize("kind", list(_stage_cases()))
def test_stage_vjp_and_collected_gradients_match_finite_differences(xp, kind):
    stage = _to(xp, _stage_cases()[kind]())
    rng = np.random.default_rng(2)
    h = rng.standard_normal((B, T, D))
    delta = rng.standard_normal(stage.out_shape(h.shape))
    got = []
    dx = stage.vjp(xp, to_xp(xp, h), to_xp(xp, delta), lambda *a: got.append(a))
    eps = 1e-5

    def f(x):
        return _np(stage.forward(xp, to_xp(xp, x)))

    v = rng.standard_normal(h.shape)
    fd = float(np.sum((f(h + eps * v) - f(h - eps * v)) * delta)) / (2 * eps)
    assert float(np.sum(_np(dx) * v)) == pytest.approx(fd, rel=1e-7, abs=1e-9)
    keys = [k for k, _, _ in got]
    assert sorted(keys) == sorted(stage.linears()) and len(keys) == len(set(keys))
    for key, x, g in got:   # the weight gradient Σ_t g_t x_tᵀ against FD in the weight
        obj, attr = _linear_W(stage, key)
        W0 = getattr(obj, attr)
        E = rng.standard_normal(tuple(W0.shape))
        G = _np(g).reshape(-1, W0.shape[0]).T @ _np(x).reshape(-1, W0.shape[1])
        vals = []
        for s in (1, -1):
            setattr(obj, attr, W0 + to_xp(xp, s * eps * E))
            vals.append(float(np.sum(f(h) * delta)))
        setattr(obj, attr, W0)
        assert float(np.sum(G * E)) == pytest.approx((vals[0] - vals[1]) / (2 * eps),
                                                     rel=1e-7, abs=1e-9), key


def test_rmsnorm_matches_definition():
    x = np.random.default_rng(0).standard_normal((3, 4, 6))
    w = np.linspace(0.5, 2.0, 6)
    y = bh.RMSNorm(w, eps=1e-5).forward(np, x)
    ref = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(y, ref, rtol=1e-14)
    y32 = bh.RMSNorm(w.astype(np.float32), eps=1e-5).forward(np, x.astype(np.float32))
    assert y32.dtype == np.float32


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(0)
    hd = 8
    inv = rope_inv_freq(hd, 1e4)
    cos, sin = _rope_tables(np, inv, 12, np.float64, "cpu")
    q, k = rng.standard_normal(hd), rng.standard_normal(hd)
    rot = lambda x, p: _rope_apply(np, x, cos[p], sin[p])  # noqa: E731
    assert rot(q, 0) @ rot(k, 0) == pytest.approx(q @ k, rel=1e-12)
    a, b = rot(q, 7) @ rot(k, 3), rot(q, 9) @ rot(k, 5)
    assert a == pytest.approx(b, rel=1e-6) and abs(a - q @ k) > 1e-3
    # the "rotate half" layout pairs coordinate i with i + hd/2 at frequency theta^(-2i/hd)
    x = np.zeros(hd)
    x[1] = 1.0
    y = rot(x, 1)
    f = 1e4 ** (-2 / hd)
    assert y[1] == pytest.approx(math.cos(f), rel=1e-6)
    assert y[1 + hd // 2] == pytest.approx(math.sin(f), rel=1e-6)


def test_llama3_rope_scaling():
    base = rope_inv_freq(64, 5e5)
    sc = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    got = rope_inv_freq(64, 5e5, sc)
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4          # short wavelengths are kept
    low = wavelen > 8192               # long ones are stretched by the factor
    np.testing.assert_allclose(got[high], base[high])
    np.testing.assert_allclose(got[low], base[low] / 32, rtol=1e-6)
    mid = ~high & ~low
    assert mid.any() and np.all(got[mid] < base[mid]) and np.all(got[mid] > base[mid] / 32)
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(64, 5e5, {"rope_type": "yarn", "factor": 4.0})


def test_attention_is_causal_and_sees_no_padding():
    st = _attention(_weights(0, n_blocks=1), 0)
    h = np.random.default_rng(4).standard_normal((1, T, D))
    y = st.forward(np, h)
    h2 = h.copy()
    h2[0, 3:] += 5.0                   # later tokens (padding) change nothing before them
    np.testing.assert_allclose(st.forward(np, h2)[0, :3], y[0, :3], rtol=1e-12)
    np.testing.assert_allclose(st.forward(np, h[:, :3])[0], y[0, :3], rtol=1e-12)
    small = _attention(_weights(0, n_blocks=1), 0)
    small.score_bytes = 1          # one sequence at a time gives the same numbers
    hh = np.random.default_rng(5).standard_normal((3, T, D))
    np.testing.assert_allclose(small.forward(np, hh), st.forward(np, hh), rtol=1e-12)


# --------------------------------------------------------------------------------------------
# the LM head
# --------------------------------------------------------------------------------------------
def test_lm_head_sampled_matches_softmax_cross_entropy_and_chunks(xp):
    rng = np.random.default_rng(0)
    W = rng.standard_normal((V, D))
    z = rng.standard_normal((B, T, D))
    ctx = HeadContext(3, 9)
    g = _np(bh.LMHead(to_xp(xp, W)).grad(xp, to_xp(xp, z), ctx))
    ref = _np(bh.SoftmaxCrossEntropy().grad(xp, to_xp(xp, z @ W.T), ctx)) @ W
    np.testing.assert_allclose(g, ref, rtol=1e-12, atol=1e-13)
    for kw in ({"chunk_tokens": 1}, {"chunk_tokens": 3}, {"chunk_bytes": 8 * V * 4}):
        g2 = _np(bh.LMHead(to_xp(xp, W), **kw).grad(xp, to_xp(xp, z), ctx))
        np.testing.assert_allclose(g2, g, rtol=1e-12, atol=1e-13)
    other = _np(bh.LMHead(to_xp(xp, W)).grad(xp, to_xp(xp, z), HeadContext(4, 9)))
    assert not np.allclose(other, g)
    mask = np.ones((B, T), dtype=bool)
    mask[1, 3:] = False
    gm = _np(bh.LMHead(to_xp(xp, W)).grad(xp, to_xp(xp, z), HeadContext(3, 9, None,
                                                                         to_xp(xp, mask))))
    np.testing.assert_allclose(gm[mask], g[mask], rtol=1e-12)
    assert np.all(gm[~mask] == 0)


def test_lm_head_true_labels_are_the_next_tokens():
    rng = np.random.default_rng(1)
    W = rng.standard_normal((V, D))
    seqs, ids = _ids()
    z = rng.standard_normal((B, ids.shape[1], D))
    head = bh.LMHead(W, labels="true", chunk_tokens=2)
    ctx = HeadContext(0, 0, ids, ids >= 0)
    g = head.grad(np, z, ctx)
    logits = z @ W.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    for b, s in enumerate(seqs):
        for t in range(ids.shape[1]):
            if t + 1 < len(s):
                want = (p[b, t] - np.eye(V)[s[t + 1]]) @ W
            else:                      # the last real position and padding: no label
                want = np.zeros(D)
            np.testing.assert_allclose(g[b, t], want, rtol=1e-12, atol=1e-14)
    nll = head.token_losses(np, z, ctx)
    assert nll[0, 0] == pytest.approx(-math.log(p[0, 0, seqs[0][1]]))
    assert np.isnan(nll[1, 2]) and np.isnan(nll[1, 4]) and np.isfinite(nll[1, 1])
    lp = head.log_softmax(np, z)
    np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0, rtol=1e-12)
    fixed = bh.LMHead(W, labels=[np.where(ids >= 0, ids, -1)])
    y = fixed._given_labels(np, ids.shape, HeadContext(0, 0), "cpu")
    assert np.array_equal(y, np.where(ids >= 0, ids, -1))


def test_lm_head_errors():
    W = np.ones((V, D))
    with pytest.raises(ValueError, match="labels must be None, 'true'"):
        bh.LMHead(W, labels="sampled")
    with pytest.raises(ValueError, match="chunk_bytes"):
        bh.LMHead(W, chunk_bytes=0)
    with pytest.raises(ValueError, match="projects 8 features"):
        bh.LMHead(W).check_input((2, 3, 5))
    with pytest.raises(ValueError, match="next token from the calibration ids"):
        bh.LMHead(W, labels="true").grad(np, np.ones((2, 3, D)), HeadContext(0, 0))
    with pytest.raises(ValueError, match="below the vocabulary size"):
        bh.LMHead(W, labels=[np.full((2, 3), V)]).grad(np, np.ones((2, 3, D)),
                                                        HeadContext(0, 0))


# --------------------------------------------------------------------------------------------
# the whole chain: the loss gradient with respect to every weight, with padding
# --------------------------------------------------------------------------------------------
def _run_chain(xp, stages, ids, seed=0, batch_index=0):
    """Forward, head gradient and reverse pass by hand; returns ``{key: Σ g xᵀ}``, the
    collected rows (masked) and the summed loss over labelled positions."""
    body, head = stages[:-1], stages[-1]
    mask = body[0].token_mask(xp, ids)
    ctx = HeadContext(batch_index, seed, ids, mask)
    states = [ids]
    for st in body:
        states.append(st.forward(xp, states[-1]))
    delta = head.grad(xp, states[-1], ctx)
    grads, rows = {}, {}
    m = _np(mask)
    def collect(key, x, g):      # a Residual hands out its full keys ("blk.0.attn_q")
        X, G = _np(x), _np(g)
        grads[key] = G[m].T @ X[m]
        rows[key] = (X, G)

    for i in range(len(body) - 1, -1, -1):
        delta = body[i].vjp(xp, states[i], delta, collect, need_input_grad=i > 0)
    loss = float(np.nansum(_np(head.token_losses(xp, states[-1], ctx))))
    return grads, rows, loss


def _set_weight(stages, key, W):
    for st in stages:
        if isinstance(st, bh.Residual) and key.startswith(st.name + "."):
            for inner in st.stages:
                short = key[len(st.name) + 1:]
                if short in getattr(inner, "names", ()):
                    obj, attr = _linear_W(inner, short)
                    old = getattr(obj, attr)
                    setattr(obj, attr, W)
                    return old
    raise KeyError(key)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_chain_gradients_match_finite_differences_with_padding(qk_norm):
    w = _weights(5, qk_norm=qk_norm)
    stages = _chain(w, chunk_tokens=3)
    _, ids = _ids((T, 3))
    grads, rows, loss = _run_chain(np, stages, ids)
    assert len(grads) == 14
    rng = np.random.default_rng(6)
    eps = 1e-5
    for key, G in grads.items():
        E = rng.standard_normal(G.shape)
        W0 = _set_weight(stages, key, None)
        vals = []
        for s in (1, -1):
            _set_weight(stages, key, W0 + s * eps * E)
            vals.append(_run_chain(np, stages, ids)[2])
        _set_weight(stages, key, W0)
        assert float(np.sum(G * E)) == pytest.approx((vals[0] - vals[1]) / (2 * eps),
                                                     rel=1e-6, abs=1e-8), key
        X, Gr = rows[key]
        assert np.all(Gr[1, 2:] == 0)    # the short text's last position and its padding


def test_padding_changes_nothing_for_the_real_tokens():
    w = _weights(7)
    seqs, ids = _ids((T, 3))
    grads, rows, _ = _run_chain(np, _chain(w), ids)
    for b, s in enumerate(seqs):
        alone = np.asarray([s])
        _, rows1, _ = _run_chain(np, _chain(w), alone)
        for key in grads:
            np.testing.assert_allclose(rows[key][0][b, :len(s)], rows1[key][0][0],
                                       rtol=1e-10, atol=1e-13)
            np.testing.assert_allclose(rows[key][1][b, :len(s)], rows1[key][1][0],
                                       rtol=1e-9, atol=1e-13)


# --------------------------------------------------------------------------------------------
# the driver on token ids
# --------------------------------------------------------------------------------------------
def _direct_factors(w, seqs, *, labels="true", seed=0, batches=None):
    """``Σ x xᵀ / N`` and ``Σ g gᵀ / N`` over the real positions, one sequence at a time."""
    acc, N = {}, 0
    for k, s in enumerate(seqs):
        _, rows, _ = _run_chain(np, _chain(w, labels=labels), np.asarray([s]), seed=seed,
                                batch_index=k)
        N += len(s)
        for key, (X, G) in rows.items():
            X, G = X.reshape(-1, X.shape[-1]), G.reshape(-1, G.shape[-1])
            a, b = acc.get(key, (0.0, 0.0))
            acc[key] = (a + X.T @ X, b + G.T @ G)
    return {k: (a / N, b / N) for k, (a, b) in acc.items()}


def test_global_factors_on_token_ids_with_padding(xp):
    w = _weights(8)
    rng = np.random.default_rng(9)
    seqs = [list(rng.integers(0, V, size=n)) for n in (5, 2, 4, 4, 3)]
    batches, order = bh.pad_batches(seqs, batch_size=2)
    assert [b.shape for b in batches] == [(2, 5), (2, 4), (1, 2)]
    sorted_seqs = [seqs[i] for rows in order for i in rows]
    ref = _direct_factors(w, sorted_seqs)
    wx = {k: to_xp(xp, v) for k, v in w.items()}
    fac, rep = bh.global_factors(_chain(wx), [to_xp(xp, b) for b in batches])
    assert list(fac) == [f"blk.{i}.{n}" for i in range(2) for n in
                         ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                          "ffn_down")]
    for key, (Hi, Ho) in fac.items():
        np.testing.assert_allclose(_np(Hi), ref[key][0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(Ho), ref[key][1], rtol=1e-9, atol=1e-12)
    assert rep.n_layers == 14


def test_global_factors_sampled_labels_and_float32():
    w = _weights(10)
    rng = np.random.default_rng(11)
    seqs = [list(rng.integers(0, V, size=n)) for n in (5, 3)]
    batches, _ = bh.pad_batches(seqs, batch_size=2)
    f64, _ = bh.global_factors(_chain(w, labels=None), batches, seed=3)
    # padding: the short text alone in its own batch gives its own labels; compare one text
    one, _ = bh.global_factors(_chain(w, labels=None), [np.asarray([seqs[0]])], seed=3)
    assert not np.allclose(one["blk.1.ffn_down"][1], f64["blk.1.ffn_down"][1])
    w32 = {k: v.astype(np.float32) for k, v in w.items()}
    f32, _ = bh.global_factors(_chain(w32, labels=None), batches, seed=3)
    for key in f64:
        for a, b in zip(f64[key], f32[key]):
            assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(a), key
    again, _ = bh.global_factors(_chain(w, labels=None), batches, seed=3)
    for key in f64:
        assert np.array_equal(f64[key][1], again[key][1])


def test_schedules_give_identical_factors():
    w = _weights(12, n_blocks=3)
    rng = np.random.default_rng(13)
    seqs = [list(rng.integers(0, V, size=n)) for n in (5, 4, 3, 5)]
    batches, _ = bh.pad_batches(seqs, batch_size=2)
    chain = lambda: _chain(w, n_blocks=3, labels=None)  # noqa: E731
    ref, rep0 = bh.global_factors(chain(), batches, checkpoint="store_all", seed=1)
    assert rep0.recompute_factor == 1.0
    runs = {"bisection": dict(checkpoint="bisection", budget_bytes=10 ** 9),
            "binomial": dict(checkpoint="binomial", snapshots=2, budget_bytes=10 ** 9)}
    plan = bh.plan_global(chain(), batches, budget_bytes=10 ** 9)
    assert plan["leaves"]
    # a budget too small for all factor buffers at once: the layer range is bisected
    buf = sum((m * m + n * n) * 8 for m, n in
              [s for st in chain()[:-1] for s in st.linears().values()])
    runs["split"] = dict(budget_bytes=buf * 2 // 3)
    for name, kw in runs.items():
        got, rep = bh.global_factors(chain(), batches, seed=1, **kw)
        assert list(got) == list(ref), name
        for key in ref:
            for a, b in zip(ref[key], got[key]):
                np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-15, err_msg=name)
        if name != "split":
            assert rep.recompute_factor > 1.0, name
        else:
            assert len(rep.leaf_ranges) > 1


class _NoTape:
    """A stage without ``forward_tape``: its VJP recomputes its forward."""

    def __init__(self, stage):
        self._stage = stage

    def __getattr__(self, name):
        if name in ("forward_tape", "tape_bytes"):
            raise AttributeError(name)
        return getattr(self._stage, name)


@pytest.mark.parametrize("qk_norm,probs", [(False, True), (True, True), (True, False)])
def test_tapes_give_bitwise_the_recomputed_factors(qk_norm, probs, monkeypatch):
    """Store-all keeps each block's tape for its VJP: the same factors bitwise as recomputing
    the forward inside the VJP, the attention's projections run once per pass, the tapes are
    counted in the plan and the ledger, and a budget schedule still gives the same factors.
    ``probs``: whether the attention's tape holds its probabilities (short sequences)."""
    monkeypatch.setattr(bh.Attention, "_tape_probs", lambda self, T: probs)
    w = _weights(14, n_blocks=2, qk_norm=qk_norm)
    rng = np.random.default_rng(15)
    seqs = [list(rng.integers(0, V, size=n)) for n in (5, 4, 3, 5)]
    batches, _ = bh.pad_batches(seqs, batch_size=2)
    calls = []
    prepare = bh.Attention._prepare
    monkeypatch.setattr(bh.Attention, "_prepare",
                        lambda self, xp, x: calls.append(1) or prepare(self, xp, x))
    ref, rep0 = bh.global_factors([_NoTape(s) for s in _chain(w, labels=None)[:-1]]
                                  + _chain(w, labels=None)[-1:], batches, seed=2,
                                  refine_iters=1, checkpoint="store_all")
    n_ref, calls[:] = len(calls), []
    got, rep = bh.global_factors(_chain(w, labels=None), batches, seed=2, refine_iters=1,
                                 checkpoint="store_all")
    assert list(got) == list(ref)
    for key in ref:
        for a, b in zip(ref[key], got[key]):
            assert np.array_equal(a, b), key
    # 2 attention stages, 2 batches, 3 passes: one _prepare per forward (twice without tapes)
    assert len(calls) == 2 * 2 * 3 and n_ref == 2 * len(calls)
    assert rep.peak_bytes == rep.planned_peak_bytes
    assert rep.peak_activation_bytes > rep0.peak_activation_bytes
    chain = _chain(w, labels=None)
    tape = sum(st.tape_bytes(tuple(batches[0].shape) + (D,), 8) for st in chain[1:-1])
    assert rep.peak_activation_bytes - rep0.peak_activation_bytes == tape
    small, rep2 = bh.global_factors(chain, batches, seed=2, refine_iters=1,
                                    checkpoint="binomial", snapshots=2, budget_bytes=10 ** 9)
    assert rep2.recompute_factor > 1.0 and rep2.peak_bytes == rep2.planned_peak_bytes
    for key in ref:
        for a, b in zip(ref[key], small[key]):
            assert np.array_equal(a, b), key


def test_weights_combine_with_padding():
    w = _weights(14)
    rng = np.random.default_rng(15)
    seqs = [list(rng.integers(0, V, size=n)) for n in (5, 3)]
    batches, _ = bh.pad_batches(seqs, batch_size=2, sort=False)
    base, _ = bh.global_factors(_chain(w), batches)
    # per-token weights: zero on the short text's positions = the long text alone
    wt = np.ones(batches[0].shape)
    wt[1] = 0.0
    got, _ = bh.global_factors(_chain(w), batches, weights=[wt])
    alone, _ = bh.global_factors(_chain(w), [np.asarray([seqs[0]])])
    for key in base:
        np.testing.assert_allclose(got[key][0], alone[key][0], rtol=1e-10)
        np.testing.assert_allclose(got[key][1], alone[key][1], rtol=1e-9, atol=1e-15)
    # per-sequence weights (2, 1) = the long text counted twice
    got2, _ = bh.global_factors(_chain(w), batches, weights=[np.asarray([2.0, 1.0])])
    twice, _ = bh.global_factors(_chain(w), [np.asarray([seqs[0], seqs[0]]),
                                             np.asarray([seqs[1]])])
    for key in base:
        np.testing.assert_allclose(got2[key][0], twice[key][0], rtol=1e-10)


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------
def test_bad_input_errors():
    w = _weights(0, n_blocks=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bh.Embedding(w["token_embd.weight"]).forward(np, np.asarray([[1, V]]))
    with pytest.raises(ValueError, match="integer token ids"):
        bh.global_factors(_chain(w, n_blocks=1), [np.zeros((1, 3))])
    with pytest.raises(ValueError, match="all padding"):
        bh.global_factors(_chain(w, n_blocks=1), [np.full((1, 3), -1)])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        bh.Attention(np.ones((12, D)), np.ones((8, D)), np.ones((8, D)), np.ones((D, 12)),
                     num_heads=3, num_kv_heads=2, head_dim=4, rope_theta=1e4)
    with pytest.raises(ValueError, match="Wk has shape"):
        bh.Attention(np.ones((8, D)), np.ones((8, D)), np.ones((4, D)), np.ones((D, 8)),
                     num_heads=2, num_kv_heads=1, head_dim=4, rope_theta=1e4)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        bh.Attention(np.ones((8, D)), np.ones((4, D)), np.ones((4, D)), np.ones((D, 8)),
                     num_heads=2, num_kv_heads=1, head_dim=4, rope_theta=1e4,
                     q_norm=np.ones(4))
    with pytest.raises(ValueError, match="takes \\(batch, tokens, 8\\)"):
        _attention(w, 0).out_shape((2, D))
    with pytest.raises(ValueError, match="SwiGLU"):
        bh.SwiGLU(np.ones((FF, D)), np.ones((FF, D)), np.ones((FF, D)))
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        bh.pad_batches([[1], []], batch_size=2)


def test_layers_selects_what_is_collected():
    w = _weights(16)
    batches, _ = bh.pad_batches([[1, 2, 3, 4], [5, 6]], batch_size=2)
    full, rep_full = bh.global_factors(_chain(w), batches)
    pick = ["blk.1.attn_k", "blk.0.ffn_down"]
    got, rep = bh.global_factors(_chain(w), batches, layers=pick)
    assert list(got) == ["blk.0.ffn_down", "blk.1.attn_k"] and rep.n_layers == 2
    for key in pick:
        for a, b in zip(full[key], got[key]):
            np.testing.assert_array_equal(a, b)
    assert rep.peak_buffer_bytes < rep_full.peak_buffer_bytes
    with pytest.raises(ValueError, match="'blk.2.attn_q' not in the chain"):
        bh.global_factors(_chain(w), batches, layers=["blk.2.attn_q"])
    with pytest.raises(ValueError, match="list of layer names"):
        bh.global_factors(_chain(w), batches, layers="blk.0.attn_q")




@pytest.mark.parametrize("refine", ["token", "sequence"])
def test_refinement_with_padding_equals_unpadded(refine):
    """Padded positions drop out of the refinement steps too: a padded batch gives the factors
    of the same texts without padding (each alone in its batch)."""
    w = _weights(20)
    rng = np.random.default_rng(21)
    seqs = [list(rng.integers(0, V, size=n)) for n in (5, 2, 4)]
    padded, order = bh.pad_batches(seqs, batch_size=3)
    alone = [np.asarray([seqs[i]]) for i in order[0]]
    a, _ = bh.global_factors(_chain(w), padded, refine_iters=1, refine=refine)
    b, _ = bh.global_factors(_chain(w), alone, refine_iters=1, refine=refine)
    for key in a:
        for x, y in zip(a[key], b[key]):
            np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-14 * np.abs(y).max())


@pytest.mark.parametrize("out_estimator", ["mean", "crossfit"])
def test_float32_sums_stay_near_float64_sums(out_estimator):
    """``accum_dtype=float32`` (what quantize-model and the demo use): float32 products of
    float32 activations summed in float32 over many batches deviate from float64 sums by a
    float32 rounding, far below any sampling error."""
    w32 = {k: v.astype(np.float32) for k, v in _weights(40).items()}
    rng = np.random.default_rng(41)
    seqs = [list(rng.integers(0, V, size=6)) for _ in range(32)]
    batches, _ = bh.pad_batches(seqs, batch_size=2)   # 16 batches, as the command's
    f64, _ = bh.global_factors(_chain(w32, labels=None), batches, seed=2,
                               out_estimator=out_estimator)
    f32, _ = bh.global_factors(_chain(w32, labels=None), batches, seed=2,
                               out_estimator=out_estimator, accum_dtype=np.float32)
    for key in f64:
        for a, b in zip(f64[key], f32[key]):
            assert b.dtype == np.float32
            assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a), key


@pytest.mark.parametrize("budget", [None, 0.6])
def test_crossfitted_h_in_of_a_shared_input_is_fitted_once(budget, monkeypatch):
    """``in_estimator="crossfit"``: q/k/v (and gate/up) read one input, so their H_in sums
    are bitwise equal and the pass cross-fits them once; each layer gets its own copy, equal
    to the cross-fit of the even and odd batches' H_in, and to what fitting every layer's
    folds gives."""
    from bakron.hessian import driver
    from bakron.hessian.crossfit import crossfit_folds

    w = _weights(42)
    rng = np.random.default_rng(43)
    seqs = [list(rng.integers(0, V, size=5)) for _ in range(8)]
    batches, _ = bh.pad_batches(seqs, batch_size=2)   # 4 batches: two per fold
    if budget is not None:   # a fraction of the whole run's peak: a split plan
        _, rep = bh.global_factors(_chain(w), batches, in_estimator="crossfit")
        budget = int(budget * rep.peak_bytes)
    fits = []
    real = driver.crossfit_folds

    def counted(xp, Hs, ws, **kw):
        fits.append(Hs[0].shape[0])
        return real(xp, Hs, ws, **kw)
    monkeypatch.setattr(driver, "crossfit_folds", counted)
    got, rep = bh.global_factors(_chain(w), batches, in_estimator="crossfit",
                                 budget_bytes=budget)
    monkeypatch.undo()
    if budget is not None:
        assert len(rep.leaf_ranges) > 1
    # per block: q/k/v's input, attn_output's, gate/up's, ffn_down's (no H_out cross-fitted)
    assert sorted(fits) == sorted([D, H * HD, D, FF] * 2)
    parts = [bh.global_factors(_chain(w), batches[j::2])[0] for j in range(2)]
    ws = [float(sum(int((b >= 0).sum()) for b in batches[j::2])) for j in range(2)]
    for key, (Hi, _) in got.items():
        ref = crossfit_folds(np, [p[key][0] for p in parts], ws)
        np.testing.assert_allclose(Hi, ref, rtol=1e-10, atol=1e-12)
    for i in range(2):
        p = f"blk.{i}."
        for a, b in ((p + "attn_q", p + "attn_k"), (p + "attn_q", p + "attn_v"),
                     (p + "ffn_gate", p + "ffn_up")):
            np.testing.assert_array_equal(got[a][0], got[b][0])
            assert not np.shares_memory(got[a][0], got[b][0])
