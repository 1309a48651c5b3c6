"""The factor pipeline: block LDL, normalisation, damping escalation, dead channels."""
import numpy as np
import pytest

import bakron
from _problems import spd
from conftest import to_xp


@pytest.mark.parametrize("n,block", [(1, 1), (7, 1), (16, 4), (17, 4), (30, 8), (5, 16)])
def test_block_ldl_reconstructs(xp, n, block):
    rng = np.random.default_rng(n * 31 + block)
    H = spd(rng, n)
    A, D = bakron.block_ldl(to_xp(xp, H), block)
    A, D = bakron._xp.to_numpy(A), bakron._xp.to_numpy(D)
    L = np.eye(n) + A
    np.testing.assert_allclose(L @ D @ L.T, H, atol=1e-10)
    b = min(block, n)
    for k in range(0, n, b):
        assert np.all(A[k:k + b, k:k + b] == 0)                 # diagonal blocks of L are I
        assert np.all(D[k:k + b, k + b:] == 0)                  # D is block diagonal
    assert np.all(np.triu(A) == 0)


def test_prepare_factor_normalises_and_damps(xp):
    rng = np.random.default_rng(0)
    H = 37.0 * spd(rng, 12)
    H0 = H.copy()
    f = bakron.prepare_factor(to_xp(xp, H), 4, damp=0.05)
    np.testing.assert_array_equal(H, H0)  # input untouched
    Hn = bakron._xp.to_numpy(f.H)
    assert f.scale == pytest.approx(np.mean(np.diag(H)))
    np.testing.assert_allclose(Hn, H / f.scale + 0.05 * np.eye(12), atol=1e-12)
    assert f.damp == 0.05 and f.tries == 1
    L = np.eye(12) + bakron._xp.to_numpy(f.A)
    np.testing.assert_allclose(L @ bakron._xp.to_numpy(f.D) @ L.T, Hn, atol=1e-10)


def test_prepare_factor_escalates_damping_for_indefinite():
    # eigenvalue -0.05 after normalisation: 0.01, 0.02, 0.04 fail; 0.08 works
    rng = np.random.default_rng(1)
    Q, _ = np.linalg.qr(rng.standard_normal((10, 10)))
    ev = np.linspace(-0.05, 2.0, 10)
    ev *= 10 / ev.sum()
    H = (Q * ev) @ Q.T
    f = bakron.prepare_factor(H, 2, damp=0.01)
    assert f.tries == 4
    assert f.damp == pytest.approx(0.08)
    assert np.all(np.isfinite(f.A))


def test_prepare_factor_indefinite_beyond_limit():
    H = np.diag([1.0, 1.0, -5.0])
    with pytest.raises(ValueError, match="negative diagonal"):
        bakron.prepare_factor(H, 1)
    H = np.array([[1.0, 2.0], [2.0, 1.0]])  # eigenvalues -1 and 3: needs damping > 1
    with pytest.raises(bakron.NotPositiveDefiniteError, match="beyond the damping limit"):
        bakron.prepare_factor(H, 2, damp=0.01, max_tries=4)


def test_dead_channels_do_not_break(xp):
    rng = np.random.default_rng(3)
    H = spd(rng, 9)
    H[[2, 5], :] = 0.0
    H[:, [2, 5]] = 0.0
    f = bakron.prepare_factor(to_xp(xp, H), 3, damp=0.0)  # no damping at all
    A = bakron._xp.to_numpy(f.A)
    assert np.all(np.isfinite(A))
    assert sorted(bakron._xp.to_numpy(f.dead).tolist()) == [2, 5]
    assert np.all(A[:, [2, 5]] == 0) and np.all(A[[2, 5], :] == 0)  # no feedback through them


def test_rank_deficient_needs_damping_and_gets_it():
    rng = np.random.default_rng(4)
    X = rng.standard_normal((8, 3))
    f = bakron.prepare_factor(X @ X.T, 2, damp=0.0)
    assert f.damp > 0 and f.tries > 1


def test_all_zero_hessian_is_rejected():
    with pytest.raises(ValueError, match="all zeros"):
        bakron.prepare_factor(np.zeros((4, 4)), 2)


def test_zero_diagonal_with_offdiagonal_is_rejected():
    H = np.eye(3)
    H[0, 0] = 0.0
    H[0, 1] = H[1, 0] = 0.5
    with pytest.raises(ValueError, match="zero diagonal entries with non-zero off-diagonal"):
        bakron.prepare_factor(H, 1)


@pytest.mark.parametrize("bad,msg", [
    (np.ones((3, 4)), "H must be square"),
    (np.ones(3), "H must be a 2-D array"),
    (np.array([[1.0, np.nan], [np.nan, 1.0]]), "H contains 2 NaN or Inf"),
    (np.array([[1.0, 0.5], [0.1, 1.0]]), "H is not symmetric"),
])
def test_prepare_factor_rejects(bad, msg):
    with pytest.raises(ValueError, match=msg):
        bakron.prepare_factor(bad, 1)


def test_prepare_factor_bad_arguments():
    with pytest.raises(ValueError, match="damp must be >= 0"):
        bakron.prepare_factor(np.eye(2), 1, damp=-1.0)
    with pytest.raises(ValueError, match="block must be a positive integer"):
        bakron.prepare_factor(np.eye(2), 0)
    with pytest.raises(ValueError, match="H_out is not symmetric"):
        bakron.prepare_factor(np.triu(np.ones((3, 3))), 1, name="H_out")


def test_block_ldl_not_positive_definite():
    with pytest.raises(bakron.NotPositiveDefiniteError, match="not positive definite"):
        bakron.block_ldl(np.diag([1.0, -1.0]), 1)


def test_shrink_moves_toward_the_diagonal():
    from bakron.factors import auto_regularization, prepare_factor

    rng = np.random.default_rng(3)
    G = rng.standard_normal((40, 12))
    H = G.T @ G
    f0 = prepare_factor(H, 1, damp=0.0)
    f1 = prepare_factor(H, 1, damp=0.0, shrink=1.0)
    fh = prepare_factor(H, 1, damp=0.0, shrink=0.5)
    d = np.diag(f0.H)
    np.testing.assert_allclose(f1.H, np.diag(d))
    np.testing.assert_allclose(fh.H, 0.5 * f0.H + 0.5 * np.diag(d))
    assert np.count_nonzero(f1.A) == 0   # a diagonal H has L = I
    with pytest.raises(ValueError, match="shrink"):
        prepare_factor(H, 1, shrink=1.5)
    with pytest.raises(ValueError, match="shrink"):
        prepare_factor(H, 1, shrink=True)
    for m, n in ((192, 4096), (1536, 4096), (1536, 10 ** 9)):   # no shrinkage, damping 1
        assert auto_regularization(m, n) == (0.0, 1.0)
        assert auto_regularization(m, n, rotated=True) == (0.0, 3.0)   # 3 for rotated layers
    with pytest.raises(ValueError, match="tokens"):
        auto_regularization(10, 0)
    assert auto_regularization(10, 10, rotated=True, estimator="crossfit") == (0.0, 0.1)
    with pytest.raises(ValueError, match=r"estimator must be one of \('mean', 'crossfit'\)"):
        auto_regularization(10, 10, estimator="median")
