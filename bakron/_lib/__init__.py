"""Small helpers shared across bakron, one implementation per concept.

- :mod:`._lib.errors`: the error classes shared by the readers, the CLI and the Dask runner;
- :mod:`._lib.fs`: atomic file writes and fsync;
- :mod:`._lib.packing`: the packed-triangle layout of symmetric matrices (factor files);
- :mod:`._lib.special`: erf and the exact GELU in any array namespace;
- :mod:`._lib.proxy`: the proxy-error metrics of a rounded layer.

Nothing here imports the solvers or the engines.
"""
