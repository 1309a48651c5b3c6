"""The per-layer pipeline shared by ``bakron quantize``, ``bakron quantize-model``, the demos
and the Dask runners: it sits on the public API (:func:`bakron.quantize_layer`,
:func:`bakron.layer_groups.quantize_layers`) and below the applications, so that each
application and its Dask tasks import it and not each other.

Layers of ``bakron quantize`` (:func:`quantize_arrays`, :func:`quantize_arrays_stack`): arrays
in (numpy, as read from the layer files), arrays to write and a report entry out, so that the
local command and the distributed tasks support the same inputs (dense or diagonal H_out,
half-precision W) and write the same tensors:

``codes``       int8 (symmetric) or uint8 (asymmetric) codes, (m, n)
``scale``       2-D table in W_hat's dtype: (1, 1) per tensor, (m, 1) per row,
                (m, ceil(n / group_size)) per group
``zero_point``  uint8 table of the same shape (asymmetric grids only)
``W_hat``       the rounded weights (float32 for a half-precision W)

:func:`bakron.io.dequantize` reads them back.

Layers of ``bakron quantize-model`` (:func:`solve_and_publish`): a layer's grid fitted by its
format's rule (:func:`fit_grid`), the solve, and its codes published write-once into the work
folder, the same body in the driver and on a Dask worker
(:mod:`bakron.distributed._model_jobs`), so both write the same bytes.
"""
from __future__ import annotations

import numpy as np

import time
from pathlib import Path

from . import _xp
from ._lib.proxy import ProxyMetrics

__all__ = ["SOLVE_KEYS", "quantize_arrays", "quantize_arrays_stack", "codes_dtype",
           "LAYER_FORMAT", "fit_grid", "decode", "layer_damping", "solve_and_publish"]

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
    from .layer import quantize_layer

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
    from .layer_groups import quantize_layers

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


# -- layers of bakron quantize-model ------------------------------------------------------------

#: the ``format`` of the layer files in the work folder of ``bakron quantize-model``
LAYER_FORMAT = "bakron-model-layer"


def fit_grid(W, grid: dict):
    """The grid of one layer, fitted to ``W`` by the format's rule (deterministic)."""
    fmt = grid["format"]
    if fmt.startswith("gguf-"):
        from .export.grids import fit_block_grid

        return fit_block_grid(W, fmt.split("-")[1].upper())
    if fmt == "gptq":
        from .export.gptq import GPTQGrid

        return GPTQGrid.fit(W, grid["bits"], group_size=grid["group_size"], sym=grid["sym"],
                            min_zero=1)
    from .quantizers import UniformQuantizer

    return UniformQuantizer.fit(W, grid["bits"], symmetric=grid["sym"], granularity="group",
                                group_size=grid["group_size"], method="minmax")


def decode(grid, codes) -> np.ndarray:
    """``W_hat`` (float32) from codes, with the arithmetic of the grid's ``quantize``."""
    return np.asarray(grid.dequantize(np.asarray(codes), dtype=np.float32))


def layer_damping(settings, H_out) -> dict:
    """``quantize_layer``'s damping arguments for one layer (``settings``: a number, the
    damping of both factors, or the dict of :func:`bakron.quantize_model._out_settings`)."""
    if not isinstance(settings, dict):
        return {"damp": float(settings)}
    kw = {"damp": settings["damp"]}
    if H_out is None:
        return kw
    if settings.get("out") == "auto":
        from .factors import auto_regularization

        kw["shrink_out"], kw["damp_out"] = auto_regularization(
            H_out.shape[0], settings["tokens"], rotated=settings.get("rotated", False),
            estimator=settings.get("estimator", "mean"))
    else:
        kw["shrink_out"], kw["damp_out"] = settings["shrink_out"], settings["damp_out"]
    return kw


def rotation(W, incoherence):
    """The :class:`~bakron.incoherence.Incoherence` of ``W``'s shape, or ``None``."""
    if incoherence is None:
        return None
    from .incoherence import Incoherence

    return Incoherence(*W.shape, seed=incoherence)


def solve_and_publish(work, name, key, W, H_in, H_out, grid, tile, damp, incoherence=None):
    """Fit ``W``'s grid, round the layer onto it (round-to-nearest when ``H_in`` is None)
    and publish its codes write-once; returns ``W_hat``. The one body of a layer's solve,
    in the driver and on a Dask worker (bakron.distributed._model_jobs), so both write
    the same bytes. ``damp``: see :func:`layer_damping`. With ``incoherence`` (a seed) the
    layer is rotated on both sides first (:mod:`bakron.incoherence`): the codes are those
    of ``U W Vᵀ`` and ``W_hat`` is rotated back."""
    t = time.perf_counter()
    rot = rotation(W, incoherence)
    if rot is not None:
        W = rot.rotate_weight(W)
        H_in = None if H_in is None else rot.rotate_in(H_in)
        H_out = None if H_out is None else rot.rotate_out(H_out)
    q = fit_grid(W, grid)
    if H_in is None:
        values, codes = q.rtn(W)
    else:
        from .layer import quantize_layer

        res = quantize_layer(W, H_in, H_out, quantizer=q, tile=tuple(tile), metrics="none",
                             **layer_damping(damp, H_out))
        values, codes = res.values, res.codes
    publish(work, name, key, q, values, codes, seconds=time.perf_counter() - t)
    return values if rot is None else rot.unrotate_weight(values)


def publish(work, name, key, q, values, codes, *, seconds):
    """Write one layer's codes write-once, after checking that they decode to ``values``."""
    from .distributed._outputs import publish_tensors

    c = np.asarray(_xp.to_numpy(codes))
    v = np.asarray(_xp.to_numpy(values), dtype=np.float32)
    if not np.array_equal(decode(q, c), v):   # the file must give back exactly W_hat
        raise RuntimeError(f"layer {name}: the codes do not decode to the solver's values")
    final = str(Path(work) / "layers" / f"{name}.safetensors")
    publish_tensors(final, {"codes": c.astype(codes_dtype(q))},
                    {"key": key, "name": name, "seconds": f"{seconds:.6f}"}, LAYER_FORMAT,
                    out_dir=str(work), journal={"layer": name})
