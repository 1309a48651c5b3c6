"""Small helpers shared across bakron, one implementation per concept.

- :mod:`._lib.errors`: the error classes shared by the readers, the CLI and the Dask runner;
- :mod:`._lib.fs`: atomic file writes and fsync;
- :mod:`._lib.packing`: the packed-triangle layout of symmetric matrices (factor files);
- :mod:`._lib.special`: erf and the exact GELU in any array namespace;
- :mod:`._lib.proxy`: the proxy-error metrics of a rounded layer;
- :mod:`._lib.pipeline`: the per-layer pipeline of ``bakron quantize`` and the Dask runner.

Only :mod:`._lib.pipeline` imports the public API (:func:`bakron.quantize_layer`); the other
modules import nothing of bakron but :mod:`bakron._xp`.
"""
