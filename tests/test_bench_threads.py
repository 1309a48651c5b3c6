"""``python -m bakron.bench --threads``: a fresh process per thread count, the table parses."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("numba", reason="the CPU benchmark needs numba")

from bakron.benchmarks import cpu  # noqa: E402


def test_cpu_methods_come_from_the_engine():
    from bakron.backends import numba_cpu

    got = cpu.cpu_methods()
    assert {m for m, _ in got} == set(numba_cpu.CAPABILITIES.methods)
    assert ("antidiagonal", "direct") in got and ("recursive", "accumulator") in got
    assert ("wavefront", "accumulator") in got  # the two-level wavefront is in the table
    assert ("recursive", "direct") not in got  # variants are the anti-diagonal's


@pytest.mark.slow
def test_quick_thread_scaling_run_writes_a_table_that_parses(tmp_path):
    out = tmp_path / "bench"
    p = subprocess.run([sys.executable, "-m", "bakron.bench", "--threads", "1,2", "--quick",
                        "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    md = (out / "cpu.md").read_text()
    assert "```bash\npython -m bakron.bench --threads 1,2 --quick\n```" in md  # --out left out
    rows = cpu.parse_threads_table(md)
    methods = {cpu._method_label(m, v) for m, v in cpu.cpu_methods()}
    want = {(t, n, m) for t in (1, 2) for n in cpu.THREAD_QUICK_SIZES for m in methods}
    assert {(r["threads"], r["size"], r["method"]) for r in rows} == want
    data = json.loads((out / "data" / "cpu-threads.json").read_text())
    raw = {(r["threads"], r["size"], r["method"]): r for d in data["processes"]
           for r in d["rows"]}
    for r in rows:  # the table is the measured rows, rounded
        x = raw[(r["threads"], r["size"], r["method"])]
        assert r["median_ms"] > 0 and r["floor_ms"] > 0
        assert r["median_ms"] == pytest.approx(x["median"] * 1e3, rel=1e-3)
        assert r["floor_ms"] == pytest.approx(x["floor"] * 1e3, rel=1e-3)
        assert r["ratio"] == pytest.approx(x["median"] / x["floor"], abs=0.006)
    procs = {d["threads"]: d for d in data["processes"]}
    for t in (1, 2):  # each thread count had its own process with its own settings
        assert procs[t]["env"]["OPENBLAS_NUM_THREADS"] == str(t)
        assert procs[t]["env"]["NUMBA_NUM_THREADS"] == str(t)
        assert procs[t]["numba_threads"] == t
        if procs[t]["pinned"]:
            assert procs[t]["affinity"] == t
    assert (out / "cpu-threads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_threads_option_is_checked(capsys):
    with pytest.raises(SystemExit):
        cpu.main(["--threads", "1,x"])
    assert "--threads must be comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cpu.main(["--threads", "0"])
    assert "--threads must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cpu.main(["--threads", "1", "--methods", "recursive,fastest"])
    err = capsys.readouterr().err
    assert "--methods must name methods of the table" in err and "'recursive,fastest'" in err


@pytest.mark.slow
def test_methods_option_limits_the_table(tmp_path):
    """``--methods``: only those methods are timed (the floor always)."""
    out = tmp_path / "bench"
    p = subprocess.run([sys.executable, "-m", "bakron.bench", "--threads", "1", "--quick",
                        "--methods", "recursive,wavefront", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = cpu.parse_threads_table((out / "cpu.md").read_text())
    assert {(r["size"], r["method"]) for r in rows} == {
        (n, m) for n in cpu.THREAD_QUICK_SIZES for m in ("recursive", "wavefront")}
