"""Make the figures of docs/algorithm.md (docs/images/*.png).

The processing orders in the figures are not drawn by hand: each is recorded from a real
``bakron.solve`` call through a tile quantizer that notes which tiles every call rounds.

    python docs/scripts/figures.py          # writes docs/images/antidiagonal.png, recursion.png
"""
from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

import bakron  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
IMAGES = os.path.join(os.path.dirname(HERE), "images")


class Recorder:
    """A tile quantizer that rounds like ``inner`` and records the tiles of every call."""

    def __init__(self, inner, tile):
        self.inner, self.tile, self.calls = inner, tile, []

    def quantize(self, targets, rows=None, cols=None):
        self.calls.append([(int(r) // self.tile, int(c) // self.tile) for r, c in zip(rows, cols)])
        return self.inner.quantize(targets, rows=rows, cols=cols)


def record_order(M, N, t, method, **kw):
    """(M, N) array: index of the quantizer call that rounded each tile."""
    rng = np.random.default_rng(0)
    m, n = M * t, N * t
    W = rng.standard_normal((m, n))
    X = rng.standard_normal((4 * n, n))
    Y = rng.standard_normal((4 * m, m))
    f_in = bakron.prepare_factor(X.T @ X, t)
    f_out = bakron.prepare_factor(Y.T @ Y, t)
    rec = Recorder(bakron.UniformQuantizer(3, 0.5), t)
    res = bakron.solve(W, f_out.A, f_in.A, rec, tile=t, method=method, engine="array_api", **kw)
    order = -np.ones((M, N), dtype=int)
    for i, tiles in enumerate(rec.calls):
        for a, b in tiles:
            assert order[a, b] < 0, "a tile was rounded twice"
            order[a, b] = i
    assert (order >= 0).all(), "a tile was never rounded"
    return order, res


def grid(ax, M, N):
    ax.set_xlim(0, N)
    ax.set_ylim(M, 0)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(N) + 0.5, [str(b) for b in range(N)])
    ax.set_yticks(np.arange(M) + 0.5, [str(a) for a in range(M)])
    ax.tick_params(length=0, labelsize=8)
    ax.set_xlabel("column tile b (inputs)")
    ax.set_ylabel("row tile a (outputs)")
    for x in range(N + 1):
        ax.axvline(x, color="white", lw=1)
    for y in range(M + 1):
        ax.axhline(y, color="white", lw=1)


def show_order(ax, order, cmap="viridis"):
    M, N = order.shape
    ax.imshow(order.max() - order, cmap=cmap, extent=(0, N, M, 0), interpolation="nearest")
    for a in range(M):
        for b in range(N):
            ax.text(b + 0.5, a + 0.5, str(order[a, b] + 1), ha="center", va="center",
                    fontsize=7, color="white" if order[a, b] > order.max() * 0.45 else "black")
    grid(ax, M, N)


def antidiagonal_figure(path):
    M, N, t = 6, 8, 4
    order, _ = record_order(M, N, t, "antidiagonal")
    # every call is one anti-diagonal, bottom-right first
    assert order.max() + 1 == M + N - 1
    assert all(order[a, b] == (M - 1 + N - 1) - (a + b) for a in range(M) for b in range(N))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    ax = axes[0]
    a0, b0 = 2, 3
    img = np.zeros((M, N))
    img[a0:, b0:] = 1
    img[a0, b0] = 2
    ax.imshow(img, cmap=matplotlib.colors.ListedColormap(["#e8e8e8", "#9ecae1", "#de2d26"]),
              extent=(0, N, M, 0), vmin=0, vmax=2, interpolation="nearest")
    grid(ax, M, N)
    ax.text(b0 + 0.5, a0 + 0.5, "(a,b)", ha="center", va="center", fontsize=8, color="white")
    for (k, l) in [(M - 1, N - 1), (a0, N - 1), (M - 1, b0), (a0 + 2, b0 + 2)]:
        ax.add_patch(FancyArrowPatch((l + 0.5, k + 0.5), (b0 + 0.75, a0 + 0.75),
                                     arrowstyle="->", mutation_scale=10, color="#08519c", lw=1))
    ax.set_title("tile (a,b) gets feedback from tiles (k,l),\nk ≥ a and l ≥ b (blue)", fontsize=10)

    show_order(axes[1], order)
    axes[1].set_title(f"anti-diagonal wavefront: quantizer call of each tile\n"
                      f"({M + N - 1} calls = M + N − 1, one per anti-diagonal)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recursion_figure(path):
    M = N = 8
    t, base = 4, 2
    order, res = record_order(M, N, t, "recursive", base=base)
    _, res_ad = record_order(M, N, t, "antidiagonal")
    assert np.array_equal(res.values, res_ad.values), "recursive and anti-diagonal differ"

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    ax = axes[0]
    ax.set_xlim(0, 2)
    ax.set_ylim(2, 0)
    ax.set_aspect("equal")
    ax.axis("off")
    colors = {"A": "#fdd0a2", "B": "#c6dbef", "C": "#c6dbef", "D": "#c7e9c0"}
    pos = {"A": (0, 0), "B": (1, 0), "C": (0, 1), "D": (1, 1)}
    step = {"D": "1. solve D", "B": "3. solve B", "C": "3. solve C", "A": "5. solve A"}
    for q, (x, y) in pos.items():
        ax.add_patch(Rectangle((x, y), 1, 1, facecolor=colors[q], edgecolor="black"))
        ax.text(x + 0.5, y + 0.42, q, ha="center", va="center", fontsize=20)
        ax.text(x + 0.5, y + 0.7, step[q], ha="center", va="center", fontsize=9)
    kw = dict(arrowstyle="-|>", mutation_scale=14, lw=1.5)
    ax.add_patch(FancyArrowPatch((1.5, 1.15), (1.5, 0.85), color="#238b45", **kw))
    ax.add_patch(FancyArrowPatch((1.15, 1.5), (0.85, 1.5), color="#238b45", **kw))
    ax.add_patch(FancyArrowPatch((1.15, 0.5), (0.85, 0.5), color="#d94801", **kw))
    ax.add_patch(FancyArrowPatch((0.5, 1.15), (0.5, 0.85), color="#d94801", **kw))
    ax.add_patch(FancyArrowPatch((1.12, 1.12), (0.88, 0.88), color="#d94801", **kw))
    ax.text(1.0, 2.12, "2. D's errors → offsets F of B and C (green);  4. B, C, D → A (orange)",
            ha="center", va="top", fontsize=8.5)
    ax.set_title("one level of the quadrant recursion\n(rows R1/R2 × columns C1/C2)",
                 fontsize=10)

    show_order(axes[1], order, cmap="magma")
    for x in (N // 2,):
        axes[1].axvline(x, color="cyan", lw=2.5)
    for y in (M // 2,):
        axes[1].axhline(y, color="cyan", lw=2.5)
    for q, (x, y) in {"A": (0, 0), "B": (N // 2, 0), "C": (0, M // 2), "D": (N // 2, M // 2)}.items():
        axes[1].text(x + 0.12, y + 0.3, q, color="cyan", fontsize=11, fontweight="bold")
    axes[1].set_title(f"recorded call order, {M}×{N} tiles, base block {base}×{base} tiles\n"
                      f"({order.max() + 1} quantizer calls; same Ŵ as the wavefront)",
                      fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    out = (argv or sys.argv[1:] or [IMAGES])[0]
    os.makedirs(out, exist_ok=True)
    antidiagonal_figure(os.path.join(out, "antidiagonal.png"))
    recursion_figure(os.path.join(out, "recursion.png"))
    print(f"wrote {out}/antidiagonal.png, {out}/recursion.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
