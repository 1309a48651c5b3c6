"""llama.cpp itself (through ``llama-cpp-python``) loads bakron's GGUF exports and its logits
agree with bakron's forward of the same quantized weights (docs/export.md, "Read back by
llama.cpp"). Optional: skipped when ``llama_cpp`` is not importable (it is a source
distribution that compiles llama.cpp).

The two forwards differ by the block formats' arithmetic: for Q4_0, Q4_1 and Q8_0 weights
llama.cpp's CPU kernels quantize each activation vector to 8-bit blocks of 32 (Q8_0, or Q8_1
for Q4_1: a step of max|x| / 127 per block) before the integer dot products, and keep the
attention's K/V cache in float16; bakron multiplies the same de-quantized weights by float32
activations. The agreement is therefore measured against the quantization's own effect
(bakron's original model against its export): it must be many times smaller."""
from __future__ import annotations

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("tqdm")

from bakron.models import load_llm  # noqa: E402
from bakron.quantize_model import quantize_model  # noqa: E402

FORMATS = ["gguf-q4_0", "gguf-q4_1", "gguf-q8_0"]
TEXTS = ["The quick brown fox jumps over the lazy dog while the theme of the text goes on.",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
         "In 1905 the physicist published four papers that changed how we think about time."]


def llama_cpp_logits(path, ids) -> np.ndarray:
    """llama.cpp's logits (T, vocab) for the token ids ``ids`` (no BOS added)."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(32, len(ids)), n_batch=len(ids),
                          logits_all=True, verbose=False, n_threads=2, seed=0)
    try:
        llm.reset()
        llm.eval(list(ids))
        return np.array(llm.scores[:len(ids)], dtype=np.float64)
    finally:
        llm.close()


def _log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def agreement(ref, other) -> dict:
    """Mean KL(ref || other) per position (nats), top-1 agreement, and the largest logit
    difference relative to the logits' spread, over every position of ``(T, vocab)``
    logit arrays."""
    lr, lo = _log_softmax(ref), _log_softmax(other)
    kl = float((np.exp(lr) * (lr - lo)).sum(axis=-1).mean())
    top1 = float((ref.argmax(-1) == other.argmax(-1)).mean())
    rel = float(np.abs(ref - other).max() / ref.std())
    return {"kl": kl, "top1": top1, "max_rel": rel}


def compare(model, export, texts=TEXTS) -> dict:
    """{"llama_cpp": agreement(bakron on the export, llama.cpp on the export),
    "quantization": agreement(bakron on ``model``, bakron on the export)} over ``texts``."""
    orig, quant = load_llm(model), load_llm(export)
    a, b, c = [], [], []
    for ids in orig.tokenize(texts):
        ids = ids[:min(len(ids), orig.config.max_positions)]
        a.append(np.asarray(quant.logits(ids), dtype=np.float64))
        b.append(llama_cpp_logits(export, ids))
        c.append(np.asarray(orig.logits(ids), dtype=np.float64))
    q, ll, o = np.concatenate(a), np.concatenate(b), np.concatenate(c)
    return {"llama_cpp": agreement(q, ll), "quantization": agreement(o, q),
            "positions": int(q.shape[0])}


def _check(res):
    ll, qz = res["llama_cpp"], res["quantization"]
    # llama.cpp and bakron agree far more closely than the export and the original model:
    # Q8 activations and an f16 KV cache move the distribution much less than 4-bit weights
    assert ll["kl"] < 0.1 * qz["kl"] or ll["kl"] < 1e-4, res
    assert ll["top1"] >= 0.9, res


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_llama_export_agrees_with_llama_cpp(tmp_path, fmt):
    from test_llm_loaders import tiny_config, tiny_weights, write_gguf

    cfg = tiny_config(tied=False)
    write_gguf(tmp_path / "tiny.gguf", cfg, tiny_weights(cfg, seed=3))
    out = tmp_path / f"tiny-{fmt}.gguf"
    quantize_model(tmp_path / "tiny.gguf", out, fmt=fmt, factors="rtn", progress=False)
    _check(compare(tmp_path / "tiny.gguf", out, ["the theme then he the", "he the t the theme"]))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_smollm2_export_agrees_with_llama_cpp(smollm2, tmp_path, fmt):
    out = tmp_path / f"smollm2-{fmt}.gguf"
    quantize_model("smollm2", out, fmt=fmt, factors="rtn", progress=False)
    _check(compare("smollm2", out))
