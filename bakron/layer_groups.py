"""Many layers at once: same-shape layers are grouped into stacks and solved together."""
from __future__ import annotations

import dataclasses

from . import _xp
from .layer import METRICS, _layer_result, _prepare, feedback
from .solvers.stack import solve_stack

__all__ = ["quantize_layers", "group_layers", "layer_bytes", "stack_chunks", "STACK_MEMORY"]


def _unpack(k: int, layer):
    try:
        items = tuple(layer)
    except TypeError:
        raise TypeError(f"layers[{k}] must be a tuple (W, H_in) or (W, H_in, H_out), got "
                        f"{type(layer).__name__}") from None
    if len(items) == 2:
        return items[0], items[1], None
    if len(items) == 3:
        return items
    raise ValueError(f"layers[{k}] must be a tuple (W, H_in) or (W, H_in, H_out), got "
                     f"{len(items)} entries")


def _group_key(prep, W):
    """Layers stack together when they share array library, device, dtypes, shape, tile and
    sidedness (one-sided layers never stack with two-sided ones)."""
    A_out = feedback(prep.f_out)
    return (prep.xp.__name__, str(_xp.device(W)), str(W.dtype), tuple(W.shape), prep.tile,
            str(prep.f_in.A.dtype), None if A_out is None else str(A_out.dtype))


def group_layers(keys) -> list[list[int]]:
    """Indices grouped by equal key, groups in order of first appearance, indices ascending."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


#: the default memory budget of one stack in the runners (``bakron quantize --stack-memory``,
#: ``run_layers(stack_memory=)``), in :func:`layer_bytes` units
STACK_MEMORY = 1 << 30


def layer_bytes(m: int, n: int, h_out: bool = True) -> int:
    """Estimated memory of one layer in a stack that a runner reads, solves and writes, at 8
    bytes an element: W, the solved and round-to-nearest values, the codes and the stacked
    copies (6 m n), and each factor as read, prepared and stacked (4 n², and 4 m² with an
    ``H_out``)."""
    return 8 * (6 * m * n + 4 * n * n + (4 * m * m if h_out else 0))


def stack_chunks(keys, nbytes, budget: int, parts: int = 1) -> list[list[int]]:
    """The stacks a runner solves: indices grouped by equal key (:func:`group_layers`), each
    group cut into consecutive, near-equal chunks of at most ``budget`` bytes (``nbytes[i]``
    per layer; one layer at least) and into at least ``parts`` chunks when the group has that
    many layers (so that ``parts`` workers share it)."""
    if budget < 1 or parts < 1:
        raise ValueError(f"budget and parts must be >= 1, got {budget} and {parts}")
    chunks = []
    for group in group_layers(keys):
        per = max(1, budget // max(max(nbytes[i] for i in group), 1))
        k = max(min(parts, len(group)), -(-len(group) // per))
        q, r = divmod(len(group), k)
        start = 0
        for c in range(k):
            stop = start + q + (c < r)
            chunks.append(group[start:stop])
            start = stop
    return chunks


def _stack_factors(xp, factors):
    """One shared 2-D factor when every layer of the group has the same one (layers that
    share a Hessian, such as the query/key/value projections of one input); else a stack."""
    if all(f is factors[0] for f in factors):
        return factors[0].A
    return xp.stack([f.A for f in factors])


def quantize_layers(layers, *, quantizer=None, bits: int | None = None, tile=(16, 16),
                    method: str = "auto", engine: str = "auto", damp: float = 0.01,
                    symmetric: bool = True, granularity: str = "row",
                    group_size: int | None = None, scale_method: str = "rms",
                    workers: int | None = None, max_bytes: int | None = None,
                    errors: str = "raise", metrics: str = "full", progress=None) -> list:
    """Quantize many layers: :func:`bakron.quantize_layer` for each, with same-shape layers
    solved as one stack (:func:`bakron.solve_stack`).

    Parameters
    ----------
    layers : sequence of tuples
        ``(W, H_in)`` or ``(W, H_in, H_out)`` per layer (``H_out=None``: one-sided). Layers
        that pass the same ``H_in`` (or ``H_out``) object share its prepared factor.
    quantizer : quantizer or sequence, optional
        One quantizer for every layer, or one per layer (length ``len(layers)``); when
        omitted, a grid of ``bits`` bits is fitted to each layer as in ``quantize_layer``.
    tile, method, engine, damp, symmetric, granularity, group_size, scale_method
        As in :func:`bakron.quantize_layer`, for every layer.
    workers, max_bytes
        As in :func:`bakron.solve_stack`, for every stack.
    errors : {"raise", "return"}
        ``"raise"``: the first bad layer raises (its index in the message) before any solve.
        ``"return"``: a layer that fails gets its exception in its place of the result list
        and the others go on (a stack that fails is retried layer by layer, so that only
        the bad layers fail) — what a runner that reports failed layers wants. A returned
        exception carries the layer's own exception as ``__cause__``.
    metrics : {"full", "basic", "none"}
        As in :func:`bakron.quantize_layer`, for every layer.
    progress : callable, optional
        Called with a short message before each phase: each layer's factor preparation, each
        stack's solve, each layer's proxy errors.

    Returns
    -------
    list of LayerResult
        In the order of ``layers``; each equal to ``quantize_layer`` on that layer alone.
        ``solve.info["stack"]`` describes the stack the layer was solved in (with its
        ``index`` there), and ``seconds_solve`` is the stack's time divided by its size.
    """
    layers = list(layers)
    if errors not in ("raise", "return"):
        raise ValueError(f"errors must be 'raise' or 'return', got {errors!r}")
    if metrics not in METRICS:
        raise ValueError(f"metrics must be one of {METRICS}, got {metrics!r}")
    say = progress if callable(progress) else (lambda msg: None)
    if isinstance(quantizer, (list, tuple)):
        if len(quantizer) != len(layers):
            raise ValueError(f"quantizer is a sequence of {len(quantizer)} quantizers but "
                             f"there are {len(layers)} layers; give one per layer or one "
                             f"shared quantizer")
        qs = list(quantizer)
    else:
        qs = [quantizer] * len(layers)
    results: list = [None] * len(layers)
    factors: dict = {}
    unpacked, preps = {}, {}
    for k, layer in enumerate(layers):  # every layer checked before any solve
        try:
            W, H_in, H_out = _unpack(k, layer)
            preps[k] = _prepare(W, H_in, H_out, quantizer=qs[k], bits=bits, tile=tile,
                                damp=damp, symmetric=symmetric, granularity=granularity,
                                group_size=group_size, scale_method=scale_method,
                                factors=factors, say=say)
            unpacked[k] = (W, H_in, H_out)
        except (ValueError, TypeError, ArithmeticError) as e:
            if errors == "raise":
                raise _named(k, e) from e
            results[k] = _named(k, e)

    ok = sorted(preps)
    for group in group_layers([_group_key(preps[k], preps[k].W) for k in ok]):
        idx = [ok[g] for g in group]
        try:
            _solve_group(idx, unpacked, preps, results, method, engine, workers, max_bytes,
                         metrics, say)
        except Exception:
            if errors == "raise" or len(idx) == 1:
                if errors == "raise":
                    raise
                results[idx[0]] = _retry_alone(idx[0], unpacked, preps, method, engine,
                                               metrics, say)
                continue
            for i in idx:  # find the bad layers: each alone
                results[i] = _retry_alone(i, unpacked, preps, method, engine, metrics, say)
    return results


def _solve_group(idx, unpacked, preps, results, method, engine, workers, max_bytes,
                 metrics="full", say=None):
    """Solve layers ``idx`` (same key) as one stack and fill their results."""
    say = say or (lambda msg: None)
    xp = preps[idx[0]].xp
    (tx, ty), (m, n) = preps[idx[0]].tile, preps[idx[0]].W.shape
    say(f"solving ({len(idx)} x {m} x {n}, tile {tx}x{ty})" if len(idx) > 1 else
        f"solving ({m} x {n}, tile {tx}x{ty})")
    Ws = xp.stack([preps[i].W for i in idx])
    A_in = _stack_factors(xp, [preps[i].f_in for i in idx])
    A_out = None if feedback(preps[idx[0]].f_out) is None else \
        _stack_factors(xp, [preps[i].f_out for i in idx])
    res = solve_stack(Ws, A_out, A_in, [preps[i].quantizer for i in idx],
                      tile=preps[idx[0]].tile, method=method, engine=engine,
                      workers=workers, max_bytes=max_bytes)
    out = []
    for j, i in enumerate(idx):
        info = dict(res.info, stack=dict(res.info["stack"], index=j))
        one = dataclasses.replace(res, values=res.values[j, ...],
                                  codes=None if res.codes is None else res.codes[j, ...],
                                  seconds=res.seconds / len(idx), targets=None, info=info)
        out.append(_layer_result(preps[i], one, metrics=metrics, say=say))
    for i, r in zip(idx, out):  # only once every layer of the group is done
        results[i] = r


def _retry_alone(i, unpacked, preps, method, engine, metrics="full", say=None):
    """Layer ``i`` as a stack of one; its exception (naming the layer) when it fails."""
    try:
        holder: dict = {}
        _solve_group([i], unpacked, preps, holder, method, engine, None, None, metrics, say)
        return holder[i]
    except Exception as e:  # noqa: BLE001 - reported in the layer's place
        return _named(i, e)


def _named(k: int, e: Exception) -> Exception:
    """``e`` with the layer's index in front of its message (``e`` itself when its class
    cannot be built from a message)."""
    try:
        named = type(e)(f"layers[{k}]: {e}")
    except Exception:  # noqa: BLE001
        return e
    named.__cause__ = e
    return named
