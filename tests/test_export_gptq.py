"""write_gptq: unpacked with an independent reader of GPTQ's documented layout."""
import json
import struct

import numpy as np
import pytest

import bakron
from bakron import _safetensors
from bakron.export import GPTQGrid, as_gptq_grid, hf_linear_name, read_gptq, write_gptq
from bakron.io import InputError, OutputExistsError

D, FF, KV_ROWS, LAYERS, VOCAB = 128, 256, 64, 2, 48
LINEARS = {"self_attn.q_proj": (D, D), "self_attn.k_proj": (KV_ROWS, D),
           "self_attn.v_proj": (KV_ROWS, D), "self_attn.o_proj": (D, D),
           "mlp.gate_proj": (FF, D), "mlp.up_proj": (FF, D), "mlp.down_proj": (D, FF)}


# -- an independent reader of the checkpoint (safetensors + GPTQ's bit layout) ------------

def read_safetensors(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        buf = raw[8 + n + b:8 + n + e]
        dt = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "BF16": "<u2"}[info["dtype"]]
        out[name] = (np.frombuffer(buf, dtype=dt).reshape(info["shape"]), info["dtype"])
    return out


def unpack_words(words, bits, axis):
    """int32 words -> unsigned fields of ``bits`` bits, lowest bits first, along ``axis``."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    per = 32 // bits
    fields = [(u >> (bits * k)) & ((1 << bits) - 1) for k in range(per)]
    stacked = np.stack(fields, axis=axis + 1)        # (.., words, per, ..)
    shape = list(words.shape)
    shape[axis] *= per
    return stacked.reshape(shape)


def dequantize_gptq(t, prefix, bits, fmt="gptq"):
    qweight, _ = t[prefix + ".qweight"]
    qzeros, _ = t[prefix + ".qzeros"]
    scales, dt = t[prefix + ".scales"]
    g_idx, _ = t[prefix + ".g_idx"]
    assert dt == "F16"
    q = unpack_words(qweight, bits, axis=0)               # (in, out)
    z = unpack_words(qzeros, bits, axis=1)                # (groups, out)
    if fmt == "gptq":
        z = z + 1
    s = scales.astype(np.float32)
    W = s[g_idx] * (q - z[g_idx]).astype(np.float32)      # (in, out), exact in float32
    return W.T


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


# -- a tiny Hugging Face folder -----------------------------------------------------------

def make_folder(path, seed=0, shards=False, bias=False):
    rng = np.random.default_rng(seed)
    path.mkdir()
    w = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, D)),
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(D)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(D)
        for name, shape in LINEARS.items():
            w[p + name + ".weight"] = 0.05 * rng.standard_normal(shape)
            if bias and name.startswith("self_attn.") and name != "self_attn.o_proj":
                w[p + name + ".bias"] = 0.1 * rng.standard_normal(shape[0])  # as Qwen2 has
    # stored as BF16 (bit patterns, rounded by truncation: the stored numbers are what count)
    stored = {k: (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
              for k, v in w.items()}
    names = sorted(stored)
    if shards:
        half = len(names) // 2
        parts = {"model-00001-of-00002.safetensors": names[:half],
                 "model-00002-of-00002.safetensors": names[half:]}
        for f, ns in parts.items():
            _safetensors.save(path / f, {n: stored[n] for n in ns}, bf16=set(ns))
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: f for f, ns in parts.items() for n in ns}}))
    else:
        _safetensors.save(path / "model.safetensors", stored, bf16=set(names))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": D, "intermediate_size": FF, "num_hidden_layers": LAYERS,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
              "torch_dtype": "bfloat16", "tie_word_embeddings": True}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (path / "generation_config.json").write_text('{"do_sample": false}')
    return {k: bf16_to_f32(v) for k, v in stored.items()}


def spd(n, seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((2 * n, n))
    return X.T @ X / (2 * n)


def quantize_all(w, bits, group_size, sym, solve_some=True, **fit):
    layers = {}
    for k, name in enumerate(n for n in w if n.endswith("_proj.weight")):
        W = w[name].astype(np.float64)
        grid = GPTQGrid.fit(W, bits, group_size=group_size, sym=sym, **fit)
        key = name[:-len(".weight")]
        if solve_some and k % 3 == 0:
            layers[key] = bakron.quantize_layer(W, spd(W.shape[1], k), spd(W.shape[0], k + 1),
                                                quantizer=grid, tile=16)
        else:
            layers[key] = (grid.rtn(W)[0], grid)
    return layers


def values(layer):
    return np.asarray(layer.values if hasattr(layer, "values") else layer[0])


@pytest.mark.parametrize("bits,group_size,sym", [(4, 128, True), (4, 32, False),
                                                 (4, 64, True), (8, 64, False),
                                                 (2, 32, True), (4, None, False)])
def test_round_trip_through_independent_reader(tmp_path, bits, group_size, sym):
    w = make_folder(tmp_path / "src")
    layers = quantize_all(w, bits, group_size, sym, solve_some=(bits, group_size) == (4, 128))
    out = write_gptq(tmp_path / "out", tmp_path / "src", layers)
    t = read_safetensors(out / "model.safetensors")
    for key, layer in layers.items():
        assert key + ".weight" not in t
        W = dequantize_gptq(t, key, bits)
        assert np.array_equal(W.astype(np.float64), values(layer))
        n = W.shape[1]
        g = n if group_size is None else group_size
        assert np.array_equal(t[key + ".g_idx"][0], np.arange(n) // g)
        assert t[key + ".qweight"][0].shape == (n * bits // 32, W.shape[0])
    for name in w:  # everything else: the stored BF16 bits, untouched
        if not name.endswith("_proj.weight"):
            arr, dt = t[name]
            assert dt == "BF16" and np.array_equal(bf16_to_f32(arr), w[name])
    # the library's own reader (for bakron's forward on the export) agrees
    dense = read_gptq(out)
    assert sorted(dense) == sorted(w)
    for name in w:
        key = name[:-len(".weight")]
        want = values(layers[key]) if key in layers else w[name]
        assert dense[name].dtype == np.float32
        assert np.array_equal(dense[name].astype(np.float64), np.asarray(want, np.float64))
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q == json.loads((out / "quantize_config.json").read_text())
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"], q["desc_act"],
            q["checkpoint_format"]) == ("gptq", bits, -1 if group_size is None else group_size,
                                        sym, False, "gptq")
    assert cfg["hidden_size"] == D and cfg["torch_dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_text() == (tmp_path / "src/tokenizer.json").read_text()
    assert (out / "generation_config.json").is_file()


def test_symmetric_zero_points_and_v1_offset(tmp_path):
    w = make_folder(tmp_path / "src")
    layers = quantize_all(w, 4, 128, True, solve_some=False)
    out = write_gptq(tmp_path / "out", tmp_path / "src", layers)
    t = read_safetensors(out / "model.safetensors")
    qz = t["model.layers.0.self_attn.q_proj.qzeros"][0]
    assert np.all(qz.view(np.uint32) == 0x77777777)   # zero 8 stored as 7 in every nibble


def test_gptq_v2_and_zero_point_zero(tmp_path):
    w = make_folder(tmp_path / "src", seed=1)
    name = "model.layers.1.mlp.up_proj.weight"
    layers = quantize_all(w, 4, 32, False, solve_some=False, min_zero=0)
    # make one group all non-negative, so that GPTQ's rule gives it the zero point 0
    W = np.abs(w[name]).astype(np.float64)
    grid = GPTQGrid.fit(W, 4, group_size=32, sym=False, min_zero=0)
    assert grid._zero.min() == 0
    layers[name[:-7]] = (grid.rtn(W)[0], grid)
    with pytest.raises(ValueError, match="cannot hold a zero point of 0"):
        write_gptq(tmp_path / "v1", tmp_path / "src", layers)
    assert not (tmp_path / "v1").exists()
    with pytest.raises(ValueError, match="shape"):  # W_hat of another shape than the source
        write_gptq(tmp_path / "v2", tmp_path / "src", dict(layers, **{
            "model.layers.0.mlp.down_proj": layers[name[:-7]]}), checkpoint_format="gptq_v2")
    out = write_gptq(tmp_path / "v2", tmp_path / "src", layers, checkpoint_format="gptq_v2")
    t = read_safetensors(out / "model.safetensors")
    dense = read_gptq(out)
    for key, layer in layers.items():
        got = dequantize_gptq(t, key, 4, fmt="gptq_v2")
        assert np.array_equal(got.astype(np.float64), values(layer))
        assert np.array_equal(dense[key + ".weight"], got)


def test_sharded_source_gguf_names_and_uniform_quantizers(tmp_path):
    w = make_folder(tmp_path / "src", seed=2, shards=True, bias=True)
    layers = {}
    for name in w:
        if name.endswith("_proj.weight"):
            m = name.split(".")
            short = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                     "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                     "down_proj": "ffn_down"}[m[4]]
            key = f"blk.{m[2]}.{short}"
            assert hf_linear_name(key) == name[:-7]
            W = w[name].astype(np.float64)
            # a bakron uniform grid with fp16 scales: symmetric, per group of 64
            scale = UniformFit(W)
            q = bakron.UniformQuantizer(4, scale, symmetric=True, group_size=64)
            layers[key] = (q.rtn(W)[0], q)
    out = write_gptq(tmp_path / "out", tmp_path / "src", layers)
    assert not (out / "model.safetensors.index.json").exists()
    t = read_safetensors(out / "model.safetensors")
    for key, (W_hat, _q) in layers.items():
        got = dequantize_gptq(t, hf_linear_name(key), 4)
        assert np.array_equal(got.astype(np.float64), W_hat)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["sym"] is True
    dense = read_gptq(out)
    biases = [n for n in w if n.endswith(".bias")]
    assert len(biases) == 3 * LAYERS
    for n in biases:  # biases stay next to the packed weights, in their stored dtype
        assert t[n][1] == "BF16" and np.array_equal(dense[n], w[n])


def UniformFit(W):
    s = bakron.UniformQuantizer.fit(W, 4, granularity="group", group_size=64).scale
    return np.asarray(s, np.float32).astype(np.float16).astype(np.float64)


# -- bad input ---------------------------------------------------------------------------

def test_grid_refusals():
    W = np.random.default_rng(0).standard_normal((8, 64))
    with pytest.raises(ValueError, match="bits in .*3-bit"):
        GPTQGrid.fit(W, 3)
    with pytest.raises(ValueError, match="group_size must divide the 64 inputs"):
        GPTQGrid.fit(W, 4, group_size=48)
    with pytest.raises(ValueError, match="cannot store .*3 bits"):
        as_gptq_grid(bakron.UniformQuantizer.fit(W, 3), 64)
    with pytest.raises(ValueError, match="not float16 numbers"):
        as_gptq_grid(bakron.UniformQuantizer(4, 0.1), 64)
    with pytest.raises(ValueError, match="zero points are not integers"):
        as_gptq_grid(bakron.UniformQuantizer(4, 0.125, symmetric=False, zero_point=7.5), 64)
    with pytest.raises(ValueError, match="not one"):
        as_gptq_grid(object(), 64)
    grid = GPTQGrid.fit(W, 4, group_size=32)
    W_hat = np.asarray(grid.rtn(W)[0]).copy()
    W_hat[1, 2] += 1e-3
    with pytest.raises(ValueError, match=r"not on this GPTQ grid at 1 entries \(first \[1, 2\]"):
        grid.encode(W_hat)


def test_writer_refusals_write_nothing(tmp_path):
    w = make_folder(tmp_path / "src")
    layers = quantize_all(w, 4, 64, True, solve_some=False)
    partial = dict(list(layers.items())[:-1])
    with pytest.raises(ValueError, match="every linear of the decoder blocks; 1 have"):
        write_gptq(tmp_path / "o", tmp_path / "src", partial)
    mixed = dict(layers)
    k = next(iter(mixed))
    W = w[k + ".weight"].astype(np.float64)
    g8 = GPTQGrid.fit(W, 8, group_size=64)
    mixed[k] = (g8.rtn(W)[0], g8)
    with pytest.raises(ValueError, match="mix bits \\[4, 8\\]"):
        write_gptq(tmp_path / "o", tmp_path / "src", mixed)
    with pytest.raises(InputError, match="no tensor 'model.layers.7"):
        write_gptq(tmp_path / "o", tmp_path / "src", dict(layers, **{"blk.7.attn_q": layers[k]}))
    with pytest.raises(InputError, match="no config.json"):
        write_gptq(tmp_path / "o", tmp_path, layers)
    with pytest.raises(ValueError, match="checkpoint_format"):
        write_gptq(tmp_path / "o", tmp_path / "src", layers, checkpoint_format="awq")
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()
    with pytest.raises(OutputExistsError):
        write_gptq(tmp_path / "o", tmp_path / "src", layers)
    with pytest.raises(InputError, match="would contain or replace the input"):
        write_gptq(tmp_path / "src", tmp_path / "src", layers, force=True)
    write_gptq(tmp_path / "o", tmp_path / "src", layers, force=True)
    assert (tmp_path / "o" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "src"]  # no temporaries


def test_missing_shard(tmp_path):
    make_folder(tmp_path / "src", shards=True)
    (tmp_path / "src" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InputError, match="shard.*missing"):
        write_gptq(tmp_path / "o", tmp_path / "src", {"x": None})


def test_fit_follows_gptqs_min_max_rule():
    rng = np.random.default_rng(3)
    W = rng.standard_normal((4, 64)).astype(np.float32)
    W[0, :32] += 3.0                                   # a group with no negative weight
    g = GPTQGrid.fit(W, 4, group_size=32, sym=False, min_zero=0)
    b = W.reshape(4, 2, 32)
    lo, hi = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)
    scale = (hi - lo) / np.float32(15)
    assert np.array_equal(g._scale, scale.astype(np.float16).astype(np.float64))
    assert np.array_equal(g._zero, np.round(-lo / scale))
    assert g._zero[0, 0] == 0
    g1 = GPTQGrid.fit(W, 4, group_size=32, sym=False)  # v1-safe: zero 1, the top still reached
    assert g1._zero[0, 0] == 1 and np.array_equal(g1._zero[1:], g._zero[1:])
    assert g1._scale[0, 0] == np.float16(b[0, 0].max() / np.float32(14))
    assert np.array_equal(g1._scale[1:], g._scale[1:])
    s = GPTQGrid.fit(W, 4, group_size=32, sym=True)
    amax = np.abs(b).max(-1)
    assert np.array_equal(s._scale, (2 * amax / np.float32(15)).astype(np.float16)
                          .astype(np.float64))
    assert np.all(s._zero == 8) and s.sym


def test_read_gptq_refusals(tmp_path):
    make_folder(tmp_path / "plain")
    with pytest.raises(InputError, match="no GPTQ quantization_config"):
        read_gptq(tmp_path / "plain")
    w = make_folder(tmp_path / "src")
    out = write_gptq(tmp_path / "out", tmp_path / "src", quantize_all(w, 4, 64, True, False))
    data = read_safetensors(out / "model.safetensors")
    kept = {k: v[0] for k, v in data.items() if not k.endswith("q_proj.g_idx")}
    bf16 = {k for k, v in data.items() if v[1] == "BF16"}
    _safetensors.save(out / "model.safetensors", {k: np.array(v) for k, v in kept.items()},
                      bf16=bf16)
    with pytest.raises(InputError, match="q_proj' lacks 'model.layers.0.self_attn.q_proj.g_idx'"):
        read_gptq(out)
