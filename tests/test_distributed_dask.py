"""bakron.distributed on a real 2-worker Dask LocalCluster (loopback, processes, 1 thread each).

Skipped when dask.distributed is not installed (``pip install 'bakron[dask]'``).
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

distributed = pytest.importorskip("distributed", reason="dask.distributed is not installed "
                                  "(pip install 'bakron[dask]')")

from bakron import _safetensors  # noqa: E402
from bakron.distributed import (LayerJob, cpu_cluster, read_journal, read_manifest,  # noqa: E402
                                run_layers, visible_gpus)
from bakron.distributed._synthetic import synthetic_chain, write_synthetic_layers  # noqa: E402
from bakron.distributed.hessian import sharded_global_factors  # noqa: E402

# array_api engine: no JIT warm-up in every worker process (the machinery is under test here)
SETTINGS = dict(bits=3, tile=8, engine="array_api")


@pytest.fixture(scope="module")
def client():
    cluster = cpu_cluster(2)
    c = distributed.Client(cluster)
    try:
        yield c
    finally:
        c.close()
        cluster.close()


def make_jobs(layers):
    return [LayerJob.make(d["name"], d["W"], d["H_in"], d["H_out"], **SETTINGS) for d in layers]


def data_of(out, name):
    return _safetensors.load(os.path.join(out, "layers", f"{name}.safetensors"))


def assert_same_layers(out_a, out_b, names):
    for n in names:
        a, b = data_of(out_a, n), data_of(out_b, n)
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), (n, k)


def journal_counts(out):
    counts = {}
    for r in read_journal(out):
        counts[r["name"]] = counts.get(r["name"], 0) + 1
    return counts


def test_dask_run_is_bitwise_identical_to_in_process_and_isolates_failures(client, tmp_path):
    layers = write_synthetic_layers(tmp_path / "in", [(48, 32), (40, 40), (64, 24), (32, 56),
                                                      (56, 48), (24, 32), (72, 40), (40, 72)],
                                    kinds=["dense", "diag", "none", "dense"] * 2, seed=3)
    jobs = make_jobs(layers)
    bad = tmp_path / "poison.npz"
    np.savez(bad, W=np.ones((16, 8), np.float32), H=-np.eye(8))  # negative diagonal
    jobs.insert(3, LayerJob.make("poison", f"{bad}::W", f"{bad}::H", **SETTINGS))
    ref = run_layers(jobs, tmp_path / "ref")
    res = run_layers(jobs, tmp_path / "dask", client, retries=1)
    good = [d["name"] for d in layers]
    for r in (ref, res):
        assert r.exit_code == 1 and set(r.failed) == {"poison"}
        assert "negative" in r.failed["poison"] and sorted(r.solved) == sorted(good)
    assert_same_layers(str(tmp_path / "ref"), str(tmp_path / "dask"), good)
    man = read_manifest(str(tmp_path / "dask"))
    workers = {man["layers"][n]["worker"] for n in good}
    assert all(w.startswith("tcp://127.0.0.1:") for w in workers)
    assert man["layers"]["poison"]["status"] == "failed"
    ref_man = read_manifest(str(tmp_path / "ref"))
    for n in good:
        assert man["layers"][n]["key"] == ref_man["layers"][n]["key"]
        assert man["layers"][n]["device"] == "cpu" and man["layers"][n]["damp_in"] == 0.01
    # the poison layer was reported, not retried: exactly one attempt per layer in the journal
    assert journal_counts(str(tmp_path / "dask")) == {n: 1 for n in good}
    # resume through the cluster: nothing to do but the failed layer, which fails again
    again = run_layers(jobs, tmp_path / "dask", client)
    assert not again.solved and sorted(again.reused) == sorted(good)
    assert set(again.failed) == {"poison"}


@pytest.mark.slow   # its own cluster of worker processes, one of them killed
def test_worker_killed_mid_run_loses_nothing_and_writes_nothing_twice(tmp_path):
    layers = write_synthetic_layers(tmp_path / "in", [(320, 256)] * 10, seed=5)
    jobs = make_jobs(layers)
    names = [j.name for j in jobs]
    out = str(tmp_path / "out")
    cluster = cpu_cluster(2)
    client = distributed.Client(cluster)
    box: list = []
    try:
        driver = threading.Thread(target=lambda: box.append(
            run_layers(jobs, out, client, retries=2)))
        driver.start()
        victim, deadline = None, time.monotonic() + 120
        while time.monotonic() < deadline and driver.is_alive():
            busy = [w for w, keys in client.processing().items() if keys]
            if busy and read_journal(out):  # mid-run: some layers done, this one busy
                victim = busy[0]
                break
            time.sleep(0.01)
        assert victim is not None, "the run finished before a worker could be killed"
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        driver.join(300)
        assert not driver.is_alive()
    finally:
        client.close()
        cluster.close()
    res = box[0]
    assert res.ok, res.failed
    assert sorted(res.solved + res.reused) == sorted(names)
    counts = journal_counts(out)
    assert all(counts.get(n, 0) <= 1 for n in names), counts  # never published twice
    for n in names:  # every layer is there, valid, and its file is the journaled one
        meta = _safetensors.metadata(os.path.join(out, "layers", f"{n}.safetensors"))
        ids = [r["write_id"] for r in read_journal(out) if r["name"] == n]
        assert not ids or ids == [meta["write_id"]]
    assert {r["status"] for r in read_manifest(out)["layers"].values()} == {"done"}
    ref = str(tmp_path / "ref")
    try:  # the workers run BLAS single-threaded; so does this reference (and it is faster)
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover
        run_layers(jobs, ref)
    else:
        with threadpool_limits(1):
            run_layers(jobs, ref)
    assert_same_layers(ref, out, names)


def test_sharded_hessians_bitwise_identical_on_the_cluster(client, tmp_path):
    """Partials as Dask tasks (model sent once, or built on the workers by a factory), reduces
    depending on them: the same bits as the in-process run, whatever worker ran what."""
    widths = [12, 40, 40, 8]
    rng = np.random.default_rng(0)
    X = rng.standard_normal((96, 12))
    shards = [[X[i:i + 8] for i in range(a, b, 8)] for a, b in [(0, 24), (24, 40), (40, 96)]]
    factory = functools.partial(synthetic_chain, widths, 1)
    ref = sharded_global_factors(factory, shards, tmp_path / "ref", seed=5, layer_ranges=2)
    a = sharded_global_factors(factory, shards, tmp_path / "a", client, seed=5,
                               layer_ranges=2)
    b = sharded_global_factors(synthetic_chain(widths, 1), shards, tmp_path / "b", client,
                               seed=5, layer_ranges=[["fc2", "fc0"], ["fc1"]])
    for res in (ref, a, b):
        assert res.ok, res.failed
        assert sorted(res.factors) == ["fc0", "fc1", "fc2"]
    workers = {p["worker"] for p in read_manifest(str(tmp_path / "a"))["partials"].values()}
    assert all(w.startswith("tcp://127.0.0.1:") for w in workers)
    for n in ref.factors:
        r_in, r_out = ref.load(n)
        for res in (a, b):
            H_in, H_out = res.load(n)
            assert np.array_equal(H_in, r_in) and np.array_equal(H_out, r_out)


_GPU_CLUSTER = textwrap.dedent("""
    import json, os, sys
    from distributed import Client
    from bakron.distributed import LayerJob, gpu_cluster, run_layers
    layers, out = json.loads(sys.argv[1]), sys.argv[2]
    with gpu_cluster(["0", "1"], use_dask_cuda=False) as cluster, Client(cluster) as c:
        env = c.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
        info = c.scheduler_info(n_workers=-1)["workers"]
        jobs = [LayerJob.make(d["name"], d["W"], d["H_in"], d["H_out"], bits=3, tile=8,
                              engine="array_api") for d in layers]
        res = run_layers(jobs, out, c)
        cuda_mods = sorted(m for m in sys.modules if m.split(".")[0] in ("cupy", "cuda")
                           or m.startswith("numba.cuda"))
        print(json.dumps({"env": sorted(env.values()), "addresses": sorted(info),
                          "resources": [w["resources"] for w in info.values()],
                          "nthreads": [w["nthreads"] for w in info.values()],
                          "ok": res.ok, "solved": len(res.solved), "cuda_mods": cuda_mods}))
""")


@pytest.mark.slow   # a subprocess with its own cluster
def test_gpu_cluster_one_worker_per_gpu_without_cuda_in_the_client(tmp_path):
    """The GPU helper's cluster shape, checked on a CPU machine: one single-threaded loopback
    worker per GPU id with its own CUDA_VISIBLE_DEVICES and a GPU=1 resource that the layer
    tasks request; the client process imports no CUDA library."""
    layers = write_synthetic_layers(tmp_path / "in", [(32, 24), (24, 32), (40, 16)], seed=9)
    p = subprocess.run([sys.executable, "-c", _GPU_CLUSTER, json.dumps(layers),
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["env"] == ["0", "1"]
    assert all(a.startswith("tcp://127.0.0.1:") for a in r["addresses"])
    assert r["resources"] == [{"GPU": 1}, {"GPU": 1}] and r["nthreads"] == [1, 1]
    assert r["ok"] and r["solved"] == 3
    assert r["cuda_mods"] == []


def test_visible_gpus_reads_cuda_visible_devices(monkeypatch):
    for value, expect in [("", []), ("-1", []), ("0,2", ["0", "2"]), ("1,-1,3", ["1"]),
                          ("GPU-8a7b,GPU-19cd", ["GPU-8a7b", "GPU-19cd"])]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert visible_gpus() == expect
