"""``bakron quantize-model``'s run and work folder under hostile or careless use: resume keys on
the full weights and the resolved source, every check made before ``OUT.work`` exists, what
is left on disk after a later error (docs/reliability.md, "Resume and the work folder")."""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("tqdm")

import bakron.quantize_model as qm  # noqa: E402
from bakron.cli import main  # noqa: E402
from bakron.io import InputError  # noqa: E402
from bakron.models import load_llm  # noqa: E402
from bakron.quantize_model import quantize_model, work_folder  # noqa: E402
from test_llm_loaders import (tiny_config, tiny_weights, write_gguf,  # noqa: E402
                              write_hf_folder)

FAST = {"calib_seqs": 4, "calib_len": 16, "progress": False}
ARGS = ["--calib-seqs", "4", "--calib-len", "16", "--quiet"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    cfg = tiny_config(tied=False)
    w = tiny_weights(cfg, seed=5)
    write_gguf(d / "tiny.gguf", cfg, w)
    return {"dir": d, "cfg": cfg, "w": w, "tok": load_llm(d / "tiny.gguf").tokenizer}


def _hf(tiny, folder, edit=None, **kw):
    """The tiny model as an F32 Hugging Face folder, its weights changed by ``edit(w)``."""
    w = {k: v.copy() for k, v in tiny["w"].items()}
    if edit is not None:
        edit(w)
    write_hf_folder(folder, kw.pop("cfg", tiny["cfg"]), w, tokenizer=tiny["tok"], **kw)
    return folder


def _stop_after(k, seen):
    def hook(name):
        seen.append(name)
        if len(seen) == k:
            raise KeyboardInterrupt   # the process dies after its k-th layer
    return hook


def _layers_in(out):
    return sorted(p.stem for p in (work_folder(out) / "layers").glob("*.safetensors"))


def _cli(model, out, *args):
    return main(["quantize-model", str(model), "--out", str(out), *ARGS, *args])


def _no_work(out):
    assert not os.path.exists(out)
    assert not work_folder(out).exists()


# -- 2. resume never mixes sources ---------------------------------------------------------------

def _set_q11(w):
    w["blk.0.attn_q.weight"][1, 1] = 5.0


@pytest.mark.parametrize("factors", ["rtn", "input"])
def test_a_changed_finished_layer_is_recomputed(tiny, tmp_path, factors):
    kw = dict(fmt="gptq", group_size=32, factors=factors, **FAST)
    src = _hf(tiny, tmp_path / "model")
    out = tmp_path / "q"
    seen = []
    with pytest.raises(KeyboardInterrupt):
        quantize_model(src, out, _after_layer=_stop_after(6, seen), **kw)
    assert "blk.0.attn_q" in seen and len(_layers_in(out)) == 6
    _hf(tiny, src, _set_q11)   # one weight of a finished layer changes in the source
    again = []
    res = quantize_model(src, out, _after_layer=again.append, **kw)
    fresh = quantize_model(_hf(tiny, tmp_path / "fresh-src", _set_q11), tmp_path / "fresh", **kw)
    assert (out / "model.safetensors").read_bytes() == \
        (tmp_path / "fresh" / "model.safetensors").read_bytes()
    assert "blk.0.attn_q" in again
    if factors == "rtn":   # a layer depends on its own weight only: the others resume
        assert res["resumed"] == 5 and len(again) == 14 - 5
    else:   # the factors come from the whole model: every layer is made again
        assert res["resumed"] == 0 and len(again) == 14
    assert fresh["resumed"] == 0 and not work_folder(out).exists()


def test_a_changed_source_converts_again(tiny, tmp_path):
    """An HF source for a GGUF format is converted into OUT.work; when the folder changes
    (here a norm, which no layer key holds for rtn), the copy is made again."""
    kw = dict(fmt="gguf-q8_0", factors="rtn", **FAST)
    src = _hf(tiny, tmp_path / "model")
    out = tmp_path / "q.gguf"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(src, out, _after_layer=_stop_after(3, []), **kw)
    assert (work_folder(out) / "source.gguf").is_file()

    def norm(w):
        w["output_norm.weight"][0] = 7.0
    _hf(tiny, src, norm)
    res = quantize_model(src, out, **kw)
    # (the folder's name goes into the GGUF's metadata: the fresh copy has the same name)
    quantize_model(_hf(tiny, tmp_path / "fresh" / "model", norm), tmp_path / "fresh.gguf", **kw)
    assert res["resumed"] == 3
    assert out.read_bytes() == (tmp_path / "fresh.gguf").read_bytes()


def test_the_key_holds_every_byte_of_the_weights(tiny):
    lm = load_llm(tiny["dir"] / "tiny.gguf")
    whole, per = qm._fingerprint(lm)
    W = np.array(lm.weights["blk.1.ffn_down.weight"])
    W[-1, -1] = np.nextafter(W[-1, -1], np.float32(np.inf))   # one ulp, off any sampling grid
    whole2, per2 = qm._fingerprint(lm.with_weights({"blk.1.ffn_down": W}))
    assert whole2 != whole and per2["blk.1.ffn_down"] != per["blk.1.ffn_down"]
    assert {k for k in per if per[k] != per2[k]} == {"blk.1.ffn_down"}


# -- 7. another spelling of the model's path -----------------------------------------------------

def test_resume_under_a_relative_path_or_a_symlink(tiny, tmp_path, monkeypatch):
    kw = dict(fmt="gguf-q4_0", factors="input", **FAST)
    src = tiny["dir"] / "tiny.gguf"
    out = tmp_path / "q.gguf"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(src, out, _after_layer=_stop_after(4, []), **kw)
    (tmp_path / "link.gguf").symlink_to(src)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyboardInterrupt):   # a symlink, named relative to the cwd
        quantize_model("link.gguf", out, _after_layer=_stop_after(2, []), **kw)
    assert len(_layers_in(out)) == 6
    monkeypatch.chdir(src.parent)
    res = quantize_model(os.path.join(".", src.name), out, **kw)   # relative
    assert res["resumed"] == 6


# -- 6. everything that can be checked, before OUT.work exists -----------------------------------

def test_memory_budget_too_small_names_the_option(tiny, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    rc = _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "input", "--memory-budget", "1")
    err = capsys.readouterr().err
    assert rc == 2 and "--memory-budget" in err and "budget_bytes" not in err, err
    _no_work(out)
    with pytest.raises(InputError, match=r"memory_budget \(--memory-budget\) 1 bytes is too "
                                         r"small: collecting layer"):
        quantize_model(tiny["dir"] / "tiny.gguf", out, factors="global", memory_budget=1,
                       **FAST)
    _no_work(out)


def test_memory_budget_nan_in_the_library(tiny, tmp_path):
    with pytest.raises(InputError, match="memory_budget"):
        quantize_model(tiny["dir"] / "tiny.gguf", tmp_path / "q.gguf", memory_budget=math.nan,
                       **FAST)
    _no_work(tmp_path / "q.gguf")
    from bakron.hessian import global_factors

    lm = load_llm(tiny["dir"] / "tiny.gguf")
    for bad in (math.nan, math.inf, "2G"):
        with pytest.raises(ValueError, match="budget_bytes must be a positive integer"):
            global_factors(lm.stages(), [np.zeros((1, 4), dtype=np.int64)], budget_bytes=bad)


def test_calib_len_longer_than_the_context(tiny, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    rc = _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "input", "--calib-len", "65")
    err = capsys.readouterr().err
    assert rc == 2 and "--calib-len" in err and "context of 64" in err, err
    _no_work(out)
    with pytest.raises(InputError, match=r"calib_len \(--calib-len\) 65 is longer than the "
                                         r"model's context of 64 tokens"):
        quantize_model(tiny["dir"] / "tiny.gguf", out, factors="global", calib_seqs=4,
                       calib_len=65, progress=False)
    _no_work(out)
    assert _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "input", "--calib-len", "64") == 0


def test_calibration_ids_outside_the_vocabulary(tiny, tmp_path, monkeypatch):
    """A tokenizer that gives ids past the embedding table (simulated: the loader refuses
    such a pair of files first) is refused before any work."""
    real = qm.calibration_sequences
    monkeypatch.setattr(qm, "calibration_sequences",
                        lambda lm, *a: [s + [lm.config.vocab_size + 3] for s in real(lm, *a)])
    out = tmp_path / "q.gguf"
    with pytest.raises(InputError, match=r"token id 263 \(sequence 0\), outside the model's "
                                         r"vocabulary 0\.\.259"):
        quantize_model(tiny["dir"] / "tiny.gguf", out, factors="input", calib="builtin",
                       **FAST)
    _no_work(out)


def test_a_config_naming_fewer_layers_than_the_files_hold(tiny, tmp_path, capsys):
    one = dataclasses.replace(tiny["cfg"], num_layers=1)
    src = _hf(tiny, tmp_path / "model", cfg=one)   # the weights of two blocks, config says 1
    out = tmp_path / "q"
    rc = _cli(src, out, "--format", "gptq", "--group-size", "32", "--factors", "rtn")
    err = capsys.readouterr().err
    assert rc == 4 and "block 1" in err and "num_hidden_layers" in err, err
    assert str(src) in err, err
    _no_work(out)
    write_gguf(tmp_path / "one.gguf", one, tiny["w"])   # block_count 1, two blocks of tensors
    rc = _cli(tmp_path / "one.gguf", out, "--factors", "rtn")
    err = capsys.readouterr().err
    assert rc == 4 and "block 1" in err and "block_count" in err and "one.gguf" in err, err
    _no_work(out)


def test_huge_weight_names_the_layer_not_just_the_fp16_scale(tiny, tmp_path, capsys):
    def huge(w):
        w["blk.1.ffn_up.weight"][3, 4] = 3e38
    src = _hf(tiny, tmp_path / "model", huge)
    out = tmp_path / "q"
    rc = _cli(src, out, "--format", "gptq", "--group-size", "32", "--factors", "rtn")
    err = capsys.readouterr().err
    # the loader refuses it first (a bad model file, exit 4), naming the file and the tensor
    assert rc == 4 and "mlp.up_proj.weight" in err and "3e+38" in err, err
    assert "model.safetensors" in err, err
    _no_work(out)


def test_nan_weight_names_the_tensor(tiny, tmp_path, capsys):
    def nan(w):
        w["blk.1.ffn_down.weight"][0, 0] = np.nan
    src = _hf(tiny, tmp_path / "model", nan)
    out = tmp_path / "q"
    rc = _cli(src, out, "--format", "float", "--factors", "input")
    err = capsys.readouterr().err
    # (the loader may refuse it first, as a bad model file)
    assert rc in (2, 4) and ("ffn_down" in err or "mlp.down_proj" in err), err
    _no_work(out)


def _retype(path, tensor, dtype):
    """Rewrite a safetensors header: ``tensor`` declared as ``dtype`` (same item size)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header[tensor]["dtype"] = dtype
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


@pytest.mark.parametrize("fmt", ["gptq", "float"])
def test_integer_weight_is_refused_by_name(tiny, tmp_path, capsys, fmt):
    src = _hf(tiny, tmp_path / "model")
    _retype(src / "model.safetensors", "model.layers.0.self_attn.q_proj.weight", "I32")
    out = tmp_path / "q"
    rc = _cli(src, out, "--format", fmt, "--group-size", "32", "--factors", "rtn")
    err = capsys.readouterr().err
    # (the loader may refuse it first, as a bad model file)
    assert rc in (2, 4) and ("q_proj" in err or "attn_q" in err) and "I32" in err, err
    assert "overflows float16" not in err
    _no_work(out)


# -- 6. a later error says what is left; a corrected command reuses the folder ------------------

def test_a_full_disk_at_the_export_keeps_the_layers_and_says_so(tiny, tmp_path, capsys,
                                                                 monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "q.gguf"))
    monkeypatch.setattr(qm, "_export", full)
    out = tmp_path / "q.gguf"
    rc = _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "rtn")
    err = capsys.readouterr().err
    assert rc == 5 and "No space left" in err and "nothing was written" not in err, err
    assert "14 finished layer(s) are kept in" in err and str(work_folder(out)) in err, err
    assert len(_layers_in(out)) == 14 and not out.exists()
    monkeypatch.undo()
    assert _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "rtn") == 0
    assert out.is_file() and not work_folder(out).exists()


def test_an_error_before_any_finished_layer_leaves_nothing(tiny, tmp_path, capsys,
                                                          monkeypatch):
    def boom(*a, **k):
        raise ValueError("the Hessian passes failed")
    monkeypatch.setattr(qm, "_collect", boom)
    out = tmp_path / "q.gguf"
    rc = _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "input")
    err = capsys.readouterr().err
    assert rc == 2 and "the Hessian passes failed" in err and "nothing is left" in err, err
    _no_work(out)
    monkeypatch.setattr(qm, "_collect", lambda *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    rc = _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "input")
    err = capsys.readouterr().err
    assert rc == 5 and "nothing is left" in err and "nothing was written" not in err, err
    _no_work(out)


def test_an_interrupt_before_any_finished_layer_leaves_nothing(tiny, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.setattr(qm, "_collect", lambda *a, **k: (_ for _ in ()).throw(
        KeyboardInterrupt))
    out = tmp_path / "q.gguf"
    rc = _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "input")
    err = capsys.readouterr().err
    assert rc == 130 and "nothing is left" in err, err
    _no_work(out)


def test_a_work_folder_without_finished_layers_is_replaced(tiny, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    work = work_folder(out)
    (work / "layers").mkdir(parents=True)   # as a run killed before its first layer leaves it
    (work / "run.json").write_text(json.dumps({"key": "another run", "model": "other"}))
    (work / "layers" / "blk.0.attn_q.safetensors").write_bytes(b"torn")   # not a layer file
    assert _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "rtn") == 0
    assert out.is_file() and not work.exists()


def test_a_work_folder_of_another_run_with_finished_layers_is_kept(tiny, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(tiny["dir"] / "tiny.gguf", out, factors="input",
                       _after_layer=_stop_after(2, []), **FAST)
    before = {p.name: p.read_bytes() for p in (work_folder(out) / "layers").iterdir()}
    rc = _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "rtn")
    err = capsys.readouterr().err
    assert rc == 2 and "belongs to another run (factors" in err and "2 finished layer" in err
    assert "left as it was" in err and str(work_folder(out)) in err, err
    assert {p.name: p.read_bytes() for p in (work_folder(out) / "layers").iterdir()} == before
    assert not out.exists()


def test_a_work_folder_of_an_older_bakron_is_named_as_such(tiny, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(tiny["dir"] / "tiny.gguf", out, factors="rtn",
                       _after_layer=_stop_after(1, []), **FAST)
    run_file = work_folder(out) / "run.json"
    old = json.loads(run_file.read_text())
    run_file.write_text(json.dumps({k: v for k, v in old.items()   # as version 1 wrote it
                                    if k not in ("version", "source", "model_hash")}
                                   | {"key": "a key of version 1"}))
    rc = _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "rtn")
    err = capsys.readouterr().err
    assert rc == 2 and "another run (version differs)" in err and "1 finished layer" in err, err
    run_file.write_text("{not json")
    rc = _cli(tiny["dir"] / "tiny.gguf", out, "--factors", "rtn")
    err = capsys.readouterr().err
    assert rc == 2 and "another run (no readable run.json)" in err, err
    assert len(_layers_in(out)) == 1 and not out.exists()
