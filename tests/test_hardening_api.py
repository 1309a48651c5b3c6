"""Hostile or careless inputs to the API: each gets a named error, never a silent wrong result.

One test per case of docs/reliability.md (API part); W float32 64 x 96, H SPD 96 x 96.
"""
import time
import types

import numpy as np
import pytest

import bakron
import bakron.hessian
from bakron.solvers._problem import QuantizerCall


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(12)
    W = rng.standard_normal((64, 96)).astype(np.float32)
    X = rng.standard_normal((400, 96))
    H = X.T @ X / 400
    Y = rng.standard_normal((300, 64))
    return W, H, Y.T @ Y / 300


# -- 1. integer options -----------------------------------------------------------------------

@pytest.mark.parametrize("tile", ["16", "ab", 8.9, True, (8.0, 8), (True, 4), [16], b"16"])
def test_tile_must_be_integers(layer, tile):
    W, H, _ = layer
    with pytest.raises(ValueError, match="tile must be an int or a pair"):
        bakron.quantize_layer(W, H, None, bits=3, tile=tile)


def test_numpy_integer_tile_is_accepted(layer):
    W, H, _ = layer
    a = bakron.quantize_layer(W, H, None, bits=3, tile=np.int64(16), metrics="none")
    b = bakron.quantize_layer(W, H, None, bits=3, tile=(16, 16), metrics="none")
    np.testing.assert_array_equal(a.values, b.values)


@pytest.mark.parametrize("bad", ["8", 8.9, True, 2.0])
def test_base_max_tries_group_size_must_be_integers(layer, bad):
    W, H, _ = layer
    f = bakron.prepare_factor(H, 16)
    q = bakron.UniformQuantizer.fit(W, 3)
    with pytest.raises(ValueError, match="base must be"):
        bakron.solve(W, None, f.A, q, tile=16, base=bad)
    with pytest.raises(ValueError, match="max_tries must be"):
        bakron.prepare_factor(H, 16, max_tries=bad)
    with pytest.raises(ValueError, match="group_size must be"):
        bakron.UniformQuantizer.fit(W, 3, granularity="group", group_size=bad)
    with pytest.raises(ValueError, match="group_size must be"):
        bakron.UniformQuantizer(3, np.ones((64, 12)), group_size=bad)


def test_group_size_2_5_is_named(layer):
    W, H, _ = layer
    with pytest.raises(ValueError, match="group_size must be an integer, got float 2.5"):
        bakron.quantize_layer(W, H, bits=3, granularity="group", group_size=2.5)


# -- 2. a factor prepared with a coarser block ------------------------------------------------

def test_factor_with_coarser_block_is_refused(layer):
    W, H, _ = layer
    q = bakron.UniformQuantizer.fit(W, 3)
    f32 = bakron.prepare_factor(H, 32)
    with pytest.raises(ValueError, match="A_in looks like a factor made with a block size "
                                         "coarser than the tile"):
        bakron.solve(W, None, f32.A, q, tile=16)
    with pytest.raises(ValueError, match="A_in was prepared with block size 32 but the tile "
                                         "needs 16"):
        bakron.solve(W, None, f32, q, tile=16)
    f16 = bakron.prepare_factor(H, 16)  # the right factor, as array or Factor, is accepted
    a = bakron.solve(W, None, f16.A, q, tile=16).values
    np.testing.assert_array_equal(a, bakron.solve(W, None, f16, q, tile=16).values)


def test_coarser_block_two_sided(layer):
    W, H, Ho = layer
    q = bakron.UniformQuantizer.fit(W, 3)
    with pytest.raises(ValueError, match="A_out looks like a factor made with a block size"):
        bakron.solve(W, bakron.prepare_factor(Ho, 32).A, bakron.prepare_factor(H, 16).A, q,
                     tile=16)


def test_block_diagonal_hessian_is_not_mistaken_for_a_coarse_factor(layer):
    """Attention-head factors are block diagonal: their factors are zero between heads, which
    must not look like a coarser block (no coupling further left)."""
    W, H, Ho = layer
    heads = np.kron(np.eye(4), np.ones((16, 16))) * Ho + 0.1 * np.eye(64)
    q = bakron.UniformQuantizer.fit(W, 3)
    f_in = bakron.prepare_factor(H, 1)
    for t in (1, 4, 16):
        A_out = bakron.prepare_factor(heads, t).A
        bakron.solve(W, A_out, bakron.prepare_factor(H, t).A, q, tile=t)
    dead = H.copy()
    dead[5, :] = dead[:, 5] = 0.0  # a dead channel
    bakron.solve(W, None, bakron.prepare_factor(dead, 1).A, q, tile=1)
    assert f_in.block == 1


# -- 4. complex inputs ------------------------------------------------------------------------

def test_complex_inputs_are_refused(layer):
    W, H, Ho = layer
    Hc = H.astype(np.complex128) + 1e-3j
    with pytest.raises(TypeError, match="H_in has the complex dtype complex128"):
        bakron.prepare_factor(Hc, 16, name="H_in")
    with pytest.raises(TypeError, match="H has the complex dtype"):
        bakron.block_ldl(Hc, 16)
    with pytest.raises(TypeError, match="H_out has the complex dtype"):
        bakron.quantize_layer(W, H, Ho.astype(np.complex64), bits=3)
    with pytest.raises(TypeError, match="W must be float32 or float64|W has the complex"):
        bakron.quantize_layer(W.astype(np.complex64), H, bits=3)
    f = bakron.prepare_factor(H, 16)
    q = bakron.UniformQuantizer.fit(W, 3)
    with pytest.raises(TypeError, match="A_in has the complex dtype"):
        bakron.solve(W, None, f.A.astype(np.complex128), q, tile=16)
    with pytest.raises(TypeError, match="H_in has the complex dtype"):
        bakron.proxy_error(W, W, Hc)
    acc = bakron.hessian.FactorAccumulator(96, xp=np)
    with pytest.raises(TypeError, match="rows has the complex dtype"):
        acc.update(np.ones((3, 96), dtype=np.complex128))
    with pytest.raises(TypeError, match="scale has the complex dtype"):
        bakron.UniformQuantizer(3, np.ones(64, dtype=np.complex128))


# -- 5. a quantizer returning NaN, proxy_error given NaN ---------------------------------------

class _NaNQuantizer:
    def quantize(self, targets):
        v = np.round(targets)
        v[..., 0, 0] = np.nan
        return v, None


class _ListQuantizer:
    def quantize(self, targets):
        return np.round(targets).tolist(), None


class _IntQuantizer:
    def quantize(self, targets):
        return np.round(targets).astype(np.int32), None


def test_quantizer_output_is_checked(layer):
    W, H, _ = layer
    f = bakron.prepare_factor(H, 16)
    with pytest.raises(ValueError, match="_NaNQuantizer.quantize returned NaN or Inf values"):
        bakron.solve(W, None, f.A, _NaNQuantizer(), tile=16, engine="array_api")
    with pytest.raises(TypeError, match="_ListQuantizer.quantize returned values of type list"):
        bakron.solve(W, None, f.A, _ListQuantizer(), tile=16, engine="array_api")
    with pytest.raises(TypeError, match="_IntQuantizer.quantize returned values of dtype int32"):
        bakron.solve(W, None, f.A, _IntQuantizer(), tile=16, engine="array_api")


def test_quantizer_from_another_namespace_is_named():
    strict = pytest.importorskip("array_api_strict")
    call = QuantizerCall(_ListQuantizer())
    T = np.zeros((2, 4, 4))
    out = (strict.asarray(T), None)
    with pytest.raises(TypeError, match="_ListQuantizer.quantize returned values of type "
                                        "Array for targets of type ndarray"):
        bakron._validate.check_quantizer_output(call.quantizer, T, out)


def test_quantizer_class_instead_of_instance(layer):
    W, H, _ = layer
    with pytest.raises(TypeError, match="quantizer is the class UniformQuantizer, not an "
                                        "instance"):
        bakron.quantize_layer(W, H, quantizer=bakron.UniformQuantizer)


def test_proxy_error_given_nan(layer):
    W, H, _ = layer
    Wn = W.copy()
    Wn[0, 0] = np.nan
    with pytest.raises(ValueError, match="W_hat contains 1 NaN"):
        bakron.proxy_error(W, Wn, H)
    Hn = H.copy()
    Hn[1, 2] = np.inf
    with pytest.raises(ValueError, match="H_in contains 1 NaN or Inf"):
        bakron.proxy_error(W, W, Hn)


# -- 6. scales that underflow or overflow in W's dtype; huge H --------------------------------

def test_scale_zero_or_inf_in_float32_is_refused(layer):
    W, H, _ = layer
    f = bakron.prepare_factor(H, 16)
    for s in (1e300, 1e-300):
        q = bakron.UniformQuantizer(3, s)  # valid in float64
        for engine in ("array_api", "auto"):
            with pytest.raises(ValueError, match="scale has 1 entry that is 0 or infinite in "
                                                 "W's dtype float32"):
                bakron.solve(W, None, f.A, q, tile=16, engine=engine)
    bakron.solve(W.astype(np.float64), None, f.A, bakron.UniformQuantizer(3, 1e300), tile=16)


def test_tiny_weights_round_to_zero_not_nan(layer):
    _, H, _ = layer
    W = np.full((64, 96), 1e-45, dtype=np.float32)
    W[::2] = -1e-45
    res = bakron.quantize_layer(W, H, bits=3)
    assert np.all(np.isfinite(res.values)) and np.all(res.values == 0)


def test_huge_hessian_is_normalised_without_overflow(layer):
    W, H, _ = layer
    Hs = H / np.abs(H).max()
    ref = bakron.prepare_factor(Hs, 16)
    for k in (1e307, 1e-300):
        f = bakron.prepare_factor(Hs * k, 16)
        assert np.abs(f.A).max() > 0.01
        np.testing.assert_allclose(f.A, ref.A, atol=1e-12)
    exact = bakron.prepare_factor(Hs * 2.0 ** 1000, 16)
    np.testing.assert_array_equal(exact.A, ref.A)


# -- poor messages ----------------------------------------------------------------------------

def test_big_endian_input_is_converted(layer):
    W, H, _ = layer
    a = bakron.quantize_layer(W.astype(">f4"), H.astype(">f8"), bits=3, metrics="none")
    b = bakron.quantize_layer(W, H, bits=3, metrics="none")
    np.testing.assert_array_equal(a.values, b.values)


@pytest.mark.parametrize("damp,msg", [("0.1", "damp must be a real number, got str '0.1'"),
                                      (float("inf"), "damp must be a finite number"),
                                      (float("nan"), "damp must be a finite number"),
                                      (-0.5, "damp must be >= 0"),
                                      (True, "damp must be a real number, got bool")])
def test_damp_messages(layer, damp, msg):
    W, H, _ = layer
    with pytest.raises(ValueError, match=msg):
        bakron.quantize_layer(W, H, bits=3, damp=damp)
    with pytest.raises(ValueError, match=msg):
        bakron.prepare_factor(H, 16, damp=damp)


def test_proxy_error_with_1d_h(layer):
    W, H, _ = layer
    with pytest.raises(ValueError, match=r"H_in must be a 2-D array, got shape \(96,\)"):
        bakron.proxy_error(W, W, np.diagonal(H).copy())


def test_matrix_and_masked_arrays_are_refused(layer):
    W, H, _ = layer
    with pytest.raises(TypeError, match="W is a numpy.matrix"):
        bakron.quantize_layer(np.asmatrix(W), H, bits=3)
    with pytest.raises(TypeError, match="H_in is a masked array"):
        bakron.quantize_layer(W, np.ma.masked_array(H, mask=H < 0), bits=3)
    with pytest.raises(TypeError, match="H is a masked array"):
        bakron.prepare_factor(np.ma.masked_array(H), 16)


def test_uniform_quantizer_copies_the_scale(layer):
    W, _, _ = layer
    s = np.full(64, 0.5)
    q = bakron.UniformQuantizer(3, s)
    before = q.rtn(W)[0].copy()
    s[:] = 100.0
    np.testing.assert_array_equal(q.rtn(W)[0], before)
    assert np.all(np.asarray(q.scale) == 0.5)


def test_block_ldl_sees_the_upper_triangle(layer):
    _, H, _ = layer
    Hn = H.copy()
    Hn[0, 5] = np.nan
    with pytest.raises(ValueError, match="H contains 1 NaN"):
        bakron.block_ldl(Hn, 16)
    Ha = H.copy()
    Ha[0, 5] += 1.0
    with pytest.raises(ValueError, match="H is not symmetric"):
        bakron.block_ldl(Ha, 16)


def test_all_zero_weights_round_to_zeros(layer):
    _, H, Ho = layer
    W = np.zeros((64, 96), dtype=np.float32)
    for h_out in (None, Ho, np.diagonal(Ho).copy()):
        res = bakron.quantize_layer(W, H, h_out, bits=3)
        assert np.all(res.values == 0)
        assert res.proxy_error == 0.0 and res.rtn_proxy_error == 0.0


# -- half precision W ------------------------------------------------------------------------

def test_half_precision_weights_are_computed_in_float32(layer):
    W, H, _ = layer
    W16 = W.astype(np.float16)
    res = bakron.quantize_layer(W16, H, bits=3)
    ref = bakron.quantize_layer(W16.astype(np.float32), H, bits=3)
    assert res.values.dtype == np.float32 and res.input_dtype == "float16"
    assert res.summary()["input_dtype"] == "float16"
    np.testing.assert_array_equal(res.values, ref.values)
    assert W16.dtype == np.float16  # not modified


def test_bfloat16_weights_if_available(layer):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    W, H, _ = layer
    Wb = W.astype(ml_dtypes.bfloat16)
    res = bakron.quantize_layer(Wb, H, bits=3, metrics="basic")
    assert res.values.dtype == np.float32 and res.input_dtype == "bfloat16"


# -- metrics ----------------------------------------------------------------------------------

def test_metrics_levels(layer):
    W, H, Ho = layer
    full = bakron.quantize_layer(W, H, Ho, bits=3, metrics="full")
    basic = bakron.quantize_layer(W, H, Ho, bits=3, metrics="basic")
    none = bakron.quantize_layer(W, H, Ho, bits=3, metrics="none")
    np.testing.assert_array_equal(full.values, none.values)
    assert basic.proxy_error == pytest.approx(full.proxy_error, rel=1e-12)
    assert basic.rtn_proxy_error == pytest.approx(full.rtn_proxy_error, rel=1e-12)
    assert basic.proxy_error_one_sided is None and none.proxy_error is None
    assert full.proxy_error == pytest.approx(bakron.proxy_error(W, full.values, H, Ho), rel=1e-12)
    assert full.proxy_error_one_sided == pytest.approx(bakron.proxy_error(W, full.values, H),
                                                       rel=1e-12)
    with pytest.raises(ValueError, match="metrics must be one of"):
        bakron.quantize_layer(W, H, bits=3, metrics="most")


def test_proxy_metrics_share_products(layer):
    from bakron._lib.proxy import ProxyMetrics

    W, H, Ho = layer
    pm = ProxyMetrics(np, W, H, Ho)
    W1, W2 = np.round(W), np.round(2 * W) / 2
    pm.errors(W1)
    pm.errors(W2)
    # W H_I and H_O (W H_I) once, then two products per candidate: 6 for four ratios each
    assert pm.products == 6


def test_progress_messages(layer):
    W, H, Ho = layer
    seen = []
    bakron.quantize_layer(W, H, Ho, bits=3, progress=seen.append)
    assert [m.split(" ")[0] for m in seen] == ["preparing", "solving", "computing"]


# -- the whole-matrix checks in row strips ----------------------------------------------------

@pytest.mark.parametrize("engine", ["array_api", "auto"])
@pytest.mark.parametrize("strip", [1 << 20, 96 * 16, 96 * 40, 7])
def test_matrix_checks_in_row_strips_find_every_bad_entry(layer, monkeypatch, strip, engine):
    """The strictly-lower, coarse-block and finiteness checks read a matrix in strips of
    ``STRIP_ELEMENTS`` (one strip, whole 16-row blocks, strips of 32 rows, a strip per row
    block), or, with the numba engine available (``auto``), the factor checks take one
    compiled pass: a forbidden entry right of a strip, in its diagonal square, inside a
    diagonal block, or a NaN in the last strip is found in every case; a good factor
    passes."""
    import bakron._validate as v

    monkeypatch.setattr(v, "STRIP_ELEMENTS", strip)
    W, H, _ = layer
    q = bakron.UniformQuantizer.fit(W, 3)
    A = bakron.prepare_factor(H, 16).A
    ref = bakron.solve(W, None, A, q, tile=16, engine=engine).values
    for r, c in [(0, 95), (5, 40), (20, 30), (40, 41), (47, 40), (95, 95), (80, 90)]:
        B = A.copy()
        B[r, c] = -1e-3
        with pytest.raises(ValueError, match="A_in must be strictly block-lower-triangular"):
            bakron.solve(W, None, B, q, tile=16, engine=engine)
    B = A.copy()
    B[95, 3] = np.nan
    with pytest.raises(ValueError, match="A_in contains 1 NaN"):
        bakron.solve(W, None, B, q, tile=16, engine=engine)
    with pytest.raises(ValueError, match="A_in looks like a factor made with a block size "
                                         "coarser than the tile"):
        bakron.solve(W, None, bakron.prepare_factor(H, 32).A, q, tile=16, engine=engine)
    np.testing.assert_array_equal(bakron.solve(W, None, A, q, tile=16, engine=engine).values,
                                  ref)


def test_row_strips_cover_the_rows_in_aligned_pieces(monkeypatch):
    import bakron._validate as v

    monkeypatch.setattr(v, "STRIP_ELEMENTS", 1000)
    for rows, size, align in [(96, 96, 16), (100, 7, 3), (5, 10**6, 4), (1, 1, 1)]:
        s = v.row_strips(np, rows, size, align)
        assert s[0][0] == 0 and s[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(s, s[1:]))
        assert all((r1 - r0) % align == 0 for r0, r1 in s[:-1])
        assert all((r1 - r0) * size <= max(1000, align * size) for r0, r1 in s)
    other = types.ModuleType("cupy")  # not numpy: the whole matrix
    assert v.row_strips(other, 96, 96, 16) == [(0, 96)]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_strip_checks_work_in_a_forked_child(monkeypatch):
    """The strips' thread pool is per process: a child forked after the parent used it
    checks its own matrices (a pool inherited without its threads would hang)."""
    import os

    import bakron._validate as v

    monkeypatch.setattr(v, "STRIP_ELEMENTS", 64)
    X = np.ones((40, 40))
    assert v.all_finite(np, X)  # the parent makes its pool
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ok = False
        try:
            X[39, 0] = np.nan
            ok = v.all_finite(np, np.ones((40, 40))) and not v.all_finite(np, X)
        finally:
            os._exit(0 if ok else 3)
    deadline = time.monotonic() + 60
    while True:  # a hang is a failure, not a stuck test run
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's strip check did not finish in 60 s")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
