"""``python -m bakron.bench`` and ``bakron bench``: the CPU benchmark of
:mod:`bakron.benchmarks.cpu` (this module only forwards to it)."""
from __future__ import annotations

import sys

from .benchmarks.cpu import gptq_loop, floor_product, main, make_problem  # noqa: F401

__all__ = ["main", "gptq_loop", "floor_product", "make_problem"]

if __name__ == "__main__":
    sys.exit(main())
