"""The engine contract and the schedule: every engine runs every method of its capability
table to the same Ŵ, exactly in float64 (reference cases and the naive solver); the plans of
``bakron.solvers.schedule`` respect the dominance order and cover every tile once.

The cuda engine runs here on a GPU (``gpu`` marker) or under numba-cuda's simulator when
``NUMBA_ENABLE_CUDASIM=1`` is set before the tests start (tests/test_cuda.py runs its own
simulator subprocess in CI)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import bakron
from _problems import make_quantizer, problem
from bakron.solvers import engines, registry
from bakron.solvers.schedule import (AFTER_BC, AFTER_BOTTOM, AFTER_D, AFTER_RIGHT, Block,
                                     RecursionPlan, step_count, step_width, tile_edges,
                                     tile_wavefront, two_level)
from conftest import HAS_GPU, REFERENCE_CASES


def _engine_or_skip(name):
    eng = registry.load(name)
    if eng is None:
        pytest.skip(f"engine {name!r} cannot run here")
    return eng


def _paths(name):
    """(method, variant) pairs of an engine's capability table (the naive reference aside)."""
    caps = _engine_or_skip(name).CAPABILITIES
    out = []
    for method in caps.methods:
        if method == "naive":
            continue
        for variant in (caps.variants if method == "antidiagonal" else ("accumulator",)):
            out.append((method, variant))
    return out


def _to_engine(name, *arrays):
    """The arrays in the namespace the engine takes (cupy for a cupy-only engine)."""
    caps = _engine_or_skip(name).CAPABILITIES
    if "cupy" in caps.namespaces and "numpy" not in caps.namespaces:
        if not HAS_GPU:
            pytest.skip("no CUDA device")
        import cupy
        return tuple(None if a is None else cupy.asarray(a) for a in arrays)
    return arrays


def _host(x):
    return bakron._xp.to_numpy(x)


ENGINE_NAMES = list(registry.ENGINE_MODULES)


def test_every_engine_satisfies_the_contract():
    for name in ENGINE_NAMES:
        eng = registry.load(name)
        if eng is None:
            continue
        assert isinstance(eng, engines.Engine), name
        assert eng.NAME == name
        caps = eng.CAPABILITIES
        assert caps.methods and set(caps.methods) <= set(bakron.solvers.METHODS) - {"auto"}
        assert set(caps.dtypes) <= {"float32", "float64"}
        # the optional hooks: every declared one is there, and an engine that has a hook
        # declares it (solve and the stack layer call only declared hooks)
        for hook in engines.HOOKS:
            assert caps.has(hook) == callable(vars(eng).get(hook)), (name, hook)


def test_capability_table_refuses_unknown_hooks():
    with pytest.raises(ValueError, match="unknown hook.*'solve_stak'"):
        engines.Capabilities(methods=("recursive",), hooks=("solve_stak",))
    caps = engines.Capabilities(methods=("recursive",), hooks=[engines.COUNT_NONFINITE])
    assert caps.has(engines.COUNT_NONFINITE) and not caps.has(engines.SOLVE_STACK)
    assert not engines.offers(None, engines.COUNT_NONFINITE)
    with pytest.raises(ValueError, match="unknown hook"):
        caps.has("count_nan")


@pytest.mark.parametrize("name", ENGINE_NAMES)
@pytest.mark.parametrize("path", REFERENCE_CASES, ids=lambda p: p.rsplit("/", 1)[-1][:-4])
def test_every_method_of_every_engine_on_the_reference_cases(ref_case, name, path):
    d = ref_case(path)
    tile = tuple(int(t) for t in d["tile"])
    q = bakron.UniformQuantizer(int(d["bits"]), float(d["scale"]))
    W, AO, AI = _to_engine(name, d["W"], d["L_out"], d["L_in"])
    for method, variant in _paths(name):
        for base in (1, 2, None):
            r = bakron.solve(W, AO, AI, q, tile=tile, method=method, variant=variant,
                             base=base, engine=name)
            assert r.engine == name and r.method == method
            np.testing.assert_array_equal(_host(r.values), d["hatW"],
                                          err_msg=f"{name} {method} {variant} {base}")
            np.testing.assert_array_equal(_host(r.codes).astype(np.float64) * float(d["scale"]),
                                          d["hatW"])
            if method == "antidiagonal":
                break  # base plays no part


@st.composite
def _cases(draw):
    m = draw(st.integers(1, 14))
    n = draw(st.integers(1, 14))
    return dict(seed=draw(st.integers(0, 2**31 - 1)), m=m, n=n,
                tx=draw(st.integers(1, min(m, 4))), ty=draw(st.integers(1, min(n, 4))),
                two_sided=draw(st.booleans()), bits=draw(st.integers(2, 6)),
                symmetric=draw(st.booleans()),
                granularity=draw(st.sampled_from(["tensor", "row", "group"])),
                group_size=draw(st.integers(1, n)), base=draw(st.integers(1, 3)))


@pytest.mark.parametrize("name", ENGINE_NAMES)
@settings(max_examples=25, deadline=None)
@given(c=_cases())
def test_every_method_of_every_engine_equals_the_naive_solver(name, c):
    """float64: Ŵ and codes of every (method, variant, base) of the engine equal the naive
    vec-form solver's exactly, ragged tiles, one- and two-sided problems included."""
    W, f_in, f_out = problem(c["seed"], c["m"], c["n"], c["tx"], c["ty"],
                             two_sided=c["two_sided"])
    q = make_quantizer(None, W, c["bits"], c["symmetric"], c["granularity"], c["group_size"])
    A_out = None if f_out is None else f_out.A
    tile = (c["tx"], c["ty"])
    ref = bakron.solve(W, A_out, f_in.A, q, tile=tile, method="naive", engine="array_api")
    Wd, AOd, AId = _to_engine(name, W, A_out, f_in.A)
    for method, variant in _paths(name):
        r = bakron.solve(Wd, AOd, AId, q, tile=tile, method=method, variant=variant,
                         base=c["base"], engine=name)
        np.testing.assert_array_equal(_host(r.values), ref.values, err_msg=f"{method} {variant}")
        np.testing.assert_array_equal(_host(r.codes), ref.codes, err_msg=f"{method} {variant}")


def test_capability_table_is_consulted_before_any_work():
    W, f_in, f_out = problem(0, 12, 10, 4, 4)
    q = bakron.UniformQuantizer.fit(W, 3)
    with pytest.raises(ValueError, match="not available on engine 'array_api'"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=4, method="wavefront", engine="array_api")
    if registry.load("numba") is not None:
        with pytest.raises(ValueError, match="method='naive' is not available on engine"):
            bakron.solve(W, f_out.A, f_in.A, q, tile=4, method="naive", engine="numba")
        class Shifted(bakron.UniformQuantizer):
            def quantize(self, targets, rows=None, cols=None):
                return super().quantize(targets, rows=rows, cols=cols)
        with pytest.raises(ValueError, match="engine='numba' does not support this problem: "
                                             "quantizer Shifted"):
            bakron.solve(W, f_out.A, f_in.A, Shifted(3, 0.5), tile=4, engine="numba")
        # auto: what numba's table lacks runs on the array-API engine
        assert bakron.solve(W, f_out.A, f_in.A, q, tile=4, method="naive").engine == "array_api"
    r = bakron.solve(W, f_out.A, f_in.A, q, tile=4, engine="array_api", method="recursive")
    assert r.info["quantizer_calls"] > 0 and r.info["base"] == 8


def test_engines_hand_back_new_arrays():
    """The caller's arrays are not modified and are not the outputs."""
    W, f_in, f_out = problem(1, 20, 18, 4, 4)
    q = bakron.UniformQuantizer.fit(W, 3)
    copies = [x.copy() for x in (W, f_in.A, f_out.A)]
    for name in ("array_api", "numba"):
        if registry.load(name) is None:
            continue
        for method in ("recursive", "antidiagonal"):
            r = bakron.solve(W, f_out.A, f_in.A, q, tile=4, engine=name, method=method,
                             return_targets=True)
            assert not np.shares_memory(r.values, W) and r.targets is not None
    for x, x0 in zip((W, f_in.A, f_out.A), copies):
        np.testing.assert_array_equal(x, x0)


def test_engines_leave_the_problem_as_it_was():
    """An engine reads the Problem and writes none of its fields (no outputs stored on it)."""
    import array_api_compat.numpy as xnp

    from bakron.solvers._problem import Problem

    W, f_in, f_out = problem(2, 20, 18, 4, 4)
    q = bakron.UniformQuantizer.fit(W, 3)
    for name in ENGINE_NAMES:
        eng = registry.load(name)
        if eng is None or eng.CAPABILITIES.namespaces == ("cupy",):
            continue
        for method in ("recursive", "antidiagonal"):
            p = Problem(xnp, W, f_out.A, f_in.A, q, (4, 4), record_targets=True)
            before = dict(p.__dict__)
            out = eng.run(p, method, 2, "accumulator")
            assert p.__dict__.keys() == before.keys(), name
            assert all(p.__dict__[k] is v for k, v in before.items()), name
            assert out.values.shape == W.shape and out.targets is not None


# ------------------------------------------------------------------------------------------
# the schedule
# ------------------------------------------------------------------------------------------

def _dominance_ok(order):
    """Every tile comes after all the tiles that dominate it (k >= a, l >= b)."""
    pos = {t: i for i, t in enumerate(order)}
    for (a, b), i in pos.items():
        for (k, l), j in pos.items():
            if k >= a and l >= b and (k, l) != (a, b) and j >= i:
                return False
    return True


@given(st.integers(1, 7), st.integers(1, 7), st.booleans())
def test_tile_wavefront_covers_each_tile_once_in_dominance_order(Mb, Nb, two):
    steps = tile_wavefront(Mb, Nb, two)
    assert len(steps) == step_count(Mb, Nb, two)
    assert max(len(s) for s in steps) == step_width(Mb, Nb, two)
    flat = [t for s in steps for t in s]
    assert sorted(flat) == [(a, b) for a in range(Mb) for b in range(Nb)]
    if two:
        # the tiles of a step do not dominate each other, so any order inside a step works
        for s in steps:
            assert all(not (k >= a and l >= b) for (a, b) in s for (k, l) in s if (k, l) != (a, b))
        assert _dominance_ok(flat)


def _leaf_order(plan, seq):
    tiles = []
    for blk in seq:
        tiles += [(a, b) for a in range(blk.ra, blk.rb) for b in range(blk.ca, blk.cb)]
    return tiles


@settings(max_examples=60)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 4), st.booleans())
def test_recursion_plan_orders(M, N, base, two):
    rows, cols = tile_edges(M * 3, 3), tile_edges(N * 2, 2)
    plan = RecursionPlan(rows, cols, base, two)
    leaves = plan.leaves()
    # the leaves partition the tiles, none larger than base (rows unsplit one-sided)
    cover = sorted(t for b in leaves for t in [(a, c) for a in range(b.ra, b.rb)
                                                  for c in range(b.ca, b.cb)])
    assert cover == [(a, c) for a in range(M) for c in range(N)]
    assert all(b.cb - b.ca <= base and (not two or b.rb - b.ra <= base) for b in leaves)
    # depth-first: solving leaves in sequence order (their own tiles bottom-right first)
    # respects dominance between leaves
    order = []
    for b in leaves:
        order += sorted([(a, c) for a in range(b.ra, b.rb) for c in range(b.ca, b.cb)],
                        reverse=True)
    if two:
        assert _dominance_ok(order)
    else:  # one-sided: rows are independent, columns from the right
        cols_seen = [c for b in leaves for c in range(b.cb - 1, b.ca - 1, -1)]
        assert cols_seen == sorted(cols_seen, reverse=True)
    # level-synchronous: the same leaves and updates, each update after the leaves it reads
    # and before the leaves it feeds, every region updated in the same relative order
    ph_leaves = [b for kind, what in plan.phases if kind == "leaves" for b in what]
    ph_updates = [u for kind, u in plan.phases if kind == "update"]
    seq_updates = [op for op in plan.sequence if not isinstance(op, Block)]
    assert sorted(ph_leaves, key=lambda b: (b.ra, b.ca)) == sorted(leaves,
                                                                  key=lambda b: (b.ra, b.ca))
    assert sorted(map(repr, ph_updates)) == sorted(map(repr, seq_updates))
    for ops in (plan.sequence, [x for kind, what in plan.phases
                                for x in (what if kind == "leaves" else [what])]):
        _check_update_order(plan, ops)


def _check_update_order(plan, ops):
    """Each update comes after the leaves inside the quadrants it reads and before the
    leaves inside the quadrant it writes."""
    done = set()
    for i, op in enumerate(ops):
        if isinstance(op, Block):
            done.add(op)
            continue
        kids = plan.children(op.block)
        ph = 0 if op.kind in (AFTER_D, AFTER_RIGHT, AFTER_BOTTOM) else 1
        read = [b for grp in kids[:ph + 1] for b in grp]
        write = [b for grp in kids[ph + 1:] for b in grp]
        inside = lambda leaf, q: (q.ra <= leaf.ra and leaf.rb <= q.rb and q.ca <= leaf.ca
                                  and leaf.cb <= q.cb)  # noqa: E731
        later = [x for x in ops[i + 1:] if isinstance(x, Block)]
        for q in read:
            assert not any(inside(x, q) for x in later), (op, q)
        for q in write:
            assert not any(inside(x, q) for x in done), (op, q)


@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 4), st.booleans())
def test_two_level_covers_each_tile_once_in_dominance_order(M, N, cs, two):
    steps = two_level(M, N, cs, two)
    tiles = []
    for i, step in enumerate(steps):
        assert step.gather == (i > 0) and step.scatter == (two and i < len(steps) - 1)
        for b in step.blocks:
            assert b.rb - b.ra <= cs and b.cb - b.ca <= cs
            local = tile_wavefront(*b.shape, two)
            tiles += [(b.ra + a, b.ca + c) for s in local for a, c in s]
    assert sorted(tiles) == [(a, c) for a in range(M) for c in range(N)]
    if two:
        assert _dominance_ok(tiles)


def _kinds(M, N, base, two):
    plan = RecursionPlan(tile_edges(M, 1), tile_edges(N, 1), base, two)
    return {op.kind for op in plan.sequence if not isinstance(op, Block)}


def test_update_kinds_are_the_documented_ones():
    assert _kinds(16, 16, 2, True) == {AFTER_D, AFTER_BC}
    assert _kinds(16, 4, 2, True) == {AFTER_D, AFTER_BC, AFTER_BOTTOM}
    assert _kinds(4, 16, 2, True) == {AFTER_D, AFTER_BC, AFTER_RIGHT}
    assert _kinds(16, 16, 2, False) == {AFTER_RIGHT}
    with pytest.raises(ValueError, match="base must be >= 1"):
        RecursionPlan([0, 4], [0, 4], 0, True)
