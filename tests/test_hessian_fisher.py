"""Against the brute-force Fisher: K-FAC where it is exact, power iteration to the nearest
Kronecker product (Van Loan–Pitsianis) elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

import bakron.hessian as bh
from bakron.hessian.stages import HeadContext


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _tiny(seed=0, T=None, n=6):
    """Linear(3→4) → GELU → LayerNorm → Linear(4→3) → Fisher head; n samples."""
    rng = np.random.default_rng(seed)
    stages = [bh.Linear(rng.standard_normal((4, 3)), 0.1 * rng.standard_normal(4), name="a"),
              bh.GELU(), bh.LayerNorm(),
              bh.Linear(rng.standard_normal((3, 4)), name="b"), bh.SoftmaxCrossEntropy()]
    X = rng.standard_normal((n, 3) if T is None else (n, T, 3))
    return stages, [X[: n // 2 + 1], X[n // 2 + 1:]]


SHAPES = {"a": (4, 3), "b": (3, 4)}


def test_nearest_kronecker_recovers_a_kronecker_product():
    rng = np.random.default_rng(1)
    A = rng.standard_normal((3, 3))
    B = rng.standard_normal((4, 4))
    A, B = A @ A.T, B @ B.T
    F = np.kron(A, B)
    A2, B2, s1, resid = bh.nearest_kronecker(F, 3, 4)
    np.testing.assert_allclose(np.kron(A2, B2), F, rtol=1e-12, atol=1e-12)
    assert resid < 1e-10 * np.linalg.norm(F)
    assert s1 == pytest.approx(np.linalg.norm(F), rel=1e-12)


def test_nearest_kronecker_is_optimal():
    rng = np.random.default_rng(2)
    V = rng.standard_normal((12, 30))
    F = V @ V.T                                    # PSD, far from a Kronecker product
    A, B, _, resid = bh.nearest_kronecker(F, 3, 4)
    best = np.linalg.norm(F - np.kron(A, B))
    assert best == pytest.approx(resid, rel=1e-10)
    assert np.all(np.linalg.eigvalsh(A) > -1e-10) and np.all(np.linalg.eigvalsh(B) > -1e-10)
    for _ in range(50):                            # no nearby pair does better
        dA = 1e-3 * rng.standard_normal((3, 3))
        dB = 1e-3 * rng.standard_normal((4, 4))
        assert np.linalg.norm(F - np.kron(A + dA, B + dB)) >= best
    with pytest.raises(ValueError, match="F must be 12 x 12"):
        bh.nearest_kronecker(F[:-1, :-1], 3, 4)


def test_finite_difference_gradients_equal_the_vjp_chain():
    """The brute-force G_s (forward passes only) equals Σ_t g_t x_tᵀ from the stages' VJPs."""
    stages, batches = _tiny(T=3)
    body, head = stages[:-1], stages[-1]
    grads = bh.per_sequence_gradients(stages, batches, "a", seed=5)
    for k, x in enumerate(batches):
        states = [x]
        for st in body:
            states.append(st.forward(np, states[-1]))
        d = head.grad(np, states[-1], HeadContext(k, 5))
        got = {}
        for i in range(len(body) - 1, -1, -1):
            d = body[i].vjp(np, states[i], d, lambda key, xx, g: got.__setitem__(key, (xx, g)))
        xx, g = got["a"]
        G = np.einsum("stm,stn->smn", g, xx)
        np.testing.assert_allclose(grads[k], G, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("layer", ["a", "b"])
def test_kfac_is_exact_for_one_single_token_sample(layer):
    stages, batches = _tiny(seed=3, n=1)
    single = [batches[0]]                          # one sample, one token
    F = bh.exact_fisher(stages, single, layer, seed=4)
    (factors, _) = bh.global_factors(stages, single, seed=4)
    H_in, H_out = factors[layer]
    np.testing.assert_allclose(np.kron(H_out, H_in), F, rtol=1e-7, atol=1e-9 * np.abs(F).max())
    # ... and a refinement step leaves the (already exact) product where it is
    (ref, _) = bh.global_factors(stages, single, seed=4, refine_iters=1)
    np.testing.assert_allclose(np.kron(ref[layer][1], ref[layer][0]), np.kron(H_out, H_in),
                               rtol=1e-12, atol=1e-14 * np.abs(F).max())


def test_kfac_is_not_exact_for_several_samples():
    stages, batches = _tiny(seed=3)
    F = bh.exact_fisher(stages, batches, "a", seed=4)
    factors, _ = bh.global_factors(stages, batches, seed=4)
    assert _rel(np.kron(factors["a"][1], factors["a"][0]), F) > 0.1


@pytest.mark.parametrize("T,refine", [(None, "token"), (None, "sequence"), (3, "sequence")])
@pytest.mark.parametrize("layer", ["a", "b"])
def test_power_iteration_converges_to_the_nearest_kronecker_product(T, refine, layer):
    stages, batches = _tiny(seed=6, T=T)
    m, n = SHAPES[layer]
    F = bh.exact_fisher(stages, batches, layer, seed=8)
    A, B, _, resid = bh.nearest_kronecker(F, m, n)
    target = np.kron(A, B)
    assert resid > 0.05 * np.linalg.norm(F)        # F is not a Kronecker product itself
    errs = []
    for k in (0, 1, 2, 25):
        factors, rep = bh.global_factors(stages, batches, seed=8, refine_iters=k, refine=refine)
        H_in, H_out = factors[layer]
        errs.append(_rel(np.kron(H_out, H_in), target))
        assert rep.passes == 1 + 2 * k
    assert errs[0] > 1e-3 and errs[0] > errs[1] > errs[2]
    assert errs[-1] < 1e-7                         # FD accuracy of the brute-force Fisher


def test_weighted_sequences_converge_to_the_weighted_fisher():
    stages, batches = _tiny(seed=9, T=2)
    w = [np.array([1.0, 3.0, 0.5, 2.0]), np.array([0.25, 1.0])]
    G = bh.per_sequence_gradients(stages, batches, "b", seed=1)
    V = np.concatenate([g.reshape(g.shape[0], -1) for g in G])
    wc = np.concatenate(w)
    F = (V * wc[:, None]).T @ V / wc.sum()
    np.testing.assert_allclose(F, bh.exact_fisher(stages, batches, "b", seed=1, weights=w),
                               rtol=1e-12)
    A, B, _, _ = bh.nearest_kronecker(F, 3, 4)
    factors, _ = bh.global_factors(stages, batches, seed=1, weights=w, refine_iters=25,
                                   refine="sequence")
    assert _rel(np.kron(factors["b"][1], factors["b"][0]), np.kron(A, B)) < 1e-7


def test_per_token_refinement_targets_the_token_level_fisher():
    """With sequences, per-token refinement converges to the nearest Kronecker product of
    E_t[(g_t g_tᵀ) ⊗ (x_t x_tᵀ)], not of the sequence Fisher."""
    stages, batches = _tiny(seed=10, T=3)
    body, head = stages[:-1], stages[-1]
    blocks = []
    for k, x in enumerate(batches):
        states = [x]
        for st in body:
            states.append(st.forward(np, states[-1]))
        d = head.grad(np, states[-1], HeadContext(k, 2))
        got = {}
        for i in range(len(body) - 1, -1, -1):
            d = body[i].vjp(np, states[i], d, lambda key, xx, g: got.__setitem__(key, (xx, g)))
        xx, g = got["a"]
        blocks += [np.kron(np.outer(gt, gt), np.outer(xt, xt))
                   for gt, xt in zip(g.reshape(-1, 4), xx.reshape(-1, 3))]
    F_tok = np.mean(blocks, axis=0)
    A, B, _, _ = bh.nearest_kronecker(F_tok, 4, 3)
    factors, _ = bh.global_factors(stages, batches, seed=2, refine_iters=25, refine="token")
    assert _rel(np.kron(factors["a"][1], factors["a"][0]), np.kron(A, B)) < 1e-9
    F_seq = bh.exact_fisher(stages, batches, "a", seed=2)
    A2, B2, _, _ = bh.nearest_kronecker(F_seq, 4, 3)
    assert _rel(np.kron(A, B), np.kron(A2, B2)) > 1e-2
