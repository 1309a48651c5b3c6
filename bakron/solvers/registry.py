"""The engine registry: each engine name of ``solve(engine=...)`` and the module that holds it,
imported the first time a solve needs it (``import bakron`` imports no engine).

The engines import the contract (:mod:`bakron.solvers.engines`); the registry imports the
engines (by name); the solve (:mod:`bakron.solvers._execute`) asks the registry. Keeping the
registry apart from the contract keeps that chain free of cycles.
"""
from __future__ import annotations

import importlib

__all__ = ["ENGINE_MODULES", "load"]

#: every engine name ``solve`` accepts besides ``"auto"``, and the module that holds it
ENGINE_MODULES = {"array_api": "bakron.solvers.array_api",
                  "numba": "bakron.backends.numba_cpu",
                  "cuda": "bakron.backends.numba_cuda"}


def load(name: str):
    """The engine ``name``, or ``None`` when it cannot run here (imports fail, no device)."""
    modname = ENGINE_MODULES.get(name)
    if modname is None:
        raise ValueError(f"unknown engine {name!r}; choose from {['auto', *ENGINE_MODULES]}")
    try:
        mod = importlib.import_module(modname)
    except ImportError:
        return None
    try:
        ok = mod.available()
    except Exception:
        ok = False
    return mod if ok else None
