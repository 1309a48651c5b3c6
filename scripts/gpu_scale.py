"""Global Hessians on the GPU and the two-sided vs one-sided ablation at scale (SmolLM2).

Two commands, both on cupy end to end (model, calibration, factors, solves, evaluation):

``throughput``
    Tokens per second of each pass of :func:`bakron.hessian.global_factors` (K-FAC, then one
    refinement step: ``refine_out``, ``refine_in``) over random token ids, every linear layer
    collected, for several batch shapes, against the pass's GEMM floor measured in the same
    process (every product of :func:`bakron.hessian.cost.pass_gemms` timed alone with CUDA
    events on random data of its shape; factor products as ``syrk``). ``--tf32`` sets
    ``CUPY_TF32=1`` for cuBLAS before cupy is imported; ``--save``/``--compare`` write and
    compare the factors of one fixed batch (to state TF32's error against float32).

``scale``
    The ablation of docs/llm.md at 64k / 256k / 1M calibration tokens: the Language
    Reference's calibration sequences (all of them, at every size) and text sampled from the
    model (temperature 1, from BOS, 128-token sequences), collected in parts of 256
    sequences (K-FAC factors of the ablation's layers; parts alternate between two folds);
    at each size the 42 layers of blocks 0, 5, ..., 25 are rounded (float grid, asymmetric
    groups of 64, min/max) with each variant and the KL to the original model is measured on
    the evaluation texts (Lee news, held-out docs) with standard errors over texts. The
    held-out choice of H_out's shrinkage (calibration folds only) is scored at 3 bits on
    blocks 10 and 20. Results are appended to ``--out`` as they come; ``--deadline`` stops
    collecting in time to finish the size in hand.

Typical calls (an H200)::

    python scripts/gpu_scale.py throughput --out thr.json --batch-seqs 64,256,1024
    python scripts/gpu_scale.py scale --out scale.json --sizes 65536,262144,1048576
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

SEQ_LEN = 128
PART_SEQS = 256
BLOCKS = (0, 5, 10, 15, 20, 25)
CV_BLOCKS = (10, 20)
SHRINKS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


def say(*a):
    print(*a, file=sys.stderr, flush=True)


CPU = {"on": False}   # scale --cpu: a smoke test of the script on numpy


def _xp():
    if CPU["on"]:
        import array_api_compat.numpy as xp

        return None, xp
    import array_api_compat.cupy as xp
    import cupy as cp

    return cp, xp


def _sync():
    if not CPU["on"]:
        import cupy as cp

        cp.cuda.Device().synchronize()


def _load(chunk_bytes):
    from bakron.models import load_llm

    cp, xp = _xp()
    return cp, xp, load_llm("smollm2", xp=xp, chunk_bytes=chunk_bytes)


def _append(path, row):
    from bakron._lib.fs import append_json_row

    append_json_row(path, row)


# -- the floor --------------------------------------------------------------------------------

def floor_seconds_gpu(g, reps=3):
    """Seconds of the products of one pass (``pass_gemms``) on this GPU, by part."""
    import cupy as cp

    cache = floor_seconds_gpu.cache
    rng = cp.random.default_rng(0)

    def timed(fn):
        fn()
        ts = []
        for _ in range(reps):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
        return float(np.median(ts))

    def t_item(it):
        if it in cache:
            return cache[it]
        if it[0] == "gemm":
            _, M, K, N = it
            A = rng.standard_normal((M, K), dtype=cp.float32)
            B = rng.standard_normal((K, N), dtype=cp.float32)
            cache[it] = timed(lambda: A @ B)
        elif it[0] == "bmm":
            _, c, M, K, N = it
            A = rng.standard_normal((c, M, K), dtype=cp.float32)
            B = rng.standard_normal((c, K, N), dtype=cp.float32)
            cache[it] = timed(lambda: cp.matmul(A, B))
        else:   # ("syrk", rows, n)
            _, M, n = it
            X = rng.standard_normal((M, n), dtype=cp.float32)
            try:
                from cupy import cublas

                cache[it] = timed(lambda: cublas.syrk("T", X))
            except Exception:                       # no syrk: the GEMM the code runs
                cache[it] = timed(lambda: X.T @ X)
        cp.get_default_memory_pool().free_all_blocks()
        return cache[it]

    N = g["N"]
    fwd = sum(t_item(tuple(it)) for it in g["fwd"])
    vjp = sum(t_item(tuple(it)) for it in g["vjp"])
    kfac = sum(t_item(("syrk", N, n)) for n in g["in"]) + \
        sum(t_item(("syrk", N, m)) for m in g["out"])
    r_out = sum(t_item(("gemm", N, n, n)) + t_item(("syrk", N, m)) for m, n in g["layers"])
    r_in = sum(t_item(("gemm", N, m, m)) + t_item(("syrk", N, n)) for m, n in g["layers"])
    return {"forward": fwd, "vjp": vjp, "kfac_products": kfac, "kfac": fwd + vjp + kfac,
            "refine_out": fwd + vjp + r_out, "refine_in": fwd + vjp + r_in}


floor_seconds_gpu.cache = {}


# -- throughput -------------------------------------------------------------------------------

def throughput(args):
    import bakron.hessian as bh
    from bakron.hessian.cost import pass_gemms

    cp, xp, lm = _load(args.chunk_bytes)
    stages = lm.stages()
    V = lm.config.vocab_size
    rng = np.random.default_rng(0)
    info = {"kind": "throughput", "tf32": os.environ.get("CUPY_TF32") == "1",
            "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
            "cupy": cp.__version__, "chunk_bytes": args.chunk_bytes}
    for B in [int(b) for b in args.batch_seqs.split(",")]:
        nb = max(1, args.tokens // (B * SEQ_LEN))
        batches = [xp.asarray(rng.integers(0, V, (B, SEQ_LEN)))
                   for _ in range(nb)]
        try:
            bh.global_factors(stages, batches[:1], refine_iters=1, sink=lambda *a: None)
            _sync()
            cp.get_default_memory_pool().free_all_blocks()
            t0 = time.perf_counter()
            _, rep = bh.global_factors(stages, batches, refine_iters=1, sink=lambda *a: None)
            _sync()
            wall = time.perf_counter() - t0
        except Exception as exc:   # e.g. out of memory at the largest batch
            say(f"batch {B}: {type(exc).__name__}: {exc}")
            _append(args.out, {**info, "batch_seqs": B, "error": repr(exc)})
            continue
        pool = cp.get_default_memory_pool().total_bytes()
        secs = {}
        for s in rep.sweeps:
            secs[s.kind] = secs.get(s.kind, 0.0) + s.seconds
        fl = {k: v * nb for k, v in floor_seconds_gpu(
            pass_gemms(stages, B * SEQ_LEN, (B, SEQ_LEN))).items()}
        tokens = nb * B * SEQ_LEN
        row = {**info, "batch_seqs": B, "seq_len": SEQ_LEN, "batches": nb, "tokens": tokens,
               "wall": wall, "seconds": secs, "floor": fl,
               "tokens_per_s": {k: tokens / v for k, v in secs.items()},
               "ratio": {k: secs[k] / fl[k] for k in secs if k in fl},
               "pool_bytes": int(pool), "ledger_peak_bytes": rep.peak_bytes}
        say(f"batch {B} x {SEQ_LEN}: " + ", ".join(
            f"{k} {row['tokens_per_s'][k]:,.0f} tok/s ({row['ratio'].get(k, 0):.2f}x floor)"
            for k in secs) + f"; pool {pool / 2**30:.1f} GiB")
        _append(args.out, row)
        del batches
        cp.get_default_memory_pool().free_all_blocks()
    if args.save or args.compare:
        batch = [xp.asarray(np.random.default_rng(1).integers(0, V, (64, SEQ_LEN)))]
        names = ["blk.3.attn_q", "blk.3.ffn_up", "blk.3.ffn_down", "blk.20.attn_v"]
        fac, _ = bh.global_factors(stages, batch, layers=names)
        got = {f"{n}.{s}": cp.asnumpy(f[i]) for n, f in fac.items()
               for i, s in enumerate(("in", "out"))}
        if args.save:
            np.savez(args.save, **got)
        if args.compare:
            with np.load(args.compare) as ref:
                err = {k: float(np.linalg.norm(got[k] - ref[k]) / np.linalg.norm(ref[k]))
                       for k in got}
            say("factor relative error against the saved run: " + json.dumps(err))
            _append(args.out, {**info, "factor_rel_error_vs_saved": err})


# -- scale ------------------------------------------------------------------------------------

def _calibration(lm, n_seqs, gen_batch, seq_len, part_seqs):
    """Part-ordered sequences: the Language Reference's sequences spread over parts 0 and 1,
    the rest sampled from the model."""
    from bakron.models.llm.calibration import generated_sequences
    from bakron.quantize_model import _calibration_documents, calibration_sequences

    docs_text, _ = _calibration_documents("builtin")
    docs = calibration_sequences(lm, docs_text, 10 ** 6, seq_len)
    docs = docs[:2 * part_seqs - 2]          # all of them at the sizes of the docs
    n_gen = n_seqs - len(docs)
    t0 = time.perf_counter()
    gen = generated_sequences(lm, n_gen, seq_len, seed=0, use_cache=False,
                              batch_size=gen_batch, progress=True)
    t_gen = time.perf_counter() - t0
    parts, g = [], 0
    for p in range(n_seqs // part_seqs):
        d = docs[p::2] if p < 2 else []
        take = part_seqs - len(d)
        parts.append(d + gen[g:g + take])
        g += take
    return parts, {"docs_seqs": len(docs), "docs_tokens": sum(map(len, docs)),
                   "generated_seqs": n_gen, "generation_seconds": t_gen,
                   "generated_tokens_per_s": n_gen * (seq_len - 1) / t_gen}


#: the variants of the ablation run here (llm_ablation.VARIANTS defines them)
SCALE_VARIANTS = ("rtn", "ldlq", "global", "global-auto", "ldlq-inc", "global-auto-inc")


def _solve(W, H_in, H_out, bits, variant, tokens, shrink=None):
    """``W_hat`` (cupy float32) of one variant from K-FAC factors: the ablation's own
    :func:`llm_ablation.solve_variant` (``H_in`` serves as the local and the K-FAC input
    factor); ``shrink`` replaces the variant by two-sided with that shrinkage of ``H_out``."""
    from llm_ablation import VARIANTS, solve_variant

    v = VARIANTS[variant] if shrink is None else {"factors": "global", "shrink": shrink}
    return solve_variant(W, {"kin": H_in, "in": H_in, "out": H_out}, bits, v, tokens)


def _proxy(xp, E, H_in, H_out):
    return float(xp.sum((H_out @ E) * (E @ H_in)))


def scale(args):
    import bakron.hessian as bh
    from bakron.models.llm.evaluation import _Reference, evaluation_texts

    t_start = time.perf_counter()
    deadline = t_start + args.deadline
    CPU["on"] = args.cpu
    cp, xp, lm = _load(args.chunk_bytes)
    T, PS = args.seq_len, args.part_seqs
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if any(N % (PS * T) for N in sizes):
        raise ValueError(f"--sizes must be multiples of {PS * T} tokens (parts of {PS} x {T})")
    n_seqs = max(sizes) // T
    names = [n for n in lm.linear_names() if int(n.split(".")[1]) in BLOCKS]
    parts, cal = _calibration(lm, n_seqs, args.gen_batch, T, PS)
    say(f"calibration: {json.dumps(cal)}")
    _append(args.out, {"kind": "calibration", **cal})
    texts = evaluation_texts(lm)
    ref = _Reference(lm, texts, 16)
    W = {n: lm.linear_weight(n) for n in names}
    sums = [{}, {}]
    toks = [0, 0]
    done_parts, t_collect = 0, 0.0
    for N in sizes:
        need = N // (PS * T)
        while done_parts < need:
            p = done_parts
            t0 = time.perf_counter()
            batches, _ = bh.pad_batches(parts[p], batch_size=PS, xp=xp,
                                        device=lm.device)
            n_tok = sum(map(len, parts[p]))
            f = p % 2

            def sink(name, H_in, H_out, f=f, n_tok=n_tok):
                s = sums[f].get(name)
                if s is None:
                    sums[f][name] = [H_in * n_tok, H_out * n_tok]
                else:
                    s[0] += H_in * n_tok
                    s[1] += H_out * n_tok

            bh.global_factors(lm.stages(), batches, layers=names, seed=p, sink=sink)
            toks[f] += n_tok
            _sync()
            t_collect += time.perf_counter() - t0
            done_parts += 1
            say(f"part {p}: {n_tok} tokens, {time.perf_counter() - t0:.1f} s")
            if time.perf_counter() > deadline:
                break
        if done_parts < need:
            say(f"deadline: stopped at {done_parts} parts, before {N} tokens")
            break
        total = toks[0] + toks[1]
        t_eval = time.perf_counter()
        full = {n: [(sums[0][n][i] + sums[1][n][i]) / total for i in range(2)] for n in names}
        base = {"kind": "ablation", "size": N, "tokens": total,
                "collect_seconds": t_collect, "collect_tokens_per_s": total / t_collect}
        # held-out choice of the shrinkage of H_out (calibration folds only), 3 bits
        cv = []
        for n in names:
            if int(n.split(".")[1]) not in CV_BLOCKS:
                continue
            fold = [[sums[f][n][i] / toks[f] for i in range(2)] for f in range(2)]
            for tr in range(2):
                Hi, Ho = fold[tr]
                Ti, To = fold[1 - tr]
                row = {"layer": n, "train": tr, "m": int(W[n].shape[0])}
                for s in (None,) + SHRINKS:
                    Wh = _solve(W[n], Hi, Ho, 3, "ldlq", toks[tr], shrink=s)
                    E = xp.astype(Wh, xp.float64) - xp.astype(W[n], xp.float64)
                    row["ldlq" if s is None else f"s{s}"] = _proxy(xp, E, Ti, To)
                cv.append(row)
        _append(args.out, {**base, "kind": "cv", "fold_tokens": toks, "rows": cv})
        for bits in (3, 4):
            for vname in args.variants:
                if time.perf_counter() > deadline + args.grace:
                    say("deadline: skipping the remaining variants")
                    break
                t0 = time.perf_counter()
                new = {n: _solve(W[n], full[n][0], full[n][1], bits, vname, total)
                       for n in names}
                _sync()
                t_solve = time.perf_counter() - t0
                figs = ref.score(lm.with_weights(new))
                row = {**base, "bits": bits, "variant": vname, "solve_seconds": t_solve,
                       **{f"{k}_{m}": figs[k][m] for k in figs
                          for m in ("kl", "kl_text_sem", "perplexity")}}
                say(f"{N} tokens {bits} bits {vname:16s} " + "  ".join(
                    f"{k} {figs[k]['kl']:.4f} ± {figs[k]['kl_text_sem']:.4f}" for k in figs)
                    + f"  (solve {t_solve:.1f} s)")
                _append(args.out, row)
        say(f"size {N}: evaluation {time.perf_counter() - t_eval:.0f} s; "
            f"elapsed {time.perf_counter() - t_start:.0f} s")


# -- report -----------------------------------------------------------------------------------

def _rows(paths):
    out = []
    for f in paths:
        out += json.loads(Path(f).read_text())
    return out


THROUGHPUT_PAGE = """# Global Hessians on the GPU

Throughput of the global-Hessian passes of SmolLM2-135M on {gpu} with cupy {cupy}: a K-FAC
pass, then one refinement step (a pass for `H_O`, a pass for `H_I`), every one of the 210
linear layers collected, over random token ids in sequences of 128 tokens, float32 factor
products summed in float64. The *floor* of a pass is measured in the same process: every
matrix product of the pass (`bakron.hessian.cost.pass_gemms`: the forward, the VJP, the
factor products as `syrk`) timed alone with CUDA events on random data of its shape and
summed; ratio = pass time ÷ floor. The TF32 row's floor was measured with TF32 allowed too,
but its factor products are timed as `syrk` calls while the pass forms them as GEMMs
(`Xᵀ X`); a ratio below 1 there says that those GEMMs on TF32 tensor cores beat the `syrk`
floor. Measured on {date}. Command:

```bash
python scripts/gpu_scale.py throughput --out thr.json --batch-seqs 128,512 --tokens 65536 \\
    --save f32.npz
CUPY_TF32=1 python scripts/gpu_scale.py throughput --out thr.json --batch-seqs 512 \\
    --tokens 65536 --compare f32.npz
python scripts/gpu_scale.py report thr.json --page docs/benchmarks/hessian-gpu.md
```

{table}

The cupy pool column is the memory the pool held after the run (activations of a whole batch
are kept: store-all schedule). With the default batches of `bakron quantize-model` on the
CPU (8 sequences) the same pass runs far below these rates on a GPU, so on a GPU
`quantize-model` now uses batches of 256 sequences.

**TF32.** `CUPY_TF32=1` lets cuBLAS use TF32 tensor cores for the float32 products:
1.6× the tokens per second. Its input factors differ from float32 by {in_err} (relative
Frobenius error, 4 layers, 8,192 tokens); its output factors by {out_err}. The labels of
the output factor are sampled from the model's own softmax, so where TF32 rounding moves a
token's probabilities across a sampling threshold that token gets another label; this is the
likely cause of the large difference (the two runs are then two samples of a noisy
estimate), but it was not separated from rounding here (a run with given labels would). The
factor tests were not run with TF32, so float32 stays the default.
"""


def report(args):
    """Markdown tables (stdout) and the KL-against-tokens plot from the JSON results; with
    ``--page`` the throughput page."""
    rows = _rows(args.results)
    thr = [r for r in rows if r.get("kind") == "throughput" and "seconds" in r]
    if args.page:
        import contextlib
        import datetime
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            _throughput_table(thr)
        err = next(r["factor_rel_error_vs_saved"] for r in rows
                   if "factor_rel_error_vs_saved" in r)
        ins = [v for k, v in err.items() if k.endswith(".in")]
        outs = [v for k, v in err.items() if k.endswith(".out")]
        date = args.date or datetime.date.today().isoformat()
        page = THROUGHPUT_PAGE.format(
            gpu=f"one {thr[0]['gpu']}", cupy=thr[0]["cupy"], date=date, table=buf.getvalue(),
            in_err=f"{min(ins):.0e}–{max(ins):.0e}", out_err=f"{min(outs):.2f}–{max(outs):.2f}")
        tmp = Path(args.page).with_suffix(".tmp")
        tmp.write_text(page)
        os.replace(tmp, args.page)
        return
    if thr:
        _throughput_table(thr)
        for r in rows:
            if "factor_rel_error_vs_saved" in r:
                e = r["factor_rel_error_vs_saved"]
                print(f"\nTF32 factors against float32 (relative Frobenius error): "
                      f"max {max(e.values()):.1e} over {len(e)} factors")
    _quality(rows, args)


def _throughput_table(thr):
    if thr:
        print("| cuBLAS | batch (sequences × tokens) | tokens | K-FAC tok/s (÷ floor) "
              "| refine H_O tok/s (÷ floor) | refine H_I tok/s (÷ floor) | cupy pool |")
        print("|---|---|---|---|---|---|---|")
        for r in thr:
            cells = [f"{r['tokens_per_s'][k]:,.0f} ({r['ratio'][k]:.2f}×)"
                     for k in ("kfac", "refine_out", "refine_in")]
            print(f"| {'TF32' if r['tf32'] else 'float32'} | {r['batch_seqs']} × {r['seq_len']} "
                  f"| {r['tokens']:,} | " + " | ".join(cells)
                  + f" | {r['pool_bytes'] / 2 ** 30:.1f} GiB |")


def _quality(rows, args):
    cal = [r for r in rows if r.get("kind") == "calibration"]
    if cal:
        c = cal[-1]
        print(f"\nCalibration: {c['docs_seqs']} Language Reference sequences "
              f"({c['docs_tokens']:,} tokens) + {c['generated_seqs']:,} generated sequences "
              f"({c['generated_tokens_per_s']:,.0f} generated tokens/s)")
    abl = [r for r in rows if r.get("kind") == "ablation" and "variant" in r]
    if abl:
        base = {(r["size"], r["bits"]): r for r in abl if r["variant"] == "ldlq"}
        print("\n| tokens | bits | method | Lee news KL ± s.e. | ÷ LDLQ "
              "| held-out docs KL ± s.e. | ÷ LDLQ |")
        print("|---|---|---|---|---|---|---|")
        for r in sorted(abl, key=lambda r: (r["size"], r["bits"], r["variant"])):
            b = base.get((r["size"], r["bits"]))
            cells = []
            for k in ("lee", "docs"):
                if f"{k}_kl" not in r:
                    cells += ["", ""]
                    continue
                cells.append(f"{r[f'{k}_kl']:.3f} ± {r[f'{k}_kl_text_sem']:.3f}")
                cells.append(f"{r[f'{k}_kl'] / b[f'{k}_kl']:.2f}" if b else "")
            print(f"| {r['size'] // 1024}k | {r['bits']} | {r['variant']} | "
                  + " | ".join(cells) + " |")
        _ratio_table(abl)
        secs = {r["size"]: r["collect_seconds"] for r in abl}
        print("\nK-FAC collection (the 42 layers): " + ", ".join(
            f"{n // 1024}k tokens {t:.0f} s" for n, t in sorted(secs.items())))
    for r in rows:
        if r.get("kind") != "cv":
            continue
        cands = [k for k in r["rows"][0] if k.startswith("s")]
        logs = {c: [] for c in cands}
        for x in r["rows"]:
            for c in cands:
                logs[c].append(math.log(x[c] / x["ldlq"]))
        gm = {c: math.exp(sum(v) / len(v)) for c, v in logs.items()}
        best = min(gm, key=gm.get)
        rule = {x["m"]: min(1.0, x["m"] / r["fold_tokens"][x["train"]]) for x in r["rows"]}
        print(f"\n{r['size'] // 1024}k tokens, held-out proxy ÷ LDLQ's (3 bits, blocks "
              f"{', '.join(map(str, CV_BLOCKS))}, geometric mean over layers and folds): "
              + ", ".join(f"shrink {c[1:]}: {v:.3f}" for c, v in gm.items())
              + f"; best {best[1:]}; the rule's shrink per width: "
              + ", ".join(f"{m}: {a:.3f}" for m, a in sorted(rule.items())))
    if abl and args.plot:
        _plot(abl, args.plot)


def _ratio_table(abl):
    """LDLQ's KL and every other variant's ratio to it, news / docs (docs/llm.md)."""
    idx = {(r["size"], r["bits"], r["variant"]): r for r in abl}
    others = [v for v in SCALE_VARIANTS if v not in ("rtn", "ldlq")
              and any(k[2] == v for k in idx)]
    print("\n| tokens | bits | LDLQ KL ± s.e. (news / docs) | " + " | ".join(others) + " |")
    print("|---|---|---|" + "---|" * len(others))
    for N, b in sorted({(k[0], k[1]) for k in idx}):
        L = idx.get((N, b, "ldlq"))
        if L is None:
            continue
        cells = [f"{L['lee_kl']:.3f} ± {L['lee_kl_text_sem']:.3f} / "
                 f"{L['docs_kl']:.3f} ± {L['docs_kl_text_sem']:.3f}"]
        for v in others:
            r = idx.get((N, b, v))
            cells.append("" if r is None else f"{r['lee_kl'] / L['lee_kl']:.2f} / "
                                              f"{r['docs_kl'] / L['docs_kl']:.2f}")
        print(f"| {N // 1024}k | {b} | " + " | ".join(cells) + " |")


def _plot(abl, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for i, bits in enumerate((3, 4)):
        for j, (k, title) in enumerate((("lee", "Lee news"), ("docs", "held-out docs"))):
            ax = axes[i][j]
            for v in sorted({r["variant"] for r in abl}):
                pts = sorted((r["size"], r[f"{k}_kl"], r[f"{k}_kl_text_sem"]) for r in abl
                             if r["variant"] == v and r["bits"] == bits and f"{k}_kl" in r)
                if pts:
                    x, y, e = zip(*pts)
                    ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=v)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{bits} bits, {title}")
            ax.set_ylabel("KL to the original (nats/token)")
            if i == 1:
                ax.set_xlabel("calibration tokens")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M, 42 layers rounded: KL against calibration tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--out", required=True)
    t.add_argument("--batch-seqs", default="64,256,1024")
    t.add_argument("--tokens", type=int, default=131072, help="tokens per measurement")
    t.add_argument("--chunk-bytes", type=int, default=1 << 31)
    t.add_argument("--save", default=None)
    t.add_argument("--compare", default=None)
    s = sub.add_parser("scale")
    s.add_argument("--out", required=True)
    s.add_argument("--sizes", default="65536,262144,1048576")
    s.add_argument("--variants", nargs="+", default=list(SCALE_VARIANTS),
                   choices=list(SCALE_VARIANTS))
    s.add_argument("--gen-batch", type=int, default=1024)
    s.add_argument("--seq-len", type=int, default=SEQ_LEN)
    s.add_argument("--part-seqs", type=int, default=PART_SEQS)
    s.add_argument("--cpu", action="store_true", help="numpy instead of cupy (a smoke test)")
    s.add_argument("--chunk-bytes", type=int, default=1 << 31)
    s.add_argument("--deadline", type=float, default=1e9,
                   help="seconds after which no new part is collected")
    s.add_argument("--grace", type=float, default=60.0,
                   help="seconds after the deadline in which variants are still evaluated")
    r = sub.add_parser("report")
    r.add_argument("results", nargs="+")
    r.add_argument("--plot", default=None, help="PNG of KL against calibration tokens")
    r.add_argument("--page", default=None, help="write the throughput page (markdown) here")
    r.add_argument("--date", default=None, help="the measurement's date on the page")
    args = p.parse_args(argv)
    try:
        {"throughput": throughput, "scale": scale, "report": report}[args.cmd](args)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
