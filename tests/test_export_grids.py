"""The llama.cpp block grids against the gguf package's own quantize/dequantize."""
import numpy as np
import pytest

import bakron
from bakron.export import Q4_0Grid, Q4_1Grid, Q8_0Grid, fit_block_grid, grid_for_format

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

FORMATS = ["Q8_0", "Q4_0", "Q4_1"]


def bits(a):
    """The float32 bit patterns of ``a``, with -0.0 counted as +0.0 (a negative Q4_0 scale
    times a zero code gives -0.0 in gguf's arithmetic and +0.0 in ours: the same number)."""
    return (np.asarray(a, np.float32) + np.float32(0)).view(np.uint32)


def qtype(fmt):
    return getattr(gguf.GGMLQuantizationType, fmt)


def weights(seed=0, m=12, n=256):
    """Random rows of varied magnitude, plus blocks with exact ties, a positive largest
    entry, a negative largest entry and a constant block."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((m, n)).astype(np.float32)
    W *= np.exp(rng.uniform(-6, 2, size=(m, 1))).astype(np.float32)
    W[0, :32] = np.arange(32, dtype=np.float32) - 15.5          # halves: ties everywhere
    W[1, :32] = np.linspace(-1, 3, 32, dtype=np.float32)         # largest entry positive
    W[1, 32:64] = np.linspace(-3, 1, 32, dtype=np.float32)       # largest entry negative
    W[2, :32] = 0.125                                            # constant block
    W[3, :32] = (np.arange(32, dtype=np.float32) - 16) * 0.5     # ties at 8.5 for Q4_0
    return W


def spd(n, seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((3 * n, n)) @ rng.standard_normal((n, n))
    return X.T @ X / (3 * n)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rtn_bytes_equal_gguf_quantize(fmt):
    W = weights()
    grid = fit_block_grid(W, fmt)
    values, codes = grid.rtn(W)
    ours = grid.to_blocks(codes)
    theirs = gguf_quantize(W, qtype(fmt))
    assert ours.dtype == np.uint8 and ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)
    # and gguf's de-quantization of those bytes is our RTN, bit for bit
    back = gguf_dequantize(ours, qtype(fmt))
    assert back.dtype == np.float32
    assert np.array_equal(bits(back), bits(values))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", [1, 2])
def test_two_sided_result_exports_losslessly(fmt, seed):
    W = weights(seed, m=24, n=128).astype(np.float64)
    grid = fit_block_grid(W, fmt)
    res = bakron.quantize_layer(W, spd(128, seed), spd(24, seed + 10), quantizer=grid, tile=8)
    W_hat = res.values
    assert not np.array_equal(W_hat, res.rtn_values)  # the solver did move some entries
    assert res.proxy_error < res.rtn_proxy_error
    codes = grid.encode(W_hat)
    assert np.array_equal(codes, np.asarray(res.codes, np.int64))
    back = gguf_dequantize(grid.to_blocks(codes), qtype(fmt))
    assert np.array_equal(bits(back), bits(W_hat))
    assert np.array_equal(back.astype(np.float64), W_hat)  # W_hat holds float32 numbers


def test_q4_0_negative_scale_convention():
    # the largest entry positive gives a negative d: the grid reaches +8|d| but only -7|d|
    W = np.zeros((1, 32), np.float32)
    W[0, 0], W[0, 1] = 8.0, -8.0
    g = Q4_0Grid.fit(W)
    assert g.d[0, 0] == -1.0
    v, c = g.rtn(W)
    assert v[0, 0] == 8.0 and v[0, 1] == -7.0
    blocks = g.to_blocks(c)
    assert np.frombuffer(blocks[0, :2].tobytes(), np.float16)[0] == -1.0
    assert np.array_equal(bits(gguf_dequantize(blocks, qtype("Q4_0"))), bits(v))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_block_is_reconstructed_as_zero(fmt):
    W = weights(3, m=4, n=64)
    W[1, :32] = 0.0
    grid = fit_block_grid(W, fmt)
    v, c = grid.rtn(W)
    blocks = grid.to_blocks(c)
    assert np.array_equal(blocks, gguf_quantize(W, qtype(fmt)))  # d = 0 there, as llama.cpp
    back = gguf_dequantize(blocks, qtype(fmt))
    assert np.all(back[1, :32] == 0.0)
    assert np.array_equal(bits(back), bits(v))


@pytest.mark.parametrize("fmt", FORMATS)
def test_solver_engines_agree(fmt):
    numba = pytest.importorskip("numba")  # noqa: F841
    W = weights(4, m=16, n=64).astype(np.float64)
    grid = fit_block_grid(W, fmt)
    H_i, H_o = spd(64, 4), spd(16, 5)
    a = bakron.quantize_layer(W, H_i, H_o, quantizer=grid, tile=8, engine="array_api")
    b = bakron.quantize_layer(W, H_i, H_o, quantizer=grid, tile=8, engine="auto")
    assert np.array_equal(a.values, b.values)


def test_float32_targets_give_float32_grid_values():
    W = weights(5, m=8, n=64)
    for fmt in FORMATS:
        grid = fit_block_grid(W, fmt)
        res = bakron.quantize_layer(W, spd(64, 1), spd(8, 2), quantizer=grid, tile=8,
                                    engine="array_api")
        assert res.values.dtype == np.float32
        back = gguf_dequantize(grid.to_blocks(grid.encode(res.values)), qtype(fmt))
        assert np.array_equal(bits(back), bits(res.values))


def test_inputs_not_modified():
    W = weights(6, m=4, n=64)
    W0 = W.copy()
    for fmt in FORMATS:
        g = fit_block_grid(W, fmt)
        g.rtn(W)
        g.encode(g.rtn(W)[0])
    assert np.array_equal(W, W0)


# -- bad input ---------------------------------------------------------------------------

def test_columns_not_a_multiple_of_the_block():
    with pytest.raises(ValueError, match="blocks of 32.*48 columns"):
        fit_block_grid(np.ones((2, 48), np.float32), "Q4_0")
    g = fit_block_grid(np.ones((2, 64), np.float32), "Q8_0")
    with pytest.raises(ValueError, match="blocks of 32"):
        g.check_shape(2, 48)


def test_scale_overflowing_float16():
    W = np.ones((1, 32), np.float32)
    W[0, 0] = 1e6
    with pytest.raises(ValueError, match="overflows float16"):
        Q4_0Grid.fit(W)
    W[0, 0] = 7e4  # Q4_1's minimum fits only when |min| <= 65504
    W[0, 1] = -7e4
    with pytest.raises(ValueError, match="minimum.*overflows float16"):
        Q4_1Grid.fit(W)


def test_nonfinite_and_unknown_format():
    W = np.ones((1, 32), np.float32)
    W[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        Q8_0Grid.fit(W)
    with pytest.raises(ValueError, match="format must be one of"):
        grid_for_format("Q5_K")


def test_encode_refuses_values_off_the_grid():
    W = weights(7, m=4, n=64)
    g = fit_block_grid(W, "Q4_1")
    W_hat = np.asarray(g.rtn(W)[0], np.float64)
    W_hat[2, 5] += 1e-3 * abs(W_hat[2, 5]) + 1e-6
    with pytest.raises(ValueError, match=r"not on this Q4_1 grid at 1 entries \(first \[2, 5\]"):
        g.encode(W_hat)


def test_scales_must_be_float16():
    with pytest.raises(ValueError, match="float16"):
        Q8_0Grid(np.full((1, 1), 0.1))
    with pytest.raises(ValueError, match="non-zero"):
        Q4_0Grid(np.zeros((1, 1)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_rtn_equals_gguf_over_many_magnitudes(fmt):
    # rows from 6e-6 to 1e3 in magnitude (fp16 scales from subnormal to large), some rows
    # shifted off zero (Q4_1's minimum far from 0), some of one sign only
    rng = np.random.default_rng(11)
    m, n = 96, 128
    W = rng.standard_normal((m, n)) * np.exp(rng.uniform(-12, 7, size=(m, 1)))
    W[::5] += 3 * np.abs(W[::5]).max(axis=1, keepdims=True)
    W[1::7] = np.abs(W[1::7])
    W = W.astype(np.float32)
    grid = fit_block_grid(W, fmt)
    values, codes = grid.rtn(W)
    blocks = grid.to_blocks(codes)
    assert np.array_equal(blocks, gguf_quantize(W, qtype(fmt)))
    assert np.array_equal(bits(gguf_dequantize(blocks, qtype(fmt))), bits(values))


def test_scale_underflowing_float16_keeps_a_grid():
    # |w| ~ 1e-6: Q8_0's d = max|w| / 127 is below half the smallest fp16 subnormal, so
    # llama.cpp stores d = 0 (every weight becomes 0); bakron stores 2**-24 and rounds onto it
    W = np.zeros((1, 32), np.float32)
    W[0, :4] = [2e-6, -1e-6, 5e-7, 0]
    g = Q8_0Grid.fit(W)
    v, c = g.rtn(W)
    ours, theirs = g.to_blocks(c), gguf_quantize(W, qtype("Q8_0"))
    assert np.frombuffer(theirs[0, :2].tobytes(), np.float16)[0] == 0
    assert not np.any(gguf_dequantize(theirs, qtype("Q8_0")))
    assert np.frombuffer(ours[0, :2].tobytes(), np.float16)[0] == np.float16(2.0 ** -24)
    back = gguf_dequantize(ours, qtype("Q8_0"))
    assert np.array_equal(back, v) and np.abs(back - W).max() <= 2.0 ** -25
    for fmt in ("Q4_0", "Q4_1"):  # and the same for the 4-bit formats
        g = fit_block_grid(W * 1e-2, fmt)
        v, c = g.rtn(W * 1e-2)
        back = gguf_dequantize(g.to_blocks(c), qtype(fmt))
        assert np.array_equal(bits(back), bits(v))


def _fp16_scales(W, bits, symmetric):
    q = bakron.UniformQuantizer.fit(W, bits, symmetric=symmetric, granularity="group",
                                    group_size=32)
    return np.asarray(q.scale, np.float32).astype(np.float16).astype(np.float64)


@pytest.mark.parametrize("bits,symmetric,fmt", [(8, True, "Q8_0"), (4, True, "Q4_0"),
                                                (4, False, "Q4_1")])
def test_uniform_quantizers_that_a_format_stores(bits, symmetric, fmt):
    from bakron.export import as_block_grid
    W = weights(8, m=16, n=64).astype(np.float64)
    s = _fp16_scales(W, bits, symmetric)
    if symmetric:
        q = bakron.UniformQuantizer(bits, s, symmetric=True, group_size=32)
    else:  # power-of-two steps keep -scale * zero in fp16
        s = 2.0 ** np.round(np.log2(s))
        z = np.random.default_rng(0).integers(0, 16, size=s.shape).astype(np.float64)
        q = bakron.UniformQuantizer(bits, s, symmetric=False, zero_point=z, group_size=32)
    res = bakron.quantize_layer(W, spd(64, 1), spd(16, 2), quantizer=q, tile=8)
    grid = as_block_grid(q)
    assert grid.format == fmt
    back = gguf_dequantize(grid.to_blocks(grid.encode(res.values)), qtype(fmt))
    assert np.array_equal(back.astype(np.float64), res.values)


def test_uniform_quantizers_that_no_format_stores():
    from bakron.export import as_block_grid
    W = weights(9, m=8, n=64).astype(np.float64)
    s = _fp16_scales(W, 4, True)
    cases = [
        (bakron.UniformQuantizer.fit(W, 4), None, "per 32 inputs, this grid has row scales"),
        (bakron.UniformQuantizer(4, s[:, :1].repeat(1, 1), symmetric=True, group_size=64),
         None, "group_size 64"),
        (bakron.UniformQuantizer(3, s, symmetric=True, group_size=32), None, "3-bit codes"),
        (bakron.UniformQuantizer(8, s, symmetric=False, group_size=32), None,
         "asymmetric 8-bit"),
        (bakron.UniformQuantizer(4, s * 1.0001, symmetric=True, group_size=32), None,
         "not float16"),
        (bakron.UniformQuantizer(4, s, symmetric=False, zero_point=np.full(s.shape, 5.0),
                                 group_size=32), "Q4_0", "as Q4_0: Q4_0's zero point is 8"),
        (bakron.UniformQuantizer(4, s, symmetric=True, group_size=32), "Q8_0", "as Q8_0"),
        (Q8_0Grid.fit(W), "Q4_0", "a Q8_0 grid, not Q4_0"),
        (object(), None, "not one of their grids"),
    ]
    for q, fmt, msg in cases:
        with pytest.raises(ValueError, match=msg):
            as_block_grid(q, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_grids_in_every_array_namespace(xp, fmt):
    """The grids round the same on numpy, array-api-strict and (with a GPU) cupy."""
    W = weights(12, m=16, n=64).astype(np.float64)
    grid = fit_block_grid(W, fmt)
    H_i, H_o = spd(64, 3), spd(16, 4)
    ref = bakron.quantize_layer(W, H_i, H_o, quantizer=grid, tile=8, engine="array_api")
    res = bakron.quantize_layer(xp.asarray(W), xp.asarray(H_i), xp.asarray(H_o), quantizer=grid,
                                tile=8, engine="array_api")
    assert np.array_equal(_to_numpy(res.values), ref.values)
    assert np.array_equal(_to_numpy(res.rtn_values), ref.rtn_values)
    back = gguf_dequantize(grid.to_blocks(grid.encode(res.values)), qtype(fmt))
    assert np.array_equal(back.astype(np.float64), ref.values)


def _to_numpy(a):
    from bakron import _xp
    return _xp.to_numpy(a)
