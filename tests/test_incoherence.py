"""Incoherence processing (:mod:`bakron.incoherence`, ``quantize_layer(incoherence=...)``):
the rotations are orthogonal and exactly invertible in float64 and have the documented
structure (random signs, Sylvester Hadamard, a random block for the odd part); the proxy
identities hold through the rotation; the result decodes from its codes; the GGUF/GPTQ
formats are refused with the reason."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.linalg import hadamard

from bakron import proxy_error, quantize_layer
from bakron.incoherence import Incoherence, Rotation, refusal

SIZES = [1, 2, 7, 24, 64, 96, 576]


@pytest.mark.parametrize("N", SIZES)
def test_rotation_is_orthogonal_and_exactly_invertible(N):
    R = Rotation(N, seed=3).matrix()
    np.testing.assert_allclose(R @ R.T, np.eye(N), atol=1e-12)
    X = np.random.default_rng(N).standard_normal((N, 5))
    rot = Rotation(N, seed=3)
    np.testing.assert_allclose(rot.apply(X), R @ X, atol=1e-12)
    np.testing.assert_allclose(rot.apply(X, transpose=True), R.T @ X, atol=1e-12)
    np.testing.assert_allclose(rot.apply(rot.apply(X), transpose=True), X, atol=1e-12)


@pytest.mark.parametrize("N, r, p", [(64, 1, 64), (576, 9, 64), (24, 3, 8), (7, 7, 1)])
def test_rotation_structure(N, r, p):
    """``R = (Q_r ⊗ H_p / sqrt(p)) · diag(s)`` with scipy's Hadamard matrix."""
    rot = Rotation(N, seed=(5, 1))
    assert (rot.r, rot.p) == (r, p)
    assert set(np.unique(rot.signs)) <= {-1.0, 1.0}
    want = np.kron(rot.Q, hadamard(p) / np.sqrt(p)) @ np.diag(rot.signs)
    np.testing.assert_allclose(rot.matrix(), want, atol=1e-12)
    np.testing.assert_allclose(rot.Q @ rot.Q.T, np.eye(r), atol=1e-12)


def test_seeds():
    a, b, c = Rotation(96, 1).matrix(), Rotation(96, 1).matrix(), Rotation(96, 2).matrix()
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    inc = Incoherence(24, 96, seed=4)
    assert not np.allclose(inc.U.matrix()[:24, :24], Rotation(24, (4, 1)).matrix())


def _problem(m=24, n=96, seed=0):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((m, n))
    X = rng.standard_normal((400, n)) * np.linspace(0.2, 3.0, n)
    G = rng.standard_normal((300, m)) * np.linspace(0.5, 2.0, m)
    return W, X.T @ X / 400, G.T @ G / 300


def test_incoherence_rotations_of_the_layer():
    W, H_in, H_out = _problem()
    inc = Incoherence(*W.shape, seed=1)
    U, V = inc.U.matrix(), inc.V.matrix()
    np.testing.assert_allclose(inc.rotate_weight(W), U @ W @ V.T, atol=1e-12)
    np.testing.assert_allclose(inc.unrotate_weight(inc.rotate_weight(W)), W, atol=1e-12)
    np.testing.assert_allclose(inc.rotate_in(H_in), V @ H_in @ V.T, atol=1e-12)
    np.testing.assert_allclose(inc.rotate_out(H_out), U @ H_out @ U.T, atol=1e-12)
    np.testing.assert_allclose(inc.rotate_out(np.diag(H_out)),
                               U @ np.diag(np.diag(H_out)) @ U.T, atol=1e-12)
    assert inc.rotate_out(None) is None
    W32 = W.astype(np.float32)
    assert inc.rotate_weight(W32).dtype == np.float32
    before = W.copy()
    inc.rotate_weight(W)
    np.testing.assert_array_equal(W, before)      # never modifies its input


def test_incoherence_spreads_an_outlier():
    W, _, _ = _problem()
    W[3, 7] = 40.0
    Wr = Incoherence(*W.shape, seed=0).rotate_weight(W)
    ratio = lambda A: np.abs(A).max() / np.sqrt(np.mean(A * A))  # noqa: E731
    assert ratio(Wr) < 0.5 * ratio(W)


@pytest.mark.parametrize("two_sided", [False, True])
def test_proxy_identities_through_the_rotation(two_sided):
    """The result's proxy errors (computed in the rotated basis) equal those of the
    rotated-back values in the original basis; H_out = None behaves as the identity."""
    W, H_in, H_out = _problem(seed=2)
    Ho = H_out if two_sided else None
    res = quantize_layer(W, H_in, Ho, bits=3, incoherence=7, tile=(8, 8))
    inc = res.rotation
    assert isinstance(inc, Incoherence) and inc.seed == 7
    # the codes decode to the rotated result, which rotates back to values
    Wr_hat = np.asarray(res.quantizer.dequantize(res.codes, dtype=np.float64))
    np.testing.assert_allclose(inc.unrotate_weight(Wr_hat), res.values, atol=1e-12)
    np.testing.assert_allclose(proxy_error(W, res.values, H_in, Ho), res.proxy_error,
                               rtol=1e-9)
    np.testing.assert_allclose(proxy_error(W, res.values, H_in), res.proxy_error_one_sided,
                               rtol=1e-9)
    np.testing.assert_allclose(proxy_error(W, res.rtn_values, H_in, Ho), res.rtn_proxy_error,
                               rtol=1e-9)
    eye = np.eye(W.shape[0])
    np.testing.assert_allclose(proxy_error(W, res.values, H_in, None),
                               proxy_error(W, res.values, H_in, eye), rtol=1e-12)
    rot_W = inc.rotate_weight(W)
    np.testing.assert_allclose(
        proxy_error(rot_W, Wr_hat, inc.rotate_in(H_in), None if Ho is None else
                    inc.rotate_out(Ho)), res.proxy_error, rtol=1e-9)
    # the solve minimised the rotated proxy: better than RTN of the rotated weights
    assert res.proxy_error < res.rtn_proxy_error


def test_same_as_quantizing_the_rotated_layer_by_hand():
    W, H_in, H_out = _problem(seed=4)
    inc = Incoherence(*W.shape, seed=2)
    res = quantize_layer(W, H_in, H_out, bits=4, incoherence=inc, tile=(8, 8))
    by_hand = quantize_layer(inc.rotate_weight(W), inc.rotate_in(H_in), inc.rotate_out(H_out),
                             bits=4, tile=(8, 8))
    np.testing.assert_array_equal(res.codes, by_hand.codes)
    np.testing.assert_allclose(res.values, inc.unrotate_weight(by_hand.values), atol=1e-12)
    plain = quantize_layer(W, H_in, H_out, bits=4, tile=(8, 8))
    assert plain.rotation is None and not np.allclose(plain.values, res.values)


def test_float32_and_half_inputs():
    W, H_in, H_out = _problem(seed=5)
    res = quantize_layer(W.astype(np.float32), H_in.astype(np.float32), None, bits=4,
                         incoherence=0)
    assert res.values.dtype == np.float32 and res.input_dtype == "float32"
    half = quantize_layer(W.astype(np.float16), H_in, None, bits=4, incoherence=0)
    assert half.values.dtype == np.float32 and half.input_dtype == "float16"


def test_bad_arguments():
    W, H_in, _ = _problem()
    with pytest.raises(ValueError, match="seed"):
        quantize_layer(W, H_in, bits=4, incoherence=-1)
    with pytest.raises(ValueError, match="rotations are for a 8 x 96 layer"):
        quantize_layer(W, H_in, bits=4, incoherence=Incoherence(8, 96))
    with pytest.raises(ValueError, match="H_in"):
        quantize_layer(W, H_in[:5, :5], bits=4, incoherence=0)
    with pytest.raises(ValueError, match="positive integer"):
        Rotation(0)
    with pytest.raises(ValueError, match="96 rows"):
        Rotation(96).apply(np.ones((5, 2)))


@pytest.mark.parametrize("fmt", ["gguf-q4_0", "gguf-q4_1", "gguf-q8_0", "gptq"])
def test_formats_that_cannot_carry_rotations_are_refused(fmt):
    msg = refusal(fmt)
    assert msg and fmt in msg and "cannot carry the rotations" in msg
    assert ("GGUF" in msg) == fmt.startswith("gguf")
    assert refusal("float") is None


# -- bakron quantize-model --format float --incoherence ----------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from test_llm_loaders import tiny_config, tiny_weights, write_gguf

    d = tmp_path_factory.mktemp("model")
    cfg = tiny_config(tied=False)
    write_gguf(d / "tiny.gguf", cfg, tiny_weights(cfg, seed=3))
    return d / "tiny.gguf"


@pytest.mark.parametrize("factors", ["input", "global", "rtn"])
def test_quantize_model_float_with_incoherence(tiny_gguf, tmp_path, factors):
    """The float export holds ``Uᵀ Ŵ' V`` with ``Ŵ'`` the rotated layer's solve (the same
    as quantize_layer with the same rotations and grid), and differs from the plain run."""
    pytest.importorskip("tqdm")
    from bakron.models import load_llm
    from bakron.quantize_model import _fit_grid, _grid_settings, quantize_model

    kw = dict(fmt="float", factors=factors, bits=3, calib_seqs=4, calib_len=16,
              progress=False, keep_weights=True)
    rot = quantize_model(tiny_gguf, tmp_path / "r", incoherence=5, **kw)
    plain = quantize_model(tiny_gguf, tmp_path / "p", incoherence=None, **kw)
    lm = load_llm(tiny_gguf)
    grid = _grid_settings("float", 3, None, None)
    name = "blk.1.ffn_down"
    W = np.asarray(lm.linear_weight(name))
    inc = Incoherence(*W.shape, seed=5)
    Wr = inc.rotate_weight(W)
    q = _fit_grid(Wr, grid)
    got = rot["weights"][name]
    # the export rotated back: U got Vᵀ lies on the grid fitted to U W Vᵀ
    back = inc.rotate_weight(got.astype(np.float64))
    np.testing.assert_allclose(back, np.asarray(q.rtn(back)[0], dtype=np.float64), atol=2e-5)
    assert np.abs(back - Wr).max() > 1e-3            # not W' itself: it was rounded
    if factors == "rtn":
        np.testing.assert_allclose(got, inc.unrotate_weight(q.rtn(Wr)[0]), atol=1e-6)
    assert not np.allclose(got, plain["weights"][name])
    out = load_llm(tmp_path / "r")        # the float export loads and holds W_hat
    np.testing.assert_allclose(np.asarray(out.linear_weight(name)), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["gguf-q4_0", "gptq"])
def test_quantize_model_refuses_incoherence_for_codes_formats(tiny_gguf, tmp_path, fmt):
    from bakron.cli import main
    from bakron.io import InputError
    from bakron.quantize_model import quantize_model

    with pytest.raises(InputError, match="cannot carry the rotations"):
        quantize_model(tiny_gguf, tmp_path / "x", fmt=fmt, factors="input", incoherence=0,
                       progress=False)
    assert not (tmp_path / "x").exists()
    assert main(["quantize-model", str(tiny_gguf), "--out", str(tmp_path / "y"), "--format",
                 fmt, "--incoherence", "1", "--quiet"]) == 2


def test_quantize_model_incoherence_auto(tiny_gguf, tmp_path):
    """``incoherence="auto"`` (the default) is seed 0 for a float export (bitwise) and off for
    GGUF, which cannot carry the rotations; the CLI's auto / off / SEED map onto it."""
    pytest.importorskip("tqdm")
    from bakron.cli import main
    from bakron.io import InputError
    from bakron.quantize_model import quantize_model

    kw = dict(factors="input", calib_seqs=4, calib_len=16, progress=False, keep_weights=True)
    auto = quantize_model(tiny_gguf, tmp_path / "a", fmt="float", bits=3, **kw)
    seed0 = quantize_model(tiny_gguf, tmp_path / "s", fmt="float", bits=3, incoherence=0, **kw)
    seed1 = quantize_model(tiny_gguf, tmp_path / "s1", fmt="float", bits=3, incoherence=1, **kw)
    for name, w in auto["weights"].items():
        np.testing.assert_array_equal(w, seed0["weights"][name])
    assert any(not np.array_equal(w, seed1["weights"][n]) for n, w in auto["weights"].items())
    rtn = dict(kw, factors="rtn")   # auto leaves round-to-nearest on W itself
    r_auto = quantize_model(tiny_gguf, tmp_path / "ra", fmt="float", bits=3, **rtn)
    r_off = quantize_model(tiny_gguf, tmp_path / "ro", fmt="float", bits=3, incoherence=None,
                           **rtn)
    for name, w in r_auto["weights"].items():
        np.testing.assert_array_equal(w, r_off["weights"][name])
    gg = quantize_model(tiny_gguf, tmp_path / "a.gguf", fmt="gguf-q4_0", **kw)
    off = quantize_model(tiny_gguf, tmp_path / "o.gguf", fmt="gguf-q4_0", incoherence=None,
                         **kw)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "o.gguf").read_bytes()
    assert sorted(gg["weights"]) == sorted(off["weights"])
    with pytest.raises(InputError, match="incoherence must be 'auto'"):
        quantize_model(tiny_gguf, tmp_path / "x", fmt="float", incoherence="on", bits=3, **kw)
    assert not (tmp_path / "x").exists()
    cli = ["quantize-model", str(tiny_gguf), "--format", "float", "--bits", "3", "--factors",
           "input", "--calib-seqs", "4", "--calib-len", "16", "--quiet"]
    assert main(cli + ["--out", str(tmp_path / "c"), "--incoherence", "off"]) == 0
    from bakron.models import load_llm

    name = "blk.1.ffn_down"
    plain = quantize_model(tiny_gguf, tmp_path / "p", fmt="float", bits=3, incoherence=None,
                           **kw)
    np.testing.assert_array_equal(np.asarray(load_llm(tmp_path / "c").linear_weight(name)),
                                  plain["weights"][name])
    assert main(cli + ["--out", str(tmp_path / "d"), "--incoherence", "maybe"]) == 2
    assert not (tmp_path / "d").exists()
