"""Compiled engines for bakron, installed as ``bakron.backends``.

Each engine here is a module that satisfies the engine contract of
:mod:`bakron.solvers.engines` (``NAME``, ``CAPABILITIES``, ``available``, ``auto_base``,
``auto_method``, ``run``) and executes the plans of :mod:`bakron.solvers.schedule` with its own
kernels:

``numba_cpu`` (engine ``"numba"``)
    numba CPU kernels (``_numba_kernels``) and BLAS;
``numba_cuda`` (engine ``"cuda"``)
    a numba-cuda kernel (``_cuda_kernels``, launch layout in ``_cuda_layout``) and cuBLAS.

They are imported lazily by :func:`bakron.solvers.registry.load` (``import bakron`` never
imports numba or cupy). docs/architecture.md says where a new engine goes.
"""
