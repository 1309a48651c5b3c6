"""write_dequantized: W_hat stored in the source tensor's own dtype (BF16/F16/F32)."""
import json

import numpy as np
import pytest

import bakron
from bakron import _safetensors
from bakron.export import GPTQGrid, write_dequantized
from bakron.io import InputError, OutputExistsError
from test_export_gptq import bf16_to_f32, make_folder, read_safetensors

gguf = pytest.importorskip("gguf")


def test_bf16_source_stays_bf16(tmp_path):
    w = make_folder(tmp_path / "src")
    layers = {}
    for k, name in enumerate(n for n in w if n.endswith("_proj.weight")):
        W = w[name].astype(np.float64)
        if k % 2:  # a grid whose values bf16 holds exactly: power-of-two step, 4-bit codes
            q = bakron.UniformQuantizer(4, 2.0 ** -6)
        else:      # GPTQ's grid: fp16 scales times codes need up to 15 bits: rounded
            q = GPTQGrid.fit(W, 4, group_size=64)
        layers[name[:-len(".weight")]] = (np.asarray(q.rtn(W)[0]), q)
    rounding = write_dequantized(tmp_path / "out", tmp_path / "src", layers)
    t = read_safetensors(tmp_path / "out" / "model.safetensors")
    for k, (key, (W_hat, q)) in enumerate(layers.items()):
        arr, dt = t[key + ".weight"]
        assert dt == "BF16"
        # gguf's BF16 conversion (ggml's round to nearest even) is the reference
        ref = gguf.quants.quantize(W_hat.astype(np.float32), gguf.GGMLQuantizationType.BF16)
        assert np.array_equal(arr.view(np.uint8).reshape(ref.shape), ref)
        if k % 2:
            assert rounding[key] == 0.0
            assert np.array_equal(bf16_to_f32(arr).astype(np.float64), W_hat)
        else:
            got = bf16_to_f32(arr).astype(np.float64)
            assert rounding[key] == pytest.approx(np.max(np.abs(got - W_hat)))
            assert rounding[key] <= 2.0 ** -8 * np.max(np.abs(W_hat))
    for name in w:
        if not name.endswith("_proj.weight"):
            assert np.array_equal(bf16_to_f32(t[name][0]), w[name])
    assert json.loads((tmp_path / "out/config.json").read_text()) == \
        json.loads((tmp_path / "src/config.json").read_text())


def test_f16_and_f32_sources(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    src.mkdir()
    W16 = (0.1 * rng.standard_normal((64, 64))).astype(np.float16)
    W32 = (0.1 * rng.standard_normal((64, 64))).astype(np.float32)
    _safetensors.save(src / "model.safetensors", {
        "model.layers.0.mlp.up_proj.weight": W16, "model.layers.0.mlp.down_proj.weight": W32,
        "model.norm.weight": np.ones(64, np.float16)})
    (src / "config.json").write_text("{}")
    g = GPTQGrid.fit(W16, 4, group_size=32)
    W_hat16 = np.asarray(g.rtn(W16.astype(np.float64))[0])
    g2 = GPTQGrid.fit(W32, 4, group_size=32)
    W_hat32 = np.asarray(g2.rtn(W32.astype(np.float64))[0])
    rounding = write_dequantized(tmp_path / "out", src, {"blk.0.ffn_up": (W_hat16, g),
                                                         "blk.0.ffn_down": W_hat32})
    t = read_safetensors(tmp_path / "out" / "model.safetensors")
    assert t["model.layers.0.mlp.up_proj.weight"][1] == "F16"
    assert np.array_equal(t["model.layers.0.mlp.up_proj.weight"][0], W_hat16.astype(np.float16))
    assert t["model.layers.0.mlp.down_proj.weight"][1] == "F32"
    assert np.array_equal(t["model.layers.0.mlp.down_proj.weight"][0].astype(np.float64),
                          W_hat32)
    assert rounding["model.layers.0.mlp.down_proj"] == 0.0
    assert t["model.norm.weight"][1] == "F16"


def test_refusals(tmp_path):
    w = make_folder(tmp_path / "src")
    name = "model.layers.0.mlp.up_proj"
    W = w[name + ".weight"]
    with pytest.raises(ValueError, match="shape"):
        write_dequantized(tmp_path / "o", tmp_path / "src", {name: W.T})
    with pytest.raises(ValueError, match="NaN"):
        write_dequantized(tmp_path / "o", tmp_path / "src", {name: W * np.nan})
    with pytest.raises(InputError, match="no tensor"):
        write_dequantized(tmp_path / "o", tmp_path / "src", {"blk.9.ffn_up": W})
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()
    with pytest.raises(OutputExistsError):
        write_dequantized(tmp_path / "o", tmp_path / "src", {name: W})
