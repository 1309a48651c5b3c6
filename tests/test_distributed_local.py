"""bakron.distributed without a cluster: keys, layer files, manifest, lock, resume, failures.

The in-process driver (``client=None``) is the reference that the Dask tests compare against;
everything here runs without dask installed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import bakron
from bakron import _safetensors
from bakron.distributed import (EXIT_FAILED, EXIT_LOCKED, EXIT_OK, EXIT_USAGE, LayerJob, LockHeld,
                                OutputLock, TensorRef, job_key, quantize_folder, read_journal,
                                read_manifest, run_layers, verify_layer_file)
from bakron.distributed._synthetic import write_synthetic_layers
from bakron.distributed._task import run_job
from bakron.factor_files import load_factors

SHAPES = [(48, 32), (40, 40), (64, 24), (32, 56), (56, 48), (24, 32)]
KINDS = ["dense", "diag", "none", "dense", "dense", "diag"]
SETTINGS = dict(bits=3, tile=8)


@pytest.fixture
def layers(tmp_path):
    return write_synthetic_layers(tmp_path / "in", SHAPES, kinds=KINDS, seed=11)


def make_jobs(layers, **settings):
    kw = dict(SETTINGS, **settings)
    return [LayerJob.make(d["name"], d["W"], d["H_in"], d["H_out"], **kw) for d in layers]


def layer_tensors(out, name):
    return _safetensors.load(os.path.join(out, "layers", f"{name}.safetensors"))


def npz_folder(path, n_layers=3, seed=0):
    """A `bakron quantize IN` folder: one .npz per layer with W and H_in."""
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    for i in range(n_layers):
        W = rng.standard_normal((24, 16)).astype(np.float32)
        X = rng.standard_normal((64, 16))
        np.savez(os.path.join(path, f"l{i}.npz"), W=W, H_in=X.T @ X)
    return path


def journal_counts(out):
    counts = {}
    for r in read_journal(out):
        counts[r["name"]] = counts.get(r["name"], 0) + 1
    return counts


# -- keys ------------------------------------------------------------------------------------

def test_keys_are_deterministic_and_content_addressed(layers, tmp_path):
    d = layers[0]
    a = LayerJob.make("x", d["W"], d["H_in"], d["H_out"], bits=3, tile=8)
    b = LayerJob.make("renamed", d["W"], d["H_in"], d["H_out"], bits=3, tile=(8, 8),
                      method="auto", damp=0.01)  # defaults given explicitly, another name
    assert job_key(a) == job_key(b)
    assert job_key(a) != job_key(LayerJob.make("x", d["W"], d["H_in"], d["H_out"], bits=4,
                                               tile=8))
    assert job_key(a) != job_key(LayerJob.make("x", d["W"], d["H_in"], None, bits=3, tile=8))
    # the same array in a .npz and a .npy file has the same checksum, so the same key
    W = _safetensors.load(d["W"].split("::")[0])["weight"]
    np.savez(tmp_path / "w.npz", W=W)
    np.save(tmp_path / "w.npy", W)
    c = LayerJob.make("x", f"{tmp_path / 'w.npz'}::W", d["H_in"], d["H_out"], bits=3, tile=8)
    e = LayerJob.make("x", tmp_path / "w.npy", d["H_in"], d["H_out"], bits=3, tile=8)
    assert job_key(a) == job_key(c) == job_key(e)
    # one changed weight changes the key
    W2 = W.copy()
    W2[3, 4] = np.nextafter(W2[3, 4], np.float32(1))
    np.save(tmp_path / "w2.npy", W2)
    f = LayerJob.make("x", tmp_path / "w2.npy", d["H_in"], d["H_out"], bits=3, tile=8)
    assert job_key(f) != job_key(a)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="unknown setting"):
        LayerJob.make("x", "a.npy", "b.npy", bitz=3)
    with pytest.raises(ValueError, match="bits"):
        LayerJob.make("x", "a.npy", "b.npy", bits=9)
    with pytest.raises(ValueError, match="group_size"):
        LayerJob.make("x", "a.npy", "b.npy", granularity="group")
    with pytest.raises(ValueError, match="device"):
        LayerJob.make("x", "a.npy", "b.npy", device="tpu")
    assert TensorRef.parse("/x/y.safetensors::a::b").name == "b"


# -- the in-process reference run --------------------------------------------------------------

def test_in_process_run_writes_verified_files_and_manifest(layers, tmp_path):
    out = str(tmp_path / "out")
    jobs = make_jobs(layers)
    res = run_layers(jobs, out)
    assert res.ok and res.exit_code == EXIT_OK
    assert sorted(res.solved) == sorted(j.name for j in jobs) and not res.reused
    man = read_manifest(out)
    for j in jobs:
        rec = man["layers"][j.name]
        assert rec["status"] == "done" and rec["key"] == job_key(j)
        assert rec["worker"] == "in-process" and rec["device"] == "cpu"
        assert rec["damp_in"] == 0.01 and rec["finished"] and rec["seconds"] > 0
        assert (rec["damp_out"] is None) == (j.H_out is None)
        path = os.path.join(out, rec["file"])
        ok, why, checksum, meta = verify_layer_file(path, rec["key"], rec["checksum"])
        assert ok, why
        # the file holds exactly what quantize_layer gives for these inputs
        t = layer_tensors(out, j.name)
        W = _safetensors.load(j.W.path)["weight"]
        fs = load_factors(j.H_in.path)
        H_out = fs.h_out if fs.h_out is not None else (
            np.diag(fs.h_out_diag) if fs.h_out_diag is not None else None)
        ref = bakron.quantize_layer(W, fs.h_in, H_out, bits=3, tile=8)
        assert np.array_equal(t["W_hat"], ref.values)
        assert np.array_equal(t["codes"], ref.codes.astype(np.int8))
        assert np.array_equal(t["scale"] * t["codes"], t["W_hat"])
        assert rec["proxy_error"] == pytest.approx(ref.proxy_error, rel=1e-12)
    assert journal_counts(out) == {j.name: 1 for j in jobs}
    assert not [f for f in os.listdir(os.path.join(out, "layers")) if ".tmp-" in f]


@pytest.mark.parametrize("settings", [dict(symmetric=False), dict(granularity="group",
                                                                  group_size=16)])
def test_layer_files_dequantize_like_bakron_quantize_outputs(layers, tmp_path, settings):
    from bakron.io import dequantize

    out = str(tmp_path / "out")
    jobs = make_jobs(layers[:3], **settings)
    assert run_layers(jobs, out).ok
    for j in jobs:
        t = layer_tensors(out, j.name)
        assert t["codes"].dtype == (np.uint8 if not settings.get("symmetric", True) else np.int8)
        W_hat = dequantize(t["codes"], t["scale"], t.get("zero_point"),
                           settings.get("group_size"), dtype=t["W_hat"].dtype)
        assert np.array_equal(W_hat, t["W_hat"])


def test_rerun_solves_nothing(layers, tmp_path):
    out = str(tmp_path / "out")
    jobs = make_jobs(layers)
    run_layers(jobs, out)
    before = {j.name: layer_tensors(out, j.name) for j in jobs}
    again = run_layers(jobs, out)
    assert again.ok and not again.solved and sorted(again.reused) == sorted(before)
    assert journal_counts(out) == {j.name: 1 for j in jobs}
    # new settings give new keys: the old files are moved aside and the layers redone
    third = run_layers(make_jobs(layers, bits=4), out)
    assert sorted(third.solved) == sorted(before) and len(third.quarantined) == len(jobs)
    assert all("key differs" in why for why, _ in third.quarantined.values())


def test_poison_layer_is_reported_and_the_others_finish(layers, tmp_path):
    bad = tmp_path / "bad.npz"
    H = np.eye(32)
    H[0, 0] = np.nan
    np.savez(bad, W=np.ones((16, 32), np.float32), H=H)
    jobs = make_jobs(layers)
    jobs.insert(2, LayerJob.make("poison", f"{bad}::W", f"{bad}::H", **SETTINGS))
    jobs.append(LayerJob.make("missing", tmp_path / "nope.npy", tmp_path / "nope2.npy",
                              **SETTINGS))
    out = str(tmp_path / "out")
    res = run_layers(jobs, out)
    assert not res.ok and res.exit_code == EXIT_FAILED
    assert set(res.failed) == {"poison", "missing"}
    assert "NaN" in res.failed["poison"] and "not found" in res.failed["missing"]
    man = read_manifest(out)
    assert man["layers"]["poison"]["status"] == "failed"
    assert "NaN" in man["layers"]["poison"]["error"]
    assert sorted(res.solved) == sorted(d["name"] for d in layers)
    assert not os.path.exists(os.path.join(out, "layers", "poison.safetensors"))


def test_changed_input_is_refused_by_the_task(layers, tmp_path):
    j = make_jobs(layers)[0]
    rec = run_job(j, str(tmp_path / "o"), j.name, "k" * 64,
                  checksums={"W": "sha256:" + "0" * 64})
    assert rec["status"] == "failed" and "changed since the run started" in rec["error"]


# -- corrupt outputs --------------------------------------------------------------------------

def _flip_byte(path, offset_from_end=5):
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x55]))


def test_corrupt_outputs_are_detected_and_redone(layers, tmp_path):
    out = str(tmp_path / "out")
    jobs = make_jobs(layers)
    run_layers(jobs, out)
    ref = {j.name: layer_tensors(out, j.name) for j in jobs}
    lp = lambda n: os.path.join(out, "layers", f"{n}.safetensors")  # noqa: E731
    _flip_byte(lp(jobs[0].name))                                   # data bit rot
    with open(lp(jobs[1].name), "r+b") as f:                       # truncated
        f.truncate(os.path.getsize(lp(jobs[1].name)) - 100)
    with open(lp(jobs[2].name), "r+b") as f:                       # header garbage
        f.seek(10)
        f.write(b"\xff\xfe")
    # a valid-looking file whose header was rewritten: only the manifest checksum catches it
    t = _safetensors.load(lp(jobs[3].name))
    meta = _safetensors.metadata(lp(jobs[3].name))
    meta["device"] = "cuda:7"
    os.unlink(lp(jobs[3].name))
    _safetensors.save(lp(jobs[3].name), t, meta)
    res = run_layers(jobs, out)
    redone = {j.name for j in jobs[:4]}
    assert res.ok and set(res.solved) == redone and set(res.quarantined) == redone
    assert "data checksum" in res.quarantined[jobs[0].name][0]
    assert "manifest" in res.quarantined[jobs[3].name][0]
    for name, (why, moved) in res.quarantined.items():
        assert os.path.exists(moved) and "/.bakron/corrupt/" in moved
    for j in jobs:
        t = layer_tensors(out, j.name)
        assert all(np.array_equal(t[k], ref[j.name][k]) for k in ref[j.name])
    # the manifest itself lost: the files verify themselves and nothing is redone
    os.unlink(os.path.join(out, "manifest.json"))
    res2 = run_layers(jobs, out)
    assert res2.ok and not res2.solved and len(res2.reused) == len(jobs)
    assert read_manifest(out)["layers"][jobs[0].name]["key"] == job_key(jobs[0])


# -- the driver lock ---------------------------------------------------------------------------

def test_lock_contention_in_one_process(layers, tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(out)
    with OutputLock(out):
        with pytest.raises(LockHeld, match="another bakron driver"):
            run_layers(make_jobs(layers)[:1], out)
        with pytest.raises(LockHeld):
            OutputLock(out).acquire()
    res = run_layers(make_jobs(layers)[:1], out)  # released: works
    assert res.ok


_HOLDER = textwrap.dedent("""
    import sys, time
    from bakron.distributed import OutputLock
    OutputLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(120)
""")


def test_lock_held_by_another_process_and_released_when_it_dies(layers, tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(out)
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, out], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(LockHeld, match=f"pid {p.pid}"):
            run_layers(make_jobs(layers)[:1], out)
        src = npz_folder(tmp_path / "npz")
        assert quantize_folder(src, out, quiet=True, **SETTINGS) == EXIT_LOCKED
    finally:
        p.send_signal(signal.SIGKILL)  # a crashed driver: its lock file stays behind ...
        p.wait()
    assert os.path.exists(os.path.join(out, ".bakron", "lock"))
    res = run_layers(make_jobs(layers)[:1], out)  # ... but the kernel released the lock
    assert res.ok


# -- resume after an interrupted driver ----------------------------------------------------------

_DRIVER = textwrap.dedent("""
    import os, sys, json
    from bakron.distributed import LayerJob, run_layers
    layers, out, stop_after = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    jobs = [LayerJob.make(d["name"], d["W"], d["H_in"], d["H_out"], bits=3, tile=8)
            for d in layers]
    seen = []
    def progress(rec):
        seen.append(rec["name"])
        if len(seen) == stop_after:  # the driver dies without any cleanup
            os.kill(os.getpid(), 9)
    run_layers(jobs, out, progress=progress, manifest_interval=3600)
""")


def test_resume_after_killed_driver_redoes_only_missing_layers(layers, tmp_path):
    out = str(tmp_path / "out")
    p = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(layers), out, "3"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    done_before = set(journal_counts(out))
    assert len(done_before) == 3
    man = read_manifest(out)  # written at the start only (manifest_interval): all pending
    assert {r["status"] for r in man["layers"].values()} == {"pending"}
    jobs = make_jobs(layers)
    res = run_layers(jobs, out)
    assert res.ok
    assert set(res.reused) == done_before
    assert set(res.solved) == {j.name for j in jobs} - done_before
    assert journal_counts(out) == {j.name: 1 for j in jobs}  # nothing written twice
    ref = str(tmp_path / "ref")
    run_layers(jobs, ref)
    for j in jobs:
        a, b = layer_tensors(out, j.name), layer_tensors(ref, j.name)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert {r["status"] for r in read_manifest(out)["layers"].values()} == {"done"}


# -- quantize_folder (the CLI's distributed entry point), in-process ---------------------------

def test_quantize_folder_exit_codes(tmp_path):
    src = npz_folder(tmp_path / "in")
    out = tmp_path / "out"
    assert quantize_folder(src, out, quiet=True, bits=3, tile=8) == EXIT_OK
    assert len(os.listdir(out / "layers")) == 3
    assert quantize_folder(src, out, quiet=True, bits=3, tile=8) == EXIT_OK  # resume: no-op
    assert journal_counts(str(out)) == {"l0": 1, "l1": 1, "l2": 1}
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert quantize_folder(src, other, quiet=True, bits=3) == EXIT_LOCKED  # 3: not bakron's
    assert quantize_folder(tmp_path / "missing", out, quiet=True) == EXIT_USAGE
    assert quantize_folder(src, out, quiet=True, bits=11) == EXIT_USAGE
    assert quantize_folder(src, out, scheduler="tcp://x:1", gpus=1, quiet=True) == EXIT_USAGE
    np.savez(src / "l3.npz", W=np.full((24, 16), np.nan, np.float32), H_in=np.eye(16))
    assert quantize_folder(src, out, quiet=True, bits=3, tile=8) == EXIT_FAILED
    assert read_manifest(str(out))["layers"]["l3"]["status"] == "failed"


def test_inputs_inside_the_managed_output_area_are_refused(layers, tmp_path):
    out = tmp_path / "in"  # the inputs' own folder as OUT is fine ...
    res = run_layers(make_jobs(layers)[:1], out)
    assert res.ok
    src = out / "layers" / f"{layers[0]['name']}.safetensors"
    with pytest.raises(ValueError, match="inside the output folder"):  # ... OUT/layers is not
        run_layers([LayerJob.make("z", f"{src}::W_hat", layers[0]["H_in"], **SETTINGS)], out)
