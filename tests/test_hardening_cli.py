"""Hostile or careless inputs to ``bakron quantize``/``demo`` and the Dask path: the documented
exit code, a one-line message, and nothing written (docs/cli.md, docs/reliability.md)."""
import io as _io
import json
import os
import struct
import zipfile

import numpy as np
import pytest

from bakron import _safetensors, cli, io
from bakron.distributed import quantize_folder


def _layer(m=64, n=96, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((3 * n, n))
    return {"W": rng.standard_normal((m, n)).astype(np.float32), "H_in": X.T @ X}


def run(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    _, err = capsys.readouterr()
    return rc, err


def _nothing_written(parent, out):
    assert not os.path.exists(out)
    assert [p for p in os.listdir(parent) if p.startswith(".")] == []


def _safetensors_with(tmp_path, edit):
    """A valid layer file whose header is changed by ``edit(header)``."""
    p = tmp_path / "good.safetensors"
    _safetensors.save(p, _layer())
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    edit(header)
    h = json.dumps(header).encode()
    bad = tmp_path / "in" / "layer.safetensors"
    bad.parent.mkdir(exist_ok=True)
    bad.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return bad


def _both_paths(capsys, tmp_path, src, message):
    """The local path and the Dask path give exit 2, the message (naming the file), nothing
    written."""
    out = tmp_path / "out"
    rc, err = run(["quantize", src, "--out", out], capsys)
    assert rc == cli.EXIT_USAGE and message in err and os.path.basename(str(src)) in err, err
    _nothing_written(tmp_path, out)
    rc = quantize_folder(src, out, quiet=True)
    err = capsys.readouterr().err
    assert rc == cli.EXIT_USAGE and message in err and os.path.basename(str(src)) in err, err
    assert not out.exists()


# -- 3. negative data_offsets -----------------------------------------------------------------

def test_negative_data_offsets(tmp_path, capsys):
    def edit(h):
        h["W"]["data_offsets"][0] -= 16
    _both_paths(capsys, tmp_path, _safetensors_with(tmp_path, edit), "data_offsets")


@pytest.mark.parametrize("edit,message", [
    (lambda h: h["W"].update(shape=[64, -96]), "must be a list of non-negative integers"),
    (lambda h: h["W"].update(shape=[32, 96]), "needs"),
    (lambda h: h["W"].update(data_offsets=[o - 4 for o in h["W"]["data_offsets"]]),
     "contiguous"),
])
def test_inconsistent_offsets_and_shapes(tmp_path, capsys, edit, message):
    _both_paths(capsys, tmp_path, _safetensors_with(tmp_path, edit), message)


# -- 7. bounded reads -------------------------------------------------------------------------

def test_huge_data_offsets(tmp_path, capsys):
    def edit(h):
        h["W"]["data_offsets"] = [0, 10**12]
        h["W"]["shape"] = [250000, 1000000]
    _both_paths(capsys, tmp_path, _safetensors_with(tmp_path, edit), "data_offsets")


def test_deeply_nested_header(tmp_path, capsys):
    raw = b"[" * 100000 + b"]" * 100000
    src = tmp_path / "in" / "deep.safetensors"
    src.parent.mkdir()
    src.write_bytes(struct.pack("<Q", len(raw)) + raw)
    _both_paths(capsys, tmp_path, src, "nested deeper than")


def test_header_length_over_the_limit(tmp_path, capsys):
    src = tmp_path / "in" / "big.safetensors"
    src.parent.mkdir()
    src.write_bytes(struct.pack("<Q", 200_000_000) + b"{}")
    _both_paths(capsys, tmp_path, src, "header length")


def _npz_with_member(path, name, payload: bytes, compress=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=compress) as z:
        buf = _io.BytesIO()
        np.save(buf, _layer()["H_in"])
        z.writestr("H_in.npy", buf.getvalue())
        z.writestr(name, payload)


def test_npz_header_declaring_a_huge_array(tmp_path, capsys):
    buf = _io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False,
                                               "shape": (200000, 200000)})
    src = tmp_path / "in" / "huge.npz"
    src.parent.mkdir()
    _npz_with_member(src, "W.npy", buf.getvalue() + b"\0" * 64)
    _both_paths(capsys, tmp_path, src, "declares shape (200000, 200000)")


def test_npz_zip_bomb(tmp_path, capsys, monkeypatch):
    # the rule at a small scale: a member expanding more than NPZ_MAX_EXPANSION times to over
    # NPZ_CHECK_ABOVE bytes is refused before it is decompressed
    monkeypatch.setattr(io, "NPZ_CHECK_ABOVE", 1 << 20)
    buf = _io.BytesIO()
    np.save(buf, np.zeros((2048, 1024), np.float32))  # 8 MiB of zeros: ~ x1000
    src = tmp_path / "in" / "bomb.npz"
    src.parent.mkdir()
    _npz_with_member(src, "W.npy", buf.getvalue(), zipfile.ZIP_DEFLATED)
    _both_paths(capsys, tmp_path, src, "possible zip bomb")
    monkeypatch.setenv("BAKRON_NPZ_MAX_MEMBER_BYTES", str(16 << 20))  # the explicit limit
    assert io.read_npz(src)["W"].shape == (2048, 1024)


# -- 8. GPU-only options on a machine without a GPU, tile larger than the layers ---------------

def test_wavefront_runs_on_the_cpu_but_not_on_the_array_api_engine(tmp_path, capsys):
    """``--method wavefront`` runs on the numba engine (CPU); with ``--engine array_api``
    it is refused before any layer runs."""
    src = tmp_path / "l.npz"
    np.savez(src, **_layer())
    out = tmp_path / "out"
    rc, err = run(["quantize", src, "--out", out, "--method", "wavefront", "--engine",
                   "array_api"], capsys)
    assert rc == cli.EXIT_USAGE and "--method wavefront runs on the numba and cuda" in err
    _nothing_written(tmp_path, out)
    pytest.importorskip("numba")
    rc, err = run(["quantize", src, "--out", out, "--method", "wavefront"], capsys)
    assert rc == 0, err
    assert out.exists()


@pytest.mark.parametrize("opt", [["--engine", "cuda"]])
def test_gpu_only_options(tmp_path, capsys, monkeypatch, opt):
    src = tmp_path / "l.npz"
    np.savez(src, **_layer())
    out = tmp_path / "out"
    rc, err = run(["quantize", src, "--out", out, *opt], capsys)
    assert rc == cli.EXIT_USAGE and "--engine cuda runs on a GPU; add --device gpu (or auto)" in err
    _nothing_written(tmp_path, out)

    def no_gpu(device="auto"):
        raise RuntimeError("device='gpu' but cupy sees no CUDA device")
    monkeypatch.setattr(io, "array_module", no_gpu)
    rc, err = run(["quantize", src, "--out", out, "--device", "gpu", *opt], capsys)
    assert rc == cli.EXIT_UNAVAILABLE and "--engine cuda needs a GPU: device='gpu'" in err
    _nothing_written(tmp_path, out)


def test_dask_path_tile_larger_than_layers_and_missing_gpus(tmp_path, capsys, monkeypatch):
    src = tmp_path / "l.npz"
    np.savez(src, **_layer(8, 96))
    out = tmp_path / "out"
    assert quantize_folder(src, out, tile=16, quiet=True) == cli.EXIT_USAGE
    assert "larger than layer l (8 x 96)" in capsys.readouterr().err
    assert not out.exists()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    rc, err = run(["quantize", src, "--out", out, "--gpus", 1, "--tile", 8], capsys)
    assert rc == cli.EXIT_UNAVAILABLE and "--gpus 1: this machine shows 0 GPUs" in err
    assert not out.exists()


# -- 9. OUT names the file system cannot hold; demo output errors -----------------------------

def test_out_name_too_long_or_with_nul(tmp_path, capsys):
    src = tmp_path / "l.npz"
    np.savez(src, **_layer())
    rc, err = run(["quantize", src, "--out", tmp_path / ("x" * 300)], capsys)
    assert rc == cli.EXIT_USAGE and "bytes long" in err and len(err.strip().splitlines()) == 1
    rc, err = run(["quantize", src, "--out", str(tmp_path / "a\x00b")], capsys)
    assert rc == cli.EXIT_USAGE and "NUL byte" in err
    assert sorted(os.listdir(tmp_path)) == ["l.npz"]


def test_demo_out_is_a_file_or_unwritable(tmp_path, capsys, monkeypatch):
    pytest.importorskip("sklearn")
    f = tmp_path / "file"
    f.write_text("x")
    rc, err = run(["demo", "--model", "mlp", "--out", f, "--quick", "--quiet"], capsys)
    assert rc == cli.EXIT_USAGE and "is a file" in err and f.read_text() == "x"
    import bakron.demo.mlp as mlp

    def read_only(out, **kw):
        raise OSError(30, "Read-only file system", str(out))
    monkeypatch.setattr(mlp, "run", read_only)
    rc, err = run(["demo", "--model", "mlp", "--out", tmp_path / "d", "--quiet"], capsys)
    assert rc == cli.EXIT_WRITE_FAILED and "Read-only file system" in err
    assert len(err.strip().splitlines()) == 1


# -- 10. garbage npz: the same message and exit code on both paths ----------------------------

@pytest.mark.parametrize("data", [b"", b"PK\x03\x04" + b"\0" * 10, b"PK" + os.urandom(300),
                                  None])
def test_truncated_empty_garbage_npz(tmp_path, capsys, data):
    src = tmp_path / "in" / "bad.npz"
    src.parent.mkdir()
    if data is None:  # a valid file cut in half
        np.savez(tmp_path / "ok.npz", **_layer())
        raw = (tmp_path / "ok.npz").read_bytes()
        data = raw[:len(raw) // 2]
        (tmp_path / "ok.npz").unlink()
    src.write_bytes(data)
    _both_paths(capsys, tmp_path, src, "not a readable .npz file")


# -- 12. stale temporary folders of killed runs ------------------------------------------------

def test_stale_tmp_of_a_dead_run_is_removed(tmp_path, capsys):
    import socket
    import subprocess
    import sys

    src = tmp_path / "l.npz"
    np.savez(src, **_layer())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".out.tmp-{dead}-abc"
    stale.mkdir()
    (stale / ".bakron-tmp.json").write_text(json.dumps({"host": socket.gethostname(),
                                                         "pid": int(dead)}))
    alive = tmp_path / ".out.tmp-other"  # not ours (no marker): kept
    alive.mkdir()
    rc, err = run(["quantize", src, "--out", tmp_path / "out", "--quiet"], capsys)
    assert rc == 0, err
    assert not stale.exists() and alive.exists()
    assert ".bakron-tmp.json" not in os.listdir(tmp_path / "out")


def test_unreadable_out_parent_is_one_line(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root ignores permissions")
    src = tmp_path / "l.npz"
    np.savez(src, **_layer())
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o000)
    try:
        rc, err = run(["quantize", src, "--out", locked / "sub" / "out"], capsys)
    finally:
        locked.chmod(0o755)
    assert rc == cli.EXIT_WRITE_FAILED and len(err.strip().splitlines()) == 1
    assert os.listdir(locked) == []


# -- one pipeline: diagonal H_out and the same tensors on both paths ---------------------------

@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_diagonal_h_out_on_both_paths(tmp_path, capsys, fmt):
    import bakron
    from bakron.distributed import read_manifest

    d = _layer(32, 48, 3)
    h = np.linspace(0.5, 2.0, 32)
    src = tmp_path / "in" / "diag.safetensors"
    src.parent.mkdir()
    _safetensors.save(src, dict(d, H_out=h))
    rc, err = run(["quantize", src, "--out", tmp_path / "local", "--tile", 8, "--quiet",
                   "--format", fmt], capsys)
    assert rc == 0, err
    assert quantize_folder(src, tmp_path / "dask", tile=8, quiet=True, file_format=fmt) == 0
    local = io.read_tensors(tmp_path / "local" / f"diag.{fmt}")
    dask = io.read_tensors(tmp_path / "dask" / "layers" / f"diag.{fmt}")
    for t in (local, dask):
        t.pop("__metadata__", None)
    assert sorted(local) == sorted(dask) == ["W_hat", "codes", "scale"]
    # the Dask output resumes: a second run reuses the verified file
    assert quantize_folder(src, tmp_path / "dask", tile=8, quiet=True, file_format=fmt) == 0
    rec = read_manifest(tmp_path / "dask")["layers"]["diag"]
    assert rec["status"] == "done" and rec["reused"] is True and rec["file"].endswith(fmt)
    for k in local:
        np.testing.assert_array_equal(local[k], dask[k])
    ref = bakron.quantize_layer(d["W"], d["H_in"], np.diag(h), bits=4, tile=8)
    np.testing.assert_array_equal(local["W_hat"], ref.values)
    np.testing.assert_array_equal(io.dequantize(local["codes"], local["scale"]), ref.values)
    e = json.loads((tmp_path / "local" / "report.json").read_text())["layers"][0]
    assert e["h_out_diagonal"] is True and e["two_sided"] is True
    assert e["proxy_error"] == pytest.approx(ref.proxy_error, rel=1e-10)


def test_report_records_the_stored_dtype(tmp_path, capsys):
    d = _layer(16, 32, 4)
    W = d["W"]
    bf16 = (W.view(np.uint32) >> 16).astype(np.uint16)  # truncation to bfloat16 bits
    src = tmp_path / "bf.safetensors"
    raw_W = bf16.tobytes()
    H = d["H_in"].astype("<f8").tobytes()
    header = {"H_in": {"dtype": "F64", "shape": [32, 32], "data_offsets": [0, len(H)]},
              "W": {"dtype": "BF16", "shape": [16, 32],
                    "data_offsets": [len(H), len(H) + len(raw_W)]}}
    hb = json.dumps(header).encode()
    src.write_bytes(struct.pack("<Q", len(hb)) + hb + H + raw_W)
    rc, err = run(["quantize", src, "--out", tmp_path / "o", "--tile", 8, "--quiet"], capsys)
    assert rc == 0, err
    e = json.loads((tmp_path / "o" / "report.json").read_text())["layers"][0]
    assert e["dtype"] == "bfloat16" and e["input_dtype"] == "bfloat16"
    np.savez(tmp_path / "h.npz", W=W.astype(np.float16), H_in=d["H_in"])
    rc, err = run(["quantize", tmp_path / "h.npz", "--out", tmp_path / "o2", "--tile", 8,
                   "--quiet"], capsys)
    assert rc == 0, err
    e = json.loads((tmp_path / "o2" / "report.json").read_text())["layers"][0]
    assert e["input_dtype"] == "float16"
    assert io.read_tensors(tmp_path / "o2" / "h.safetensors")["W_hat"].dtype == np.float32


def test_metrics_option(tmp_path, capsys):
    d = _layer(32, 48, 5)
    G = np.random.default_rng(5).standard_normal((64, 32))
    np.savez(tmp_path / "l.npz", **d, H_out=G.T @ G)
    figures = {}
    for level in ("none", "basic", "full"):
        rc, err = run(["quantize", tmp_path / "l.npz", "--out", tmp_path / level, "--tile", 8,
                       "--metrics", level], capsys)
        assert rc == 0, err
        figures[level] = json.loads((tmp_path / level / "report.json").read_text())["layers"][0]
    assert figures["none"]["proxy_error"] is None and figures["none"]["rtn_proxy_error"] is None
    assert figures["basic"]["proxy_error"] == figures["full"]["proxy_error"]
    assert figures["basic"]["proxy_error_one_sided"] is None
    assert figures["full"]["proxy_error_one_sided"] is not None
    rc, err = run(["quantize", tmp_path / "l.npz", "--out", tmp_path / "x", "--metrics", "all"],
                  capsys)
    assert rc == cli.EXIT_USAGE and "--metrics" in err


def test_sigterm_removes_the_temporary_folder(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    rng = np.random.default_rng(0)
    layers = tmp_path / "in"
    layers.mkdir()
    for i in range(200):  # long enough that the signal lands mid-run on a loaded machine too
        np.savez(layers / f"l{i:03d}.npz", **_layer(64, 96, i))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "bakron", "quantize", str(layers), "--out",
                             str(out), "--engine", "array_api", "--quiet"],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any(p.name.startswith(".out.tmp-")
                                             for p in tmp_path.iterdir()):
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0 or (proc.returncode == -signal.SIGTERM and out.is_dir()):
        # finished before the signal, or during the interpreter's shutdown after the command
        # had returned (the default handler then ends it, with the output complete)
        pytest.skip("the run finished before the signal")
    assert proc.returncode == cli.EXIT_INTERRUPTED, err
    assert "terminated (SIGTERM)" in err and not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    del rng


def test_progress_inside_a_large_layer(tmp_path, capsys, monkeypatch):
    np.savez(tmp_path / "l.npz", **_layer(32, 48, 6))
    monkeypatch.setattr(cli, "PROGRESS_INSIDE_LAYER", 32 * 48)
    rc, err = run(["quantize", tmp_path / "l.npz", "--out", tmp_path / "o", "--tile", 8], capsys)
    assert rc == 0, err
    phases = [line.strip().split(" ")[0] for line in err.splitlines() if line.endswith("...")]
    assert phases == ["preparing", "solving", "computing"]
    monkeypatch.setattr(cli, "PROGRESS_INSIDE_LAYER", 32 * 48 + 1)
    rc, err = run(["quantize", tmp_path / "l.npz", "--out", tmp_path / "o2", "--tile", 8],
                  capsys)
    assert rc == 0 and "solving" not in err
