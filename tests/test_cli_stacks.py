"""``bakron quantize`` solves same-shape layers as stacks (docs/cli.md "Stacks"): the outputs
are byte-identical to the one-by-one path, the report keeps its per-layer records."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from bakron import _safetensors, cli
from bakron.layer_groups import layer_bytes, stack_chunks


def _layer(m, n, seed, h_out="dense", dtype=np.float64):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((3 * n, n)) * np.linspace(0.2, 2.0, n)
    d = {"W": rng.standard_normal((m, n)).astype(dtype), "H_in": X.T @ X}
    if h_out == "dense":
        G = rng.standard_normal((3 * m, m))
        d["H_out"] = G.T @ G
    elif h_out == "diag":
        d["H_out"] = rng.uniform(0.5, 2.0, m)
    return d


def _save(path, d):
    if str(path).endswith(".npz"):
        np.savez(path, **d)
    else:
        _safetensors.save(path, d)


@pytest.fixture
def many(tmp_path):
    """Nine layers: four two-sided 24 x 32 (one with a diagonal H_out), three one-sided
    24 x 32, two two-sided 16 x 16; float64, npz and safetensors mixed."""
    d = tmp_path / "many"
    d.mkdir()
    specs = [("a0", 24, 32, "dense"), ("a1", 24, 32, "dense"), ("b0", 24, 32, "none"),
             ("a2", 24, 32, "diag"), ("c0", 16, 16, "dense"), ("b1", 24, 32, "none"),
             ("a3", 24, 32, "dense"), ("c1", 16, 16, "dense"), ("b2", 24, 32, "none")]
    for i, (name, m, n, kind) in enumerate(specs):
        _save(d / f"{name}.{'npz' if i % 2 else 'safetensors'}", _layer(m, n, i, kind))
    return d


def _run(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _files(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.name != cli.REPORT_NAME}


_TIMES = ("seconds_factor", "seconds_solve", "seconds_metrics", "seconds_total",
          "seconds_write", "stack")


@pytest.mark.parametrize("extra", [[], ["--one-sided", "--metrics", "full"],
                                   ["--asym", "--scale", "group", "--group-size", "8",
                                    "--format", "npz"]])
def test_stacks_are_byte_identical_to_one_by_one(many, tmp_path, capsys, extra):
    base = ["quantize", many, "--tile", 8, "--bits", 3, "--engine", "numba", *extra]
    rc1, out1, err1 = _run([*base, "--out", tmp_path / "one", "--stack-memory", 1], capsys)
    rc2, out2, err2 = _run([*base, "--out", tmp_path / "stk"], capsys)
    assert rc1 == rc2 == cli.EXIT_OK, (err1, err2)
    one, stk = tmp_path / "one", tmp_path / "stk"
    assert _files(one) == _files(stk) and len(_files(one)) == 9
    r1 = json.loads((one / cli.REPORT_NAME).read_text())
    r2 = json.loads((stk / cli.REPORT_NAME).read_text())
    assert r1["summary"]["stacks"] == 9
    # two-sided 24 x 32 (a0 a1 a2 a3: the diagonal H_out stacks beside the dense ones but is
    # solved in its own group inside), one-sided 24 x 32, 16 x 16
    want = 2 if "--one-sided" in extra else 3
    assert r2["summary"]["stacks"] == want
    assert [e["name"] for e in r2["layers"]] == [e["name"] for e in r1["layers"]]
    for e1, e2 in zip(r1["layers"], r2["layers"]):
        assert {k: v for k, v in e1.items() if k not in _TIMES} == \
            {k: v for k, v in e2.items() if k not in _TIMES}
    sizes = {e["name"]: e["stack"]["size"] for e in r2["layers"]}
    assert sizes["c0"] == sizes["c1"] == 2
    # the per-layer progress lines are all there, and a line per stack
    for i in range(1, 10):
        assert f"[{i}/9] " in err2
    multi = {e["stack"]["stack"] for e in r2["layers"] if e["stack"]["size"] > 1}
    assert sum(line.startswith("stack ") for line in err2.splitlines()) == len(multi) > 0
    assert out1.splitlines()[-1].replace(str(one), "X") == out2.splitlines()[-1].replace(
        str(stk), "X")


def test_memory_budget_cuts_stacks(many, tmp_path, capsys):
    one = layer_bytes(24, 32, True)
    rc, _, err = _run(["quantize", many, "--out", tmp_path / "o", "--tile", 8,
                       "--stack-memory", 2 * one, "--quiet"], capsys)
    assert rc == 0, err
    rep = json.loads((tmp_path / "o" / cli.REPORT_NAME).read_text())
    assert rep["options"]["stack_memory"] == 2 * one
    sizes = sorted({(e["stack"]["stack"], e["stack"]["size"]) for e in rep["layers"]})
    # a0..a3 in two stacks of 2; b0..b2 (no H_out: smaller, but not three times) in 2 + 1;
    # c0 c1 in one
    assert [s for _, s in sizes] == [2, 2, 2, 1, 2]
    assert rep["summary"]["stacks"] == 5


def test_bad_layer_in_a_stack_fails_alone(many, tmp_path, capsys):
    n = 32
    H = np.full((n, n), 5.0) - 4.0 * np.eye(n)  # symmetric, unit diagonal, eigenvalue -4
    d = _layer(24, 32, 99)
    d["H_in"] = H
    _save(many / "a9.npz", d)
    rc, out, err = _run(["quantize", many, "--out", tmp_path / "o", "--tile", 8], capsys)
    assert rc == cli.EXIT_LAYER_FAILED
    rep = json.loads((tmp_path / "o" / cli.REPORT_NAME).read_text())
    bad = [e for e in rep["layers"] if e["name"] == "a9"][0]
    assert bad["status"] == "failed" and bad["error"].startswith("NotPositiveDefiniteError")
    assert "layers[" not in bad["error"]
    assert rep["summary"] == {**rep["summary"], "ok": 9, "failed": 1}
    assert not (tmp_path / "o" / "a9.safetensors").exists()
    # the same message as the one-by-one path
    rc1, _, _ = _run(["quantize", many, "--out", tmp_path / "p", "--tile", 8, "--quiet",
                      "--stack-memory", 1], capsys)
    rep1 = json.loads((tmp_path / "p" / cli.REPORT_NAME).read_text())
    assert rc1 == cli.EXIT_LAYER_FAILED
    assert [e for e in rep1["layers"] if e["name"] == "a9"][0]["error"] == bad["error"]


def test_stack_chunks():
    keys = ["a", "b", "a", "a", "b", "a", "a"]
    assert stack_chunks(keys, [1] * 7, 10) == [[0, 2, 3, 5, 6], [1, 4]]
    assert stack_chunks(keys, [1] * 7, 2) == [[0, 2], [3, 5], [6], [1, 4]]
    assert stack_chunks(keys, [1] * 7, 10, parts=2) == [[0, 2, 3], [5, 6], [1], [4]]
    assert stack_chunks(keys, [5] * 7, 1) == [[i] for i in (0, 2, 3, 5, 6, 1, 4)]
    assert stack_chunks([], [], 1) == []
    with pytest.raises(ValueError, match="budget and parts"):
        stack_chunks(keys, [1] * 7, 0)
