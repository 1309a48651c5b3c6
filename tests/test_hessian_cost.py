"""The cost model of the Hessian passes (bakron.hessian.cost) and --calib-tokens."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

import bakron.hessian as bh
from bakron.hessian import cost
from bakron.quantize_model import CALIB_SEQS, quantize_model


def _mlp(sizes, seed=0):
    rng = np.random.default_rng(seed)
    st = []
    for k in range(len(sizes) - 1):
        st.append(bh.Linear(rng.standard_normal((sizes[k + 1], sizes[k])), name=f"fc{k}"))
        if k < len(sizes) - 2:
            st.append(bh.ReLU())
    return st + [bh.SoftmaxCrossEntropy()]


def test_pass_gemms_and_flops_of_an_mlp():
    g = cost.pass_gemms(_mlp([6, 8, 4]), 10)
    assert g["fwd"] == [("gemm", 10, 6, 8), ("gemm", 10, 8, 4)]
    assert g["vjp"] == [("gemm", 10, 4, 8)]          # no input gradient for the first layer
    assert g["in"] == [6, 8] and g["out"] == [8, 4] and g["layers"] == [(8, 6), (4, 8)]
    f = cost.pass_flops(g)
    assert f["forward"] == 2 * 10 * (6 * 8 + 8 * 4) and f["vjp"] == 2 * 10 * 4 * 8
    assert f["kfac_products"] == 10 * (36 + 64 + 64 + 16)
    assert f["kfac"] == f["forward"] + f["vjp"] + f["kfac_products"]
    assert f["inputs"] == f["forward"] + 10 * (36 + 64)   # the forward-only pass: H_in alone


def test_the_forward_only_pass_leaves_out_the_head():
    from bakron.hessian import LMHead

    rng = np.random.default_rng(2)
    g = cost.pass_gemms([bh.Linear(rng.standard_normal((8, 6)), name="a"),
                         LMHead(rng.standard_normal((50, 8)))], 10)
    assert g["head"] == [("gemm", 10, 8, 50)] and g["head"][0] in g["fwd"]
    f = cost.pass_flops(g)
    assert f["inputs"] == 2 * 10 * 6 * 8 + 10 * 36
    st = _mlp([32, 64, 10])
    kfac = cost.estimate_seconds(st, 1000, passes=1, rate=1e9)
    fwd = cost.estimate_seconds(st, 1000, passes=1, rate=1e9, forward_only=True)
    assert 0 < fwd < kfac
    line = cost.announce(st, [[1] * 100] * 20, passes=1, batch_size=8, forward_only=True)
    assert line.startswith("input factors: 1 forward pass over 2,000 calibration tokens")


def test_shared_inputs_count_once():
    from bakron.hessian import SwiGLU

    rng = np.random.default_rng(1)
    ffn = SwiGLU(rng.standard_normal((12, 5)), rng.standard_normal((12, 5)),
                 rng.standard_normal((5, 12)))
    g = cost.pass_gemms([bh.Residual([ffn], name="b")], 7)
    assert g["in"] == [5, 12]                         # gate/up share one H_in
    assert g["out"] == [12, 12, 5] and len(g["layers"]) == 3


def test_estimate_scales_with_tokens_and_passes():
    st = _mlp([32, 64, 10])
    one = cost.estimate_seconds(st, 1000, passes=1, rate=1e9)
    assert one > 0
    assert cost.estimate_seconds(st, 2000, passes=1, rate=1e9) == pytest.approx(2 * one)
    assert cost.estimate_seconds(st, 1000, passes=3, rate=1e9) > 2.9 * one
    assert cost.estimate_seconds(st, 0, passes=3) == 0.0
    assert cost.gemm_rate(64, 32, 64, repeats=1) > 0
    line = cost.announce(st, [[1] * 100] * 20, passes=3, batch_size=8)
    assert line.startswith("global Hessians: 3 passes over 2,000 calibration tokens, about ")
    assert line.endswith(" on this machine")


def test_format_duration():
    from bakron.hessian.progress import format_duration

    assert format_duration(45) == "45 s" and format_duration(360) == "6 min"
    assert format_duration(3 * 3600) == "3.0 h" and format_duration(float("inf")) == "?"


def test_calib_tokens_round_up_to_whole_sequences():
    from bakron import cli

    p = cli.build_parser()
    a = p.parse_args(["quantize-model", "smollm2", "--out", "x.gguf", "--calib-tokens",
                      "1000", "--calib-len", "128"])
    assert cli._calib_seqs(a) == 8
    a = p.parse_args(["quantize-model", "smollm2", "--out", "x.gguf"])
    default = inspect.signature(quantize_model).parameters["calib_seqs"].default
    assert cli._calib_seqs(a) == default == CALIB_SEQS   # the command's is the library's
    with pytest.raises(cli.UsageError, match="not allowed with"):
        p.parse_args(["quantize-model", "smollm2", "--out", "x.gguf", "--calib-tokens", "10",
                      "--calib-seqs", "2"])
