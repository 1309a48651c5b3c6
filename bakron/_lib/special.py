"""erf and the exact GELU in any array namespace (one implementation for the whole library).

numpy uses :func:`scipy.special.erf`, cupy :func:`cupyx.scipy.special.erf`; any other namespace
goes through the host (scipy) and back to the array's device, so every namespace gets the
same exact values. The dtype of ``x`` is kept.
"""
from __future__ import annotations

import math

from .. import _xp

__all__ = ["erf", "gelu", "gelu_derivative"]

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


def erf(xp, x):
    """The error function of ``x`` in ``xp``, elementwise, in ``x``'s dtype."""
    if _xp.is_numpy(xp):
        from scipy.special import erf as _erf

        return xp.asarray(_erf(x))
    if _xp.is_cupy(xp):
        from cupyx.scipy.special import erf as _erf

        return _erf(x)
    import numpy as np
    from scipy.special import erf as _erf

    host = np.asarray(_erf(_xp.to_numpy(x)))
    return xp.asarray(host, dtype=x.dtype, device=_xp.device(x))


def normal_cdf(xp, x):
    """``Φ(x) = (1 + erf(x/√2)) / 2``."""
    return 0.5 * (1.0 + erf(xp, x * _INV_SQRT2))


def gelu(xp, x):
    """Exact GELU ``x Φ(x)``."""
    return x * normal_cdf(xp, x)


def gelu_derivative(xp, x):
    """``d/dx [x Φ(x)] = Φ(x) + x φ(x)``."""
    return normal_cdf(xp, x) + x * (_INV_SQRT2PI * xp.exp(-0.5 * x * x))
