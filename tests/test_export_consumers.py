"""The exports read by a consumer of its own: transformers (with torch) loads the float folder
and the GGUF file that ``quantize_model`` wrote, and its forward pass gives bakron's logits.

transformers reads a GGUF with its own code (metadata to config, llama.cpp's Q/K row order
undone, the block formats de-quantized by the ``gguf`` package); it checks the names, the
metadata and the permutation that bakron's writer produces. Skipped where torch or
transformers is not installed (CI); run on a machine that has them."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("tqdm")

from bakron.models import load_llm  # noqa: E402
from bakron.quantize_model import quantize_model  # noqa: E402
from test_llm_loaders import (tiny_config, tiny_weights, write_gguf,  # noqa: E402
                              write_hf_folder)

FAST = {"calib_seqs": 4, "calib_len": 16, "progress": False}
IDS = [[5, 17, 42, 99, 3, 250, 7, 8, 1, 64], [2, 2, 9, 130, 77]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("consumers")
    cfg = tiny_config(tied=False)
    w = tiny_weights(cfg, seed=5)
    write_gguf(d / "tiny.gguf", cfg, w)
    tok = load_llm(d / "tiny.gguf").tokenizer
    write_hf_folder(d / "hf32", cfg, w, dtype="F32", tokenizer=tok)
    return d


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def _assert_same_logits(hf_model, lm):
    for ids in IDS:
        want = np.asarray(lm.logits(ids), dtype=np.float64)
        got = _hf_logits(hf_model, ids)
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()


def test_transformers_reads_the_float_export(models, tmp_path):
    out = tmp_path / "float"
    res = quantize_model(models / "hf32", out, fmt="float", factors="global", bits=4,
                         group_size=16, keep_weights=True, **FAST)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    lm = load_llm(out)
    _assert_same_logits(hf, lm)
    # and the folder holds W_hat, not the source weights
    q = hf.model.layers[0].mlp.up_proj.weight.detach().numpy()
    np.testing.assert_array_equal(q, res["weights"]["blk.0.ffn_up"])


@pytest.mark.parametrize("fmt", ["gguf-q4_0", "gguf-q4_1", "gguf-q8_0"])
def test_transformers_reads_the_gguf_export(models, tmp_path, fmt):
    out = tmp_path / "q.gguf"
    res = quantize_model(models / "tiny.gguf", out, fmt=fmt, factors="global",
                         keep_weights=True, **FAST)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name,
                                                           dtype=torch.float32)
    lm = load_llm(out)
    _assert_same_logits(hf, lm)
    # transformers' de-quantization of a linear (its row order) is W_hat
    q = hf.model.layers[1].mlp.down_proj.weight.detach().numpy()
    np.testing.assert_array_equal(q, res["weights"]["blk.1.ffn_down"])
