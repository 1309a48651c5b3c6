"""The engines' typed options (``bakron.CudaOptions``, ``bakron.NumbaOptions``): checked
fields, defaults from the environment, ``solve(options=...)``, the caches keyed on them and
``bakron bench --option``."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import bakron
from _problems import problem
from bakron.solvers import options as opt


def test_fields_are_checked_and_named():
    with pytest.raises(ValueError, match=r"CudaOptions.step must be 'auto', 'running' or "
                                         r"'chain', got 'fast'"):
        bakron.CudaOptions(step="fast")
    with pytest.raises(ValueError, match=r"CudaOptions.gather_split must be an integer >= 1"):
        bakron.CudaOptions(gather_split=0)
    with pytest.raises(TypeError, match=r"CudaOptions.tf32 must be True or False, got 1"):
        bakron.CudaOptions(tf32=1)
    with pytest.raises(ValueError, match=r"NumbaOptions.panel must be an integer >= 1"):
        bakron.NumbaOptions(panel=2.0)
    with pytest.raises(ValueError, match=r"NumbaOptions.gather_k must be an integer >= 1, "
                                         r"got True"):
        bakron.NumbaOptions(gather_k=True)
    o = bakron.NumbaOptions(panel=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.panel = 64
    assert o.with_(panel=128) == bakron.NumbaOptions(panel=128) and o.panel == 32
    with pytest.raises(TypeError, match="NumbaOptions has no field"):
        o.with_(panels=1)
    with pytest.raises(ValueError, match="NumbaOptions.panel"):
        o.with_(panel=0)
    # hashable and equal by value: they key the engines' caches
    assert len({bakron.CudaOptions(), bakron.CudaOptions(), bakron.CudaOptions(tf32=True)}) == 2


def test_environment_sets_the_defaults_only(monkeypatch):
    monkeypatch.setenv("BAKRON_CUDA_GATHER_TILES", "0")
    monkeypatch.setenv("BAKRON_CUDA_TF32", "1")
    d = bakron.CudaOptions.defaults()
    assert (d.gather_tiles, d.tf32) == (0, True)
    assert bakron.CudaOptions().gather_tiles == 512  # an object given is used as made
    monkeypatch.setenv("BAKRON_CUDA_TF32", "yes")
    with pytest.raises(ValueError, match=r"BAKRON_CUDA_TF32 \(CudaOptions.tf32\) must be "
                                         r"'0' or '1', got 'yes'"):
        bakron.CudaOptions.defaults()
    monkeypatch.delenv("BAKRON_CUDA_TF32")
    monkeypatch.delenv("BAKRON_CUDA_GATHER_TILES")
    assert bakron.CudaOptions.defaults() == bakron.CudaOptions()  # read again on a change
    assert set(bakron.CudaOptions.ENV) == {f.name for f in dataclasses.fields(bakron.CudaOptions)}


def test_solve_takes_options_and_checks_them():
    W, f_in, f_out = problem(3, 40, 48, 8, 8, two_sided=True)
    q = bakron.UniformQuantizer.fit(W, 3)
    with pytest.raises(TypeError, match="options must be an engine options object"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=8, options=3)
    with pytest.raises(TypeError, match="options: each entry must be one of"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=8, options=[bakron.NumbaOptions(), "x"])
    with pytest.raises(ValueError, match="two NumbaOptions objects"):
        bakron.solve(W, f_out.A, f_in.A, q, tile=8,
                     options=(bakron.NumbaOptions(), bakron.NumbaOptions(panel=8)))
    with pytest.raises(TypeError, match="options must be an engine options object"):
        bakron.quantize_layer(W, np.eye(48), bits=2, tile=8, options="numba.panel=8")
    ref = bakron.solve(W, f_out.A, f_in.A, q, tile=8, engine="array_api", method="naive")
    for o in (None, bakron.NumbaOptions(panel=8, base_elements=16),
              (bakron.CudaOptions(tf32=True), bakron.NumbaOptions(panel=1))):
        r = bakron.solve(W, f_out.A, f_in.A, q, tile=8, engine="numba", method="recursive",
                         options=o)
        np.testing.assert_array_equal(r.values, ref.values)  # float64: exactly
    # base_elements: the numba engine's base=None rule
    r = bakron.solve(W, f_out.A, f_in.A, q, tile=8, engine="numba", method="recursive",
                     options=bakron.NumbaOptions(base_elements=16))
    assert r.info["base"] == 2


def test_wavefront_tables_are_keyed_on_the_options():
    from bakron.backends import numba_cpu as nc

    W, f_in, f_out = problem(5, 96, 80, 8, 8, two_sided=True)
    q = bakron.UniformQuantizer.fit(W, 3)
    ref = bakron.solve(W, f_out.A, f_in.A, q, tile=8, engine="array_api", method="naive")
    nc._cached_wavefront.cache_clear()
    for o in (bakron.NumbaOptions(), bakron.NumbaOptions(gather_rows=8, gather_k=16,
                                                         gather_min_rows=8)):
        r = bakron.solve(W, f_out.A, f_in.A, q, tile=8, engine="numba", method="wavefront",
                         base=3, options=o)
        np.testing.assert_array_equal(r.values, ref.values)
    # one table per options object
    assert nc._cached_wavefront.cache_info().currsize == 2


def test_option_arguments_of_the_command_line():
    got = opt.from_cli(["numba.panel=128", "cuda.tf32=on", "cuda.step=running"])
    assert got == (bakron.NumbaOptions.defaults().with_(panel=128),
                   bakron.CudaOptions.defaults().with_(tf32=True, step="running"))
    for bad, msg in (("numba.pane=1", "NumbaOptions has no field 'pane'"),
                     ("panel=1", "the engine must be one of"),
                     ("numba.panel", "expected ENGINE.FIELD=VALUE"),
                     ("numba.panel=x", "NumbaOptions.panel must be an integer >= 1"),
                     ("numba.panel=0", "NumbaOptions.panel must be an integer >= 1"),
                     ("cuda.stack=maybe", "CudaOptions.stack takes 0/1"),
                     ("cuda.launch=pointer", "CudaOptions.launch must be 'ptr' or 'array'")):
        with pytest.raises(ValueError, match=msg):
            opt.from_cli([bad])


def test_bench_option_is_a_usage_error_when_bad(capsys):
    from bakron.benchmarks import cpu

    with pytest.raises(SystemExit) as exc:
        cpu.main(["--option", "numba.pane=1", "--quick"])
    assert exc.value.code == 2
    assert "NumbaOptions has no field 'pane'" in capsys.readouterr().err
    o = bakron.NumbaOptions.defaults().with_(panel=128, gather_k=64)
    assert cpu._option_args(o) == ["numba.panel=128", "numba.gather_k=64"]



def test_every_other_environment_read_is_declared(monkeypatch):
    """``environment`` reads only the declared variables, and no module but options.py reads
    ``os.environ`` (handing it to a child process or setting a variable is not a read)."""
    import pathlib
    import re

    from bakron.solvers.options import ENVIRONMENT, environment

    monkeypatch.setenv("BAKRON_CACHE", "/somewhere")
    assert environment("BAKRON_CACHE") == "/somewhere"
    with pytest.raises(KeyError, match="BAKRON_UNKNOWN.*ENVIRONMENT"):
        environment("BAKRON_UNKNOWN")
    assert all(isinstance(v, str) and v for v in ENVIRONMENT.values())
    from bakron.models.llm.fetch import MODELS
    from bakron.models.minilm import _SPEC

    for spec in [*(m.wheel for m in MODELS.values()), _SPEC]:   # the wheels' variables
        assert spec.env_var in ENVIRONMENT
    root = pathlib.Path(__file__).resolve().parent.parent
    not_a_read = re.compile(r"dict\(os\.environ\b|os\.environ\.setdefault\(|"
                            r"os\.environ\[[^]]+\]\s*=[^=]")
    reads = []
    for path in sorted([*(root / "bakron").rglob("*.py"), *(root / "backends").rglob("*.py")]):
        if path.parts[-2:] == ("solvers", "options.py"):
            continue
        for k, line in enumerate(path.read_text().splitlines(), 1):
            if ("os.environ" in line or "os.getenv" in line) and not not_a_read.search(line):
                reads.append(f"{path.relative_to(root)}:{k}: {line.strip()}")
    assert not reads, "\n".join(reads)
