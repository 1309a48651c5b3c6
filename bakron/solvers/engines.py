"""The engine contract: what an engine declares, what ``solve`` asks of it, what it hands back.

An engine is an object (the engines here are modules) with:

``NAME``
    its name for ``solve(engine=...)``;
``CAPABILITIES``
    a :class:`Capabilities` table: methods, variants, dtypes, array namespaces, quantizer
    kinds, tile limits. ``solve`` consults it before any work (and the tests derive their
    skips from it);
``available() -> bool``
    whether it can run here (imports succeed, a device exists, ...);
``auto_base(p)``, ``auto_method(p, base)``
    its measured rules for ``base=None`` and ``method="auto"``;
``run(p, method, base, variant) -> EngineResult``
    solve :class:`~bakron.solvers._problem.Problem` ``p`` (read only) with a method of its
    table and hand back new arrays.

and, besides, the optional hooks its table declares in ``Capabilities.hooks`` (``HOOKS``:
the one-pass input and result checks, the stack layer's hooks; :class:`EngineHooks` gives
their signatures). ``solve`` and the stack layer call a hook only when the table declares it
(:func:`offers`) and otherwise do the work themselves, with array-API operations or item by
item; an engine leaves a hook out by not declaring it, never by a missing attribute.

``solve`` is the one public entry point: it validates, builds the ``Problem`` (the array
namespace is taken once there), picks the engine and calls ``run``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .. import _xp

#: quantizer kinds of the capability table
ANY_QUANTIZER = "any"          # anything with quantize(targets) -> (values, codes)
UNIFORM_FUSED = "uniform"      # a UniformQuantizer whose rounding the engine compiles in

#: The optional hooks of the contract (signatures: :class:`EngineHooks`), by name.
QUIET_BLAS = "quiet_blas"            # before the compiled checks: end BLAS's idle workers
COUNT_NONFINITE = "count_nonfinite"  # NaN/Inf count of an array in one pass
FACTOR_SCAN = "factor_scan"          # a factor's structure statistics in one pass
INPUT_CHECKS = "input_checks"        # all of solve's input statistics, one read-back
STACK_CHECKS = "stack_checks"        # all of the stack layer's input statistics, one read-back
SOLVE_STACK = "solve_stack"          # a stack chunk in one schedule (every launch all items)
STACK_METHOD = "stack_method"        # the method solve_stack runs for a stack, or None
STACK_THREADS = "stack_threads"      # threads on which the stack layer runs a chunk's items
HOOKS = (QUIET_BLAS, COUNT_NONFINITE, FACTOR_SCAN, INPUT_CHECKS, STACK_CHECKS, SOLVE_STACK,
         STACK_METHOD, STACK_THREADS)


@dataclass(frozen=True)
class Capabilities:
    """What an engine can run (checked by ``solve`` before any work).

    ``methods``: method names (``"antidiagonal"`` with one of ``variants``); ``dtypes``:
    dtype names; ``namespaces``: ``"any"`` or the array libraries (``"numpy"``, ``"cupy"``);
    ``quantizers``: ``ANY_QUANTIZER`` or ``UNIFORM_FUSED``; ``max_tile``: ``(t_x, t_y,
    t_x t_y)`` limits or ``None``; ``targets``: whether it records every tile's target."""

    methods: tuple[str, ...]
    variants: tuple[str, ...] = ("accumulator",)
    dtypes: tuple[str, ...] = ("float32", "float64")
    namespaces: tuple[str, ...] = ("any",)
    quantizers: str = ANY_QUANTIZER
    max_tile: tuple[int, int, int] | None = None
    targets: bool = True
    hooks: frozenset = frozenset()

    def __post_init__(self):
        hooks = frozenset(self.hooks)
        unknown = sorted(hooks - set(HOOKS))
        if unknown:
            raise ValueError(f"Capabilities.hooks: unknown hook(s) {unknown}; the hooks of "
                             f"the engine contract are {list(HOOKS)}")
        object.__setattr__(self, "hooks", hooks)

    def has(self, hook: str) -> bool:
        """Whether the engine declares the optional hook ``hook`` (one of ``HOOKS``)."""
        if hook not in HOOKS:
            raise ValueError(f"unknown hook {hook!r}; the hooks are {list(HOOKS)}")
        return hook in self.hooks

    def refusal(self, p) -> str | None:
        """Why this engine cannot take problem ``p`` at all (``None``: it can)."""
        if not any(p.dtype == getattr(p.xp, d, None) for d in self.dtypes):
            return f"dtype {p.dtype} (it runs {', '.join(self.dtypes)})"
        if "any" not in self.namespaces:
            name = "numpy" if _xp.is_numpy(p.xp) else "cupy" if _xp.is_cupy(p.xp) else \
                p.xp.__name__
            if name not in self.namespaces:
                return f"array type {name} (it runs {', '.join(self.namespaces)})"
            if name == "numpy" and not getattr(p.W.dtype, "isnative", True):
                return "non-native byte order"
        if self.quantizers == UNIFORM_FUSED and not is_plain_uniform(p.quantizer):
            return (f"quantizer {type(p.quantizer).__name__} (it fuses the rounding of "
                    f"bakron.UniformQuantizer and runs no other quantizer)")
        if self.max_tile is not None:
            mx, my, mxy = self.max_tile
            if p.tx > mx or p.ty > my or p.tx * p.ty > mxy:
                return f"tile {p.tx} x {p.ty} (at most {mx} x {my} and {mxy} elements)"
        if p.record_targets and not self.targets:
            return "return_targets=True"
        return None

    def runs(self, method: str, variant: str) -> bool:
        """Whether ``method`` (with ``variant`` for the anti-diagonal) is in the table."""
        return method in self.methods and (method != "antidiagonal" or variant in self.variants)


def is_plain_uniform(q) -> bool:
    """A :class:`bakron.UniformQuantizer` whose ``quantize`` is not overridden (so that an
    engine may compile its rounding in)."""
    from ..quantizers import UniformQuantizer

    return isinstance(q, UniformQuantizer) and type(q).quantize is UniformQuantizer.quantize


@dataclass
class EngineResult:
    """What an engine hands back: new arrays in W's namespace and device.

    ``info`` always has ``quantizer_calls``: the calls of ``quantizer.quantize`` (0 on engines
    that compile the rounding in); engines may add their own counts (``launches``, ...)."""

    values: Any
    codes: Any
    targets: Any = None
    info: dict = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    NAME: str
    CAPABILITIES: Capabilities

    def available(self) -> bool: ...

    def auto_base(self, p) -> int: ...

    def auto_method(self, p, base: int) -> str: ...

    def run(self, p, method: str, base: int, variant: str) -> EngineResult: ...


class EngineHooks(Protocol):
    """The optional hooks, each present exactly when ``CAPABILITIES.hooks`` names it."""

    def quiet_blas(self) -> None:
        """Before ``solve``'s compiled checks: quiet BLAS's idle threads (numba engine)."""

    def count_nonfinite(self, X) -> int | None:
        """NaN and Inf entries of ``X`` in one pass; ``None`` for arrays it does not take."""

    def factor_scan(self, A, block: int):
        """``(forbidden, row_any, first, col_any)`` of a factor (``numba_cpu.factor_scan``);
        ``None`` for arrays it does not take."""

    def input_checks(self, arrays: dict, blocks: dict):
        """``(nonfinite, forbidden, coarse_tile)`` dicts by name, one read-back; or ``None``."""

    def stack_checks(self, arrays: dict, blocks: dict):
        """Starts the stack's checks; a function reading ``(nonfinite, forbidden)``, or ``None``."""

    def solve_stack(self, chunk) -> list | None:
        """Solve a ``StackChunk`` into its outputs: one info dict per item, or ``None``."""

    def stack_method(self, p, items: int, method: str) -> str | None:
        """The method ``solve_stack`` runs for a stack of ``items`` like ``p``, or ``None``."""

    def stack_threads(self, chunk, cores: int) -> int:
        """Threads on which the stack layer runs the items of ``chunk`` (1: serially)."""


def offers(eng, hook: str) -> bool:
    """Whether the engine ``eng`` (``None``: no engine) declares the optional hook ``hook``."""
    return eng is not None and eng.CAPABILITIES.has(hook)
