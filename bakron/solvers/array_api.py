"""The array-API engine: the reference executor of every schedule, on any array namespace and
with any quantizer (numpy, cupy, array-api-strict, ...). It keeps its state in a
:class:`~bakron.solvers._problem.Workspace` of its own and hands back the arrays it made."""
from __future__ import annotations

from ._problem import Problem, Workspace
from .antidiagonal import solve_accumulator, solve_direct
from .engines import Capabilities, EngineResult
from .naive import solve_naive
from .recursive import BASE_TILES, solve_recursive

NAME = "array_api"
CAPABILITIES = Capabilities(methods=("naive", "antidiagonal", "recursive"),
                            variants=("accumulator", "direct"))


def available() -> bool:
    return True


def auto_base(p: Problem) -> int:
    return BASE_TILES


def auto_method(p: Problem, base: int) -> str:
    """The recursion for anything larger than one base block, else the anti-diagonal."""
    return "recursive" if (p.M > base or p.N > base) else "antidiagonal"


def run(p: Problem, method: str, base: int, variant: str, *,
        max_naive_bytes: int | None = None) -> EngineResult:
    w = Workspace(p)
    if method == "naive":
        solve_naive(w, max_naive_bytes)
    elif method == "antidiagonal":
        (solve_direct if variant == "direct" else solve_accumulator)(w)
    elif method == "recursive":
        solve_recursive(w, base)
    else:
        raise ValueError(f"method={method!r} is not available on engine {NAME!r}")
    return EngineResult(values=w.Wq, codes=w.codes, targets=w.T,
                        info={"quantizer_calls": w.quantizer_calls})
