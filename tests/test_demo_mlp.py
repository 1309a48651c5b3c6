"""The digits-MLP demo: a quick end-to-end run (through the CLI), its outputs, and its factors."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

import array_api_compat.numpy as xpn  # noqa: E402

from bakron import cli, io  # noqa: E402
from bakron.demo import mlp  # noqa: E402


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick demo run through ``bakron demo --model mlp --quick``, shared by the tests."""
    out = tmp_path_factory.mktemp("demo") / "d"
    out.mkdir()
    (out / "other.txt").write_text("not ours")  # e.g. the MiniLM demo's files
    rc = cli.main(["demo", "--model", "mlp", "--quick", "--out", str(out), "--device", "cpu"])
    return rc, out


def test_quick_demo_through_cli(quick_run, capsys):
    rc, out = quick_run
    assert rc == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["mlp_plot.png", "mlp_report.md", "mlp_results.json", "other.txt"]
    assert (out / "other.txt").read_text() == "not ours"
    assert (out / "mlp_plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_demo_results(quick_run):
    _, out = quick_run
    res = json.loads((out / "mlp_results.json").read_text())
    assert res["device"] == "cpu" and res["bits"] == [2, 3, 4] and res["quick"] is True
    assert res["accuracy_original"] > 0.9
    assert res["factor_source"] in ("bakron.hessian.global_factors",
                                    "bakron.demo.mlp (K-FAC, sampled Fisher)")
    rows = {(r["bits"], r["method"]): r for r in res["summary"]}
    assert sorted(rows) == sorted((b, m) for b in (2, 3, 4) for m in mlp.METHODS)
    for (b, m), r in rows.items():
        assert 0.0 <= r["accuracy"] <= 1.0 and r["kl"] >= 0.0
        assert sorted(r["layers"]) == sorted(mlp.LAYER_NAMES)
        for f in r["layers"].values():
            assert f["proxy_error"] > 0 and f["proxy_error_one_sided"] > 0 and f["seconds"] >= 0
    for name in mlp.LAYER_NAMES:
        # every second-order method improves its own proxy over RTN at 4 bits on every layer
        rtn = rows[(4, "rtn")]["layers"][name]
        assert rows[(4, "bakron")]["layers"][name]["proxy_error"] < rtn["proxy_error"]
        assert rows[(4, "ldlq")]["layers"][name]["proxy_error_one_sided"] < \
            rtn["proxy_error_one_sided"]
    # more bits, closer to the original model
    for m in mlp.METHODS:
        assert rows[(4, m)]["kl"] < rows[(2, m)]["kl"]
    report = (out / "mlp_report.md").read_text()
    assert "# bakron demo: digits MLP" in report and "![results](mlp_plot.png)" in report
    for b in (2, 3, 4):
        for label in mlp.METHODS.values():
            assert f"| {b} | {label} |" in report
    assert res["files"] == [str(out / n) for n in ("mlp_report.md", "mlp_plot.png",
                                                  "mlp_results.json")]


def test_run_validates_arguments(tmp_path):
    with pytest.raises(ValueError, match="bits must be in 2..8, got 1"):
        mlp.run(tmp_path, bits=(1, 4), progress=False)
    with pytest.raises(ValueError, match="at least one bit width"):
        mlp.run(tmp_path, bits=(), progress=False)
    with pytest.raises(ValueError, match="device must be"):
        mlp.run(tmp_path, device="tpu", progress=False)
    if io.array_module("auto")[1] == "cpu":
        with pytest.raises(RuntimeError, match="device='gpu' but"):
            mlp.run(tmp_path, device="gpu", progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def small_model():
    Xtr, ytr, Xte, yte = mlp.load_digits_split()
    return mlp.train_mlp(Xtr, ytr, hidden=24, epochs=2), Xtr[:300]


def test_fallback_factors_definition(small_model):
    params, X = small_model
    f = mlp._kfac_factors(xpn, params, X, batch_size=128, seed=0)
    assert sorted(f) == sorted(mlp.LAYER_NAMES)
    H_in, H_out = f["fc1"]
    np.testing.assert_allclose(H_in, X.T @ X / len(X), rtol=1e-12)
    for name, (W, _) in zip(mlp.LAYER_NAMES, params):
        Hi, Ho = f[name]
        assert Hi.shape == (W.shape[1],) * 2 and Ho.shape == (W.shape[0],) * 2
        np.testing.assert_allclose(Ho, Ho.T, atol=1e-15)
        assert np.linalg.eigvalsh(Ho).min() > -1e-12
    # the head's gradient p - onehot(y) sums to zero over classes: H_out of the head is singular
    assert abs(np.linalg.eigvalsh(f["out"][1]).min()) < 1e-12


def test_factor_source_matches_bakron_hessian(small_model):
    """The demo's own K-FAC and bakron.hessian agree (same label draws): a cross-check."""
    import bakron.hessian as bh

    if getattr(bh, "global_factors", None) is None:
        pytest.skip("bakron.hessian.global_factors is not available")
    params, X = small_model
    lib, source = mlp.global_factors(xpn, params, X, batch_size=128, seed=3)
    assert source == "bakron.hessian.global_factors"
    own = mlp._kfac_factors(xpn, params, X, batch_size=128, seed=3)
    for name in mlp.LAYER_NAMES:
        for a, b in zip(lib[name], own[name]):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-10, atol=1e-14 * np.abs(b).max())
