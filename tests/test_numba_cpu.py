"""The numba CPU engine: identical to the array-API path, exact on the reference cases."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import bakron
from _problems import make_quantizer, problem
from bakron.solvers._problem import Problem
from bakron.solvers.schedule import RecursionPlan
from conftest import REFERENCE_CASES

nc = pytest.importorskip("bakron.backends.numba_cpu")
if not nc.available():  # pragma: no cover - numba is a test dependency
    pytest.skip("numba is not available", allow_module_level=True)

import array_api_compat.numpy as xnp  # noqa: E402

# (method, variant, base): every compiled path of the engine
PATHS = [("recursive", "accumulator", 1), ("recursive", "accumulator", 2),
         ("recursive", "accumulator", 3), ("antidiagonal", "accumulator", 8),
         ("antidiagonal", "direct", 8), ("wavefront", "accumulator", 1),
         ("wavefront", "accumulator", 2), ("wavefront", "accumulator", 3)]


@st.composite
def cases(draw, max_side=24):
    m = draw(st.integers(1, max_side))
    n = draw(st.integers(1, max_side))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)), m=m, n=n,
        tx=draw(st.integers(1, min(m, 6))), ty=draw(st.integers(1, min(n, 6))),
        kind=draw(st.sampled_from(["well", "ill", "rank"])), two_sided=draw(st.booleans()),
        bits=draw(st.integers(2, 8)), symmetric=draw(st.booleans()),
        granularity=draw(st.sampled_from(["tensor", "row", "group"])),
        group_size=draw(st.integers(1, n)),
    )


def _setup(c, dtype=np.float64):
    W, f_in, f_out = problem(c["seed"], c["m"], c["n"], c["tx"], c["ty"], kind=c["kind"],
                             two_sided=c["two_sided"])
    q = make_quantizer(None, W, c["bits"], c["symmetric"], c["granularity"], c["group_size"])
    A_out = None if f_out is None else f_out.A.astype(dtype)
    return W.astype(dtype), A_out, f_in.A.astype(dtype), q


def _reference(W, A_out, A_in, q, tile, **kw):
    return bakron.solve(W, A_out, A_in, q, tile=tile, method="antidiagonal",
                        engine="array_api", **kw)


@given(cases())
def test_numba_equals_array_api_float64(c):
    """Every compiled path (the base block with offsets from outside under the recursions of
    bases 1-3) gives the array-API engine's Ŵ and codes exactly, and leaves the inputs
    untouched."""
    W, A_out, A_in, q = _setup(c)
    tile = (c["tx"], c["ty"])
    copies = [x.copy() for x in (W, A_in) + (() if A_out is None else (A_out,))]
    ref = _reference(W, A_out, A_in, q, tile)
    for method, variant, base in PATHS:
        r = bakron.solve(W, A_out, A_in, q, tile=tile, method=method, variant=variant,
                         base=base, engine="numba")
        assert r.engine == "numba" and r.values.dtype == np.float64
        np.testing.assert_array_equal(r.values, ref.values, err_msg=f"{method} {variant} {base}")
        np.testing.assert_array_equal(r.codes, ref.codes, err_msg=f"{method} {variant} {base}")
    for x, x0 in zip((W, A_in) + (() if A_out is None else (A_out,)), copies):
        np.testing.assert_array_equal(x, x0)


@given(cases(max_side=16))
def test_numba_records_the_targets(c):
    """With return_targets the engine records every tile's target (float64: equal to the
    array-API targets up to summation order)."""
    W, A_out, A_in, q = _setup(c)
    tile = (c["tx"], c["ty"])
    ref = _reference(W, A_out, A_in, q, tile, return_targets=True)
    for method, variant, base in PATHS[1:]:
        r = bakron.solve(W, A_out, A_in, q, tile=tile, method=method, variant=variant,
                         base=base, engine="numba", return_targets=True)
        np.testing.assert_array_equal(r.values, ref.values)
        np.testing.assert_allclose(r.targets, ref.targets, rtol=1e-10, atol=1e-10)


def _first_difference(m, n, tx, ty, a, b):
    """A differing element whose dominating tiles agree (first in a dominance order)."""
    for r0 in reversed(range(0, m, tx)):
        for c0 in reversed(range(0, n, ty)):
            blk = (slice(r0, r0 + tx), slice(c0, c0 + ty))
            d = np.argwhere(a[blk] != b[blk])
            if len(d):
                return r0 + d[0][0], c0 + d[0][1]
    return None


def _assert_near_tie(q, i, j, t1, t2):
    s_tab, z_tab = q.tables(np, "cpu", np.float64)
    g = j // q.group_size if s_tab.shape[1] > 1 else 0
    s = float(s_tab[i if s_tab.shape[0] > 1 else 0, g])
    z = 0.0
    if z_tab is not None:
        z = float(z_tab[i if z_tab.shape[0] > 1 else 0, g if z_tab.shape[1] > 1 else 0])
    u1, u2 = t1 / s + z, t2 / s + z
    boundary = np.floor((u1 + u2) / 2) + 0.5
    assert abs(u1 - boundary) < 1e-3 and abs(u2 - boundary) < 1e-3, (u1, u2, boundary)


@given(cases(max_side=32))
def test_numba_float32_agrees_modulo_near_ties(c):
    """float32: results are in float32 and equal to the array-API ones, except that the first
    difference in processing order (if any) is a target next to a rounding boundary."""
    W, A_out, A_in, q = _setup(c, np.float32)
    tile = (c["tx"], c["ty"])
    ref = _reference(W, A_out, A_in, q, tile, return_targets=True)
    for method, variant, base in (PATHS[1], PATHS[3], PATHS[4]):
        r = bakron.solve(W, A_out, A_in, q, tile=tile, method=method, variant=variant,
                         base=base, engine="numba", return_targets=True)
        assert r.values.dtype == np.float32 and r.targets.dtype == np.float32
        first = _first_difference(c["m"], c["n"], *tile, ref.values, r.values)
        if first is not None:
            _assert_near_tie(q, *first, float(ref.targets[first]), float(r.targets[first]))


def test_float32_larger_problem_near_tie_or_equal():
    """A 256 x 192 float32 problem: agreement or a near-tie first difference; float64 exact."""
    W64, f_in, f_out = problem(3, 256, 192, 16, 16)
    q = bakron.UniformQuantizer.fit(W64, 2)
    for dtype in (np.float32, np.float64):
        W, AO, AI = W64.astype(dtype), f_out.A.astype(dtype), f_in.A.astype(dtype)
        ref = _reference(W, AO, AI, q, 16, return_targets=True)
        r = bakron.solve(W, AO, AI, q, tile=16, method="recursive", base=4, engine="numba",
                         return_targets=True)
        if dtype == np.float64:
            np.testing.assert_array_equal(r.values, ref.values)
        else:
            first = _first_difference(256, 192, 16, 16, ref.values, r.values)
            if first is not None:
                _assert_near_tie(q, *first, float(ref.targets[first]), float(r.targets[first]))
            assert np.mean(r.values != ref.values) < 0.05


@pytest.mark.parametrize("path", REFERENCE_CASES, ids=lambda p: p.rsplit("/", 1)[-1][:-4])
def test_reference_cases_numba(ref_case, path):
    d = ref_case(path)
    tile = tuple(int(t) for t in d["tile"])
    q = bakron.UniformQuantizer(int(d["bits"]), float(d["scale"]))
    for method, variant, base in PATHS + [("auto", "accumulator", None)]:
        r = bakron.solve(d["W"], d["L_out"], d["L_in"], q, tile=tile, method=method,
                         variant=variant, base=base, engine="numba")
        np.testing.assert_array_equal(r.values, d["hatW"], err_msg=f"{method} {variant} {base}")
        np.testing.assert_array_equal(float(d["scale"]) * r.codes.astype(np.float64), d["hatW"])


def test_auto_engine_and_method():
    W, f_in, f_out = problem(0, 64, 48, 8, 8)
    q = bakron.UniformQuantizer.fit(W, 3)
    r = bakron.solve(W, f_out.A, f_in.A, q, tile=8)
    assert r.engine == "numba" and r.method in ("recursive", "antidiagonal")
    # a quantizer the engine cannot fuse: auto falls back, an explicit request is refused
    class Shifted(bakron.UniformQuantizer):
        def quantize(self, targets, rows=None, cols=None):
            return super().quantize(targets, rows=rows, cols=cols)
    sq = Shifted(3, 0.5)
    assert bakron.solve(W, f_out.A, f_in.A, sq, tile=8).engine == "array_api"
    with pytest.raises(ValueError, match="engine='numba' does not support"):
        bakron.solve(W, f_out.A, f_in.A, sq, tile=8, engine="numba")


@pytest.mark.slow   # compiles the kernels for strided layouts
def test_non_contiguous_inputs():
    W, f_in, f_out = problem(1, 40, 36, 4, 4)
    q = bakron.UniformQuantizer.fit(W, 3)
    ref = _reference(W, f_out.A, f_in.A, q, 4)
    Wf = np.asfortranarray(W)
    AOf = np.asfortranarray(f_out.A)
    big = np.zeros((72, 72))
    big[::2, ::2] = f_in.A
    AIv = big[::2, ::2]
    for method in ("recursive", "antidiagonal"):
        r = bakron.solve(Wf, AOf, AIv, q, tile=4, method=method, base=2, engine="numba")
        np.testing.assert_array_equal(r.values, ref.values)


def test_plan_scratch_memory_bound():
    """The recursion's extra memory: the F/E buffer (m n) plus scratch <= m n / 3 (+ slack of
    one base block row/column), so with Ŵ and the codes it stays under 3 m n elements."""
    for (m, n, t, base, two) in [(1024, 1024, 16, 8, True), (512, 2048, 16, 4, True),
                                 (2048, 256, 16, 8, True), (300, 700, 8, 2, True),
                                 (1024, 1024, 16, 8, False)]:
        W = np.zeros((m, n))
        A_O = np.zeros((m, m)) if two else None
        p = Problem(xnp, W, A_O, np.zeros((n, n)), bakron.UniformQuantizer(2, 1.0), (t, t))
        ops, scratch = nc.op_table(RecursionPlan(p.rows, p.cols, base, two))
        assert scratch <= m * n / 3 + base * t * (m + n), (m, n, scratch)
        assert (ops[:, 0] == 0).sum() >= 1


def test_numba_not_imported_by_bakron():
    code = "import sys, bakron; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_gptq_order_one_sided_matches_classic_loop():
    """One-sided, tile (1, 1): the engine equals a plain LDLQ column loop (last column first)."""
    W, f_in, _ = problem(5, 33, 47, 1, 1, two_sided=False)
    q = bakron.UniformQuantizer.fit(W, 4)
    A = f_in.A
    E = np.zeros_like(W)
    Wq = np.zeros_like(W)
    for j in reversed(range(W.shape[1])):
        t = W[:, j] + E[:, j + 1:] @ A[j + 1:, j]
        v, _ = q.quantize(t[None, :, None], rows=np.array([0]), cols=np.array([j]))
        Wq[:, j] = v[0, :, 0]
        E[:, j] = W[:, j] - Wq[:, j]
    for method, variant, base in PATHS:
        r = bakron.solve(W, None, A, q, tile=1, method=method, variant=variant, base=base,
                         engine="numba")
        np.testing.assert_array_equal(r.values, Wq)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("two_sided", [True, False])
def test_recursive_extra_memory_within_budget(dtype, two_sided):
    """The recursive solver's extra memory is <= 3 m n elements beyond its inputs: everything
    the engine allocates (Ŵ, codes, the F/E buffer, scratch; numba's internal per-block
    buffers are O(base block)) is traced."""
    import tracemalloc

    m, n = 384, 320
    W, f_in, f_out = problem(2, m, n, 16, 16, two_sided=two_sided)
    q = bakron.UniformQuantizer.fit(W, 2)
    A_out = None if f_out is None else f_out.A.astype(dtype)
    p = Problem(xnp, W.astype(dtype), A_out, f_in.A.astype(dtype), q, (16, 16))
    nc.run(p, "recursive", 2, "accumulator")  # compile / warm outside the trace
    tracemalloc.start()
    try:
        out = nc.run(p, "recursive", 2, "accumulator")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.values.dtype == dtype and out.codes.shape == (m, n)
    assert peak <= 3 * m * n * np.dtype(dtype).itemsize, peak / (m * n * np.dtype(dtype).itemsize)


def test_parallel_one_sided_kernel(monkeypatch):
    """The prange variant of the one-sided base block (used for large blocks) is exact too:
    through the engine, and on a sub-block with offsets F and its errors written back (as the
    recursion calls it) equal to the serial kernel."""
    K = nc._kernels()
    W, f_in, _ = problem(4, 70, 45, 8, 4, two_sided=False)
    q = bakron.UniformQuantizer.fit(W, 3, granularity="group", group_size=7)
    ref = _reference(W, None, f_in.A, q, (8, 4))
    monkeypatch.setattr(K, "PAR_MIN_WORK", 0)
    r = bakron.solve(W, None, f_in.A, q, tile=(8, 4), method="antidiagonal", engine="numba")
    np.testing.assert_array_equal(r.values, ref.values)
    s_tab, z_tab = q.tables(np, "cpu", np.float64)
    z_tab = np.zeros((1, 1)) if z_tab is None else np.ascontiguousarray(z_tab)
    flags = K.HAS_F | K.WRITE_E | K.HAS_T | (0 if q.symmetric else K.ASYM)
    prm = K.params(flags=flags, tile=(8, 4), group_size=q.group_size or 1,
                   code_range=q.code_range)
    tables = (np.ascontiguousarray(s_tab), z_tab)
    F0 = np.random.default_rng(1).standard_normal(W.shape)
    AI = np.ascontiguousarray(f_in.A)
    outs = []
    for kernel in (K.base_one_sided, K.base_one_sided_par):
        FE, Wq = F0.copy(), np.zeros_like(W)
        codes, T = np.zeros(W.shape, np.int16), np.zeros_like(W)
        kernel(W, FE, AI, Wq, codes, T, FE, *tables, prm, 16, 62, 8, 41)
        outs.append((FE, Wq, codes, T))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    assert np.any(outs[0][1] != 0) and np.any(outs[0][0] != F0)


@pytest.mark.parametrize("kind,dtype", [("s", np.float32), ("d", np.float64)])
def test_blas_adapter(kind, dtype):
    """The cblas adapter over SciPy's BLAS (used when numpy's BLAS is not the OpenBLAS of
    numpy's wheels) computes row-major C = beta C + op(A) op(B) on sub-blocks."""
    import ctypes

    K = nc._kernels()
    f = K._adapter(kind)
    rng = np.random.default_rng(0)
    A = rng.standard_normal((7, 9)).astype(dtype)
    B = rng.standard_normal((9, 11)).astype(dtype)
    C = rng.standard_normal((6, 12)).astype(dtype)
    C0 = C.copy()
    ptr = lambda X, off: ctypes.c_void_p(X.ctypes.data + off * X.itemsize)  # noqa: E731
    # C[1:6, 2:10] = 0.5 C + A[1:6, 0:4] @ B[3:7, 1:9], then with op(A) = A[0:4, 2:7]^T
    f.ctypes(101, 111, 111, 5, 8, 4, 1.0, ptr(A, 9), 9, ptr(B, 3 * 11 + 1), 11, 0.5,
             ptr(C, 12 + 2), 12)
    ref = 0.5 * C0[1:6, 2:10] + A[1:6, 0:4] @ B[3:7, 1:9]
    np.testing.assert_allclose(C[1:6, 2:10], ref, rtol=1e-5)
    C1 = C.copy()
    f.ctypes(101, 112, 111, 5, 8, 4, 1.0, ptr(A, 2), 9, ptr(B, 3 * 11 + 1), 11, 1.0,
             ptr(C, 12 + 2), 12)
    np.testing.assert_allclose(C[1:6, 2:10], C1[1:6, 2:10] + A[0:4, 2:7].T @ B[3:7, 1:9],
                               rtol=1e-5)
    assert np.array_equal(C[0], C0[0]) and np.array_equal(C[:, :2], C0[:, :2])


def test_bench_smoke_and_gptq_equivalence(tmp_path):
    """The CPU benchmark writes its table and plot; the classic GPTQ loop it compares against
    solves the same problem as the one-sided solver (float64: identical Ŵ)."""
    import bakron.bench
    from bakron.benchmarks import cpu as bench

    assert bakron.bench.main is bench.main  # python -m bakron.bench / bakron bench forward

    P = bench.make_problem(40, 48, (16, 16), np.float64, seed=3)
    q = bakron.UniformQuantizer.fit(P["W"], 3)
    U = np.linalg.cholesky(np.linalg.inv(P["H_in"][::-1, ::-1])).T
    theirs = bench.gptq_loop(P["W"][:, ::-1], U, q, block=16)[:, ::-1]
    ours = bakron.solve(P["W"], None, P["A_in1"], q, tile=(16, 1), engine="numba").values
    np.testing.assert_array_equal(ours, theirs)
    assert bench.main(["--sizes", "32,64", "--repeats", "1", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "cpu.md").read_text()
    assert "| 32 |" in md and "| 64 |" in md and "python -m bakron.benchmarks.cpu" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the plot is optional (extra 'bench')
        assert not (tmp_path / "cpu.png").exists() and "no plot" in md
    else:
        assert (tmp_path / "cpu.png").stat().st_size > 1000 and "cpu.png" in md


def test_bench_help_explains_every_option(capsys):
    """``bakron bench --help``: every option has a help text; ``--out`` names its default."""
    from bakron.benchmarks import cpu as bench

    actions = [a for a in bench.parser()._actions if a.option_strings]
    names = {o for a in actions for o in a.option_strings}
    assert {"--repeats", "--dtype", "--tile", "--bits", "--budget", "--out", "--sizes"} <= names
    for a in actions:
        assert a.help and len(a.help) > 10, a.option_strings
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    assert "default docs/benchmarks" in " ".join(capsys.readouterr().out.split())


# -- the two-level wavefront (docs/engines.md, "Many cores") ---------------------------------

@st.composite
def wave_cases(draw):
    c = draw(cases(max_side=40))
    c["base"] = draw(st.integers(1, 5))
    c["threads"] = draw(st.integers(1, 4))
    return c


@given(wave_cases())
def test_wavefront_equals_every_other_method_float64(c):
    """``method="wavefront"`` (coarse blocks of 1-5 tiles, ragged edges, one- and two-sided,
    1-4 numba threads) gives exactly the Ŵ and codes of the numba recursion and
    anti-diagonal and of the array-API engine; its targets are the same sums up to order."""
    import numba

    W, A_out, A_in, q = _setup(c)
    tile = (c["tx"], c["ty"])
    ref = _reference(W, A_out, A_in, q, tile, return_targets=True)
    others = [bakron.solve(W, A_out, A_in, q, tile=tile, method=m, base=c["base"],
                           engine="numba") for m in ("recursive", "antidiagonal")]
    before = numba.get_num_threads()
    numba.set_num_threads(min(c["threads"], numba.config.NUMBA_NUM_THREADS))
    try:
        r = bakron.solve(W, A_out, A_in, q, tile=tile, method="wavefront", base=c["base"],
                         engine="numba", return_targets=True)
    finally:
        numba.set_num_threads(before)
    assert r.method == "wavefront" and r.info["base"] == c["base"]
    for other in [ref] + others:
        np.testing.assert_array_equal(r.values, other.values)
        np.testing.assert_array_equal(r.codes, other.codes)
    np.testing.assert_allclose(r.targets, ref.targets, rtol=1e-10, atol=1e-10)


def test_wavefront_is_the_same_on_any_number_of_threads():
    """The blocks of a step write disjoint regions and every product has a fixed size, so
    the result (float32 included, bit for bit) does not depend on numba's thread count."""
    import numba

    for two_sided in (True, False):
        W, f_in, f_out = problem(7, 200, 168, 8, 8, two_sided=two_sided)
        q = bakron.UniformQuantizer.fit(W, 2)
        AO = None if f_out is None else f_out.A.astype(np.float32)
        W32, AI = W.astype(np.float32), f_in.A.astype(np.float32)
        before = numba.get_num_threads()
        outs = []
        for t in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(t)
            try:
                outs.append(bakron.solve(W32, AO, AI, q, tile=8, method="wavefront", base=3,
                                         engine="numba"))
            finally:
                numba.set_num_threads(before)
        for o in outs[1:]:
            np.testing.assert_array_equal(o.values, outs[0].values)
            np.testing.assert_array_equal(o.codes, outs[0].codes)


@pytest.mark.parametrize("gather", [None, (20, 50)])
def test_wavefront_pieces_split_gathers_and_scatters_exactly(monkeypatch, gather):
    """Matrices taller than ``SCATTER_ROWS``, and gathers cut into several targets per block
    (``NumbaOptions.gather_rows``) and several partial products per target (``gather_k``), summed
    afterwards: the scatters run in several row pieces (the identity of a scatter inside
    one of them); Ŵ and codes equal the recursion's in float64, targets up to order, with
    BLAS set to one thread (one call per piece) and without (pieces split along k), on 1
    and all numba threads; the BLAS thread count is back afterwards."""
    import numba

    K = nc._kernels()
    opts = bakron.NumbaOptions() if gather is None else bakron.NumbaOptions(
        gather_rows=gather[0], gather_k=gather[1])
    nc._cached_wavefront.cache_clear()
    tile, base = (16, 8), 3
    try:
        for two_sided in (True, False):
            W, f_in, f_out = problem(11, 300, 264, *tile, two_sided=two_sided)
            assert W.shape[0] > 2 * K.SCATTER_ROWS
            tasks, steps = nc.wavefront_table(list(range(0, 301, 16)) + [300],
                                              list(range(0, 265, 8)), base, two_sided)
            gt, _, gp, _, _ = nc.gather_table(tasks, steps, 300, 264, two_sided, opts)
            if gather is not None:  # several targets per block and pieces per target
                assert (gt[:, 5] - gt[:, 4]).max() > 1
                assert (gt[:, 1] - gt[:, 0]).min() < base * tile[0]
            q = bakron.UniformQuantizer.fit(W, 3)
            AO = None if f_out is None else f_out.A
            rec = bakron.solve(W, AO, f_in.A, q, tile=tile, method="recursive",
                               engine="numba", return_targets=True)
            before = numba.get_num_threads()
            for pinned in (K.BLAS_THREADS, None):
                monkeypatch.setattr(K, "BLAS_THREADS", pinned)
                for t in sorted({1, numba.config.NUMBA_NUM_THREADS}):
                    numba.set_num_threads(t)
                    try:
                        r = bakron.solve(W, AO, f_in.A, q, tile=tile, method="wavefront",
                                         base=base, engine="numba", return_targets=True,
                                         options=opts)
                    finally:
                        numba.set_num_threads(before)
                    np.testing.assert_array_equal(r.values, rec.values)
                    np.testing.assert_array_equal(r.codes, rec.codes)
                    np.testing.assert_allclose(r.targets, rec.targets, rtol=1e-10,
                                               atol=1e-10)
    finally:
        nc._cached_wavefront.cache_clear()


def test_gather_table_covers_every_product_once():
    """Every gather of the wavefront, as targets and pieces: two-sided each block after the
    first step, its rows once and its inner dimension ``[c0, n)`` once; one-sided each
    coarse column but the last, all rows, ``[c1, n)``; pieces of a step do not overlap in the
    scratch buffer, which holds the largest step; a step with few pieces has thin targets."""
    from bakron.solvers.schedule import tile_edges

    m, n = 70, 45
    o = bakron.NumbaOptions()
    rows, cols = tile_edges(m, 8), tile_edges(n, 4)
    for two in (True, False):
        tasks, steps = nc.wavefront_table(rows, cols, 3, two)
        gt, gsteps, gp, psteps, size = nc.gather_table(tasks, steps, m, n, two)
        assert len(gsteps) == len(psteps) == len(steps)
        for s in range(len(steps) - 1):
            blocks = tasks[steps[s]:steps[s + 1]]
            cover = np.zeros((m, n, n), int)  # (row, output column, inner index)
            used = np.zeros(size, int)
            for r0, r1, c0, c1, q0, q1 in gt[gsteps[s]:gsteps[s + 1]]:
                assert r1 - r0 <= o.gather_rows
                for t, k0, k1, off in gp[q0:q1]:
                    assert k1 - k0 <= o.gather_k and psteps[s] <= q0 and q1 <= psteps[s + 1]
                    cover[r0:r1, c0:c1, k0:k1] += 1
                    used[off:off + (r1 - r0) * (c1 - c0)] += 1
            assert used.max(initial=0) <= 1
            step = gt[gsteps[s]:gsteps[s + 1]]
            if 0 < psteps[s + 1] - psteps[s] < o.gather_min_pieces:  # few pieces: thin targets
                assert (step[:, 1] - step[:, 0]).max() <= o.gather_min_rows
            want = np.zeros_like(cover)
            if two and s > 0:
                for r0, r1, c0, c1 in blocks:
                    want[r0:r1, c0:c1, c0:] = 1
            elif not two:
                c0, c1 = blocks[0, 2], blocks[0, 3]
                want[:, c0:c1, c1:] = 1
            np.testing.assert_array_equal(cover, want)


def test_blas_on_one_thread_counts_in_and_out():
    """The wavefront sets numpy's OpenBLAS to one thread while it runs: nested and
    concurrent solves count in and out, the last one out restores the count, and a whole
    wavefront solve leaves it as it found it."""
    import threading

    get_put = nc._kernels().BLAS_THREADS
    if get_put is None:  # pragma: no cover - numpy with another BLAS
        with nc._blas_on_one_thread() as pinned:
            assert pinned is False
        return
    get, put = get_put
    before = get()
    put(2)
    try:
        with nc._blas_on_one_thread() as pinned:
            assert pinned is True and get() == 1
            with nc._blas_on_one_thread():
                assert get() == 1
            assert get() == 1  # the inner one left; the outer still runs
        assert get() == 2
        inside, go = threading.Barrier(3), threading.Event()

        def solve_like():
            with nc._blas_on_one_thread():
                inside.wait()
                go.wait()

        workers = [threading.Thread(target=solve_like) for _ in range(2)]
        for w in workers:
            w.start()
        inside.wait()
        assert get() == 1
        go.set()
        for w in workers:
            w.join()
        assert get() == 2
        W, f_in, f_out = problem(3, 64, 48, 4, 4)  # a whole solve leaves the count as found
        r = bakron.solve(W, f_out.A, f_in.A, bakron.UniformQuantizer.fit(W, 2), tile=4,
                         method="wavefront", engine="numba")
        assert r.method == "wavefront" and get() == 2
    finally:
        put(before)


def test_blas_pool_stopped_only_when_alone(monkeypatch):
    """The first solve in ends OpenBLAS's (possibly spinning) workers only when BLAS ran on
    more than one thread and no other thread can be in BLAS (``_alone``: none but the input
    checks' pool); products afterwards still run and are right, and the count is
    restored."""
    import threading

    from bakron._validate import CHECK_THREADS

    me = threading.current_thread()
    checks = threading.Thread(name=f"{CHECK_THREADS}_0")  # the checks' pool: never BLAS
    user = threading.Thread(name="user")
    for others, alone in (([], True), ([checks], True), ([checks, user], False)):
        monkeypatch.setattr(threading, "enumerate", lambda o=others: [me, *o])
        assert nc._alone() is alone
    monkeypatch.undo()

    K = nc._kernels()
    if K.BLAS_THREADS is None or K.BLAS_POOL_STOP is None:  # pragma: no cover - other BLAS
        pytest.skip("numpy's OpenBLAS does not export blas_thread_shutdown_")
    get, put = K.BLAS_THREADS
    calls = []
    real = K.BLAS_POOL_STOP

    def spy():
        calls.append(1)
        return real()

    monkeypatch.setattr(K, "BLAS_POOL_STOP", spy)
    monkeypatch.setattr(nc, "_alone", lambda: True)
    before = get()
    rng = np.random.default_rng(0)
    A = rng.standard_normal((300, 300))
    want = A @ A.T
    try:
        put(1)
        with nc._blas_on_one_thread():
            pass
        assert calls == []  # BLAS was on one thread already: nothing spins
        put(2)
        with nc._blas_on_one_thread():
            assert len(calls) == 1 and get() == 1
            with nc._blas_on_one_thread():  # nested: not again
                assert len(calls) == 1
            np.testing.assert_allclose(A @ A.T, want, rtol=1e-12, atol=1e-12)
            nc.quiet_blas()  # inside a solve: nothing
            assert len(calls) == 1
        # restoring the count started new workers; the last one out ended them again
        assert len(calls) == 2 and get() == 2
        np.testing.assert_allclose(A @ A.T, want, rtol=1e-12, atol=1e-12)
        nc.quiet_blas()  # before a solve's checks
        assert len(calls) == 3
        np.testing.assert_allclose(A @ A.T, want, rtol=1e-12, atol=1e-12)
        monkeypatch.setattr(nc, "_alone", lambda: False)  # another thread exists
        with nc._blas_on_one_thread():
            assert get() == 1
        nc.quiet_blas()
        assert len(calls) == 3 and get() == 2
    finally:
        put(before)


def test_wavefront_table_is_the_schedule():
    """The task table is ``schedule.two_level`` in elements: every tile once, steps in order."""
    from bakron.solvers.schedule import tile_edges, two_level

    rows, cols = tile_edges(70, 8), tile_edges(45, 4)
    for two in (True, False):
        tasks, steps = nc.wavefront_table(rows, cols, 3, two)
        coarse = two_level(len(rows) - 1, len(cols) - 1, 3, two)
        assert len(steps) == len(coarse) + 1 and steps[-1] == len(tasks)
        cover = np.zeros((70, 45), int)
        for s, st in enumerate(coarse):
            got = tasks[steps[s]:steps[s + 1]]
            want = [[rows[b.ra], rows[b.rb], cols[b.ca], cols[b.cb]] for b in st.blocks]
            assert got.tolist() == want
            for r0, r1, c0, c1 in got:
                cover[r0:r1, c0:c1] += 1
        assert (cover == 1).all()


def test_gather_targets_are_thin_only_where_pieces_are_few():
    """Large layers gather whole 128-row blocks (``NumbaOptions.gather_rows``) in their wide
    steps; a 512² layer (at most 4 blocks and 4 pieces a step) cuts them to
    ``gather_min_rows``."""
    from bakron.solvers.schedule import tile_edges

    o = bakron.NumbaOptions()
    assert o.gather_rows == 128
    for size, thin_only in ((512, True), (4096, False)):
        e = tile_edges(size, 16)
        tasks, steps = nc.wavefront_table(e, e, 8, True)
        gt, gsteps, gp, psteps, _ = nc.gather_table(tasks, steps, size, size, True)
        heights = gt[:, 1] - gt[:, 0]
        assert (heights.max() <= o.gather_min_rows) == thin_only
        wide = int(np.argmax(np.diff(psteps)))  # the step with most pieces
        assert np.diff(psteps)[wide] >= (1 if thin_only else o.gather_min_pieces)


def test_auto_rule_takes_the_wavefront_with_threads_and_work(monkeypatch):
    """``method="auto"``: the wavefront from ``WAVEFRONT_MIN_THREADS`` numba threads
    (one-sided: ``WAVEFRONT_ONE_SIDED_MIN_THREADS``) and ``WAVEFRONT_MIN_WORK``; the
    recursion below either, the anti-diagonal for small problems."""
    t = nc.WAVEFRONT_MIN_THREADS
    assert t >= 2  # one thread: the recursion (faster there at 4096², docs/engines.md)
    W, f_in, f_out = problem(0, 96, 80, 4, 4)
    q = bakron.UniformQuantizer.fit(W, 3)
    monkeypatch.setattr(nc, "numba_threads", lambda: t)
    monkeypatch.setattr(nc, "WAVEFRONT_MIN_WORK", 96 * 80 * 176)
    assert bakron.solve(W, f_out.A, f_in.A, q, tile=4).method == "wavefront"
    monkeypatch.setattr(nc, "numba_threads", lambda: t - 1)
    assert bakron.solve(W, f_out.A, f_in.A, q, tile=4).method == "recursive"
    monkeypatch.setattr(nc, "numba_threads", lambda: t)
    monkeypatch.setattr(nc, "WAVEFRONT_MIN_WORK", 96 * 80 * 176 + 1)
    assert bakron.solve(W, f_out.A, f_in.A, q, tile=4).method == "recursive"
    monkeypatch.setattr(nc, "WAVEFRONT_MIN_WORK", 96 * 80 * 176)
    # one-sided: from WAVEFRONT_ONE_SIDED_MIN_THREADS (more than two-sided needs)
    t1 = nc.WAVEFRONT_ONE_SIDED_MIN_THREADS
    assert t1 > t
    monkeypatch.setattr(nc, "numba_threads", lambda: t1 - 1)
    assert bakron.solve(W, None, f_in.A, q, tile=4).method == "recursive"
    monkeypatch.setattr(nc, "numba_threads", lambda: t1)
    assert bakron.solve(W, None, f_in.A, q, tile=4).method == "wavefront"
    # tiles of >= 256 elements and a small problem: the anti-diagonal, whatever the threads
    W, f_in, f_out = problem(0, 64, 64, 16, 16)
    q = bakron.UniformQuantizer.fit(W, 3)
    assert bakron.solve(W, f_out.A, f_in.A, q, tile=16).method == "antidiagonal"


def test_stack_threads_rule(monkeypatch):
    """Threads for the items of a stack: >= 2 items, >= 2 cores, per-item work
    m n (m + n) >= STACK_THREADS_MIN_WORK and a thread-safe threading layer."""
    from types import SimpleNamespace

    def chunk(items, m, n):
        return SimpleNamespace(start=3, stop=3 + items, W=np.zeros((1, m, n)))

    monkeypatch.setattr(nc, "threading_layer", lambda: "omp")
    k = round((nc.STACK_THREADS_MIN_WORK / 2) ** (1 / 3))  # square items at the threshold
    assert 2 * k ** 3 == nc.STACK_THREADS_MIN_WORK
    assert nc.stack_threads(chunk(8, k, k), 4) == 4
    assert nc.stack_threads(chunk(3, k, k), 16) == 3
    assert nc.stack_threads(chunk(1, 512, 512), 16) == 1
    assert nc.stack_threads(chunk(8, 512, 512), 1) == 1
    assert nc.stack_threads(chunk(8, k - 1, k), 16) == 1
    monkeypatch.setattr(nc, "threading_layer", lambda: "workqueue")
    assert nc.stack_threads(chunk(8, 512, 512), 16) == 1


def _cores():
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def test_stack_items_on_threads_equal_single_solves(monkeypatch):
    """A stack above the rule's threshold runs its items on threads (the kernels are nogil);
    every item equals its own single solve, and ``info`` says what ran."""
    rng = np.random.default_rng(3)
    B, m, n = 3, 136, 128
    monkeypatch.setattr(nc, "STACK_THREADS_MIN_WORK", m * n * (m + n))  # small, fast items
    W = rng.standard_normal((B, m, n))
    _, f_in, f_out = problem(2, m, n, 8, 8)
    qs = bakron.fit_quantizers(W, 2)
    for method in ("wavefront", "recursive"):
        r = bakron.solve(W, f_out.A, f_in.A, qs, tile=8, method=method, base=4)
        st_ = r.info["stack"]
        if _cores() >= 2 and nc.threading_layer() in nc.THREAD_SAFE_LAYERS:
            assert st_["path"] == "items on 2 threads" or st_["workers"] >= 2
        assert st_["workers_by"] == "engine rule stack_threads"
        for i in range(B):
            one = bakron.solve(W[i], f_out.A, f_in.A, qs[i], tile=8, method=method, base=4)
            np.testing.assert_array_equal(r.values[i], one.values)
            np.testing.assert_array_equal(r.codes[i], one.codes)


def test_workqueue_layer_serialises_solves(monkeypatch):
    """Under numba's workqueue layer (not thread-safe) solves from several threads take a
    lock: an explicit ``workers=`` stack still gives every item exactly."""
    monkeypatch.setattr(nc, "threading_layer", lambda: "workqueue")
    W, f_in, f_out = problem(4, 48, 40, 4, 4)
    Ws = np.stack([W, W[::-1].copy(), -W])
    q = bakron.UniformQuantizer.fit(W, 3)
    r = bakron.solve_stack(Ws, f_out.A, f_in.A, q, tile=4, method="wavefront", base=2,
                           workers=3)
    assert r.info["stack"]["workers_by"] == "workers="
    for i in range(3):
        one = bakron.solve(Ws[i], f_out.A, f_in.A, q, tile=4, method="wavefront", base=2)
        np.testing.assert_array_equal(r.values[i], one.values)


def test_wavefront_with_targets_and_auto_engine_runs_on_numba():
    """``return_targets`` with ``engine="auto"`` sends other methods to the array-API engine
    (the reference's sums); the wavefront, which it lacks, stays on numba (single and stack)."""
    W, f_in, f_out = problem(5, 40, 36, 4, 4)
    q = bakron.UniformQuantizer.fit(W, 3)
    r = bakron.solve(W, f_out.A, f_in.A, q, tile=4, method="wavefront", base=2,
                     return_targets=True)
    ref = _reference(W, f_out.A, f_in.A, q, 4, return_targets=True)
    assert r.engine == "numba" and r.method == "wavefront"
    np.testing.assert_array_equal(r.values, ref.values)
    np.testing.assert_allclose(r.targets, ref.targets, rtol=1e-10, atol=1e-10)
    rs = bakron.solve(np.stack([W, -W]), f_out.A, f_in.A, q, tile=4, method="wavefront",
                      base=2, return_targets=True)
    assert rs.engine == "numba" and rs.targets.shape == (2, 40, 36)
    np.testing.assert_array_equal(rs.values[0], ref.values)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), block=st.integers(1, 20), seed=st.integers(0, 2**31),
       dtype=st.sampled_from([np.float32, np.float64]), bad=st.integers(0, 3),
       dead=st.integers(0, 3), strided=st.booleans())
def test_factor_scan_equals_numpy(n, block, seed, dtype, bad, dead, strided):
    """The compiled one-pass statistics of the factor checks equal numpy's on random
    factor-shaped matrices with forbidden entries, zero (dead) rows and columns, both
    dtypes and a non-contiguous view; the input is not modified."""
    rng = np.random.default_rng(seed)
    i = np.arange(n)
    allowed = (i[None, :] < (i[:, None] // block) * block)
    A = np.where(allowed, rng.standard_normal((n, n)), 0.0)
    A[rng.random((n, n)) < 0.3] = 0.0
    for r, c in rng.integers(0, n, (bad, 2)):
        A[r, c] = rng.standard_normal()  # maybe forbidden, maybe not
    for k in rng.integers(0, n, dead):
        A[k, :] = 0.0
        A[:, k] = 0.0
    A = A.astype(dtype)
    if strided:
        A = np.asfortranarray(A)
    before = A.copy()
    got = nc.factor_scan(A, block)
    np.testing.assert_array_equal(A, before)
    assert got[0] == np.abs(np.where(allowed, 0, A)).max()
    left = np.where(allowed, A, 0) != 0
    np.testing.assert_array_equal(got[1], left.any(axis=1))
    np.testing.assert_array_equal(got[2], np.where(left.any(axis=1), left.argmax(axis=1), n))
    np.testing.assert_array_equal(got[3], left.any(axis=0))


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 40), seed=st.integers(0, 2**31),
       dtype=st.sampled_from([np.float32, np.float64]), bad=st.integers(0, 6),
       strided=st.booleans())
def test_count_nonfinite_equals_numpy(m, n, seed, dtype, bad, strided):
    """The compiled count of NaN and Inf entries equals numpy's (NaN, +Inf, -Inf at random
    places, both dtypes, a non-contiguous view); the input is not modified."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((m, n)).astype(dtype)
    for (i, j), v in zip(rng.integers(0, [m, n], (bad, 2)), [np.nan, np.inf, -np.inf] * 2):
        X[i, j] = v
    if strided:
        X = X.T
    before = X.copy()
    assert nc.count_nonfinite(X) == int((~np.isfinite(X)).sum())
    np.testing.assert_array_equal(X, before)
    assert nc.count_nonfinite(X.astype(np.float16)) is None  # the array-API check counts
