"""Small helpers shared across bakron, one implementation per concept.

- :mod:`._lib.errors`: the error classes shared by the readers, the CLI and the Dask runner;
- :mod:`._lib.fs`: atomic file writes, write-once publication, fsync (every temporary file,
  fsync and rename of bakron's outputs);
- :mod:`._lib.lapack`: eigendecompositions of float32 numpy matrices in float32 (LAPACK's
  ``ssyevd`` through scipy, the GIL released);
- :mod:`._lib.packing`: the packed-triangle layout of symmetric matrices (factor files);
- :mod:`._lib.special`: erf and the exact GELU in any array namespace;
- :mod:`._lib.symmetric`: ``(H + Hᵀ) / 2``, ``max |H - Hᵀ|`` and mirroring a triangle, tile by
  tile (bitwise the plain expressions, several times faster on wide numpy factors);
- :mod:`._lib.proxy`: the proxy-error metrics of a rounded layer;
- :mod:`._lib.threads`: BLAS thread limits (threadpoolctl) and the cores the process may use.

These modules import nothing of bakron but :mod:`bakron._xp` and (to write a safetensors file)
:mod:`bakron._safetensors`; the per-layer pipeline, which uses the public API, is
:mod:`bakron.pipeline`.
"""
