"""What a Hessian pass costs: its matrix products, their FLOPs, and a prediction of the wall
time of a collection on this machine from a short measurement of its GEMM rate.

``pass_gemms(stages, rows, seqs)`` lists the products of one pass of a chain (the forward, the
VJP, the factor updates); :func:`estimate_seconds` turns them into seconds for ``tokens``
calibration tokens and ``passes`` passes: the FLOPs over the GEMM rate measured now (one
product of the chain's own sizes, a fraction of a second) times :data:`OVERHEAD`, the ratio of a
pass to its GEMM floor measured by ``python -m bakron.benchmarks.hessian``
(docs/benchmarks/hessian.md).
"""
from __future__ import annotations

import time

import numpy as np

__all__ = ["pass_gemms", "pass_flops", "gemm_rate", "estimate_seconds", "announce",
           "OVERHEAD"]

#: pass time / GEMM floor of a K-FAC or refinement pass (docs/benchmarks/hessian.md: SmolLM2,
#: 4096 tokens, 1 thread, K-FAC 1.47x and refinement 1.44x / 1.37x store-all, 1.63x / 1.52x /
#: 1.49x under the budget, mean 1.49; 1.53x-1.65x with other jobs on the cores, so rounded up
#: to 1.6): a prediction scales the floor by it
OVERHEAD = 1.6


def _linear(out, N, m, n, *, need_grad=True, syrk_in=True):
    out["fwd"].append(("gemm", N, n, m))
    if need_grad:
        out["vjp"].append(("gemm", N, m, n))
    if syrk_in:
        out["in"].append(n)
    out["out"].append(m)
    out["layers"].append((m, n))


def pass_gemms(stages, rows: int, seqs=None) -> dict:
    """The matrix products of one pass of ``stages`` over ``rows`` real token rows (``seqs``:
    ``(count, length)`` of the attention's sequences, for its score products):
    ``{"N": rows, "fwd": [...], "vjp": [...], "in": [n, ...], "out": [m, ...],
    "layers": [(m, n), ...], "head": [...]}`` (``head``: the head's forward products, also in
    ``fwd``). GEMMs are ``("gemm", M, K, N)``, batched ones
    ``("bmm", count, M, K, N)``; ``in``/``out`` are the sizes of the factor updates of a K-FAC
    pass (one ``H_in`` per distinct input), ``layers`` every linear's ``(m, n)``."""
    from .stages import Linear, Residual, SoftmaxCrossEntropy
    from .transformer import Attention, Embedding, LMHead, SwiGLU

    N = int(rows)
    out = {"N": N, "fwd": [], "vjp": [], "in": [], "out": [], "layers": [], "head": []}

    def walk(chain, first):
        for i, st in enumerate(chain):
            need = not (first and i == 0)
            if isinstance(st, Residual):
                walk(st.stages, False)
            elif isinstance(st, Linear):
                m, n = st.shape
                _linear(out, N, m, n, need_grad=need)
            elif isinstance(st, Attention):
                d, hd, H, K = st.d, st.hd, st.H, st.K
                _linear(out, N, H * hd, d, need_grad=need)
                _linear(out, N, K * hd, d, need_grad=need, syrk_in=False)
                _linear(out, N, K * hd, d, need_grad=need, syrk_in=False)
                _linear(out, N, d, H * hd)
                if seqs is not None:
                    S, T = seqs
                    c, r = S * K, H // K
                    out["fwd"] += [("bmm", c, r * T, hd, T), ("bmm", c, r * T, T, hd)]
                    out["vjp"] += [("bmm", c, T, r * T, hd), ("bmm", c, r * T, hd, T),
                                   ("bmm", c, r * T, T, hd), ("bmm", c, T, r * T, hd)]
            elif isinstance(st, SwiGLU):
                f, d = st.W_gate.shape
                _linear(out, N, f, d, need_grad=need)
                _linear(out, N, f, d, need_grad=need, syrk_in=False)
                _linear(out, N, d, f)
            elif isinstance(st, LMHead):
                V, d = st.W_out.shape
                out["fwd"].append(("gemm", N, d, V))
                out["head"].append(("gemm", N, d, V))
                out["vjp"].append(("gemm", N, V, d))
            elif isinstance(st, (Embedding, SoftmaxCrossEntropy)):
                pass
    walk(stages, True)
    return out


def _flops(item) -> float:
    if item[0] == "gemm":
        _, M, K, N = item
        return 2.0 * M * K * N
    _, c, M, K, N = item
    return 2.0 * c * M * K * N


def pass_flops(g: dict) -> dict:
    """FLOPs of a pass by part (``forward``, ``vjp``, ``kfac``/``refine`` products; a
    symmetric rank-k update of ``k`` rows of size ``n`` counts ``k n²``; ``inputs``: the
    forward-only pass of :func:`~bakron.hessian.input_factors`, no head, ``H_in`` alone)."""
    N = g["N"]
    fwd = sum(map(_flops, g["fwd"]))
    vjp = sum(map(_flops, g["vjp"]))
    kfac = float(N) * (sum(n * n for n in g["in"]) + sum(m * m for m in g["out"]))
    refine = max(sum(2.0 * N * n * n + N * m * m for m, n in g["layers"]),
                 sum(2.0 * N * m * m + N * n * n for m, n in g["layers"]))
    head = sum(map(_flops, g.get("head", ())))
    inputs = fwd - head + float(N) * sum(n * n for n in g["in"])
    return {"forward": fwd, "vjp": vjp, "kfac_products": kfac, "refine_products": refine,
            "kfac": fwd + vjp + kfac, "refine": fwd + vjp + refine, "inputs": inputs}


def gemm_rate(n: int = 1024, k: int = 576, m: int = 1536, dtype="float32",
              repeats: int = 3, xp=None) -> float:
    """This machine's GEMM rate now (FLOP/s): the median of ``repeats`` products of an
    ``(n, k)`` by ``(k, m)`` pair of random matrices, after one warm-up, in the namespace
    ``xp`` (default numpy; a GPU namespace is synchronised around each product)."""
    from .. import _xp

    rng = np.random.default_rng(0)
    A = rng.standard_normal((n, k)).astype(dtype)
    B = rng.standard_normal((k, m)).astype(dtype)
    if xp is not None and not _xp.is_numpy(xp):
        A, B = xp.asarray(A), xp.asarray(B)
    else:
        xp = np
    A @ B
    _xp.sync(xp)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        A @ B
        _xp.sync(xp)
        ts.append(time.perf_counter() - t0)
    return 2.0 * n * k * m / max(float(np.median(ts)), 1e-9)


def estimate_seconds(stages, tokens: int, *, passes: int, seq_len: int = 128,
                     batch_tokens: int = 1024, refine: bool = True, rate=None,
                     xp=None, forward_only: bool = False) -> float:
    """Predicted wall time of ``passes`` passes over ``tokens`` calibration tokens
    (the first a K-FAC pass, the others refinement passes when ``refine``; with
    ``forward_only``, forward passes of :func:`~bakron.hessian.input_factors`): the passes'
    FLOPs at ``rate`` (default: :func:`gemm_rate` measured now on the chain's hidden size,
    in ``xp``) times :data:`OVERHEAD`."""
    if passes <= 0 or tokens <= 0:
        return 0.0
    rows = min(int(tokens), int(batch_tokens))
    seqs = (max(1, rows // max(int(seq_len), 1)), min(int(seq_len), rows))
    g = pass_gemms(stages, rows, seqs)
    f = pass_flops(g)
    if rate is None:
        k = max((n for _, n in g["layers"]), default=576)
        rate = gemm_rate(n=rows, k=min(k, 4096), m=min(4 * k, 8192), xp=xp)
    if forward_only:
        per_token = passes * f["inputs"] / rows
    else:
        per_token = (f["kfac"] + (passes - 1) * (f["refine"] if refine else f["kfac"])) / rows
    return OVERHEAD * per_token * int(tokens) / rate


def announce(stages, seqs, *, passes: int, batch_size: int, xp=None,
             forward_only: bool = False) -> str:
    """``"global Hessians: 3 passes over 16,384 calibration tokens, about 6 min on this
    machine"`` (``forward_only``: ``"input factors: 1 forward pass over ..."``): the line a
    command prints before it collects (``seqs``: the token lists)."""
    from .progress import format_duration

    tokens = sum(len(s) for s in seqs)
    T = max((len(s) for s in seqs), default=1)
    est = estimate_seconds(stages, tokens, passes=passes, seq_len=T,
                           batch_tokens=max(1, batch_size) * T, xp=xp,
                           forward_only=forward_only)
    what = "input factors: 1 forward pass" if forward_only else (
        f"global Hessians: {passes} pass{'es' if passes != 1 else ''}")
    return (f"{what} over {tokens:,} calibration tokens, about {format_duration(est)} on "
            f"this machine")
