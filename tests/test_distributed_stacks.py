"""The distributed runner's stacks (docs/distributed.md "Stacks"): same-shape layers run as one
task, outputs bitwise identical to one layer per task, per-layer write-once files and retries."""
from __future__ import annotations

import os

import numpy as np
import pytest

from bakron import _safetensors
from bakron.distributed import LayerJob, read_journal, read_manifest, run_layers
from bakron.distributed import _task
from bakron.distributed._jobs import job_key, stack_key
from bakron.distributed._synthetic import write_synthetic_layers

SETTINGS = dict(bits=3, tile=8, engine="array_api", dtype="float64")
# 24 x 32 two-sided (dense), 24 x 32 diagonal H_out, 24 x 32 one-sided, 16 x 24 two-sided
SHAPES = [(24, 32)] * 7 + [(16, 24)] * 3
KINDS = ["dense", "dense", "diag", "none", "dense", "none", "dense", "dense", "dense", "dense"]


@pytest.fixture
def layers(tmp_path):
    return write_synthetic_layers(tmp_path / "in", SHAPES, kinds=KINDS, seed=4,
                                  w_dtype=np.float64)


def make_jobs(layers, **settings):
    return [LayerJob.make(d["name"], d["W"], d["H_in"], d["H_out"], **dict(SETTINGS, **settings))
            for d in layers]


def tensors(out, name):
    return _safetensors.load(os.path.join(out, "layers", f"{name}.safetensors"))


def assert_same(out_a, out_b, names):
    for n in names:
        a, b = tensors(out_a, n), tensors(out_b, n)
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), (n, k)


def stack_sizes(out):
    return {n: r.get("stack") for n, r in read_manifest(out)["layers"].items()}


def test_stack_keys(layers):
    jobs = make_jobs(layers)
    keys = [stack_key(j)[0] for j in jobs]
    assert keys[0] == keys[1] == keys[4] == keys[6]  # 24 x 32, dense H_out
    assert len({keys[0], keys[2], keys[3], keys[7]}) == 4  # dense, diag, none, other shape
    assert keys[3] == keys[5]
    one = make_jobs(layers, one_sided=True)
    assert stack_key(one[0])[0] == stack_key(one[2])[0] == stack_key(one[3])[0]
    assert stack_key(make_jobs(layers, bits=4)[0])[0] != keys[0]


def test_in_process_stacks_equal_one_layer_per_task(layers, tmp_path):
    jobs = make_jobs(layers)
    names = [j.name for j in jobs]
    one = run_layers(jobs, tmp_path / "one", stack_memory=None)
    stk = run_layers(jobs, tmp_path / "stk")
    assert one.ok and stk.ok and sorted(stk.solved) == sorted(names)
    assert_same(str(tmp_path / "one"), str(tmp_path / "stk"), names)
    sizes = stack_sizes(str(tmp_path / "stk"))
    assert [sizes[n] for n in names] == [4, 4, 1, 2, 4, 2, 4, 3, 3, 3]
    assert stk.stacks == 4 and one.stacks == 10 and "; 4 stacks (" in stk.summary()
    assert set(stack_sizes(str(tmp_path / "one")).values()) == {1}
    m1, m2 = read_manifest(str(tmp_path / "one")), read_manifest(str(tmp_path / "stk"))
    for n in names:  # same keys and checksums: the files are the same bytes but for metadata
        assert m1["layers"][n]["key"] == m2["layers"][n]["key"]
    # a rerun with stacks finds every layer done and solves nothing
    again = run_layers(jobs, tmp_path / "stk")
    assert not again.solved and sorted(again.reused) == sorted(names)


def test_a_failed_stack_publishes_what_it_solved_and_a_retry_skips_it(layers, tmp_path,
                                                                      monkeypatch):
    jobs = make_jobs(layers)[:2] + [make_jobs(layers)[4], make_jobs(layers)[6]]
    out = str(tmp_path / "o")
    os.makedirs(os.path.join(out, "layers"))
    keys = [job_key(j) for j in jobs]
    stems = [j.name for j in jobs]
    from bakron import pipeline

    orig = pipeline.quantize_arrays_stack

    def flaky(layers_, *a, **k):  # the third layer hits a device error (not its inputs' fault)
        got = orig(layers_, *a, **k)
        got[2] = RuntimeError("CUDA error: an illegal memory access was encountered")
        return got

    monkeypatch.setattr(pipeline, "quantize_arrays_stack", flaky)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _task.run_stack(jobs, out, stems, keys)
    published = sorted(r["name"] for r in read_journal(out))
    assert published == sorted(stems[:2] + stems[3:])
    monkeypatch.setattr(pipeline, "quantize_arrays_stack", orig)
    recs = _task.run_stack(jobs, out, stems, keys)  # the retry
    assert [r["status"] for r in recs] == ["done"] * 4
    assert [r["wrote"] for r in recs] == [False, False, True, False]
    counts = {}
    for r in read_journal(out):
        counts[r["name"]] = counts.get(r["name"], 0) + 1
    assert counts == {n: 1 for n in stems}
    ref = run_layers(jobs, tmp_path / "ref", stack_memory=None)
    assert ref.ok
    assert_same(out, str(tmp_path / "ref"), stems)


def test_bad_inputs_fail_alone_inside_a_stack(layers, tmp_path):
    jobs = make_jobs(layers)
    bad = tmp_path / "poison.npz"
    m, n = SHAPES[0]
    H = np.full((n, n), 5.0) - 4.0 * np.eye(n)  # symmetric, unit diagonal, eigenvalue -4
    np.savez(bad, W=np.ones((m, n)), H=H, O=np.eye(m))
    jobs.insert(1, LayerJob.make("poison", f"{bad}::W", f"{bad}::H", f"{bad}::O", **SETTINGS))
    res = run_layers(jobs, tmp_path / "o")
    assert set(res.failed) == {"poison"} and "not positive definite" in res.failed["poison"]
    assert stack_sizes(str(tmp_path / "o"))["poison"] == 5
    assert len(res.solved) == len(layers)


distributed = pytest.importorskip("distributed", reason="dask.distributed is not installed")


def test_dask_stacks_are_identical_to_the_local_path(tmp_path):
    from bakron.distributed import cpu_cluster

    layers = write_synthetic_layers(tmp_path / "in", [(24, 32)] * 12 + [(16, 24)] * 2,
                                    kinds=["dense", "diag"] * 6 + ["none"] * 2, seed=8,
                                    w_dtype=np.float64)
    jobs = make_jobs(layers)
    bad = tmp_path / "poison.npz"
    n = 32
    np.savez(bad, W=np.ones((24, n)), H=np.full((n, n), 5.0) - 4.0 * np.eye(n), O=np.eye(24))
    jobs.insert(2, LayerJob.make("poison", f"{bad}::W", f"{bad}::H", f"{bad}::O", **SETTINGS))
    names = [d["name"] for d in layers]
    ref = run_layers(jobs, tmp_path / "ref", stack_memory=None)
    with cpu_cluster(2) as cluster, distributed.Client(cluster) as client:
        res = run_layers(jobs, tmp_path / "dask", client, retries=1)
        sizes = stack_sizes(str(tmp_path / "dask"))
        again = run_layers(jobs, tmp_path / "dask", client)
    for r in (ref, res):
        assert set(r.failed) == {"poison"} and sorted(r.solved) == sorted(names)
    assert_same(str(tmp_path / "ref"), str(tmp_path / "dask"), names)
    man = read_manifest(str(tmp_path / "dask"))
    assert all(man["layers"][n]["worker"].startswith("tcp://127.0.0.1:") for n in names)
    # 2 workers, each group cut into 4 stacks (two per worker): 7 dense (poison included) in
    # 2 + 2 + 2 + 1, 6 diagonal in 2 + 2 + 1 + 1, 2 one-sided in 1 + 1: 10 tasks, 15 layers
    assert sorted(sizes.values()) == sorted([2] * 6 + [1] + [2] * 4 + [1] * 2 + [1] * 2)
    assert sum(1 / s for s in sizes.values()) == pytest.approx(10) and res.stacks == 10
    counts = {}
    for r in read_journal(str(tmp_path / "dask")):
        counts[r["name"]] = counts.get(r["name"], 0) + 1
    assert counts == {n: 1 for n in names}  # the poison was reported, not retried
    assert not again.solved and sorted(again.reused) == sorted(names)
