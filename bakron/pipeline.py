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

__all__ = ["SOLVE_KEYS", "quantize_arrays", "quantize_arrays_stack", "codes_dtype"]

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

    kw = _solve_kwargs(settings)
    dev = _to_device(xp)
    Wx, Hx, Ox = dev(W), dev(H_in), dev(H_out)
    res = quantize_layer(Wx, Hx, None if one_sided else Ox, metrics=metrics, progress=progress,
                         **kw)
    arrays, entry = _finish(res, Wx, Hx, Ox, one_sided=one_sided, metrics=metrics)
    return arrays, entry, res


def quantize_arrays_stack(layers, settings: dict, *, xp=np, one_sided: bool = False,
                          metrics: str = "basic", progress=None, max_bytes=None) -> list:
    """:func:`quantize_arrays` for many layers at once: ``layers`` is a sequence of
    ``(W, H_in, H_out)``; same-shape layers are solved as one stack
    (:func:`bakron.layer_groups.quantize_layers`), each exactly as alone.

    Returns one item per layer, in order: ``(arrays, entry, LayerResult)``, or the exception
    that layer raised (the layer's own exception, not the stack's; a failed stack is retried
    layer by layer, so only the bad layers fail). ``entry["stack"]`` says which stack solved
    the layer (``index`` in it, ``size``).
    """
    from ..layer_groups import quantize_layers

    kw = _solve_kwargs(settings)
    dev = _to_device(xp)
    moved = [tuple(dev(a) for a in layer) for layer in layers]
    got = quantize_layers([(W, H, None if one_sided else O) for W, H, O in moved],
                          errors="return", metrics=metrics, progress=progress,
                          max_bytes=max_bytes, **kw)
    out: list = []
    for k, ((Wx, Hx, Ox), res) in enumerate(zip(moved, got)):
        if isinstance(res, BaseException):
            cause = res.__cause__  # quantize_layers names the layer; its caller knows it
            named = type(cause) is type(res) and str(res) == f"layers[{k}]: {cause}"
            out.append(cause if named else res)
            continue
        try:
            arrays, entry = _finish(res, Wx, Hx, Ox, one_sided=one_sided, metrics=metrics)
        except Exception as exc:  # noqa: BLE001 - the layer's failure, reported in its place
            out.append(exc)
            continue
        st = res.solve.info.get("stack") or {}
        entry["stack"] = {"index": st.get("index", 0), "size": st.get("items", 1)}
        out.append((arrays, entry, res))
    return out


def _solve_kwargs(settings: dict) -> dict:
    kw = {k: settings[k] for k in SOLVE_KEYS}
    kw["tile"] = tuple(kw["tile"])
    return kw


def _to_device(xp):
    return (lambda a: a) if xp is np else (lambda a: None if a is None else xp.asarray(a))


def _finish(res, Wx, Hx, Ox, *, one_sided: bool, metrics: str):
    """A solved layer's arrays to write and report entry (see the module docstring)."""
    entry = res.summary()
    if one_sided and Ox is not None and metrics != "none":  # judge it on both sides too
        pm = ProxyMetrics(_xp.namespace(Wx), Wx, Hx, Ox)
        entry["proxy_error"] = pm.error(res.values)
        entry["rtn_proxy_error"] = pm.error(res.rtn_values)
    entry["two_sided"] = Ox is not None and not one_sided
    entry["h_out_diagonal"] = Ox is not None and len(Ox.shape) == 1
    W_hat = _xp.to_numpy(res.values)
    q = res.quantizer
    s_tab, z_tab = q.tables(np, "cpu", np.dtype(W_hat.dtype))
    arrays = {"codes": _xp.to_numpy(res.codes).astype(codes_dtype(q)),
              "scale": np.array(s_tab, dtype=W_hat.dtype).reshape(s_tab.shape[0],
                                                                     s_tab.shape[1]),
              "W_hat": W_hat}
    if z_tab is not None:
        arrays["zero_point"] = np.rint(np.asarray(z_tab, dtype=np.float64)).astype(np.uint8)
    return arrays, entry
