"""What a solve works on: the inputs and their tile partition (:class:`Problem`, read by every
engine), and the array-API executor's working state (:class:`Workspace`: outputs, offsets,
quantizer calls)."""
from __future__ import annotations

import inspect

from .. import _xp
from .._validate import check_quantizer_output
from .schedule import tile_edges


class QuantizerCall:
    """Calls a tile quantizer on a batch, passing tile offsets when it accepts them."""

    def __init__(self, quantizer):
        if not callable(getattr(quantizer, "quantize", None)):
            raise TypeError("quantizer must have a method quantize(targets) -> (values, codes); "
                            f"got {type(quantizer).__name__}")
        self.quantizer = quantizer
        self.checked = False  # the first batch gets the full output check
        try:
            params = inspect.signature(quantizer.quantize).parameters
            self.positions = "rows" in params and "cols" in params
        except (TypeError, ValueError):
            self.positions = False

    def __call__(self, targets, rows, cols):
        if self.positions:
            out = self.quantizer.quantize(targets, rows=rows, cols=cols)
        else:
            out = self.quantizer.quantize(targets)
        values, codes = check_quantizer_output(self.quantizer, targets, out,
                                               full=not self.checked)
        self.checked = True
        return values, codes


class Problem:
    """Inputs and partition of one solve (engines read it and never write to it).

    ``W`` (m, n) in the working dtype; ``A_O`` (m, m) or ``None`` (one-sided), ``A_I`` (n, n),
    both cast to W's dtype. Tiles are ``tx x ty``; ``rows``/``cols`` are the tile edges.
    ``record_targets``: the caller wants every tile's target (for the loss identity).
    ``options``: the engines' options objects the caller gave (``options.as_options``); an
    engine reads its own with :meth:`options_for`.
    """

    def __init__(self, xp, W, A_O, A_I, quantizer, tile, *, record_targets=False,
                 options: tuple = ()):
        self.xp = xp
        self.options = tuple(options)
        self.W = W
        self.dtype = W.dtype
        self.device = _xp.device(W)
        self.m, self.n = W.shape
        self.A_O = None if A_O is None else xp.astype(A_O, W.dtype, copy=False)
        self.A_I = xp.astype(A_I, W.dtype, copy=False)
        self.tx, self.ty = tile
        self.rows = tile_edges(self.m, self.tx)
        self.cols = tile_edges(self.n, self.ty)
        self.M, self.N = len(self.rows) - 1, len(self.cols) - 1
        self.quantizer = quantizer
        self.qcall = QuantizerCall(quantizer)
        self.record_targets = bool(record_targets)

    @property
    def two_sided(self) -> bool:
        return self.A_O is not None

    def options_for(self, cls):
        """The caller's options of class ``cls`` (``bakron.solvers.options``), else the
        defaults."""
        from .options import pick
        return pick(self.options, cls)

    def eye(self, k: int):
        return self.xp.eye(k, dtype=self.dtype, device=self.device)

    def offsets(self, idx: list[int]):
        return self.xp.asarray(idx, dtype=self.xp.int64, device=self.device)

    def tile_shape(self, a: int, b: int) -> tuple[int, int]:
        return self.rows[a + 1] - self.rows[a], self.cols[b + 1] - self.cols[b]

    def group_by_shape(self, tiles):
        """Split a list of tiles into lists of equal shape (ragged edges give up to 4 groups)."""
        groups: dict = {}
        for t in tiles:
            groups.setdefault(self.tile_shape(*t), []).append(t)
        return list(groups.values())

    def tiles_of(self, X, tiles, r0: int = 0, c0: int = 0):
        """Stack the sub-arrays of ``X`` (whose element (0, 0) is W's (r0, c0)) for ``tiles``."""
        return self.xp.stack([X[self.rows[a] - r0:self.rows[a + 1] - r0,
                                self.cols[b] - c0:self.cols[b + 1] - c0] for a, b in tiles])


class Workspace(Problem):
    """The array-API executor's state for one solve of ``problem`` (its inputs, shared, plus):
    ``Wq`` receives the rounded values, ``codes`` the integer codes; ``F`` (allocated by the
    recursive solver) holds the feedback a block has received from outside; ``T`` (when
    targets are recorded) every tile's target; ``quantizer_calls`` counts the calls of
    ``quantizer.quantize``."""

    def __init__(self, problem: Problem):
        self.__dict__.update(problem.__dict__)
        xp = self.xp
        self.Wq = xp.zeros_like(self.W)
        self.codes = None
        self.codes_seen = False
        self.F = None
        self.T = xp.zeros_like(self.W) if self.record_targets else None
        self.quantizer_calls = 0

    def round_batch(self, tiles, T, Wt):
        """Quantize a batch of same-shape tiles ``tiles`` [(a, b), ...] with targets ``T``
        (k, tx, ty) and weights ``Wt``; store values/codes; return the errors ``Wt - values``."""
        xp = self.xp
        rows = self.offsets([self.rows[a] for a, _ in tiles])
        cols = self.offsets([self.cols[b] for _, b in tiles])
        values, codes = self.qcall(T, rows, cols)
        self.quantizer_calls += 1
        values = xp.astype(values, self.dtype)
        if codes is not None and self.codes is None and not self.codes_seen:
            self.codes = xp.zeros((self.m, self.n), dtype=codes.dtype, device=self.device)
        self.codes_seen = True
        for i, (a, b) in enumerate(tiles):
            r = slice(self.rows[a], self.rows[a + 1])
            c = slice(self.cols[b], self.cols[b + 1])
            self.Wq[r, c] = values[i, ...]
            if self.codes is not None and codes is not None:
                self.codes[r, c] = codes[i, ...]
            if self.T is not None:
                self.T[r, c] = T[i, ...]
        return Wt - values

    def error(self, r0: int, r1: int, c0: int, c1: int):
        """``E = W - Wq`` over the element ranges (a new array)."""
        return self.W[r0:r1, c0:c1] - self.Wq[r0:r1, c0:c1]
