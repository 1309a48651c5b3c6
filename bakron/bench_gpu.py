"""``python -m bakron.bench_gpu``: the GPU benchmark of :mod:`bakron.benchmarks.gpu` (this
module only forwards to it)."""
from __future__ import annotations

import sys

from .benchmarks.gpu import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
