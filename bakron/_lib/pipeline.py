"""The per-layer pipeline shared by ``bakron quantize`` and the Dask runner.

Arrays in (numpy, as read from the layer files), arrays to write and a report entry out, so
that the local command and the distributed tasks support the same inputs (dense or diagonal
H_out, half-precision W) and write the same tensors:

``codes``       int8 (symmetric) or uint8 (asymmetric) codes, (m, n)
``scale``       2-D table in W_hat's dtype: (1, 1) per tensor, (m, 1) per row,
                (m, ceil(n / group_size)) per group
``zero_point``  uint8 table of the same shape (asymmetric grids only)
``W_hat``       the rounded weights (float32 for a half-precision W)

:func:`bakron.io.dequantize` reads them back.
"""
from __future__ import annotations

import numpy as np

from .. import _xp
from .proxy import ProxyMetrics

__all__ = ["SOLVE_KEYS", "quantize_arrays", "codes_dtype"]

#: the solve settings both runners pass through
SOLVE_KEYS = ("bits", "tile", "method", "engine", "damp", "symmetric", "granularity",
              "group_size", "scale_method")


def codes_dtype(q):
    """int8 for symmetric codes, uint8 for asymmetric ones (wider when the range needs it)."""
    lo, hi = q.code_range
    for dt in ((np.uint8, np.uint16) if lo >= 0 else (np.int8, np.int16)):
        if np.iinfo(dt).min <= lo and hi <= np.iinfo(dt).max:
            return dt
    return np.int32


def quantize_arrays(W, H_in, H_out, settings: dict, *, xp=np, one_sided: bool = False,
                    metrics: str = "basic", progress=None):
    """Quantize one layer: ``(arrays to write, report entry, LayerResult)``.

    ``H_out`` is ``None``, an (m, m) matrix or the (m,) diagonal of a diagonal factor.
    ``one_sided`` ignores ``H_out`` for the rounding but still judges the result (and RTN)
    under it. ``xp`` is where the work runs (numpy or cupy); outputs are numpy.
    """
    from ..layer import quantize_layer

    kw = {k: settings[k] for k in SOLVE_KEYS}
    kw["tile"] = tuple(kw["tile"])
    dev = (lambda a: a) if xp is np else (lambda a: None if a is None else xp.asarray(a))
    Wx, Hx, Ox = dev(W), dev(H_in), dev(H_out)
    res = quantize_layer(Wx, Hx, None if one_sided else Ox, metrics=metrics, progress=progress,
                         **kw)
    entry = res.summary()
    if one_sided and H_out is not None and metrics != "none":  # judge it on both sides too
        pm = ProxyMetrics(_xp.namespace(Wx), Wx, Hx, Ox)
        entry["proxy_error"] = pm.error(res.values)
        entry["rtn_proxy_error"] = pm.error(res.rtn_values)
    entry["two_sided"] = H_out is not None and not one_sided
    entry["h_out_diagonal"] = H_out is not None and len(H_out.shape) == 1
    W_hat = _xp.to_numpy(res.values)
    q = res.quantizer
    s_tab, z_tab = q.tables(np, "cpu", np.dtype(W_hat.dtype))
    arrays = {"codes": _xp.to_numpy(res.codes).astype(codes_dtype(q)),
              "scale": np.array(s_tab, dtype=W_hat.dtype).reshape(s_tab.shape[0],
                                                                     s_tab.shape[1]),
              "W_hat": W_hat}
    if z_tab is not None:
        arrays["zero_point"] = np.rint(np.asarray(z_tab, dtype=np.float64)).astype(np.uint8)
    return arrays, entry, res
