"""Model files are untrusted input: hostile or careless GGUF files and Hugging Face folders get
a named error from ``load_llm`` (the file and the key or tensor in the message), never a
silently wrong model, a traceback, a hang or a memory blow-up; ``bakron quantize-model``
answers them with exit code 4 and writes nothing. The cases come from the third hardening
audit; the policies are in docs/reliability.md ("Model files")."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from bakron.cli import main  # noqa: E402
from bakron.models import load_llm  # noqa: E402
from bakron.models.llm import (ModelFileError, ModelUnavailableError,  # noqa: E402
                               UnsupportedModelError)
from bakron.models.llm.gguf_file import read_gguf  # noqa: E402
from bakron.quantize_model import work_folder  # noqa: E402
from test_llm_loaders import (TOKENS, tiny_config, tiny_weights, write_gguf,  # noqa: E402
                              write_hf_folder)

Q = gguf.GGMLQuantizationType


@pytest.fixture
def tiny_gguf(tmp_path):
    cfg = tiny_config()
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, tiny_weights(cfg))
    return path


def _patch(path, edit):
    """Edit the GGUF ``path`` in place through the gguf package's reader (its fields are
    views of the file): ``edit(reader)``."""
    r = gguf.GGUFReader(str(path), "r+")
    edit(r)
    r.data.flush()
    del r


def _tensor(r, name):
    return next(t for t in r.tensors if t.name == name)


def _set_offset(name, value):
    def edit(r):
        _tensor(r, name).field.parts[5][0] = value
    return edit


def _set_field(key, value):
    def edit(r):
        r.fields[key].parts[-1][0] = value
    return edit


def _raises(cls, fn, *needles):
    with pytest.raises(cls) as info:
        fn()
    msg = str(info.value)
    for n in needles:
        assert n in msg, msg
    return msg


# -- 1. GGUF tensor data offsets --------------------------------------------------------------
def test_gguf_tensor_offsets_are_checked(tiny_gguf):
    assert load_llm(tiny_gguf).config.num_layers == 2            # the file as written loads
    base = {t.name: int(t.field.parts[5][0]) for t in gguf.GGUFReader(str(tiny_gguf)).tensors}
    name = "blk.0.ffn_up.weight"
    good = tiny_gguf.read_bytes()
    cases = [(0, "offset 0"),                                 # aliases token_embd's bytes
             (base[name] + 4, "not a multiple of the alignment (32)"),    # shifted by 4
             (base[name] - 32, "would overlap the tensors before it"),
             (base[name] + 32, "leaves a gap"),
             (2 ** 40, "offset 1099511627776")]
    for value, needle in cases:
        tiny_gguf.write_bytes(good)
        _patch(tiny_gguf, _set_offset(name, value))
        _raises(ModelFileError, lambda: load_llm(tiny_gguf), str(tiny_gguf), repr(name),
                needle)


def test_gguf_tensor_sizes_and_file_end(tiny_gguf):
    good = tiny_gguf.read_bytes()
    # a tensor declared F16 instead of F32 is half the size: the next tensor's offset is off
    names = [t.name for t in gguf.GGUFReader(str(tiny_gguf)).tensors]
    first = names[0]

    def to_f16(r):
        _tensor(r, first).field.parts[4][0] = int(Q.F16)
    _patch(tiny_gguf, to_f16)
    _raises(ModelFileError, lambda: load_llm(tiny_gguf), repr(names[1]), "expected")
    # the last tensor runs past the end of a truncated file
    tiny_gguf.write_bytes(good[:-16])
    _raises(ModelFileError, lambda: load_llm(tiny_gguf), repr(names[-1]), "truncated")
    # a first dimension that is not a multiple of the type's block (Q8_0: 32)
    cfg = tiny_config()
    w = tiny_weights(cfg)
    path = tiny_gguf.parent / "q8.gguf"
    write_gguf(path, cfg, w, types={"ffn_down": Q.Q8_0})

    def odd_rows(r):
        _tensor(r, "blk.0.ffn_down.weight").field.parts[3][0] = 48
    _patch(path, odd_rows)
    _raises(ModelFileError, lambda: load_llm(path), "'blk.0.ffn_down.weight'",
            "not a multiple of its type's block of 32")


def test_gguf_header_counts_and_lengths(tiny_gguf):
    good = tiny_gguf.read_bytes()
    # an array length far beyond the file (the gguf package's reader loops on it)
    r = gguf.GGUFReader(str(tiny_gguf))
    f = r.fields["tokenizer.ggml.merges"]
    at = f.offset + sum(int(p.nbytes) for p in f.parts[:4])      # key len, key, type, item type
    data = bytearray(good)
    data[at:at + 8] = (2 ** 62).to_bytes(8, "little")
    tiny_gguf.write_bytes(bytes(data))
    _raises(ModelFileError, lambda: load_llm(tiny_gguf), "'tokenizer.ggml.merges'",
            "past the end of the file")
    # a tensor count of 2**40
    data = bytearray(good)
    data[8:16] = (2 ** 40).to_bytes(8, "little")
    tiny_gguf.write_bytes(bytes(data))
    _raises(ModelFileError, lambda: load_llm(tiny_gguf), "declares 1099511627776 tensors")


# -- 3. tokenizer / embedding / config --------------------------------------------------------
def test_tokenizer_must_match_the_embedding(tmp_path):
    cfg = tiny_config(vocab=200)                  # TOKENS has 260 entries
    w = tiny_weights(cfg)
    write_gguf(tmp_path / "m.gguf", cfg, w)
    _raises(ModelFileError, lambda: load_llm(tmp_path / "m.gguf"), "260 tokens",
            "200 rows", "m.gguf")
    tok = load_llm(_full_gguf(tmp_path)).tokenizer
    write_hf_folder(tmp_path / "hf", cfg, w, tokenizer=tok)
    _raises(ModelFileError, lambda: load_llm(tmp_path / "hf"), "token id 259",
            "vocab_size", "is 200")
    # more embedding rows than tokens is what llama.cpp's converter pads: fine for a folder
    big = tiny_config(vocab=300)
    write_hf_folder(tmp_path / "pad", big, tiny_weights(big), tokenizer=tok)
    assert load_llm(tmp_path / "pad").config.vocab_size == 300


def _full_gguf(tmp_path):
    cfg = tiny_config()
    path = tmp_path / "full.gguf"
    if not path.exists():
        write_gguf(path, cfg, tiny_weights(cfg))
    return path


def test_gguf_without_a_tokenizer(tmp_path):
    cfg = tiny_config()
    write_gguf(tmp_path / "m.gguf", cfg, tiny_weights(cfg), tokenizer=False)
    _raises(ModelFileError, lambda: load_llm(tmp_path / "m.gguf"), "has no tokenizer",
            "tokenizer.ggml.tokens")
    m = read_gguf(tmp_path / "m.gguf", tokenizer=False)      # token ids only: the rows count
    assert m.tokenizer is None and m.config.vocab_size == cfg.vocab_size


# -- 4. counts checked against what the files hold --------------------------------------------
@pytest.mark.parametrize("count,needle", [
    (2 ** 31, "must be an integer in 1..2147483647, got 2147483648"),
    (2 ** 31 - 1, "holds tensors of 2 block(s)"),
    (1, "holds tensors of block 1"),
])
def test_gguf_block_count(tiny_gguf, count, needle):
    _patch(tiny_gguf, _set_field("llama.block_count", count))
    _raises(ModelFileError, lambda: load_llm(tiny_gguf), "llama.block_count", needle)


@pytest.mark.parametrize("value,needle", [
    (1e12, "must be an integer, got float 1000000000000.0"),
    (10 ** 12, "must be an integer in 1..2147483647"),
    (2 ** 31 - 1, "holds tensors of 2 block(s)"),
    (1, "holds tensors of block 1"),
])
def test_hf_num_hidden_layers(tmp_path, value, needle):
    cfg = tiny_config()
    write_hf_folder(tmp_path / "m", cfg, tiny_weights(cfg), extra={"num_hidden_layers": value})
    _raises(ModelFileError, lambda: load_llm(tmp_path / "m"), "num_hidden_layers", needle)


# -- 5. config.json, the shard index and the GGUF metadata against one schema ------------------
CONFIG_CASES = [
    ("hidden_size", None, "has no 'hidden_size'"),
    ("hidden_size", [32], "hidden_size must be an integer, got list"),
    ("hidden_size", "abc", "hidden_size must be an integer, got str 'abc'"),
    ("hidden_size", 32.9, "hidden_size must be an integer, got float 32.9"),
    ("hidden_size", True, "hidden_size must be an integer, got bool"),
    ("num_attention_heads", 0, "num_attention_heads must be an integer in 1.."),
    ("num_key_value_heads", 3, "num_attention_heads=4 must be a multiple of"),
    ("num_key_value_heads", 0, "num_key_value_heads must be an integer in 1.."),
    ("head_dim", 7, "head_dim must be even"),
    ("vocab_size", 10 ** 12, "vocab_size must be an integer in 1.."),
    ("rope_scaling", [1, 2], "rope_scaling must be an object or null, got list"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
     "high_freq_factor (4.0) must be larger than low_freq_factor"),
    ("bos_token_id", "<s>", "bos_token_id must be an integer, got str '<s>'"),
    ("bos_token_id", 260, "bos_token_id must be an integer in 0..259"),
    ("eos_token_id", [0, "x"], "eos_token_id[1] must be an integer"),
    ("rms_norm_eps", "tiny", "rms_norm_eps must be a number, got str 'tiny'"),
    ("rms_norm_eps", math.inf, "rms_norm_eps must be a finite number > 0, got inf"),
    ("rms_norm_eps", 0.0, "rms_norm_eps must be a finite number > 0, got 0.0"),
    ("rope_theta", math.inf, "rope_theta must be a finite number > 0, got inf"),
    ("rope_theta", math.nan, "rope_theta must be a finite number > 0, got nan"),
    ("architectures", "LlamaForCausalLM", "architectures must be a list of class names"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false"),
    ("max_position_embeddings", -5, "max_position_embeddings must be an integer in 1.."),
]


@pytest.mark.parametrize("key,value,needle", CONFIG_CASES,
                         ids=[f"{k}={v!r}"[:40] for k, v, _ in CONFIG_CASES])
def test_config_values(tmp_path, key, value, needle):
    cfg = tiny_config()
    folder = tmp_path / "m"
    write_hf_folder(folder, cfg, tiny_weights(cfg), extra={key: value})
    msg = _raises(ModelFileError, lambda: load_llm(folder), needle)
    assert str(folder / "config.json") in msg


@pytest.mark.parametrize("content,needle", [
    ([1, 2], "must hold a JSON object, got list"), (None, "must hold a JSON object, got NoneType"),
    ("x", "must hold a JSON object, got str")])
def test_config_not_an_object(tmp_path, content, needle):
    cfg = tiny_config()
    folder = tmp_path / "m"
    write_hf_folder(folder, cfg, tiny_weights(cfg))
    (folder / "config.json").write_text(json.dumps(content))
    _raises(ModelFileError, lambda: load_llm(folder), str(folder / "config.json"), needle)
    (folder / "config.json").write_text("[" * 100000)
    _raises(ModelFileError, lambda: load_llm(folder), "is not valid JSON")


def test_shard_index(tmp_path):
    cfg = tiny_config()
    folder = tmp_path / "m"
    write_hf_folder(folder, cfg, tiny_weights(cfg), shards=2)
    index = folder / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    name = sorted(good["weight_map"])[0]
    shard = good["weight_map"][name]
    (tmp_path / "outside.safetensors").write_bytes((folder / shard).read_bytes())
    cases = [
        ({**good, "weight_map": list(good["weight_map"])}, "weight_map must be an object"),
        ({**good, "weight_map": {**good["weight_map"], name: 3}},
         f"weight_map[{name!r}] must be a shard file name, got int 3"),
        ({**good, "weight_map": {**good["weight_map"], name: "../outside.safetensors"}},
         "leaves the model folder"),
        ({**good, "weight_map": {**good["weight_map"],
                                 name: str(tmp_path / "outside.safetensors")}},
         "leaves the model folder"),
        ({**good, "weight_map": {**good["weight_map"], "model.layers.0.extra.weight": shard}},
         "'model.layers.0.extra.weight'"),
        ([good], "must hold a JSON object"),
    ]
    for content, needle in cases:
        index.write_text(json.dumps(content))
        _raises(ModelFileError, lambda: load_llm(folder), str(index), needle)


@pytest.mark.parametrize("key,value,needle", [
    ("llama.attention.head_count", 0, "must be an integer in 1.."),
    ("llama.attention.head_count_kv", 3, "must be a multiple of"),
    ("llama.attention.layer_norm_rms_epsilon", math.inf, "finite number > 0, got inf"),
    ("llama.rope.freq_base", math.inf, "finite number > 0, got inf"),
    ("llama.rope.freq_base", math.nan, "finite number > 0, got nan"),
    ("llama.context_length", 0, "must be an integer in 1.."),
    ("tokenizer.ggml.bos_token_id", 100000, "must be an integer in 0..259"),
])
def test_gguf_metadata_values(tiny_gguf, key, value, needle):
    _patch(tiny_gguf, _set_field(key, value))
    _raises(ModelFileError, lambda: load_llm(tiny_gguf), str(tiny_gguf), key, needle)


def test_gguf_block_tensor_that_is_not_implemented(tmp_path):
    cfg = tiny_config()
    bias = np.zeros(cfg.hidden_size, np.float32)
    write_gguf(tmp_path / "m.gguf", cfg, tiny_weights(cfg),
               extra_tensors={"blk.0.attn_q.bias": (bias, Q.F32)})
    _raises(UnsupportedModelError, lambda: load_llm(tmp_path / "m.gguf"),
            "'blk.0.attn_q.bias'", "would be ignored")


def test_decode_and_tokenize_errors(tiny_gguf):
    lm = load_llm(tiny_gguf)
    _raises(ValueError, lambda: lm.decode([-1]), "ids[0] = -1 is outside the vocabulary 0..259")
    _raises(ValueError, lambda: lm.decode([5, 2 ** 40]), "ids[1] = 1099511627776")
    _raises(ValueError, lambda: lm.decode([5, 1.5]), "ids[1] is float 1.5")
    assert lm.decode(np.asarray([TOKENS.index("Ġthe")])) == " the"
    _raises(ValueError, lambda: lm.tokenize(["fine", "ab\ud800c"]), "texts[1]",
            "lone surrogate '\\ud800' at position 2")
    _raises(ValueError, lambda: lm.tokenizer.encode("\udfff"), "text holds", "position 0")


def test_load_llm_on_an_unusable_path(tmp_path):
    long = str(tmp_path / ("x" * 5000))
    msg = _raises(ModelUnavailableError, lambda: load_llm(long), "cannot be used",
                  "File name too long")
    assert len(msg) < 300
    _raises(ModelUnavailableError, lambda: load_llm(str(tmp_path / "a\0b")), "not found",
            "\\x00")


# -- 6. weights: finite, floating point, within the forward pass's range -----------------------
@pytest.mark.parametrize("value,needle", [
    (math.nan, "1 NaN or infinite value"), (math.inf, "1 NaN or infinite value"),
    (3e38, "magnitude 3e+38; its square overflows float32")])
@pytest.mark.parametrize("tensor", ["blk.1.ffn_up.weight", "token_embd.weight"])
def test_nonfinite_weights_are_named(tmp_path, value, needle, tensor):
    cfg = tiny_config()
    w = tiny_weights(cfg)
    w[tensor][1, 2] = value
    write_hf_folder(tmp_path / "hf", cfg, w)
    msg = _raises(ModelFileError, lambda: load_llm(tmp_path / "hf"), needle)
    hf = {"blk.1.ffn_up.weight": "model.layers.1.mlp.up_proj.weight",
          "token_embd.weight": "model.embed_tokens.weight"}[tensor]
    assert repr(hf) in msg and "model.safetensors" in msg
    write_gguf(tmp_path / "m.gguf", cfg, w)
    _raises(ModelFileError, lambda: load_llm(tmp_path / "m.gguf"), repr(tensor), needle)
    if value == 3e38:     # in float64 the forward pass holds such a weight
        assert load_llm(tmp_path / "hf", dtype="float64").config == cfg


def test_integer_and_overflowing_weights(tmp_path):
    from bakron import _safetensors

    cfg = tiny_config()
    w = tiny_weights(cfg)
    write_hf_folder(tmp_path / "hf", cfg, w)
    st = tmp_path / "hf" / "model.safetensors"
    tensors = _safetensors.load(st)
    name = "model.layers.0.self_attn.q_proj.weight"
    _safetensors.save(st, {**tensors, name: np.ones(tensors[name].shape, np.int32)})
    _raises(ModelFileError, lambda: load_llm(tmp_path / "hf"), repr(name), "stored as I32",
            "floating point")
    big = tensors[name].astype(np.float64)
    big[0, 0] = 1e300                                  # F64 beyond float32's range
    _safetensors.save(st, {**tensors, name: big})
    _raises(ModelFileError, lambda: load_llm(tmp_path / "hf"), repr(name), "NaN or infinite")
    skip = "blk.0.ffn_up.weight"
    write_gguf(tmp_path / "i.gguf", cfg, w, skip=(skip,), extra_tensors={
        skip: (np.ones(w[skip].shape, np.int32), Q.I32)})
    _raises(ModelFileError, lambda: load_llm(tmp_path / "i.gguf"), repr(skip), "stored as I32")


# -- the command line: exit 4, nothing written -------------------------------------------------
def _hostile_models(tmp_path):
    cfg = tiny_config()
    w = tiny_weights(cfg)
    nan = dict(w, **{"blk.0.attn_v.weight": w["blk.0.attn_v.weight"].copy()})
    nan["blk.0.attn_v.weight"][0, 0] = math.nan
    write_hf_folder(tmp_path / "nan", cfg, nan)
    write_hf_folder(tmp_path / "abc", cfg, w, extra={"hidden_size": "abc"})
    write_hf_folder(tmp_path / "bomb", cfg, w, extra={"num_hidden_layers": 2 ** 31 - 1})
    write_gguf(tmp_path / "alias.gguf", cfg, w)
    _patch(tmp_path / "alias.gguf", _set_offset("blk.0.ffn_up.weight", 0))
    return [(tmp_path / "nan", "model.layers.0.self_attn.v_proj.weight"),
            (tmp_path / "abc", "hidden_size"), (tmp_path / "bomb", "num_hidden_layers"),
            (tmp_path / "alias.gguf", "blk.0.ffn_up.weight")]


def test_quantize_model_exits_4_and_writes_nothing(tmp_path, capsys):
    for model, needle in _hostile_models(tmp_path):
        for fmt in ("float", "gptq"):
            out = tmp_path / f"out-{model.name}-{fmt}"
            rc = main(["quantize-model", str(model), "--out", str(out), "--format", fmt,
                       "--group-size", "32", "--quiet"])
            err = capsys.readouterr().err
            assert rc == 4, err
            assert needle in err and str(model) in err, err
            assert not out.exists() and not work_folder(out).exists()
