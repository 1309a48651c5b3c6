"""The benchmark harness (not part of the library API): ``cpu`` measures the CPU engines
against the GEMM floor and writes docs/benchmarks/cpu.md, ``gpu`` the cuda engine on a GPU
(docs/benchmarks/gpu.md). Both call only the public ``bakron.solve``.

Commands: ``python -m bakron.benchmarks.cpu`` (also ``bakron bench`` and
``python -m bakron.bench``) and ``python -m bakron.benchmarks.gpu`` (also
``python -m bakron.bench_gpu``).
"""
