"""The built-in calibration mix (:mod:`bakron.models.llm.calibration`): generated sequences
(seeded, cached atomically, extended by longer requests, keyed on the model), the documents'
part, the mix's counts and the argument errors, on a tiny random Llama written as a GGUF
file (tokenizer included)."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from bakron.models import load_llm  # noqa: E402
from bakron.models.llm import CausalLM  # noqa: E402
from bakron.models.llm import calibration as cal  # noqa: E402
from bakron.models.textdata import reference_split  # noqa: E402
from bakron.quantize_model import calibration_sequences  # noqa: E402

from test_llm_loaders import tiny_config, tiny_weights, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    cfg = tiny_config(max_positions=64)
    write_gguf(d / "tiny.gguf", cfg, tiny_weights(cfg, seed=2))
    return load_llm(d / "tiny.gguf")


def _files(cache):
    return sorted((cache / "calibration").glob("generated-*.json"))


def test_generated_is_seeded_cached_and_extended(tiny, tmp_path, monkeypatch):
    c = tmp_path / "cache"
    a = cal.generated_sequences(tiny, 5, 12, seed=3, cache=c)
    assert len(a) == 5 and all(len(s) == 12 for s in a)
    start = tiny.config.bos_id
    assert all(s[0] == start for s in a)
    assert len(_files(c)) == 1
    # the same request without the cache gives the same tokens; another seed others
    assert cal.generated_sequences(tiny, 5, 12, seed=3, use_cache=False) == a
    assert cal.generated_sequences(tiny, 5, 12, seed=4, use_cache=False) != a
    # a shorter request is read back without generating
    import bakron.models.llm.generate as gen

    def boom(*a, **k):
        raise AssertionError("generated again")

    with monkeypatch.context() as m:
        m.setattr(gen, "_generate_many", boom)
        assert cal.generated_sequences(tiny, 3, 12, seed=3, cache=c) == a[:3]
    # a longer one generates only the rest, with the same streams as a fresh run
    longer = cal.generated_sequences(tiny, 8, 12, seed=3, cache=c)
    assert longer[:5] == a
    assert longer == cal.generated_sequences(tiny, 8, 12, seed=3, use_cache=False)
    assert len(_files(c)) == 1
    stored = json.loads(_files(c)[0].read_text())
    assert stored["sequences"] == longer and stored["settings"]["seed"] == 3
    # other settings, other files
    cal.generated_sequences(tiny, 2, 10, seed=3, cache=c)
    cal.generated_sequences(tiny, 2, 12, seed=3, temperature=0.7, cache=c)
    assert len(_files(c)) == 3


def test_a_corrupt_cache_file_is_regenerated(tiny, tmp_path, capsys):
    c = tmp_path / "cache"
    a = cal.generated_sequences(tiny, 3, 10, seed=1, cache=c)
    f = _files(c)[0]
    for bad in ("{not json", json.dumps({"settings": {}, "sequences": [[1, 2]]}),
                f.read_text().replace("[", "[99999, ", 2)):
        f.write_text(bad)
        assert cal.generated_sequences(tiny, 3, 10, seed=1, cache=c, progress=True) == a
        assert "generating again" in capsys.readouterr().err
        assert json.loads(f.read_text())["sequences"] == a


def test_the_key_follows_the_weights(tiny, tmp_path):
    cfg = tiny.config
    m1 = CausalLM(cfg, tiny_weights(cfg, seed=2))
    m2 = CausalLM(cfg, tiny_weights(cfg, seed=5))
    assert cal.model_fingerprint(m1) != cal.model_fingerprint(m2)
    assert cal.model_fingerprint(m1) == cal.model_fingerprint(CausalLM(cfg, tiny_weights(cfg, 2)))
    c = tmp_path / "cache"
    cal.generated_sequences(m1, 2, 8, cache=c)
    cal.generated_sequences(m2, 2, 8, cache=c)
    assert len(_files(c)) == 2


def test_the_mix(tiny, tmp_path):
    c = tmp_path / "cache"
    mixed = cal.calibration_ids(tiny, 200, seq_len=20, seed=0, cache=c)
    assert len(mixed) == 10
    gen = cal.generated_sequences(tiny, 5, 20, seed=0, cache=c)
    docs = calibration_sequences(tiny, reference_split(0)[0], 5, 20)
    assert mixed == gen + docs
    assert cal.calibration_ids(tiny, 200, "generated", seq_len=20, cache=c)[:5] == gen
    assert cal.calibration_ids(tiny, 200, "docs", seq_len=20, cache=c) == \
        calibration_sequences(tiny, reference_split(0)[0], 10, 20)
    third = cal.calibration_ids(tiny, 200, seq_len=20, generated_share=0.3, cache=c)
    assert third[:3] == gen[:3] and third[3:] == calibration_sequences(
        tiny, reference_split(0)[0], 7, 20)
    own = cal.calibration_ids(tiny, 40, "docs", seq_len=10, docs=["one two three four five."])
    assert own and all(len(s) <= 10 for s in own)
    # documents that run out: generated sequences make up the count asked for
    short = ["one two three."]
    few = calibration_sequences(tiny, short, 10, 10)
    filled = cal.calibration_ids(tiny, 100, seq_len=10, docs=short, cache=c)
    assert len(few) < 5 and len(filled) == 10
    assert filled[10 - len(few):] == few
    assert filled[:10 - len(few)] == cal.generated_sequences(tiny, 10 - len(few), 10, cache=c)


@pytest.mark.parametrize("kw, msg", [
    ({"mix": "news"}, "mix must be one of"),
    ({"n_tokens": 0}, "n_tokens"),
    ({"seq_len": 1}, "seq_len"),
    ({"generated_share": 1.5}, "generated_share"),
])
def test_bad_arguments(tiny, kw, msg):
    with pytest.raises(ValueError, match=msg):
        cal.calibration_ids(tiny, **{"n_tokens": 64, **kw}, use_cache=False)


def test_bad_generation_arguments(tiny):
    with pytest.raises(ValueError, match="context"):
        cal.generated_sequences(tiny, 1, 65, use_cache=False)
    with pytest.raises(ValueError, match="no room"):
        cal.generated_sequences(tiny, 1, 3, prompt=[1, 2, 3], use_cache=False)
    with pytest.raises(ValueError, match="temperature"):
        cal.generated_sequences(tiny, 1, 8, temperature=0, use_cache=False)
    with pytest.raises(TypeError, match="docs"):
        cal.calibration_ids(tiny, 64, "docs", docs="just a string", use_cache=False)


def test_quantize_model_takes_the_generated_mix(tiny, tmp_path, monkeypatch):
    """``quantize_model(calib="generated+docs")`` calibrates on exactly
    :func:`calibration_ids`'s sequences (the generated part cached in the run's cache
    folder); ``--calib generated`` goes through the CLI."""
    from bakron.cli import main
    from bakron.quantize_model import quantize_model

    c = tmp_path / "cache"
    seen = []
    real = cal.calibration_ids

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    monkeypatch.setattr(cal, "calibration_ids", spy)
    res = quantize_model(tiny.source, tmp_path / "q", fmt="float", factors="input", bits=4,
                         calib="generated+docs", calib_seqs=4, calib_len=16, cache=c,
                         seed=2, progress=False)
    assert res["calibration"]["sequences"] == 4 and res["calibration"]["tokens"] == 64
    assert "sampled from the model" in res["calibration"]["text"]
    assert seen == [real(tiny, 64, seq_len=16, seed=2, cache=c)]
    assert seen[0][:2] == cal.generated_sequences(tiny, 2, 16, seed=2, cache=c)
    assert len(_files(c)) == 1
    monkeypatch.setenv("BAKRON_CACHE", str(c))
    rc = main(["quantize-model", tiny.source, "--out", str(tmp_path / "g"), "--format", "float",
               "--factors", "input", "--calib", "generated", "--calib-seqs", "2",
               "--calib-len", "12", "--quiet"])
    assert rc == 0
    assert len(seen) == 2 and len(seen[1]) == 2 and len(_files(c)) == 2


# -- the demo's option ----------------------------------------------------------------------------

def test_demo_calibrates_on_the_mix(tmp_path):
    from bakron.demo import llm as demo
    from test_llm_demo import _tiny_lm

    lm = _tiny_lm()
    lm.config = type(lm.config)(**{**vars(lm.config), "bos_id": 1})   # a start token
    c = tmp_path / "cache"
    kw = dict(device="cpu", bits=(4,), methods=("ldlq",), n_calibration=6, n_heldout=4,
              lee=False, progress=False, cache=c, seed=5)
    docs = demo.run(tmp_path / "a", model=lm, calib="docs", **kw)
    mixed = demo.run(tmp_path / "b", model=lm, **kw)      # the default: the mix
    n_sent = docs["data"]["calibration_tokens"]
    gen = cal.generated_sequences(lm, -(-n_sent // 64), 64, seed=5, cache=c)
    assert mixed["data"]["calibration_texts"] == docs["data"]["calibration_texts"] + len(gen)
    assert mixed["data"]["calibration_tokens"] == n_sent + 64 * len(gen)
    assert mixed["data"]["calibration_mix"] == "generated+docs"
    assert "sampled from the model" in (tmp_path / "b" / "llm_report.md").read_text()
    assert mixed["summary"][0]["kl"] != docs["summary"][0]["kl"]
    # a model that cannot start sampling (no BOS, no EOS) calibrates on the sentences alone
    plain = demo.run(tmp_path / "e", model=_tiny_lm(), **kw)
    assert plain["data"]["calibration_mix"] == "docs"
    assert plain["data"]["calibration_texts"] == docs["data"]["calibration_texts"]
    only = demo.run(tmp_path / "c", model=lm, calib="generated", **kw)
    assert only["data"]["calibration_tokens"] == 64 * len(gen)
    with pytest.raises(ValueError, match="calib must be one of"):
        demo.run(tmp_path / "d", model=lm, calib="news", **kw)


def test_demo_cli_forwards_calib(monkeypatch, tmp_path):
    import sys
    import types

    from bakron import cli

    seen = {}
    fake = types.ModuleType("bakron.demo.llm")
    fake.run = lambda out_dir, **kw: seen.update(kw) or {"files": []}
    monkeypatch.setitem(sys.modules, "bakron.demo.llm", fake)
    assert cli.main(["demo", "--out", str(tmp_path / "d"), "--calib", "generated+docs",
                     "--quiet"]) == 0
    assert seen["calib"] == "generated+docs"
    assert cli.main(["demo", "--model", "mlp", "--out", str(tmp_path / "e"), "--calib",
                     "generated"]) == 2
