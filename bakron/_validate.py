"""Input checks shared by the public API. Every error names the argument and the problem.

docs/reliability.md lists the input classes these checks were tried against and the error each
one gets.
"""
from __future__ import annotations

import math
import numbers
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._lib.symmetric import max_asymmetry
from ._lib.threads import cores


def check_int(value, name: str, *, minimum: int | None = None, what: str | None = None) -> int:
    """``value`` as a Python int: only integers are accepted (``int`` or a numpy integer
    scalar); strings, floats (even 8.0) and bools raise ``ValueError`` naming ``name`` (the
    library's rule for option values: ``ValueError``; ``TypeError`` is for array dtypes)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {what or 'an integer'}, got {type(value).__name__} "
                         f"{value!r}")
    v = int(value)
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be {what or f'>= {minimum}'}, got {v}")
    return v


def check_real_number(value, name: str, *, minimum: float | None = None,
                      finite: bool = True) -> float:
    """``value`` as a float: an int or a real float (numpy scalars included); strings, bools,
    complex numbers and NaN raise ``ValueError`` naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if math.isnan(v) or (finite and math.isinf(v)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return v


def check_damp(damp, name: str = "damp") -> float:
    """Relative damping: a finite real number >= 0."""
    return check_real_number(damp, name, minimum=0.0)


def check_array_kind(x, name: str) -> None:
    """Refuse array types whose semantics would silently change the result."""
    if isinstance(x, np.matrix):
        raise TypeError(f"{name} is a numpy.matrix (whose * and indexing differ from arrays); "
                        f"pass np.asarray({name})")
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a masked array: its masked entries would be used as the "
                        f"values stored under the mask; fill them first "
                        f"({name}.filled(...)) and pass a plain array")


def check_real_dtype(xp, x, name: str) -> None:
    """``x`` must hold real numbers: complex dtypes (whose imaginary part a cast would drop)
    raise ``TypeError``; so do non-numeric dtypes."""
    dt = x.dtype
    if xp.isdtype(dt, "complex floating"):
        raise TypeError(f"{name} has the complex dtype {dt}; bakron works with real matrices "
                        f"(a cast would silently drop the imaginary part)")
    if not xp.isdtype(dt, ("real floating", "integral")):
        raise TypeError(f"{name} must hold real numbers, got dtype {dt}")


def native(xp, x):
    """``x`` with a native byte order (a converted copy for big-endian numpy arrays)."""
    dt = getattr(x, "dtype", None)
    if isinstance(dt, np.dtype) and not dt.isnative and isinstance(x, np.ndarray):
        return x.astype(dt.newbyteorder("="))
    return x


def check_matrix(xp, x, name: str, *, square: bool = False):
    check_array_kind(x, name)
    if not hasattr(x, "shape") or len(x.shape) != 2:
        shape = getattr(x, "shape", None)
        raise ValueError(f"{name} must be a 2-D array, got shape {shape}")
    if square and x.shape[0] != x.shape[1]:
        raise ValueError(f"{name} must be square, got shape {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x


#: Elements per piece of the numpy checks that read a whole matrix (``row_strips``): their
#: temporaries stay small instead of ``n²`` fresh pages, and the pieces run on threads
#: (``map_strips``). Measured on the 16-core host: with whole-matrix masks a 2048² / 4096²
#: solve spent 53 / 356 ms in its checks; docs/engines.md, "Many cores". Other namespaces
#: (a GPU's memory pool) take the whole matrix: fewer launches.
STRIP_ELEMENTS = 1 << 18

_STRIP_POOL: dict = {}  # the thread pool of map_strips by process id, made on first use
_STRIP_LOCK = threading.Lock()


#: name prefix of the threads of ``map_strips``'s pool (they never call BLAS:
#: ``backends/numba_cpu._alone``)
CHECK_THREADS = "bakron-check"


def row_strips(xp, rows: int, row_size: int, align: int = 1) -> list[tuple[int, int]]:
    """``[(r0, r1), ...]`` covering ``range(rows)``: for numpy strips of about
    ``STRIP_ELEMENTS`` elements (rows of ``row_size`` elements), every strip but the last a
    multiple of ``align`` rows high; one strip for other namespaces."""
    from . import _xp

    if not _xp.is_numpy(xp):
        return [(0, rows)]
    align = max(int(align), 1)
    h = max(align, STRIP_ELEMENTS // max(int(row_size), 1) // align * align)
    return [(r0, min(r0 + h, rows)) for r0 in range(0, rows, h)]


def map_strips(fn, strips) -> list:
    """``[fn(r0, r1) for r0, r1 in strips]``; several strips run on a thread pool with one
    thread per usable core (numpy's reductions release the GIL). ``fn`` only reads."""
    if len(strips) <= 1:
        return [fn(r0, r1) for r0, r1 in strips]
    pid = os.getpid()  # a forked child has none of its parent's pool threads: its own pool
    with _STRIP_LOCK:
        if pid not in _STRIP_POOL:
            _STRIP_POOL.clear()
            _STRIP_POOL[pid] = ThreadPoolExecutor(max(1, cores()), CHECK_THREADS)
        pool = _STRIP_POOL[pid]
    return list(pool.map(lambda s: fn(*s), strips))


def all_finite(xp, x) -> bool:
    """No NaN or Inf in ``x``: strips along the first axis (``row_strips``, ``map_strips``),
    one synchronisation."""
    if x.ndim == 0 or x.shape[0] == 0:
        return bool(xp.all(xp.isfinite(x)))
    strips = row_strips(xp, x.shape[0], math.prod(x.shape[1:]))
    if len(strips) == 1:
        return bool(xp.all(xp.isfinite(x)))
    return bool(xp.all(xp.stack(map_strips(
        lambda r0, r1: xp.all(xp.isfinite(x[r0:r1, ...])), strips))))


def nonfinite(xp, x, count=None) -> int:
    """The number of NaN and Inf entries of ``x`` (0 after one pass when there are none).
    ``count``: a compiled counter (``numba_cpu.count_nonfinite``; it returns ``None`` for
    arrays it does not take), used instead of the array-API passes when given."""
    bad = None if count is None else count(x)
    if bad is not None:
        return bad
    if all_finite(xp, x):
        return 0
    return int(xp.sum(xp.astype(~xp.isfinite(x), xp.int64)))


def check_finite(xp, x, name: str, count=None, known: int | None = None):
    """No NaN or Inf in ``x``. ``count``: as in :func:`nonfinite`; ``known``: the number of
    NaN and Inf entries when a fused pass has counted them already (nothing is read then)."""
    bad = nonfinite(xp, x, count) if known is None else known
    if bad:
        raise ValueError(f"{name} contains {bad} NaN or Inf entr{'y' if bad == 1 else 'ies'}")
    return x


def check_symmetric(xp, H, name: str, rtol: float = 1e-5):
    """Reject a matrix that is not symmetric beyond rounding (relative to its largest entry)."""
    scale = float(xp.max(xp.abs(H)))
    asym = max_asymmetry(xp, H)
    if asym > rtol * max(scale, 1e-300):
        raise ValueError(
            f"{name} is not symmetric: max |{name} - {name}.T| = {asym:.3g} "
            f"(largest entry {scale:.3g}); a Hessian factor must be symmetric"
        )


def check_factor_shape(H, expected: int, name: str, other_name: str, other_size: int, what: str):
    """``H`` must be ``expected x expected``; detect the common swap of H_in and H_out."""
    n0, n1 = H.shape
    if n0 != n1:
        raise ValueError(f"{name} must be square, got shape {(n0, n1)}")
    if n0 != expected:
        hint = ""
        if n0 == other_size and expected != other_size:
            hint = f"; it matches the {other_name} side: are {name} and {other_name} swapped?"
        raise ValueError(
            f"{name} has shape {(n0, n1)} but W has {expected} {what}, so {name} must be "
            f"{expected} x {expected}{hint}"
        )


def check_tile(tile, m: int, n: int, name: str = "tile") -> tuple[int, int]:
    """An int or a pair of ints (numpy integer scalars accepted; strings, floats and bools
    refused), each >= 1 and no larger than the matrix."""
    if isinstance(tile, numbers.Integral) and not isinstance(tile, (bool, np.bool_)):
        tile = (tile, tile)
    if isinstance(tile, (str, bytes)) or not isinstance(tile, (tuple, list)) or len(tile) != 2:
        raise ValueError(f"{name} must be an int or a pair (t_x, t_y) of ints, got "
                        f"{type(tile).__name__} {tile!r}")
    for t in tile:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{name} must be an int or a pair (t_x, t_y) of ints, got {tile!r} "
                            f"(entry {t!r} is a {type(t).__name__})")
    tx, ty = int(tile[0]), int(tile[1])
    if tx < 1 or ty < 1:
        raise ValueError(f"{name} entries must be >= 1, got {(tx, ty)}")
    if tx > m or ty > n:
        raise ValueError(
            f"{name} {(tx, ty)} is larger than the matrix {(m, n)}; use a tile no larger than W"
        )
    return tx, ty


def check_bits(bits, name: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral):
        raise ValueError(f"{name} must be an integer in 2..8, got {bits!r}")
    if not 2 <= int(bits) <= 8:
        raise ValueError(f"{name} must be in 2..8, got {bits}")
    return int(bits)


def check_bits_list(bits, name: str = "bits") -> tuple[int, ...]:
    """A non-empty sequence of bit widths, each an integer in 2..8."""
    bits = tuple(bits)
    if not bits:
        raise ValueError(f"{name} must name at least one bit width")
    return tuple(check_bits(b, name) for b in bits)


def check_factor_block(xp, A, block: int, name: str, recorded: int | None = None,
                       scan=None, coarse_tile: int | None = None) -> None:
    """Refuse a factor ``A = L - I`` made with a *coarser* block size than ``block``.

    ``recorded`` is the block size a :class:`bakron.Factor` carries: it must be ``block``
    (or the whole matrix when ``block`` covers it).

    A bare array made with a coarser block passes the strictly-block-lower check (its zero
    diagonal blocks contain the finer ones) but rounds differently. Its signature: some tile
    just below the diagonal, ``A[k, k-1]``, lies inside a coarse diagonal block, so it is
    exactly zero on its live channels (those with a non-zero in their row or column of ``A``;
    a dead channel's row and column are zero in any factor), while the same rows hold
    non-zeros further left (the coupling across coarse blocks). A factor made with ``block``
    carries the coupling of neighbouring blocks in that tile (with fill-in); a block-diagonal
    Hessian (attention heads) has no coupling further left. Only a Hessian whose neighbouring
    live blocks are exactly decoupled after elimination while distant ones are not could be
    refused wrongly.

    ``scan``: the statistics of a strictly block-lower ``A`` from a compiled pass
    (``bakron.solvers._execute._factor_scan``: ``(_, row_any, first, col_any)``); without it they are
    computed here in row strips. ``coarse_tile``: the decision made already by a fused pass
    (``numba_cuda.input_checks``): the first tile ``k`` with the signature, 0 for none.
    """
    n = A.shape[0]
    if recorded is not None and recorded != min(block, n):
        raise ValueError(f"{name} was prepared with block size {recorded} but the tile needs "
                         f"{block}; prepare it with prepare_factor(H, {block})")
    if n <= block:
        return
    if coarse_tile is not None:
        if coarse_tile:
            _refuse_coarse(name, block, coarse_tile)
        return
    dev = _device(A)
    # per row: any non-zero, the first non-zero column (n where the row is zero); per
    # column: any non-zero -- in row strips (row_strips), no n x n temporaries
    def scan_rows(r0, r1):
        nz = A[r0:r1, :] != 0
        return (xp.any(nz, axis=1), xp.astype(xp.argmax(xp.astype(nz, xp.int8), axis=1),
                                              xp.int64), xp.any(nz, axis=0))

    if scan is not None:
        _, row_any, first, col_any = scan
        live = row_any | col_any
    else:
        row_any, first, col_any = zip(*map_strips(scan_rows, row_strips(xp, n, n)))
        row_any = xp.concat(row_any)
        live = row_any | xp.any(xp.stack(col_any), axis=0)  # dead channel: zero row and column
        first = xp.where(row_any, xp.concat(first), xp.full((n,), n, dtype=xp.int64,
                                                            device=dev))
    # the tiles just left of the diagonal, gathered as (n - block, block): row r, column
    # (r // block - 1) * block + j -- O(n * block) work, no n x n integer temporaries
    r = xp.arange(block, n, device=dev)
    j = xp.arange(block, device=dev)
    start = (r // block - 1) * block
    cols = start[:, None] + j[None, :]
    flat = xp.reshape(A, (n * n,))
    near = xp.reshape(xp.take(flat, xp.reshape(r[:, None] * n + cols, (-1,))), cols.shape)
    live_cols = xp.reshape(xp.take(live, xp.reshape(cols, (-1,))), cols.shape)
    elig = xp.take(live, r)[:, None] & live_cols
    # coupling beyond the neighbouring tile: what a coarse block leaves non-zero
    further = xp.astype(xp.astype(xp.take(first, r), xp.int64) < start, xp.int64)
    per_row_elig = xp.sum(xp.astype(elig, xp.int64), axis=1)
    per_row_nz = xp.sum(xp.astype(elig & (near != 0), xp.int64), axis=1)
    tiles = -(-(n - block) // block)
    pad = tiles * block - (n - block)
    if pad:
        zeros = xp.zeros((pad,), dtype=xp.int64, device=dev)
        per_row_elig = xp.concat([per_row_elig, zeros])
        per_row_nz = xp.concat([per_row_nz, zeros])
        further = xp.concat([further, zeros])
    t_elig = xp.sum(xp.reshape(per_row_elig, (tiles, block)), axis=1)
    t_nz = xp.sum(xp.reshape(per_row_nz, (tiles, block)), axis=1)
    t_further = xp.sum(xp.reshape(further, (tiles, block)), axis=1)
    empty = (t_elig > 0) & (t_nz == 0) & (t_further > 0)
    if bool(xp.any(empty)):
        _refuse_coarse(name, block, int(xp.nonzero(empty)[0][0]) + 1)


def _refuse_coarse(name: str, block: int, k: int) -> None:
    """The error of :func:`check_factor_block` for tile ``(k, k - 1)``."""
    raise ValueError(
        f"{name} looks like a factor made with a block size coarser than the tile ({block}): "
        f"its tile ({k}, {k - 1}) next to the diagonal is exactly zero on live rows and "
        f"columns while those rows hold non-zeros further left; prepare it with "
        f"prepare_factor(H, {block}) (the tile's {'t_y' if name.endswith('in') else 't_x'})")


def _device(x):
    from . import _xp

    return _xp.device(x)


def factor_array(A):
    """``(array, recorded block size or None)`` of a :class:`bakron.Factor` or an array."""
    if hasattr(A, "A") and hasattr(A, "block") and hasattr(A, "D"):
        return A.A, int(A.block)
    return A, None


def check_quantizer(quantizer, m: int, n: int, dtype, name: str = "quantizer") -> None:
    """A quantizer instance with a ``quantize`` method whose tables fit an m x n W of
    ``dtype``."""
    if isinstance(quantizer, type):
        raise TypeError(f"{name} is the class {quantizer.__name__}, not an instance; create "
                        f"one first (e.g. {quantizer.__name__}.fit(W, bits))")
    if not callable(getattr(quantizer, "quantize", None)):
        raise TypeError(f"{name} must have a method quantize(targets) -> (values, codes); got "
                        f"{type(quantizer).__name__}")
    if hasattr(quantizer, "check_shape"):
        quantizer.check_shape(m, n)
    if hasattr(quantizer, "check_dtype"):
        quantizer.check_dtype(dtype)


def check_quantizer_output(quantizer, targets, out, *, full: bool = True):
    """Check what ``quantizer.quantize`` returned for ``targets`` and return ``(values,
    codes)``: a pair of arrays with the targets' shape (codes may be ``None``). With ``full``
    (the solvers do it on the first batch of a solve) also: arrays of the targets' namespace,
    real float values, all finite."""
    who = f"{type(quantizer).__name__}.quantize"
    try:
        values, codes = out
    except Exception:
        raise TypeError(f"{who} must return a pair (values, codes), got "
                        f"{type(out).__name__}") from None
    for what, arr in (("values", values), ("codes", codes)):
        if arr is None and what == "codes":
            continue
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"{who} returned {what} of type {type(arr).__name__}; it must "
                            f"return arrays of the targets' type ({type(targets).__name__})")
        if tuple(arr.shape) != tuple(targets.shape):
            raise ValueError(f"{who} returned {what} of shape {tuple(arr.shape)} for targets of "
                             f"shape {tuple(targets.shape)}; {what} must have the targets' shape"
                             f"{' or be None' if what == 'codes' else ''}")
    if not full:
        return values, codes
    from . import _xp

    for what, arr in (("values", values), ("codes", codes)):
        if arr is None:
            continue
        try:
            _xp.namespace(arr, targets)
        except TypeError:
            raise TypeError(f"{who} returned {what} of type {type(arr).__name__} for targets "
                            f"of type {type(targets).__name__}; return arrays of the targets' "
                            f"namespace") from None
    xp = _xp.namespace(targets)
    if not xp.isdtype(values.dtype, "real floating"):
        raise TypeError(f"{who} returned values of dtype {values.dtype}; they must be real "
                        f"floats (the targets' dtype is {targets.dtype})")
    if not bool(xp.all(xp.isfinite(values))):
        raise ValueError(f"{who} returned NaN or Inf values for finite targets; check the "
                         f"quantizer's scales")
    return values, codes


def check_result_finite(xp, values, quantizer, count=None) -> None:
    """The rounded weights must be finite (a quantizer or an engine produced NaN or Inf).
    ``count``: as in :func:`nonfinite`."""
    if nonfinite(xp, values, count):
        raise ValueError(f"the rounding produced NaN or Inf values: the quantizer "
                         f"{type(quantizer).__name__} returned non-finite values (check its "
                         f"scales in W's dtype)")
