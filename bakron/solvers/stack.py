"""Stacks of layers: :func:`bakron.solve` on ``W`` of shape ``(..., m, n)``.

The leading axes are a *stack* (batch) in the Array API's ``linalg`` sense: ``W`` ``(..., m,
n)``, ``A_out`` ``(..., m, m)`` or ``None``, ``A_in`` ``(..., n, n)``; their leading shapes
broadcast (a factor of shape ``(m, m)`` or ``(1, m, m)`` is shared by every item). The
quantizer is one object shared by every item or a sequence with one quantizer per item (flat,
in C order over the stack shape). Every item is solved exactly as :func:`bakron.solve` would
solve it alone: the result is bitwise identical to the one-by-one loop.

How a stack runs (``SolveResult.info["stack"]`` says which path ran):

1. Everything is validated before any work (shapes, lengths, dtypes, devices, tiles, every
   factor's structure, the engine), once for the stack (on the GPU the checks of the
   values run as kernels while the host checks the rest).
2. The stack is cut into *chunks* whose working memory fits ``max_bytes`` (``4 m n`` elements
   per item at most, besides the inputs and the stacked outputs).
3. A chunk goes to the engine in one call when the engine's capability table declares the
   hook ``solve_stack`` (a one-launch GPU version); otherwise its items go to their engine
   one by one (what the single-layer solve runs after its checks), on ``workers`` threads
   when the engine declares the rule ``stack_threads(chunk, cores)`` and it says so (its
   kernels release the GIL), with BLAS and numba threads split so that workers × threads ≤
   cores.

See docs/stacks.md for the engine contract and the measurements.
"""
from __future__ import annotations

import math
import os
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import _xp
from .._validate import check_factor_shape, check_finite, check_tile, factor_array, native
from . import _execute as solvers  # the single-layer solve's engine choice and checks
from ._execute import METHODS, SolveResult
from .engines import COUNT_NONFINITE, SOLVE_STACK, STACK_CHECKS, STACK_THREADS, offers
from .options import as_options
from .._lib.threads import blas_limit, cores
from ._stack_items import ItemRunner, engine_check

__all__ = ["solve_stack", "StackChunk", "stack_shape"]

#: Upper bound on the working memory of one item, in elements of W's dtype: the single-layer
#: solve's own buffers (about 2.4 m n for the recursion) and the item's output before it is
#: copied into the stack.
ITEM_WORK_MN = 4


@dataclass
class StackChunk:
    """Items ``[start, stop)`` of a validated stack, as an engine's ``solve_stack`` gets them.

    ``W``, ``A_out``, ``A_in`` are the flattened inputs (``(k, m, n)``, ``(kO, m, m)`` or
    ``None``, ``(kI, n, n)``; factors already in W's dtype) and ``w_index``, ``out_index``,
    ``in_index`` map an item (0 … B-1) to its row in each; ``quantizers[i]`` is item ``i``'s
    quantizer. The engine writes ``values[i]`` (and ``codes[i]``, ``targets[i]`` when those
    are not ``None``) for ``i`` in the chunk and returns a list of per-item ``info`` dicts, or
    ``None`` to decline (the stack layer then solves the items one by one). ``options``:
    the caller's engine options (``Problem.options``).
    """

    start: int
    stop: int
    W: Any
    A_out: Any
    A_in: Any
    w_index: np.ndarray
    out_index: np.ndarray | None
    in_index: np.ndarray
    quantizers: list
    tile: tuple
    method: str
    base: int | None
    variant: str
    values: Any
    codes: Any
    targets: Any
    options: tuple = ()

    def item(self, i: int):
        """``(W_i, A_out_i, A_in_i, quantizer_i)`` of item ``i`` (2-D views)."""
        A_out = None if self.A_out is None else self.A_out[int(self.out_index[i]), ...]
        return (self.W[int(self.w_index[i]), ...], A_out, self.A_in[int(self.in_index[i]), ...],
                self.quantizers[i])


def stack_shape(W, A_out, A_in) -> tuple[int, ...]:
    """The broadcast stack shape of ``W`` ``(..., m, n)`` and the factors, or a ``ValueError``
    naming the shapes that do not broadcast."""
    parts = [("W", W), ("A_out", A_out), ("A_in", A_in)]
    shapes = {name: tuple(a.shape[:-2]) for name, a in parts if a is not None}
    try:
        return tuple(np.broadcast_shapes(*shapes.values()))
    except ValueError:
        desc = ", ".join(f"{k} {v}" for k, v in shapes.items())
        raise ValueError(f"the stack shapes do not broadcast: {desc} (the leading axes of W, "
                         f"A_out and A_in must broadcast as in numpy; use shape 1 or no axis "
                         f"for a factor shared by every item)") from None


def _namespace(W, A_out, A_in):
    try:
        return _xp.namespace(W, A_out, A_in)
    except TypeError as e:
        kinds = ", ".join(f"{n} {type(a).__module__}.{type(a).__name__}"
                          for n, a in (("W", W), ("A_out", A_out), ("A_in", A_in))
                          if a is not None)
        raise TypeError(f"W, A_out and A_in must be arrays of one array library on one device; "
                        f"got {kinds} ({e})") from None


def _check_stack_array(a, name: str, what: str) -> None:
    if not hasattr(a, "shape") or len(a.shape) < 2:
        raise ValueError(f"{name} must have shape {what}, got shape {getattr(a, 'shape', None)}")


def _check_factor_dtype(xp, A, name: str) -> None:
    if not (A.dtype == xp.float32 or A.dtype == xp.float64):
        raise TypeError(f"{name} has dtype {A.dtype}; a factor must be float32 or float64 "
                        f"(it is cast to W's dtype, as in the single-layer solve)")


def _check_device(A, name: str, dev) -> None:
    d = _xp.device(A)
    if str(d) != str(dev):
        raise ValueError(f"{name} is on device {d} but W is on device {dev}; move every array "
                         f"of a stack to one device")


def _quantizer_list(quantizer, B: int) -> list:
    """One quantizer per item: a shared quantizer, or a sequence of length B (or 1)."""
    if isinstance(quantizer, (list, tuple)):
        if len(quantizer) not in (B, 1):
            raise ValueError(f"quantizer is a sequence of {len(quantizer)} quantizers but the "
                             f"stack has {B} items; give one quantizer per item (flat, in C "
                             f"order over the stack shape) or one shared quantizer")
        qs = list(quantizer) if len(quantizer) == B else list(quantizer) * B
    else:
        qs = [quantizer] * B
    for i, q in enumerate(qs):
        if not callable(getattr(q, "quantize", None)):
            where = f"quantizer[{i}]" if isinstance(quantizer, (list, tuple)) else "quantizer"
            raise TypeError(f"{where} must have a method quantize(targets) -> (values, codes); "
                            f"got {type(q).__name__}")
    return qs


def _flat(xp, a, stack: tuple[int, ...]):
    """``a`` (…, r, c) as ``(k, r, c)`` and the row of each of the ``B`` items in it."""
    lead = tuple(a.shape[:-2])
    k = math.prod(lead)
    flat = xp.reshape(a, (k, *a.shape[-2:]))
    idx = np.broadcast_to(np.arange(k).reshape(lead), stack).reshape(-1)
    return flat, np.ascontiguousarray(idx)


def _default_budget(xp) -> int:
    """Working memory a stack may use when ``max_bytes`` is not given: half of the free
    device memory on cupy, a quarter of the physical memory elsewhere."""
    if _xp.is_cupy(xp):
        import cupy

        free, _ = cupy.cuda.runtime.memGetInfo()
        return int(free // 2)
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4)
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 32


#: Elements per pass of the stack-wide checks on the CPU: the temporaries of a pass stay in
#: cache (one pass over a 16 MB stack at a time cost as much as the per-item checks it
#: replaced). On a GPU a pass is a few kernel launches whatever its size, so passes are
#: larger there (``_GPU_PASS_ELEMENTS``: temporaries of at most 64 MiB in float32), and the
#: passes' results stay on the device until one synchronisation per array (at 64 × 1024²
#: the per-item passes with one synchronisation each took 30-50 ms, more than the solve).
_PASS_ELEMENTS = 1 << 18
_GPU_PASS_ELEMENTS = 1 << 24


def _pass_items(xp, r: int, c: int) -> int:
    """Matrices of ``r x c`` per pass of a stack-wide check."""
    per = _GPU_PASS_ELEMENTS if _xp.is_cupy(xp) else _PASS_ELEMENTS
    return max(1, per // max(1, r * c))


def _rows_first(reduce, X):
    """``reduce`` (``xp.max``, ``xp.all``) of each matrix of ``X`` (k, r, c) -> (k,), over
    its last axis first. Profiled on the H200, the block-lower check of the MoE stack
    (128 × 768² and 128 × 2048² factors) took 41 ms of a 113 ms solve when each pass reduced
    its few matrices straight to one value each; our reading is that cupy runs a reduction
    with that few outputs on that few CUDA blocks (not profiled at the kernel level).
    Reducing the rows first gives the heavy reduction r k outputs; the result is the same."""
    return reduce(reduce(X, axis=2), axis=1)


def _check_finite_stack(xp, flat, name: str, fast=None) -> None:
    """No NaN or Inf in ``flat`` (k, r, c), checked a few matrices at a time (one
    synchronisation), or in one kernel of the GPU engine (``fast``, from
    ``_execute._compiled``); the single check counts the bad entries for the message."""
    k, r, c = flat.shape
    if k == 0:
        return
    # the engine's counter (it returns None for arrays it does not take)
    count = fast.count_nonfinite if offers(fast, COUNT_NONFINITE) else None
    bad = None if count is None else count(flat)
    if bad is not None:
        if bad:
            check_finite(xp, flat, name, count)
        return
    step = _pass_items(xp, r, c)
    ok = [xp.all(_rows_first(xp.all, xp.isfinite(flat[j0:min(k, j0 + step), ...])))
          for j0 in range(0, k, step)]
    if not bool(xp.all(xp.stack(ok))):
        check_finite(xp, flat, name)


def _refuse_factor(solvers, xp, A, j: int, block: int, name: str) -> None:
    """Raise the single-layer check's error for factor ``j`` of the stack ``A`` (k, s, s),
    which is not ``L - I``, naming it by its place in the flattened stack."""
    label = name if A.shape[0] == 1 else f"{name}[{j}] (flattened stack)"
    solvers._check_strictly_lower(xp, A[j, ...], block, label)


def _check_strictly_lower_stack(solvers, xp, A, block: int, name: str) -> None:
    """Every factor of the stack ``A`` (k, s, s) is ``L - I``: one mask for all of them,
    factors taken a few at a time (``_pass_items``), one synchronisation (the GPU engine
    reads every factor once in ``stack_checks`` instead). The single-layer check words the
    error for the first bad one."""
    k, s = A.shape[0], A.shape[-1]
    if k == 0:
        return
    i = xp.arange(s, device=_xp.device(A))
    blk = i // block
    forbidden = ((i[None, :] >= i[:, None]) | (blk[None, :] == blk[:, None]))[None, ...]
    zero = xp.zeros((1, 1, 1), dtype=A.dtype, device=_xp.device(A))
    step = _pass_items(xp, s, s)
    parts = (A[j0:min(k, j0 + step), ...] for j0 in range(0, k, step))
    bad = xp.concat([_rows_first(xp.max, xp.abs(xp.where(forbidden, P, zero)))
                     for P in parts])
    if float(xp.max(bad)) != 0.0:
        j = int(_xp.to_numpy(xp.argmax(xp.astype(bad != 0, xp.int8))))
        _refuse_factor(solvers, xp, A, j, block, name)


def _start_value_checks(solvers, xp, W_flat, factors, fast):
    """The checks of the stack's values: no NaN or Inf in ``W_flat`` and the factor stacks
    ``factors`` ((name, flat, block) each), every factor ``L - I``. Returns a function that
    decides them, in this order, each error worded as the single-layer check words it.

    The GPU engine's ``stack_checks`` launches its kernels here and the returned function
    reads every statistic back at once, so the caller's host work between the two runs
    while the GPU reads the stack (about a millisecond for an MoE stack); otherwise the
    returned function runs one pass per array and statistic (``fast``: the compiled
    engine's one-kernel checks, from ``_execute._compiled``)."""
    read = None if not offers(fast, STACK_CHECKS) else fast.stack_checks(
        {"W": W_flat, **{name: flat for name, flat, _ in factors}},
        {name: blk for name, _, blk in factors})

    def passes():
        _check_finite_stack(xp, W_flat, "W", fast)
        for name, flat, blk in factors:
            _check_finite_stack(xp, flat, name, fast)
            _check_strictly_lower_stack(solvers, xp, flat, blk, name)

    def decide():
        nonfinite, forbidden = read()
        check_finite(xp, W_flat, "W", known=nonfinite["W"])
        for name, flat, blk in factors:
            check_finite(xp, flat, name, known=nonfinite[name])
            bad = np.flatnonzero(np.asarray(forbidden[name]))
            if bad.size:
                _refuse_factor(solvers, xp, flat, int(bad[0]), blk, name)

    return passes if read is None else decide


def solve_stack(W, A_out, A_in, quantizer, *, tile=(16, 16), method: str = "auto",
                engine: str = "auto", variant: str = "accumulator", base: int | None = None,
                return_targets: bool = False, max_naive_bytes: int | None = None,
                workers: int | None = None, max_bytes: int | None = None, options=None):
    """Round a stack of layers: :func:`bakron.solve` over the leading axes of ``W``.

    Parameters
    ----------
    W : array (..., m, n), float32 or float64
        The stack of weights (not modified).
    A_out : array (..., m, m), Factor or None
        ``L_O - I`` per item (``None``: one-sided for every item). Its leading shape
        broadcasts against W's: ``(m, m)``, or a :class:`bakron.Factor` from
        :func:`bakron.prepare_factor` (its block must be the tile's), is one factor shared by
        the whole stack.
    A_in : array (..., n, n) or Factor
        ``L_I - I`` per item, broadcast like ``A_out``.
    quantizer : quantizer or sequence of quantizers
        One quantizer for every item, or one per item (a list or tuple of length
        ``prod(stack shape)``, flat in C order; :func:`fit_quantizers` fits per-item
        :class:`bakron.UniformQuantizer` grids).
    tile, method, engine, variant, base, return_targets, max_naive_bytes, options
        As in :func:`bakron.solve`, for every item.
    workers : int, optional
        Threads that solve items concurrently. Default: the engine's rule
        ``stack_threads(chunk, cores)`` when it has one (the numba engine: docs/stacks.md,
        "Threads"), else 1. With more than one worker, BLAS (through threadpoolctl, when
        installed) and numba get ``cores // workers`` threads each for the duration of the
        stack.
    max_bytes : int, optional
        Working memory for the stack (besides inputs and the stacked outputs); items are
        taken in chunks of ``max_bytes // (4 m n itemsize)`` (at least one). Default: half of
        the free device memory on cupy, a quarter of the physical memory elsewhere.

    Returns
    -------
    SolveResult
        ``values``/``codes``/``targets`` of shape ``(*stack, m, n)``; ``method``/``engine``
        as run (comma-separated when items differ); ``info["stack"]`` says how the stack
        was executed (items, chunks, path, workers, threads).
    """

    # ---- validation: nothing below runs any solve until all of it has passed -------------
    # a bakron.Factor is one factor shared by every item (its array L - I and its block)
    (A_out, rec_out), (A_in, rec_in) = factor_array(A_out), factor_array(A_in)
    xp = _namespace(W, A_out, A_in)
    # big-endian numpy arrays: native copies, as the single-layer solve makes them
    W, A_out, A_in = native(xp, W), native(xp, A_out), native(xp, A_in)
    _check_stack_array(W, "W", "(..., m, n)")
    _check_stack_array(A_in, "A_in", "(..., n, n)")
    if A_out is not None:
        _check_stack_array(A_out, "A_out", "(..., m, m)")
    dtype = _xp.float_dtype(xp, W, "W")
    m, n = (int(s) for s in W.shape[-2:])
    if m == 0 or n == 0:
        raise ValueError(f"W must not have empty matrices, got shape {tuple(W.shape)}")
    check_factor_shape(types.SimpleNamespace(shape=tuple(A_in.shape[-2:])), n, "A_in",
                       "A_out", m, "columns")
    if A_out is not None:
        check_factor_shape(types.SimpleNamespace(shape=tuple(A_out.shape[-2:])), m, "A_out",
                           "A_in", n, "rows")
    stack = stack_shape(W, A_out, A_in)
    B = math.prod(stack)
    dev = _xp.device(W)
    for name, A in (("A_in", A_in), ("A_out", A_out)):
        if A is not None:
            _check_factor_dtype(xp, A, name)
            _check_device(A, name, dev)
    tx, ty = check_tile(tile, m, n)
    for name, rec, block, size in (("A_in", rec_in, ty, n), ("A_out", rec_out, tx, m)):
        if rec is not None and rec != min(block, size):   # the single solve's rule and words
            raise ValueError(f"{name} was prepared with block size {rec} but the tile needs "
                             f"{block}; prepare it with prepare_factor(H, {block})")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if variant not in ("accumulator", "direct"):
        raise ValueError(f"variant must be 'accumulator' or 'direct', got {variant!r}")
    if base is not None and int(base) < 1:
        raise ValueError(f"base must be a positive number of tiles, got {base}")
    if workers is not None and (isinstance(workers, bool) or int(workers) != workers
                                or workers < 1):
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if max_bytes is not None and (int(max_bytes) != max_bytes or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive number of bytes, got {max_bytes!r}")
    options = as_options(options)
    qs = _quantizer_list(quantizer, B)
    W_flat, w_idx = _flat(xp, W, stack)
    # a factor in another dtype is cast once for the stack, as the single solve casts it
    A_in_flat, in_idx = _flat(xp, xp.astype(A_in, dtype, copy=False), stack)
    if A_out is None:
        A_out_flat, out_idx = None, None
    else:
        A_out_flat, out_idx = _flat(xp, xp.astype(A_out, dtype, copy=False), stack)
    factors = [(name, flat, blk) for name, flat, blk in
               (("A_in", A_in_flat, ty), ("A_out", A_out_flat, tx)) if flat is not None]
    # the value checks start here (on the GPU: kernels that run during the host checks
    # below) and decide after them
    decide_values = _start_value_checks(solvers, xp, W_flat, factors,
                                        solvers._compiled(xp, engine))
    seen: set = set()
    for i, q in enumerate(qs):
        if id(q) in seen:
            continue
        seen.add(id(q))
        if hasattr(q, "check_shape"):
            try:
                q.check_shape(m, n)
            except ValueError as e:
                raise ValueError(f"quantizer for item {i}: {e}") from None
    itemsize = 4 if dtype == xp.float32 else 8
    budget = _default_budget(xp) if max_bytes is None else int(max_bytes)
    chunk_items = max(1, min(B, budget // (ITEM_WORK_MN * m * n * itemsize))) if B else 1
    full = StackChunk(0, B, W_flat, A_out_flat, A_in_flat, w_idx, out_idx, in_idx, qs,
                      (tx, ty), method, base, variant, None, None, None, options)
    engines = engine_check(solvers, xp, full, engine, return_targets) if B else {}
    decide_values()
    # ---- outputs: allocated once every check has passed ----------------------------------
    # every item's values (and codes) are written by its chunk, whichever path runs it, so
    # they start uninitialised (a fill of the MoE stack's values took 0.2 ms on the H200);
    # targets start at zero: an item whose engine records none leaves zeros
    values = full.values = xp.empty((B, m, n), dtype=dtype, device=dev)
    targets = full.targets = xp.zeros((B, m, n), dtype=dtype, device=dev) \
        if return_targets else None
    t0 = time.perf_counter()
    if B == 0:
        return SolveResult(values=xp.reshape(values, (*stack, m, n)), codes=None,
                           method=method, engine=engine, seconds=0.0, tile=(tx, ty),
                           targets=None if targets is None else
                           xp.reshape(targets, (*stack, m, n)),
                           info={"stack": {"shape": stack, "items": 0, "chunks": 0}})

    # ---- execution -----------------------------------------------------------------------
    names = {e.NAME for e in engines.values()}
    one_engine = len(names) == 1
    eng = next(iter(engines.values())) if one_engine else None
    n_cores = cores()
    if workers is not None:
        chosen_by = "workers="
    elif one_engine and offers(eng, STACK_THREADS):  # the engine's rule
        chosen_by = "engine rule stack_threads"
        workers = int(eng.stack_threads(replace(full, stop=chunk_items), n_cores))  # 1st chunk
    else:
        chosen_by, workers = "serial (no stack_threads)", 1
    workers = max(1, min(int(workers), chunk_items, B))
    threads = max(1, n_cores // workers) if workers > 1 else None
    stack_hook = offers(eng, SOLVE_STACK)

    runner = ItemRunner(full, dict(tile=(tx, ty), method=method, engine=engine,
                                    variant=variant, base=base, return_targets=return_targets,
                                    max_naive_bytes=max_naive_bytes, options=options),
                          threads, engines)
    paths = []
    _xp.sync(xp)
    with blas_limit(threads) as blas_applied:
        for start in range(0, B, chunk_items):
            stop = min(B, start + chunk_items)
            chunk = StackChunk(start, stop, W_flat, A_out_flat, A_in_flat, w_idx, out_idx,
                               in_idx, qs, (tx, ty), method, base, variant, values,
                               runner.codes, targets, options)
            infos = eng.solve_stack(chunk) if stack_hook else None
            if infos is not None:
                runner.take_engine_infos(chunk, infos)
                paths.append("engine solve_stack")
                continue
            if workers > 1:
                runner.run(start, start + 1)  # first item alone: compiles, allocates codes
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    list(pool.map(lambda i: runner.run(i, i + 1), range(start + 1, stop)))
                paths.append(f"items on {workers} threads")
            else:
                runner.run(start, stop)
                paths.append("items one by one")
    _xp.sync(xp)
    seconds = time.perf_counter() - t0

    codes = runner.final_codes()
    shape = (*stack, m, n)
    info = dict(runner.first_info)
    info["quantizer_calls"] = runner.quantizer_calls
    info["stack"] = {
        "shape": stack, "items": B, "chunks": -(-B // chunk_items), "chunk_items": chunk_items,
        "budget_bytes": budget, "path": ", ".join(sorted(set(paths))), "workers": workers,
        "threads_per_worker": threads, "blas_threads": blas_applied, "cores": n_cores,
        "workers_by": chosen_by,
    }
    return SolveResult(values=xp.reshape(values, shape),
                       codes=None if codes is None else xp.reshape(codes, shape),
                       method=",".join(sorted(runner.methods)),
                       engine=",".join(sorted(runner.engines)), seconds=seconds, tile=(tx, ty),
                       targets=None if targets is None else xp.reshape(targets, shape),
                       info=info)


def fit_quantizers(W, bits, **kwargs) -> list:
    """One :class:`bakron.UniformQuantizer` per item of a stack ``W`` ``(..., m, n)``, fitted
    by :meth:`bakron.UniformQuantizer.fit` (same keyword arguments), flat in C order: the
    per-item quantizers that :func:`bakron.solve` takes for a stack."""
    from ..quantizers import UniformQuantizer

    Wn = _xp.to_numpy(W)
    if Wn.ndim < 2:
        raise ValueError(f"W must have shape (..., m, n), got shape {Wn.shape}")
    flat = Wn.reshape(-1, *Wn.shape[-2:])
    return [UniformQuantizer.fit(flat[i], bits, **kwargs) for i in range(flat.shape[0])]
