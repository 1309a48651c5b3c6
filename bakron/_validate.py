"""Input checks shared by the public API. Every error names the argument and the problem."""
from __future__ import annotations

import numbers


def check_matrix(xp, x, name: str, *, square: bool = False):
    if not hasattr(x, "shape") or len(x.shape) != 2:
        shape = getattr(x, "shape", None)
        raise ValueError(f"{name} must be a 2-D array, got shape {shape}")
    if square and x.shape[0] != x.shape[1]:
        raise ValueError(f"{name} must be square, got shape {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x


def check_finite(xp, x, name: str):
    if not bool(xp.all(xp.isfinite(x))):
        bad = int(xp.sum(xp.astype(~xp.isfinite(x), xp.int64)))
        raise ValueError(f"{name} contains {bad} NaN or Inf entr{'y' if bad == 1 else 'ies'}")
    return x


def check_symmetric(xp, H, name: str, rtol: float = 1e-5):
    """Reject a matrix that is not symmetric beyond rounding (relative to its largest entry)."""
    scale = float(xp.max(xp.abs(H)))
    asym = float(xp.max(xp.abs(H - H.T)))
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
    if isinstance(tile, numbers.Integral):
        tile = (int(tile), int(tile))
    try:
        tx, ty = (int(t) for t in tile)
    except Exception:
        raise ValueError(f"{name} must be an int or a pair (t_x, t_y), got {tile!r}") from None
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
