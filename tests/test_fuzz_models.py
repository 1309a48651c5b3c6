"""Fuzzing the model loaders: hostile config.json values, shard indexes, GGUF metadata and GGUF
tensor tables either load correctly or raise the documented named error.

The documented errors are :class:`~bakron.models.llm.ModelUnavailableError` (with its
subclass :class:`~bakron.models.llm.ModelFileError`) and
:class:`~bakron.models.llm.UnsupportedModelError`; the message must name the file. Any other
exception fails the test, and so does an example that runs longer than 60 s (a hang) or whose
traced memory peaks above 256 MiB (the tiny model needs well under 1 MiB). A file that loads
must give what it says: the configuration its keys hold and, when its tensor table was not
touched, the original weights.

GGUF files are written here byte by byte (the gguf package's writer refuses many of the
hostile values), from a tiny Llama with F32, F16 and Q8_0 tensors. The figures are in
docs/reliability.md. BAKRON_FUZZ_EXAMPLES=N sets the examples per strategy (150 by default).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import signal
import struct
import tempfile
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from bakron.models import load_llm  # noqa: E402
from bakron.models.llm import (ModelUnavailableError, UnsupportedModelError,  # noqa: E402
                               schema)
from test_llm_loaders import (MERGES, TOKENS, tiny_config, tiny_weights,  # noqa: E402
                              write_hf_folder)

FUZZ = settings(max_examples=int(os.environ.get("BAKRON_FUZZ_EXAMPLES", "150")),
                deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
NAMED = (ModelUnavailableError, UnsupportedModelError)
Q = gguf.GGMLQuantizationType
CFG = tiny_config()
WEIGHTS = tiny_weights(CFG)


@contextlib.contextmanager
def _bounded(seconds=60, memory=256 << 20):
    """Fail an example that hangs (SIGALRM after ``seconds``) or whose traced allocations
    peak above ``memory`` bytes."""
    def timeout(signum, frame):
        raise TimeoutError(f"the example ran longer than {seconds} s")
    old = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert peak < memory, f"the example's traced memory peaked at {peak} bytes"


def _load(path):
    """The loaded model, or None after a documented error naming ``path``."""
    with _bounded():
        try:
            lm = load_llm(path)
        except NAMED as exc:
            assert str(path) in str(exc), f"the message does not name the file: {exc}"
            event(type(exc).__name__)
            return None
    event("loaded")
    return lm


# -- config.json and the shard index --------------------------------------------------------------
_counts = st.sampled_from([0, 1, 2, 3, 4, 8, 12, 16, 32, 64, 259, 260, 2 ** 31 - 1, 2 ** 31,
                           10 ** 12, -1])
_scalars = st.one_of(st.none(), st.booleans(), _counts, st.integers(-2 ** 70, 2 ** 70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                     st.sampled_from(["LlamaForCausalLM", "Qwen3ForCausalLM", "llama", "qwen3",
                                      "32", "1e-5", "llama3", "default"]))
_scaling = st.dictionaries(
    st.sampled_from(["rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings", "rope_theta"]),
    st.one_of(st.sampled_from(["llama3", "default", "yarn"]), _scalars), max_size=6)
_values = st.one_of(_scalars, st.lists(_scalars, max_size=3), _scaling)
_KEYS = [k for k, _ in schema.FIELDS.values()] + [
    "architectures", "model_type", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "use_sliding_window", "attention_bias", "mlp_bias"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """(folder, its config.json value, its index value): a tiny Llama in two shards."""
    folder = tmp_path_factory.mktemp("hf") / "m"
    write_hf_folder(folder, CFG, WEIGHTS, shards=2)
    return (folder, json.loads((folder / "config.json").read_text()),
            json.loads((folder / "model.safetensors.index.json").read_text()))


def _expect_config(raw: dict, cfg) -> None:
    """A config.json that loads gives exactly its values."""
    for field, (key, _g) in schema.FIELDS.items():
        v = raw.get(key)
        if key == "eos_token_id" and isinstance(v, list):
            v = v[0] if v else None
        if v is None:
            continue
        got = getattr(cfg, field)
        if field in ("rope_theta", "rms_eps"):
            assert got == float(v), (field, v, got)
        else:
            assert got == v and type(got) is type(v), (field, v, got)


def _write(folder, config, index):
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@FUZZ
@given(st.dictionaries(st.sampled_from(_KEYS), _values, max_size=4),
       st.lists(st.sampled_from(_KEYS), max_size=2),
       st.one_of(st.none(), _values))
def test_fuzz_config_json(hf_folder, changes, removed, whole):
    folder, config, index = hf_folder
    raw = {k: v for k, v in {**config, **changes}.items() if k not in removed}
    if whole is not None and not changes:
        raw = whole                                  # not an object at all
    _write(folder, raw, index)
    lm = _load(folder)
    if lm is not None:
        assert isinstance(raw, dict)
        _expect_config(raw, lm.config)
        for k, W in WEIGHTS.items():
            np.testing.assert_array_equal(np.asarray(lm.weights[k]), W)


_shard_names = st.one_of(
    st.sampled_from(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "../outside.safetensors", "/etc/passwd", "", ".", "sub/../x",
                     "C:\\x.safetensors", "model-00003-of-00002.safetensors"]),
    _scalars)
_tensor_names = st.sampled_from([f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)]
                                + ["model.embed_tokens.weight", "model.norm.weight",
                                   "__metadata__", "x"])


@FUZZ
@given(st.dictionaries(_tensor_names, _shard_names, max_size=3), st.one_of(st.none(), _values))
def test_fuzz_shard_index(hf_folder, changes, whole):
    folder, config, index = hf_folder
    content = {**index, "weight_map": {**index["weight_map"], **changes}}
    if whole is not None and not changes:
        content = {**index, "weight_map": whole}
    _write(folder, config, content)
    lm = _load(folder)
    if lm is not None:
        for k, W in WEIGHTS.items():
            np.testing.assert_array_equal(np.asarray(lm.weights[k]), W)


# -- GGUF files written byte by byte --------------------------------------------------------------
# value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array,
# 10 u64, 11 i64, 12 f64
_PACK = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
         11: "<q", 12: "<d"}
_RANGES = {0: (0, 255), 1: (-128, 127), 2: (0, 2 ** 16 - 1), 3: (-2 ** 15, 2 ** 15 - 1),
           4: (0, 2 ** 32 - 1), 5: (-2 ** 31, 2 ** 31 - 1), 10: (0, 2 ** 64 - 1),
           11: (-2 ** 63, 2 ** 63 - 1)}


def _str(s) -> bytes:
    b = s.encode("utf-8", errors="surrogatepass") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _val(vtype: int, value, length=None) -> bytes:
    if vtype == 8:
        return _str(value)
    if vtype == 9:
        itype, items = value
        n = len(items) if length is None else length
        return struct.pack("<IQ", itype, n) + b"".join(_val(itype, v) for v in items)
    if vtype in _PACK:
        return struct.pack(_PACK[vtype], value)
    return bytes(value)     # an unknown type: whatever bytes follow


def gguf_bytes(kvs, tensors, data: bytes, *, n_tensors=None, n_kv=None, alignment=32,
               version=3) -> bytes:
    """A GGUF file: ``kvs`` [(key, type, value, declared array length or None)],
    ``tensors`` [(name, dims innermost first, GGML type, offset)], ``data`` the data section."""
    out = [b"GGUF", struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                len(kvs) if n_kv is None else n_kv)]
    for key, vtype, value, length in kvs:
        out += [_str(key), struct.pack("<I", vtype), _val(vtype, value, length)]
    for name, dims, ttype, offset in tensors:
        out += [_str(name), struct.pack("<I", len(dims)),
                b"".join(struct.pack("<Q", d) for d in dims), struct.pack("<IQ", ttype, offset)]
    head = b"".join(out)
    head += b"\0" * (-len(head) % alignment)
    return head + data


def _base_gguf():
    """(kvs, tensors, data) of the tiny Llama: F32 norms and embedding, F16 and Q8_0 mats."""
    c = CFG
    kvs = [("general.architecture", 8, "llama", None),
           ("llama.block_count", 4, c.num_layers, None),
           ("llama.context_length", 4, c.max_positions, None),
           ("llama.embedding_length", 4, c.hidden_size, None),
           ("llama.feed_forward_length", 4, c.intermediate_size, None),
           ("llama.attention.head_count", 4, c.num_heads, None),
           ("llama.attention.head_count_kv", 4, c.num_kv_heads, None),
           ("llama.rope.freq_base", 6, c.rope_theta, None),
           ("llama.attention.layer_norm_rms_epsilon", 6, c.rms_eps, None),
           ("tokenizer.ggml.model", 8, "gpt2", None),
           ("tokenizer.ggml.pre", 8, "smollm", None),
           ("tokenizer.ggml.tokens", 9, (8, TOKENS), None),
           ("tokenizer.ggml.merges", 9, (8, MERGES), None),
           ("tokenizer.ggml.token_type", 9, (5, [3] + [1] * (len(TOKENS) - 1)), None),
           ("tokenizer.ggml.bos_token_id", 4, 0, None),
           ("tokenizer.ggml.eos_token_id", 4, 0, None)]
    tensors, blobs, off = [], [], 0
    for name, W in WEIGHTS.items():
        t = Q.F32 if W.ndim == 1 or name == "token_embd.weight" else (
            Q.Q8_0 if "ffn" in name else Q.F16)
        b = gguf.quants.quantize(W, t).tobytes()
        tensors.append((name, list(reversed(W.shape)), int(t), off))
        blobs.append(b + b"\0" * (-len(b) % 32))
        off += len(blobs[-1])
    return kvs, tensors, b"".join(blobs)


BASE_KVS, BASE_TENSORS, BASE_DATA = _base_gguf()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The model the unmodified bytes give (it must load)."""
    path = tmp_path_factory.mktemp("gguf") / "base.gguf"
    path.write_bytes(gguf_bytes(BASE_KVS, BASE_TENSORS, BASE_DATA))
    lm = load_llm(path)
    assert lm.config == CFG
    return {k: np.asarray(v) for k, v in lm.weights.items()}


def _tmp_file(data: bytes):
    d = tempfile.mkdtemp(prefix="bakron-fuzz-")
    path = pathlib.Path(d) / "m.gguf"
    path.write_bytes(data)
    return path


def _cleanup(path):
    path.unlink()
    path.parent.rmdir()


@st.composite
def _gguf_value(draw):
    vtype = draw(st.sampled_from(list(range(13)) + [13, 255]))
    if vtype in _RANGES:
        lo, hi = _RANGES[vtype]
        return vtype, draw(st.one_of(st.integers(lo, hi), st.sampled_from(
            [max(lo, min(hi, v)) for v in (0, 1, 2, 4, 32, 260, 2 ** 31, 2 ** 32 - 1)]))), None
    if vtype in (6, 12):
        return vtype, draw(st.floats(allow_nan=True, allow_infinity=True,
                                     width=32 if vtype == 6 else 64)), None
    if vtype == 7:
        return vtype, draw(st.booleans()), None
    if vtype == 8:
        return vtype, draw(st.text(max_size=8)), None
    if vtype == 9:
        itype = draw(st.sampled_from([4, 5, 6, 8, 9, 10, 13]))
        if itype in (4, 5, 10):
            lo, hi = _RANGES[itype]
            items = draw(st.lists(st.integers(lo, hi), max_size=4))
        elif itype == 6:
            items = draw(st.lists(st.floats(width=32), max_size=4))
        elif itype == 8:
            items = draw(st.lists(st.text(max_size=4), max_size=4))
        elif itype == 9:
            items = [(4, [1])] * draw(st.integers(0, 2))
        else:
            items = []
        length = draw(st.one_of(st.none(), st.sampled_from([0, 5, 2 ** 31, 2 ** 62])))
        return 9, (itype, items), length
    return vtype, draw(st.binary(max_size=8)), None


_KV_KEYS = [k for k, *_ in BASE_KVS] + ["general.alignment", "llama.vocab_size",
                                        "llama.attention.key_length", "llama.rope.scaling.type",
                                        "general.name", "general.file_type"]


@FUZZ
@given(st.dictionaries(st.sampled_from(_KV_KEYS), _gguf_value(), max_size=3),
       st.lists(st.sampled_from(_KV_KEYS), max_size=2), st.booleans(),
       st.one_of(st.none(), st.integers(0, 2 ** 64 - 1)))
def test_fuzz_gguf_metadata(reference, changes, removed, duplicate, n_kv):
    kvs = [kv for kv in BASE_KVS if kv[0] not in removed and kv[0] not in changes]
    kvs += [(k, *v) for k, v in changes.items()]
    if duplicate and kvs:
        kvs.append(kvs[0])
    path = _tmp_file(gguf_bytes(kvs, BASE_TENSORS, BASE_DATA, n_kv=n_kv))
    try:
        lm = _load(path)
    finally:
        _cleanup(path)
    if lm is not None:    # the tensor table was not touched: the original weights
        for k, W in reference.items():
            np.testing.assert_array_equal(np.asarray(lm.weights[k]), W, err_msg=k)


_NAMES = [t[0] for t in BASE_TENSORS]


@st.composite
def _tensor_edit(draw):
    field = draw(st.sampled_from(["offset", "dims", "n_dims", "type", "name", "drop", "dup"]))
    if field == "offset":
        return field, draw(st.one_of(st.integers(0, 2 ** 64 - 1), st.integers(-64, 64),
                                     st.sampled_from([0, 4, 32, -32, 2 ** 40])))
    if field == "dims":
        return field, draw(st.lists(st.one_of(st.integers(0, 300), st.sampled_from(
            [2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64 - 1])), min_size=1, max_size=5))
    if field == "type":
        return field, draw(st.one_of(st.sampled_from([int(t) for t in Q]),
                                     st.integers(0, 2 ** 32 - 1)))
    if field == "name":
        return field, draw(st.one_of(st.sampled_from(_NAMES + ["blk.7.attn_q.weight",
                                                              "blk.0.attn_q.bias", "x", ""]),
                                     st.text(max_size=6)))
    return field, None


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(range(len(BASE_TENSORS))), _tensor_edit()),
                min_size=1, max_size=3),
       st.one_of(st.none(), st.integers(0, 2 ** 64 - 1)))
def test_fuzz_gguf_tensor_table(reference, edits, n_tensors):
    table = [list(t) for t in BASE_TENSORS]
    for i, (field, v) in edits:
        i = min(i, len(table) - 1)
        if i < 0:
            break
        name, dims, ttype, off = table[i]
        if field == "offset":
            table[i][3] = off + v if -64 <= v <= 64 else v
            table[i][3] %= 2 ** 64
        elif field == "dims":
            table[i][1] = v
        elif field == "n_dims":
            table[i][1] = dims[:1] if len(dims) > 1 else dims + [1]
        elif field == "type":
            table[i][2] = v
        elif field == "name":
            table[i][0] = v
        elif field == "drop":
            table.pop(i)
        else:
            table.append(list(table[i]))
    path = _tmp_file(gguf_bytes(BASE_KVS, [tuple(t) for t in table], BASE_DATA,
                                n_tensors=n_tensors))
    try:
        lm = _load(path)
    finally:
        _cleanup(path)
    if lm is not None:
        # an accepted table never moves a tensor: data offsets are fixed by the sizes
        kept = {t[0]: t[3] for t in table}
        for name, _dims, _t, off in BASE_TENSORS:
            if name in kept:
                assert kept[name] == off, (name, kept[name], off)
        base = {(n, tuple(d), ty, o) for n, d, ty, o in BASE_TENSORS}
        unchanged = {t[0] for t in table if (t[0], tuple(t[1]), t[2], t[3]) in base}
        for k in unchanged & set(reference):
            np.testing.assert_array_equal(np.asarray(lm.weights[k]), reference[k], err_msg=k)
        for k, W in lm.weights.items():
            assert np.isfinite(np.asarray(W)).all()


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 4000), st.binary(min_size=1, max_size=8)),
                min_size=1, max_size=4),
       st.one_of(st.none(), st.integers(0, 8000)))
def test_fuzz_gguf_header_bytes(reference, patches, cut):
    data = bytearray(gguf_bytes(BASE_KVS, BASE_TENSORS, BASE_DATA))
    for pos, b in patches:
        data[pos:pos + len(b)] = b
    if cut is not None:
        data = data[:cut]
    path = _tmp_file(bytes(data))
    try:
        lm = _load(path)
    finally:
        _cleanup(path)
    if lm is not None:
        for k, W in lm.weights.items():
            assert np.isfinite(np.asarray(W)).all()
            assert W.shape == reference[k].shape


def test_the_builder_writes_what_gguf_reads(reference):
    """The byte-by-byte writer agrees with the gguf package's reader."""
    path = _tmp_file(gguf_bytes(BASE_KVS, BASE_TENSORS, BASE_DATA))
    try:
        r = gguf.GGUFReader(str(path))
        assert [t.name for t in r.tensors] == _NAMES
        assert r.fields["llama.block_count"].contents() == CFG.num_layers
        assert r.fields["tokenizer.ggml.tokens"].contents() == TOKENS
        del r
    finally:
        _cleanup(path)
    assert math.isclose(float(np.abs(reference["blk.0.ffn_up.weight"]
                                     - WEIGHTS["blk.0.ffn_up.weight"]).max()), 0.0,
                        abs_tol=0.05)   # Q8_0 round trip
