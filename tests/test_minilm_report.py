"""The MiniLM demo's report: conclusions in words and readable figures (from a synthetic result,
no model needed)."""
import re

import numpy as np
import pytest

from bakron.demo import minilm as demo

BITS, METHS = [2, 3, 4], ["rtn", "ldlq", "attention", "local"]
KINDS = ("query", "key", "value", "attn_out", "ffn_in", "ffn_out")


def _res(lee=True, cos=None):
    rng = np.random.default_rng(0)
    cos = cos or {2: [0.95, 0.90, 0.88, 0.91], 3: [0.267, 0.135, 0.122, 0.127],
                  4: [0.0742, 0.0297, 0.0244, 0.0244]}
    summary = []
    for b in BITS:
        for k, m in enumerate(METHS):
            e = {"bits": b, "method": m, "label": demo.METHODS[m], "one_minus_cos": cos[b][k],
                 "one_minus_cos_max": 2 * cos[b][k], "seconds_factor": 1.0, "seconds_solve": 1.0}
            if lee:
                p = {2: 0.1, 3: 0.5 + 0.02 * k, 4: 0.65}[b]
                e["lee"] = {"pearson": p, "spearman": p - 0.1}
            summary.append(e)
    layers = {}
    for i in range(6):
        for kind in KINDS:
            bits = {}
            for b in BITS:
                bits[b] = {m: {"proxy": {"input": rng.uniform(0.1, 1), "attention": rng.uniform(0.1, 1),
                                         "local": rng.uniform(0.1, 1)}, "seconds_solve": 0.1}
                           for m in METHS}
            layers[f"layer.{i}.{kind}"] = {"shape": [384, 384], "factor_seconds": {}, "bits": bits}
    return {"bits": BITS, "methods": METHS, "summary": summary, "layers": layers,
            "fp32": {"lee": {"pearson": 0.66, "spearman": 0.55} if lee else None}}


def test_findings_in_words():
    lines = [ln for ln in demo._findings(_res()) if ln.startswith("- ")]
    assert len(lines) == 3
    two, three, four = lines
    assert "every method destroys the model" in two and "mean nothing" in two
    assert "0.88" in two  # the best 1−cos, named
    # 3 bits: attention is best; 0.122 / 0.135 = 0.904 -> 10 % lower; 0.122 / 0.267 -> 54 % lower
    assert demo.METHODS["attention"] in three
    assert "10 % lower than one-sided LDLQ's (0.135)" in three
    assert "54 % lower than round-to-nearest's (0.267)" in three
    assert "far from the original" in three
    assert "18 % lower than one-sided LDLQ's" in four and "measurably changed" in four
    for ln in lines:  # no mechanical rankings
        assert "÷" not in ln and " < " not in ln and "(better)" not in ln


def test_findings_name_methods_worse_than_rtn_and_ties():
    cos = {2: [0.9] * 4, 3: [0.100, 0.150, 0.101, 0.099], 4: [0.05, 0.02, 0.02, 0.02]}
    lines = [ln for ln in demo._findings(_res(lee=False, cos=cos)) if ln.startswith("- ")]
    assert "Worse than round-to-nearest here: " + demo.METHODS["ldlq"] in lines[1]
    assert "about the same as round-to-nearest's" in lines[1]  # 0.099 vs 0.100
    assert "Lee" not in "".join(lines)


def test_compare_wording():
    assert demo._compare(0.5, 1.0) == "50 % lower than"
    assert demo._compare(1.02, 1.0) == "about the same as"
    assert demo._compare(1.5, 1.0) == "50 % higher than"
    assert demo._compare(3.0, 1.0) == "3.0× that of"


def test_quality_figure_labels_the_fp32_line():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = demo._quality_figure(_res())
    try:
        lee_ax = fig.axes[1]
        texts = [t.get_text() for t in lee_ax.texts] + [ln.get_label() for ln in lee_ax.lines]
        assert any(t.startswith("fp32 (original model)") for t in texts), texts
    finally:
        plt.close(fig)


def test_proxy_figure_has_one_panel_per_kind_and_width():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = demo._proxy_figure(_res())
    try:
        axes = [ax for ax in fig.axes if ax.get_title() or ax.get_xlabel() or ax.lines]
        assert len(axes) == len(BITS) * len(KINDS)
        assert [ax.get_title() for ax in axes[:len(KINDS)]] == list(KINDS)
        # each panel: the six encoder blocks on x
        for ax in axes:
            for line in ax.get_lines():
                xs = list(line.get_xdata())
                assert xs == list(range(6)) or len(xs) == 2  # data, or the RTN = 1 line
    finally:
        plt.close(fig)


def test_plots_are_pngs():
    pytest.importorskip("matplotlib")
    q, p = demo._plots(_res(lee=False))
    assert q[:8] == p[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(rb"IHDR", p)


def test_findings_call_a_near_tie_a_tie():
    cos = {2: [0.9] * 4, 3: [0.2, 0.1, 0.05, 0.06], 4: [0.0742, 0.0297, 0.02439, 0.02437]}
    four = [ln for ln in demo._findings(_res(lee=False, cos=cos)) if ln.startswith("- ")][2]
    assert (f"{demo.METHODS['local']} and {demo.METHODS['attention']} come (within 3 % of each "
            "other) closest") in four
    three = [ln for ln in demo._findings(_res(lee=False, cos=cos)) if ln.startswith("- ")][1]
    assert f"{demo.METHODS['attention']} comes closest" in three
