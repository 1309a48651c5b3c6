"""Two-sided against one-sided through ``bakron quantize-model`` itself (issue: the whole model).

Every run is one call of :func:`bakron.quantize_model.quantize_model` — the function behind
``bakron quantize-model smollm2 --format float --asym --group-size 64`` — with one setting
of calibration text and size, ``--factors``, ``--labels``, ``--incoherence`` and the
shrinkage of ``H_out`` (``--shrink-out``; ``auto`` is the command's rule); all 210
linear layers are rounded. The quantized weights are scored against the original model on

* ``lee``: the first 16 Lee news documents (64 tokens each; another domain),
* ``docs``: 24 held-out sentences of the Language Reference (topics never used for
  calibration),
* ``gen``: text sampled from the model with another seed than any calibration text
  (``--heldout-seed``; 24 sequences of 128 tokens) — the calibration distribution, never an
  evaluation text, so the setting chosen by it is chosen on calibration data only,
* ``caldocs``: 18 sequences of 128 tokens of the Language Reference's calibration topics
  that no calibration of up to 128 sequences uses (calibration-side text too; the held-out
  source of ``--calib generated`` runs in ``shift``),

with the KL of every text kept, so that the ratio of two methods' mean KLs has a paired
standard error (:func:`ratio`). Rows are appended to ``--out`` as they finish.

    python scripts/qm_ablation.py run --out runs.json --device gpu \
        --calib generated+docs --seqs 128 --factors input global --bits 3 4
    python scripts/qm_ablation.py table runs.json
    python scripts/qm_ablation.py pool runs.json     # rotation seeds pooled per setting
    python scripts/qm_ablation.py shift runs.json    # calibrated on one source, scored on the other
    python scripts/qm_ablation.py score --weights w --text FILE --out more.json   # saved runs
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TEXTS = ("lee", "docs", "gen")


def say(*a):
    print(*a, file=sys.stderr, flush=True)


def _append(path, row):
    from bakron._lib.fs import append_json_row

    append_json_row(path, row)


def _reference(lm, heldout_seed, n_gen=24, seq_len=128, files=()):
    from bakron.models.llm.calibration import calibration_ids
    from bakron.models.llm.evaluation import _Reference, evaluation_texts, file_texts

    texts = evaluation_texts(lm)
    texts.update(file_texts(lm, files))   # (--text: evaluation texts, windows of 64 tokens)
    gen = calibration_ids(lm, n_gen * seq_len, mix="generated", seq_len=seq_len,
                          seed=heldout_seed)
    texts["gen"] = (gen, f"{n_gen} sequences sampled from the model, seed {heldout_seed}")
    texts["caldocs"] = (_caldocs(lm, seq_len), "the Language Reference's calibration topics, "
                        "sequences no calibration of up to 128 sequences uses")
    return _Reference(lm, texts, 16)


def _caldocs(lm, seq_len, skip=128):
    """The calibration topics' sequences after the first ``skip`` (those ``--calib builtin``
    and ``generated+docs`` draw from): calibration-side text, held out from every run of up to
    ``skip`` sequences. With ``--calib generated`` it is another source than the fit's, the
    calibration-only stand-in for text of another domain (``shift`` below)."""
    from bakron.models.llm.calibration import calibration_sequences
    from bakron.quantize_model import _builtin_split

    seqs = calibration_sequences(lm, _builtin_split()[0], 10**6, seq_len)[skip:]
    return [s for s in seqs if len(s) == seq_len]


def run(args):
    import bakron.factors
    from bakron.io import array_namespace as namespace
    from bakron.models import load_llm
    from bakron.quantize_model import quantize_model

    xp, _ = namespace(args.device)
    lm = load_llm("smollm2", xp=xp)
    ref = _reference(lm, args.heldout_seed, files=args.text)
    if args.generated_share is not None:   # (quantize_model asks calibration_ids for the mix)
        import functools

        import bakron.models.llm.calibration as cal

        cal.calibration_ids = functools.partial(cal.calibration_ids,
                                                generated_share=args.generated_share)
    deadline = time.perf_counter() + args.deadline
    seeds = [(0 if args.format == "float" else -1) if v == "auto" else int(v)
             for v in args.incoherence]
    grid = itertools.product(args.calib, args.seqs, args.bits, seeds, args.factors,
                             args.labels, args.shrink_out, args.damp_out,
                             args.refine, args.tile)
    seen = set()
    if args.auto_c is not None:   # the auto rule's damping (as chosen in docs/hessian.md)
        bakron.factors.AUTO_DAMP_OUT = bakron.factors.AUTO_DAMP_OUT_ROTATED = args.auto_c

    if args.auto_wide is not None:   # another damping for the wide factors (ffn_gate/up)
        rule = bakron.factors.auto_regularization

        def wide_rule(width, tokens, **kw):   # (rotated=, estimator=: as the rule's)
            shrink, damp = rule(width, tokens, **kw)
            return (shrink, args.auto_wide) if width >= args.wide else (shrink, damp)
        bakron.factors.auto_regularization = wide_rule

    def auto_damp(rotated):
        d = bakron.factors.auto_regularization(1, 1, rotated=rotated,
                                               estimator=args.out_estimator)[1]
        return f"{d:g}" + ("" if args.auto_wide is None
                           else f", {args.auto_wide:g} for m >= {args.wide}")
    for calib, seqs, bits, inc, factors, labels, shrink, damp_out, refine, tile in grid:
        if factors in ("rtn", "input"):   # (ignored there: no H_out)
            labels, shrink, damp_out, refine = "sample", "auto", 0.01, 0
        if shrink == "auto":
            damp_out = 0.01
        key = (calib, seqs, bits, inc, factors, labels, shrink, damp_out, refine, tile)
        out_reg = ({} if shrink == "auto" else
                   {"damp_out": damp_out, "shrink_out": float(shrink)})
        if key in seen:
            continue
        seen.add(key)
        if time.perf_counter() > deadline:
            say(f"deadline: skipping {key}")
            continue
        work = Path(tempfile.mkdtemp(prefix="qm-"))
        t0 = time.perf_counter()
        try:
            fixed = ({"bits": bits, "group_size": 64, "sym": False} if args.format == "float"
                    else {})   # (the GGUF formats fix their grid)
            res = quantize_model("smollm2", work / "out", fmt=args.format, factors=factors,
                                 calib=calib, **fixed,
                                 calib_seqs=seqs, device=args.device, labels=labels,
                                 incoherence=None if inc < 0 else inc, keep_weights=True,
                                 refine_iters=refine, tile=(tile, tile), damp=args.damp,
                                 out_estimator=args.out_estimator,
                                 in_estimator=args.in_estimator,
                                 progress=False, **out_reg)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        wall = time.perf_counter() - t0
        weights = {n: xp.asarray(w) for n, w in res["weights"].items()}
        figs = ref.score(lm.with_weights(weights))
        row = {"format": args.format, "calib": calib, "seqs": seqs,
               "tokens": res["calibration"]["tokens"],
               "bits": bits, "incoherence": inc, "factors": factors, "labels": labels,
               "shrink_out": shrink, "damp_out": damp_out, "refine": refine, "tile": tile,
               "damp": args.damp, "out_estimator": args.out_estimator,
               **({} if args.in_estimator == "mean" else {"in_estimator": args.in_estimator}),
               **({} if args.generated_share is None
                  else {"generated_share": args.generated_share}),
               "rule": (f"damp {auto_damp(inc >= 0)}" + ("" if args.out_estimator == "mean"
                                                          else f", {args.out_estimator} H_out")
                        if shrink == "auto" and factors not in ("rtn", "input") else None),
               "wall": wall, "seconds": res["seconds"], "device": res["device"],
               **({"host": args.host} if args.host else {}),
               **{f"{k}_{m}": figs[k][m] for k in figs
                  for m in ("kl", "kl_text_sem", "kl_per_text", "perplexity")}}
        say(f"{calib} {seqs}x128 {bits}b inc={inc} {factors} {labels} shrink={shrink} "
            f"damp_out={damp_out} refine={refine} tile={tile}: "
            + "  ".join(
            f"{k} {figs[k]['kl']:.4f}±{figs[k]['kl_text_sem']:.4f}" for k in figs)
            + f"  ({wall:.0f} s)")
        _append(args.out, row)
        if args.save_weights:   # for ``compose``: the rounded weights of this run
            from bakron._lib.fs import atomic_path, atomic_write_json

            d = Path(args.save_weights)
            d.mkdir(parents=True, exist_ok=True)
            stem = _weights_stem(calib, seqs, bits, inc, factors)
            with atomic_path(d / f"{stem}.npz") as tmp, open(tmp, "wb") as fh:
                np.savez(fh, **{n: np.asarray(w) for n, w in res["weights"].items()})
            atomic_write_json(d / f"{stem}.json", row)


def _weights_stem(calib, seqs, bits, inc, factors):
    return f"{factors}-{calib}-{seqs}x-{bits}b-inc{inc}"


def compose(args):
    """Models made of two runs' layers: ``--factors global``'s rounded weights for some layer
    kinds and ``--factors input``'s for the others (each layer is rounded on its own from
    factors of the original model, so such a model is what a per-kind choice of the method
    would give). For every pair of runs of the same calibration, width and rotations saved by
    ``run --save-weights``: all input, all global, each kind alone global, and all but each
    kind global; one row each, scored like ``run``'s."""
    from bakron.io import array_namespace as namespace
    from bakron.models import load_llm
    from bakron.models.llm.config import LINEAR_KINDS

    xp, _ = namespace(args.device)
    lm = load_llm("smollm2", xp=xp)
    ref = _reference(lm, args.heldout_seed)
    d = Path(args.weights)
    for meta in sorted(d.glob("global-*.json")):
        two = json.loads(meta.read_text())
        stem = meta.stem.removeprefix("global-")
        if not (d / f"input-{stem}.npz").exists():
            say(f"{meta.name}: no input run saved beside it; skipped")
            continue
        W = {f: dict(np.load(d / f"{f}-{stem}.npz")) for f in ("input", "global")}
        sets = [(), LINEAR_KINDS]
        if args.sets in ("both", "alone"):
            sets += [(k,) for k in LINEAR_KINDS]
        if args.sets in ("both", "but"):
            sets += [tuple(j for j in LINEAR_KINDS if j != k) for k in LINEAR_KINDS]
        for kinds in sets:
            weights = {n: xp.asarray(W["global" if n.split(".")[-1] in kinds else "input"][n])
                       for n in W["input"]}
            figs = ref.score(lm.with_weights(weights))
            row = {k: two[k] for k in ("format", "calib", "seqs", "tokens", "bits",
                                       "incoherence", "labels", "shrink_out", "damp_out",
                                       "refine", "tile", "damp", "out_estimator", "rule")}
            row.update({"global_kinds": list(kinds), "device": args.device,
                        **({"host": args.host} if args.host else {}),
                        **{f"{k}_{m}": figs[k][m] for k in figs
                           for m in ("kl", "kl_text_sem", "kl_per_text")}})
            say(f"{stem} global for {','.join(kinds) or 'none'}: " + "  ".join(
                f"{k} {figs[k]['kl']:.4f}" for k in figs))
            _append(args.out, row)


def score(args):
    """The runs saved by ``run --save-weights`` scored afterwards on text files (windows of 64
    tokens, as ``run --text``): each run's row again, with the files' figures added."""
    from bakron.io import array_namespace as namespace
    from bakron.models import load_llm
    from bakron.models.llm.evaluation import _Reference, file_texts

    xp, _ = namespace(args.device)
    lm = load_llm("smollm2", xp=xp)
    ref = _Reference(lm, file_texts(lm, args.text), 16)
    for d in map(Path, args.weights):
        for meta in sorted(d.glob("*.json")):
            if not meta.with_suffix(".npz").exists():
                continue
            row = json.loads(meta.read_text())
            W = dict(np.load(meta.with_suffix(".npz")))
            figs = ref.score(lm.with_weights({n: xp.asarray(w) for n, w in W.items()}))
            row.update({f"{k}_{m}": figs[k][m] for k in figs
                        for m in ("kl", "kl_text_sem", "kl_per_text")})
            say(f"{meta.stem}: " + "  ".join(f"{k} {figs[k]['kl']:.4f}" for k in figs))
            _append(args.out, row)


def compose_table(args):
    """Per composition, the rotation seeds of each width pooled: the ratio of its mean KLs to
    all input's on every text and to all global's on ``gen`` (paired by seed and text), ±
    its standard error."""
    from bakron.models.llm.config import LINEAR_KINDS

    rows = []
    for f in args.results:
        rows += json.loads(Path(f).read_text())
    by = {}
    for r in rows:
        by.setdefault((r["bits"], r["incoherence"], r.get("host")), {})[
            tuple(r["global_kinds"])] = r
    every = tuple(LINEAR_KINDS)
    print("| bits | two-sided for | seeds | " + " | ".join(f"{t} ÷ input" for t in TEXTS)
          + " | gen ÷ all two-sided |")
    print("|---" * (4 + len(TEXTS)) + "|")
    for bits in sorted({k[0] for k in by}):
        runs = [v for k, v in sorted(by.items()) if k[0] == bits and () in v and every in v]
        for kinds in [every] + [(k,) for k in LINEAR_KINDS] + [
                tuple(j for j in LINEAR_KINDS if j != k) for k in LINEAR_KINDS]:
            have = [v for v in runs if kinds in v]
            if not have:
                continue
            cells = []
            for t, base in [(t, ()) for t in TEXTS] + [("gen", every)]:
                a = [x for v in have for x in v[kinds][f"{t}_kl_per_text"]]
                b = [x for v in have for x in v[base][f"{t}_kl_per_text"]]
                q, se = ratio(a, b)
                cells.append("—" if kinds == base else f"{q:.2f} ± {se:.2f}")
            name = ("every kind" if kinds == every else f"`{kinds[0]}` alone"
                    if len(kinds) == 1 else "all but `"
                    + next(k for k in LINEAR_KINDS if k not in kinds) + "`")
            seeds = ", ".join(str(v[kinds]["incoherence"]) for v in have)
            print(f"| {bits} | {name} | {seeds} | " + " | ".join(cells) + " |")


def ratio(a, b):
    """Ratio of mean KLs over the same texts and its delta-method standard error (paired)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    r = a.mean() / b.mean()
    d = (a - r * b) / b.mean()
    return r, float(d.std(ddof=1) / math.sqrt(d.size))


def _rows(paths):
    """The rows of the result files, with the defaults of rows from before an option."""
    rows = []
    for f in paths:
        rows += json.loads(Path(f).read_text())
    for r in rows:
        r.setdefault("format", "float")
        r.setdefault("shrink_out", "auto")
        r.setdefault("damp_out", 0.01)
        r.setdefault("refine", 1)   # (rows from before the option: one step)
        r.setdefault("rule", None)
        r.setdefault("tile", 16)   # (rows from before the option: the command's tiles)
        r.setdefault("damp", 0.01)   # (rows from before the option: the command's damping)
        r.setdefault("out_estimator", "mean")
        r.setdefault("in_estimator", "mean")   # (rows from before the option: the command's)
    return rows


def input_factor(r):
    """The ``H_in`` setting of a row: its damping and, if not the mean, its estimator."""
    return f"damp {r['damp']:g}" + ("" if r["in_estimator"] == "mean"
                                    else f", {r['in_estimator']}")


def regularisation(r):
    """The ``H_out`` column of a row: ``auto: <rule>`` or the numbers given."""
    if r["factors"] in ("rtn", "input"):   # no H_out
        return "—"
    if r["shrink_out"] == "auto":   # --damp-out auto (rows without "rule": the earlier one)
        return "auto: " + (r["rule"] or "shrink m/N")
    return (f"damp {r['damp_out']:g}" + (f", shrink {r['shrink_out']}"
                                         if float(r["shrink_out"]) else "")
            + ("" if r["out_estimator"] == "mean" else f", {r['out_estimator']} H_out"))


#: the cross-source folds of ``shift``: a run calibrated on one source, scored on the other
SHIFT_FOLDS = (("generated", "caldocs"), ("builtin", "gen"))


def shift(args):
    """The calibration-only stand-in for text of another domain: runs calibrated on one
    source alone (``--calib generated``: text sampled from the model; ``--calib builtin``: the
    Language Reference's calibration topics), scored on the other (``caldocs``, sequences of
    the calibration topics no run uses; ``gen``, sampled with another seed). One line per
    ``H_out`` setting and width: each fold's ratio of the mean KLs to ``--factors input`` of
    the same seed and host, the seeds pooled, ± its paired standard error (and the single
    seeds' ratios); the geometric mean of the two folds; and the same-source ratios
    (``generated`` on ``gen``, ``builtin`` on ``caldocs``) beside them."""
    rows = [r for r in _rows(args.results) if r["calib"] in dict(SHIFT_FOLDS)
            and "caldocs_kl_per_text" in r]
    one = {(r["calib"], r["bits"], r["incoherence"], r.get("host")): r for r in rows
           if r["factors"] == "input"}
    groups = {}
    for r in rows:
        if r["factors"] == "global" and (r["calib"], r["bits"], r["incoherence"],
                                         r.get("host")) in one:
            groups.setdefault((regularisation(r), r["bits"]), {}).setdefault(
                r["calib"], []).append(r)

    def cell(runs, text):
        runs = sorted(runs, key=lambda r: r["incoherence"])
        base = [one[(r["calib"], r["bits"], r["incoherence"], r.get("host"))] for r in runs]
        a = [x for r in runs for x in r[f"{text}_kl_per_text"]]
        b = [x for q in base for x in q[f"{text}_kl_per_text"]]
        each = [ratio(r[f"{text}_kl_per_text"], q[f"{text}_kl_per_text"])[0]
                for r, q in zip(runs, base)]
        return ratio(a, b), each, [r["incoherence"] for r in runs]

    print("| `H_O` | bits | seeds | generated → caldocs ÷ input ± s.e. (per seed) "
          "| builtin → gen ÷ input ± s.e. (per seed) | geometric mean "
          "| same source: generated → gen | builtin → caldocs |")
    print("|---" * 8 + "|")
    for (label, bits), by in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if set(by) != set(dict(SHIFT_FOLDS)):
            continue
        cells, logs, same = [], [], []
        for calib, text in SHIFT_FOLDS:
            (r, se), each, seeds = cell(by[calib], text)
            cells.append(f"{r:.3f} ± {se:.3f} ({' / '.join(f'{e:.2f}' for e in each)})")
            logs.append(math.log(r))
            other = "gen" if text == "caldocs" else "caldocs"
            (r2, se2), _, _ = cell(by[calib], other)
            same.append(f"{r2:.3f} ± {se2:.3f}")
        print(f"| {label} | {bits} | {', '.join(map(str, seeds))} | " + " | ".join(cells)
              + f" | {math.exp(sum(logs) / len(logs)):.3f} | " + " | ".join(same) + " |")


def pool(args):
    """One line per setting with rotations: the rotation seeds pooled. Each text's ratio is
    that of the mean KLs over every (seed, text) pair, paired with ``--factors input`` of
    the same seed on the same machine (``host``; a run without its pair is left out), with
    its delta-method standard error (with ``--seed-se`` over the seeds' mean KLs instead: what a
    run with another rotation seed may give); the range is that of the single seeds' ratios; the
    KLs are the seeds' means. Settings are those of :func:`run` but the
    seed (``--factors global`` with one label draw, K-FAC; ``--rule`` keeps one ``H_out``
    column, e.g. ``"damp 3"`` for ``auto: damp 3`` or ``"damp 0.1, crossfit H_out"``)."""
    rows = [r for r in _rows(args.results) if r["incoherence"] >= 0
            and (args.calib is None or r["calib"] == args.calib)]
    key = (lambda r: (r["format"], r["calib"], r["tokens"], r["bits"], r["tile"],
                      input_factor(r)))
    two = {}
    one = {(key(r), r["incoherence"], r.get("host")): r for r in rows
           if r["factors"] == "input"}
    for r in rows:
        if (r["factors"] == "global" and r["labels"] == "sample" and r["refine"] == 0
                and (key(r), r["incoherence"], r.get("host")) in one):
            label = regularisation(r)
            if args.rule is None or args.rule in (label, label.removeprefix("auto: ")):
                two.setdefault((key(r), label), []).append(r)
    # (the texts every run was scored on: runs without the network have no lee; files of
    # run --text or score after the built-in ones)
    runs_all = [q for (k, _), runs in two.items() for r in runs
                for q in (r, one[(k, r["incoherence"], r.get("host"))])]
    common = set.intersection(*[{k.removesuffix("_kl_per_text") for k in r
                                 if k.endswith("_kl_per_text")} for r in runs_all] or [set()])
    texts = [t for t in TEXTS + ("caldocs",) if t in common] + sorted(
        common - set(TEXTS) - {"caldocs"})
    print("| calibration | tokens | bits | tile | H_out | seeds | "
          + " | ".join(f"{k} KL, input / global | ÷ input ± s.e. (range)" for k in texts)
          + " |")
    print("|---" * (6 + 2 * len(texts)) + "|")
    for (k, rule), runs in sorted(two.items()):
        runs = sorted(runs, key=lambda r: r["incoherence"])
        base = [one[(k, r["incoherence"], r.get("host"))] for r in runs]
        cells = []
        for t in texts:
            a = [x for r in runs for x in r[f"{t}_kl_per_text"]]
            b = [x for q in base for x in q[f"{t}_kl_per_text"]]
            q, se = ratio(a, b)
            each = [ratio(r[f"{t}_kl_per_text"], q_[f"{t}_kl_per_text"])[0]
                    for r, q_ in zip(runs, base)]
            if args.seed_se and len(runs) > 1:   # the seeds as the unit: their mean KLs
                se = ratio([np.mean(r[f"{t}_kl_per_text"]) for r in runs],
                           [np.mean(q_[f"{t}_kl_per_text"]) for q_ in base])[1]
            cells += [f"{np.mean([q_[f'{t}_kl'] for q_ in base]):.3f} / "
                      f"{np.mean([r[f'{t}_kl'] for r in runs]):.3f}",
                      f"**{q:.2f}** ± {se:.2f} ({min(each):.2f}–{max(each):.2f})"]
        in_damp = "" if k[5] == "damp 0.01" else f", H_in {k[5]}"
        print(f"| {k[1]} | {k[2]:,} | {k[3]} | {k[4]}×{k[4]} | {rule}{in_damp} | "
              + ", ".join(str(r["incoherence"]) for r in runs) + " | "
              + " | ".join(cells) + " |")


def table(args):
    rows = _rows(args.results)

    def base_of(r):
        for q in rows:
            if (q["format"], q["calib"], q["seqs"], q["bits"], q["incoherence"], q["tile"],
                    input_factor(q), q.get("host"), q["factors"]) == (
                    r["format"], r["calib"], r["seqs"], r["bits"], r["incoherence"], r["tile"],
                    input_factor(r), r.get("host"), "input"):
                return q
        return None

    def cols(r):
        no_out = r["factors"] in ("rtn", "input")
        return {"format": r["format"], "calibration": r["calib"], "tokens": f"{r['tokens']:,}",
                "bits": str(r["bits"]), "factors": r["factors"],
                "refine": "—" if no_out else str(r["refine"]),
                "labels": "—" if no_out else r["labels"],
                "incoherence": "none" if r["incoherence"] < 0 else str(r["incoherence"]),
                "tile": f"{r['tile']}×{r['tile']}", "H_in": input_factor(r),
                "H_out": regularisation(r), "device": r["device"]}

    shown = [k for k in cols(rows[0])
             if k in ("calibration", "tokens", "bits", "factors", "H_out")
             or len({cols(r)[k] for r in rows}) > 1]
    print("| " + " | ".join(shown) + " | "
          + " | ".join(f"{k} KL ± s.e. | ÷ input ± s.e." for k in TEXTS) + " | wall (s) |")
    print("|---" * (len(shown) + 2 * len(TEXTS) + 1) + "|")
    for r in sorted(rows, key=lambda r: (r["format"], r["calib"], r["tokens"], r["bits"],
                                         r["incoherence"], r["tile"], r["factors"] != "input",
                                         r["factors"], r["labels"], -r["refine"],
                                         regularisation(r))):
        base = base_of(r)
        cells = []
        for k in TEXTS:
            if f"{k}_kl" not in r:
                cells += ["", ""]
                continue
            cells.append(f"{r[f'{k}_kl']:.3f} ± {r[f'{k}_kl_text_sem']:.3f}")
            if base is None or base is r:
                cells.append("")
            else:
                q, s = ratio(r[f"{k}_kl_per_text"], base[f"{k}_kl_per_text"])
                cells.append(f"**{q:.2f}** ± {s:.2f}")
        c = cols(r)
        print("| " + " | ".join(c[k] for k in shown) + " | " + " | ".join(cells)
              + (" | — |" if r.get("host") else f" | {r['wall']:.0f} |"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--device", default="cpu")
    r.add_argument("--calib", nargs="+", default=["builtin"])
    r.add_argument("--seqs", nargs="+", type=int, default=[32])
    r.add_argument("--format", default="float",
                   help="float (asymmetric groups of 64 at --bits) or a GGUF format (its grid; "
                        "give one --bits value, it is only a label there)")
    r.add_argument("--bits", nargs="+", type=int, default=[3, 4])
    r.add_argument("--factors", nargs="+", default=["input", "global"])
    r.add_argument("--labels", nargs="+", default=["sample"])
    r.add_argument("--shrink-out", nargs="+", default=["auto"],
                   help="shrinkage of H_out toward its diagonal (with 1 %% damping), or auto "
                        "(the command's damp_out='auto' rule)")
    r.add_argument("--damp-out", nargs="+", type=float, default=[0.01],
                   help="relative damping of H_out with a numeric --shrink-out (default 0.01)")
    r.add_argument("--auto-wide", type=float, default=None,
                   help="the auto rule's damping for the H_out of --wide outputs or more")
    r.add_argument("--wide", type=int, default=1024,
                   help="width from which --auto-wide applies (default 1024: SmolLM2's "
                        "ffn_gate and ffn_up)")
    r.add_argument("--auto-c", type=float, default=None,
                   help="the damping of the auto rule, with and without rotations "
                        "(bakron.factors.AUTO_DAMP_OUT and AUTO_DAMP_OUT_ROTATED)")
    r.add_argument("--refine", nargs="+", type=int, default=[0],
                   help="refinement steps of the global factors (default 0: K-FAC)")
    r.add_argument("--incoherence", nargs="+", default=["auto"],
                   help="seeds; -1 for none; auto (default): the command's, seed 0 for "
                        "--format float and none for GGUF")
    r.add_argument("--tile", nargs="+", type=int, default=[16],
                   help="square solver tiles (default 16, the command's)")
    r.add_argument("--damp", type=float, default=0.01,
                   help="relative damping of H_in, both methods (default 0.01, the command's)")
    r.add_argument("--out-estimator", default="mean",
                   help="H_out from all tokens (mean, the default here), cross-fitted "
                        "halves (crossfit, the command's default for rotated layers) or K "
                        "folds (crossfit:K)")
    r.add_argument("--in-estimator", default="mean",
                   help="H_in of both methods from all tokens (mean, the command's default), "
                        "cross-fitted halves (crossfit) or K folds (crossfit:K); kept in "
                        "each row when not the mean")
    r.add_argument("--heldout-seed", type=int, default=1000)
    r.add_argument("--generated-share", type=float, default=None, metavar="F",
                   help="share of the generated+docs sequences sampled from the model "
                        "(default: the command's, 0.5); kept in each row")
    r.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="also score on this text file, cut into windows of 64 tokens "
                        "(bakron evaluate --text); repeatable")
    r.add_argument("--deadline", type=float, default=1e9, help="seconds; then stop starting runs")
    r.add_argument("--host", default=None,
                   help="a note on the machine kept in each row (its wall time is then not "
                        "shown in the table)")
    r.add_argument("--save-weights", default=None, metavar="DIR",
                   help="keep each run's rounded weights in DIR (for compose)")
    c = sub.add_parser("compose", help="models of global layers of some kinds, input layers of "
                                       "the others (runs saved with --save-weights)")
    c.add_argument("--weights", required=True, metavar="DIR")
    c.add_argument("--out", required=True)
    c.add_argument("--device", default="cpu")
    c.add_argument("--heldout-seed", type=int, default=1000)
    c.add_argument("--host", default=None)
    c.add_argument("--sets", choices=("both", "alone", "but"), default="both",
                   help="compositions besides all input and all global: each kind alone "
                        "global, all but each kind global, or both (default)")
    t = sub.add_parser("compose-table")
    t.add_argument("results", nargs="+")
    t = sub.add_parser("table")
    t.add_argument("results", nargs="+")
    t = sub.add_parser("pool", help="the rotation seeds of each setting pooled")
    t.add_argument("results", nargs="+")
    t.add_argument("--calib", default=None, help="only this calibration")
    t.add_argument("--rule", default=None,
                   help="only this H_out column (e.g. 'damp 3' for 'auto: damp 3')")
    t.add_argument("--seed-se", action="store_true",
                   help="standard errors over the rotation seeds (each seed's mean KLs, "
                        "paired) instead of over every (seed, window) pair")
    s = sub.add_parser("score", help="runs saved with --save-weights scored on text files")
    s.add_argument("--weights", required=True, nargs="+", metavar="DIR")
    s.add_argument("--text", action="append", required=True, metavar="FILE",
                   help="a text file, cut into windows of 64 tokens; repeatable")
    s.add_argument("--out", required=True)
    s.add_argument("--device", default="cpu")
    t = sub.add_parser("shift", help="runs calibrated on one source, scored on the other")
    t.add_argument("results", nargs="+")
    args = p.parse_args(argv)
    {"run": run, "table": table, "pool": pool, "compose": compose,
     "compose-table": compose_table, "shift": shift, "score": score}[args.cmd](args)


if __name__ == "__main__":
    main()
