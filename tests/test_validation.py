"""Bad input gets a clear ValueError naming the argument; inputs are never modified."""
import numpy as np
import pytest

import bakron
from _problems import problem


@pytest.fixture
def case():
    W, f_in, f_out = problem(0, 12, 10, 4, 5)
    q = bakron.UniformQuantizer.fit(W, 3)
    return W, f_in, f_out, q


def test_solve_rejects_bad_weights(case):
    W, f_in, f_out, q = case
    Wn = W.copy()
    Wn[3, 4] = np.nan
    with pytest.raises(ValueError, match="W contains 1 NaN or Inf entry"):
        bakron.solve(Wn, f_out.A, f_in.A, q, tile=(4, 5))
    Wi = W.copy()
    Wi[0, :2] = np.inf
    with pytest.raises(ValueError, match="W contains 2 NaN or Inf entries"):
        bakron.solve(Wi, f_out.A, f_in.A, q, tile=(4, 5))
    with pytest.raises(ValueError, match="W must be a 2-D array"):
        bakron.solve(W[0], f_out.A, f_in.A, q, tile=(4, 5))
    with pytest.raises(TypeError, match="W must be float32 or float64"):
        bakron.solve(W.astype(np.int32), f_out.A, f_in.A, q, tile=(4, 5))


def test_solve_detects_swapped_factors(case):
    W, f_in, f_out, q = case
    with pytest.raises(ValueError, match="A_in .* swapped"):
        bakron.solve(W, f_in.A, f_out.A, q, tile=(4, 5))


def test_solve_rejects_wrong_factor_shapes(case):
    W, f_in, f_out, q = case
    with pytest.raises(ValueError, match=r"A_in has shape \(9, 9\) but W has 10 columns"):
        bakron.solve(W, f_out.A, f_in.A[:9, :9], q, tile=(4, 5))
    with pytest.raises(ValueError, match="A_out must be square"):
        bakron.solve(W, f_out.A[:, :5], f_in.A, q, tile=(4, 5))


def test_solve_rejects_a_hessian_or_wrong_block_instead_of_a_factor(case):
    W, f_in, f_out, q = case
    with pytest.raises(ValueError, match="A_in must be strictly block-lower-triangular"):
        bakron.solve(W, f_out.A, f_in.H, q, tile=(4, 5))
    with pytest.raises(ValueError, match="A_out must be strictly block-lower-triangular"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=(6, 5))  # factor made with block 4
    A = f_in.A.copy()
    A[0, 0] = np.nan
    with pytest.raises(ValueError, match="A_in contains 1 NaN"):
        bakron.solve(W, f_out.A, A, q, tile=(4, 5))


@pytest.mark.parametrize("tile,msg", [
    ((13, 5), r"tile \(13, 5\) is larger than the matrix \(12, 10\)"),
    ((0, 5), "tile entries must be >= 1"),
    ("ab", "tile must be an int or a pair"),
])
def test_solve_rejects_bad_tiles(case, tile, msg):
    W, f_in, f_out, q = case
    with pytest.raises(ValueError, match=msg):
        bakron.solve(W, f_out.A, f_in.A, q, tile=tile)


def test_solve_rejects_bad_options(case):
    W, f_in, f_out, q = case
    with pytest.raises(ValueError, match="method must be one of"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=(4, 5), method="fast")
    class Shifted(bakron.UniformQuantizer):  # a quantizer only the array-API engine runs
        def quantize(self, targets, rows=None, cols=None):
            return super().quantize(targets, rows=rows, cols=cols)
    with pytest.raises(ValueError, match="method='wavefront' .* not available on engine "
                                         "'array_api'"):
        bakron.solve(W, f_out.A, f_in.A, Shifted(3, 0.5), tile=(4, 5), method="wavefront")
    with pytest.raises(ValueError, match="engine must be one of"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=(4, 5), engine="tpu")
    with pytest.raises(ValueError, match="variant must be"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=(4, 5), variant="x")
    with pytest.raises(ValueError, match="base must be a positive number of tiles"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=(4, 5), base=0)
    with pytest.raises(TypeError, match="quantizer must have a method quantize"):
        bakron.solve(W, f_out.A, f_in.A, object(), tile=(4, 5))


def test_scale_of_the_wrong_shape(case):
    W, f_in, f_out, _ = case
    q = bakron.UniformQuantizer(3, np.ones(11))
    with pytest.raises(ValueError, match="scale has 11 rows but W has 12 rows"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=(4, 5))


def test_bad_tile_quantizer_output(case):
    W, f_in, f_out, _ = case

    class Bad:
        def quantize(self, targets):
            return targets[:, :1], None

    with pytest.raises(ValueError, match="returned values of shape"):
        bakron.solve(W, f_out.A, f_in.A, Bad(), tile=(4, 5))


def test_naive_refuses_large_problems():
    W, f_in, _ = problem(0, 64, 64, 8, 8, two_sided=False)
    q = bakron.UniformQuantizer.fit(W, 2)
    with pytest.raises(ValueError, match="method='naive' would build a 4096 x 4096 Kronecker"):
        bakron.solve(W, None, f_in.A, q, tile=8, method="naive", max_naive_bytes=2**20)


def test_inputs_are_not_modified(case):
    W, f_in, f_out, q = case
    copies = [a.copy() for a in (W, f_in.A, f_out.A, f_in.H, f_out.H)]
    for method in ("naive", "antidiagonal", "recursive"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=(4, 5), method=method, base=1)
    bakron.quantize_layer(W, f_in.H, f_out.H, bits=3, tile=(4, 5))
    for a, b in zip((W, f_in.A, f_out.A, f_in.H, f_out.H), copies):
        np.testing.assert_array_equal(a, b)


def test_quantize_layer_validation(case):
    W, f_in, f_out, _ = case
    with pytest.raises(ValueError, match="H_in .* swapped"):
        bakron.quantize_layer(W, f_out.H, f_in.H, bits=3, tile=(4, 5))
    with pytest.raises(ValueError, match="give either quantizer= or bits="):
        bakron.quantize_layer(W, f_in.H, f_out.H, tile=(4, 5))
    with pytest.raises(ValueError, match="bits must be in 2..8"):
        bakron.quantize_layer(W, f_in.H, f_out.H, bits=12, tile=(4, 5))
    Hn = f_in.H.copy()
    Hn[0, 1] += 1.0
    with pytest.raises(ValueError, match="H_in is not symmetric"):
        bakron.quantize_layer(W, Hn, f_out.H, bits=3, tile=(4, 5))
    Hn = f_out.H.copy()
    Hn[2, 2] = np.inf
    with pytest.raises(ValueError, match="H_out contains 1 NaN or Inf"):
        bakron.quantize_layer(W, f_in.H, Hn, bits=3, tile=(4, 5))


def test_proxy_error_validation(case):
    W, f_in, f_out, _ = case
    with pytest.raises(ValueError, match="W_hat has shape"):
        bakron.proxy_error(W, W[:, :3], f_in.H, f_out.H)
    with pytest.raises(ValueError, match="H_in .* swapped"):
        bakron.proxy_error(W, W, f_out.H, f_in.H)
    assert bakron.proxy_error(W, W, f_in.H, f_out.H) == 0.0
    assert bakron.proxy_error(W, np.zeros_like(W), f_in.H, f_out.H) == pytest.approx(1.0)
