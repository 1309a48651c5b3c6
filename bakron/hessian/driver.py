"""The global-Hessian driver: every linear layer's Kronecker factors within a memory budget.

Memory model (what ``budget_bytes`` bounds and the report measures):

- *buffers*: the factor accumulators of the layers being collected, ``(n² + m²)`` entries of
  the accumulation dtype per linear (in a refinement step the fixed factor and the new one);
- *caches*: boundary states of the layer-range bisection, ``h_c`` and ``δ_c`` for every
  calibration batch;
- *activations*: the states and gradients between stages that the checkpoint schedule holds
  (snapshots, the state being advanced, the gradient being propagated).

Not counted: the caller's inputs and weights, the finished factors handed back, and
temporaries inside one stage's ``forward``/``vjp`` or one accumulator update (a few times one
state or one factor). Planning uses the largest batch; the ledger records the real run.
"""
from __future__ import annotations

import itertools
import math
import numbers
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import _xp
from .._lib.threads import cores
from .._validate import check_finite
from ..factors import estimator_folds
from .accumulate import (FactorAccumulator, frobenius_sq, gram_buffer, sequence_mix,
                         token_quadratic)
from .checkpoint import SCHEDULES, bisection_slots, split_point
from .crossfit import crossfit_folds
from .progress import Progress, progress_bar
from .stages import HeadContext, forward_collect, is_head, stage_label

__all__ = ["global_factors", "HessianReport", "SweepRecord", "plan_global"]

_STEP_KINDS = ("kfac", "refine_out", "refine_in")


# --------------------------------------------------------------------------------------------
# bookkeeping
# --------------------------------------------------------------------------------------------
class _Ledger:
    """Live bytes by kind (``act``, ``buf``, ``cache``) and live states, with their peaks."""

    def __init__(self):
        self.cur = {"act": 0, "buf": 0, "cache": 0}
        self.peak = dict(self.cur)
        self.total = self.peak_total = 0
        self.states = self.peak_states = 0

    def alloc(self, kind, nbytes, states=1):
        self.cur[kind] += nbytes
        self.total += nbytes
        self.states += states if kind == "act" else 0
        self.peak[kind] = max(self.peak[kind], self.cur[kind])
        self.peak_total = max(self.peak_total, self.total)
        self.peak_states = max(self.peak_states, self.states)

    def free(self, kind, nbytes, states=1):
        self.cur[kind] -= nbytes
        self.total -= nbytes
        self.states -= states if kind == "act" else 0

    def move(self, src, dst, nbytes):
        self.cur[src] -= nbytes
        self.states -= 1 if src == "act" else 0
        self.cur[dst] += nbytes
        self.peak[dst] = max(self.peak[dst], self.cur[dst])


@dataclass
class SweepRecord:
    """One pass over all calibration batches.

    ``kind``: ``"split"`` (stores the boundary states at ``cut``), ``"kfac"``,
    ``"refine_out"`` or ``"refine_in"``; stages ``[start, stop)``; the checkpoint schedule and
    its snapshots; forward stage evaluations, VJPs and head evaluations over all batches;
    ``seconds``: its wall time, ``cpu_seconds`` this process's CPU time (all its threads);
    ``tokens``: the real (unpadded) rows it went through.
    """

    kind: str
    start: int
    stop: int
    cut: int | None
    schedule: str
    snapshots: int
    stage_evals: int = 0
    vjp_evals: int = 0
    head_evals: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    tokens: int = 0


@dataclass
class HessianReport:
    """What :func:`global_factors` (or :func:`~bakron.hessian.input_factors`, with
    ``checkpoint="forward"``) did and how much memory it held."""

    n_stages: int
    n_batches: int
    n_layers: int
    budget_bytes: int | None
    checkpoint: str
    refine: str
    refine_iters: int
    sweeps: list = field(default_factory=list)
    leaf_ranges: list = field(default_factory=list)
    planned_peak_bytes: int = 0
    peak_bytes: int = 0
    peak_activation_bytes: int = 0
    peak_buffer_bytes: int = 0
    peak_cache_bytes: int = 0
    peak_states: int = 0
    seconds: float = 0.0

    @property
    def passes(self) -> int:
        """Passes over the calibration data (sweeps of any layer range)."""
        return len(self.sweeps)

    @property
    def stage_evals(self) -> int:
        return sum(s.stage_evals for s in self.sweeps)

    @property
    def vjp_evals(self) -> int:
        return sum(s.vjp_evals for s in self.sweeps)

    @property
    def head_evals(self) -> int:
        return sum(s.head_evals for s in self.sweeps)

    @property
    def recompute_factor(self) -> float:
        """Stage evaluations relative to storing everything in one range (1.0 = no recompute)."""
        base = self.n_stages * self.n_batches * (1 + 2 * self.refine_iters)
        return self.stage_evals / base

    def __str__(self) -> str:
        mib = 2.0 ** 20
        if self.checkpoint == "forward":   # (input_factors: one forward pass, no H_out)
            return (f"input factors (forward only): {self.n_layers} linear layers, "
                    f"{self.n_stages} stages, {self.n_batches} batches, stage evaluations "
                    f"{self.stage_evals}\n  peak {self.peak_bytes / mib:.2f} MiB (activations "
                    f"{self.peak_activation_bytes / mib:.2f}, buffers "
                    f"{self.peak_buffer_bytes / mib:.2f}), {self.seconds:.2f} s")
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / mib:.2f} MiB"
        return (f"global Hessians: {self.n_layers} linear layers, {self.n_stages} stages, "
                f"{self.n_batches} batches, budget {budget}\n"
                f"  passes {self.passes} (leaf ranges {self.leaf_ranges}), stage evaluations "
                f"{self.stage_evals} ({self.recompute_factor:.2f}x store-all), VJPs "
                f"{self.vjp_evals}\n"
                f"  peak {self.peak_bytes / mib:.2f} MiB (activations "
                f"{self.peak_activation_bytes / mib:.2f}, buffers "
                f"{self.peak_buffer_bytes / mib:.2f}, caches {self.peak_cache_bytes / mib:.2f}),"
                f" {self.peak_states} live states, {self.seconds:.2f} s")


# --------------------------------------------------------------------------------------------
# the reversal of one batch over stages [c, b), generic over a real or a dry-run engine
# --------------------------------------------------------------------------------------------
def _advance(eng, ledger, i, j, h, owned, keep=False):
    """Run stages i..j-1 forward from ``h``; returns the state at j and whether it is owned.
    ``keep``: stage j-1's VJP follows this evaluation: keep its tape (counted as activations)."""
    for k in range(i, j):
        h2 = eng.forward(k, h, keep and k == j - 1)
        ledger.alloc("act", eng.nbytes(h2))
        if keep and k == j - 1:
            ledger.alloc("act", eng.tape_nbytes(k), 0)
        if owned:
            ledger.free("act", eng.nbytes(h))
        h, owned = h2, True
    return h, owned


def _reverse(eng, ledger, c, b, h_c, d_b, schedule, s, need_bottom):
    """Run the VJPs of stages b-1, ..., c (the checkpoint schedule decides what is recomputed).

    ``h_c`` and ``d_b`` are held by the caller (not counted here); ``d_b=None`` evaluates the
    head after stage b-1. Returns ``δ_c`` (counted as an activation) or ``None``.
    """
    ckpt, owned = {c: h_c}, set()
    delta, d_owned = d_b, False
    stack = [(c, b, s)]
    while stack:
        i, j, si = stack.pop()
        if j - i == 1:
            if delta is None:  # the loss sits right after this stage
                z = eng.forward(i, ckpt[i], True)
                ledger.alloc("act", eng.nbytes(z))
                ledger.alloc("act", eng.tape_nbytes(i), 0)
                delta = eng.head(z)
                ledger.alloc("act", eng.nbytes(delta))
                ledger.free("act", eng.nbytes(z))
                del z
                d_owned = True
            need = need_bottom or i > c
            tape = eng.tape_nbytes(i)
            d_new = eng.vjp(i, ckpt[i], delta, need)
            ledger.free("act", tape, 0)
            if d_new is not None:
                ledger.alloc("act", eng.nbytes(d_new))
            if d_owned:
                ledger.free("act", eng.nbytes(delta))
            delta, d_owned = d_new, d_new is not None
            h = ckpt.pop(i)
            if i in owned:
                owned.discard(i)
                ledger.free("act", eng.nbytes(h))
            del h
            continue
        m = split_point(j - i, schedule, si)
        # with m = 1 stage i's VJP follows this evaluation (no recomputation): keep its tape
        h, _ = _advance(eng, ledger, i, i + m, ckpt[i], False, m == 1)
        ckpt[i + m] = h
        owned.add(i + m)
        del h
        stack.append((i, i + m, si))
        stack.append((i + m, j, si - 1))
    return delta


class _DryEngine:
    """States are byte counts: the same control code computes the memory a schedule needs.
    ``tapes``: the bytes of each stage's tape (``None``: no stage keeps one)."""

    def __init__(self, sizes, tapes=None):
        self.sizes = sizes
        self.tapes = tapes
        self.kept = set()
        self.evals = self.vjps = self.heads = 0

    @staticmethod
    def nbytes(x):
        return x

    def tape_nbytes(self, i):
        return self.tapes[i] if i in self.kept else 0

    def forward(self, i, h, keep=False):
        self.evals += 1
        if keep and self.tapes is not None and self.tapes[i]:
            self.kept.add(i)
        return self.sizes[i + 1]

    def head(self, z):
        self.heads += 1
        return self.sizes[-1]

    def vjp(self, i, h, d, need):
        self.vjps += 1
        self.kept.discard(i)
        return self.sizes[i] if need else None


def _simulate(sizes, a, c, b, loss, schedule, s, tapes=None):
    """Peak activation bytes and counts of one batch's sweep: advance a→c, reverse [c, b).
    ``tapes``: bytes of each stage's tape (kept where its VJP follows its evaluation)."""
    eng, led = _DryEngine(sizes, tapes), _Ledger()
    h, owned = _advance(eng, led, a, c, sizes[a], False)
    if owned:  # a split pass moves h_c into the cache
        led.move("act", "cache", h)
    d = _reverse(eng, led, c, b, h, None if loss else sizes[b], schedule, s, c > a)
    if d is not None:
        led.move("act", "cache", d)
    return led.peak["act"], led.peak_states, eng.evals, eng.vjps, eng.heads


# --------------------------------------------------------------------------------------------
# planning
# --------------------------------------------------------------------------------------------
@dataclass
class _Leaf:
    start: int
    stop: int
    schedule: str
    snapshots: int
    peak: int


@dataclass
class _Split:
    start: int
    stop: int
    cut: int
    schedule: str
    snapshots: int
    peak: int
    right: object
    left: object


@dataclass
class _Skip:
    start: int
    stop: int
    peak: int = 0


class _Planner:
    def __init__(self, sizes, batch_sizes, buf_bytes, names_at, budget, checkpoint, snapshots,
                 tapes=None):
        self.sizes = sizes                # bytes of state l (largest batch), l = 0..L
        self.tapes = tapes                # bytes of stage l's tape (largest batch), or None
        self.batch_sizes = batch_sizes    # per batch: bytes of state l
        self.buf = buf_bytes              # factor-buffer bytes per stage
        self.names_at = names_at
        self.L = len(sizes) - 1
        self.budget = budget
        self.checkpoint = checkpoint
        self.snapshots = snapshots

    def buffers(self, a, b):
        return sum(self.buf[a:b])

    def cache_bytes(self, c):
        return sum(bs[c] for bs in self.batch_sizes)

    def _fits(self, a, c, b, s, avail, schedule):
        peak = _simulate(self.sizes, a, c, b, b == self.L, schedule, s, self.tapes)[0]
        return peak <= avail, peak

    def choose(self, a, c, b, avail, minimum=1):
        """(schedule, snapshots, activation peak) for a sweep advancing a→c and reversing
        [c, b) within ``avail`` bytes, or ``None``."""
        l = b - c
        sched = self.checkpoint
        if sched == "auto" and self.budget is None:
            sched = "store_all"
        if sched in ("store_all", "bisection"):
            s = l if sched == "store_all" else bisection_slots(l)
            ok, peak = self._fits(a, c, b, s, avail, sched)
            return (sched, s, peak) if ok else None
        if self.snapshots is not None:  # binomial with a given number of snapshots
            s = min(self.snapshots, l)
            ok, peak = self._fits(a, c, b, s, avail, "binomial")
            return ("binomial", s, peak) if ok else None
        # auto / binomial: the most snapshots that fit (store-all when everything fits)
        ok, peak = self._fits(a, c, b, l, avail, "binomial")
        if ok:
            return ("binomial" if sched == "binomial" else "store_all", l, peak)
        lo, hi = 0, l - 1              # largest s in [minimum, l-1] that fits (peaks grow with s)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(a, c, b, mid, avail, "binomial")[0]:
                lo = mid
            else:
                hi = mid - 1
        if lo < minimum:
            return None
        return ("binomial", lo, self._fits(a, c, b, lo, avail, "binomial")[1])

    def split_point(self, a, b):
        best = None
        total = self.buffers(a, b)
        for c in range(a + 1, b):
            left = self.buffers(a, c)
            if left == 0 or left == total:
                continue
            key = (max(left, total - left), abs(2 * c - a - b), c)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]

    def plan(self, a, b, held):
        buf = self.buffers(a, b)
        if buf == 0:
            return _Skip(a, b)
        avail = None if self.budget is None else self.budget - held - buf
        if self.budget is None:
            sched, s, peak = self.choose(a, a, b, float("inf"))
            return _Leaf(a, b, sched, s, held + buf + peak)
        l = b - a
        prefer = min(l, bisection_slots(l)) if self.checkpoint in ("auto", "binomial") else 1
        leaf = self.choose(a, a, b, avail, prefer) if avail >= 0 else None
        if leaf is not None:
            return _Leaf(a, b, leaf[0], leaf[1], held + buf + leaf[2])
        c = self.split_point(a, b)
        failure = None
        if c is not None:
            hc, dc = self.cache_bytes(c), self.cache_bytes(c)
            split = self.choose(a, c, b, self.budget - held - hc - dc)
            if split is not None:
                try:
                    right = self.plan(c, b, held + hc + dc)
                    left = self.plan(a, c, held + dc)
                    return _Split(a, b, c, split[0], split[1], held + hc + dc + split[2],
                                  right, left)
                except _TooSmall as exc:
                    failure = exc
        if prefer > 1 and avail >= 0:   # splitting does not fit: accept more recomputation
            leaf = self.choose(a, a, b, avail, 1)
            if leaf is not None:
                return _Leaf(a, b, leaf[0], leaf[1], held + buf + leaf[2])
        raise self._too_small(a, b, held, c) from failure

    def _too_small(self, a, b, held, c):
        sched, s = self.checkpoint, self.snapshots
        if sched == "store_all":
            s = b - a
        elif sched == "bisection":
            s = bisection_slots(b - a)
        else:
            sched, s = "binomial", min(s or 1, b - a)
        need_act = _simulate(self.sizes, a, a, b, b == self.L, sched, s, self.tapes)[0]
        layers = ", ".join(repr(n) for i in range(a, b) for n in self.names_at[i])
        msg = (f"budget_bytes={self.budget} is too small: collecting layer(s) {layers} "
               f"(stages {a}..{b - 1}) needs {self.buffers(a, b)} bytes of factor buffers + "
               f"at least {need_act} bytes of activations ({sched}, {s} snapshots)")
        if held:
            msg += f", with {held} bytes of boundary states cached for it"
        if c is not None:
            msg += (f"; splitting at stage {c} would cache {2 * self.cache_bytes(c)} bytes of "
                    f"boundary states and does not fit either")
        need = held + self.buffers(a, b) + need_act
        return _TooSmall(msg + f". Give at least about {need} bytes, smaller calibration "
                               f"batches, or budget_bytes=None")


class _TooSmall(ValueError):
    """The memory budget cannot hold any schedule for a layer range."""


def _walk(node):
    if isinstance(node, _Split):
        yield node
        yield from _walk(node.right)
        yield from _walk(node.left)
    else:
        yield node


# --------------------------------------------------------------------------------------------
# the real engine
# --------------------------------------------------------------------------------------------
def _defer_checks(xp) -> bool:
    """Whether the finiteness checks of a pass are counted on the device and read once per
    batch (cupy: a host round trip per stage would stall the GPU)."""
    return _xp.is_cupy(xp)


class _Engine:
    def __init__(self, xp, body, head, seed, check):
        self.xp, self.body, self.head_stage = xp, body, head
        self.seed, self.check = seed, check
        self.draws = _head_draws(head)   # gradient rows per position (copy-major, axis 0)
        self.shapes = None
        self.batch = 0
        self.inputs = self.mask = None
        self.collect = None
        self.vjp_done = None      # called after each stage's vjp (drops per-stage caches)
        self.evals = self.vjps = self.heads = 0
        self.pending = []         # (what, device count of non-finite entries), see flush()
        self.tapes = {}           # stage index -> (tape, bytes): kept for its next VJP

    def nbytes(self, x):
        return math.prod(x.shape) * _itemsize(self.xp, x.dtype)

    def _check(self, x, what):
        if not self.check:
            return
        xp = self.xp
        if _defer_checks(xp):   # count on the device; flush() looks once per batch
            self.pending.append((what, xp.sum(xp.astype(~xp.isfinite(x), xp.int64))))
        elif not bool(xp.all(xp.isfinite(x))):
            self._raise_nonfinite(what, int(xp.sum(xp.astype(~xp.isfinite(x), xp.int64))))

    def _raise_nonfinite(self, what, bad):
        raise ValueError(f"non-finite {what} on calibration batch {self.batch}: {bad} NaN "
                         f"or Inf entr{'y' if bad == 1 else 'ies'}")

    def flush(self):
        """Raise for the first non-finite array of this batch that :meth:`_check` counted on
        the device (one host round trip per batch instead of one per stage)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        counts = _xp.to_numpy(self.xp.stack([c for _, c in pending]))
        for (what, _), bad in zip(pending, counts):
            if bad:
                self._raise_nonfinite(what, int(bad))

    def tape_nbytes(self, i):
        return self.tapes[i][1] if i in self.tapes else 0

    def forward(self, i, h, keep=False, collect=None):
        """Stage ``i``'s output; ``keep``: its VJP follows, so keep the stage's tape (when it
        has ``forward_tape`` and the head draws one row per position); ``collect(key, x)``:
        called with each linear weight's input rows (:func:`~bakron.hessian.forward_collect`,
        the forward-only pass)."""
        self.evals += 1
        stage = self.body[i]
        if collect is not None:
            y = forward_collect(stage, self.xp, h, collect)
        elif keep and _keeps_tape(stage, self.draws):
            if i in self.tapes:
                raise RuntimeError(f"stage {stage_label(stage, i)}: a tape is kept already")
            y, tape = stage.forward_tape(self.xp, h)
            self.tapes[i] = (tape, _tape_nbytes(self, tape))
        else:
            y = stage.forward(self.xp, h)
        if tuple(y.shape) != self.shapes[i + 1]:
            raise ValueError(f"stage {stage_label(self.body[i], i)} returned shape "
                             f"{tuple(y.shape)}, but its out_shape promised {self.shapes[i + 1]}")
        self._check(y, f"activation: the output of stage {stage_label(self.body[i], i)}")
        return y

    def head(self, z):
        self.heads += 1
        d = self.head_stage.grad(self.xp, z, HeadContext(self.batch, self.seed, self.inputs,
                                                         self.mask))
        want = (self.draws * z.shape[0],) + tuple(z.shape[1:])
        if tuple(d.shape) != want:
            raise ValueError(f"head {stage_label(self.head_stage)} returned a gradient of shape "
                             f"{tuple(d.shape)} for logits of shape {tuple(z.shape)} "
                             f"({self.draws} row(s) per position: {want})")
        self._check(d, f"gradient: the loss gradient of head {stage_label(self.head_stage)}")
        return d

    def vjp(self, i, h, d, need):
        self.vjps += 1
        stage = self.body[i]
        if self.draws > 1:   # one VJP over all the head's rows: the input repeated per row
            h = self.xp.concat([h] * self.draws, axis=0)
        kw = {"tape": self.tapes.pop(i)[0]} if i in self.tapes else {}
        r = stage.vjp(self.xp, h, d, self.collect_for(i), need_input_grad=need, **kw)
        del kw
        if self.vjp_done is not None:
            self.vjp_done()
        if need:
            want = self.shapes[i]
            if self.draws > 1:
                want = (self.draws * want[0],) + tuple(want[1:])
            if r is None or tuple(r.shape) != want:
                raise ValueError(f"stage {stage_label(stage, i)}: vjp returned "
                                 f"{'None' if r is None else tuple(r.shape)}, expected a "
                                 f"gradient of shape {want}")
            self._check(r, f"gradient: ∂loss/∂(input of stage {stage_label(stage, i)})")
            return r
        return None

    def collect_for(self, i):
        return lambda key, x, g: self.collect(i, key, x, g)


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def _keeps_tape(stage, draws: int) -> bool:
    """Whether the driver keeps ``stage``'s tape for its VJP (where that VJP follows the
    evaluation): the stage has ``forward_tape`` and the head draws one row per position (a
    VJP over ``draws`` rows reads the input repeated, not the tape). The plan and the engine
    both ask this."""
    return draws == 1 and hasattr(stage, "forward_tape")


def _head_draws(head) -> int:
    """The head's gradient rows per position (``draws``, default 1)."""
    k = getattr(head, "draws", 1)
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"head {stage_label(head)}: draws must be a positive integer, got "
                         f"{k!r}")
    return int(k)


def _as_batches(calib_inputs, batch_size):
    if hasattr(calib_inputs, "shape"):
        if batch_size is None:
            return [calib_inputs]
        if int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        N = calib_inputs.shape[0]
        return [calib_inputs[i:i + batch_size, ...] for i in range(0, N, int(batch_size))]
    if isinstance(calib_inputs, (list, tuple)):
        if batch_size is not None:
            raise ValueError("batch_size applies to a single array of calibration inputs; "
                             "calib_inputs is already a list of batches")
        return list(calib_inputs)
    raise ValueError(f"calib_inputs must be an array or a list of arrays (batches; the driver "
                     f"reads them more than once), got {type(calib_inputs).__name__}")


def _layer_names(body):
    names_at, shapes = [], {}
    for i, st in enumerate(body):
        lin = st.linears()
        here = []
        for key, (m, n) in lin.items():
            name = f"stage{i}" if key is None else key
            if name in shapes:
                raise ValueError(f"two linear layers are both named {name!r} (stage "
                                 f"{stage_label(st, i)}); names must be unique")
            shapes[name] = (int(m), int(n))
            here.append(name)
        names_at.append(here)
    return names_at, shapes


def _check_weights(xp, weights, batches, refine, refine_iters, ids=False):
    if weights is None:
        return [None] * len(batches)
    if len(weights) != len(batches):
        raise ValueError(f"weights has {len(weights)} entries but there are {len(batches)} "
                         f"calibration batches")
    out = []
    for k, (w, x) in enumerate(zip(weights, batches)):
        if w is None:
            out.append(None)
            continue
        lead = tuple(x.shape) if ids else tuple(x.shape[:-1])   # token ids have no feature axis
        if tuple(w.shape) != lead[:len(w.shape)] or len(w.shape) == 0:
            raise ValueError(f"weights[{k}] has shape {tuple(w.shape)}; batch {k} has shape "
                             f"{tuple(x.shape)}, so it needs {lead[:1]} (per sample) or "
                             f"{lead} (per token)")
        if refine == "sequence" and refine_iters and len(w.shape) != 1:
            raise ValueError(f"weights[{k}] has shape {tuple(w.shape)}: per-sequence "
                             f"refinement needs one weight per sequence, shape {lead[:1]}")
        w = xp.astype(w, xp.float64)
        check_finite(xp, w, f"weights[{k}]")
        if bool(xp.any(w < 0)):
            raise ValueError(f"weights[{k}] has negative entries")
        out.append(w)
    return out


def _token_weights(xp, w, lead, mask=None):
    """Flat per-row weights for rows with leading axes ``lead``: the batch's weights broadcast
    over the token axes, times the token mask (``None``: all ones)."""
    if mask is not None:
        m = xp.astype(mask, xp.float64)
        m = xp.reshape(m, tuple(m.shape) + (1,) * (len(lead) - len(m.shape)))
        w = m if w is None else m * xp.reshape(w, tuple(w.shape)
                                               + (1,) * (len(m.shape) - len(w.shape)))
    if w is None:
        return None
    w = xp.reshape(w, tuple(w.shape) + (1,) * (len(lead) - len(w.shape)))
    return xp.reshape(xp.broadcast_to(w, lead), (-1,))


def _tape_nbytes(eng, tape):
    """Bytes of the arrays in a (nested) tape."""
    if tape is None:
        return 0
    if isinstance(tape, (tuple, list)):
        return sum(_tape_nbytes(eng, t) for t in tape)
    return eng.nbytes(tape)


def _itemsize(xp, dtype):
    if xp.isdtype(dtype, "real floating"):
        return xp.finfo(dtype).bits // 8
    return xp.iinfo(dtype).bits // 8 if xp.isdtype(dtype, "integral") else 1


def _token_masks(xp, first, batches):
    """The first stage's ``token_mask`` of every batch (``None`` where it has none or where
    every position is real)."""
    fn = getattr(first, "token_mask", None)
    if fn is None:
        return [None] * len(batches)
    out = []
    for k, x in enumerate(batches):
        m = fn(xp, x)
        if m is None:
            out.append(None)
            continue
        lead = tuple(x.shape[:len(m.shape)])
        if tuple(m.shape) != lead or m.dtype != xp.bool:
            raise ValueError(f"stage {stage_label(first, 0)}: token_mask of batch {k} must be "
                             f"a boolean array over the batch axes of {tuple(x.shape)}, got "
                             f"{m.dtype} of shape {tuple(m.shape)}")
        if not bool(xp.any(m)):
            raise ValueError(f"calibration batch {k} has no real position (all padding)")
        out.append(None if bool(xp.all(m)) else m)
    return out


# --------------------------------------------------------------------------------------------
# the public driver
# --------------------------------------------------------------------------------------------
def plan_global(stages, calib_inputs, *, batch_size=None, budget_bytes=None, checkpoint="auto",
                snapshots=None, accum_dtype=None, layers=None, out_estimator="mean",
                in_estimator="mean") -> dict:
    """What :func:`global_factors` would run, without running it (``out_estimator``,
    ``in_estimator``: as there; a factor cross-fitted from K folds needs K buffers).

    Returns ``{"leaves": [(start, stop, schedule, snapshots), ...], "splits": [(start, stop,
    cut, schedule, snapshots), ...], "planned_peak_bytes": int}`` in execution order; raises
    the same errors (shapes, budget too small) as :func:`global_factors`.
    """
    P = _prepare(stages, calib_inputs, batch_size, budget_bytes, checkpoint, snapshots,
                 accum_dtype, None, "token", 0, layers, out_copies=estimator_folds(out_estimator),
                 in_copies=estimator_folds(in_estimator, "in_estimator"))
    nodes = list(_walk(P["plan"]))
    return {"leaves": [(n.start, n.stop, n.schedule, n.snapshots) for n in nodes
                       if isinstance(n, _Leaf)],
            "splits": [(n.start, n.stop, n.cut, n.schedule, n.snapshots) for n in nodes
                       if isinstance(n, _Split)],
            "planned_peak_bytes": max(n.peak for n in nodes)}


def _prepare(stages, calib_inputs, batch_size, budget_bytes, checkpoint, snapshots,
             accum_dtype, weights, refine, refine_iters, layers=None, products=None,
             out_copies=1, in_copies=1):
    stages = list(stages)
    if len(stages) < 2 or not is_head(stages[-1]):
        raise ValueError("stages must be a list of stages ending with a head (e.g. "
                         "SoftmaxCrossEntropy()), with at least one stage before it")
    body, head = stages[:-1], stages[-1]
    for i, st in enumerate(body):
        if is_head(st):
            raise ValueError(f"stage {stage_label(st, i)} is a head; only the last stage may "
                             f"be a head")
        for meth in ("out_shape", "forward", "vjp", "linears"):
            if not callable(getattr(st, meth, None)):
                raise ValueError(f"stage {stage_label(st, i)} has no {meth}() method; see "
                                 f"bakron.hessian.stages for the stage protocol")
    if checkpoint not in ("auto",) + SCHEDULES:
        raise ValueError(f"checkpoint must be 'auto' or one of {SCHEDULES}, got {checkpoint!r}")
    if snapshots is not None:
        if checkpoint not in ("binomial", "auto"):
            raise ValueError(f"snapshots applies to checkpoint='binomial', not {checkpoint!r}")
        if isinstance(snapshots, bool) or int(snapshots) != snapshots or snapshots < 1:
            raise ValueError(f"snapshots must be a positive integer (the segment's input "
                             f"counts as one), got {snapshots!r}")
        checkpoint = "binomial"
    if budget_bytes is not None and (isinstance(budget_bytes, bool)
                                     or not isinstance(budget_bytes, numbers.Real)
                                     or not math.isfinite(budget_bytes)
                                     or int(budget_bytes) != budget_bytes or budget_bytes <= 0):
        raise ValueError(f"budget_bytes must be a positive integer or None, got {budget_bytes!r}")
    if refine not in ("token", "sequence"):
        raise ValueError(f"refine must be 'token' or 'sequence', got {refine!r}")
    if isinstance(refine_iters, bool) or int(refine_iters) != refine_iters or refine_iters < 0:
        raise ValueError(f"refine_iters must be a non-negative integer, got {refine_iters!r}")

    batches = _as_batches(calib_inputs, batch_size)
    if not batches:
        raise ValueError("calib_inputs is empty: give at least one calibration batch")
    params = [a for st in stages for a in (st.arrays() if hasattr(st, "arrays") else ())]
    if weights is not None and (hasattr(weights, "shape")
                                or not isinstance(weights, (list, tuple))):
        raise ValueError("weights must be a list with one array (or None) per calibration "
                         "batch")
    xp = _xp.namespace(*batches, *params, *(weights or ()))
    feat = None
    ids = bool(getattr(body[0], "integer_inputs", False))
    for k, x in enumerate(batches):
        if not hasattr(x, "shape") or len(x.shape) < 2 or x.shape[0] == 0:
            raise ValueError(f"calibration batch {k} must have shape (batch, ..., features) "
                             f"with batch >= 1, got {getattr(x, 'shape', None)}")
        if ids:   # token ids: integers, and the sequence length may differ between batches
            if not xp.isdtype(x.dtype, "integral"):
                raise ValueError(f"calibration batch {k} must hold integer token ids for "
                                 f"stage {stage_label(body[0], 0)}, got dtype {x.dtype}")
            if feat is None:
                feat = len(x.shape)
            elif len(x.shape) != feat:
                raise ValueError(f"calibration batch {k} has shape {tuple(x.shape)}; batch 0 "
                                 f"has {feat} axes; all batches must have the same number")
            continue
        _xp.float_dtype(xp, x, f"calibration batch {k}")
        if feat is None:
            feat = tuple(x.shape[1:])
        elif tuple(x.shape[1:]) != feat:
            raise ValueError(f"calibration batch {k} has shape {tuple(x.shape)}; batch 0 has "
                             f"trailing shape {feat}; all batches must agree after axis 0")
        check_finite(xp, x, f"calibration batch {k}")
    weights = _check_weights(xp, weights, batches, refine, refine_iters, ids)

    # shapes of every state, for every batch (checks the chain before computing anything)
    shapes = []
    for x in batches:
        sh = [tuple(x.shape)]
        for i, st in enumerate(body):
            try:
                sh.append(tuple(st.out_shape(sh[-1])))
            except ValueError as exc:
                raise ValueError(f"shape mismatch at stage {i}: {exc}") from None
        shapes.append(sh)
    try:
        head.check_input(shapes[0][-1])
    except ValueError as exc:
        raise ValueError(f"shape mismatch at the head: {exc}") from None
    names_at, layer_shapes = _layer_names(body)
    if not layer_shapes:
        raise ValueError("the chain holds no linear layers: nothing to collect")
    skipped = {}
    if layers is not None:
        if isinstance(layers, str) or not all(isinstance(n, str) for n in layers):
            raise ValueError(f"layers must be a list of layer names, got {layers!r}")
        want = set(layers)
        unknown = sorted(want - set(layer_shapes))
        if unknown:
            some = ", ".join(repr(n) for n in list(layer_shapes)[:4])
            raise ValueError(f"layers: {', '.join(map(repr, unknown))} not in the chain (its "
                             f"layers are {some}, ...)")
        if not want:
            raise ValueError("layers is empty: name at least one layer to collect")
        skipped = {n: i for i, names in enumerate(names_at) for n in names if n not in want}
        names_at = [[n for n in names if n in want] for names in names_at]
        layer_shapes = {n: v for n, v in layer_shapes.items() if n in want}

    dtypes = ([] if ids else [x.dtype for x in batches]) + [
        a.dtype for a in params if xp.isdtype(a.dtype, "real floating")]
    if not dtypes:
        raise ValueError("the chain takes integer inputs but holds no floating parameters: "
                         "the activations' dtype is unknown")
    act_dtype = xp.result_type(*dtypes)
    itemsize = xp.finfo(act_dtype).bits // 8
    acc_dtype = xp.float64 if accum_dtype is None else accum_dtype
    if acc_dtype != xp.float64 and acc_dtype != xp.float32:
        raise ValueError(f"accum_dtype must be float32 or float64, got {accum_dtype!r}")
    acc_item = xp.finfo(acc_dtype).bits // 8
    if products is None:   # float32 activations: float32 products, summed per batch in acc_dtype
        prod_dtype = act_dtype if act_dtype == xp.float32 else acc_dtype
    elif products == xp.float32 or products == xp.float64:
        prod_dtype = products
    else:
        raise ValueError(f"products must be None, float32 or float64, got {products!r}")
    batch_sizes = [[math.prod(s) * itemsize for s in sh] for sh in shapes]
    if ids:   # state 0 is the ids themselves
        for bs, x in zip(batch_sizes, batches):
            bs[0] = math.prod(x.shape) * _itemsize(xp, x.dtype)
    masks = _token_masks(xp, body[0], batches)
    batch_tokens = [int(xp.sum(xp.astype(m, xp.int64))) if m is not None
                    else math.prod(x.shape if ids else x.shape[:-1])
                    for m, x in zip(masks, batches)]
    tokens = sum(batch_tokens)
    batch_tokens = list(itertools.accumulate(batch_tokens))   # done after batch k
    sizes = [max(bs[l] for bs in batch_sizes) for l in range(len(body) + 1)]
    # (a crossfitted factor is summed in folds: out_copies m x m, in_copies n x n buffers)
    buf = [sum((out_copies * layer_shapes[n][0] ** 2 + in_copies * layer_shapes[n][1] ** 2)
               * acc_item
               for n in names) for names in names_at]
    tapes = None   # a stage's tape: kept for its VJP where that follows its evaluation
    draws = _head_draws(head)
    if any(_keeps_tape(st, draws) for st in body):
        tapes = [max(int(st.tape_bytes(sh[i], itemsize)) for sh in shapes)
                 if _keeps_tape(st, draws) else 0 for i, st in enumerate(body)]
    planner = _Planner(sizes, batch_sizes, buf, names_at, budget_bytes, checkpoint, snapshots,
                       tapes)
    plan = planner.plan(0, len(body), 0)
    return dict(xp=xp, body=body, head=head, batches=batches, weights=weights, masks=masks,
                shapes=shapes, tokens=tokens,
                batch_tokens=batch_tokens,
                names_at=names_at, layer_shapes=layer_shapes, skipped=skipped,
                acc_dtype=acc_dtype, plan=plan, ids=ids, products=prod_dtype,
                batch_sizes=batch_sizes,
                checkpoint=checkpoint, out_copies=out_copies, in_copies=in_copies, buf=buf)


def global_factors(stages, calib_inputs, *, batch_size=None, budget_bytes=None,
                   checkpoint="auto", snapshots=None, refine_iters=0, refine="token", seed=0,
                   weights=None, accum_dtype=None, check_finite=True, sink=None, layers=None,
                   kfac_sink=None, products=None, progress=None, out_estimator="mean",
                   in_estimator="mean"):
    """Kronecker factors ``(H_in, H_out)`` of the Fisher for every linear layer of a chain.

    Parameters
    ----------
    stages : list
        Stages ``f_1, …, f_L`` followed by a head (e.g. ``SoftmaxCrossEntropy()``); see
        :mod:`bakron.hessian.stages` for the protocol.
    calib_inputs : array or list of arrays
        Calibration inputs ``(N, features)`` / ``(N, T, features)`` (split into batches of
        ``batch_size``), or a list of batches. Never modified. A chain whose first stage takes
        token ids (:class:`~bakron.hessian.Embedding`) takes integer batches ``(B, T)``,
        right-padded with negative ids (see :func:`~bakron.hessian.pad_batches`; ``T`` may
        differ between batches); padded positions count in no factor.
    budget_bytes : int, optional
        Working-memory budget (factor buffers + boundary caches + activations; see
        :mod:`bakron.hessian.driver`). ``None``: no limit (store everything, one range).
    checkpoint : {"auto", "store_all", "bisection", "binomial"}
        Activation checkpointing inside a pass. ``"auto"``: store all if it fits, else the
        binomial schedule with the most snapshots that fit. ``snapshots=k`` fixes the binomial
        schedule's snapshots. When even that does not fit, the layer range is bisected.
    refine_iters : int
        Power-iteration steps towards the nearest Kronecker product of the Fisher after the
        K-FAC pass; each step is one pass for ``H_out`` then one for ``H_in``.
    refine : {"token", "sequence"}
        Per-token (``E[(xᵀH_I x) g gᵀ]``) or per-sequence (``E[G_s H_I G_sᵀ]``) refinement.
    seed : int
        Seed of the head's label draws (per batch: ``(seed, batch index)``). A head with
        ``draws = R`` label rows per position (``LMHead(labels="fisher:K")``) makes every VJP
        one pass over ``R`` times the rows; ``H_out`` is the mean over the rows.
    weights : list, optional
        One array per batch: ``(B,)`` per sample or ``(B, T)`` per token (non-negative); the
        first stage's token mask multiplies them.
    accum_dtype : dtype, optional
        Accumulation dtype (float64 by default).
    products : dtype, optional
        Precision of each batch's factor products (``Σ_t x_t x_tᵀ`` over the batch's rows, a
        refinement step's quadratic forms). Default: float32 for float32 activations (each
        batch's float32 sum is added to the ``accum_dtype`` sum: twice the BLAS rate, relative
        errors of order 1e-6), else ``accum_dtype``. ``float64`` casts the rows first (exact
        products, as the float64 reference tests need).
    progress : bool or callable, optional
        ``True``: a progress bar on stderr (tokens done / total, tokens per second, the pass,
        the time left; shown only when stderr is a terminal). A callable receives a
        :class:`~bakron.hessian.progress.Progress` after every batch of every pass. Default:
        quiet.
    check_finite : bool
        Check every activation and gradient for NaN/Inf (a clear error naming the stage).
    sink : callable, optional
        ``sink(name, H_in, H_out)`` is called as soon as a layer's factors are final, and the
        returned dict stays empty (write factors out instead of keeping them). Without a sink
        nothing is handed out unless the whole run succeeds.
    layers : list of str, optional
        Collect only these layers (the backward pass still runs through the whole chain, so
        their factors are the same as in a full run); default all.
    kfac_sink : callable, optional
        With ``refine_iters > 0``: ``kfac_sink(name, H_in, H_out)`` receives the K-FAC factors
        of each layer before they are refined (``H_in`` is then the local ``E[x xᵀ]``), so
        that one run gives both (no extra pass). Not called without refinement.

    out_estimator : {"mean", "crossfit", "crossfit:K"}
        ``"mean"``: the K-FAC ``H_out``, the mean over every row. ``"crossfit"``: the rows of
        the even and of the odd batches are summed apart (one more ``m x m`` buffer per
        layer, counted in the budget) and combined by
        :func:`~bakron.hessian.crossfit.crossfit`: each half's eigenvectors with eigenvalues
        measured on the other half, which does not underestimate the factor's small
        directions as the mean does. ``"crossfit:K"``: batch ``k`` in fold ``k mod K`` (``K``
        buffers), combined by :func:`~bakron.hessian.crossfit.crossfit_folds` (``K``
        eigendecompositions per layer; ``"crossfit:2"`` is ``"crossfit"``). Refinement steps
        start from it. With one batch it is the mean; with fewer batches than folds, the
        folds there are. On the CPU the layers' eigendecompositions run two at a time.
    in_estimator : {"mean", "crossfit", "crossfit:K"}
        The same for ``H_in`` (``n x n`` buffers per fold; batch ``k`` in fold ``k mod K``).

    Returns
    -------
    factors : dict
        ``{layer name: (H_in, H_out)}`` in chain order; float64 (``accum_dtype``) arrays of the
        inputs' namespace and device, exactly symmetric.
    report : HessianReport
        Passes, stage evaluations, VJPs, peak bytes by kind, the plan's leaf ranges.
    """
    t0 = time.perf_counter()
    P = _prepare(stages, calib_inputs, batch_size, budget_bytes, checkpoint, snapshots,
                 accum_dtype, weights, refine, refine_iters, layers, products,
                 out_copies=estimator_folds(out_estimator),
                 in_copies=estimator_folds(in_estimator, "in_estimator"))
    xp, body, batches = P["xp"], P["body"], P["batches"]
    L = len(body)
    report = HessianReport(n_stages=L, n_batches=len(batches), n_layers=len(P["layer_shapes"]),
                           budget_bytes=budget_bytes, checkpoint=P["checkpoint"], refine=refine,
                           refine_iters=int(refine_iters))
    report.planned_peak_bytes = max(node.peak for node in _walk(P["plan"]))
    eng = _Engine(xp, body, P["head"], int(seed), check_finite)
    ledger = _Ledger()
    run = _Run(P, eng, ledger, report, refine, int(refine_iters), sink)
    run.kfac_sink = kfac_sink
    run.folded = P["out_copies"] > 1 or P["in_copies"] > 1   # (a factor summed in folds)
    run.progress, close = progress_bar(progress)
    run.passes = sum(1 if isinstance(nd, _Split) else 1 + 2 * int(refine_iters)
                     for nd in _walk(P["plan"]) if not isinstance(nd, _Skip))
    run.t0 = t0
    try:
        run.node(P["plan"])
    finally:
        close()
    results = {n: run.results[n] for names in P["names_at"] for n in names if n in run.results}
    report.peak_bytes = ledger.peak_total
    report.peak_activation_bytes = ledger.peak["act"]
    report.peak_buffer_bytes = ledger.peak["buf"]
    report.peak_cache_bytes = ledger.peak["cache"]
    report.peak_states = ledger.peak_states
    report.seconds = time.perf_counter() - t0
    return results, report


class _Run:
    """Executes a plan: split passes fill the boundary caches, leaves run their sweeps."""

    def __init__(self, P, eng, ledger, report, refine, refine_iters, sink):
        self.P, self.eng, self.ledger, self.report = P, eng, ledger, report
        self.xp = P["xp"]
        self.L = len(P["body"])
        self.refine, self.iters, self.sink = refine, refine_iters, sink
        self.h_cache, self.d_cache = {}, {}
        self.results = {}
        self.kfac_sink = None
        self.folded = False
        self.progress, self.passes, self.t0 = None, 0, time.perf_counter()

    def _crossfit_all(self, names, accs, emit=None, same_in=None) -> dict:
        """``{name: (H_in, H_out)}``, each cross-fitted where it was summed in folds, of the
        K-FAC accumulators ``accs`` (popped), in the products' precision; on the CPU two
        factors at a time (numpy's LAPACK and BLAS release the GIL: the eigendecompositions
        are most of the work, and a pass under a one-thread BLAS limit leaves the other cores
        idle). ``same_in``: layer -> the layer whose H_in sums it holds (q/k/v, gate/up),
        whose cross-fitted H_in it gets a copy of; an ``H_out`` accumulator of ``None`` (the
        forward-only pass) gives ``None``. With ``emit``, each layer is handed to
        ``emit(name, H_in, H_out)`` in order as soon as it is ready (the caller's solve of
        one layer overlaps the next ones' eigendecompositions) and left out of the returned
        dict."""
        xp, dtype = self.xp, self.P["products"]

        def fit(accs):
            folds = [a for a in accs if a.weight != 0]   # (fewer batches than folds)
            if len(folds) <= 1:   # one batch (or one fold weighted): nothing to measure on
                return (folds or accs)[0].finish()   # the mean
            return crossfit_folds(xp, [a.finish() for a in folds],
                                  [a.weight for a in folds], dtype=dtype)

        # a folded H_in shared by several layers is cross-fitted once (bitwise the same sums)
        same_in = same_in or {}
        lead = {n: (same_in.get(n) if same_in.get(n) in accs and self.P["in_copies"] > 1
                    else n) for n in names}
        uses = {}
        for n in names:
            uses[lead[n]] = uses.get(lead[n], 0) + 1

        out = {}
        workers = min(2, cores()) if _xp.is_numpy(xp) else 0
        pool = ThreadPoolExecutor(max_workers=workers) if workers > 1 else None

        class _Now:   # (a result computed at once: no pool)
            def __init__(self, fn, *a):
                self.value = fn(*a)

            def result(self):
                return self.value

        submit = (lambda fn, *a: _Now(fn, *a)) if pool is None else pool.submit
        try:
            # (every factor submitted at once; results taken in layer order, each dropped)
            jobs_in, jobs_out = {}, {}
            for n in names:
                acc = accs.pop(n)
                if lead[n] == n:
                    jobs_in[n] = submit(fit, acc[0])
                jobs_out[n] = None if acc[1] is None else submit(fit, acc[1])
                del acc

            def ready():
                for n in names:
                    k = lead[n]
                    H_in = jobs_in[k].result()
                    uses[k] -= 1
                    if uses[k]:   # (a copy: each layer owns its factors)
                        H_in = xp.asarray(H_in, copy=True)
                    else:
                        del jobs_in[k]
                    job = jobs_out.pop(n)   # (None: no H_out, the forward-only pass)
                    yield n, (H_in, None if job is None else job.result())
            for n, res in ready():
                if emit is None:
                    out[n] = res
                else:
                    emit(n, *res)
                del res
        finally:   # (after an error: drop what has not started)
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        return out

    def _h(self, a, k):
        return self.P["batches"][k] if a == 0 else self.h_cache[a][k]

    def _d(self, b, k):
        return None if b == self.L else self.d_cache[b][k]

    def _sweep(self, rec, a, c, b, on_batch=None):
        """One pass over all batches: advance a→c, reverse [c, b)."""
        eng, led = self.eng, self.ledger
        e0, v0, h0 = eng.evals, eng.vjps, eng.heads
        t0, c0 = time.perf_counter(), time.process_time()
        out_h, out_d = [], []
        for k in range(len(self.P["batches"])):
            eng.batch, eng.shapes = k, self.P["shapes"][k]
            eng.inputs, eng.mask = self.P["batches"][k], self.P["masks"][k]
            if on_batch is not None:
                on_batch(k)
            h, owned = _advance(eng, led, a, c, self._h(a, k), False)
            if owned:
                led.move("act", "cache", eng.nbytes(h))
                out_h.append(h)
            d = _reverse(eng, led, c, b, h, self._d(b, k), rec.schedule, rec.snapshots, c > a)
            del h
            eng.flush()
            if d is not None:
                led.move("act", "cache", eng.nbytes(d))
                out_d.append(d)
            if self.progress is not None:
                P = self.P
                done = len(self.report.sweeps) * P["tokens"] + P["batch_tokens"][k]
                self.progress(Progress(rec.kind, len(self.report.sweeps) + 1, self.passes,
                                       done, self.passes * P["tokens"],
                                       time.perf_counter() - self.t0))
        rec.stage_evals, rec.vjp_evals, rec.head_evals = (eng.evals - e0, eng.vjps - v0,
                                                          eng.heads - h0)
        rec.seconds = time.perf_counter() - t0
        rec.cpu_seconds = time.process_time() - c0
        rec.tokens = self.P["tokens"]
        self.report.sweeps.append(rec)
        return out_h, out_d

    def node(self, node):
        if isinstance(node, _Skip):
            return
        if isinstance(node, _Leaf):
            self.leaf(node)
            return
        a, b, c = node.start, node.stop, node.cut
        rec = SweepRecord("split", a, b, c, node.schedule, node.snapshots)
        self.eng.collect = lambda i, key, x, g: None
        self.h_cache[c], self.d_cache[c] = self._sweep(rec, a, c, b)
        self.eng.collect = None
        self.node(node.right)
        self._drop_cache(self.h_cache, c)
        self.node(node.left)
        self._drop_cache(self.d_cache, c)

    def _drop_cache(self, cache, c):
        states = cache.pop(c)
        self.ledger.free("cache", sum(self.eng.nbytes(s) for s in states), 0)

    def _batch_rows(self, k):
        """Batch ``k``'s per-row weights over its real rows and the flat row selection of
        those rows (``None``: every row is real)."""
        xp, P = self.xp, self.P
        mask, w = P["masks"][k], P["weights"][k]
        lead = tuple(P["shapes"][k][0]) if P["ids"] else tuple(P["shapes"][k][0][:-1])
        if mask is None:
            return _token_weights(xp, w, lead), None
        # the real rows as indices, found once per batch (a boolean selection in every layer
        # would be a host round trip per layer on a GPU)
        sel = xp.nonzero(xp.reshape(mask, (-1,)))[0]
        w_tok = None if w is None else xp.take(_token_weights(xp, w, lead, mask), sel, axis=0)
        return w_tok, (sel, math.prod(mask.shape))

    def _rows(self, x, n):
        """``x`` as (rows, n), the padded rows left out."""
        x = self.xp.reshape(x, (-1, n))
        st = self._state
        sel, w = st["sel"], st["w_tok"]
        if sel is None:
            if w is not None and w.shape[0] != x.shape[0]:
                raise ValueError(f"calibration batch {self.eng.batch}: a stage collected "
                                 f"{x.shape[0]} rows, but the batch's weights cover "
                                 f"{w.shape[0]} rows (its batch axes)")
            return x
        idx, positions = sel
        if positions != x.shape[0]:
            raise ValueError(f"calibration batch {self.eng.batch}: a stage collected "
                             f"{x.shape[0]} rows, but the batch has {positions} positions "
                             f"(its token mask)")
        return self.xp.take(x, idx, axis=0)

    def _copies(self, x, n, R):
        """``x`` of ``R`` stacked copies of the batch as (rows, n), each copy's padded rows left
        out (copy-major, like the head's label rows)."""
        x3 = self.xp.reshape(x, (R, -1, n))
        return self.xp.concat([self._rows(x3[r, ...], n) for r in range(R)], axis=0)

    def leaf(self, node):
        xp, P = self.xp, self.P
        a, b = node.start, node.stop
        self.report.leaf_ranges.append((a, b))
        names = [n for i in range(a, b) for n in P["names_at"][i]]
        owner = {n: i for i in range(a, b) for n in P["names_at"][i]}
        acc_dtype = P["acc_dtype"]
        dev = _xp.device(P["batches"][0])
        nbuf = sum(P["buf"][a:b])   # (this leaf's factor buffers, as the plan counts them)
        self.ledger.alloc("buf", nbuf, 0)
        current = {}
        state = {"w": None, "mask": None, "w_tok": None, "sel": None, "shared": None}
        self._state = state
        prod = P["products"]
        # on a GPU the collected rows are checked with the stages' outputs, once per batch;
        # on the CPU each product's diagonal is checked (the rows only to name a fault)
        defer = _defer_checks(xp) and self.eng.check
        chk = False if defer else "product"
        # reusable outputs of the factor products, by size: one for the shared input products
        # (kept while q/k/v or gate/up add them) and one for the rest; temporaries of one
        # update, not counted as buffers
        scratch = {}

        def out_buffer(size, kept):
            key = (size, kept)
            if key not in scratch:
                scratch[key] = gram_buffer(xp, size, prod)
            return scratch[key]

        def key_of(i, key):
            return f"stage{i}" if key is None else key

        def check_pair(i, name, x, g):
            m, n = P["layer_shapes"][name]
            if x.shape[-1] != n or g.shape[-1] != m or tuple(x.shape[:-1]) != tuple(g.shape[:-1]):
                raise ValueError(f"stage {stage_label(P['body'][i], i)} collected x of shape "
                                 f"{tuple(x.shape)} and g of shape {tuple(g.shape)} for layer "
                                 f"{name!r}, which is {m} x {n}")

        steps = ["kfac"] + ["refine_out", "refine_in"] * self.iters
        same_in = {}   # layer -> the layer whose H_in products it added (a shared input)
        emitted = False   # the layers were handed to the sink as they were cross-fitted
        for si, step in enumerate(steps):
            accs = {}
            # the factor a refinement step replaces holds the new sum (no fresh n x n memory
            # and its page faults), unless kfac_sink was handed it (the first two steps)
            reuse = si > 2 or self.kfac_sink is None
            if step == "kfac":
                for n in names:
                    m_, n_ = P["layer_shapes"][n]
                    # (H_in folds, H_out folds): each fold of batches apart (crossfit)
                    accs[n] = tuple([FactorAccumulator(size, xp=xp, dtype=acc_dtype, device=dev)
                                     for _ in range(P[copies])]
                                    for size, copies in ((n_, "in_copies"), (m_, "out_copies")))
            else:
                for n in names:
                    H_in, H_out = current[n]
                    fixed = H_in if step == "refine_out" else H_out
                    size = H_out.shape[0] if step == "refine_out" else H_in.shape[0]
                    old = H_out if step == "refine_out" else H_in
                    accs[n] = FactorAccumulator(size, xp=xp, dtype=acc_dtype, device=dev,
                                                divisor=frobenius_sq(xp, fixed),
                                                out=old if reuse else None)
                    del old
                    # the factor being replaced is no longer needed
                    current[n] = (H_in, None) if step == "refine_out" else (None, H_out)

            fixed = {}
            if step != "kfac":   # the fixed factors in the products' precision, once a step
                for n in names:
                    H = current[n][0 if step == "refine_out" else 1]
                    fixed[n] = H if H.dtype == prod else xp.astype(H, prod)

            def collect(i, key, x, g, _step=step, _accs=accs, _fixed=fixed):
                name = key_of(i, key)
                if P["skipped"].get(name, -1) == i:   # a layer the caller did not ask for
                    return
                if owner.get(name) != i:
                    raise ValueError(f"stage {stage_label(P['body'][i], i)} collected a layer "
                                     f"named {name!r} that its linears() does not declare")
                check_pair(i, name, x, g)
                m, n = P["layer_shapes"][name]
                w_tok = state["w_tok"]
                R = self.eng.draws
                seq = _step != "kfac" and self.refine == "sequence"
                if not seq:
                    # the rows of x once per distinct input (q/k/v and gate/up read one x):
                    # padded rows dropped, and in K-FAC its product formed once too
                    sh = state["shared"]
                    if sh is not None and sh[0] is x:
                        xs, gram = sh[1], sh[2]
                    else:   # with R label rows per position x is repeated R times: K-FAC's
                        # H_in takes it once, a refinement step pairs every copy with its g
                        xs = (self._rows(x, n) if R == 1 else
                              self._rows(x[:x.shape[0] // R], n) if _step == "kfac" else
                              self._copies(x, n, R))
                        gram = None
                        state["shared"] = sh = [x, xs, None, name]
                        if defer:
                            self.eng._check(xs, f"input of layer {name!r}")
                    g = self._rows(g, m) if R == 1 else self._copies(g, m, R)
                    if defer:
                        self.eng._check(g, f"output gradient of layer {name!r}")
                    if R > 1:
                        w_tok = state["w_rows"]
                if _step == "kfac":
                    if gram is None:
                        same_in[name] = None   # (formed its own product: no other's H_in)
                        sh[2] = _accs[name][0][state["in_fold"]]._update(
                            xp, xs, state["w_tok"], products=prod, keep=True, check=chk,
                            out=out_buffer(n, True))
                    else:   # (the H_in of the layer that formed it, while every batch agrees)
                        same_in[name] = sh[3] if same_in.get(name, sh[3]) == sh[3] else None
                        _accs[name][0][state["in_fold"]].add_product(*gram)
                    # H_out: the mean over the R rows of each position (weights repeated)
                    _accs[name][1][state["fold"]]._update(
                        xp, g, w_tok, products=prod, check=chk, out=out_buffer(m, False))
                    return
                if not seq:
                    # x_tᵀ H x_t >= 0 for the positive semi-definite factor H; clamping the
                    # rounding below 0 keeps the update a symmetric rank-k one (√c_t y_t)
                    if _step == "refine_out":
                        c = xp.maximum(token_quadratic(xp, xs, _fixed[name]), 0.0)
                        _accs[name]._update(xp, g, w_tok, c, products=prod, check=chk,
                                            out=out_buffer(m, False))
                    else:
                        c = xp.maximum(token_quadratic(xp, g, _fixed[name]), 0.0)
                        _accs[name]._update(xp, xs, w_tok, c, products=prod, check=chk,
                                            out=out_buffer(n, False))
                    return
                H_in, H_out = current[name]
                B = x.shape[0]
                X3, G3 = xp.reshape(x, (B, -1, n)), xp.reshape(g, (B, -1, m))
                w_seq = state["w"]   # R label rows: the R copies of each sequence averaged
                if R > 1 and w_seq is not None:
                    w_seq = xp.concat([w_seq] * R, axis=0)
                if _step == "refine_out":
                    _accs[name]._update_sequences(xp, G3, sequence_mix(xp, X3, H_in), w_seq)
                else:
                    _accs[name]._update_sequences(xp, X3, sequence_mix(xp, G3, H_out), w_seq)

            def on_batch(k):
                state["fold"] = k % P["out_copies"]   # (batch k's H_out fold: crossfit)
                state["in_fold"] = k % P["in_copies"]
                state["w"], state["mask"] = P["weights"][k], P["masks"][k]
                state["w_tok"], state["sel"] = self._batch_rows(k)
                w_tok, R = state["w_tok"], self.eng.draws
                state["w_rows"] = (None if w_tok is None or R == 1
                                   else xp.concat([w_tok] * R, axis=0))
                state["shared"] = None

            self.eng.collect = collect
            self.eng.vjp_done = lambda: state.__setitem__("shared", None)
            rec = SweepRecord(step, a, b, None, node.schedule, node.snapshots)
            self._sweep(rec, a, a, b, on_batch)
            if step == "kfac" and self.folded:
                # (without refinement the layers are final: hand each on as it is ready)
                emit = self.sink if not self.iters and self.sink is not None else None
                current.update(self._crossfit_all(names, accs, emit, same_in))
                emitted = emit is not None
            else:
                for n in names:   # finalise layer by layer, dropping each accumulator at once
                    acc = accs.pop(n)
                    if step == "kfac":
                        current[n] = (acc[0][0].finish(), acc[1][0].finish())
                    elif step == "refine_out":
                        current[n] = (current[n][0], acc.finish())
                    else:
                        current[n] = (acc.finish(), current[n][1])
                    del acc
            del accs
            scratch.clear()
            if step == "kfac" and self.iters and self.kfac_sink is not None:
                for n in names:
                    self.kfac_sink(n, *current[n])
        self.eng.collect = None   # the closure holds this leaf's factors: let them go
        self.eng.vjp_done = None
        if not emitted:
            for n in names:
                if self.sink is not None:
                    self.sink(n, *current[n])
                else:
                    self.results[n] = current[n]
        self.ledger.free("buf", nbuf, 0)
