"""Peak memory against stage evaluations of the global Hessians of a causal LM.

    python -m bakron.demo.llm_memory --out docs/images/llm_hessian_memory.png [--check]

For the 30-block SmolLM2 chain (62 stages: embedding, 2 residual blocks per layer, final
norm; the LM head) on the ``bakron demo --model smollm2`` calibration set (64 sentences of the
Python Language Reference in right-padded batches of 8), the driver's planner
(:func:`bakron.hessian.plan_global`) gives, without computing anything, the peak working
memory of one K-FAC pass for

* store-all checkpointing (every stage's activation kept),
* bisection checkpointing (``⌈log₂ l⌉ + 1`` snapshots),
* binomial checkpointing with ``s`` snapshots,
* the automatic schedule under memory budgets (binomial, then layer-range bisection),

and the stage evaluations come from the same control code run on byte counts (the driver's
dry-run engine). The table is printed as markdown; the plot goes to ``--out``. ``--tokens``
adds the same sweep for longer calibration sequences (activations then matter more).
``--check`` runs the real thing on a few texts: the factors of a handful of layers across
the whole chain must be bitwise identical for every schedule and budget.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time

import numpy as np

__all__ = ["sweep", "check", "main"]

_KINDS = ("store_all", "bisection", "binomial", "auto")


def _evals(stages, batches, plan, refine_iters=0):
    """Stage evaluations of a plan over all batches (the driver's dry-run engine)."""
    from ..hessian.driver import _simulate

    L = len(stages) - 1
    sizes = [1] * (L + 1)          # the counts do not depend on the sizes
    total = 0
    for a, b, c, sched, s in plan["splits"]:
        total += _simulate(sizes, a, c, b, b == L, sched, s)[2]
    for a, b, sched, s in plan["leaves"]:
        total += (1 + 2 * refine_iters) * _simulate(sizes, a, a, b, b == L, sched, s)[2]
    return total * len(batches)


def sweep(stages, batches, *, accum_dtype=None,
          fractions=tuple(np.geomspace(0.9, 0.03, 18)),
          snapshots=(2, 3, 4, 6, 8, 12, 16, 24, 32)):
    """Rows ``{"schedule", "budget", "peak", "evals", "recompute", "passes", "leaves"}``:
    store-all, bisection and binomial (fixed snapshots) inside one layer range, and the
    automatic schedule under budgets that are ``fractions`` of the store-all peak."""
    from ..hessian import plan_global

    L = len(stages) - 1
    base = L * len(batches)

    def row(kind, budget, **kw):
        p = plan_global(stages, batches, budget_bytes=budget, accum_dtype=accum_dtype, **kw)
        ev = _evals(stages, batches, p)
        return {"schedule": kind, "budget": budget, "peak": p["planned_peak_bytes"],
                "evals": ev, "recompute": ev / base,
                "passes": len(p["splits"]) + len(p["leaves"]), "leaves": len(p["leaves"]),
                "snapshots": kw.get("snapshots")}

    rows = [row("store_all", None, checkpoint="store_all")]
    top = rows[0]["peak"]
    big = 1 << 62                    # a budget that never forces a range split
    rows.append(row("bisection", big, checkpoint="bisection"))
    for s in snapshots:
        if s < L:
            rows.append(row("binomial", big, checkpoint="binomial", snapshots=s))
    seen = set()
    for f in fractions:
        try:
            r = row("auto", int(f * top))
        except ValueError:           # too small for any plan
            continue
        if (r["peak"], r["evals"]) not in seen:      # one row per distinct plan
            seen.add((r["peak"], r["evals"]))
            rows.append(r)
    return rows


def check(lm, seqs, *, layers, accum_dtype=None, progress=True):
    """Real runs on ``seqs`` (Fisher of the KL, sampled labels): per schedule the sha256 of
    every collected factor, the stage evaluations, the peak and the seconds."""
    import bakron.hessian as bh

    stages = lm.stages()
    batches, _ = bh.pad_batches(seqs, batch_size=2, xp=lm.xp)
    runs = {"store_all": dict(checkpoint="store_all"),
            "bisection": dict(checkpoint="bisection", budget_bytes=1 << 62),
            "binomial (3 snapshots)": dict(checkpoint="binomial", snapshots=3,
                                           budget_bytes=1 << 62)}
    out = {}
    for what, kw in list(runs.items()) + [("auto, range bisection", None)]:
        if kw is None:               # the largest budget whose plan bisects the layer range
            kw = {"budget_bytes": _splitting_budget(stages, batches, layers, accum_dtype,
                                                    out["store_all"]["peak"])}
        digests = {}

        def sink(name, H_in, H_out, _d=digests):
            from .. import _xp

            _d[name] = tuple(hashlib.sha256(np.ascontiguousarray(_xp.to_numpy(H))
                                            .tobytes()).hexdigest() for H in (H_in, H_out))

        t0 = time.perf_counter()
        _, rep = bh.global_factors(stages, batches, layers=layers, seed=0, sink=sink,
                                   accum_dtype=accum_dtype, **kw)
        out[what] = {"digests": digests, "evals": rep.stage_evals, "peak": rep.peak_bytes,
                     "buffers": rep.peak_buffer_bytes, "leaves": len(rep.leaf_ranges),
                     "passes": rep.passes, "seconds": time.perf_counter() - t0}
        if progress:
            print(f"  {what}: {rep.stage_evals} stage evaluations, {rep.passes} passes, "
                  f"{len(rep.leaf_ranges)} ranges, {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    ref = out["store_all"]["digests"]
    for what, r in out.items():
        r["identical"] = r["digests"] == ref
    return out


def _splitting_budget(stages, batches, layers, accum_dtype, top):
    from ..hessian import plan_global

    for f in np.linspace(0.95, 0.05, 19):
        try:
            p = plan_global(stages, batches, budget_bytes=int(f * top), layers=layers,
                            accum_dtype=accum_dtype)
        except ValueError:
            break
        if len(p["leaves"]) > 1:
            return int(f * top)
    raise ValueError("no budget splits the layer range of these layers")


def _mib(b):
    return f"{b / 2 ** 20:,.1f}"


def table(rows) -> str:
    from ._common import md_table

    body = [["schedule", "budget (MiB)", "peak (MiB)", "stage evaluations",
             "× store-all", "passes", "layer ranges"]]
    for r in rows:
        name = r["schedule"] + (f", {r['snapshots']} snapshots" if r["snapshots"] else "")
        budget = "—" if r["budget"] is None or r["budget"] >= 1 << 60 else _mib(r["budget"])
        body.append([name, budget, _mib(r["peak"]), r["evals"], f"{r['recompute']:.2f}",
                     r["passes"], r["leaves"]])
    return md_table(body)


def plot(panels, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ._common import png

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    styles = {"store_all": ("C2", "^"), "bisection": ("C1", "s"), "binomial": ("C0", "o"),
              "auto": ("C3", "D")}
    labels = {"store_all": "store-all", "bisection": "bisection checkpointing",
              "binomial": "binomial checkpointing (s snapshots)",
              "auto": "budget: binomial, then layer-range bisection"}
    for ax, (title, rows) in zip(axes[0], panels):
        for kind in _KINDS:
            rs = [r for r in rows if r["schedule"] == kind]
            if not rs:
                continue
            color, marker = styles[kind]
            ax.plot([r["recompute"] for r in rs], [r["peak"] / 2 ** 20 for r in rs],
                    marker=marker, color=color, ls="-" if len(rs) > 1 else "",
                    label=labels[kind])
            if kind == "binomial":
                for r in rs[::2]:
                    ax.annotate(f"s={r['snapshots']}", (r["recompute"], r["peak"] / 2 ** 20),
                                fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="stage evaluations (× one store-all pass)", ylabel="peak memory (MiB)",
               title=title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    data = png(fig)
    plt.close(fig)
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bakron.demo.llm_memory",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="llm_hessian_memory.png", help="the PNG to write")
    ap.add_argument("--n-calibration", type=int, default=64,
                    help="calibration sentences (default 64, the demo's)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048,
                    help="a second panel: batches of --batch-size sequences of this many "
                         "tokens (0: none)")
    ap.add_argument("--accum-dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--check", action="store_true",
                    help="also run real passes and compare the factors across schedules")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=None)
    a = ap.parse_args(argv)

    import array_api_compat.numpy as xp

    import bakron.hessian as bh
    from bakron import io as bio
    from bakron.models import load_llm
    from bakron.models.textdata import calibration_and_heldout

    lm = load_llm("smollm2", xp=xp, cache=a.cache, progress=True)
    acc = getattr(xp, a.accum_dtype)
    cal, _ = calibration_and_heldout(a.n_calibration, 0, seed=a.seed)
    seqs = [s for s in lm.tokenize(cal) if s]
    stages = lm.stages()
    batches, _ = bh.pad_batches(seqs, batch_size=a.batch_size, xp=xp)
    panels = []
    title = (f"{len(seqs)} sentences, {sum(map(len, seqs))} tokens, {len(batches)} batches "
             f"(the demo's)")
    rows = sweep(stages, batches, accum_dtype=acc)
    print(f"## SmolLM2, {len(stages) - 1} stages: {title}; {a.accum_dtype} accumulation\n")
    print(table(rows) + "\n")
    panels.append((title, rows))
    if a.tokens:
        n_b = math.ceil(len(seqs) / a.batch_size)
        long = [np.zeros((a.batch_size, a.tokens), dtype=np.int64) for _ in range(n_b)]
        long = [xp.asarray(b) for b in long]
        t2 = f"{n_b} batches of {a.batch_size} × {a.tokens} tokens"
        rows2 = sweep(stages, long, accum_dtype=acc)
        print(f"## SmolLM2: {t2}\n\n" + table(rows2) + "\n")
        panels.append((t2, rows2))
    bio.atomic_write_bytes(a.out, plot(panels, a.out))
    print(f"wrote {a.out}", file=sys.stderr)
    if a.check:
        layers = [f"blk.{i}.{k}" for i in (0, 15, 29) for k in ("attn_q", "attn_v",
                                                               "ffn_down")]
        short = sorted(seqs, key=len)[:4]
        print(f"## Real check: {len(short)} texts ({sum(map(len, short))} tokens), layers "
              f"{', '.join(layers)} across the whole chain\n")
        res = check(lm, short, layers=layers, accum_dtype=acc)
        from ._common import md_table

        print(md_table([["schedule", "stage evaluations", "passes", "layer ranges",
                         "peak (MiB)", "seconds", "factors bitwise = store-all"]]
                       + [[k, r["evals"], r["passes"], r["leaves"], _mib(r["peak"]),
                           f"{r['seconds']:.1f}", "yes" if r["identical"] else "NO"]
                          for k, r in res.items()]))
        if not all(r["identical"] for r in res.values()):
            return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
