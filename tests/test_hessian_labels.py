"""The LM head's label estimators for H_out ("sample:K", "fisher:K", "true") against the exact
expectation over independent labels, computed naively in float64."""
from __future__ import annotations

import numpy as np
import pytest

import bakron.hessian as bh
from bakron.hessian.stages import HeadContext
from test_hessian_transformer import V, _chain, _run_chain, _weights


def _seqs(lengths, seed):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, V, size=n)) for n in lengths]


def _model_probs(w, ids):
    """The model's next-token probabilities ``(B, T, V)`` for the id batch ``ids``."""
    chain = _chain(w, labels=None)
    h = ids
    for st in chain[:-1]:
        h = st.forward(np, h)
    return np.exp(chain[-1].log_softmax(np, h))


def _exact_factors(w, seqs):
    """``H_out = (1/N) Σ_t' Σ_y p_t'(y) g g ᵀ`` with ``g`` the layer-output gradients of the loss
    at position ``t'`` alone with label ``y``: the expectation over independent labels drawn
    from the model (cross-position terms vanish), one backward pass per (position, label)."""
    acc, N = {}, 0
    for s in seqs:
        ids = np.asarray([s])
        p = _model_probs(w, ids)[0]          # (T, V)
        N += len(s)
        for t in range(len(s)):
            for y in range(V):
                lab = np.full((1, len(s)), -1)
                lab[0, t] = y
                _, rows, _ = _run_chain(np, _chain(w, labels=[lab]), ids)
                for key, (X, G) in rows.items():
                    G = G.reshape(-1, G.shape[-1])
                    acc[key] = acc.get(key, 0.0) + p[t, y] * (G.T @ G)
    return {k: v / N for k, v in acc.items()}


def _factors(w, seqs, labels, seed=0, batch_size=2):
    batches, _ = bh.pad_batches(seqs, batch_size=batch_size)
    return bh.global_factors(_chain(w, labels=labels), batches, seed=seed)[0]


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_fisher_all_labels_is_the_exact_expectation():
    """One-token sequences have no cross-position terms: "fisher:V" is the exact output Fisher
    (float64 round-off), and its H_in is the default's."""
    w = _weights(20)
    seqs = _seqs([1] * 5, 21)
    exact = _exact_factors(w, seqs)
    fac = _factors(w, seqs, f"fisher:{V}", batch_size=3)
    base = _factors(w, seqs, None, batch_size=3)
    for key, (Hi, Ho) in fac.items():
        np.testing.assert_allclose(Ho, exact[key], rtol=1e-9, atol=1e-12 * np.abs(exact[key]).max())
        np.testing.assert_allclose(Hi, base[key][0], rtol=1e-12, atol=0)
    # larger K than the vocabulary is the same estimator
    more = _factors(w, seqs, f"fisher:{V + 5}", batch_size=3)
    for key in fac:
        np.testing.assert_allclose(more[key][1], fac[key][1], rtol=1e-12)


def test_fisher_top_k_plus_remainder_is_exact_for_one_token():
    """With one remainder row, top-K keeps the remainder's mean exactly; what it drops is
    W_outᵀ (diag(p_rest) − p_rest p_restᵀ/q) W_out, computed here at the head's input."""
    rng = np.random.default_rng(3)
    d, K = 6, 3
    W = rng.standard_normal((V, d))
    z = rng.standard_normal((4, 1, d))
    head = bh.LMHead(W, labels=f"fisher:{K}")
    assert head.draws == K + 1
    G = head.grad(np, z, HeadContext(0, 0)).reshape(K + 1, 4, d)
    for i in range(4):
        p = np.exp(head.log_softmax(np, z[i, 0]))
        F = W.T @ (np.diag(p) - np.outer(p, p)) @ W
        top = np.argsort(p)[::-1][:K]
        rest = np.delete(np.arange(V), top)
        pr, q = p[rest], p[rest].sum()
        dropped = W[rest].T @ (np.diag(pr) - np.outer(pr, pr) / q) @ W[rest]
        est = G[:, i].T @ G[:, i] / (K + 1)
        np.testing.assert_allclose(est, F - dropped, rtol=1e-10, atol=1e-12 * np.abs(F).max())


def test_estimators_converge_to_the_expectation_with_cross_positions():
    """Several tokens per sequence: the exact target has no cross-position terms. "sample:K"
    and "fisher:K" are unbiased; K draws shrink the squared error K-fold, so the error of K
    draws must lie within 4 standard deviations derived from single draws at other seeds."""
    w = _weights(30)
    seqs = _seqs([4, 3, 4], 31)
    exact = _exact_factors(w, seqs)
    keys = ["blk.0.ffn_up", "blk.0.attn_v", "blk.1.attn_q"]
    one = [_factors(w, seqs, "sample:1", seed=s) for s in range(8)]
    for key in keys:
        var1 = np.mean([np.linalg.norm(f[key][1] - exact[key]) ** 2 for f in one])
        K = 256
        fk = _factors(w, seqs, f"sample:{K}", seed=100)[key][1]
        err = np.linalg.norm(fk - exact[key])
        assert err <= 4 * np.sqrt(var1 / K), (key, err, np.sqrt(var1 / K))
        assert err < 0.5 * np.sqrt(var1)   # and it did converge: far below one draw's error
        # fisher over all labels: only the sign noise of cross-position products is left
        fis = [_factors(w, seqs, f"fisher:{V}", seed=s)[key][1] for s in range(8)]
        fvar = np.mean([np.linalg.norm(f - exact[key]) ** 2 for f in fis])
        assert fvar < var1, (key, fvar, var1)
        mean = np.mean(fis, axis=0)
        assert np.linalg.norm(mean - exact[key]) <= 4 * np.sqrt(fvar / len(fis)), key


def test_default_labels_are_unchanged():
    w = _weights(40)
    seqs = _seqs([5, 3, 4], 41)
    base = _factors(w, seqs, None, seed=7)
    for spec in ("sample", "sample:1"):
        f = _factors(w, seqs, spec, seed=7)
        for key in base:
            assert np.array_equal(f[key][0], base[key][0])
            assert np.array_equal(f[key][1], base[key][1])
    # K draws: H_in is the same up to round-off (the input rows are counted once)
    f = _factors(w, seqs, "sample:3", seed=7)
    for key in base:
        np.testing.assert_allclose(f[key][0], base[key][0], rtol=1e-12)
        assert not np.allclose(f[key][1], base[key][1])


def test_true_labels_spelled_as_a_string_and_errors():
    w = _weights(50)
    seqs = _seqs([5, 3], 51)
    a, b = _factors(w, seqs, "true"), _factors(w, seqs, "true")
    assert all(np.array_equal(a[k][1], b[k][1]) for k in a)
    W = np.ones((V, 4))
    for bad in ("sample:0", "fisher:", "fisher:x", "fisher:-2", "sample: 3", "gold", "fisher"):
        with pytest.raises(ValueError, match="labels"):
            bh.LMHead(W, labels=bad)


@pytest.mark.parametrize("refine", ["token", "sequence"])
def test_refinement_with_all_labels_is_the_exact_expectation(refine):
    """One refinement step with "fisher:V" on one-token sequences against the naive float64
    expectation over the labels: H_out' = E[(xᵀ H_in x) g gᵀ] / ‖H_in‖², then
    H_in' = E[(gᵀ H_out' g) x xᵀ] / ‖H_out'‖² (one token per sequence: both refinements agree)."""
    w = _weights(60)
    seqs = _seqs([1] * 4, 61)
    terms = {}   # key -> [(p_y, x, g)]
    for s in seqs:
        ids = np.asarray([s])
        p = _model_probs(w, ids)[0, 0]
        for y in range(V):
            _, rows, _ = _run_chain(np, _chain(w, labels=[np.asarray([[y]])]), ids)
            for key, (X, G) in rows.items():
                terms.setdefault(key, []).append((p[y], X.reshape(-1), G.reshape(-1)))
    batches, _ = bh.pad_batches(seqs, batch_size=3)
    # one token: the scores of q and k have no gradient (a single key), so their H_out is 0
    keys = [k for k in terms if not k.endswith(("attn_q", "attn_k"))]
    fac = bh.global_factors(_chain(w, labels=f"fisher:{V}"), batches, refine_iters=1,
                            refine=refine, seed=2, layers=keys)[0]
    assert sorted(fac) == sorted(keys)
    N = len(seqs)
    for key in keys:
        ts = terms[key]
        Hi0 = sum(p * np.outer(x, x) for p, x, g in ts) / sum(p for p, _, _ in ts)
        Ho1 = sum(p * (x @ Hi0 @ x) * np.outer(g, g) for p, x, g in ts) / (
            N * np.sum(Hi0 * Hi0))
        Hi1 = sum(p * (g @ Ho1 @ g) * np.outer(x, x) for p, x, g in ts) / (
            N * np.sum(Ho1 * Ho1))
        np.testing.assert_allclose(fac[key][1], Ho1, rtol=1e-8, atol=1e-12 * np.abs(Ho1).max())
        np.testing.assert_allclose(fac[key][0], Hi1, rtol=1e-8, atol=1e-12 * np.abs(Hi1).max())


@pytest.mark.parametrize("V,dtype", [(49152, np.float32), (1500, np.float32), (7, np.float64),
                                     (1024, np.float64)])
def test_inverse_cdf_counts_as_the_float64_running_sum(V, dtype):
    """The two-level label draw gives bitwise the count of the float64 running sum over the
    whole vocabulary, also for uniforms that sit exactly on a partial sum (the rows it must
    count in full), at 0 and beyond the row's total."""
    from bakron.hessian.transformer import _inverse_cdf, _softmax_

    rng = np.random.default_rng(V)
    b = 64
    logits = (rng.standard_normal((b, V)) * 4).astype(dtype)
    logits[: b // 4, : V // 2] -= 200.0       # rows with a long run of (near) zero terms
    p = _softmax_(np, logits.copy())
    cdf = np.cumsum(p.astype(np.float64), axis=-1)
    u = rng.random(b)
    j = rng.integers(0, V, size=b)
    u[:8] = cdf[np.arange(8), j[:8]]           # exactly on a partial sum
    u[8:12] = np.nextafter(cdf[np.arange(8, 12), j[8:12]], 2.0)
    u[12], u[13] = 0.0, np.nextafter(cdf[13, -1], 2.0)
    want = np.sum(cdf < u[:, None], axis=-1)
    got = _inverse_cdf(np, p, u)
    np.testing.assert_array_equal(got, want)
    assert got[13] == V and got[12] == 0
