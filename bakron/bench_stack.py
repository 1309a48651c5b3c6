"""``python -m bakron.bench_stack``: the stack benchmark of :mod:`bakron.benchmarks.stack`
(this module only forwards to it)."""
from __future__ import annotations

import sys

from .benchmarks.stack import main, make_stack  # noqa: F401

__all__ = ["main", "make_stack"]

if __name__ == "__main__":
    sys.exit(main())
