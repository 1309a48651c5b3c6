"""``scripts/bench_numba_ab.py``: its parsing, and one tiny A/B run (no timing assertions)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytest.importorskip("numba", reason="the A/B script times the numba engine")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "bench_numba_ab", os.path.join(ROOT, "scripts", "bench_numba_ab.py"))
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def test_parsing():
    assert ab.parse_cpus("0-3,6,8-9") == [0, 1, 2, 3, 6, 8, 9]
    assert ab.parse_ints("1,4,16", "--threads") == [1, 4, 16]
    assert ab.parse_case("wave:2048@4") == {"name": "wave:2048@4", "kind": "wave", "items": 1,
                                            "m": 2048, "n": 2048, "base": 4}
    assert ab.parse_case("rec:768x2048")["m"] == 768
    st = ab.parse_case("stack:64x256")
    assert (st["items"], st["m"], st["n"]) == (64, 256, 256)
    assert ab.parse_case("stack:8x128x64")["n"] == 64
    assert [c["kind"] for c in ab.parse_cases("floor:1024,rec:1024,anti:64,wave1:64")] == \
        ["floor", "rec", "anti", "wave1"]
    assert ab.parse_env(["OMP_WAIT_POLICY=PASSIVE"]) == {"OMP_WAIT_POLICY": "PASSIVE"}
    for bad in ("wave", "fast:12", "rec:0", "stack:12", "wave:64@0"):
        with pytest.raises(ValueError):
            ab.parse_case(bad)
    for bad in ("", "3-1", "-1"):
        with pytest.raises(ValueError):
            ab.parse_cpus(bad)
    with pytest.raises(ValueError):
        ab.parse_ints("1,x", "--threads")


@pytest.mark.slow   # benchmark subprocesses
def test_tiny_run_writes_json(tmp_path, capsys):
    out = tmp_path / "ab.json"
    cpus = sorted(os.sched_getaffinity(0))[:1] if hasattr(os, "sched_getaffinity") else [0]
    rc = ab.main(["--old", ROOT, "--new", ROOT, "--cpus", ",".join(map(str, cpus)),
                  "--threads", "1", "--rounds", "1", "--inner", "1",
                  "--cases", "floor:32,rec:48,wave:48@2,stack:2x32,wave1:48@2", "--json", str(out),
                  "--env", "OPENBLAS_NUM_THREADS=1"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.startswith("| case | threads | old ms | new ms | new ÷ old |")
    data = json.loads(out.read_text())
    assert data["env"] == {"OPENBLAS_NUM_THREADS": "1"}
    assert [d["case"] for d in data["summary"]] == ["floor:32", "rec:48", "wave:48@2",
                                                   "stack:2x32", "wave1:48@2"]
    for d in data["summary"]:
        assert d["old"] > 0 and d["new"] > 0
    ran = {d["case"]: d["new_ran"] for d in data["summary"]}
    assert ran["wave:48@2"]["method"] == "wavefront" and ran["wave:48@2"]["base"] == 2
    assert ran["wave1:48@2"]["method"] == "wavefront"
    assert ran["stack:2x32"]["path"]
    for r in data["rows"]:
        assert r["numba_threads"] == 1 and len(r["affinity"]) == 1
