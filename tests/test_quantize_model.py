"""``bakron quantize-model`` on tiny random Llama models written by the tests (GGUF files and
Hugging Face folders), and the end-to-end check on SmolLM2 when it can be fetched."""
from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("tqdm")

from bakron.cli import main  # noqa: E402
from bakron.export import read_gptq  # noqa: E402
from bakron.io import InputError  # noqa: E402
from bakron.models import load_llm  # noqa: E402
from bakron.quantize_model import (_decode, _fit_grid, _grid_settings,  # noqa: E402
                                   perplexity_and_kl, quantize_model,
                                   reference_log_probs, work_folder)
from test_llm_loaders import (tiny_config, tiny_weights, write_gguf,  # noqa: E402
                              write_hf_folder)

FAST = {"calib_seqs": 4, "calib_len": 16, "progress": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny llama GGUF (F32 tensors) and the same weights as a BF16 Hugging Face folder."""
    d = tmp_path_factory.mktemp("models")
    cfg = tiny_config(tied=False)
    w = tiny_weights(cfg, seed=3)
    write_gguf(d / "tiny.gguf", cfg, w)
    tok = load_llm(d / "tiny.gguf").tokenizer
    write_hf_folder(d / "hf", cfg, w, dtype="BF16", tokenizer=tok)
    write_hf_folder(d / "hf32", cfg, w, dtype="F32", tokenizer=tok)
    return d


def _rtn(lm, name, grid):
    W = lm.linear_weight(name)
    v, _ = _fit_grid(W, grid).rtn(W)
    return np.asarray(v, dtype=np.float32)


@pytest.mark.parametrize("fmt,factors", [("gguf-q4_0", "global"), ("gguf-q4_1", "input"),
                                         ("gguf-q8_0", "input+global-out"),
                                         ("gguf-q4_0", "rtn")])
def test_gguf_formats_read_back_exactly(models, tmp_path, fmt, factors):
    out = tmp_path / "q.gguf"
    res = quantize_model(models / "tiny.gguf", out, fmt=fmt, factors=factors,
                         keep_weights=True, **FAST)
    assert out.is_file() and not work_folder(out).exists()
    orig = res["model_object"]
    back = load_llm(out)
    grid = _grid_settings(fmt, None, None, None)
    # the GGUF's own de-quantization (gguf's reader, llama.cpp order undone) gives W_hat
    # bit for bit, and every other tensor is the source's
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    differs = 0
    for name in orig.linear_names():
        assert types[name + ".weight"] == fmt.split("-")[1].upper()
        W_hat = res["weights"][name]
        np.testing.assert_array_equal(np.asarray(back.linear_weight(name)), W_hat)
        rtn = _rtn(orig, name, grid)
        if factors == "rtn":
            np.testing.assert_array_equal(W_hat, rtn)
        else:
            differs += int(np.any(W_hat != rtn))
    if factors != "rtn":   # the Hessian-aware rounding moves away from round-to-nearest
        assert differs >= len(orig.linear_names()) // 2
    for key in ("token_embd.weight", "output.weight", "blk.0.attn_norm.weight"):
        np.testing.assert_array_equal(np.asarray(back.weights[key]),
                                      np.asarray(orig.weights[key]))
    ids = orig.tokenize(["the theme of the text", "then the"])
    a = perplexity_and_kl(orig, orig.with_weights(res["weights"]), ids)
    b = perplexity_and_kl(orig, back, ids)
    assert a == b and a["kl"] > 0
    assert perplexity_and_kl(reference_log_probs(orig, ids), back, ids) == b
    same = perplexity_and_kl(orig, orig, ids)
    assert same["kl"] == 0 and same["tokens"] == b["tokens"]


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_folder_unpacks_to_w_hat(models, tmp_path, sym):
    out = tmp_path / "gptq"
    res = quantize_model(models / "hf", out, fmt="gptq", factors="global", bits=4,
                         group_size=32, sym=sym, keep_weights=True, **FAST)
    conf = json.loads((out / "config.json").read_text())["quantization_config"]
    assert conf["bits"] == 4 and conf["group_size"] == 32 and conf["sym"] is sym
    unpacked = read_gptq(out)
    from bakron.export import hf_linear_name

    for name, W_hat in res["weights"].items():
        np.testing.assert_array_equal(
            np.asarray(unpacked[hf_linear_name(name) + ".weight"], dtype=np.float32), W_hat)


def test_float_export_keeps_the_source_dtype(models, tmp_path):
    out = tmp_path / "float"
    res = quantize_model(models / "hf32", out, fmt="float", factors="input", bits=3,
                         group_size=16, keep_weights=True, incoherence=None, **FAST)
    back = load_llm(out)   # F32 source: W_hat stored exactly (without rotations: on the grid)
    for name, W_hat in res["weights"].items():
        np.testing.assert_array_equal(np.asarray(back.linear_weight(name)), W_hat)
        assert len(np.unique(W_hat[0, :16])) <= 8   # 3 bits: at most 8 levels per group
    out16 = tmp_path / "float16"
    quantize_model(models / "hf", out16, fmt="float", factors="rtn", **FAST)
    header = (out16 / "model.safetensors").read_bytes()
    n = int.from_bytes(header[:8], "little")
    meta = json.loads(header[8:8 + n])
    assert meta["model.layers.0.mlp.up_proj.weight"]["dtype"] == "BF16"


@pytest.mark.gpu
def test_device_gpu_writes_the_same_kind_of_export(models, tmp_path):
    """``device="gpu"``: factors and solves on cupy; the file reads back exactly as W_hat, and
    its rounding is the CPU run's up to float32 near-ties (different GEMM orders)."""
    from conftest import HAS_GPU

    if not HAS_GPU:
        pytest.skip("needs a CUDA device with cupy")
    kw = dict(fmt="gguf-q4_0", factors="global", keep_weights=True, **FAST)
    gpu = quantize_model(models / "tiny.gguf", tmp_path / "gpu.gguf", device="gpu", **kw)
    cpu = quantize_model(models / "tiny.gguf", tmp_path / "cpu.gguf", device="cpu", **kw)
    back = load_llm(tmp_path / "gpu.gguf")
    same = total = 0
    for name, W_hat in gpu["weights"].items():
        assert isinstance(W_hat, np.ndarray)
        np.testing.assert_array_equal(np.asarray(back.linear_weight(name)), W_hat)
        same += int((W_hat == cpu["weights"][name]).sum())
        total += W_hat.size
    assert same >= 0.99 * total, (same, total)
    orig = cpu["model_object"]
    ids = orig.tokenize(["the theme of the text", "then the"])
    kl_gpu = perplexity_and_kl(orig, back, ids)["kl"]
    kl_cpu = perplexity_and_kl(orig, load_llm(tmp_path / "cpu.gguf"), ids)["kl"]
    assert kl_gpu > 0 and abs(kl_gpu - kl_cpu) <= 0.2 * kl_cpu, (kl_gpu, kl_cpu)


def test_resume_after_a_kill(models, tmp_path):
    full = tmp_path / "full.gguf"
    quantize_model(models / "tiny.gguf", full, fmt="gguf-q4_0", factors="global", **FAST)
    out = tmp_path / "resumed.gguf"
    seen = []

    def killed(name):
        seen.append(name)
        if len(seen) == 5:
            raise KeyboardInterrupt   # the process dies after its fifth layer

    with pytest.raises(KeyboardInterrupt):
        quantize_model(models / "tiny.gguf", out, fmt="gguf-q4_0", factors="global",
                       _after_layer=killed, **FAST)
    assert not out.exists()
    files = sorted(p.stem for p in (work_folder(out) / "layers").glob("*.safetensors"))
    assert files == sorted(seen)
    bad = work_folder(out) / "layers" / f"{seen[1]}.safetensors"   # a layer file torn apart
    bad.write_bytes(bad.read_bytes()[:-7])
    again = []
    res = quantize_model(models / "tiny.gguf", out, fmt="gguf-q4_0", factors="global",
                         _after_layer=again.append, **FAST)
    assert res["resumed"] == 4 and set(again) & set(seen) == {seen[1]}
    assert len(again) == 14 - 4
    assert out.read_bytes() == full.read_bytes()
    assert not work_folder(out).exists()


def test_other_settings_do_not_resume_a_work_folder(models, tmp_path):
    out = tmp_path / "q.gguf"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(models / "tiny.gguf", out, fmt="gguf-q4_0", factors="input",
                       _after_layer=lambda n: (_ for _ in ()).throw(KeyboardInterrupt), **FAST)
    rc = main(["quantize-model", str(models / "tiny.gguf"), "--out", str(out), "--factors",
               "global", "--calib-seqs", "4", "--calib-len", "16", "--quiet"])
    assert rc == 2 and not out.exists()


def test_another_accumulation_dtype_does_not_resume(models, tmp_path, monkeypatch):
    """A work folder of layers solved from factors summed in another dtype belongs to
    another run: it is refused, not resumed."""
    import bakron.quantize_model as qm

    out = tmp_path / "q.gguf"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(models / "tiny.gguf", out, fmt="gguf-q4_0", factors="input",
                       _after_layer=lambda n: (_ for _ in ()).throw(KeyboardInterrupt), **FAST)
    assert len(list((work_folder(out) / "layers").glob("*.safetensors"))) == 1
    monkeypatch.setattr(qm, "_ACCUM_DTYPE", "float64")
    with pytest.raises(InputError, match="belongs to another run"):
        quantize_model(models / "tiny.gguf", out, fmt="gguf-q4_0", factors="input", **FAST)
    assert not out.exists()
    monkeypatch.undo()   # the same dtype again: the finished layer is resumed
    res = quantize_model(models / "tiny.gguf", out, fmt="gguf-q4_0", factors="input", **FAST)
    assert res["resumed"] == 1 and out.is_file()


def test_a_work_folder_in_use_is_refused(models, tmp_path, capsys):
    from bakron.distributed._outputs import OutputLock

    out = tmp_path / "q.gguf"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(models / "tiny.gguf", out, fmt="gguf-q4_0", factors="rtn",
                       _after_layer=lambda n: (_ for _ in ()).throw(KeyboardInterrupt), **FAST)
    with OutputLock(str(work_folder(out))):   # another run is working on it
        rc = main(["quantize-model", str(models / "tiny.gguf"), "--out", str(out), "--factors",
                   "rtn", "--quiet"])
    assert rc == 3 and "in use" in capsys.readouterr().err and not out.exists()
    assert main(["quantize-model", str(models / "tiny.gguf"), "--out", str(out), "--factors",
                 "rtn", "--quiet"]) == 0


def test_output_factor_regularisation(models, tmp_path):
    """--damp-out auto (the default), a numeric --damp-out with --shrink-out, and
    --shrink-out 1 (H_out reduced to its diagonal) giving the one-sided codes (with tiles
    of 1 x 1: a tile's own rounding weighs its outputs by the diagonal of H_out)."""
    # (two batches: the cross-fitted H_out of the rotated float default has two halves)
    kw = dict(fmt="float", sym=False, group_size=16, keep_weights=True, tile=(1, 1),
              batch_size=2, **FAST)
    auto = quantize_model(models / "hf32", tmp_path / "a", factors="input+global-out", **kw)
    plain = quantize_model(models / "hf32", tmp_path / "p", factors="input+global-out",
                           damp_out=0.01, **kw)
    diag = quantize_model(models / "hf32", tmp_path / "d", factors="input+global-out",
                          damp_out=0.01, shrink_out=1.0, **kw)
    one = quantize_model(models / "hf32", tmp_path / "o", factors="input", **kw)
    # what auto stands for: a cross-fitted H_out damped by 0.1 for the rotated layers of the
    # float default, the mean damped by 3 when asked for, 1 without rotations
    rule = quantize_model(models / "hf32", tmp_path / "r", factors="input+global-out",
                          damp_out=0.1, shrink_out=0.0, out_estimator="crossfit", **kw)
    mean = quantize_model(models / "hf32", tmp_path / "m", factors="input+global-out",
                          out_estimator="mean", **kw)
    rule_mean = quantize_model(models / "hf32", tmp_path / "rm", factors="input+global-out",
                               damp_out=3.0, shrink_out=0.0, out_estimator="mean", **kw)
    auto0 = quantize_model(models / "hf32", tmp_path / "a0", factors="input+global-out",
                           incoherence=None, **kw)
    rule0 = quantize_model(models / "hf32", tmp_path / "r0", factors="input+global-out",
                           damp_out=1.0, shrink_out=0.0, incoherence=None, **kw)
    for name, W in one["weights"].items():
        assert np.array_equal(diag["weights"][name], W), name
        assert np.array_equal(rule["weights"][name], auto["weights"][name]), name
        assert np.array_equal(rule_mean["weights"][name], mean["weights"][name]), name
        assert np.array_equal(rule0["weights"][name], auto0["weights"][name]), name
    for other in (plain, mean):
        assert any(not np.array_equal(other["weights"][n], auto["weights"][n])
                   for n in one["weights"])
    rc = main(["quantize-model", str(models / "hf32"), "--out", str(tmp_path / "x"),
               "--format", "float", "--shrink-out", "0.5", "--quiet"])
    assert rc == 2 and not (tmp_path / "x").exists()   # shrink-out needs a numeric damp-out
    rc = main(["quantize-model", str(models / "hf32"), "--out", str(tmp_path / "y"),
               "--format", "float", "--damp-out", "-1", "--quiet"])
    assert rc == 2
    rc = main(["quantize-model", str(models / "hf32"), "--out", str(tmp_path / "z"),
               "--format", "float", "--out-estimator", "median", "--quiet"])
    assert rc == 2 and not (tmp_path / "z").exists()
    with pytest.raises(InputError, match="out_estimator"):
        quantize_model(models / "hf32", tmp_path / "w", factors="global",
                       out_estimator="median", **kw)


def test_k_fold_crossfit(models, tmp_path):
    """--out-estimator crossfit:K: crossfit:2 is crossfit itself (the same run, the same
    codes); three folds of the batches give another H_out and other codes; K < 2 is
    refused (exit 2, nothing written)."""
    kw = dict(fmt="float", sym=False, group_size=16, keep_weights=True, batch_size=1,
              factors="input+global-out", **FAST)
    two = quantize_model(models / "hf32", tmp_path / "2", out_estimator="crossfit", **kw)
    also = quantize_model(models / "hf32", tmp_path / "2b", out_estimator="crossfit:2", **kw)
    three = quantize_model(models / "hf32", tmp_path / "3", out_estimator="crossfit:3", **kw)
    for name, W in two["weights"].items():
        assert np.array_equal(also["weights"][name], W), name
    assert any(not np.array_equal(three["weights"][n], two["weights"][n])
               for n in two["weights"])
    assert main(["quantize-model", str(models / "hf32"), "--out", str(tmp_path / "c3"),
                 "--format", "float", "--factors", "input+global-out", "--out-estimator",
                 "crossfit:3", "--calib-seqs", "4", "--calib-len", "16", "--quiet"]) == 0
    rc = main(["quantize-model", str(models / "hf32"), "--out", str(tmp_path / "c1"),
               "--format", "float", "--out-estimator", "crossfit:1", "--quiet"])
    assert rc == 2 and not (tmp_path / "c1").exists()
    with pytest.raises(InputError, match="crossfit:K"):
        quantize_model(models / "hf32", tmp_path / "w", out_estimator="crossfit:0",
                       **{k: v for k, v in kw.items()})


def test_in_estimator(models, tmp_path):
    """in_estimator="crossfit": the cross-fitted H_in for one-sided and two-sided rounding
    alike (other codes than the mean's); "crossfit:2" is it; a bad value is refused with
    the argument's name, before anything is written."""
    kw = dict(fmt="float", sym=False, group_size=16, keep_weights=True, batch_size=1, **FAST)
    for factors in ("input", "input+global-out"):
        mean = quantize_model(models / "hf32", tmp_path / f"m{factors}", factors=factors, **kw)
        cf = quantize_model(models / "hf32", tmp_path / f"c{factors}", factors=factors,
                            in_estimator="crossfit", **kw)
        cf2 = quantize_model(models / "hf32", tmp_path / f"k{factors}", factors=factors,
                             in_estimator="crossfit:2", **kw)
        for name, W in cf["weights"].items():
            assert np.array_equal(cf2["weights"][name], W), name
        assert any(not np.array_equal(cf["weights"][n], mean["weights"][n])
                   for n in mean["weights"])
    with pytest.raises(InputError, match="in_estimator must be one of"):
        quantize_model(models / "hf32", tmp_path / "bad", in_estimator="auto", **kw)
    assert not (tmp_path / "bad").exists()
    rc = main(["quantize-model", str(models / "hf32"), "--out", str(tmp_path / "cli"),
               "--format", "float", "--in-estimator", "crossfit:1", "--quiet"])
    assert rc == 2 and not (tmp_path / "cli").exists()
    assert main(["quantize-model", str(models / "hf32"), "--out", str(tmp_path / "ok"),
                 "--format", "float", "--factors", "input", "--in-estimator", "crossfit",
                 "--calib-seqs", "4", "--calib-len", "16", "--quiet"]) == 0


@pytest.mark.parametrize("in_estimator", ["mean", "crossfit"])
def test_one_sided_rounding_takes_the_forward_pass(models, tmp_path, monkeypatch,
                                                   in_estimator):
    """``factors="input"`` collects H_in by forward passes alone (no head, no backward pass)
    and writes bitwise the weights the K-FAC pass's H_in gives; the budgeted global pass
    takes over when the forward pass does not fit ``memory_budget``, and a budget neither
    fits is refused by name."""
    import bakron.hessian
    import bakron.quantize_model as qm

    kw = dict(fmt="float", sym=False, group_size=16, keep_weights=True, batch_size=1,
              factors="input", in_estimator=in_estimator, **FAST)
    calls = []
    real = bakron.hessian.input_factors
    monkeypatch.setattr(bakron.hessian, "input_factors",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    fwd = quantize_model(models / "hf32", tmp_path / "f", **kw)
    assert calls == [1]
    monkeypatch.setattr(qm, "_forward_fits", lambda *a: False)
    glob = quantize_model(models / "hf32", tmp_path / "g", **kw)
    assert calls == [1]
    assert fwd["weights"].keys() == glob["weights"].keys()
    for name, W in fwd["weights"].items():
        assert np.array_equal(glob["weights"][name], W), name
    monkeypatch.undo()
    with pytest.raises(InputError, match=r"memory_budget \(--memory-budget\) 1 bytes"):
        quantize_model(models / "hf32", tmp_path / "b", memory_budget=1, **kw)


def test_calibration_sequences(models):
    from bakron.quantize_model import _builtin_split, calibration_sequences

    lm = load_llm(models / "tiny.gguf")
    docs = ["the theme then", "he the", "t"]
    stream = []
    for ids in lm.tokenize(docs):
        stream += ids + [lm.config.eos_id]
    seqs = calibration_sequences(lm, docs, 3, 4)
    assert seqs == [stream[0:4], stream[4:8], stream[8:12]]
    everything = calibration_sequences(lm, docs, 100, 5)   # the text runs out
    want = [stream[i:i + 5] for i in range(0, len(stream), 5)]
    assert everything == [c for c in want if len(c) >= 2] and len(stream) < 500
    # the built-in calibration text never holds a sentence of the held-out topics
    from bakron.models.textdata import calibration_and_heldout

    cal, held = _builtin_split()
    _, some_held = calibration_and_heldout(0, 30, seed=0)
    assert set(some_held) <= set(held) and not set(some_held) & set(cal)


def test_decode_matches_the_grid_values():
    rng = np.random.default_rng(0)
    W = rng.standard_normal((8, 64)).astype(np.float32)
    for fmt, bits, gs, sym in (("gguf-q4_0", None, None, None), ("gguf-q4_1", None, None, None),
                               ("gguf-q8_0", None, None, None), ("gptq", 2, 32, False),
                               ("gptq", 8, 64, True), ("float", 3, 16, False),
                               ("float", 5, 32, True)):
        q = _fit_grid(W, _grid_settings(fmt, bits, gs, sym))
        v, c = q.rtn(W)
        np.testing.assert_array_equal(_decode(q, np.asarray(c)), np.asarray(v))


def _cli(models, tmp_path, *args, model="tiny.gguf", out="o.gguf"):
    target = tmp_path / out
    rc = main(["quantize-model", str(models / model) if model else "", "--out", str(target),
               "--calib-seqs", "4", "--calib-len", "16", "--quiet", *args])
    return rc, target


def test_cli_writes_the_export(models, tmp_path, capsys):
    rc, out = _cli(models, tmp_path, "--format", "gguf-q8_0", "--factors", "input",
                   "--memory-budget", "64M")
    assert rc == 0 and out.is_file()
    assert load_llm(out).config.num_layers == 2


def test_cli_interrupt_keeps_the_finished_layers(models, tmp_path, capsys, monkeypatch):
    import bakron.pipeline as pipeline

    real = pipeline.publish
    count = []

    def dies(*a, **k):
        real(*a, **k)
        count.append(1)
        if len(count) == 3:
            raise KeyboardInterrupt   # Ctrl-C after the third layer

    monkeypatch.setattr(pipeline, "publish", dies)
    rc, out = _cli(models, tmp_path, "--factors", "input")
    err = capsys.readouterr().err
    assert rc == 130 and "kept in" in err and not out.exists()
    assert len(list((work_folder(out) / "layers").glob("*.safetensors"))) == 3
    monkeypatch.setattr(pipeline, "publish", real)
    rc = main(["quantize-model", str(models / "tiny.gguf"), "--out", str(out), "--factors",
               "input", "--calib-seqs", "4", "--calib-len", "16"])
    assert rc == 0 and "(3 resumed)" in capsys.readouterr().out and out.is_file()


@pytest.mark.parametrize("args,code,match", [
    (("--format", "gguf-q4_0", "--bits", "3"), 2, "cannot represent a 3-bit grid"),
    (("--format", "gguf-q4_1", "--group-size", "64"), 2, "groups of 64"),
    (("--format", "gguf-q8_0", "--asym"), 2, "--sym/--asym"),
    (("--format", "gptq", "--bits", "3"), 2, "cannot represent a 3-bit grid"),
    (("--format", "gptq",), 2, "not a multiple of 128"),   # a GGUF source converts; 32 inputs
    (("--calib", "/nonexistent/calib.txt",), 2, "no such file"),
    (("--memory-budget", "lots"), 2, "number of bytes"),
    (("--labels", "fisher:0"), 2, "K must be a positive integer"),
    (("--labels", "gold"), 2, "labels must be None, 'true', 'sample'"),
])
def test_cli_errors_on_a_gguf_source(models, tmp_path, capsys, args, code, match):
    rc, out = _cli(models, tmp_path, *args)
    assert rc == code and match in capsys.readouterr().err
    assert not out.exists() and not work_folder(out).exists()


def test_cli_errors(models, tmp_path, capsys):
    def check(rc, code, match, out):
        err = capsys.readouterr().err
        assert rc == code and match in err, err
        assert not work_folder(out).exists()

    # a format that cannot hold the model's shapes: groups of 48 do not divide 32 inputs
    rc, out = _cli(models, tmp_path, "--format", "gptq", "--group-size", "48", model="hf")
    check(rc, 2, "not a multiple of 48", out)
    assert not out.exists()
    # an HF source for a GGUF format is converted, but not without its tokenizer
    cfg = tiny_config()
    write_hf_folder(tmp_path / "notok", cfg, tiny_weights(cfg))
    rc, out = _cli(tmp_path, tmp_path, "--format", "gguf-q4_0", model="notok")
    check(rc, 2, "no tokenizer.json", out)
    # OUT exists: never replaced
    (tmp_path / "there.gguf").write_bytes(b"keep")
    rc, out = _cli(models, tmp_path, out="there.gguf")
    check(rc, 3, "already exists", out)
    assert out.read_bytes() == b"keep"
    # a missing model and a sharded folder with a missing shard: exit 4
    rc, out = _cli(models, tmp_path, model="nothing.gguf")
    check(rc, 4, "not found", out)
    cfg = tiny_config()
    w = tiny_weights(cfg)
    write_hf_folder(tmp_path / "shard", cfg, w, shards=2)
    (tmp_path / "shard" / "model-00002-of-00002.safetensors").unlink()
    rc, out = main(["quantize-model", str(tmp_path / "shard"), "--out",
                    str(tmp_path / "s-out"), "--format", "float", "--quiet"]), tmp_path / "s-out"
    check(rc, 4, "missing", out)
    assert not out.exists()
    # an unsupported architecture and a tensor type the reader cannot de-quantize: exit 2
    write_gguf(tmp_path / "gpt2.gguf", cfg, w, arch="gpt2")
    rc, out = _cli(tmp_path, tmp_path, model="gpt2.gguf")
    check(rc, 2, "architecture 'gpt2'", out)
    q81 = gguf.GGMLQuantizationType.Q8_1
    raw = np.zeros((4, gguf.GGML_QUANT_SIZES[q81][1]), dtype=np.uint8)
    write_gguf(tmp_path / "q81.gguf", cfg, w, extra_tensors={"extra.weight": (raw, q81)})
    rc, out = _cli(tmp_path, tmp_path, model="q81.gguf")
    check(rc, 2, "Q8_1", out)
    # an empty calibration file
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    rc, out = _cli(models, tmp_path, "--calib", str(tmp_path / "empty.txt"))
    check(rc, 2, "no text", out)
    assert not out.exists()


def test_cli_evaluate_on_text_files(models, tmp_path, capsys):
    """``bakron evaluate --text``: each file tokenized whole and cut into windows; the KL is
    0 against the original itself and equals ``perplexity_and_kl``'s (an independent
    per-token mean) for a quantized model; bad files and options exit 2 naming them."""
    prose = " ".join(f"Sentence {i} of the held-out text says something else." for i in range(40))
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "held.txt").write_text(prose, encoding="utf-8")
    ref_path = str(models / "hf32")
    q = tmp_path / "q"
    quantize_model(models / "hf32", q, fmt="float", factors="rtn", bits=3, **FAST)
    report = tmp_path / "eval.json"
    rc = main(["evaluate", ref_path, str(q), "--reference", ref_path, "--window", "16",
               "--text", str(tmp_path / "a" / "held.txt"), "--text",
               str(tmp_path / "b" / "held.txt"), "--json", str(report)])
    out, err = capsys.readouterr()
    assert rc == 0, out
    assert "2 model(s) and the original on" in err and f"{q} (2/2):" in err   # progress
    res = json.loads(report.read_text())
    assert set(res["sources"]) == {"held", "held-2"}    # two files of one stem
    ref = load_llm(ref_path)
    ids = ref.tokenize([prose])[0]
    windows = [ids[i:i + 16] for i in range(0, len(ids), 16)]
    windows = [w for w in windows if len(w) >= 2]
    assert f"{len(windows)} windows" in res["sources"]["held"]
    same, quant = res["models"][ref_path], res["models"][str(q)]
    assert same["held"]["kl"] == 0.0 and same["held"]["top1_agreement"] == 1.0
    want = perplexity_and_kl(ref, load_llm(q), windows)
    np.testing.assert_allclose(quant["held"]["perplexity"], want["perplexity"], rtol=1e-5)
    # evaluate's KL is the mean over every position, the last of each window included
    kl = n = 0
    for (rows, ids_r, lr), (_, _, lq) in zip(reference_log_probs(ref, windows),
                                             reference_log_probs(load_llm(q), windows)):
        for r in range(len(rows)):
            T = int((ids_r[r] >= 0).sum())
            kl += float((np.exp(lr[r, :T]) * (lr[r, :T] - lq[r, :T])).sum())
            n += T
    np.testing.assert_allclose(quant["held"]["kl"], kl / n, rtol=1e-5)
    assert quant["held-2"]["kl"] == quant["held"]["kl"] > 0
    assert "held-2" in out and "windows" in out

    def fails(*args, match):
        rc = main(["evaluate", str(q), "--reference", ref_path, *args])
        err = capsys.readouterr().err
        assert rc == 2 and match in err, err

    fails("--text", str(tmp_path / "none.txt"), match="--text " + str(tmp_path / "none.txt"))
    (tmp_path / "short.txt").write_text("Two words.", encoding="utf-8")
    fails("--text", str(tmp_path / "short.txt"), match="fewer than two windows")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    fails("--text", str(tmp_path / "latin1.txt"), match="not UTF-8")
    fails("--window", "8", match="--window only applies with --text")
    cfg = tiny_config(tied=False, vocab=300)     # another vocabulary: not comparable
    write_hf_folder(tmp_path / "other", cfg, tiny_weights(cfg, seed=3))
    rc = main(["evaluate", str(tmp_path / "other"), "--reference", ref_path,
               "--text", str(tmp_path / "a" / "held.txt")])
    err = capsys.readouterr().err
    assert rc == 2 and "not a quantized version of the reference" in err, err
    fails("--text", str(tmp_path / "a" / "held.txt"), "--window", "100000",
          match="longer than the model's context")


# -- SmolLM2 (the built-in model; skipped when it cannot be fetched) ---------------------------


@pytest.mark.slow
def test_smollm2_q4_0_file_equals_the_in_memory_model(smollm2, tmp_path):
    out = tmp_path / "smollm2-q4_0.gguf"
    res = quantize_model("smollm2", out, fmt="gguf-q4_0", factors="input", calib_seqs=4,
                         calib_len=32, keep_weights=True, progress=False)
    from bakron.models.textdata import calibration_and_heldout

    _, held = calibration_and_heldout(0, 6, seed=1)
    ids = [s[:48] for s in smollm2.tokenize(held)]
    a = perplexity_and_kl(smollm2, smollm2.with_weights(res["weights"]), ids)
    b = perplexity_and_kl(smollm2, load_llm(out), ids)
    assert a == b
    assert 0 < a["kl"] < 1.0
    assert os.path.getsize(out) < os.path.getsize(pathlib.Path(res["source"])) * 1.2


def test_label_estimator_changes_only_the_global_out_factor(models, tmp_path):
    """``labels`` reaches the Hessian pass of the global factors (other rounding), leaves the
    one-sided rounding alone, and a bad spelling is an InputError before any work."""
    kw = dict(fmt="float", bits=4, group_size=32, keep_weights=True, **FAST)
    base = quantize_model(models / "tiny.gguf", tmp_path / "a", factors="global", **kw)
    fis = quantize_model(models / "tiny.gguf", tmp_path / "b", factors="global",
                         labels="fisher:4", **kw)
    assert any(not np.array_equal(base["weights"][n], fis["weights"][n])
               for n in base["weights"])
    one = quantize_model(models / "tiny.gguf", tmp_path / "c", factors="input", **kw)
    one_f = quantize_model(models / "tiny.gguf", tmp_path / "d", factors="input",
                           labels="fisher:4", **kw)
    for n in one["weights"]:
        np.testing.assert_array_equal(one["weights"][n], one_f["weights"][n])
    with pytest.raises(InputError, match="fisher:x"):
        quantize_model(models / "tiny.gguf", tmp_path / "e", factors="global",
                       labels="fisher:x", **kw)
    assert not (tmp_path / "e").exists()


def test_blas_threads_limit_the_solves(models, tmp_path):
    """``blas_threads`` limits BLAS while the layers are collected and solved (read inside
    the run through threadpoolctl), the limit is lifted afterwards, and a count below 1 is an
    InputError naming it (nothing written)."""
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads():
        return {i["num_threads"] for i in threadpoolctl.threadpool_info()
                if i["user_api"] == "blas"}

    seen = []
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        if before != {2}:
            pytest.skip(f"BLAS does not run two threads here ({before})")
        quantize_model(models / "tiny.gguf", tmp_path / "a", factors="global", fmt="float",
                       bits=4, group_size=32, blas_threads=1,
                       _after_layer=lambda name: seen.append(blas_threads()), **FAST)
        assert seen and all(s == {1} for s in seen)
        assert blas_threads() == before
    with pytest.raises(InputError, match="blas_threads"):
        quantize_model(models / "tiny.gguf", tmp_path / "b", blas_threads=0, **FAST)
    assert not (tmp_path / "b").exists()


def test_refinement_steps_of_the_global_factors(models, tmp_path):
    """``refine_iters=0`` rounds with the K-FAC factors, whose ``H_in`` is the local one: with
    ``H_out`` reduced to its diagonal and tiles of 1 x 1, ``global`` then gives the one-sided
    codes; one refinement step changes the codes; the one-sided rounding ignores the
    setting; a negative count is an InputError naming it, and ``--refine -1`` exits 2."""
    kw = dict(fmt="float", bits=4, group_size=32, sym=False, keep_weights=True, tile=(1, 1),
              **FAST)
    diag = dict(damp_out=0.01, shrink_out=1.0)
    kfac = quantize_model(models / "tiny.gguf", tmp_path / "a", factors="global",
                          refine_iters=0, **diag, **kw)
    refined = quantize_model(models / "tiny.gguf", tmp_path / "b", factors="global",
                             refine_iters=1, **diag, **kw)
    one = quantize_model(models / "tiny.gguf", tmp_path / "c", factors="input", **kw)
    one_r = quantize_model(models / "tiny.gguf", tmp_path / "d", factors="input",
                           refine_iters=2, **kw)
    for n in one["weights"]:
        np.testing.assert_array_equal(kfac["weights"][n], one["weights"][n])
        np.testing.assert_array_equal(one_r["weights"][n], one["weights"][n])
    assert any(not np.array_equal(refined["weights"][n], one["weights"][n])
               for n in one["weights"])
    with pytest.raises(InputError, match="refine_iters"):
        quantize_model(models / "tiny.gguf", tmp_path / "f", factors="global",
                       refine_iters=-1, **kw)
    assert not (tmp_path / "f").exists()
    rc = main(["quantize-model", str(models / "tiny.gguf"), "--out", str(tmp_path / "g"),
               "--format", "float", "--factors", "global", "--refine", "-1", "--quiet"])
    assert rc == 2 and not (tmp_path / "g").exists()


def test_generated_calibration_needs_a_start_token(models, tmp_path, monkeypatch):
    """The default calibration samples text from BOS (or EOS): a model with neither is refused
    with an error that names the way out, before the work folder exists."""
    import bakron.models as bm

    real = bm.load_llm

    def without_start(*a, **k):
        lm = real(*a, **k)
        lm.config = type(lm.config)(**{**vars(lm.config), "bos_id": None, "eos_id": None})
        return lm

    monkeypatch.setattr(bm, "load_llm", without_start)
    out = tmp_path / "x"
    with pytest.raises(InputError, match="BOS.*--calib builtin"):
        quantize_model(models / "tiny.gguf", out, fmt="float", factors="input", **FAST)
    assert not out.exists() and not work_folder(out).exists()
    res = quantize_model(models / "tiny.gguf", out, fmt="float", factors="input",
                         calib="builtin", **FAST)
    assert res["calibration"]["sequences"] == 4 and out.is_dir()
