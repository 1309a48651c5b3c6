"""bakron.io: layer readers and validation, writers, dequantize, atomic output."""
from __future__ import annotations

import json
import os
import struct
import zipfile

import numpy as np
import pytest

from bakron import UniformQuantizer, _safetensors
from bakron import io


def _layer(m=12, n=10, seed=0, dtype=np.float64, h_out=True):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((3 * n, n))
    d = {"W": rng.standard_normal((m, n)).astype(dtype), "H_in": X.T @ X}
    if h_out:
        G = rng.standard_normal((3 * m, m))
        d["H_out"] = G.T @ G
    return d


# -- reading -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_write_read_round_trip(tmp_path, fmt):
    d = _layer()
    d["codes"] = np.arange(6, dtype=np.int8).reshape(2, 3)
    p = tmp_path / f"x.{fmt}"
    io.write_tensors(p, d, metadata={"layer": "x", "bits": 3})
    back = io.read_tensors(p)
    meta = back.pop("__metadata__", None)
    assert sorted(back) == sorted(d)
    for k in d:
        assert back[k].dtype == d[k].dtype
        np.testing.assert_array_equal(back[k], d[k])
    if fmt == "npz":
        assert json.loads(str(meta)) == {"layer": "x", "bits": "3"}
    else:
        assert _safetensors.metadata(p) == {"layer": "x", "bits": "3"}


def test_write_tensors_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="format must be one of"):
        io.write_tensors(tmp_path / "x.bin", {"a": np.zeros(2)})


def test_read_tensors_errors(tmp_path):
    with pytest.raises(io.InputError, match="no such file"):
        io.read_tensors(tmp_path / "missing.npz")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(io.InputError, match="unsupported file type '.txt'"):
        io.read_tensors(tmp_path / "x.txt")
    (tmp_path / "bad.npz").write_bytes(b"not a zip file at all")
    with pytest.raises(io.InputError, match="not a readable .npz file"):
        io.read_tensors(tmp_path / "bad.npz")
    np.savez(tmp_path / "obj.npz", W=np.array([{"a": 1}], dtype=object))
    with pytest.raises(io.InputError, match="cannot be read without pickle"):
        io.read_tensors(tmp_path / "obj.npz")
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(io.InputError, match="not a safetensors file"):
        io.read_tensors(tmp_path / "bad.safetensors")
    with zipfile.ZipFile(tmp_path / "zip.npz", "w") as z:
        z.writestr("W.npy", b"not an array")
    with pytest.raises(io.InputError, match="member 'W' is not a .npy array"):
        io.read_tensors(tmp_path / "zip.npz")

    def header(obj, data=b""):
        h = json.dumps(obj).encode()
        return struct.pack("<Q", len(h)) + h + data

    (tmp_path / "h1.safetensors").write_bytes(header({"W": {"dtype": "F32"}}))
    with pytest.raises(io.InputError, match="corrupt safetensors header"):
        io.read_tensors(tmp_path / "h1.safetensors")
    (tmp_path / "h2.safetensors").write_bytes(header([1, 2]))
    with pytest.raises(io.InputError, match="corrupt safetensors header"):
        io.read_tensors(tmp_path / "h2.safetensors")
    (tmp_path / "h3.safetensors").write_bytes(
        header({"W": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"1234"))
    with pytest.raises(io.InputError, match="tensor 'W' is truncated"):
        io.read_tensors(tmp_path / "h3.safetensors")


def test_find_layer_files(tmp_path):
    with pytest.raises(io.InputError, match="no such file or folder"):
        io.find_layer_files(tmp_path / "nope")
    with pytest.raises(io.InputError, match="folder holds no layer files"):
        io.find_layer_files(tmp_path)
    np.savez(tmp_path / "b.npz", **_layer())
    _safetensors.save(tmp_path / "a.safetensors", _layer())
    (tmp_path / ".hidden.npz").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "sub").mkdir()
    np.savez(tmp_path / "sub" / "c.npz", **_layer())  # not searched recursively
    found = io.find_layer_files(tmp_path)
    assert [n for n, _ in found] == ["a", "b"]
    assert io.find_layer_files(tmp_path / "b.npz") == [("b", tmp_path / "b.npz")]
    with pytest.raises(io.InputError, match="unsupported file type"):
        io.find_layer_files(tmp_path / "notes.txt")
    np.savez(tmp_path / "a.npz", **_layer())
    with pytest.raises(io.InputError, match="two files for layer 'a'"):
        io.find_layer_files(tmp_path)


def _bad(name):
    d = _layer()
    m, n = d["W"].shape
    if name == "no W":
        del d["W"]
    elif name == "no H_in":
        del d["H_in"]
    elif name == "W 1-D":
        d["W"] = d["W"][0]
    elif name == "W empty":
        d["W"] = np.zeros((0, n))
    elif name == "W int":
        d["W"] = np.ones((m, n), dtype=np.int32)
    elif name == "W NaN":
        d["W"][1, 2] = np.nan
    elif name == "H_in shape":
        d["H_in"] = d["H_in"][:-1, :-1]
    elif name == "H_in not square":
        d["H_in"] = d["H_in"][:, :-1]
    elif name == "swapped":
        d["H_in"], d["H_out"] = d["H_out"], d["H_in"]
    elif name == "H_in asym":
        d["H_in"][0, 1] += 1.0
    elif name == "H_in Inf":
        d["H_in"][0, 0] = np.inf
    elif name == "H_in int":
        d["H_in"] = np.eye(n, dtype=np.int64)
    elif name == "H_in negative diag":
        d["H_in"][3, 3] = -1.0
    elif name == "H_in zero":
        d["H_in"] = np.zeros((n, n))
    elif name == "H_out shape":
        d["H_out"] = np.eye(m + 1)
    return d


BAD = {
    "no W": "missing tensor 'W'",
    "no H_in": "missing tensor 'H_in'",
    "W 1-D": "W must be a 2-D array",
    "W empty": "W is empty",
    "W int": "W must be a floating-point array",
    "W NaN": "W contains 1 NaN or Inf entry",
    "H_in shape": r"H_in has shape \(9, 9\) but W has 10 columns",
    "H_in not square": "H_in must be a square 2-D array",
    "swapped": "are H_in and H_out swapped",
    "H_in asym": "H_in is not symmetric",
    "H_in Inf": "H_in contains 1 NaN or Inf entry",
    "H_in int": "H_in must be a floating-point array",
    "H_in negative diag": "H_in has negative diagonal entries",
    "H_in zero": "H_in has an all-zero diagonal",
    "H_out shape": r"H_out has shape \(13, 13\) but W has 12 rows",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_validate_layer_errors(tmp_path, case):
    p = tmp_path / "layer.npz"
    np.savez(p, **_bad(case))
    with pytest.raises(io.InputError, match=BAD[case]) as err:
        io.read_layer(p)
    assert str(p) in str(err.value)  # every message names the file


def test_read_layer_float16_and_extras(tmp_path):
    d = _layer(dtype=np.float16)
    d["bias"] = np.zeros(12)
    p = tmp_path / "l.npz"
    np.savez(p, **d)
    before = p.read_bytes()
    arrays, info = io.read_layer(p)
    assert arrays["W"].dtype == np.float32
    np.testing.assert_array_equal(arrays["W"], d["W"].astype(np.float32))
    assert info.shape == (12, 10) and info.has_H_out and info.ignored == ["bias"]
    assert info.dtype == "float16" and info.name == "l"
    assert p.read_bytes() == before


# -- dequantize ----------------------------------------------------------------------------

@pytest.mark.parametrize("granularity,group", [("tensor", None), ("row", None), ("group", 4),
                                               ("group", 3)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dequantize_reproduces_quantizer_values(granularity, group, symmetric, dtype):
    rng = np.random.default_rng(1)
    W = rng.standard_normal((7, 10)).astype(dtype)
    q = UniformQuantizer.fit(W, 3, symmetric=symmetric, granularity=granularity,
                             group_size=group, method="minmax")
    values, codes = q.rtn(W)
    s, z = q.tables(np, "cpu", np.dtype(dtype))
    back = io.dequantize(codes, s, None if z is None else z.astype(np.uint8), group, dtype)
    assert back.dtype == dtype
    np.testing.assert_array_equal(back, values)


def test_dequantize_group_needs_group_size():
    with pytest.raises(ValueError, match="needs group_size"):
        io.dequantize(np.zeros((2, 4), np.int8), np.ones((2, 2)))


# -- atomic output -----------------------------------------------------------------------

def _leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_atomic_output_dir_success(tmp_path):
    out = tmp_path / "sub" / "out"
    with io.atomic_output_dir(out) as tmp:
        assert tmp.parent == out.parent and not out.exists()
        (tmp / "a.txt").write_text("a")
    assert (out / "a.txt").read_text() == "a"
    assert _leftovers(out.parent, "out") == []
    mask = os.umask(0o22)
    os.umask(mask)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~mask  # an ordinary folder, not mkdtemp's 0700


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_atomic_output_dir_failure_leaves_nothing(tmp_path, exc):
    out = tmp_path / "out"
    with pytest.raises(type(exc)):
        with io.atomic_output_dir(out) as tmp:
            (tmp / "a.txt").write_text("partial")
            raise exc
    assert not out.exists()
    assert _leftovers(tmp_path, "out") == []


def test_atomic_output_dir_exists(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("old")
    with pytest.raises(io.OutputExistsError, match="already exists; use --force"):
        with io.atomic_output_dir(out):
            pass  # pragma: no cover
    with pytest.raises(io.OutputExistsError, match="not a bakron output folder"):
        with io.atomic_output_dir(out, force=True):
            pass  # pragma: no cover
    (out / "report.json").write_text('{"tool": "bakron quantize"}')  # now it is bakron's
    # force: a failed build keeps the old folder, a finished one replaces it
    with pytest.raises(RuntimeError):
        with io.atomic_output_dir(out, force=True) as tmp:
            (tmp / "new").write_text("new")
            raise RuntimeError("boom")
    assert (out / "keep").read_text() == "old" and not (out / "new").exists()
    with io.atomic_output_dir(out, force=True) as tmp:
        (tmp / "new").write_text("new")
    assert (out / "new").read_text() == "new" and not (out / "keep").exists()
    assert _leftovers(tmp_path, "out") == []
    (out / "new").unlink()  # an empty folder may be replaced too
    with io.atomic_output_dir(out, force=True) as tmp:
        (tmp / "x").write_text("x")
    assert (out / "x").exists()


def test_atomic_output_dir_appearing_meanwhile(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(io.OutputExistsError):
        with io.atomic_output_dir(out) as tmp:
            (tmp / "a").write_text("a")
            out.mkdir()
            (out / "theirs").write_text("t")
    assert (out / "theirs").read_text() == "t" and not (out / "a").exists()
    assert _leftovers(tmp_path, "out") == []


def test_atomic_write_bytes(tmp_path, monkeypatch):
    p = tmp_path / "f.json"
    io.atomic_write_json(p, {"a": np.float64(1.5), "b": np.int64(2), "c": float("nan"),
                             "d": (1, 2), "e": np.arange(2)})
    assert json.loads(p.read_text()) == {"a": 1.5, "b": 2, "c": None, "d": [1, 2], "e": [0, 1]}

    def fail(fd):
        raise OSError("no space left on device")
    monkeypatch.setattr(io.os, "fsync", fail)
    with pytest.raises(OSError, match="no space"):
        io.atomic_write_text(p, "new")
    assert json.loads(p.read_text())["a"] == 1.5  # the old content is intact
    assert _leftovers(tmp_path, "f.json") == []


def test_append_json_row(tmp_path):
    from bakron._lib.fs import append_json_row

    p = tmp_path / "runs.json"
    append_json_row(p, {"a": np.float64(0.5)})
    append_json_row(p, {"b": [1, 2]})
    assert json.loads(p.read_text()) == [{"a": 0.5}, {"b": [1, 2]}]
    assert _leftovers(tmp_path, "runs.json") == []
    p.write_text("{}")
    with pytest.raises(ValueError, match="runs.json: not a JSON list"):
        append_json_row(p, {"c": 1})
    assert p.read_text() == "{}"


def test_check_output_path(tmp_path):
    f = tmp_path / "in" / "a.npz"
    f.parent.mkdir()
    f.write_bytes(b"")
    with pytest.raises(io.InputError, match="would contain or replace the input"):
        io.check_output_path(tmp_path / "in", [f])
    with pytest.raises(io.InputError, match="would contain or replace the input"):
        io.check_output_path(f, [f])
    with pytest.raises(io.InputError):
        io.check_output_path(tmp_path, [f])
    assert io.check_output_path(tmp_path / "in" / "out", [f]) == tmp_path / "in" / "out"


def test_array_module():
    assert io.array_module("cpu") == (np, "cpu")
    xp, name = io.array_module("auto")
    assert name in ("cpu", "gpu")
    with pytest.raises(ValueError, match="device must be"):
        io.array_module("tpu")
    if name == "cpu":
        with pytest.raises(RuntimeError, match="device='gpu' but"):
            io.array_module("gpu")


def test_array_namespace():
    import array_api_compat.numpy as xpn

    assert io.array_namespace("cpu") == (xpn, "cpu")
    xp, name = io.array_namespace("auto")
    assert name == io.array_module("auto")[1]
    assert xp.asarray([1.0, 2.0]).shape == (2,) and hasattr(xp, "linalg")
    with pytest.raises(ValueError, match="device must be"):
        io.array_namespace("tpu")


@pytest.mark.parametrize("compressed", [False, True])
def test_read_npz_round_trips_every_plain_layout(tmp_path, compressed):
    """The bounded npz reader gives what np.load gives: Fortran order, big-endian, 0-d,
    empty, bool and integer arrays, stored or deflated."""
    rng = np.random.default_rng(0)
    arrays = {"F": np.asfortranarray(rng.standard_normal((5, 7))),
              "BE": rng.standard_normal((3, 4)).astype(">f4"),
              "S": np.array(3.5), "E": np.zeros((0, 4), np.float32),
              "B": rng.random(6) > 0.5, "I": np.arange(10, dtype=np.int16).reshape(2, 5)}
    p = tmp_path / "a.npz"
    (np.savez_compressed if compressed else np.savez)(p, **arrays)
    got = io.read_npz(p)
    assert sorted(got) == sorted(arrays) == sorted(io.npz_names(p))
    with np.load(p) as ref:
        for k in arrays:
            assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape
            np.testing.assert_array_equal(got[k], ref[k])
    assert io.read_npz(p, ["S"]) == {"S": np.array(3.5)}
    with pytest.raises(io.InputError, match="no array named 'Z'"):
        io.read_npz(p, ["Z"])
