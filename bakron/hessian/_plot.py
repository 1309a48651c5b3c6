"""Memory vs recomputation of ``global_factors`` over budgets, for a deep chain.

    python -m bakron.hessian._plot --out docs/images/hessian_memory.png

Runs a chain of ``--depth`` (Linear, GELU) pairs of width ``--width`` on ``--samples``
calibration inputs in ``--batches`` batches, at budgets from "everything fits" down to the
smallest that runs, for the automatic schedule (binomial checkpointing, then layer-range
bisection) and for fixed bisection / store-all checkpointing (each with range bisection when
needed). Prints a table and draws the peak bytes (ledger and, for numpy, the real traced
peak) against the stage evaluations relative to one store-all pass.
"""
from __future__ import annotations

import argparse
import tracemalloc

import numpy as np

from ._examples import deep_chain
from .driver import global_factors


def sweep(depth=32, width=128, samples=512, batches=2, points=24, schedules=None, seed=0):
    """Rows ``(schedule, budget, peak, traced_peak, recompute, passes, leaves, seconds)``."""
    stages = deep_chain(depth, width, seed=seed)
    X = np.random.default_rng(seed + 1).standard_normal((samples, width))
    bs = -(-samples // batches)
    _, full = global_factors(stages, X, batch_size=bs)
    top = full.peak_bytes
    rows = []
    for schedule in schedules or ("auto", "bisection", "store_all"):
        for budget in np.geomspace(top, top / 40, points).astype(int):
            try:
                tracemalloc.start()   # the sink drops finished factors: working memory only
                _, rep = global_factors(stages, X, batch_size=bs, budget_bytes=int(budget),
                                        checkpoint=schedule, sink=lambda *a: None)
                _, traced = tracemalloc.get_traced_memory()
            except ValueError:
                break
            finally:
                tracemalloc.stop()
            rows.append((schedule, int(budget), rep.peak_bytes, traced,
                         rep.recompute_factor, rep.passes, len(rep.leaf_ranges), rep.seconds))
    return rows, full


def plot(rows, full, out, title):
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2.0 ** 20
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    styles = {"auto": ("C0", "o", "auto (binomial, then range bisection)"),
              "bisection": ("C1", "s", "bisection checkpointing"),
              "store_all": ("C2", "^", "store-all (range bisection only)")}
    for sched, (color, marker, label) in styles.items():
        r, seen = [], set()
        for row in rows:      # one point per distinct plan (budgets that give the same plan)
            if row[0] == sched and (row[2], row[4]) not in seen:
                seen.add((row[2], row[4]))
                r.append(row)
        if not r:
            continue
        peak = np.array([row[2] for row in r]) / mib
        rec = np.array([row[4] for row in r])
        ax.plot(peak, rec, marker=marker, color=color, label=label, ms=4, lw=1.2)
        if sched == "auto":
            traced = np.array([row[3] for row in r]) / mib
            ax.plot(traced, rec, ls=":", color=color, lw=1,
                    label="auto: real peak (tracemalloc)")
        for row in r:   # passes over the calibration data
            ax.annotate(f"{row[5]}", (row[2] / mib, row[4]), fontsize=7, color=color,
                        textcoords="offset points", xytext=(3, 4))
    ax.axvline(full.peak_bytes / mib, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("peak working memory (MiB): activations + factor buffers + boundary caches")
    ax.set_ylabel("stage evaluations / one store-all pass")
    ax.set_title(title + "\n(labels: passes over the calibration data)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/images/hessian_memory.png")
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--points", type=int, default=24)
    a = p.parse_args(argv)
    rows, full = sweep(a.depth, a.width, a.samples, a.batches, a.points)
    mib = 2.0 ** 20
    print(f"{'schedule':10s} {'budget MiB':>10s} {'peak MiB':>9s} {'real MiB':>9s} "
          f"{'recompute':>9s} {'passes':>6s} {'ranges':>6s} {'s':>6s}")
    for sched, budget, peak, traced, rec, passes, leaves, sec in rows:
        print(f"{sched:10s} {budget / mib:10.2f} {peak / mib:9.2f} {traced / mib:9.2f} "
              f"{rec:9.2f} {passes:6d} {leaves:6d} {sec:6.2f}")
    title = (f"global_factors on {a.depth} x (Linear {a.width}x{a.width} + GELU), "
             f"{a.samples} samples in {a.batches} batches, float64")
    plot(rows, full, a.out, title)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
