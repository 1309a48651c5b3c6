"""Sharded global Hessians (bakron.distributed.hessian), in-process: agreement with the unsharded
driver, bitwise independence of ranges/budgets/order, the reduce's formula, resume, failures.
(The 2-worker Dask run is in test_distributed_dask.py.)"""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest

import bakron.hessian as bh
from bakron import _safetensors
from bakron.distributed import LayerJob, read_manifest, run_layers
from bakron.distributed._synthetic import synthetic_chain
from bakron.distributed.hessian import PARTIAL_FORMAT, sharded_global_factors
from bakron.factor_files import load_factors, unpack_upper

WIDTHS = [12, 48, 48, 48, 8]  # buffer-heavy: a small budget bisects the layer range


def model(seed=0):
    """(Linear → GELU) x 3 → Linear → softmax head (Fisher labels)."""
    return synthetic_chain(WIDTHS, seed)


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((120, WIDTHS[0]))
    return [X[i:i + 12] for i in range(0, 120, 12)]  # 10 batches


def shards_of(batches, cuts):
    return [batches[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def factors_of(res):
    return {n: res.load(n) for n in sorted(res.factors)}


def test_sharded_equals_unsharded_up_to_summation_order(batches, tmp_path):
    ref, _ = bh.global_factors(model(), batches, seed=7)
    res = sharded_global_factors(model, shards_of(batches, [0, 3, 4, 10]), tmp_path / "o",
                                 seed=7)
    assert res.ok and res.exit_code == 0 and sorted(res.factors) == sorted(ref)
    assert res.partials_computed == 3 and res.reduces_computed == 4
    for n, (H_in, H_out) in factors_of(res).items():
        # the labels of shard s are drawn under global batch indices: same Fisher sample
        np.testing.assert_allclose(H_in, ref[n][0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(H_out, ref[n][1], rtol=1e-12, atol=1e-14)
        assert np.array_equal(H_in, H_in.T) and np.array_equal(H_out, H_out.T)
    # one shard is exactly the unsharded run's accumulation
    one = sharded_global_factors(model, [batches], tmp_path / "one", seed=7)
    for n, (H_in, H_out) in factors_of(one).items():
        np.testing.assert_allclose(H_in, ref[n][0], rtol=1e-14, atol=1e-15)


def test_bitwise_independent_of_ranges_budget_and_task_order(batches, tmp_path):
    shards = shards_of(batches, [0, 2, 5, 10])
    base = factors_of(sharded_global_factors(model, shards, tmp_path / "a", seed=1))
    # a budget small enough that each shard's pass bisects the layer range
    budget = 125000
    plan = bh.plan_global(model(), shards[2], budget_bytes=budget)
    assert plan["splits"], "the budget should force a layer-range bisection"
    bisected = sharded_global_factors(model, shards, tmp_path / "b", seed=1,
                                      budget_bytes=budget)
    assert bisected.ok, bisected.failed
    man = read_manifest(str(tmp_path / "b"))
    assert all(int(p["passes"]) > 1 for p in man["partials"].values())  # bisection ran
    halves = sharded_global_factors(model, shards, tmp_path / "c", seed=1, layer_ranges=2)
    mixed = sharded_global_factors(model, shards, tmp_path / "d", seed=1,
                                   layer_ranges=[["fc3", "fc2"], ["fc0"], ["fc1"]])
    for res in (bisected, halves, mixed):
        for n, (H_in, H_out) in factors_of(res).items():
            assert np.array_equal(H_in, base[n][0]) and np.array_equal(H_out, base[n][1])


def test_sample_and_token_weights(batches, tmp_path):
    rng = np.random.default_rng(9)
    w = [rng.uniform(0, 2, b.shape[0]) for b in batches]      # one weight per sample
    ref, _ = bh.global_factors(model(), batches, seed=4, weights=w)
    cuts = [0, 6, 10]
    res = sharded_global_factors(model, shards_of(batches, cuts), tmp_path / "o", seed=4,
                                 weights=shards_of(w, cuts))
    for n, (H_in, H_out) in factors_of(res).items():
        np.testing.assert_allclose(H_in, ref[n][0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(H_out, ref[n][1], rtol=1e-12, atol=1e-14)
    man = read_manifest(str(tmp_path / "o"))
    total = sum(float(p["weight"]) for p in man["partials"].values())
    assert total == pytest.approx(float(sum(x.sum() for x in w)), rel=1e-14)
    with pytest.raises(ValueError, match="weights"):
        sharded_global_factors(model, shards_of(batches, cuts), tmp_path / "p",
                               weights=[None])


def test_reduce_is_factor_accumulator_merge_in_shard_order(batches, tmp_path):
    shards = shards_of(batches, [0, 4, 7, 10])
    res = sharded_global_factors(model, shards, tmp_path / "o", seed=2)
    parts = sorted((tmp_path / "o" / "partials" / "r000").glob("s*.safetensors"))
    assert [p.name for p in parts] == ["s00000.safetensors", "s00001.safetensors",
                                       "s00002.safetensors"]
    for n in res.factors:
        accs = []
        for p in parts:
            meta = _safetensors.metadata(p)
            assert meta["format"] == PARTIAL_FORMAT
            t = _safetensors.load(p, [f"{n}.in_sum"])
            S = unpack_upper(t[f"{n}.in_sum"])
            assert S.dtype == np.float64
            accs.append(bh.FactorAccumulator.from_state_dict(
                {"sum": bh.pack_upper(np, S), "n": S.shape[0], "weight": float(meta["weight"]),
                 "count": 1}))
        merged = bh.FactorAccumulator.merge_all(accs).value()
        assert np.array_equal(merged, res.load(n)[0])
        assert sum(a.weight for a in accs) == 120.0  # tokens over all shards


def test_resume_recomputes_only_what_is_missing(batches, tmp_path):
    shards = shards_of(batches, [0, 5, 10])
    out = tmp_path / "o"
    first = sharded_global_factors(model, shards, out, seed=3, layer_ranges=3)
    ref = factors_of(first)
    again = sharded_global_factors(model, shards, out, seed=3, layer_ranges=3)
    assert again.partials_computed == 0 and again.reduces_computed == 0
    assert again.reduces_reused == 4  # ranges: [fc0], [fc1, fc2], [fc3]
    os.unlink(out / "factors" / "fc1.safetensors")            # a lost factor file
    os.unlink(out / "partials" / "r001" / "s00001.safetensors")  # and one of its partials
    with open(out / "factors" / "fc2.safetensors", "r+b") as f:  # a corrupt one
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    third = sharded_global_factors(model, shards, out, seed=3, layer_ranges=3)
    assert third.ok
    assert third.reduces_computed == 2 and third.reduces_reused == 2   # fc1, fc2 redone
    assert third.partials_computed == 1 and third.partials_reused == 1  # r001/s1 redone
    for n, (H_in, H_out) in factors_of(third).items():
        assert np.array_equal(H_in, ref[n][0]) and np.array_equal(H_out, ref[n][1])


def test_shard_arrays_are_used_as_aligned_copies():
    """Arrays that arrive from the network can be unaligned; numpy's matmul then leaves BLAS
    and rounds differently, so a task copies its shard (the Dask test caught this)."""
    from bakron.distributed.hessian import _shard_batches

    raw = bytearray(8 * 24 + 3)
    x = np.frombuffer(raw, dtype=np.float64, count=24, offset=3).reshape(2, 12)
    assert not x.flags.aligned
    for src in (x, [x, x]):
        got = _shard_batches(src, None)
        assert all(b.flags.aligned and b.flags.c_contiguous and b.flags.writeable for b in got)
        assert all(b.base is None and np.array_equal(b, x) for b in got)


def test_a_bad_shard_is_reported(batches, tmp_path):
    bad = [b.copy() for b in batches[:2]]
    bad[1][0, 0] = np.nan
    res = sharded_global_factors(model, [batches[2:], bad], tmp_path / "o", seed=0)
    assert not res.ok and res.exit_code == 1 and set(res.failed) == {"fc0", "fc1", "fc2", "fc3"}
    man = read_manifest(str(tmp_path / "o"))
    assert "NaN" in man["partials"]["r000/s00001"]["error"]
    assert man["partials"]["r000/s00000"]["status"] == "done"
    with pytest.raises(ValueError, match="not in the chain"):
        sharded_global_factors(model, [batches], tmp_path / "p", layer_ranges=[["fc9"]])


def test_shard_files_and_factor_files_feed_the_layer_jobs(batches, tmp_path):
    """.npy/.npz shards in, factor files out, solved by run_layers with the model's weights."""
    X = np.concatenate(batches)
    np.save(tmp_path / "s0.npy", X[:60])
    np.savez(tmp_path / "s1.npz", a=X[60:84], b=X[84:120])
    m = functools.partial(model, 0)
    res = sharded_global_factors(m, [tmp_path / "s0.npy", tmp_path / "s1.npz"],
                                 tmp_path / "hess", seed=4, batch_size=None)
    ref, _ = bh.global_factors(model(), [X[:60], X[60:84], X[84:120]], seed=4)
    for n in ref:
        fs = load_factors(res.factors[n])
        np.testing.assert_allclose(fs.h_in, ref[n][0], rtol=1e-12, atol=1e-14)
    stages = model()
    jobs = []
    for st in stages[:-1]:
        if isinstance(st, bh.Linear):
            wp = tmp_path / f"{st.name}.npy"
            np.save(wp, st.W)
            f = res.factors[st.name]
            jobs.append(LayerJob.make(st.name, wp, f"{f}::hin", f"{f}::hout", bits=4, tile=4,
                                      engine="array_api"))
    out = run_layers(jobs, tmp_path / "q")
    assert out.ok and len(out.solved) == 4
