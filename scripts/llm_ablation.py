"""The two-sided vs one-sided ablation on SmolLM2 (docs/llm.md, "Two-sided against one-sided";
docs/hessian.md, "Regularising H_out").

Factors are collected once and cached on disk; every variant is re-solved from the cache.
The tables of the docs were made with (K-FAC factors of the default calibration of
``bakron quantize-model``, 32 x 128 tokens of the Language Reference, in 8 processes of 4
sequences each; folds: sequences 0-15 and 16-31):

    echo '{"tokens": 4096, "parts": {"fold0": [0, 1, 2, 3], "fold1": [4, 5, 6, 7]}}' \
        > kfac-cache/meta.json
    for p in 0 1 2 3 4 5 6 7; do
        python scripts/llm_ablation.py collect --out kfac-cache --part $p --parts 8 --folds 2 &
    done; wait
    python scripts/llm_ablation.py cv --factors kfac-cache --blocks 10 --bits 3 \
        --shrinks 0 50 100 --damps --out cv-b10.json          # and --blocks 20
    python scripts/llm_ablation.py cv-summary cv-b10.json cv-b20.json
    python scripts/llm_ablation.py run --factors kfac-cache --blocks 0,5,10,15,20,25 \
        --variants rtn ldlq global global-auto --bits 3 4 --out runs.json
    python scripts/llm_ablation.py table runs.json

``collect`` without ``--part`` stores K-FAC and refined (one per-sequence step) factors per
fold instead. ``run`` rounds the chosen layers (the others stay float32) with each variant
from the fold-averaged factors (the folds hold equal token counts: their mean is the factor
of the whole calibration) and measures the KL on the evaluation texts
(bakron.models.llm.evaluation). ``cv`` scores regularisations of H_out by the held-out fold's
proxy (calibration data only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def _load(cache=None):
    import array_api_compat.numpy as xp

    from bakron.models import load_llm

    return xp, load_llm("smollm2", xp=xp, cache=cache)


def calib_seqs(lm, n_seqs=32, seq_len=128):
    from bakron.quantize_model import _calibration_documents, calibration_sequences

    docs, _ = _calibration_documents("builtin")
    return calibration_sequences(lm, docs, n_seqs, seq_len)


def collect(args):
    from bakron.hessian import global_factors, pad_batches

    xp, lm = _load()
    seqs = calib_seqs(lm, args.seqs, args.seq_len)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folds = np.array_split(np.arange(len(seqs)), args.folds)
    meta = {"tokens": int(sum(map(len, seqs))), "seqs": len(seqs), "labels": args.labels,
            "draws": args.draws, "folds": [f.tolist() for f in folds], "seconds": {}}
    labels = None if args.labels == "sample" else args.labels
    if args.part is not None:   # one part of a fold (K-FAC only: one pass), its own process
        return collect_part(args, lm, xp, seqs, labels, out)
    for k, idx in enumerate(folds):
        if args.only_fold is not None and k != args.only_fold:
            continue
        fdir = out / f"fold{k}"
        fdir.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        batches, _ = pad_batches([seqs[i] for i in idx], batch_size=8, xp=xp)
        for d in range(args.draws):
            def kfac(name, H_in, H_out, d=d):   # written at once: nothing held in memory
                np.savez(fdir / f"{name}.k{d}.npz", kin=np.asarray(H_in, np.float32),
                         kout=np.asarray(H_out, np.float32))

            def sink(name, H_in, H_out, d=d):
                with np.load(fdir / f"{name}.k{d}.npz") as z:
                    kin, kout = z["kin"], z["kout"]
                np.savez(fdir / f"{name}.d{d}.npz", kin=kin, kout=kout,
                         **{"in": np.asarray(H_in, np.float32),
                            "out": np.asarray(H_out, np.float32)})
                (fdir / f"{name}.k{d}.npz").unlink()

            global_factors(lm.stages(labels), batches, refine_iters=1, refine="sequence",
                           seed=1000 * k + d, sink=sink, kfac_sink=kfac,
                           accum_dtype=np.float32)
            print(f"fold {k} draw {d}: {time.perf_counter() - t0:.0f} s", flush=True)
        meta["seconds"][f"fold{k}"] = time.perf_counter() - t0
    name = "meta.json" if args.only_fold is None else f"meta-fold{args.only_fold}.json"
    (out / name).write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta["seconds"]))


def collect_part(args, lm, xp, seqs, labels, out):
    """K-FAC factors (local H_in, K-FAC H_out: one pass) of part ``args.part`` of
    ``args.parts`` consecutive slices of the calibration sequences, written to
    ``out/fold{f}/{layer}.p{part}.npz`` (``args.folds`` folds of consecutive parts)."""
    from bakron.hessian import global_factors, pad_batches

    parts = np.array_split(np.arange(len(seqs)), args.parts)
    idx = parts[args.part]
    fold = args.part * args.folds // args.parts
    fdir = out / f"fold{fold}"
    fdir.mkdir(exist_ok=True)
    t0, c0 = time.perf_counter(), time.process_time()
    batches, _ = pad_batches([seqs[i] for i in idx], batch_size=8, xp=xp)

    def sink(name, H_in, H_out):
        tmp = fdir / f"{name}.p{args.part}.tmp.npz"
        kin, kout = np.asarray(H_in, np.float32), np.asarray(H_out, np.float32)
        np.savez(tmp, kin=kin, kout=kout, **{"in": kin, "out": kout})
        os.replace(tmp, fdir / f"{name}.p{args.part}.npz")

    layers = None
    if args.blocks:
        keep = {int(b) for b in args.blocks.split(",")}
        layers = [n for n in lm.linear_names() if int(n.split(".")[1]) in keep]
    global_factors(lm.stages(labels), batches, refine_iters=0, seed=args.seed + args.part,
                   sink=sink, accum_dtype=np.float32, layers=layers)
    meta = {"part": args.part, "parts": args.parts, "folds": args.folds, "fold": fold,
            "labels": args.labels, "seed": args.seed + args.part, "load": os.getloadavg(),
            "seqs": idx.tolist(), "tokens": int(sum(len(seqs[i]) for i in idx)),
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
    (out / f"meta-part{args.part}.json").write_text(json.dumps(meta))
    print(json.dumps(meta))


# -- factors from the cache ---------------------------------------------------------------------

def _wait_load(f, wait):
    """The arrays of ``f``; with ``wait``, waits for a collection still writing it."""
    while True:
        try:
            if f.exists() and time.time() - f.stat().st_mtime > 5:
                with np.load(f) as z:
                    return {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError):
            pass
        if not wait:
            raise FileNotFoundError(f)
        time.sleep(10)


def fold_factors(root, name, wait=False):
    """``{fold: {"kin", "kout", "in", "out": float64 array}}`` (draws averaged); with
    ``wait``, waits for the collection to write them."""
    root = Path(root)
    out = {}
    meta = json.loads((root / "meta.json").read_text())
    for fdir in sorted(root.glob("fold*")):
        acc = {}
        if "parts" in meta:   # equal token counts per part: the mean of the parts
            files = [fdir / f"{name}.p{p}.npz" for p in meta["parts"][fdir.name]]
        else:
            files = [fdir / f"{name}.d{d}.npz" for d in range(meta.get("draws", 1))]
        for f in files:
            for k, v in _wait_load(f, wait).items():
                acc[k] = acc.get(k, 0) + v.astype(np.float64) / len(files)
        out[fdir.name] = acc
    return out


def full_factors(folds):
    """The whole calibration's factors: the mean of the folds (equal token counts)."""
    keys = next(iter(folds.values())).keys()
    return {k: sum(f[k] for f in folds.values()) / len(folds) for k in keys}


def grid_of(W, bits):
    from bakron.quantize_model import _fit_grid

    return _fit_grid(W, {"format": "float", "bits": bits, "group_size": 64, "sym": False})


def solve_variant(W, F, bits, v, tokens, tile=(16, 16)):
    """``W_hat`` (float32, in ``W``'s namespace: numpy, or cupy on a GPU) of one variant:
    ``v`` is a dict (``factors`` rtn|input|global|local_in, optional ``shrink``, ``damp_out``,
    ``kfac_out``, ``auto``, ``incoherence`` (a seed: both sides rotated before rounding,
    bakron.incoherence; the grid is fitted to the rotated W))."""
    from bakron import _xp
    from bakron.factors import auto_regularization
    from bakron.layer import quantize_layer

    xp = _xp.namespace(W)

    rot = None
    if v.get("incoherence") is not None:
        from bakron.incoherence import Incoherence

        rot = Incoherence(*W.shape, seed=v["incoherence"])
        W = rot.rotate_weight(W)
    q = grid_of(W, bits)
    kind = v["factors"]
    if kind == "rtn":
        vals = q.rtn(W)[0]
        return xp.astype(vals if rot is None else rot.unrotate_weight(vals), xp.float32)
    H_in = F["kin"] if kind in ("input", "local_in") else F["in"]
    H_out = None if kind == "input" else (F["kout"] if v.get("kfac_out") else F["out"])
    if rot is not None:
        H_in = rot.rotate_in(H_in)
        H_out = None if H_out is None else rot.rotate_out(H_out)
    kw = {}
    if H_out is not None:
        if v.get("auto"):
            kw["shrink_out"], kw["damp_out"] = auto_regularization(H_out.shape[0], tokens)
            kw["shrink_out"] = min(1.0, kw["shrink_out"] * v.get("c", 1.0))
        else:
            kw["shrink_out"] = v.get("shrink", 0.0)
            kw["damp_out"] = v.get("damp_out", 0.01)
    r = quantize_layer(W, H_in, H_out, quantizer=q, tile=tile, damp=0.01, metrics="none", **kw)
    return xp.astype(r.values if rot is None else rot.unrotate_weight(r.values), xp.float32)


VARIANTS = {
    "rtn": {"factors": "rtn"},
    "ldlq": {"factors": "input"},
    "global": {"factors": "global"},
    "global-kfac": {"factors": "global", "kfac_out": True},
    "local_in": {"factors": "local_in"},
    **{f"global-s{a}": {"factors": "global", "shrink": a / 100} for a in (25, 50, 75, 90)},
    **{f"global-d{d}": {"factors": "global", "damp_out": d / 100} for d in (10, 30, 100)},
    "global-auto": {"factors": "global", "auto": True},
    **{f"global-auto-c{c}": {"factors": "global", "auto": True, "c": c / 100}
       for c in (25, 50, 200)},
    "local_in-auto": {"factors": "local_in", "auto": True},
    **{f"{k}-inc": {**v, "incoherence": 0} for k, v in (
        ("rtn", {"factors": "rtn"}), ("ldlq", {"factors": "input"}),
        ("global", {"factors": "global"}), ("global-auto", {"factors": "global", "auto": True}))},
}


def run(args):
    from bakron.models.llm.evaluation import _Reference, evaluation_texts

    xp, lm = _load()
    meta = json.loads((Path(args.factors) / "meta.json").read_text())
    tokens = meta["tokens"]
    names = list(lm.linear_names())
    if args.blocks:
        keep = {int(b) for b in args.blocks.split(",")}
        names = [n for n in names if int(n.split(".")[1]) in keep]
    t0 = time.perf_counter()
    texts = evaluation_texts(lm)
    ref = _Reference(lm, texts, 8)
    t_ref = time.perf_counter() - t0
    W_hat = {(v, b): {} for v in args.variants for b in args.bits}
    secs = {(v, b): 0.0 for v in args.variants for b in args.bits}
    t0 = time.perf_counter()
    for i, name in enumerate(names):
        W = np.asarray(lm.linear_weight(name), np.float32)
        F = full_factors(fold_factors(args.factors, name, wait=True))
        for v in args.variants:
            for b in args.bits:
                t = time.process_time()
                W_hat[(v, b)][name] = solve_variant(W, F, b, VARIANTS[v], tokens)
                secs[(v, b)] += time.process_time() - t
        if i % 21 == 0:
            print(f"{i}/{len(names)} layers, {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for (v, b), weights in W_hat.items():
        t = time.perf_counter()
        figs = ref.score(lm.with_weights(weights))
        row = {"variant": v, "bits": b, "solve_cpu": secs[(v, b)], "solve_seconds": secs[(v, b)],
               "eval_seconds": time.perf_counter() - t, "tokens": tokens,
               "factors": str(args.factors), "layers": len(names),
               **{f"{k}_{m}": figs[k][m] for k in figs for m in ("kl", "kl_text_sem",
                                                                  "perplexity")},
               **{f"{k}_per_text": figs[k]["kl_per_text"] for k in figs}}
        rows.append(row)
        print(f"{b} bits {v:18s} " + "  ".join(
            f"{k} {figs[k]['kl']:.4f} ± {figs[k]['kl_text_sem']:.4f}" for k in figs)
              + f"  (solve {secs[(v, b)]:.0f} s)", flush=True)
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + rows, indent=1))
    print(f"reference {t_ref:.0f} s; load {os.getloadavg()}")


# -- held-out-fold choice of the regularisation --------------------------------------------------

def proxy(E, H_in, H_out):
    return float(np.einsum("ij,ij->", H_out @ E, E @ H_in))


def cv(args):
    """Score each candidate regularisation of H_out by the held-out fold's proxy
    tr(E H_in^test Eᵀ H_out^test) of the solution from the other fold's factors."""
    from bakron.layer import quantize_layer

    xp, lm = _load()
    meta = json.loads((Path(args.factors) / "meta.json").read_text())
    fold_tokens = meta["tokens"] // len(list(Path(args.factors).glob("fold*")))
    names = [n for n in lm.linear_names() if int(n.split(".")[1]) in
             {int(b) for b in args.blocks.split(",")}]
    cands = [("ldlq", None, None)] + [(f"s{a}", a, None) for a in args.shrinks] + \
            [(f"d{d}", 0.0, d) for d in args.damps]
    rows = []
    t0 = time.perf_counter()
    for name in names:
        W = np.asarray(lm.linear_weight(name), np.float32)
        folds = fold_factors(args.factors, name, wait=True)
        keys = sorted(folds)
        for b in args.bits:
            q = grid_of(W, b)
            for tr in keys:
                te = [k for k in keys if k != tr]
                Ftr = folds[tr]
                Fte = full_factors({k: folds[k] for k in te})
                for label, a, d in cands:
                    if label == "ldlq":
                        r = quantize_layer(W, Ftr["kin"], None, quantizer=q, metrics="none")
                    else:
                        r = quantize_layer(W, Ftr["in"], Ftr["out"], quantizer=q,
                                           metrics="none", shrink_out=a / 100,
                                           damp_out=0.01 if d is None else d / 100)
                    E = np.asarray(r.values, np.float64) - W
                    rows.append({"layer": name, "kind": name.rsplit(".", 1)[1],
                                 "m": W.shape[0], "n": W.shape[1], "bits": b, "train": tr,
                                 "cand": label, "tokens": fold_tokens,
                                 "test_proxy": proxy(E, Fte["in"], Fte["out"]),
                                 "train_proxy": proxy(E, Ftr["in"], Ftr["out"])})
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    Path(args.out).write_text(json.dumps(rows))
    summarize_cv(rows)
    summarize_kinds(rows)


def summarize_cv(rows, cs=(0.25, 0.5, 1, 2, 4, 8)):
    """Per layer kind, the held-out proxy of each candidate relative to LDLQ's; then, for the
    rule shrink = min(1, c m / tokens) (the nearest shrinkage candidate), the geometric mean
    over all layers of the held-out proxy relative to LDLQ's, for each c."""
    import collections

    grid = sorted({int(r["cand"][1:]) for r in rows if r["cand"].startswith("s")})
    per = collections.defaultdict(dict)
    for r in rows:
        per[(r["layer"], r["bits"], r["train"])][r["cand"]] = r
    for b in sorted({r["bits"] for r in rows}):
        print(f"\n{b} bits: rule shrink = min(1, c * width / fold tokens)")
        for c in cs:
            logs = []
            for (layer, bb, tr), d in per.items():
                if bb != b:
                    continue
                any_r = next(iter(d.values()))
                a = min(1.0, c * any_r["m"] / any_r["tokens"]) * 100
                pick = min(grid, key=lambda g: abs(g - a))
                logs.append(np.log(d[f"s{pick}"]["test_proxy"] / d["ldlq"]["test_proxy"]))
            print(f"  c = {c:5}: held-out proxy / LDLQ's = {np.exp(np.mean(logs)):.3f} "
                  f"(geometric mean over {len(logs)} layer-folds)")


def summarize_kinds(rows):
    import collections

    by = collections.defaultdict(dict)
    for r in rows:
        by[(r["layer"], r["bits"], r["train"])][r["cand"]] = r["test_proxy"]
    agg = collections.defaultdict(list)
    for (layer, b, tr), d in by.items():
        kind = layer.rsplit(".", 1)[1]
        for c, v in d.items():
            agg[(kind, b, c)].append(v / d["ldlq"])
    cands = list(dict.fromkeys(r["cand"] for r in rows))
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    for b in sorted({r["bits"] for r in rows}):
        print(f"\n{b} bits: held-out proxy / LDLQ's (geometric mean over layers and folds)")
        print("kind        " + " ".join(f"{c:>7s}" for c in cands))
        for k in kinds:
            print(f"{k:11s} " + " ".join(
                f"{np.exp(np.mean(np.log(agg[(k, b, c)]))):7.3f}" for c in cands))


def table(args):
    """The markdown table of the result rows (docs/llm.md, "Ablation")."""
    rows = []
    for f in args.results:
        rows += json.loads(Path(f).read_text())
    ref = {(r["bits"]): r for r in rows if r["variant"] == "ldlq"}
    print("| bits | method | Lee news KL ± s.e. | ÷ LDLQ | held-out docs KL ± s.e. | ÷ LDLQ "
          "| solve CPU (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["bits"], r["variant"], r["factors"])):
        cells = []
        for k in ("lee", "docs"):
            if f"{k}_kl" not in r:
                cells += ["", ""]
                continue
            cells.append(f"{r[f'{k}_kl']:.3f} ± {r[f'{k}_kl_text_sem']:.3f}")
            base = ref.get(r["bits"])
            cells.append(f"{r[f'{k}_kl'] / base[f'{k}_kl']:.2f}" if base else "")
        method = r["variant"] if len({q["factors"] for q in rows}) == 1 else \
            f"{r['variant']} ({Path(r['factors']).name})"
        print(f"| {r['bits']} | {method} | " + " | ".join(cells)
              + f" | {r.get('solve_cpu', r['solve_seconds']):.0f} |")


def _labels_arg(spec):
    from bakron.hessian.transformer import parse_labels

    try:
        parse_labels(spec, 2 ** 31)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


# -- variance of H_out per label estimator ---------------------------------------------------

def _unit(H):
    """``H`` scaled to mean diagonal 1 (the solver's normalisation)."""
    return H / np.mean(np.diag(H))


def variance(args):
    """Per estimator and layer: the disagreement of the two folds' H_out (relative Frobenius
    after normalising each to mean diagonal 1), and the held-out proxy relative to LDLQ's of
    the two-sided solution from one fold's factors (no shrinkage, and the rule), scored on the
    other fold with the reference estimator's factors (calibration data only)."""
    from bakron.factors import auto_regularization
    from bakron.layer import quantize_layer

    xp, lm = _load()
    ref = Path(args.ref)
    rows = []
    for est in args.factors:
        meta = json.loads((Path(est) / "meta.json").read_text())
        parts = [json.loads((Path(est) / f"meta-part{p}.json").read_text())
                 for p in sorted(i for v in meta["parts"].values() for i in v)]
        fold_tokens = meta["tokens"] // 2
        names = sorted({f.name.split(".p")[0] for f in (Path(est) / "fold0").glob("*.npz")},
                       key=lambda n: lm.linear_names().index(n))
        if args.blocks:
            keep = {int(b) for b in args.blocks.split(",")}
            names = [n for n in names if int(n.split(".")[1]) in keep]
        for name in names:
            W = np.asarray(lm.linear_weight(name), np.float32)
            F = fold_factors(est, name)
            R = fold_factors(ref, name)
            a, b = _unit(F["fold0"]["kout"]), _unit(F["fold1"]["kout"])
            row = {"estimator": Path(est).name, "layer": name, "m": W.shape[0],
                   "rel_frob": float(np.linalg.norm(a - b) / np.linalg.norm((a + b) / 2)),
                   "pass_seconds": float(np.mean([p["seconds"] for p in parts])),
                   "pass_cpu_seconds": float(np.mean([p["cpu_seconds"] for p in parts]))}
            for bits in args.bits:
                q = grid_of(W, bits)
                for tr, te in (("fold0", "fold1"), ("fold1", "fold0")):
                    Hi_te, Ho_te = R[te]["kin"], R[te]["kout"]
                    E0 = np.asarray(quantize_layer(W, F[tr]["kin"], None, quantizer=q,
                                                   metrics="none").values, np.float64) - W
                    base = proxy(E0, Hi_te, Ho_te)
                    H_out = F[tr]["kout"]
                    for cand, kw in (("raw", {"shrink_out": 0.0, "damp_out": 0.01}),
                                     ("rule", dict(zip(("shrink_out", "damp_out"),
                                                       auto_regularization(W.shape[0],
                                                                           fold_tokens))))):
                        E = np.asarray(quantize_layer(W, F[tr]["kin"], H_out, quantizer=q,
                                                      metrics="none", **kw).values,
                                       np.float64) - W
                        row.setdefault(f"proxy_{cand}_{bits}", []).append(
                            proxy(E, Hi_te, Ho_te) / base)
            for k in list(row):
                if k.startswith("proxy_"):
                    row[k] = float(np.exp(np.mean(np.log(row[k]))))
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    variance_table(rows)


def variance_table(rows):
    """Per estimator and layer kind: the mean fold disagreement of H_out and the geometric
    means of the held-out proxy ÷ LDLQ's (raw factor / the rule) over the layers; then all
    layers."""
    import collections

    bits = sorted({int(k.rsplit("_", 1)[1]) for r in rows for k in r if k.startswith("proxy_")})
    groups = collections.defaultdict(list)
    for r in rows:
        groups[(r["estimator"], r["layer"].rsplit(".", 1)[1])].append(r)
        groups[(r["estimator"], "all layers")].append(r)
    print("| estimator | layers | fold disagreement of H_out | "
          + " | ".join(f"held-out proxy ÷ LDLQ's, {b} bits: raw / rule" for b in bits)
          + " | seconds per pass of 2048 tokens, wall (CPU) |")
    print("|---" * (4 + len(bits)) + "|")
    gm = (lambda v: float(np.exp(np.mean(np.log(v)))))
    for (est, kind), rs in sorted(groups.items(), key=lambda kv: kv[0][1] == "all layers"):
        print(f"| {est} | {kind} ({len(rs)}) | {np.mean([r['rel_frob'] for r in rs]):.2f} | "
              + " | ".join(f"{gm([r[f'proxy_raw_{b}'] for r in rs]):.2f} / "
                           f"{gm([r[f'proxy_rule_{b}'] for r in rs]):.2f}" for b in bits)
              + f" | {rs[0]['pass_seconds']:.0f} ({rs[0]['pass_cpu_seconds']:.0f}) |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    c.add_argument("--labels", type=_labels_arg, default="sample",
                   help="label estimator of H_out: sample, sample:K, fisher:K or true")
    c.add_argument("--seed", type=int, default=0, help="label seed of part 0 (part p: "
                   "seed + p)")
    c.add_argument("--blocks", default=None, help="collect only these blocks' layers "
                   "(comma-separated; with --part)")
    c.add_argument("--draws", type=int, default=1)
    c.add_argument("--seqs", type=int, default=32)
    c.add_argument("--seq-len", type=int, default=128)
    c.add_argument("--folds", type=int, default=2)
    c.add_argument("--part", type=int, default=None, help="K-FAC factors of this part alone")
    c.add_argument("--parts", type=int, default=8)
    c.add_argument("--only-fold", type=int, default=None, help="collect this fold alone (folds "
                   "run as separate processes)")
    r = sub.add_parser("run")
    r.add_argument("--factors", required=True)
    r.add_argument("--variants", nargs="+", choices=list(VARIANTS), required=True)
    r.add_argument("--bits", nargs="+", type=int, default=[3, 4])
    r.add_argument("--blocks", default=None, help="comma-separated blocks (default all)")
    r.add_argument("--out", required=True, help="JSON list of result rows (appended)")
    v = sub.add_parser("cv")
    v.add_argument("--factors", required=True)
    v.add_argument("--blocks", default="0,5,10,15,20,25,29")
    v.add_argument("--bits", nargs="+", type=int, default=[3])
    v.add_argument("--shrinks", nargs="+", type=int, default=[0, 25, 50, 75, 90])
    v.add_argument("--damps", nargs="*", type=int, default=[100])
    v.add_argument("--out", required=True)
    vs = sub.add_parser("variance-summary")
    vs.add_argument("results", nargs="+")
    s = sub.add_parser("cv-summary")
    s.add_argument("results", nargs="+")
    va = sub.add_parser("variance")
    va.add_argument("--factors", nargs="+", required=True, help="one collection per estimator")
    va.add_argument("--ref", required=True, help="the collection whose held-out fold scores")
    va.add_argument("--bits", nargs="+", type=int, default=[3])
    va.add_argument("--blocks", default=None, help="comma-separated blocks (default all)")
    va.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("results", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "variance-summary":
        variance_table([r for f in args.results for r in json.loads(Path(f).read_text())])
        return
    if args.cmd == "cv-summary":
        rows = [r for f in args.results for r in json.loads(Path(f).read_text())]
        summarize_cv(rows)
        summarize_kinds(rows)
        return
    {"collect": collect, "run": run, "cv": cv, "table": table,
     "variance": variance}[args.cmd](args)


if __name__ == "__main__":
    main()
