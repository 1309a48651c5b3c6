"""Stacks of layers: every item equals its own single solve, bad stacks fail before any work."""
from __future__ import annotations

import re
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, strategies as st

import bakron
from _problems import make_quantizer, spd
from bakron.solvers import stack as stack_mod
from bakron.solvers.stack import fit_quantizers, solve_stack

try:
    from bakron.backends import numba_cpu as _nc
    HAS_NUMBA = _nc.available()
except ImportError:  # pragma: no cover - numba is a test dependency
    HAS_NUMBA = False

ENGINES = ["array_api"] + (["numba"] if HAS_NUMBA else [])
# (method, variant, base)
PATHS = [("naive", "accumulator", None), ("antidiagonal", "accumulator", None),
         ("antidiagonal", "direct", None), ("recursive", "accumulator", 1),
         ("recursive", "accumulator", 2), ("auto", "accumulator", None)]


def _factors(rng, k, size, block, kind="well"):
    """``k`` prepared factors ``A = L - I`` of ``size x size`` (stacked: (k, size, size))."""
    return np.stack([bakron.prepare_factor(spd(rng, size, kind), block).A for _ in range(k)])


def _lead(draw, stack):
    """A leading shape that broadcasts to ``stack``: the full shape, ones, or fewer axes."""
    form = draw(st.sampled_from(["full", "ones", "shared", "mixed"]))
    if form == "full":
        return stack
    if form == "ones":
        return (1,) * len(stack)
    if form == "shared":
        return ()
    return tuple(s if draw(st.booleans()) else 1 for s in stack)


@st.composite
def stacks(draw, max_side=14):
    m = draw(st.integers(1, max_side))
    n = draw(st.integers(1, max_side))
    stack = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)), m=m, n=n, stack=stack,
        tx=draw(st.integers(1, min(m, 5))), ty=draw(st.integers(1, min(n, 5))),
        w_lead=draw(st.sampled_from(["full", "ones"])),
        in_lead=_lead(draw, stack), out_lead=_lead(draw, stack),
        two_sided=draw(st.booleans()), kind=draw(st.sampled_from(["well", "ill", "rank"])),
        bits=draw(st.integers(2, 8)), symmetric=draw(st.booleans()),
        granularity=draw(st.sampled_from(["tensor", "row", "group"])),
        group_size=draw(st.integers(1, n)), per_item=draw(st.booleans()),
        path=draw(st.sampled_from(PATHS)), engine=draw(st.sampled_from(ENGINES)),
        workers=draw(st.sampled_from([1, 2])),
    )


def _build(c, dtype=np.float64):
    rng = np.random.default_rng(c["seed"])
    m, n, stack = c["m"], c["n"], c["stack"]
    w_shape = stack if c["w_lead"] == "full" else (1,) * len(stack)
    W = rng.standard_normal((*w_shape, m, n)).astype(dtype)
    k_in = int(np.prod(c["in_lead"], dtype=np.int64))
    A_in = _factors(rng, k_in, n, c["ty"], c["kind"]).reshape(*c["in_lead"], n, n).astype(dtype)
    A_out = None
    if c["two_sided"]:
        k_out = int(np.prod(c["out_lead"], dtype=np.int64))
        A_out = _factors(rng, k_out, m, c["tx"], c["kind"]).reshape(
            *c["out_lead"], m, m).astype(dtype)
    leads = [w_shape, c["in_lead"]] + ([c["out_lead"]] if c["two_sided"] else [])
    c["expected"] = np.broadcast_shapes(*leads)  # the stack shape the solve must report
    Wb = np.broadcast_to(W, (*c["expected"], m, n)).reshape(-1, m, n)
    if c["per_item"]:
        q = [make_quantizer(None, Wb[i], c["bits"], c["symmetric"], c["granularity"],
                            c["group_size"]) for i in range(Wb.shape[0])]
    else:
        q = make_quantizer(None, Wb[0], c["bits"], c["symmetric"], c["granularity"],
                           c["group_size"])
    return W, A_out, A_in, q


def _items(a, stack, r, cdim):
    """The B items of ``a`` broadcast to ``stack`` (2-D each)."""
    return np.broadcast_to(a, (*stack, r, cdim)).reshape(-1, r, cdim)


def _check_items(c, W, A_out, A_in, q, res, *, tile):
    m, n, stack = c["m"], c["n"], c["expected"]
    method, variant, base = c["path"]
    assert res.values.shape == (*stack, m, n)
    assert res.codes.shape == (*stack, m, n)
    Ws, Is = _items(W, stack, m, n), _items(A_in, stack, n, n)
    Os = None if A_out is None else _items(A_out, stack, m, m)
    vals = res.values.reshape(-1, m, n)
    codes = res.codes.reshape(-1, m, n)
    for i in range(Ws.shape[0]):
        qi = q[i] if isinstance(q, list) else q
        one = bakron.solve(np.ascontiguousarray(Ws[i]), None if Os is None else Os[i], Is[i],
                           qi, tile=tile, method=method, variant=variant, base=base,
                           engine=c["engine"])
        np.testing.assert_array_equal(vals[i], one.values, err_msg=f"item {i}")
        np.testing.assert_array_equal(codes[i], one.codes, err_msg=f"item {i}")
        assert one.engine in res.engine.split(",")


def _refused(c, W, A_out, A_in, q, tile):
    """The error of the single solve of item 0 when its engine refuses the method (then the
    stack must refuse it the same way, before any work), else ``None``."""
    method, variant, base = c["path"]
    first = (W.reshape(-1, *W.shape[-2:])[0], None if A_out is None else
             A_out.reshape(-1, *A_out.shape[-2:])[0], A_in.reshape(-1, *A_in.shape[-2:])[0],
             q[0] if isinstance(q, list) else q)
    try:
        bakron.solve(*first, tile=tile, method=method, variant=variant, base=base,
                     engine=c["engine"])
    except ValueError as e:
        if "not available on engine" in str(e):
            return e
        raise
    return None


@pytest.mark.slow   # many random stacks through every engine and path
@given(stacks())
def test_every_item_equals_its_single_solve_float64(c):
    W, A_out, A_in, q = _build(c)
    copies = [None if a is None else a.copy() for a in (W, A_out, A_in)]
    method, variant, base = c["path"]
    tile = (c["tx"], c["ty"])
    refused = _refused(c, W, A_out, A_in, q, tile)
    if refused is not None:
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            bakron.solve(W, A_out, A_in, q, tile=tile, method=method, variant=variant,
                         base=base, engine=c["engine"])
        return
    res = bakron.solve(W, A_out, A_in, q, tile=tile, method=method, variant=variant,
                       base=base, engine=c["engine"]) if c["workers"] == 1 else \
        solve_stack(W, A_out, A_in, q, tile=tile, method=method, variant=variant, base=base,
                    engine=c["engine"], workers=c["workers"])
    _check_items(c, W, A_out, A_in, q, res, tile=tile)
    for a, a0 in zip((W, A_out, A_in), copies):
        if a is not None:
            np.testing.assert_array_equal(a, a0)  # the caller's arrays are untouched
    info = res.info["stack"]
    assert info["items"] == int(np.prod(c["expected"]))
    assert info["shape"] == c["expected"]


@pytest.mark.slow   # many random stacks through every engine and path
@given(stacks(max_side=10))
def test_every_item_equals_its_single_solve_float32(c):
    """float32: the stack runs the same single solve per item, so it is bitwise identical
    too (not only up to near-ties)."""
    W, A_out, A_in, q = _build(c, np.float32)
    method, variant, base = c["path"]
    tile = (c["tx"], c["ty"])
    if _refused(c, W, A_out, A_in, q, tile) is not None:
        return
    res = solve_stack(W, A_out, A_in, q, tile=tile, method=method, variant=variant, base=base,
                      engine=c["engine"], workers=c["workers"])
    assert res.values.dtype == np.float32
    _check_items(c, W, A_out, A_in, q, res, tile=tile)


def _simple(B=4, m=12, n=10, t=4, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((B, m, n)).astype(dtype)
    A_in = _factors(rng, B, n, t).astype(dtype)
    A_out = _factors(rng, 1, m, t)[0].astype(dtype)
    return W, A_out, A_in


class CountingQuantizer:
    """A tile quantizer that counts its calls (to prove no work ran before an error)."""

    def __init__(self):
        self.inner = bakron.UniformQuantizer(3, 0.5)
        self.calls = 0

    def quantize(self, targets):
        self.calls += 1
        return self.inner.quantize(targets)


def test_shapes_that_do_not_broadcast():
    W, A_out, A_in = _simple(B=4)
    q = CountingQuantizer()
    with pytest.raises(ValueError, match=r"the stack shapes do not broadcast: W \(4,\), "
                                         r"A_out \(\), A_in \(3,\)"):
        bakron.solve(W, A_out, A_in[:3], q, tile=4)
    assert q.calls == 0


def test_per_item_quantizer_of_the_wrong_length():
    W, A_out, A_in = _simple(B=4)
    qs = [CountingQuantizer() for _ in range(3)]
    with pytest.raises(ValueError, match="quantizer is a sequence of 3 quantizers but the "
                                         "stack has 4 items"):
        bakron.solve(W, A_out, A_in, qs, tile=4)
    assert all(q.calls == 0 for q in qs)


def test_per_item_quantizer_that_is_not_one():
    W, A_out, A_in = _simple(B=2)
    with pytest.raises(TypeError, match=r"quantizer\[1\] must have a method quantize"):
        bakron.solve(W, A_out, A_in, [CountingQuantizer(), "2-bit"], tile=4)


def test_per_item_scale_of_the_wrong_shape_names_the_item():
    W, A_out, A_in = _simple(B=3)
    qs = fit_quantizers(W, 3)
    qs[2] = bakron.UniformQuantizer(3, np.ones(W.shape[1] + 1))
    with pytest.raises(ValueError, match="quantizer for item 2: scale has 13 rows but W has "
                                         "12 rows"):
        bakron.solve(W, A_out, A_in, qs, tile=4)


def test_factor_of_an_integer_dtype():
    W, A_out, A_in = _simple(B=2)
    with pytest.raises(TypeError, match="A_in has dtype int64; a factor must be float32 or "
                                        "float64"):
        bakron.solve(W, A_out, A_in.astype(np.int64), CountingQuantizer(), tile=4)


def test_weights_of_an_integer_dtype():
    W, A_out, A_in = _simple(B=2)
    with pytest.raises(TypeError, match="W must be float32 or float64, got dtype int32"):
        bakron.solve(W.astype(np.int32), A_out, A_in, CountingQuantizer(), tile=4)


def test_mixed_array_libraries():
    strict = pytest.importorskip("array_api_strict")
    W, A_out, A_in = _simple(B=2)
    with pytest.raises(TypeError, match="W, A_out and A_in must be arrays of one array "
                                        "library on one device"):
        bakron.solve(W, A_out, strict.asarray(A_in), CountingQuantizer(), tile=4)


def test_mixed_devices():
    strict = pytest.importorskip("array_api_strict")
    W, A_out, A_in = _simple(B=2)
    d1 = strict.Device("device1")
    with pytest.raises(ValueError, match="A_in is on device .*device1.* but W is on device "
                                         ".*CPU_DEVICE.*; move every array of a stack to one "
                                         "device"):
        bakron.solve(strict.asarray(W), strict.asarray(A_out), strict.asarray(A_in, device=d1),
                     CountingQuantizer(), tile=4)


def test_bad_factor_item_fails_before_any_item_is_solved():
    W, A_out, A_in = _simple(B=4)
    A_in = A_in.copy()
    A_in[3, 0, 5] = 1.0  # above the diagonal in item 3 only
    q = CountingQuantizer()
    with pytest.raises(ValueError, match=r"A_in\[3\] \(flattened stack\) must be strictly "
                                         r"block-lower-triangular"):
        bakron.solve(W, A_out, A_in, q, tile=4)
    assert q.calls == 0


def test_nan_and_bad_tile_fail_before_any_work():
    W, A_out, A_in = _simple(B=3)
    q = CountingQuantizer()
    Wn = W.copy()
    Wn[2, 1, 1] = np.nan
    with pytest.raises(ValueError, match="W contains 1 NaN or Inf entry"):
        bakron.solve(Wn, A_out, A_in, q, tile=4)
    with pytest.raises(ValueError, match="tile .* is larger than the matrix"):
        bakron.solve(W, A_out, A_in, q, tile=40)
    with pytest.raises(ValueError, match="A_in has shape .* but W has 10 columns"):
        bakron.solve(W, A_out, A_in[:, :8, :8], q, tile=4)
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        solve_stack(W, A_out, A_in, q, tile=4, workers=0)
    assert q.calls == 0


def test_engine_that_cannot_run_fails_before_any_work():
    W, A_out, A_in = _simple(B=3)
    q = CountingQuantizer()
    with pytest.raises(ValueError, match="engine='numba' does not support this problem"):
        bakron.solve(W, A_out, A_in, q, tile=4, engine="numba")
    with pytest.raises(ValueError, match="method='wavefront'"):
        bakron.solve(W, A_out, A_in, q, tile=4, method="wavefront", engine="array_api")
    assert q.calls == 0


def test_shared_and_stacked_factors_broadcast_and_targets():
    """A 2-D W with a stacked A_in is a stack; ``return_targets`` stacks the targets."""
    W, A_out, A_in = _simple(B=3)
    q = bakron.UniformQuantizer(3, 0.5)
    res = bakron.solve(W[0], A_out, A_in, q, tile=4, return_targets=True)
    assert res.values.shape == (3, 12, 10) and res.targets.shape == (3, 12, 10)
    for i in range(3):
        one = bakron.solve(W[0], A_out, A_in[i], q, tile=4, return_targets=True)
        np.testing.assert_array_equal(res.values[i], one.values)
        np.testing.assert_array_equal(res.targets[i], one.targets)


def test_float32_weights_with_float64_factors_cast_like_the_single_solve():
    W, A_out, A_in = _simple(B=3, dtype=np.float64)
    W32 = W.astype(np.float32)
    q = bakron.UniformQuantizer(2, 0.7)
    res = bakron.solve(W32, A_out, A_in, q, tile=4)
    assert res.values.dtype == np.float32
    for i in range(3):
        one = bakron.solve(W32[i], A_out, A_in[i], q, tile=4)
        np.testing.assert_array_equal(res.values[i], one.values)


def test_chunks_when_the_budget_is_small():
    W, A_out, A_in = _simple(B=5, m=16, n=16)
    q = bakron.UniformQuantizer(3, 0.5)
    item_bytes = stack_mod.ITEM_WORK_MN * 16 * 16 * 8
    res = solve_stack(W, A_out, A_in, q, tile=4, max_bytes=2 * item_bytes)
    info = res.info["stack"]
    assert (info["chunk_items"], info["chunks"]) == (2, 3)
    ref = solve_stack(W, A_out, A_in, q, tile=4)
    assert ref.info["stack"]["chunks"] == 1
    np.testing.assert_array_equal(res.values, ref.values)
    np.testing.assert_array_equal(res.codes, ref.codes)


def test_strict_namespace_stack(xp):
    W, A_out, A_in = _simple(B=3)
    q = bakron.UniformQuantizer(3, 0.5)
    res = bakron.solve(xp.asarray(W), xp.asarray(A_out), xp.asarray(A_in), q, tile=4,
                       engine="array_api")
    assert tuple(res.values.shape) == (3, 12, 10)
    ref = bakron.solve(W, A_out, A_in, q, tile=4, engine="array_api")
    np.testing.assert_array_equal(bakron._xp.to_numpy(res.values), ref.values)


def test_quantizers_that_disagree_on_codes():
    class NoCodes:
        def quantize(self, targets):
            return bakron.UniformQuantizer(3, 0.5).quantize(targets)[0], None

    W, A_out, A_in = _simple(B=2)
    with pytest.raises(TypeError, match="the quantizers of the stack disagree"):
        bakron.solve(W, A_out, A_in, [CountingQuantizer(), NoCodes()], tile=4,
                     engine="array_api")
    res = bakron.solve(W, A_out, A_in, [NoCodes(), NoCodes()], tile=4, engine="array_api")
    assert res.codes is None and res.values.shape == W.shape


def test_empty_stack():
    W, A_out, A_in = _simple(B=2)
    res = bakron.solve(W[:0], A_out, A_in[:1], bakron.UniformQuantizer(3, 0.5), tile=4)
    assert res.values.shape == (0, 12, 10) and res.info["stack"]["items"] == 0


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not available")
def test_engine_solve_stack_hook_is_preferred(monkeypatch):
    """An engine whose capability table declares ``solve_stack`` gets whole chunks (an
    undeclared one is not called); ``None`` declines to the items."""
    W, A_out, A_in = _simple(B=5, m=16, n=16)
    q = bakron.UniformQuantizer(3, 0.5)
    seen = []

    def solve_stack_hook(chunk):
        seen.append((chunk.start, chunk.stop))
        if chunk.start == 4:
            return None  # decline the last chunk
        infos = []
        for i in range(chunk.start, chunk.stop):
            W_i, A_out_i, A_in_i, q_i = chunk.item(i)
            r = bakron.solve(W_i, A_out_i, A_in_i, q_i, tile=chunk.tile, engine="numba")
            chunk.values[i, ...] = r.values
            if chunk.codes is None:
                chunk.codes = np.zeros(chunk.values.shape, dtype=r.codes.dtype)
            chunk.codes[i, ...] = r.codes
            infos.append(dict(r.info, method=r.method, engine=r.engine))
        return infos

    import dataclasses

    from bakron.solvers import engines

    monkeypatch.setattr(_nc, "solve_stack", solve_stack_hook, raising=False)
    item_bytes = stack_mod.ITEM_WORK_MN * 16 * 16 * 8
    # a hook the capability table does not declare is not called
    res = solve_stack(W, A_out, A_in, q, tile=4, engine="numba", max_bytes=2 * item_bytes)
    assert seen == [] and res.info["stack"]["path"] == "items one by one"
    caps = _nc.CAPABILITIES
    monkeypatch.setattr(_nc, "CAPABILITIES", dataclasses.replace(
        caps, hooks=caps.hooks | {engines.SOLVE_STACK}))
    res = solve_stack(W, A_out, A_in, q, tile=4, engine="numba", max_bytes=2 * item_bytes)
    assert seen == [(0, 2), (2, 4), (4, 5)]
    assert res.info["stack"]["path"] == "engine solve_stack, items one by one"
    monkeypatch.setattr(_nc, "CAPABILITIES", caps)
    monkeypatch.delattr(_nc, "solve_stack")
    ref = solve_stack(W, A_out, A_in, q, tile=4, engine="numba")
    np.testing.assert_array_equal(res.values, ref.values)
    np.testing.assert_array_equal(res.codes, ref.codes)


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not available")
def test_extra_memory_within_four_b_m_n():
    """Everything the stack allocates (outputs included) stays below 4 B m n elements."""
    B, m, n = 12, 96, 96
    W, A_out, A_in = _simple(B=B, m=m, n=n, t=16)
    q = fit_quantizers(W, 2)
    solve_stack(W[:1], A_out, A_in[:1], q[:1], tile=16, engine="numba")  # compile, warm
    for workers in (1, 2):
        tracemalloc.start()
        res = solve_stack(W, A_out, A_in, q, tile=16, engine="numba", workers=workers)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert res.info["stack"]["workers"] == workers
        assert peak <= 4 * B * m * n * 8, (workers, peak / (B * m * n * 8))


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not available")
def test_items_are_checked_once_by_the_stack(monkeypatch):
    """The stack checks every factor itself (before any work) and hands the items to the
    engine without the single solve's per-item checks."""
    import bakron.solvers._execute as solvers

    W, A_out, A_in = _simple(B=6, m=16, n=16)
    A_in[2, 0, 9] = 0.5            # item 2 breaks the structure: the stack's own check finds it
    calls = []
    real = solvers._check_strictly_lower
    monkeypatch.setattr(solvers, "_check_strictly_lower",
                        lambda *a: calls.append(a[-1]) or real(*a))
    with pytest.raises(ValueError, match=r"A_in\[2\] \(flattened stack\)"):
        bakron.solve(W, A_out, A_in, bakron.UniformQuantizer(3, 0.5), tile=4, engine="numba")
    assert calls == ["A_in[2] (flattened stack)"]
    A_in[2, 0, 9] = 0.0
    calls.clear()
    res = bakron.solve(W, A_out, A_in, bakron.UniformQuantizer(3, 0.5), tile=4, engine="numba")
    assert calls == [] and res.engine == "numba"


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not available")
def test_stack_checks_in_several_passes_name_the_bad_item(monkeypatch):
    """The stack-wide checks take a few matrices per pass and look at the passes' results
    once: a bad item in a later pass is still found and named."""
    import bakron.solvers.stack as st

    monkeypatch.setattr(st, "_PASS_ELEMENTS", 2 * 16 * 16)  # two 16 x 16 matrices a pass
    assert st._pass_items(np, 16, 16) == 2
    W, A_out, A_in = _simple(B=7, m=16, n=16)
    q = bakron.UniformQuantizer(3, 0.5)
    A_in[5, 1, 12] = 0.25          # pass 3 of 4
    with pytest.raises(ValueError, match=r"A_in\[5\] \(flattened stack\)"):
        bakron.solve(W, A_out, A_in, q, tile=4, engine="numba")
    A_in[5, 1, 12] = 0.0
    W[6, 3, 3] = np.nan            # the last pass, a single matrix
    with pytest.raises(ValueError, match=r"W contains 1 NaN or Inf entry"):
        bakron.solve(W, A_out, A_in, q, tile=4, engine="numba")
    W[6, 3, 3] = 0.0
    assert bakron.solve(W, A_out, A_in, q, tile=4, engine="numba").values.shape == (7, 16, 16)


# -- big-endian arrays and a shared Factor (as the single-layer solve takes them) -----------------

def test_big_endian_arrays_are_converted_like_the_single_solve():
    W, A_out, A_in = _simple(B=3)
    q = bakron.UniformQuantizer(3, 0.5)
    want = bakron.solve(W, A_out, A_in, q, tile=4).values
    be = [a.astype(a.dtype.newbyteorder(">")) for a in (W, A_out, A_in)]
    copies = [a.copy() for a in be]
    got = bakron.solve(*be, q, tile=4)
    np.testing.assert_array_equal(got.values, want)
    for a, c in zip(be, copies):   # the caller's arrays are untouched, still big-endian
        assert a.dtype.byteorder == ">" and np.array_equal(a, c)
    for i in range(3):   # and each item equals the single solve of its big-endian W
        np.testing.assert_array_equal(
            got.values[i], bakron.solve(be[0][i], be[1], be[2][i], q, tile=4).values)


def test_a_factor_object_is_shared_by_every_item():
    rng = np.random.default_rng(1)
    W = rng.standard_normal((3, 12, 10))
    H_in, H_out = spd(rng, 10), spd(rng, 12)
    f_in, f_out = bakron.prepare_factor(H_in, 4), bakron.prepare_factor(H_out, 4)
    q = bakron.UniformQuantizer(3, 0.5)
    res = bakron.solve(W, f_out, f_in, q, tile=4)
    want = bakron.solve(W, f_out.A, f_in.A, q, tile=4)
    np.testing.assert_array_equal(res.values, want.values)
    for i in range(3):
        np.testing.assert_array_equal(res.values[i],
                                      bakron.solve(W[i], f_out, f_in, q, tile=4).values)
    # made for another tile: refused with the single solve's words, before any work
    cq = CountingQuantizer()
    with pytest.raises(ValueError, match=r"A_in was prepared with block size 4 but the tile "
                                         r"needs 5; prepare it with prepare_factor\(H, 5\)"):
        bakron.solve(W, None, f_in, cq, tile=5)
    with pytest.raises(ValueError, match=r"A_in .*block size"):   # (the single solve's)
        bakron.solve(W[0], None, f_in, cq, tile=5)
    assert cq.calls == 0
