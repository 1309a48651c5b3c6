"""The exports read by a consumer of its own: transformers (with torch) loads the float folder
and the GGUF file that ``quantize_model`` wrote (from a source of the same kind and across
kinds), and the Hugging Face folder ``gguf_to_hf`` writes; its forward pass gives bakron's
logits.

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


# -- across formats: a GGUF source to Hugging Face folders, an HF source to GGUF ---------------

def _qwen3_cfg():
    from bakron.models.llm import LlamaConfig

    return LlamaConfig(**{**tiny_config("qwen3", tied=False).__dict__, "head_dim": 16})


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_transformers_reads_the_folder_converted_from_gguf(tmp_path, arch):
    """gguf_to_hf: config.json (rope_parameters), the weights (Q/K rows back in HF order) and
    tokenizer.json load in transformers; its logits are bakron's of the GGUF."""
    from bakron.export.from_gguf import gguf_to_hf

    cfg = tiny_config(tied=False) if arch == "llama" else _qwen3_cfg()
    write_gguf(tmp_path / "m.gguf", cfg, tiny_weights(cfg, seed=9))
    folder = gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    lm = load_llm(tmp_path / "m.gguf")
    _assert_same_logits(hf, lm)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = " the 12 theme <|endoftext|> then"
    assert tok.encode(text, add_special_tokens=False) == lm.tokenizer.encode(text)


@pytest.mark.parametrize("fmt", ["float", "gptq"])
def test_transformers_reads_the_hf_exports_of_a_gguf_source(models, tmp_path, fmt):
    if fmt == "gptq":   # transformers loads GPTQ checkpoints through gptqmodel's kernels
        pytest.importorskip("gptqmodel")
    out = tmp_path / fmt
    res = quantize_model(models / "tiny.gguf", out, fmt=fmt, factors="global", bits=4,
                         group_size=16, keep_weights=True, **FAST)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    if fmt == "float":
        lm = load_llm(out)
        _assert_same_logits(hf, lm)
        q = hf.model.layers[0].self_attn.q_proj.weight.detach().numpy()
        np.testing.assert_array_equal(q, res["weights"]["blk.0.attn_q"])
    else:
        lm = res["model_object"].with_weights(res["weights"])
        for ids in IDS:
            want = np.asarray(lm.logits(ids), dtype=np.float64)
            got = _hf_logits(hf.to("cpu"), ids)
            assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()   # fp16 kernels


@pytest.mark.parametrize("fmt", ["gguf-q4_0", "gguf-q8_0"])
def test_transformers_reads_the_gguf_export_of_an_hf_source(models, tmp_path, fmt):
    out = tmp_path / "q.gguf"
    res = quantize_model(models / "hf32", out, fmt=fmt, factors="global", keep_weights=True,
                         **FAST)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name,
                                                           dtype=torch.float32)
    lm = load_llm(out)
    _assert_same_logits(hf, lm)
    for layer, name in ((0, "blk.0.attn_q"), (1, "blk.1.attn_k")):   # llama.cpp's order undone
        attn = hf.model.layers[layer].self_attn
        q = (attn.q_proj if name.endswith("q") else attn.k_proj).weight.detach().numpy()
        np.testing.assert_array_equal(q, res["weights"][name])
