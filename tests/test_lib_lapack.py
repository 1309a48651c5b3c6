"""bakron._lib.lapack.eigh: float32 numpy matrices through LAPACK's ssyevd in float32 (the
GIL released), everything else through the namespace's eigh; checked against float64
eigendecompositions."""
import threading
import time

import numpy as np
import pytest

from bakron._lib import lapack
from conftest import to_xp


def _spd(n, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((max(2 * n, 8), n)) * np.geomspace(1, 1e-2, n)
    H = X.T @ X / len(X)
    return ((H + H.T) / 2).astype(dtype)


@pytest.mark.parametrize("n", [1, 2, 17, 200])
def test_float32_eigh_matches_float64(n):
    H = _spd(n)
    before = H.copy()
    w, U = lapack.eigh(np, H)
    assert w.dtype == np.float32 and U.dtype == np.float32 and U.shape == (n, n)
    assert np.array_equal(H, before)   # not modified
    w64 = np.linalg.eigvalsh(H.astype(np.float64))
    scale = float(w64[-1])
    assert np.all(np.diff(w) >= -1e-6 * scale)   # ascending
    assert np.max(np.abs(w - w64)) <= 1e-5 * scale
    assert np.max(np.abs(U.T.astype(np.float64) @ U - np.eye(n))) <= 1e-5
    assert np.max(np.abs((U * w) @ U.T - H)) <= 1e-5 * scale


def test_float32_runs_in_float32_lapack():
    """The float32 path is LAPACK's ssyevd (scipy.linalg.eigh's 'evd' driver on float32 runs
    the same routine: bitwise the same result), not numpy's float64 eigh cast down."""
    import scipy.linalg

    H = _spd(120, seed=3)
    w, U = lapack.eigh(np, H)
    w_s, U_s = scipy.linalg.eigh(H, driver="evd")
    assert w_s.dtype == np.float32
    assert np.array_equal(w, w_s) and np.array_equal(U, U_s)
    assert not np.array_equal(U, np.linalg.eigh(H)[1])


def test_other_dtypes_and_namespaces_use_their_eigh(xp):
    H = _spd(30, dtype=np.float64)
    w, U = lapack.eigh(xp, to_xp(xp, H))
    w_ref, _ = np.linalg.eigh(H)
    assert np.allclose(np.asarray(w), w_ref, rtol=1e-12, atol=1e-12)
    if xp.__name__.endswith("numpy"):   # float64 is numpy.linalg.eigh itself
        assert np.array_equal(np.asarray(U), np.linalg.eigh(H)[1])


def test_the_gil_is_released():
    """A Python thread keeps running while a large float32 eigendecomposition runs."""
    H = _spd(1024, seed=1)
    lapack.eigh(np, H)   # (the routine is looked up once)
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.02)
    c0 = count[0]
    t0 = time.perf_counter()
    lapack.eigh(np, H)
    took = time.perf_counter() - t0
    during = count[0] - c0
    time.sleep(took)
    after = count[0] - c0 - during
    stop.set()
    t.join()
    # holding the GIL for the whole call would let the spinner run only at the start
    assert during > 0.1 * after
