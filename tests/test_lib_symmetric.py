"""bakron._lib.symmetric: the tiled transposed reads give bitwise the plain expressions'
results, in every namespace, for sizes on and off the tile grid."""
import numpy as np
import pytest

from bakron._lib.symmetric import TILE, max_asymmetry, mirror_upper, symmetrize
from conftest import to_xp

SIZES = [1, 2, TILE - 1, TILE, TILE + 1, 2 * TILE + 7, 200]


def _matrix(n, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, n))
    return (X @ X.T + 1e-7 * rng.standard_normal((n, n))).astype(dtype)   # nearly symmetric


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_symmetrize_is_bitwise_the_plain_expression(xp, n, dtype):
    H = to_xp(xp, _matrix(n, n, dtype))
    before = np.array(H, copy=True)
    got = np.asarray(symmetrize(xp, H))
    want = (before + before.T) / 2
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(got, got.T)
    assert np.array_equal(np.asarray(H), before)   # the argument is not modified


@pytest.mark.parametrize("n", SIZES)
def test_max_asymmetry_is_the_plain_maximum(xp, n):
    H = _matrix(n, n)
    H[n - 1, 0] += 0.5   # the largest difference in the last tile row (n = 1: none)
    want = float(np.max(np.abs(H - H.T)))
    assert max_asymmetry(xp, to_xp(xp, H)) == want
    assert max_asymmetry(xp, to_xp(xp, (H + H.T) / 2)) == 0.0


def test_max_asymmetry_sees_a_nan():
    H = _matrix(TILE + 3)
    H[TILE + 1, 2] = np.nan
    assert np.isnan(max_asymmetry(np, H))


@pytest.mark.parametrize("n", SIZES)
def test_mirror_upper_copies_the_upper_triangle(xp, n):
    H = _matrix(n, n)
    want = np.triu(H) + np.triu(H, 1).T
    got = np.asarray(mirror_upper(xp, to_xp(xp, H.copy())))
    assert np.array_equal(got, want)
