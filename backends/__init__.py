"""Compiled engines for bakron, installed as ``bakron.backends``.

An engine is a module here that is imported lazily (numba and cupy are never imported by
``import bakron``). Each engine module provides:

``available() -> bool``
    whether it can run here (imports succeed, a device exists, ...).
``supports(p) -> bool``
    whether it can solve the problem ``p`` (a :class:`bakron.solvers._problem.Problem`):
    its array namespace, dtype, quantizer type.
``solve_block(p, ra, rb, ca, cb) -> None``
    the base case: round tiles ``[ra, rb) x [ca, cb)`` of ``p`` with targets
    ``W + F + (feedback from inside the block)``, writing ``p.Wq`` and ``p.codes``
    (and ``p.T`` when it is not ``None``), bit-identical to the array-API path.

and optionally ``solve(p, method, base, variant) -> bool`` to run a whole method itself (returning
``False`` to fall back to the generic driver).
"""
from __future__ import annotations

import importlib

#: engine name -> module name inside this package
ENGINES = {"numba": "numba_cpu", "cuda": "numba_cuda"}


def load(engine: str):
    """Import an engine module, or return ``None`` when it does not exist or cannot run."""
    modname = ENGINES.get(engine)
    if modname is None:
        raise ValueError(f"unknown engine {engine!r}; choose from "
                         f"{['auto', 'array_api', *ENGINES]}")
    try:
        mod = importlib.import_module(f"{__name__}.{modname}")
    except ImportError:
        return None
    try:
        ok = mod.available()
    except Exception:
        ok = False
    return mod if ok else None
