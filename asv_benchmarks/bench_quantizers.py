"""Fitting a grid: ``UniformQuantizer.fit`` on a float32 weight (row, group of 128 and
asymmetric row grids). The runners fit one grid per layer on the host, so for large layers
the fit is a visible part of a layer's wall time (docs/benchmarks/gpu.md, "A Llama-3-8B
block through the runner")."""
import numpy as np

import bakron


class Fit:
    params = [["4096x4096", "14336x4096"], ["row", "group128", "row-asym"]]
    param_names = ["shape", "grid"]
    number = 1
    repeat = (3, 7, 30.0)

    def setup(self, shape, grid):
        m, n = (int(x) for x in shape.split("x"))
        self.W = np.random.default_rng(0).standard_normal((m, n)).astype(np.float32)
        self.kw = {"row": {}, "group128": {"granularity": "group", "group_size": 128},
                   "row-asym": {"symmetric": False}}[grid]

    def time_fit(self, shape, grid):
        bakron.UniformQuantizer.fit(self.W, 4, **self.kw)
