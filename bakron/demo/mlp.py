"""The digits-MLP demo (``bakron demo --model mlp``).

Trains (seeded, a few seconds, numpy) a small MLP on scikit-learn's bundled handwritten-digits
data, computes the global Kronecker factors of every linear layer (the Fisher of the KL to the
trained model, labels drawn from the model's own softmax), quantizes every layer at each bit
width with round-to-nearest, one-sided LDLQ (``H_in`` only, the GPTQ rule) and two-sided bakron
(``H_out ⊗ H_in``), and reports test accuracy, KL to the original model, per-layer proxy errors
and times; writes a markdown report, a PNG plot and a JSON file to the output folder.

The factor source is one function, :func:`global_factors`: it uses
:func:`bakron.hessian.global_factors` when that exists, else the K-FAC computation here
(same label-sampling convention), and says which one it used.
"""
from __future__ import annotations

import io as _stdio
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

from .._validate import check_bits_list

__all__ = ["run", "load_digits_split", "train_mlp", "forward", "global_factors",
           "quantize_model", "METHODS"]

#: method key -> label used in tables and plots
METHODS = {"rtn": "RTN", "ldlq": "LDLQ one-sided (H_in)", "bakron": "bakron two-sided"}
LAYER_NAMES = ("fc1", "fc2", "out")
TILE = 8
SEED = 0


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


# -- data and model ----------------------------------------------------------------------------

def load_digits_split(seed: int = SEED):
    """The 8 x 8 digits of scikit-learn (1797 images), scaled to [0, 1], split 75/25
    (stratified, seeded): ``(X_train, y_train, X_test, y_test)`` as float64/int64 numpy."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:  # pragma: no cover - scikit-learn is in the demo extra
        raise ImportError("the MLP demo needs scikit-learn: pip install 'bakron[demo]'") from exc
    d = load_digits()
    X = d.data.astype(np.float64) / 16.0
    y = d.target.astype(np.int64)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=seed, stratify=y)
    return Xtr, ytr, Xte, yte


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def forward(xp, params, X, *, return_hidden: bool = False):
    """Logits of the MLP ``[(W1, b1), (W2, b2), (W3, b3)]`` (ReLU between layers) for ``X``."""
    h = X
    hidden = []
    for i, (W, b) in enumerate(params):
        hidden.append(h)
        z = h @ W.T + b
        h = xp.where(z > 0, z, xp.zeros_like(z)) if i < len(params) - 1 else z
    return (h, hidden) if return_hidden else h


def train_mlp(X, y, *, hidden: int = 128, epochs: int = 20, batch: int = 64, lr: float = 3e-3,
              seed: int = SEED):
    """Train ``64 -> hidden -> hidden -> 10`` with ReLU, softmax cross-entropy and Adam, in numpy
    float64 (seeded; the same weights on every machine up to BLAS rounding). Returns
    ``[(W, b), ...]`` with float32 weights (the "original model")."""
    rng = np.random.default_rng(seed)
    sizes = [X.shape[1], hidden, hidden, int(y.max()) + 1]
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        params.append([rng.standard_normal((n_out, n_in)) * math.sqrt(2.0 / n_in),
                       np.zeros(n_out)])
    m_ = [[np.zeros_like(p) for p in layer] for layer in params]
    v_ = [[np.zeros_like(p) for p in layer] for layer in params]
    b1, b2, eps, step = 0.9, 0.999, 1e-8, 0
    N = X.shape[0]
    for _ in range(epochs):
        perm = rng.permutation(N)
        for s in range(0, N, batch):
            idx = perm[s:s + batch]
            xb, yb = X[idx], y[idx]
            z, hs = forward(np, [(W, b) for W, b in params], xb, return_hidden=True)
            g = _softmax(z)
            g[np.arange(len(idx)), yb] -= 1.0
            g /= len(idx)
            step += 1
            for i in range(len(params) - 1, -1, -1):
                W, b = params[i]
                grads = (g.T @ hs[i], g.sum(axis=0))
                if i > 0:
                    g = (g @ W) * (hs[i] > 0)
                for j, gr in enumerate(grads):
                    m_[i][j] = b1 * m_[i][j] + (1 - b1) * gr
                    v_[i][j] = b2 * v_[i][j] + (1 - b2) * gr * gr
                    mh = m_[i][j] / (1 - b1 ** step)
                    vh = v_[i][j] / (1 - b2 ** step)
                    params[i][j] = params[i][j] - lr * mh / (np.sqrt(vh) + eps)
    return [(W.astype(np.float32), b.astype(np.float32)) for W, b in params]


# -- the factor source ---------------------------------------------------------------------

def global_factors(xp, params, X_calib, *, batch_size: int = 256, seed: int = SEED):
    """Global Kronecker factors ``{name: (H_in, H_out)}`` of every linear layer, and the source.

    The Fisher of the KL to the model's own predictions: labels are drawn from the model's
    softmax (inverse CDF of ``numpy.random.default_rng((seed, batch_index)).random(B)``), and
    for a layer with inputs ``x`` and output gradients ``g``: ``H_in = E[x xᵀ]``,
    ``H_out = E[g gᵀ]`` (K-FAC). Uses :func:`bakron.hessian.global_factors` when it exists,
    else computes the same here. Returns ``(factors, source)`` with float64 arrays in ``xp``.
    """
    try:
        from .. import hessian as bh
        gf = getattr(bh, "global_factors", None)
    except ImportError:  # pragma: no cover
        gf = None
    if gf is not None:
        stages = []
        for i, (name, (W, b)) in enumerate(zip(LAYER_NAMES, params)):
            stages.append(bh.Linear(xp.asarray(W, dtype=xp.float64),
                                    xp.asarray(b, dtype=xp.float64), name=name))
            if i < len(params) - 1:
                stages.append(bh.ReLU())
        stages.append(bh.SoftmaxCrossEntropy())
        factors, _report = gf(stages, xp.asarray(X_calib, dtype=xp.float64),
                              batch_size=batch_size, seed=seed)
        return {k: (v[0], v[1]) for k, v in factors.items()}, "bakron.hessian.global_factors"
    return _kfac_factors(xp, params, X_calib, batch_size=batch_size, seed=seed), \
        "bakron.demo.mlp (K-FAC, sampled Fisher)"


def _kfac_factors(xp, params, X_calib, *, batch_size: int, seed: int):
    """The K-FAC factors computed directly (the fallback of :func:`global_factors`; ``xp`` is
    an array-API namespace such as ``array_api_compat.numpy``)."""
    P = [(xp.asarray(W, dtype=xp.float64), xp.asarray(b, dtype=xp.float64)) for W, b in params]
    Hin = [xp.zeros((W.shape[1], W.shape[1]), dtype=xp.float64) for W, _ in P]
    Hout = [xp.zeros((W.shape[0], W.shape[0]), dtype=xp.float64) for W, _ in P]
    X = xp.asarray(X_calib, dtype=xp.float64)
    N = X.shape[0]
    for bi, s in enumerate(range(0, N, batch_size)):
        xb = X[s:s + batch_size]
        z, hs = forward(xp, P, xb, return_hidden=True)
        e = xp.exp(z - xp.max(z, axis=-1, keepdims=True))
        p = e / xp.sum(e, axis=-1, keepdims=True)
        u = xp.asarray(np.random.default_rng((seed, bi)).random(xb.shape[0]))
        cdf = xp.cumulative_sum(p, axis=-1)
        y = xp.sum(xp.astype(cdf < u[:, None], xp.int64), axis=-1)
        y = xp.minimum(y, xp.asarray(z.shape[-1] - 1, dtype=xp.int64))
        onehot = xp.astype(xp.arange(z.shape[-1])[None, :] == y[:, None], xp.float64)
        g = p - onehot                              # per-sample dloss/dlogits for label y
        for i in range(len(P) - 1, -1, -1):
            Hin[i] += hs[i].T @ hs[i]
            Hout[i] += g.T @ g
            if i > 0:
                g = (g @ P[i][0]) * (hs[i] > 0)
    return {name: (Hin[i] / N, Hout[i] / N) for i, name in enumerate(LAYER_NAMES[:len(P)])}


# -- quantization and evaluation --------------------------------------------------------------

def _tile(shape):
    """8 x 8 tiles; 2 x 8 for layers with fewer than 32 outputs (the 10-class head), so that
    its output side has several LDL blocks (a single block row would give no output-side
    feedback, and two-sided would equal one-sided)."""
    m, n = shape
    return (min(TILE if m >= 4 * TILE else 2, m), min(TILE, n))


def _warm_up(xp, params):
    """One solve of each layer's shape on dummy data, one- and two-sided, so that compiled
    engines (numba, CUDA) are built before anything is timed. Returns the seconds it took."""
    from .. import _xp, quantize_layer

    t0 = time.perf_counter()
    for W, _ in params:
        m, n = W.shape
        Wd = xp.asarray(np.linspace(-1, 1, m * n, dtype=np.float32).reshape(m, n))
        for H_out in (None, xp.eye(m, dtype=xp.float64)):
            quantize_layer(Wd, xp.eye(n, dtype=xp.float64), H_out, bits=2, tile=_tile((m, n)))
    _xp.sync(xp)
    return time.perf_counter() - t0


def quantize_model(xp, params, factors, bits: int, *, repeats: int = 1, progress: bool = False):
    """Quantize every layer with RTN, one-sided LDLQ and two-sided bakron (same grid: per-row
    symmetric, RMS-fitted). Times are the best of ``repeats`` runs (the results are identical).
    Returns ``{method: {"params": [...], "layers": {name: figures}}}``."""
    from .. import UniformQuantizer, _xp, proxy_error, quantize_layer

    out = {k: {"params": [], "layers": {}} for k in METHODS}
    for (W, b), name in zip(params, LAYER_NAMES):
        Wx = xp.asarray(W)
        bx = xp.asarray(b)
        H_in, H_out = factors[name]
        tile = _tile(W.shape)
        q = UniformQuantizer.fit(Wx, bits)
        t_rtn = t_one = t_two = math.inf
        for _ in range(max(1, int(repeats))):
            t0 = time.perf_counter()
            rtn, _ = q.rtn(Wx)
            _xp.sync(xp)
            t_rtn = min(t_rtn, time.perf_counter() - t0)
            one = quantize_layer(Wx, H_in, None, quantizer=q, tile=tile)
            two = quantize_layer(Wx, H_in, H_out, quantizer=q, tile=tile)
            t_one = min(t_one, one.seconds_factor + one.seconds_solve)
            t_two = min(t_two, two.seconds_factor + two.seconds_solve)
        results = {"rtn": (rtn, t_rtn, None), "ldlq": (one.values, t_one, one),
                   "bakron": (two.values, t_two, two)}
        for key, (Wq, secs, res) in results.items():
            out[key]["params"].append((Wq, bx))
            out[key]["layers"][name] = {
                "shape": list(W.shape), "tile": list(tile),
                "proxy_error": proxy_error(Wx, Wq, H_in, H_out),
                "proxy_error_one_sided": proxy_error(Wx, Wq, H_in),
                "seconds": secs,
                "method": None if res is None else res.solve.method,
                "engine": None if res is None else res.solve.engine,
                "damp_in": None if res is None else res.damp_in,
                "damp_out": None if res is None else res.damp_out,
            }
        _log(progress, f"  {bits} bits  {name:4s} {W.shape[0]}x{W.shape[1]}: proxy error RTN "
                       f"{out['rtn']['layers'][name]['proxy_error']:.4f}, LDLQ "
                       f"{out['ldlq']['layers'][name]['proxy_error']:.4f}, bakron "
                       f"{out['bakron']['layers'][name]['proxy_error']:.4f}")
    return out


def _evaluate(xp, params, X, y, p_ref):
    """(accuracy, mean KL(p_ref || p_model)) on ``X`` in float64."""
    from .. import _xp

    P = [(xp.astype(xp.asarray(W), xp.float64), xp.astype(xp.asarray(b), xp.float64))
         for W, b in params]
    z = _xp.to_numpy(forward(xp, P, xp.asarray(X, dtype=xp.float64)))
    logq = z - z.max(axis=1, keepdims=True)
    logq = logq - np.log(np.exp(logq).sum(axis=1, keepdims=True))
    acc = float(np.mean(np.argmax(z, axis=1) == y))
    if p_ref is None:
        return acc, 0.0, np.exp(logq)
    kl = float(np.mean(np.sum(p_ref * (np.log(np.maximum(p_ref, 1e-300)) - logq), axis=1)))
    return acc, kl, None


# -- report -------------------------------------------------------------------------------------

def _table(summary, acc_fp) -> str:
    rows = [("bits", "method", "test acc.", "KL to original", "quantize s")]
    rows.append(("32", "original (float32)", f"{100 * acc_fp:.2f} %", "0", "-"))
    for r in summary:
        rows.append((str(r["bits"]), METHODS[r["method"]], f"{100 * r['accuracy']:.2f} %",
                     f"{r['kl']:.4g}", f"{r['seconds']:.3f}"))
    return _format(rows)


def _layer_table(summary) -> str:
    rows = [("bits", "layer", "method", "proxy (H_out⊗H_in)", "proxy (I⊗H_in)", "seconds")]
    for r in summary:
        for name, f in r["layers"].items():
            rows.append((str(r["bits"]), name, METHODS[r["method"]], f"{f['proxy_error']:.4g}",
                         f"{f['proxy_error_one_sided']:.4g}", f"{f['seconds']:.4f}"))
    return _format(rows)


def _format(rows) -> str:
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w[i]) if i < 2 or i == 2 and not c[:1].isdigit() else c.rjust(w[i])
                       for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def _md_table(rows) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def _plot_png(summary, acc_fp, bits) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"rtn": "#969696", "ldlq": "#3182bd", "bakron": "#e6550d"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for key in METHODS:
        rs = [r for r in summary if r["method"] == key]
        bs = [r["bits"] for r in rs]
        axes[0].plot(bs, [100 * r["accuracy"] for r in rs], "o-", color=colors[key],
                     label=METHODS[key])
        axes[1].semilogy(bs, [max(r["kl"], 1e-12) for r in rs], "o-", color=colors[key],
                         label=METHODS[key])
    axes[0].axhline(100 * acc_fp, color="black", ls="--", lw=1, label="original")
    axes[0].set(xlabel="bits", ylabel="test accuracy (%)", xticks=list(bits),
                title="test accuracy")
    axes[1].set(xlabel="bits", ylabel="mean KL(original ‖ quantized)", xticks=list(bits),
                title="KL to the original model")
    groups = [(b, n) for b in bits for n in LAYER_NAMES]
    x = np.arange(len(groups))
    for j, key in enumerate(METHODS):
        vals = []
        for b, n in groups:
            r = next(r for r in summary if r["method"] == key and r["bits"] == b)
            vals.append(r["layers"][n]["proxy_error"])
        axes[2].bar(x + (j - 1) * 0.27, vals, width=0.27, color=colors[key], label=METHODS[key])
    axes[2].set_yscale("log")
    axes[2].set_xticks(x, [f"{n}\n{b} bits" for b, n in groups], fontsize=7)
    axes[2].set(ylabel="proxy error tr(E H_I Eᵀ H_O)/tr(W H_I Wᵀ H_O)",
                title="per-layer proxy error (global factors)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    buf = _stdio.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _markdown(res: dict) -> str:
    s = res["setup"]
    lines = [
        "# bakron demo: digits MLP",
        "",
        f"Command: `{res['command']}`  ",
        f"Device: {res['device']}; bakron {res['versions']['bakron']}, numpy "
        f"{res['versions']['numpy']}, Python {res['versions']['python']}; total "
        f"{res['seconds']['total']:.1f} s.",
        "",
        "## Setup",
        "",
        f"- Data: scikit-learn's bundled handwritten digits (8 x 8 pixels, 1797 images), split "
        f"{s['n_train']} train / {s['n_test']} test (stratified, seed {SEED}).",
        f"- Model: MLP {' -> '.join(str(v) for v in s['sizes'])} with ReLU, trained in numpy "
        f"(Adam, {s['epochs']} epochs, {res['seconds']['train']:.1f} s), weights float32. "
        f"Test accuracy {100 * res['accuracy_original']:.2f} %.",
        f"- Factors: {res['factor_source']}; the Fisher of the KL to the trained model "
        f"(labels drawn from its softmax) on {s['n_calib']} training images "
        f"({res['seconds']['factors']:.2f} s).",
        f"- Grid: symmetric uniform, one scale per output row fitted to W (RMS rule), the same "
        f"for all three methods; tiles {TILE} x {TILE} (2 x {TILE} for the 10-output layer), "
        f"damping 0.01. Engines were compiled/warmed up first "
        f"({res['seconds']['warm_up']:.2f} s, not in the times below).",
        "- Methods: RTN (nearest grid point); LDLQ one-sided (H_in only, the GPTQ rule); "
        "bakron two-sided (H_out ⊗ H_in). Layers are quantized independently from the "
        "original model's factors.",
        "- KL: mean over test images of KL(original softmax ‖ quantized softmax).",
        "",
        "## Results",
        "",
    ]
    rows = [("bits", "method", "test accuracy", "KL to original", "quantize time (s)")]
    rows.append(("32", "original", f"{100 * res['accuracy_original']:.2f} %", "0", "-"))
    for r in res["summary"]:
        rows.append((str(r["bits"]), METHODS[r["method"]], f"{100 * r['accuracy']:.2f} %",
                     f"{r['kl']:.4g}", f"{r['seconds']:.3f}"))
    lines += [_md_table(rows), "", "![results](mlp_plot.png)", ""]
    verdicts = []
    for b in res["bits"]:
        rs = {r["method"]: r for r in res["summary"] if r["bits"] == b}
        best = min(rs, key=lambda k: rs[k]["kl"])
        verdicts.append(f"- {b} bits: lowest KL with {METHODS[best]} "
                        f"(RTN {rs['rtn']['kl']:.4g}, LDLQ {rs['ldlq']['kl']:.4g}, bakron "
                        f"{rs['bakron']['kl']:.4g}); accuracy RTN "
                        f"{100 * rs['rtn']['accuracy']:.2f} %, LDLQ "
                        f"{100 * rs['ldlq']['accuracy']:.2f} %, bakron "
                        f"{100 * rs['bakron']['accuracy']:.2f} %.")
    lines += ["What the table shows (computed, not curated):", ""] + verdicts + [""]
    lines += ["## Per layer", "",
              "Proxy errors are normalised: `tr(E H_I Eᵀ H_O) / tr(W H_I Wᵀ H_O)` under the "
              "global factors, and the same with `H_O = I`. Seconds: factor preparation + "
              "rounding (RTN: rounding only), the best of 3 runs.", ""]
    rows = [("bits", "layer", "method", "proxy (H_out⊗H_in)", "proxy (I⊗H_in)", "seconds")]
    for r in res["summary"]:
        for name, f in r["layers"].items():
            rows.append((str(r["bits"]), f"{name} {f['shape'][0]}x{f['shape'][1]}",
                         METHODS[r["method"]], f"{f['proxy_error']:.4g}",
                         f"{f['proxy_error_one_sided']:.4g}", f"{f['seconds']:.4f}"))
    lines += [_md_table(rows), ""]
    return "\n".join(lines)


# -- the demo --------------------------------------------------------------------------------------

def run(out_dir, *, device: str = "auto", bits=(2, 3, 4), quick: bool = False,
        progress: bool = True) -> dict:
    """Run the digits-MLP demo and write ``mlp_report.md``, ``mlp_plot.png`` and
    ``mlp_results.json`` to ``out_dir`` (created if needed; each file written atomically).

    Parameters
    ----------
    out_dir : str or path
        Output folder.
    device : {"auto", "cpu", "gpu"}
        ``auto`` uses cupy when it sees a GPU (training always runs in numpy).
    bits : sequence of int
        Bit widths, each in 2..8.
    quick : bool
        A smaller model and shorter training (for tests).
    progress : bool
        Print progress to stderr and the tables to stdout.

    Returns
    -------
    dict
        Everything in the report: ``accuracy_original``, ``summary`` (one entry per bit width
        and method with ``accuracy``, ``kl``, ``seconds`` and per-layer figures),
        ``factor_source``, ``seconds``, ``files``.
    """
    from .. import __version__
    from .. import io as bio

    bits = check_bits_list(bits)
    xp, dev = bio.array_module(device)
    if dev == "gpu":
        import array_api_compat

        xp = array_api_compat.array_namespace(xp.zeros(1))
    else:
        import array_api_compat.numpy as xp
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    t_all = time.perf_counter()
    hidden, epochs = (64, 12) if quick else (128, 20)
    Xtr, ytr, Xte, yte = load_digits_split()
    _log(progress, f"[1/4] training MLP 64-{hidden}-{hidden}-10 on {len(Xtr)} digits "
                   f"({epochs} epochs)...")
    t0 = time.perf_counter()
    params = train_mlp(Xtr, ytr, hidden=hidden, epochs=epochs)
    t_train = time.perf_counter() - t0
    acc_fp, _, p_ref = _evaluate(xp, params, Xte, yte, None)
    _log(progress, f"      done in {t_train:.1f} s; test accuracy {100 * acc_fp:.2f} %")

    n_calib = min(len(Xtr), 512 if quick else len(Xtr))
    _log(progress, f"[2/4] global factors (Fisher, {n_calib} calibration images) on {dev}...")
    t0 = time.perf_counter()
    factors, source = global_factors(xp, params, Xtr[:n_calib])
    from .. import _xp
    _xp.sync(xp)
    t_fac = time.perf_counter() - t0
    _log(progress, f"      done in {t_fac:.2f} s ({source})")

    _log(progress, f"[3/4] quantizing {len(params)} layers at {', '.join(map(str, bits))} bits "
                   f"with RTN, LDLQ and bakron...")
    t_warm = _warm_up(xp, params)
    _log(progress, f"      (compiled engines warmed up in {t_warm:.2f} s, not counted below)")
    t0 = time.perf_counter()
    summary = []
    for b in bits:
        qm = quantize_model(xp, params, factors, b, repeats=1 if quick else 3,
                            progress=progress)
        for key in METHODS:
            acc, kl, _ = _evaluate(xp, qm[key]["params"], Xte, yte, p_ref)
            layers = qm[key]["layers"]
            summary.append({"bits": b, "method": key, "accuracy": acc, "kl": kl,
                            "seconds": sum(f["seconds"] for f in layers.values()),
                            "layers": layers})
    t_quant = time.perf_counter() - t0

    _log(progress, f"[4/4] writing the report to {out}...")
    res = {
        "model": "mlp", "device": dev, "bits": list(bits), "quick": quick,
        "command": "bakron demo --model mlp" + (" --quick" if quick else "")
                   + ("" if bits == (2, 3, 4) else f" --bits {','.join(map(str, bits))}"),
        "versions": {"bakron": __version__, "numpy": np.__version__,
                     "python": platform.python_version()},
        "setup": {"sizes": [64, hidden, hidden, 10], "epochs": epochs, "n_train": len(Xtr),
                  "n_test": len(Xte), "n_calib": n_calib},
        "factor_source": source, "accuracy_original": acc_fp, "summary": summary,
    }
    png = _plot_png(summary, acc_fp, bits)
    res["seconds"] = {"train": t_train, "factors": t_fac, "warm_up": t_warm, "quantize": t_quant,
                      "total": time.perf_counter() - t_all}
    files = [out / "mlp_report.md", out / "mlp_plot.png", out / "mlp_results.json"]
    bio.atomic_write_bytes(files[1], png)
    bio.atomic_write_text(files[0], _markdown(res))
    res["files"] = [str(f) for f in files]
    bio.atomic_write_json(files[2], res)
    if progress:
        print(_table(summary, acc_fp))
        print()
        print(_layer_table(summary))
    return res
