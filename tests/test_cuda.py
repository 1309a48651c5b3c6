"""The cuda engine: kernels under numba-cuda's simulator (CI), and on a real GPU (``gpu``).

* ``test_simulator_suite`` runs the ``test_sim_*`` tests below in a subprocess with
  ``NUMBA_ENABLE_CUDASIM=1`` (it must be set before numba is imported), on tiny inputs; the
  subprocess starts after collection and runs beside the other tests (conftest.py).
* ``gpu``-marked tests need a CUDA device with cupy and are skipped without one: every method
  reproduces the reference cases exactly in float64, property tests against the CPU path.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import bakron
from conftest import HAS_GPU, REFERENCE_CASES

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
sim_only = pytest.mark.skipif(not SIM, reason="runs in the simulator subprocess")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")]

try:
    import numba  # noqa: F401
    import numba.cuda  # noqa: F401
    HAS_NUMBA_CUDA = True
except Exception:  # pragma: no cover - numba-cuda is a test dependency
    HAS_NUMBA_CUDA = False


def _problem(seed, m, n, tx, ty, two_sided=True, bits=2, symmetric=True, granularity="row",
             group_size=None):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((m, n))
    Xi = rng.standard_normal((n, 2 * n + 4))
    f_in = bakron.prepare_factor(Xi @ Xi.T / Xi.shape[1], ty)
    A_out = None
    if two_sided:
        Xo = rng.standard_normal((m, 2 * m + 4))
        A_out = bakron.prepare_factor(Xo @ Xo.T / Xo.shape[1], tx).A
    if granularity == "group":
        q = bakron.UniformQuantizer.fit(W, bits, symmetric=symmetric, granularity="group",
                                        group_size=group_size)
    else:
        q = bakron.UniformQuantizer.fit(W, bits, symmetric=symmetric, granularity=granularity)
    return W, A_out, f_in.A, q


def _cuda(W, A_out, A_in, q, tile, method, base=None, **kw):
    """A solve on the cuda engine through the public entry point."""
    r = bakron.solve(W, A_out, A_in, q, tile=tile, method=method, base=base, engine="cuda",
                     **kw)
    assert r.engine == "cuda" and r.method == method
    return r


def _ref(W, A_out, A_in, q, tile):
    return bakron.solve(W, A_out, A_in, q, tile=tile, method="antidiagonal",
                        engine="array_api", return_targets=True)


# ------------------------------------------------------------------------------------------
# simulator (CI): the same kernels and schedules on numpy arrays
# ------------------------------------------------------------------------------------------

# the number of test_sim_ cases (parametrizations included): the parent requires exactly these
# many passes and no skip, so that a test that stops running cannot go unnoticed; adding or
# removing a simulator case updates it
SIM_CASES = 56


@pytest.mark.slow
@pytest.mark.skipif(SIM or not HAS_NUMBA_CUDA, reason="parent of the simulator run")
def test_simulator_suite(simulator_run):
    """The ``test_sim_*`` tests below in a child pytest with ``NUMBA_ENABLE_CUDASIM=1``
    (conftest.py starts it right after collection, beside the rest of the suite): every case
    passes, none is skipped, and every ``test_sim_`` function ran."""
    import xml.etree.ElementTree as ET

    # a few minutes on the 2-core CI machine (it starts after collection); the limit leaves
    # room for a loaded machine
    rc, tail = simulator_run.wait(timeout=1200)
    assert rc == 0, tail
    cases = ET.parse(simulator_run.junit).getroot().iter("testcase")
    outcome = {}
    for c in cases:
        bad = [e.tag for e in c if e.tag in ("failure", "error", "skipped")]
        outcome[c.get("name")] = bad[0] if bad else "passed"
    passed = sorted(n for n, o in outcome.items() if o == "passed")
    assert len(outcome) == len(passed) == SIM_CASES, (
        f"{len(passed)} of {len(outcome)} simulator cases passed, want {SIM_CASES}: "
        f"{sorted((n, o) for n, o in outcome.items() if o != 'passed')}\n{tail}")
    functions = {n for n in globals() if n.startswith("test_sim_")}
    assert {n.split("[")[0] for n in passed} == functions, tail


@sim_only
def test_sim_engine_available_and_capabilities():
    from bakron.solvers import engines, registry
    from bakron.solvers._problem import Problem
    import array_api_compat.numpy as xnp
    mod = registry.load("cuda")
    assert mod is not None and mod.available() and isinstance(mod, engines.Engine)
    caps = mod.CAPABILITIES
    W, AO, AI, q = _problem(0, 8, 6, 2, 2)
    assert caps.refusal(Problem(xnp, W, AO, AI, q, (2, 2))) is None
    assert "dtype" in caps.refusal(Problem(xnp, W.astype(np.float16), AO, AI, q, (2, 2)))

    class Tile:
        def quantize(self, t):
            return t, None
    assert "quantizer" in caps.refusal(Problem(xnp, W, AO, AI, Tile(), (2, 2)))
    big = np.zeros((80, 80))
    assert "tile" in caps.refusal(Problem(xnp, big, None, big, q, (65, 1)))
    assert caps.runs("wavefront", "accumulator") and not caps.runs("antidiagonal", "direct")
    with pytest.raises(ValueError, match="variant='direct' is not available on engine 'cuda'"):
        bakron.solve(W, AO, AI, q, tile=2, method="antidiagonal", variant="direct",
                     engine="cuda")
    r = bakron.solve(W, AO, AI, q, tile=2, method="antidiagonal", variant="direct")
    assert r.engine != "cuda"  # auto: another engine runs what cuda's table lacks


@pytest.fixture(params=["running", "chain"])
def step(request, monkeypatch):
    """Both tile steps of the kernel (``CudaOptions.step``, here through the variable that
    sets its default; ``auto`` picks running sums only for blocks longer than one K-chunk,
    which the simulator's tiny problems never have)."""
    monkeypatch.setenv("BAKRON_CUDA_STEP", request.param)
    assert bakron.CudaOptions.defaults().step == request.param
    return request.param


@sim_only
def test_sim_step_option_is_checked(monkeypatch):
    """An unknown ``BAKRON_CUDA_STEP`` (or ``CudaOptions.step``) is a named error, not a
    silent choice of step."""
    monkeypatch.setenv("BAKRON_CUDA_STEP", "fast")
    W, AO, AI, q = _problem(0, 8, 6, 2, 2)
    with pytest.raises(ValueError, match="BAKRON_CUDA_STEP .* must be 'auto', 'running' or"):
        bakron.solve(W, AO, AI, q, tile=2, method="antidiagonal", engine="cuda")
    monkeypatch.delenv("BAKRON_CUDA_STEP")
    with pytest.raises(ValueError, match="CudaOptions.step must be 'auto', 'running' or"):
        bakron.CudaOptions(step="fast")


@sim_only
def test_sim_per_thread_option_is_checked(monkeypatch):
    """A bad ``BAKRON_CUDA_PER_THREAD`` (or ``CudaOptions.per_thread``) is a named error; 0
    picks 2 elements per thread for running sums and 1 for whole sums."""
    from bakron.backends import numba_cuda
    o = bakron.CudaOptions()
    assert (numba_cuda.per_thread(o, True), numba_cuda.per_thread(o, False)) == (2, 1)
    W, AO, AI, q = _problem(0, 8, 6, 2, 2)
    for bad in ("-1", "two"):
        monkeypatch.setenv("BAKRON_CUDA_PER_THREAD", bad)
        with pytest.raises(ValueError,
                           match=r"BAKRON_CUDA_PER_THREAD .* must be an integer >= 0"):
            bakron.solve(W, AO, AI, q, tile=2, method="antidiagonal", engine="cuda")
    for bad in (-1, "2", 1.0):
        with pytest.raises(ValueError, match=r"CudaOptions.per_thread must be an integer >= 0"):
            bakron.CudaOptions(per_thread=bad)


@sim_only
@pytest.mark.parametrize("name,field,low", [("BAKRON_CUDA_MAXREG", "maxreg", 0),
                                            ("BAKRON_CUDA_STACK_BASE", "stack_base", 1)])
def test_sim_integer_options_are_checked(monkeypatch, name, field, low):
    """The variables that set the integer options' defaults: a value that is not an
    integer, or is too small, is an error naming the variable (and the field)."""
    monkeypatch.setenv(name, "12")
    assert getattr(bakron.CudaOptions.defaults(), field) == 12
    monkeypatch.delenv(name)
    assert getattr(bakron.CudaOptions.defaults(), field) == \
        getattr(bakron.CudaOptions(), field)
    for bad in ("x", str(low - 1)):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=rf"{name} \(CudaOptions.{field}\) must be an "
                                             rf"integer >= {low}"):
            bakron.CudaOptions.defaults()


@sim_only
@pytest.mark.parametrize("step_name,per", [("running", 1), ("running", 4), ("chain", 2)])
def test_sim_elements_per_thread_keep_results_exact(ref_case, monkeypatch, step_name, per):
    """Fewer threads per tile (each holding ``per`` of its elements) give the reference
    case's result exactly, for both steps (the defaults, 2 and 1, run in the tests above)."""
    from bakron.backends import _cuda_kernels, numba_cuda
    opts = bakron.CudaOptions(step=step_name, per_thread=per)
    assert numba_cuda.kernel_variant("float64", 16, 16, False, step_name == "running",
                                     opts=opts)[1] == \
        _cuda_kernels.threads_for(16, 16, per) == 256 // per
    path = [p for p in REFERENCE_CASES if p.endswith("pub_48x80_t16_b4.npz")][0]
    d = ref_case(path)
    q = bakron.UniformQuantizer(int(d["bits"]), float(d["scale"]))
    r = _cuda(d["W"], d["L_out"], d["L_in"], q, (16, 16), "antidiagonal", None, options=opts)
    np.testing.assert_array_equal(r.values, d["hatW"])


@sim_only
@pytest.mark.parametrize("two", [True, False])
def test_sim_step_items_are_the_tiles_that_receive(two):
    """The kernel's item enumeration (``_step_shape``, ``_item_tile``) against its definition:
    step 0 visits every tile; a later step visits, once each, the tiles not yet rounded that
    receive a contribution from the tiles rounded at the step before (two-sided: from below
    in their column or from the right in their row; one-sided: from the right), and those
    include every tile the step rounds."""
    from bakron.backends import _cuda_kernels as k
    shapes = [(Mb, Nb) for Mb in range(1, 7) for Nb in range(1, 7)]
    for Mb, Nb in shapes + [(16, 16), (31, 9), (9, 40), (48, 48)]:
        steps = Mb + Nb - 1 if two else Nb
        for g in range(steps + 1):
            cnt, s, rows, a_lo, b_lo = k._step_shape(Mb, Nb, g, two, True)
            got = [tuple(k._item_tile(Nb, s, rows, a_lo, b_lo, r, two, True))
                   for r in range(cnt)]
            tiles = [(a, b) for a in range(Mb) for b in range(Nb)]
            if g == steps:
                want = []
            elif g == 0:
                want = tiles
            elif two:
                want = [(a, b) for a, b in tiles if a + b <= s
                        and (s + 1 - b < Mb or s + 1 - a < Nb)]
            else:
                want = [(a, b) for a, b in tiles if b <= s]
            assert len(got) == len(set(got)) == cnt, (Mb, Nb, g)
            assert set(got) == set(want), (Mb, Nb, g, got, want)
            rounded = [(a, b) for a, b in tiles if (a + b if two else b) == s]
            assert set(rounded) <= set(got), (Mb, Nb, g)
            # without running sums a step's items are exactly the tiles it rounds
            cnt, s, rows, a_lo, b_lo = k._step_shape(Mb, Nb, g, two, False)
            got = [tuple(k._item_tile(Nb, s, rows, a_lo, b_lo, r, two, False))
                   for r in range(cnt)]
            assert sorted(got) == sorted(rounded), (Mb, Nb, g)


@sim_only
@pytest.mark.parametrize("name", ["pub_32x48_t16_b2", "pub_48x80_t16_b4"])
@pytest.mark.parametrize("method,base", [("antidiagonal", None), ("wavefront", 1),
                                         ("recursive", 2)])
def test_sim_reference_cases_exact(ref_case, name, method, base, step):
    path = [p for p in REFERENCE_CASES if p.endswith(name + ".npz")][0]
    d = ref_case(path)
    tile = tuple(int(t) for t in d["tile"])
    q = bakron.UniformQuantizer(int(d["bits"]), float(d["scale"]))
    r = _cuda(d["W"], d["L_out"], d["L_in"], q, tile, method, base)
    assert r.info["quantizer_calls"] == 0 and r.info["launches"] >= 1
    np.testing.assert_array_equal(r.values, d["hatW"])
    np.testing.assert_array_equal(r.codes.astype(np.float64) * float(d["scale"]), d["hatW"])


@sim_only
def test_sim_solve_entry_point_and_targets():
    """bakron.solve(engine='cuda') reaches the engine; targets satisfy the loss identity."""
    W, AO, AI, q = _problem(3, 11, 13, 3, 2, granularity="group", group_size=5)
    W0 = W.copy()
    ref = _ref(W, AO, AI, q, (3, 2))
    for method in ("antidiagonal", "recursive"):
        r = bakron.solve(W, AO, AI, q, tile=(3, 2), method=method, engine="cuda", base=2,
                         return_targets=True)
        assert r.engine == "cuda" and r.method == method
        np.testing.assert_array_equal(r.values, ref.values)
        np.testing.assert_array_equal(r.codes, ref.codes)
        np.testing.assert_allclose(r.targets, ref.targets, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(W, W0)


@sim_only
@pytest.mark.parametrize("seed", range(4))
def test_sim_random_methods_match_cpu(seed, step):
    rng = np.random.default_rng(seed)
    m, n = (int(v) for v in rng.integers(5, 14, 2))
    tx, ty = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    two = seed % 2 == 0
    gran = ["tensor", "row", "group"][seed % 3]
    W, AO, AI, q = _problem(seed, m, n, tx, ty, two_sided=two, bits=int(rng.integers(2, 5)),
                            symmetric=bool(seed % 3), granularity=gran, group_size=3)
    ref = _ref(W, AO, AI, q, (tx, ty))
    for method, base in (("antidiagonal", None), ("wavefront", 1), ("wavefront", 2),
                         ("recursive", 1), ("recursive", 3)):
        r = _cuda(W, AO, AI, q, (tx, ty), method, base)
        np.testing.assert_array_equal(r.values, ref.values, err_msg=f"{method}/{base}")
        np.testing.assert_array_equal(r.codes, ref.codes, err_msg=f"{method}/{base}")


@sim_only
def test_sim_every_tile_a_leaf_with_offsets():
    """Base 1: every tile is a leaf of the recursion (each launch solves blocks whose targets
    come from offsets F alone) and every tile a coarse block of the wavefront; asymmetric
    grid. Both equal the array-API path."""
    W, AO, AI, q = _problem(7, 10, 9, 2, 2, symmetric=False)
    ref = _ref(W, AO, AI, q, (2, 2))
    for method in ("recursive", "wavefront"):
        r = _cuda(W, AO, AI, q, (2, 2), method, 1)
        np.testing.assert_array_equal(r.values, ref.values, err_msg=method)
        np.testing.assert_array_equal(r.codes, ref.codes, err_msg=method)


@sim_only
def test_sim_check_kernels_equal_the_cpu_checks(monkeypatch):
    """The GPU engine's one-kernel checks give the statistics of the numba CPU engine's
    (``factor_scan``, ``count_nonfinite``) and of the stack layer's definition
    (``stack_checks``): a factor from prepare_factor, one with entries
    on and above the diagonal, a coarser-block factor, dead channels; NaN and Inf counts in
    1-3 dimensions; the stack scan with one CTA per factor and with several (ragged)."""
    from bakron.backends import _cuda_checks, numba_cpu, numba_cuda as nc
    rng = np.random.default_rng(11)
    n, b = 22, 4  # a ragged last block
    X = rng.standard_normal((n, 2 * n))
    H = X @ X.T / n
    H[5, :] = H[:, 5] = 0.0  # a dead channel
    good = bakron.prepare_factor(H, b).A
    coarse = bakron.prepare_factor(H, 2 * b).A
    bad = good.copy()
    bad[3, 3], bad[6, 20], bad[9, 8] = 0.5, -2.0, 0.25  # diagonal, above, inside a block
    for A, dt in ((good, np.float64), (coarse, np.float64), (bad, np.float32),
                  (np.zeros((n, n)), np.float64)):
        Ad = A.astype(dt)
        got, want = nc.factor_scan(Ad, b), numba_cpu.factor_scan(Ad, b)
        assert got[0] == want[0]
        for g, w in zip(got[1:], want[1:]):
            np.testing.assert_array_equal(g, w)
    stack = np.stack([good, bad, coarse]).astype(np.float32)
    i = np.arange(n)
    forbidden = (i[None, :] >= i[:, None]) | (i[None, :] // b == i[:, None] // b)
    want = np.abs(np.where(forbidden, stack, 0)).max(axis=(1, 2))
    assert want[0] == 0 and want[1] == 2.0
    nonfinite = stack.copy()
    nonfinite[1, 4, 2], nonfinite[2, 21, 21], nonfinite[2, 0, 7] = np.nan, np.inf, -np.inf
    want_nf = np.abs(np.where(forbidden, nonfinite, 0)).max(axis=(1, 2))
    assert np.isinf(want_nf[2]) and want_nf[1] == 2.0  # the NaN is below the blocks
    for entries, cpi in ((_cuda_checks._SCAN_CTA_ENTRIES, 1), (50, 8)):  # 8 CTAs: 7 x 3 + 1 rows
        monkeypatch.setattr(_cuda_checks, "_SCAN_CTA_ENTRIES", entries)
        assert _cuda_checks._scan_layout(n)[1] == cpi
        counts, worst = nc.stack_checks({"A": stack}, {"A": b})()
        assert counts == {"A": 0}
        np.testing.assert_array_equal(worst["A"], want)
        counts, worst = nc.stack_checks({"A": nonfinite}, {"A": b})()
        assert counts == {"A": 3}
        np.testing.assert_array_equal(worst["A"], want_nf)
    for shape, dt in (((300,), np.float32), ((7, 45), np.float64), ((3, 5, 11), np.float32)):
        x = rng.standard_normal(shape).astype(dt)
        assert nc.count_nonfinite(x) == 0
        flat = x.reshape(-1)
        flat[rng.choice(flat.size, 5, replace=False)] = [np.nan, np.inf, -np.inf, np.nan, np.inf]
        assert nc.count_nonfinite(x) == 5
    assert nc.count_nonfinite(np.zeros((3, 3), dtype=np.int32)) is None
    assert nc.factor_scan(np.zeros((3, 3), dtype=np.int32), 1) is None


@pytest.mark.skipif(SIM, reason="compiles for a GPU target (outside the simulator)")
def test_check_kernels_compile_for_raw_pointers():
    """The check kernels type and lower for their raw-pointer signatures (what a GPU
    compiles; no GPU needed up to the PTX step): a kernel that, say, used an atomic on a
    pointer would fail here instead of on the device."""
    pytest.importorskip("numba_cuda")
    from numba.cuda import compiler
    from bakron.backends import _cuda_checks
    for name, source in _cuda_checks._SOURCES.items():
        for dtname in ("float32", "float64"):
            sig = _cuda_checks._signature(name, dtname)
            cres = compiler.compile_cuda(source, None, sig, cc=(9, 0))
            assert len(cres.signature.args) == len(sig), (name, dtname)


@sim_only
def test_sim_fused_input_checks_decide_as_the_array_api_checks():
    """``numba_cuda.input_checks`` (all statistics of ``bakron.solve``'s input checks, one
    read-back) counts what the array-API checks count and finds the coarse-block tile that
    ``check_factor_block`` finds: factors from prepare_factor (ragged, a dead channel, a
    finer and a coarser block), one with entries where ``L - I`` is zero, NaN and Inf."""
    from bakron import _validate
    from bakron.backends import numba_cuda as nc
    rng = np.random.default_rng(5)
    n = 22
    X = rng.standard_normal((n, 2 * n))
    H = X @ X.T / n
    H[5, :] = H[:, 5] = 0.0  # a dead channel
    W = rng.standard_normal((9, n)).astype(np.float32)
    W[2, 3], W[4, 0] = np.nan, -np.inf
    seen = set()
    for made, b, dt in ((4, 4, np.float64), (8, 4, np.float64), (8, 4, np.float32),
                        (12, 3, np.float64), (3, 3, np.float32), (2, 4, np.float64),
                        (4, 22, np.float64)):
        A = bakron.prepare_factor(H, made).A.astype(dt)
        if made == 3:
            A[1, 1], A[7, 15], A[10, 9] = 0.5, -2.0, 0.25  # diagonal, above, inside a block
        nonfinite, forbidden, coarse = nc.input_checks({"W": W, "A_in": A}, {"A_in": b})
        # a non-contiguous factor is read in C order too
        assert nc.input_checks({"W": W, "A_in": np.asfortranarray(A)},
                               {"A_in": b}) == (nonfinite, forbidden, coarse)
        assert nonfinite == {"W": 2, "A_in": 0}
        i = np.arange(n)
        zero_part = (i[None, :] >= i[:, None]) | (i[None, :] // b == i[:, None] // b)
        assert forbidden["A_in"] == np.abs(np.where(zero_part, A, 0)).max()
        if forbidden["A_in"]:
            seen.add("forbidden")
            continue
        want = None
        try:
            _validate.check_factor_block(np, A, b, "A_in")
        except ValueError as exc:
            want = str(exc)
        got = None
        try:
            _validate.check_factor_block(np, A, b, "A_in", coarse_tile=coarse["A_in"])
        except ValueError as exc:
            got = str(exc)
        assert got == want, (made, b)
        seen.add("coarse" if want else "fine")
    assert seen == {"forbidden", "coarse", "fine"}
    assert nc.input_checks({"W": np.zeros((3, 3), dtype=np.int32)}, {}) is None


@sim_only
def test_sim_fused_stack_checks_decide_as_the_passes(monkeypatch):
    """The stack layer with the GPU engine's ``stack_checks`` (every statistic of its input
    checks, launched before the host checks and read back once after them) accepts what the
    per-array passes accept and raises their errors in their order: NaN/Inf in W or a
    factor, a factor that is not ``L - I``, a stack of one; ``stack_checks`` counts as
    ``count_nonfinite`` and finds the largest entry where ``L - I`` is zero."""
    from bakron.solvers import _execute as solvers
    from bakron.backends import numba_cuda as nc
    W, AO, AI, qs = _stack(4, 4, 9, 7, 3, 1)
    W32 = W.astype(np.float32)
    nonfinite, forbidden = nc.stack_checks({"W": W32, "A_in": AI}, {"A_in": 1})()
    assert nonfinite == {"W": 0, "A_in": 0} and forbidden["A_in"].shape == (4,)
    AI_bad = AI.copy()
    AI_bad[2, 0, 5], AI_bad[3, 1, 1] = 0.5, np.inf  # above the diagonal; on it, not finite
    W_bad = W32.copy()
    W_bad[1, 2, 3] = np.nan
    nonfinite, forbidden = nc.stack_checks({"W": W_bad, "A_in": AI_bad}, {"A_in": 1})()
    assert nonfinite == {"W": 1, "A_in": nc.count_nonfinite(AI_bad)} == {"W": 1, "A_in": 1}
    # block 1: the forbidden entries are those on and above the diagonal
    np.testing.assert_array_equal(forbidden["A_in"], np.abs(np.triu(AI_bad)).max(axis=(1, 2)))
    assert nc.stack_checks({"W": W32[:0]}, {}) is None  # empty: the passes decide

    calls, order = [], []

    from bakron.solvers import engines

    class Fused:  # the GPU engine's checks, on the simulator's numpy arrays
        CAPABILITIES = engines.Capabilities(methods=("antidiagonal",),
                                            hooks=(engines.STACK_CHECKS,))

        @staticmethod
        def stack_checks(arrays, blocks):
            calls.append(sorted(arrays))
            order.append("launch")
            read = nc.stack_checks(arrays, blocks)
            return lambda: order.append("read") or read()

    from bakron.solvers import stack as stack_layer
    engine_check = stack_layer.engine_check
    monkeypatch.setattr(stack_layer, "engine_check",
                        lambda *a: order.append("engine_check") or engine_check(*a))

    def errors(fast):
        monkeypatch.setattr(solvers, "_compiled", lambda xp, engine: fast)
        out = []
        for w, ao, ai in ((W, AO, AI), (W_bad, AO, AI), (W, AO, AI_bad),
                          (W, AO, np.where(np.isinf(AI_bad), 0.0, AI_bad)),
                          (W[:1], AO[:1], AI_bad[2:3])):
            try:
                r = bakron.solve(w.astype(W.dtype), ao, ai, qs[:w.shape[0]], tile=(3, 1),
                                 engine="array_api")
                out.append(("ok", float(np.abs(r.values).sum())))
            except ValueError as exc:
                out.append(("error", str(exc)))
        return out

    fused = errors(Fused)
    assert len(calls) == 5 and calls[0] == ["A_in", "A_out", "W"]
    # the kernels start before the host checks and are read back after them
    assert order[:3] == ["launch", "engine_check", "read"], order
    assert fused == errors(None)
    assert [kind for kind, _ in fused] == ["ok", "error", "error", "error", "error"]
    assert "W contains 1 NaN" in fused[1][1] and "A_in contains 1 NaN or Inf" in fused[2][1]
    assert "A_in[2] (flattened stack)" in fused[3][1] and fused[4][1].startswith("A_in")


@sim_only
def test_sim_launch_period_of_equal_blocks(monkeypatch):
    """A launch whose blocks have one shape gets period 1 (the kernel locates an item in
    O(1)); blocks that repeat a pattern get its length; results stay those of the CPU path,
    ragged edges (no period) included."""
    from bakron.backends import numba_cuda as nc
    from bakron.backends._cuda_plans import _period
    assert _period([(4, 4)] * 6) == 1
    assert _period([(4, 4), (4, 2)] * 3) == 2
    assert _period([(4, 4), (4, 4), (4, 2)]) == 3
    assert _period([(4, 4), (4, 2), (4, 4), (4, 4)]) == 4
    assert _period([]) == 1
    seen = []
    params = nc._DeviceSolve.params

    def spy(self, nblk, nsteps, flags, period=0):
        seen.append((nblk, period))
        return params(self, nblk, nsteps, flags, period)
    monkeypatch.setattr(nc._DeviceSolve, "params", spy)
    for m, n in ((16, 16), (14, 16)):  # 8 x 8 tiles: equal blocks; 7 x 8: a ragged edge
        W, AO, AI, q = _problem(5, m, n, 2, 2)
        ref = _ref(W, AO, AI, q, (2, 2))
        for method in ("wavefront", "recursive"):
            seen.clear()
            r = _cuda(W, AO, AI, q, (2, 2), method, 2)
            np.testing.assert_array_equal(r.values, ref.values, err_msg=f"{m} {method}")
            np.testing.assert_array_equal(r.codes, ref.codes, err_msg=f"{m} {method}")
            multi = [(k, per) for k, per in seen if k > 1]
            assert multi, seen
            if m == 16:
                assert all(per == 1 for k, per in multi), seen
            else:
                assert any(per == k for k, per in multi), seen


@sim_only
@pytest.mark.parametrize("m,n", [(16, 16), (13, 15)])
def test_sim_split_gemms_leave_out_only_zeros(monkeypatch, m, n):
    """The wavefront's gathers split along K (partial products summed by a small kernel) and
    its scatters split by output rows (``CudaOptions.gather_tiles``, ``gather_split``,
    ``scatter_rows``) give the results of the unsplit GEMMs (float64: the values and codes
    of the array-API path; targets to rounding), ragged tiles and chunks included, with fewer
    multiply-adds: only products with zeros of the factors are left out."""
    from bakron.backends import numba_cuda as nc
    W, AO, AI, q = _problem(7, m, n, 2, 2)
    ref = bakron.solve(W, AO, AI, q, tile=(2, 2), engine="array_api", method="naive",
                       return_targets=True)
    o1 = bakron.CudaOptions(gather_min_side=1)  # blocks of 4 x 4 here
    macs = {}
    for name, tiles, split, rows in (("unsplit", 0, 8, 0), ("partials in 3", 512, 3, 0),
                                     ("partials and rows", 512, 8, 1), ("rows by 2", 0, 8, 2)):
        o = o1.with_(gather_tiles=tiles, gather_split=split, scatter_rows=rows)
        r = _cuda(W, AO, AI, q, (2, 2), "wavefront", 2, return_targets=True, options=o)
        np.testing.assert_array_equal(r.values, ref.values, err_msg=name)
        np.testing.assert_array_equal(r.codes, ref.codes, err_msg=name)
        np.testing.assert_allclose(r.targets, ref.targets, rtol=1e-12, atol=1e-12,
                                   err_msg=name)
        plan = nc._PLANS[("wavefront", 2, m, n, 2, 2, True, 0, True, tiles, 1, split, rows)]
        macs[name] = sum(op[2] * op[3] * op[4] * op[11] for op in plan.ops)
        partial = [op for op in plan.ops if op[9][0] == "Fp"]
        assert bool(partial) == (tiles > 0) and (plan.slices > 1) == (tiles > 0), name
        assert plan.slices <= split
        if rows:
            assert max(op[2] for op in plan.ops if op[0]) <= rows * 2 * 2  # x base x tile
    unsplit = macs.pop("unsplit")
    assert all(v < unsplit for v in macs.values()), (unsplit, macs)
    assert macs["partials and rows"] < macs["partials in 3"]
    # a stack's items split as their single solves do (the rule looks at one item), so
    # they equal them bitwise; blocks narrower than gather_min_side are not split
    Ws, AOs, AIs, qs = _stack(3, 3, m, n, 2, 2)
    res = bakron.solve(Ws, AOs, AIs, qs, tile=(2, 2), engine="cuda", method="wavefront",
                       base=2, options=o1)
    assert res.info["stack"]["path"] == "engine solve_stack"
    for i in range(3):
        one = _cuda(Ws[i], AOs[i], AIs[i], qs[i], (2, 2), "wavefront", 2, options=o1)
        np.testing.assert_array_equal(res.values[i], one.values, err_msg=f"item {i}")
        np.testing.assert_array_equal(res.codes[i], one.codes, err_msg=f"item {i}")
    assert nc._PLANS[("wavefront", 2, m, n, 2, 2, True, 0, True, 512, 1, 8, 1)].slices > 1
    _cuda(W, AO, AI, q, (2, 2), "wavefront", 2, options=o1.with_(gather_min_side=5))
    assert nc._PLANS[("wavefront", 2, m, n, 2, 2, True, 0, True, 512, 5, 8, 1)].slices == 0


@sim_only
def test_sim_float32_agrees_up_to_near_ties():
    W, AO, AI, q = _problem(11, 12, 12, 3, 3)
    W32, AO32, AI32 = (x.astype(np.float32) for x in (W, AO, AI))
    r = _cuda(W32, AO32, AI32, q, 3, "wavefront", 2)
    ref = bakron.solve(W32, AO32, AI32, q, tile=3, engine="array_api", method="antidiagonal")
    assert r.values.dtype == np.float32
    diff = np.argwhere(r.values != ref.values)
    assert len(diff) <= W.size // 20  # a flip is rare; exactness is checked in float64


# ------------------------------------------------------------------------------------------
# real GPU
# ------------------------------------------------------------------------------------------

def _cp():
    import cupy
    return cupy


@pytest.mark.parametrize("path", REFERENCE_CASES, ids=lambda p: p.rsplit("/", 1)[-1][:-4])
@pytest.mark.parametrize("method,base", [("antidiagonal", None), ("wavefront", 1),
                                         ("wavefront", 2), ("wavefront", None),
                                         ("recursive", 1), ("recursive", 2),
                                         ("recursive", None), ("auto", None)])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_gpu_reference_cases_exact(ref_case, path, method, base):
    cp = _cp()
    d = ref_case(path)
    tile = tuple(int(t) for t in d["tile"])
    q = bakron.UniformQuantizer(int(d["bits"]), float(d["scale"]))
    W, AO, AI = (cp.asarray(d[k]) for k in ("W", "L_out", "L_in"))
    if method == "auto":
        r = bakron.solve(W, AO, AI, q, tile=tile)
        assert r.engine == "cuda"
    else:
        r = _cuda(W, AO, AI, q, tile, method, base)
    assert isinstance(r.values, cp.ndarray) and r.values.dtype == cp.float64
    np.testing.assert_array_equal(cp.asnumpy(r.values), d["hatW"])
    np.testing.assert_array_equal(cp.asnumpy(r.codes).astype(np.float64) * float(d["scale"]),
                                  d["hatW"])


@st.composite
def _gpu_cases(draw):
    tx, ty = draw(st.sampled_from([(16, 16), (8, 8), (16, 8), (4, 4), (3, 5), (1, 1)]))
    m = draw(st.integers(tx, 96))
    n = draw(st.integers(ty, 96))
    return dict(seed=draw(st.integers(0, 2 ** 31 - 1)), m=m, n=n, tx=tx, ty=ty,
                two=draw(st.booleans()), bits=draw(st.integers(2, 8)),
                sym=draw(st.booleans()), gran=draw(st.sampled_from(["tensor", "row", "group"])),
                gs=draw(st.integers(1, n)), base=draw(st.integers(1, 4)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
@settings(max_examples=30, deadline=None)
@given(_gpu_cases())
def test_gpu_methods_match_cpu_float64(c):
    cp = _cp()
    W, AO, AI, q = _problem(c["seed"], c["m"], c["n"], c["tx"], c["ty"], two_sided=c["two"],
                            bits=c["bits"], symmetric=c["sym"], granularity=c["gran"],
                            group_size=c["gs"])
    ref = _ref(W, AO, AI, q, (c["tx"], c["ty"]))
    Wd = cp.asarray(W)
    AOd = None if AO is None else cp.asarray(AO)
    AId = cp.asarray(AI)
    for method in ("antidiagonal", "wavefront", "recursive"):
        r = _cuda(Wd, AOd, AId, q, (c["tx"], c["ty"]), method, c["base"],
                  return_targets=True)
        np.testing.assert_array_equal(cp.asnumpy(r.values), ref.values, err_msg=method)
        np.testing.assert_array_equal(cp.asnumpy(r.codes), ref.codes, err_msg=method)
        np.testing.assert_allclose(cp.asnumpy(r.targets), ref.targets, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(cp.asnumpy(Wd), W)  # input untouched


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_gpu_checks_run_as_kernels_and_refuse_bad_inputs(monkeypatch):
    """On cupy, ``bakron.solve`` and the stack layer check W and the factors with the GPU
    engine's fused checks (one read-back each), and refuse bad inputs with the messages of
    the CPU checks."""
    from bakron.backends import numba_cuda as nc
    cp = _cp()
    calls = []
    for name in ("count_nonfinite", "factor_scan", "input_checks", "stack_checks"):
        real = getattr(nc, name)
        monkeypatch.setattr(nc, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    W, AO, AI, q = _problem(7, 64, 48, 8, 8)
    Wd, AOd, AId = cp.asarray(W), cp.asarray(AO), cp.asarray(AI)
    r = bakron.solve(Wd, AOd, AId, q, tile=8)
    np.testing.assert_array_equal(cp.asnumpy(r.values), _ref(W, AO, AI, q, (8, 8)).values)
    # the inputs in one fused pass, the result in one count; the kernels went through the
    # direct launch path (it falls back to numba's launch, with a warning, when it fails)
    assert calls == ["input_checks", "count_nonfinite"], calls
    from bakron.backends import _cuda_launch
    assert _cuda_launch._DIRECT[0]
    Wn = Wd.copy()
    Wn[3, 4] = cp.nan
    with pytest.raises(ValueError, match="W contains 1 NaN or Inf entry"):
        bakron.solve(Wn, AOd, AId, q, tile=8)
    up = AId.copy()
    up[2, 30] = 1.0
    with pytest.raises(ValueError, match="A_in must be strictly block-lower-triangular"):
        bakron.solve(Wd, AOd, up, q, tile=8)
    coarse = bakron.prepare_factor(cp.asarray(AI @ AI.T + np.eye(48)), 16).A
    with pytest.raises(ValueError, match="coarser than the tile"):
        bakron.solve(Wd, AOd, coarse, q, tile=8)
    calls.clear()
    Ws, AIs = cp.stack([Wd, Wd, Wd]), cp.stack([AId, AId, up])
    with pytest.raises(ValueError, match=r"A_in\[2\] \(flattened stack\) must be strictly"):
        bakron.solve(Ws, AOd, AIs, [q] * 3, tile=8)
    assert calls == ["stack_checks"], calls  # every statistic of the stack in one pass
    Ws[1, 0, 0] = cp.inf
    with pytest.raises(ValueError, match="W contains 1 NaN or Inf entry"):
        bakron.solve(Ws, AOd, cp.stack([AId] * 3), [q] * 3, tile=8)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
@pytest.mark.parametrize("m,n", [(512, 768), (600, 520)])
def test_gpu_split_gemms_equal_the_reference_float64(m, n):
    """On the device, layers whose coarse blocks are large enough for the split GEMMs (blocks
    of 256, gathers as partial products, scatters by block rows; ragged blocks in the second
    shape) equal the CPU reference exactly in float64."""
    from bakron.backends import numba_cuda as nc
    cp = _cp()
    W, AO, AI, q = _problem(11, m, n, 16, 16)
    r = _cuda(cp.asarray(W), cp.asarray(AO), cp.asarray(AI), q, 16, "wavefront")
    ref = _ref(W, AO, AI, q, (16, 16))
    np.testing.assert_array_equal(cp.asnumpy(r.values), ref.values)
    np.testing.assert_array_equal(cp.asnumpy(r.codes), ref.codes)
    plans = [v for k, v in nc._PLANS.items() if k[0] == "wavefront" and k[2:4] == (m, n)]
    assert plans and plans[-1].slices > 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_gpu_caller_stream_and_device():
    """cupy in -> cupy out on the caller's device, work queued on the caller's stream."""
    cp = _cp()
    W, AO, AI, q = _problem(5, 200, 150, 16, 16)
    ref = _ref(W, AO, AI, q, (16, 16))
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        Wd, AOd, AId = cp.asarray(W), cp.asarray(AO), cp.asarray(AI)
        r = bakron.solve(Wd, AOd, AId, q, tile=16)
        s.synchronize()
        assert r.values.device.id == cp.cuda.Device().id
    assert r.engine == "cuda"
    np.testing.assert_array_equal(cp.asnumpy(r.values), ref.values)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_gpu_float32_first_difference_is_a_near_tie():
    """float32: the first difference in processing order has a target at a rounding boundary."""
    cp = _cp()
    W, AO, AI, q = _problem(9, 256, 256, 16, 16)
    W32, AO32, AI32 = (x.astype(np.float32) for x in (W, AO, AI))
    ref = bakron.solve(W32, AO32, AI32, q, tile=16, method="antidiagonal", engine="array_api",
                       return_targets=True)
    r = _cuda(cp.asarray(W32), cp.asarray(AO32), cp.asarray(AI32), q, 16, "wavefront",
              return_targets=True)
    got = cp.asnumpy(r.values)
    diff = got != ref.values
    if not diff.any():
        return
    # processing order: dominance order, bottom-right first; the naive vec order (last element
    # first) respects it, so the first difference is the largest flat index that differs
    flat = np.flatnonzero(diff.reshape(-1))[-1]
    i, j = divmod(int(flat), W.shape[1])
    s = float(q.tables(np, None, np.float32)[0][i, 0])
    t_cpu, t_gpu = float(ref.targets[i, j]), float(cp.asnumpy(r.targets)[i, j])
    assert abs(t_cpu - t_gpu) <= 1e-4 * max(1.0, abs(t_cpu))
    frac = t_cpu / s - np.floor(t_cpu / s)
    assert abs(frac - 0.5) < 1e-3, (t_cpu, t_gpu, s)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_gpu_prepare_factor_detects_cupy_nan_cholesky():
    """cupy's Cholesky returns NaNs instead of raising: prepare_factor escalates damping."""
    cp = _cp()
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 8))
    u = np.ones(64) / 8
    H = X @ X.T / 8 + np.eye(64) - 3 * np.outer(u, u)   # indefinite, positive diagonal
    with pytest.raises(bakron.NotPositiveDefiniteError):
        bakron.prepare_factor(cp.asarray(H), 16, damp=0.0, max_tries=3)
    f = bakron.prepare_factor(cp.asarray(X @ X.T), 16, damp=0.0, max_tries=30)  # rank 8
    assert f.tries > 1 and isinstance(f.A, cp.ndarray)
    assert bool(cp.all(cp.isfinite(f.A)))
    L = cp.eye(64) + f.A
    np.testing.assert_allclose(cp.asnumpy(L @ f.D @ L.T), cp.asnumpy(f.H), rtol=1e-8,
                               atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_gpu_array_api_engine_on_cupy():
    cp = _cp()
    W, AO, AI, q = _problem(2, 40, 56, 8, 8, symmetric=False, granularity="group", group_size=16)
    ref = _ref(W, AO, AI, q, (8, 8))
    for method in ("antidiagonal", "recursive", "naive"):
        r = bakron.solve(cp.asarray(W), cp.asarray(AO), cp.asarray(AI), q, tile=8,
                         method=method, engine="array_api", base=2)
        assert isinstance(r.values, cp.ndarray)
        np.testing.assert_array_equal(cp.asnumpy(r.values), ref.values)


# ------------------------------------------------------------------------------------------
# stacks: the engine's solve_stack hook (one launch over every item of a chunk)
# ------------------------------------------------------------------------------------------

def _stack(seed, B, m, n, tx, ty, *, two_sided=True, shared_in=False, shared_out=False,
           symmetric=True, granularity="row", group_size=None, dtype=np.float64):
    """B items with per-item quantizers; factors per item or shared (broadcast, 2-D)."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((B, m, n)).astype(dtype)

    def factor(s, blk):
        X = rng.standard_normal((s, 2 * s + 4))
        return bakron.prepare_factor(X @ X.T / X.shape[1], blk).A.astype(dtype)

    A_in = factor(n, ty) if shared_in else np.stack([factor(n, ty) for _ in range(B)])
    A_out = None
    if two_sided:
        A_out = factor(m, tx) if shared_out else np.stack([factor(m, tx) for _ in range(B)])
    kw = dict(symmetric=symmetric, granularity=granularity)
    if granularity == "group":
        kw["group_size"] = group_size
    return W, A_out, A_in, bakron.fit_quantizers(W, 2, **kw)


def _ns(**kw):
    """A stand-in for a ``Problem`` with the given sizes (its options: the defaults)."""
    import types
    return types.SimpleNamespace(options_for=lambda cls: cls.defaults(), **kw)


def _item(A, i):
    return None if A is None else (A if A.ndim == 2 else A[i])


def _check_items(res, W, A_out, A_in, qs, tile, *, engine="cuda", method="antidiagonal",
                 targets=False):
    """Every item of the stack result equals its own single solve bitwise (values, codes;
    targets too, except the wavefront's: its feedback GEMMs of a stack are one batched
    call over the items, whose sums may differ in the last bit from the single solve's)."""
    for i in range(W.shape[0]):
        one = bakron.solve(W[i], _item(A_out, i), _item(A_in, i), qs[i], tile=tile,
                           engine=engine, method=method, return_targets=targets)
        np.testing.assert_array_equal(res.values[i], one.values, err_msg=f"item {i}")
        np.testing.assert_array_equal(res.codes[i], one.codes, err_msg=f"item {i}")
        if targets and method == "wavefront":
            np.testing.assert_allclose(res.targets[i], one.targets, rtol=1e-12, atol=1e-12)
        elif targets:
            np.testing.assert_array_equal(res.targets[i], one.targets, err_msg=f"item {i}")


@sim_only
def test_sim_stack_one_launch_equals_items(step):
    """Two-sided, ragged tiles (9 x 7 in 2 x 3 tiles), per-item quantizers and A_out, A_in
    shared by the stack: one launch for the whole stack, every item equal to its single
    solve on the cuda engine and on the array-API engine (float64: exact)."""
    W, AO, AI, qs = _stack(1, 3, 9, 7, 2, 3, shared_in=True)
    W0, AO0, AI0 = W.copy(), AO.copy(), AI.copy()
    res = bakron.solve(W, AO, AI, qs, tile=(2, 3), engine="cuda", method="antidiagonal")
    assert res.info["stack"]["path"] == "engine solve_stack"
    assert res.info["launches"] == 1 and res.info["gemms"] == 0
    assert res.info["stack_run"].startswith("one launch for 3 items: 7 grid-synchronised")
    assert res.method == "antidiagonal" and res.engine == "cuda"
    assert res.values.shape == (3, 9, 7) and res.codes.dtype == np.int16
    _check_items(res, W, AO, AI, qs, (2, 3))
    _check_items(res, W, AO, AI, qs, (2, 3), engine="array_api")
    for a, b in ((W, W0), (AO, AO0), (AI, AI0)):
        np.testing.assert_array_equal(a, b)  # inputs untouched


@sim_only
def test_sim_stack_one_sided_asym_groups_targets(step):
    """One-sided, asymmetric per-group grids (one per item), targets recorded: equal to the
    single solves bitwise (values, codes and targets)."""
    W, AO, AI, qs = _stack(2, 2, 6, 8, 3, 2, two_sided=False, symmetric=False,
                           granularity="group", group_size=3)
    res = bakron.solve(W, None, AI, qs, tile=(3, 2), engine="cuda", method="antidiagonal",
                       return_targets=True)
    assert res.info["stack"]["path"] == "engine solve_stack" and res.targets.shape == W.shape
    _check_items(res, W, None, AI, qs, (3, 2), targets=True)
    ref = bakron.solve(W[1], None, AI[1], qs[1], tile=(3, 2), engine="array_api",
                       method="antidiagonal", return_targets=True)
    np.testing.assert_array_equal(res.values[1], ref.values)
    np.testing.assert_allclose(res.targets[1], ref.targets, rtol=1e-12, atol=1e-12)


@sim_only
def test_sim_stack_chunks_broadcast_w_and_auto():
    """A 2-D W shared by a stack of A_in (every item reads the same W rows), A_out shared,
    chunks of 2 items (max_bytes), method 'antidiagonal': one launch per chunk, items equal
    the single solves; and the stack rule of method 'auto'."""
    from bakron.backends import numba_cuda as nc
    W3, AO, AI, _ = _stack(3, 5, 5, 6, 2, 2, shared_out=True)
    W = W3[0]
    qs = bakron.fit_quantizers(np.broadcast_to(W, (5, 5, 6)), 3)
    item_bytes = 4 * 5 * 6 * 8
    res = bakron.solve_stack(W, AO, AI, qs, tile=2, engine="cuda", max_bytes=2 * item_bytes,
                             method="antidiagonal")
    assert res.info["stack"]["chunks"] == 3 and res.info["stack"]["path"] == "engine solve_stack"
    assert res.method == "antidiagonal" and res.info["launches"] == 1
    assert nc.stack_method(_ns(M=3, N=3), 5, "auto") == "wavefront"
    assert nc.stack_method(_ns(M=2, N=2), 5, "auto") == "antidiagonal"  # at most 4 tiles
    assert nc.stack_method(_ns(M=3, N=3), 1, "auto") is None  # one item: single rule
    assert nc.stack_method(_ns(M=256, N=256), 64, "auto") == "wavefront"
    assert nc.stack_method(_ns(M=3, N=3), 5, "recursive") is None  # no stack form
    _check_items(res, np.repeat(W[None], 5, axis=0), AO, AI, qs, (2, 2))


@sim_only
@pytest.mark.parametrize("two_sided,base", [(True, 1), (True, 2), (False, 1)])
def test_sim_stack_wavefront_batched_gemms(two_sided, base):
    """The two-level wavefront of a stack: one launch per coarse step over every item's
    blocks, every feedback GEMM one batched call over the items (ragged tiles, per-item
    A_out, A_in shared, one-sided with asymmetric grids, targets): equal to the single
    solves bitwise and to the array-API reference."""
    W, AO, AI, qs = _stack(6, 3, 9, 7, 2, 3, two_sided=two_sided, shared_in=True,
                           symmetric=two_sided)
    res = bakron.solve(W, AO, AI, qs, tile=(2, 3), engine="cuda", method="wavefront",
                       base=base, return_targets=True)
    assert res.info["stack"]["path"] == "engine solve_stack"
    assert res.info["stack_run"].startswith("one launch per coarse step for 3 items")
    assert res.info["base"] == base
    one = bakron.solve(W[0], _item(AO, 0), AI, qs[0], tile=(2, 3), engine="cuda",
                       method="wavefront", base=base)
    # as many launches and GEMM calls as one item's solve: the items share every call
    assert (res.info["launches"], res.info["gemms"]) == (one.info["launches"],
                                                         one.info["gemms"])
    _check_items(res, W, AO, AI, qs, (2, 3), method="wavefront", targets=True)
    _check_items(res, W, AO, AI, qs, (2, 3), engine="array_api")


@sim_only
@pytest.mark.parametrize("two_sided", [True, False])
def test_sim_blocks_per_cta_equal_grid_steps(monkeypatch, two_sided):
    """Launches of at least ``CudaOptions.local_blocks`` blocks take the kernel that solves whole blocks
    per CTA (steps separated by ``syncthreads``): a stack's wavefront and anti-diagonal
    (ragged tiles, per-item A_out, A_in shared) and single solves give bitwise the results
    of the grid-wide steps and of the array-API reference."""
    from bakron.backends import numba_cuda as nc
    o = bakron.CudaOptions()  # the defaults, whatever the environment
    assert (o.local_blocks, o.local_tiles) == (64, 16)
    assert nc._local(o, 64, (4, 4)) and nc._local(o, 500, (2, 8))
    assert not nc._local(o, 63, (4, 4)) and not nc._local(o, 64, (16, 16))  # whole 256² items
    W, AO, AI, qs = _stack(7, 3, 9, 7, 2, 3, two_sided=two_sided, shared_in=True)
    used = []
    variant = nc.kernel_variant

    def spy(*args, **kw):
        used.append(bool(kw.get("local", args[5] if len(args) > 5 else False)))
        return variant(*args, **kw)
    from bakron.backends import _cuda_runtime
    monkeypatch.setattr(_cuda_runtime, "kernel_variant", spy)  # where the run context looks
    runs = {}
    for local in (0, 2):
        ol = o.with_(local_blocks=local)
        used.clear()
        stack = bakron.solve(W, AO, AI, qs, tile=(2, 3), engine="cuda", method="wavefront",
                             base=2, options=ol)
        one = _cuda(W[1], _item(AO, 1), AI, qs[1], (2, 3), "wavefront", 2, options=ol)
        # an anti-diagonal stack of items of 5 x 3 tiles: one block per item
        whole = bakron.solve(W, AO, AI, qs, tile=(2, 3), engine="cuda", method="antidiagonal",
                             options=ol)
        runs[local] = (stack, one, whole, list(used))
    assert not any(runs[0][3]) and any(runs[2][3])
    assert "each CTA solves whole items" in runs[2][2].info["stack_run"]
    assert "grid-synchronised" in runs[0][2].info["stack_run"]
    for a, b in zip(runs[0][:3], runs[2][:3]):
        np.testing.assert_array_equal(a.values, b.values)
        np.testing.assert_array_equal(a.codes, b.codes)
    ref = _ref(W[1], _item(AO, 1), AI, qs[1], (2, 3))
    np.testing.assert_array_equal(runs[2][1].values, ref.values)
    _check_items(runs[2][0], W, AO, AI, qs, (2, 3), engine="array_api")
    _check_items(runs[2][2], W, AO, AI, qs, (2, 3), engine="array_api")


@sim_only
def test_sim_whole_sums_deeper_than_one_chunk(monkeypatch):
    """The step without running sums forms a tile's sums in K-chunks of ``chunk_for`` (64)
    and multiplies only each chunk's depth (in runs of 8): sums 72 deep (two chunks, the
    second ragged) give the array-API reference's values and codes exactly (float64)."""
    W, AO, AI, q = _problem(11, 80, 76, 8, 8)
    ref = _ref(W, AO, AI, q, (8, 8))
    r = _cuda(W, AO, AI, q, (8, 8), "antidiagonal", options=bakron.CudaOptions(step="chain"))
    np.testing.assert_array_equal(r.values, ref.values)
    np.testing.assert_array_equal(r.codes, ref.codes)


@sim_only
def test_sim_stack_base_follows_item_size(monkeypatch):
    """``base=None`` on a stack: ``CudaOptions.stack_base`` tiles for items below ``STACK_LARGE`` tiles a
    side, the single layer's ``DEFAULT_BASE`` from there on (lowered here so that a small
    stack crosses it); the items still equal their single solves."""
    from bakron.backends import numba_cuda as nc
    o = bakron.CudaOptions.defaults()
    assert nc.stack_base(_ns(M=255, N=255), o) == o.stack_base
    assert nc.stack_base(_ns(M=8, N=256), o) == nc.stack_base(_ns(M=256, N=8), o) == \
        nc.DEFAULT_BASE
    W, AO, AI, qs = _stack(8, 2, 9, 7, 2, 3)  # 5 x 3 tiles
    monkeypatch.setattr(nc, "STACK_LARGE", 5)
    monkeypatch.setattr(nc, "DEFAULT_BASE", 2)
    res = bakron.solve(W, AO, AI, qs, tile=(2, 3), engine="cuda", method="wavefront")
    assert res.info["stack"]["path"] == "engine solve_stack" and res.info["base"] == 2
    monkeypatch.setattr(nc, "STACK_LARGE", 6)
    res6 = bakron.solve(W, AO, AI, qs, tile=(2, 3), engine="cuda", method="wavefront")
    assert res6.info["base"] == o.stack_base
    _check_items(res, W, AO, AI, qs, (2, 3))
    np.testing.assert_array_equal(res.values, res6.values)


@sim_only
def test_sim_stack_option_off_declines(monkeypatch):
    """``CudaOptions(stack=False)`` (or ``BAKRON_CUDA_STACK=0``): every stack runs item by
    item."""
    W, AO, AI, qs = _stack(7, 2, 5, 5, 2, 2)
    res = bakron.solve(W, AO, AI, qs, tile=2, engine="cuda", method="antidiagonal",
                       options=bakron.CudaOptions(stack=False))
    assert res.info["stack"]["path"] == "items one by one" and "stack_run" not in res.info
    _check_items(res, W, AO, AI, qs, (2, 2))
    monkeypatch.setenv("BAKRON_CUDA_STACK", "0")
    res = bakron.solve(W, AO, AI, qs, tile=2, engine="cuda", method="antidiagonal")
    assert res.info["stack"]["path"] == "items one by one"


@sim_only
def test_sim_stack_declines_to_items():
    """Quantizers of different kinds (symmetric and asymmetric), or a method without a stack
    form (recursion): the hook declines and the items run one by one, still exact."""
    W, AO, AI, qs = _stack(4, 2, 6, 6, 2, 2)
    mixed = [qs[0], bakron.UniformQuantizer.fit(W[1], 2, symmetric=False)]
    res = bakron.solve(W, AO, AI, mixed, tile=2, engine="cuda", method="antidiagonal")
    assert res.info["stack"]["path"] == "items one by one"
    _check_items(res, W, AO, AI, mixed, (2, 2))
    res = bakron.solve(W, AO, AI, qs, tile=2, engine="cuda", method="recursive", base=1)
    assert res.info["stack"]["path"] == "items one by one" and res.method == "recursive"
    _check_items(res, W, AO, AI, qs, (2, 2), method="recursive")


@sim_only
def test_sim_stack_float32_and_shared_quantizer():
    """float32 with one quantizer shared by every item: the stack equals the single
    anti-diagonal solves bitwise (same kernel, same summation order per tile)."""
    W, AO, AI, _ = _stack(5, 3, 7, 5, 2, 2, dtype=np.float32)
    q = bakron.UniformQuantizer.fit(W[0], 3)
    res = bakron.solve(W, AO, AI, q, tile=2, engine="cuda", method="antidiagonal")
    assert res.values.dtype == np.float32 and res.info["stack"]["path"] == "engine solve_stack"
    _check_items(res, W, AO, AI, [q] * 3, (2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
@pytest.mark.parametrize("two_sided,dtype", [(True, np.float64), (False, np.float64),
                                             (True, np.float32)])
def test_gpu_stack_one_launch_equals_items(two_sided, dtype):
    """On the device: a stack of 6 ragged layers (100 x 70, tile 16) with per-item
    quantizers, per-item A_out and a shared A_in runs in one launch and equals the single
    anti-diagonal solves bitwise (float32 too: same kernel, same sums); in float64 it also
    equals the single solves of method 'auto' (the wavefront), the stack's own 'auto' (the
    wavefront in stack form) and the CPU reference."""
    cp = _cp()
    W, AO, AI, qs = _stack(8, 6, 100, 70, 16, 16, two_sided=two_sided, shared_in=True,
                           symmetric=not two_sided, dtype=dtype)
    Wd, AId = cp.asarray(W), cp.asarray(AI)
    AOd = None if AO is None else cp.asarray(AO)
    res = bakron.solve(Wd, AOd, AId, qs, tile=16, engine="cuda", method="antidiagonal",
                       return_targets=True)
    assert res.info["stack"]["path"] == "engine solve_stack" and res.info["launches"] == 1
    assert res.method == "antidiagonal" and isinstance(res.values, cp.ndarray)
    got = cp.asnumpy(res.values)
    auto = bakron.solve(Wd, AOd, AId, qs, tile=16, engine="cuda")   # 7 x 5 tiles > STACK_BASE
    assert auto.method == "wavefront" and auto.info["stack"]["path"] == "engine solve_stack"
    if dtype == np.float64:
        np.testing.assert_array_equal(cp.asnumpy(auto.values), got)
    for i in range(6):
        one = bakron.solve(Wd[i], None if AOd is None else AOd[i], AId, qs[i], tile=16,
                           engine="cuda", method="antidiagonal", return_targets=True)
        np.testing.assert_array_equal(got[i], cp.asnumpy(one.values), err_msg=f"item {i}")
        np.testing.assert_array_equal(cp.asnumpy(res.codes[i]), cp.asnumpy(one.codes))
        np.testing.assert_array_equal(cp.asnumpy(res.targets[i]), cp.asnumpy(one.targets))
        if dtype == np.float64:
            auto = bakron.solve(Wd[i], None if AOd is None else AOd[i], AId, qs[i], tile=16)
            np.testing.assert_array_equal(got[i], cp.asnumpy(auto.values))
            ref = _ref(W[i], _item(AO, i), AI, qs[i], (16, 16))
            np.testing.assert_array_equal(got[i], ref.values, err_msg=f"item {i}")
    np.testing.assert_array_equal(cp.asnumpy(Wd), W)  # input untouched


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
@pytest.mark.parametrize("two_sided,base", [(True, 2), (True, None), (False, 2)])
def test_gpu_stack_wavefront_equals_items_float64(two_sided, base):
    """On the device: the stack's two-level wavefront (batched GEMMs over every item's
    blocks, per-item A_out and quantizers, A_in shared) equals the single wavefront solves
    and the CPU reference exactly in float64, with the launches and GEMM calls of one
    item."""
    from bakron.backends import numba_cuda as nc

    cp = _cp()
    W, AO, AI, qs = _stack(9, 5, 150, 90, 16, 16, two_sided=two_sided, shared_in=True)
    Wd, AId = cp.asarray(W), cp.asarray(AI)
    AOd = None if AO is None else cp.asarray(AO)
    res = bakron.solve(Wd, AOd, AId, qs, tile=16, engine="cuda", method="wavefront",
                       base=base)
    assert res.info["stack"]["path"] == "engine solve_stack"
    stack_base = bakron.CudaOptions.defaults().stack_base
    assert res.info["base"] == (stack_base if base is None else base)  # 10 x 6 tiles
    got, codes = cp.asnumpy(res.values), cp.asnumpy(res.codes)
    for i in range(5):
        # base=None: the stack's coarse blocks are STACK_BASE tiles (the single-layer rule
        # picks its own); compare with single solves of the same blocks
        one = bakron.solve(Wd[i], None if AOd is None else AOd[i], AId, qs[i], tile=16,
                           engine="cuda", method="wavefront",
                           base=stack_base if base is None else base)
        if i == 0:
            assert (res.info["launches"], res.info["gemms"]) == (one.info["launches"],
                                                                 one.info["gemms"])
        np.testing.assert_array_equal(got[i], cp.asnumpy(one.values), err_msg=f"item {i}")
        np.testing.assert_array_equal(codes[i], cp.asnumpy(one.codes), err_msg=f"item {i}")
        ref = _ref(W[i], _item(AO, i), AI, qs[i], (16, 16))
        np.testing.assert_array_equal(got[i], ref.values, err_msg=f"item {i}")


@sim_only
def test_sim_bench_stack_gpu_suite(tmp_path, monkeypatch):
    """``python -m bakron.bench_stack --gpu --suite`` end to end on tiny workloads in the
    simulator (numpy standing in for cupy): one row per workload with every entry, the stack
    form of auto, the bitwise identity with the single solves, the page and its raw JSON."""
    import json
    import types

    from bakron.benchmarks import stack as bench

    rt = types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"simulator"})
    fake = types.ModuleType("cupy")
    fake.asarray, fake.all, fake.sum, fake.eye = np.asarray, np.all, np.sum, np.eye
    fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(bench, "GPU_SUITE", ((2, 5, 4), (2, 4, 6)))
    # sync() of the entries waits on cupy's stream: give the stand-in one
    stream = types.SimpleNamespace(synchronize=lambda: None)
    fake.cuda = types.SimpleNamespace(runtime=rt, get_current_stream=lambda: stream)
    assert bench.main(["--gpu", "--suite", "--tile", "2", "--repeats", "1", "--dtype",
                       "float64", "--engine", "cuda", "--out", str(tmp_path)]) == 0
    page = (tmp_path / "stacks.md").read_text()
    rows = [ln for ln in page.splitlines() if ln.startswith("| 2 × ")]
    assert len(rows) == 2 and all(r.endswith("| True |") for r in rows)
    assert "float32 entries differ on near-ties: 0 and 0 entries" in " ".join(page.split())
    raw = json.loads((tmp_path / "data" / "stacks-gpu-suite.json").read_text())["points"]
    # auto: the wavefront form
    assert "one launch per coarse step for 2 items" in raw["2x5x4"]["info"]["stack_run"]
    assert "(here the wavefront" in page
    assert set(raw["2x5x4"]["median"]) == {"floor", "one by one", "stack, items",
                                           "stack, antidiagonal", "stack, wavefront",
                                           "stack, auto"}


@sim_only
def test_sim_bench_stack_gpu_block(tmp_path, monkeypatch):
    """``python -m bakron.bench_stack --gpu --block`` end to end on a tiny stand-in block in
    the simulator: layers sharing Hessians, same-shape layers solved as one stack, the row
    and the stacks on the page."""
    import types

    from bakron.benchmarks import stack as bench

    rt = types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"simulator"})
    stream = types.SimpleNamespace(synchronize=lambda: None)
    fake = types.ModuleType("cupy")
    fake.eye = np.eye
    fake.random = types.SimpleNamespace(default_rng=np.random.default_rng)
    fake.cuda = types.SimpleNamespace(runtime=rt, get_current_stream=lambda: stream)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(bench, "LLAMA3_8B_BLOCK", (
        ("q", 8, 8, "attn_in", "q"), ("k", 4, 8, "attn_in", "k"), ("v", 4, 8, "attn_in", "v"),
        ("down", 8, 12, "down_in", "down")))
    assert bench.main(["--gpu", "--block", "--tile", "2", "--repeats", "1", "--dtype",
                       "float64", "--engine", "cuda", "--out", str(tmp_path)]) == 0
    page = (tmp_path / "stacks.md").read_text()
    assert "Stacks solved: 1 × 8×12: wavefront; 1 × 8×8: wavefront; 2 × 4×8: " in " ".join(
        page.split())
    row = [ln for ln in page.splitlines() if ln.startswith("| Llama-3-8B")]
    assert len(row) == 1 and row[0].count("ms") == 3 and row[0].endswith("× |")
