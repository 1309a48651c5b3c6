"""Checkpoint schedules for reversing a chain of stages, and their cost formulas.

*Reversal* of a segment of ``l`` stages: the segment's input state is stored, the gradient at its
end is available (or the loss is evaluated there), and every stage's vector-Jacobian product
must run, last stage first. A VJP needs its stage's input state, so states are kept
(*snapshots*) or recomputed from an earlier snapshot by running stages forward.

``s`` snapshots count every state held for later use, the segment's input included; the
current state while running forward is extra. All three schedules split a segment at a point
``m`` (run ``m`` stages forward from the start, keep that state, reverse the right part, drop
it, reverse the left part):

- ``store_all``: ``m = 1`` at every level (``s = l``): ``l - 1`` forward evaluations.
- ``bisection``: ``m = ceil(l/2)``: at most ``ceil(log2 l) + 1`` snapshots,
  ``T(l) = m + T(l - m) + T(m)``, ``T(1) = 0`` evaluations (``k 2^(k-1)`` for ``l = 2^k``).
- ``binomial`` (revolve) with ``s`` snapshots: the fewest evaluations possible,
  ``F(l, s) = r l - C(s + r, r - 1)`` where ``r`` is the least integer with
  ``l <= C(s + r, s)`` (Griewank 1992; Griewank & Walther 2000).

When the loss is evaluated at the end of the segment (rather than a stored gradient being
available), the last stage runs forward once more: ``+1`` evaluation for every schedule.
"""
from __future__ import annotations

from functools import lru_cache
from math import comb

__all__ = ["SCHEDULES", "bisection_cost", "bisection_slots", "binomial_cost", "binomial_steps",
           "reversal_cost", "reversal_slots", "split_point"]

SCHEDULES = ("store_all", "bisection", "binomial")


def _check(l: int, s: int | None = None) -> None:
    if int(l) != l or l < 1:
        raise ValueError(f"the number of stages l must be a positive integer, got {l!r}")
    if s is not None and (int(s) != s or s < 1):
        raise ValueError(f"snapshots must be a positive integer (the segment's input counts "
                         f"as one), got {s!r}")


def binomial_steps(s: int, r: int) -> int:
    """``C(s + r, s)``: the most stages ``s`` snapshots reverse with every stage run at most
    ``r`` times forward (0 for ``r < 0``)."""
    return comb(s + r, s) if r >= 0 else 0


def _repetitions(l: int, s: int) -> int:
    r = 0
    while binomial_steps(s, r) < l:
        r += 1
    return r


def binomial_cost(l: int, s: int) -> int:
    """Fewest forward evaluations to reverse ``l`` stages with ``s`` snapshots (closed form)."""
    _check(l, s)
    r = _repetitions(l, s)
    return r * l - binomial_steps(s + 1, r - 1)


@lru_cache(maxsize=None)
def bisection_cost(l: int) -> int:
    """Forward evaluations of the bisection schedule:
    ``T(l) = m + T(l-m) + T(m)`` with ``m = ceil(l/2)``, ``T(1) = 0``."""
    _check(l)
    if l == 1:
        return 0
    m = (l + 1) // 2
    return m + bisection_cost(l - m) + bisection_cost(m)


@lru_cache(maxsize=None)
def bisection_slots(l: int) -> int:
    """Snapshots the bisection schedule holds at most: ``P(l) = max(1 + P(l-m), P(m))``;
    ``P(l) <= ceil(log2 l) + 1``."""
    _check(l)
    if l == 1:
        return 1
    m = (l + 1) // 2
    return max(1 + bisection_slots(l - m), bisection_slots(m))


def reversal_slots(l: int, schedule: str, snapshots: int | None = None) -> int:
    """Snapshots a schedule uses on ``l`` stages (``snapshots`` for binomial, capped at ``l``)."""
    _check(l)
    if schedule == "store_all":
        return l
    if schedule == "bisection":
        return bisection_slots(l)
    if schedule == "binomial":
        _check(l, snapshots)
        return min(int(snapshots), l)
    raise ValueError(f"checkpoint schedule must be one of {SCHEDULES}, got {schedule!r}")


def reversal_cost(l: int, schedule: str, snapshots: int | None = None, *,
                  loss: bool = False) -> int:
    """Forward stage evaluations to reverse ``l`` stages (``+1`` when the loss is at the end)."""
    _check(l)
    if schedule == "store_all":
        cost = l - 1
    elif schedule == "bisection":
        cost = bisection_cost(l)
    elif schedule == "binomial":
        cost = binomial_cost(l, reversal_slots(l, schedule, snapshots))
    else:
        raise ValueError(f"checkpoint schedule must be one of {SCHEDULES}, got {schedule!r}")
    return cost + (1 if loss else 0)


def split_point(l: int, schedule: str, s: int) -> int:
    """Stages to run forward before the next snapshot when reversing ``l >= 2`` stages with
    ``s`` snapshots free (the segment's input included)."""
    if schedule == "store_all":
        return 1
    if schedule == "bisection":
        return (l + 1) // 2
    if s >= l:
        return 1
    if s == 1:
        return l - 1
    best_m, best = 1, None
    for m in range(1, l):  # m + F(l - m, s - 1) + F(m, s) is minimal for the optimal split
        c = m + binomial_cost(l - m, s - 1) + binomial_cost(m, s)
        if best is None or c < best:
            best_m, best = m, c
    return best_m
