"""Key/value-cached generation (:mod:`bakron.models.llm.generate`): the cached steps give the
full forward pass's logits, greedy tokens are the argmax of the full-sequence log-probs at
every step, sampling is reproducible for a seed, on tiny random Llama / Qwen3 models and on
SmolLM2 (skipped where it cannot be fetched)."""
from __future__ import annotations

import numpy as np
import pytest

from bakron.models.llm import CausalLM

from test_llm_loaders import tiny_config, tiny_weights  # noqa: E402


def _tiny(arch="llama", dtype="float64", seed=3, **kw):
    cfg = tiny_config(arch, **kw)
    return CausalLM(cfg, tiny_weights(cfg, seed=seed), dtype=dtype)


PROMPTS = [[5, 17, 42, 9, 100, 7], [3], [250, 11, 11, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def _check_against_full(lm, prompts, new, logits, rtol, atol):
    """Every step's logits equal the full forward's at that position and the greedy token
    is their argmax."""
    for p, toks, lg in zip(prompts, new, logits):
        seq = list(p) + list(toks)
        full = np.asarray(lm.logits(seq), dtype=np.float64)
        want = full[len(p) - 1:len(seq) - 1]
        assert lg.shape == want.shape
        np.testing.assert_allclose(lg, want, rtol=rtol, atol=atol)
        assert list(np.argmax(want, axis=-1)) == list(toks)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cached_steps_equal_the_full_forward(arch):
    lm = _tiny(arch)
    new, logits = lm.generate(PROMPTS, 12, greedy=True, stop=(), batch_size=3,
                              return_logits=True)
    assert [len(t) for t in new] == [12] * len(PROMPTS)
    _check_against_full(lm, PROMPTS, new, logits, rtol=1e-9, atol=1e-9)


def test_float32_within_float32_tolerance():
    lm = _tiny(dtype="float32")
    new, logits = lm.generate(PROMPTS, 10, greedy=True, stop=(), return_logits=True)
    _check_against_full(lm, PROMPTS, new, logits, rtol=1e-4, atol=1e-4)


def test_batched_equals_one_at_a_time_and_single_prompt_form():
    lm = _tiny()
    together = lm.generate(PROMPTS, 9, greedy=True, stop=())
    alone = [lm.generate(p, 9, greedy=True, stop=()) for p in PROMPTS]
    assert together == alone
    assert lm.greedy(PROMPTS[0], 9, stop=()) == alone[0]


def test_padded_batch_input():
    lm = _tiny()
    batch = np.full((2, 6), -1, dtype=np.int64)
    batch[0, :6] = PROMPTS[0]
    batch[1, :1] = PROMPTS[1]
    assert lm.generate(batch, 5, greedy=True, stop=()) == \
        lm.generate(PROMPTS[:2], 5, greedy=True, stop=())


def test_sampling_is_reproducible_and_follows_the_seed():
    lm = _tiny(dtype="float32")
    a = lm.generate(PROMPTS, 15, seed=7, stop=(), batch_size=4)
    b = lm.generate(PROMPTS, 15, seed=7, stop=(), batch_size=1)   # batch size does not matter
    c = lm.generate(PROMPTS, 15, seed=8, stop=())
    assert a == b
    assert a != c
    assert all(0 <= t < lm.config.vocab_size for s in a for t in s)


def test_sampling_draws_from_the_softmax():
    """Over many sequences, the first sampled token's frequencies match the softmax of the
    prompt's last logits at temperature 0.5 (chi-square-style bound)."""
    lm = _tiny(vocab=12)
    n = 3000
    toks = lm.generate([[3, 4]] * n, 1, temperature=0.5, seed=1, stop=(), batch_size=1000)
    counts = np.bincount([t[0] for t in toks], minlength=12)
    z = np.asarray(lm.logits([3, 4]))[-1] / 0.5
    p = np.exp(z - z.max())
    p /= p.sum()
    sd = np.sqrt(n * p * (1 - p)) + 1
    assert np.all(np.abs(counts - n * p) < 5 * sd), (counts, n * p)


def test_stop_token_and_context_limit():
    lm = _tiny(max_positions=12)
    free = lm.generate(PROMPTS[0], 20, greedy=True, stop=())
    assert len(free) == 12 - len(PROMPTS[0])         # the context fills up, no more
    stop = free[2]
    cut = lm.generate(PROMPTS[0], 20, greedy=True, stop=stop)
    assert cut == free[:free.index(stop) + 1]
    assert lm.generate(list(range(1, 13)), 5, greedy=True) == []
    assert lm.generate(PROMPTS[0], 0) == []


@pytest.mark.parametrize("kw, msg", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"temperature": 0.0}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"seed": -2}, "seed"),
    ({"batch_size": 0}, "batch_size"),
    ({"stop": "x"}, "stop"),
])
def test_bad_arguments(kw, msg):
    lm = _tiny()
    args = {"max_new_tokens": 3, **kw}
    with pytest.raises(ValueError, match=msg):
        lm.generate([[1, 2]], **args)


def test_bad_prompts():
    lm = _tiny()
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        lm.generate([[1], []], 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.generate([[1, 9999]], 3)
    with pytest.raises(TypeError, match="token-id"):
        lm.generate("hello", 3)


@pytest.mark.slow   # the real SmolLM2: outside the fast tier
def test_smollm2_greedy_matches_full_forward(smollm2):
    prompts = smollm2.tokenize(["The capital of France is", "def fibonacci(n):",
                                "Once upon a time"])
    new, logits = smollm2.generate(prompts, 16, greedy=True, stop=(), return_logits=True)
    _check_against_full(smollm2, prompts, new, logits, rtol=1e-3, atol=2e-3)
    assert smollm2.decode(new[0][:2]) == " Paris."


# -- the demo report's continuations ----------------------------------------------------------------

def test_demo_report_shows_the_continuations(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from bakron.demo import llm as demo
    from bakron.models import load_llm
    from test_llm_loaders import write_gguf

    cfg = tiny_config(max_positions=512)
    write_gguf(tmp_path / "tiny.gguf", cfg, tiny_weights(cfg, seed=4))
    lm = load_llm(tmp_path / "tiny.gguf")
    kw = dict(device="cpu", bits=(2, 8), methods=("rtn", "ldlq"), n_calibration=6,
              n_heldout=4, lee=False, progress=False)
    res = demo.run(tmp_path / "a", model=lm, continuations=7, **kw)
    c = res["continuations"]
    assert c["prompts"] == list(demo.PROMPTS) and c["max_new_tokens"] == 7
    # the original's continuations are the argmax of the full forward pass, step by step
    for prompt, text in zip(demo.PROMPTS, c["original"]):
        seq = lm.tokenize([prompt])[0]
        for _ in range(7):
            t = int(np.argmax(np.asarray(lm.logits(seq))[-1]))
            seq.append(t)
            if t == cfg.eos_id:
                break
        assert text == lm.decode(seq[len(lm.tokenize([prompt])[0]):])
    md = (tmp_path / "a" / "llm_report.md").read_text()
    assert "## What rounding did to the text" in md
    assert md.count("| original | ") == 3
    for e in res["summary"]:
        assert len(e["continuations"]) == 3
        for text in e["continuations"]:
            assert demo._cell(text) in md
        assert f"| {e['bits']} bits, {e['method']} |" in md
    none = demo.run(tmp_path / "b", model=lm, continuations=0, **kw)
    assert none["continuations"] is None
    assert "What rounding did" not in (tmp_path / "b" / "llm_report.md").read_text()


def test_report_cells_escape_markdown():
    from bakron.demo import llm as demo

    assert demo._cell("a|b\nc`d") == "a\\|b⏎ c\\`d"
    assert demo._cell("") == "(nothing: the end-of-text token)"


def _naive_choice(logits, seeds, greedy, temperature):
    """The inverse CDF row by row with ``searchsorted`` (float64, numpy)."""
    if greedy:
        return np.argmax(logits, axis=-1).tolist()
    out = []
    for row, seed in zip(np.asarray(logits, np.float64), seeds):
        z = row / temperature
        cdf = np.cumsum(np.exp(z - z.max()))
        u = np.random.default_rng(seed).random() * cdf[-1]
        out.append(min(int(np.searchsorted(cdf, u, side="right")), len(row) - 1))
    return out


@pytest.mark.parametrize("greedy, temperature", [(False, 1.0), (False, 0.7), (True, 1.0)])
def test_choice_in_any_namespace_equals_the_row_by_row_inverse_cdf(greedy, temperature):
    """The next-token choice runs where the logits are (a GPU namespace copies back only the
    ids): on numpy and on array-api-strict (standing in for a device namespace) it draws the
    same uniforms and gives the same tokens as a row-by-row ``searchsorted``."""
    xps = pytest.importorskip("array_api_strict")
    from bakron.models.llm.generate import _choose

    rng = np.random.default_rng(0)
    logits = (3 * rng.standard_normal((64, 500))).astype(np.float32)
    seeds = [(5, i) for i in range(64)]
    want = _naive_choice(logits, seeds, greedy, temperature)
    for lg in (logits, xps.asarray(logits)):
        got = _choose(lg, [np.random.default_rng(k) for k in seeds], greedy, temperature)
        assert isinstance(got, np.ndarray) and got.shape == (64,)
        assert got.tolist() == want
    assert len(set(want)) > 10          # the draws really vary
