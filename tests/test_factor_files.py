"""Factor files: the packed upper-triangle layout, round trips, interop, the diagonal fast path."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

import bakron
from bakron import _safetensors
from bakron import factor_files as ff


def _spd(rng, n):
    X = rng.standard_normal((2 * n + 3, n))
    return X.T @ X


# -- the layout ------------------------------------------------------------------------------

def test_pack_layout_is_upper_triangle_column_by_column():
    H = np.arange(16, dtype=np.float64).reshape(4, 4)
    H = H + H.T
    v = ff.pack_upper(H)
    expect = [H[r, c] for c in range(4) for r in range(c + 1)]
    assert v.tolist() == expect
    # entry (r, c), r <= c, sits at c(c+1)/2 + r ...
    for c in range(4):
        for r in range(c + 1):
            assert v[c * (c + 1) // 2 + r] == H[r, c]
    # ... which is the lower triangle read row by row (torch.tril_indices / YAQA / QuIP# order)
    i, j = np.tril_indices(4)
    assert np.array_equal(v, H[i, j])


@given(n=st.integers(1, 40), dtype=st.sampled_from([np.float32, np.float64]),
       seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip_is_exact(n, dtype, seed):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((n, n)).astype(dtype)
    H = A + A.T
    v = ff.pack_upper(H)
    assert v.shape == (n * (n + 1) // 2,) and v.dtype == dtype
    back = ff.unpack_upper(v)
    assert back.dtype == dtype
    assert np.array_equal(back, H)


def test_pack_errors():
    with pytest.raises(ValueError, match="square"):
        ff.pack_upper(np.zeros((2, 3)))
    with pytest.raises(TypeError, match="float"):
        ff.pack_upper(np.eye(3, dtype=np.int64))
    with pytest.raises(ValueError, match="not n\\(n\\+1\\)/2"):
        ff.unpack_upper(np.zeros(5))
    with pytest.raises(ValueError, match="expected 4 x 4"):
        ff.unpack_upper(np.zeros(6), 4)


# -- files -----------------------------------------------------------------------------------

def test_save_load_round_trip_dense(tmp_path):
    rng = np.random.default_rng(0)
    Hi, Ho = _spd(rng, 12), _spd(rng, 9)
    p = tmp_path / "f.safetensors"
    ff.save_factors(p, Hi, Ho, metadata={"tokens": 1234})
    header, _ = _safetensors.read_header(p)
    assert header["hin"]["shape"] == [78] and header["hin"]["dtype"] == "F64"
    assert header["hout"]["shape"] == [45]
    meta = header["__metadata__"]
    assert meta["format"] == "bakron-factors" and meta["packing"] == "upper-colmajor"
    assert meta["n_in"] == "12" and meta["n_out"] == "9" and meta["tokens"] == "1234"
    fs = ff.load_factors(p)
    assert np.array_equal(fs.h_in, Hi) and np.array_equal(fs.h_out, Ho)
    assert fs.h_out_diag is None and fs.n_in == 12 and fs.n_out == 9
    # float32 storage: values rounded once, still exactly symmetric
    p32 = tmp_path / "f32.safetensors"
    ff.save_factors(p32, Hi, Ho, dtype=np.float32)
    fs32 = ff.load_factors(p32)
    assert fs32.h_in.dtype == np.float32
    assert np.array_equal(fs32.h_in, Hi.astype(np.float32))
    assert np.array_equal(fs32.h_in, fs32.h_in.T)


def test_diag_and_one_sided_files(tmp_path):
    rng = np.random.default_rng(1)
    Hi, d = _spd(rng, 7), rng.uniform(0.5, 2, 5)
    ff.save_factors(tmp_path / "d.safetensors", Hi, d)
    fs = ff.load_factors(tmp_path / "d.safetensors")
    assert fs.h_out is None and np.array_equal(fs.h_out_diag, d) and fs.n_out == 5
    ff.save_factors(tmp_path / "o.safetensors", Hi)
    fs = ff.load_factors(tmp_path / "o.safetensors")
    assert fs.h_out is None and fs.h_out_diag is None and fs.n_out is None


def test_collection_and_layer_names(tmp_path):
    rng = np.random.default_rng(2)
    layers = {"model.l0.q": (_spd(rng, 6), _spd(rng, 4)),
              "model.l0.k": (_spd(rng, 6), rng.uniform(1, 2, 3)),
              "model.l1.o": ff.FactorSet(h_in=_spd(rng, 5))}
    p = tmp_path / "all.safetensors"
    ff.save_factor_collection(p, layers)
    assert ff.list_factor_layers(p) == sorted(layers)
    a = ff.load_factors(p, "model.l0.q")
    assert np.array_equal(a.h_in, layers["model.l0.q"][0])
    assert np.array_equal(a.h_out, layers["model.l0.q"][1])
    b = ff.load_factors(p, "model.l0.k")
    assert np.array_equal(b.h_out_diag, layers["model.l0.k"][1])
    c = ff.load_factors(p, "model.l1.o")
    assert c.h_out is None and c.n_in == 5
    with pytest.raises(KeyError, match="layers in this file"):
        ff.load_factors(p, "model.l9.x")


def test_never_overwrites_and_writes_atomically(tmp_path):
    rng = np.random.default_rng(3)
    p = tmp_path / "f.safetensors"
    ff.save_factors(p, _spd(rng, 4))
    before = p.read_bytes()
    with pytest.raises(FileExistsError):
        ff.save_factors(p, _spd(rng, 4))
    assert p.read_bytes() == before
    # invalid input: nothing written, no temporary left behind
    bad = _spd(rng, 4)
    bad[0, 1] += 1.0
    with pytest.raises(ValueError, match="not symmetric"):
        ff.save_factors(tmp_path / "g.safetensors", bad)
    nan = _spd(rng, 4)
    nan[2, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        ff.save_factors(tmp_path / "g.safetensors", nan)
    with pytest.raises(ValueError, match=">= 0"):
        ff.save_factors(tmp_path / "g.safetensors", _spd(rng, 4), -np.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["f.safetensors"]
    ff.save_factors(p, _spd(rng, 4), overwrite=True)
    assert p.read_bytes() != before


def test_reads_foreign_files_packed_in_tril_order(tmp_path):
    """A file made elsewhere: hin/hout as H[tril_indices] vectors (float32), written by the
    reference ``safetensors`` package when it is installed (else by bakron's writer)."""
    rng = np.random.default_rng(4)
    Hi, Ho = _spd(rng, 10).astype(np.float32), _spd(rng, 6).astype(np.float32)
    tensors = {"hin": Hi[np.tril_indices(10)], "hout": Ho[np.tril_indices(6)]}
    p = str(tmp_path / "foreign.safetensors")
    try:
        from safetensors.numpy import save_file
        save_file(tensors, p)
    except ImportError:
        _safetensors.save(p, tensors)
    fs = ff.load_factors(p)
    assert np.array_equal(fs.h_in, Hi) and np.array_equal(fs.h_out, Ho)


def test_files_written_here_read_by_reference_library(tmp_path):
    sn = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not "
                             "installed")
    rng = np.random.default_rng(5)
    Hi, Ho = _spd(rng, 8), _spd(rng, 5)
    p = str(tmp_path / "f.safetensors")
    ff.save_factors(p, Hi, Ho)
    t = sn.load_file(p)
    i, j = np.tril_indices(8)
    full = np.zeros((8, 8))
    full[i, j] = t["hin"]
    full[j, i] = t["hin"]
    assert np.array_equal(full, Hi)
    assert t["hout"].shape == (15,)


def test_load_rejects_inconsistent_files(tmp_path):
    p = tmp_path / "bad.safetensors"
    _safetensors.save(p, {"hin": np.zeros(7)})
    with pytest.raises(ValueError, match="not n\\(n\\+1\\)/2"):
        ff.load_factors(p)
    _safetensors.save(p, {"hin": np.ones(6)}, {"n_in": "4"})
    with pytest.raises(ValueError, match="n_in = 4"):
        ff.load_factors(p)
    _safetensors.save(p, {"weight": np.ones(3)})
    with pytest.raises(KeyError, match="no tensor 'hin'"):
        ff.load_factors(p)


# -- solving from factors ----------------------------------------------------------------------

def test_quantize_from_factor_file_matches_quantize_layer(tmp_path):
    rng = np.random.default_rng(6)
    m, n = 40, 24
    W = rng.standard_normal((m, n))
    Hi, Ho = _spd(rng, n), _spd(rng, m)
    p = tmp_path / "f.safetensors"
    ff.save_factors(p, Hi, Ho)
    a = ff.quantize_from_factors(W, p, bits=3, tile=8)
    b = bakron.quantize_layer(W, Hi, Ho, bits=3, tile=8)
    assert np.array_equal(a.values, b.values)
    assert a.proxy_error == b.proxy_error
    with pytest.raises(ValueError, match="columns"):
        ff.quantize_from_factors(W[:, :10], p, bits=3)


@pytest.mark.parametrize("tile", [1, 8, (4, 8)])
def test_diagonal_h_out_fast_path(tile):
    rng = np.random.default_rng(7)
    m, n = 48, 32
    W = rng.standard_normal((m, n))
    Hi = _spd(rng, n)
    d = rng.uniform(0.1, 3.0, m)
    d[5] = 0.0  # a dead output channel
    fast = ff.quantize_layer_diag_out(W, Hi, d, bits=3, tile=tile)
    dense = bakron.quantize_layer(W, Hi, np.diag(d), bits=3, tile=tile)
    assert np.array_equal(fast.values, dense.values)
    assert np.array_equal(fast.codes, dense.codes)
    assert fast.proxy_error == pytest.approx(dense.proxy_error, rel=1e-12)
    assert fast.rtn_proxy_error == pytest.approx(dense.rtn_proxy_error, rel=1e-12)
    assert fast.proxy_error_one_sided == pytest.approx(dense.proxy_error_one_sided, rel=1e-12)
    assert fast.damp_out == dense.damp_out == 0.01
    assert fast.factor_out.A is None and fast.factor_out.D.shape == (m,)
    # the dense path's factor is the same diagonal
    assert np.allclose(np.diagonal(dense.factor_out.H), fast.factor_out.H, rtol=1e-14)


def test_diagonal_fast_path_errors():
    rng = np.random.default_rng(8)
    W, Hi = rng.standard_normal((6, 4)), _spd(rng, 4)
    with pytest.raises(ValueError, match="length 5"):
        ff.quantize_layer_diag_out(W, Hi, np.ones(5), bits=3, tile=2)
    with pytest.raises(ValueError, match="negative"):
        ff.quantize_layer_diag_out(W, Hi, -np.ones(6), bits=3, tile=2)
    with pytest.raises(ValueError, match="all zeros"):
        ff.quantize_layer_diag_out(W, Hi, np.zeros(6), bits=3, tile=2)
    with pytest.raises(ValueError, match="NaN"):
        ff.quantize_layer_diag_out(W, Hi, np.full(6, np.nan), bits=3, tile=2)
