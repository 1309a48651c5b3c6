"""The stage protocol and the ready stages.

A network is a list of stages ``f_1, …, f_L`` followed by a head (the loss). A **stage** is any
object with

``out_shape(in_shape) -> tuple``
    the shape of its output for an input of shape ``in_shape`` (batch axes included); raise
    ``ValueError`` naming the stage when the input does not fit (the driver checks the whole
    chain this way before it computes anything).
``forward(xp, h) -> array``
    the output for input ``h``; must not modify ``h``.
``vjp(xp, h, delta, collect, need_input_grad=True) -> array | None``
    the vector-Jacobian product: given the stage's input ``h`` and ``delta = ∂loss/∂output``,
    return ``∂loss/∂h`` (or ``None`` when ``need_input_grad`` is false). For every linear weight
    ``W`` (``y = x Wᵀ + b``) it holds, call ``collect(key, x, g)`` with the weight's input rows
    ``x`` (shape ``(..., n)``) and output gradients ``g = ∂loss/∂y`` (shape ``(..., m)``, same
    leading axes): this is where the driver accumulates ``H_in`` and ``H_out``.
``linears() -> dict``
    ``{key: (m, n)}`` for the linear weights it holds (empty for none); its ``vjp`` calls
    ``collect`` once for each. ``None`` as the key means "name it after the stage's position".
``arrays() -> tuple``
    its parameter arrays (used to check that everything lives in one namespace).

Optionally, a stage whose VJP would recompute part of its forward may keep it instead:

``forward_tape(xp, h) -> (array, tape)``
    the output (bitwise that of ``forward``) and a *tape*: arrays (in nested tuples) that its
    ``vjp`` reads when called with ``tape=`` instead of recomputing them (the same values, so
    the factors are bitwise the same either way);
``tape_bytes(in_shape, itemsize) -> int``
    the bytes of that tape for an input of shape ``in_shape`` and activations of ``itemsize``
    bytes.

A stage with linear weights may also have

``forward_collect(xp, h, collect) -> array``
    the output (bitwise that of ``forward``), calling ``collect(key, x)`` with the input rows
    of each linear weight it holds (bitwise the ``x`` its ``vjp`` collects): the forward-only
    pass of :func:`~bakron.hessian.input_factors` (``H_in`` without ``H_out``). Without it
    that pass runs the stage's ``vjp`` on a zero gradient, which costs a VJP.

The driver keeps a tape only where a stage's VJP follows its last forward evaluation (all of
them under the store-all schedule) and counts it as activations in its plan and ledger.

A **head** has ``is_head = True``, ``check_input(in_shape)`` and ``grad(xp, z, ctx)`` returning
``∂loss/∂z`` for the chain's output ``z``; ``ctx`` (:class:`HeadContext`) carries the batch
index, the seed, the batch's inputs and its token mask. A head may set ``draws = R`` (default 1):
``grad`` then returns ``R`` gradient rows per position stacked along the first axis
(``(R·B, ...)``, copy-major) and the driver back-propagates them in one pass, averaging
``H_out`` over the rows (:class:`~bakron.hessian.LMHead`'s ``"sample:K"``, ``"fisher:K"``).

The first stage may take integer inputs (token ids): it then sets ``integer_inputs = True`` and
may define ``token_mask(xp, inputs)``, a boolean array over the batch axes marking the
positions that count (padding is ``False``); the driver gives masked positions zero weight in
every factor and hands the mask to the head.

Leading axes are batch axes: ``(B, n)`` is B single-token samples, ``(B, T, n)`` is B
sequences of T tokens. Stages act on the last axis; token mixing (attention) is a stage too.
A stage that holds a sub-chain (:class:`Residual`) runs it inside its own ``forward``/``vjp``;
its inner activations are transient (not counted by the driver's memory budget).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _xp
from .._lib.special import gelu, gelu_derivative

__all__ = ["Linear", "Bias", "ReLU", "GELU", "LayerNorm", "Residual", "SoftmaxCrossEntropy",
           "HeadContext", "stage_label", "is_head", "forward_collect"]


def stage_label(stage, index=None) -> str:
    """``'fc1' (Linear)`` or ``#3 (ReLU)``: how errors name a stage."""
    name = getattr(stage, "name", None)
    kind = type(stage).__name__
    if name is not None:
        return f"{name!r} ({kind})" if index is None else f"{index} {name!r} ({kind})"
    return f"{kind}" if index is None else f"{index} ({kind})"


def is_head(obj) -> bool:
    return bool(getattr(obj, "is_head", False))


def forward_collect(stage, xp, h, collect):
    """``stage``'s output for input ``h``, calling ``collect(key, x)`` with the input rows of
    each of its linear weights (the ``x`` its ``vjp`` hands to ``collect``, bitwise): its
    ``forward_collect`` where it has one, its ``forward`` where it holds no linear weight,
    else its ``forward`` and a ``vjp`` with a zero gradient (correct, at a VJP's cost)."""
    fn = getattr(stage, "forward_collect", None)
    if fn is not None:
        return fn(xp, h, collect)
    y = stage.forward(xp, h)
    if stage.linears():
        stage.vjp(xp, h, xp.zeros_like(y), lambda key, x, g: collect(key, x),
                  need_input_grad=False)
    return y


def _last_axis(in_shape, stage, what="inputs"):
    if len(in_shape) < 2:
        raise ValueError(f"stage {stage_label(stage)} needs {what} of shape (batch, ..., "
                         f"features), got shape {tuple(in_shape)}")
    return in_shape[-1]


class Linear:
    """``y = x Wᵀ + b`` with ``W`` of shape (m, n); collects ``H_in`` (n x n) and ``H_out``."""

    def __init__(self, W, b=None, *, name: str | None = None):
        if not hasattr(W, "shape") or len(W.shape) != 2 or 0 in tuple(W.shape):
            raise ValueError(f"Linear {name!r}: W must be a non-empty 2-D array (m outputs x n "
                             f"inputs), got shape {getattr(W, 'shape', None)}")
        if b is not None and (not hasattr(b, "shape") or tuple(b.shape) != (W.shape[0],)):
            raise ValueError(f"Linear {name!r}: b must have shape ({W.shape[0]},) to match W "
                             f"{tuple(W.shape)}, got {getattr(b, 'shape', None)}")
        self.W, self.b, self.name = W, b, name

    @property
    def shape(self):
        return tuple(self.W.shape)

    def linears(self):
        return {self.name: self.shape}

    def arrays(self):
        return (self.W,) if self.b is None else (self.W, self.b)

    def out_shape(self, in_shape):
        m, n = self.shape
        if _last_axis(in_shape, self) != n:
            raise ValueError(f"stage {stage_label(self)} expects inputs with {n} features "
                             f"(W is {m} x {n}), got shape {tuple(in_shape)}")
        return tuple(in_shape[:-1]) + (m,)

    def forward(self, xp, h):
        m, n = self.shape
        lead = tuple(h.shape[:-1])
        y = xp.reshape(h, (-1, n)) @ self.W.T
        if self.b is not None:
            y = y + self.b
        return xp.reshape(y, lead + (m,))

    def forward_collect(self, xp, h, collect):
        collect(self.name, h)
        return self.forward(xp, h)

    def vjp(self, xp, h, delta, collect, need_input_grad=True):
        collect(self.name, h, delta)
        if not need_input_grad:
            return None
        m, n = self.shape
        d = xp.reshape(delta, (-1, m)) @ self.W
        return xp.reshape(d, tuple(h.shape[:-1]) + (n,))


class Bias:
    """``y = x + b`` (b over the last axis)."""

    def __init__(self, b, *, name: str | None = None):
        if not hasattr(b, "shape") or len(b.shape) != 1:
            raise ValueError(f"Bias {name!r}: b must be a 1-D array, got shape "
                             f"{getattr(b, 'shape', None)}")
        self.b, self.name = b, name

    def linears(self):
        return {}

    def arrays(self):
        return (self.b,)

    def out_shape(self, in_shape):
        if _last_axis(in_shape, self) != self.b.shape[0]:
            raise ValueError(f"stage {stage_label(self)} adds a bias of length "
                             f"{self.b.shape[0]} but its input has shape {tuple(in_shape)}")
        return tuple(in_shape)

    def forward(self, xp, h):
        return h + self.b

    def vjp(self, xp, h, delta, collect, need_input_grad=True):
        return delta if need_input_grad else None


class _Elementwise:
    name = None

    def __init__(self, *, name: str | None = None):
        self.name = name

    def linears(self):
        return {}

    def arrays(self):
        return ()

    def out_shape(self, in_shape):
        _last_axis(in_shape, self)
        return tuple(in_shape)


class ReLU(_Elementwise):
    """``max(x, 0)`` (gradient 0 at 0)."""

    def forward(self, xp, h):
        return xp.where(h > 0, h, xp.zeros_like(h))

    def vjp(self, xp, h, delta, collect, need_input_grad=True):
        if not need_input_grad:
            return None
        return xp.where(h > 0, delta, xp.zeros_like(delta))


class GELU(_Elementwise):
    """Exact GELU ``x Φ(x)`` with ``Φ(x) = (1 + erf(x/√2))/2``."""

    def forward(self, xp, h):
        return gelu(xp, h)

    def vjp(self, xp, h, delta, collect, need_input_grad=True):
        if not need_input_grad:
            return None
        return delta * gelu_derivative(xp, h)


class LayerNorm:
    """Normalise over the last axis: ``(x - mean) / sqrt(var + eps) * gamma + beta``."""

    def __init__(self, gamma=None, beta=None, *, eps: float = 1e-5, name: str | None = None):
        for a, nm in ((gamma, "gamma"), (beta, "beta")):
            if a is not None and (not hasattr(a, "shape") or len(a.shape) != 1):
                raise ValueError(f"LayerNorm {name!r}: {nm} must be a 1-D array, got shape "
                                 f"{getattr(a, 'shape', None)}")
        if gamma is not None and beta is not None and gamma.shape != beta.shape:
            raise ValueError(f"LayerNorm {name!r}: gamma {tuple(gamma.shape)} and beta "
                             f"{tuple(beta.shape)} must have the same shape")
        if not eps > 0:
            raise ValueError(f"LayerNorm {name!r}: eps must be > 0, got {eps!r}")
        self.gamma, self.beta, self.eps, self.name = gamma, beta, float(eps), name

    def linears(self):
        return {}

    def arrays(self):
        return tuple(a for a in (self.gamma, self.beta) if a is not None)

    def out_shape(self, in_shape):
        d = _last_axis(in_shape, self)
        for a in self.arrays():
            if a.shape[0] != d:
                raise ValueError(f"stage {stage_label(self)} has parameters of length "
                                 f"{a.shape[0]} but its input has shape {tuple(in_shape)}")
        return tuple(in_shape)

    def _normalise(self, xp, h):
        mu = xp.mean(h, axis=-1, keepdims=True)
        c = h - mu
        r = 1.0 / xp.sqrt(xp.mean(c * c, axis=-1, keepdims=True) + self.eps)
        return c * r, r

    def forward(self, xp, h):
        xh, _ = self._normalise(xp, h)
        y = xh if self.gamma is None else xh * self.gamma
        return y if self.beta is None else y + self.beta

    def vjp(self, xp, h, delta, collect, need_input_grad=True):
        if not need_input_grad:
            return None
        xh, r = self._normalise(xp, h)
        dxh = delta if self.gamma is None else delta * self.gamma
        return r * (dxh - xp.mean(dxh, axis=-1, keepdims=True)
                    - xh * xp.mean(dxh * xh, axis=-1, keepdims=True))


class Residual:
    """``y = x + g(x)`` with ``g`` a sub-chain of stages (a transformer block's skip path).

    Linear weights inside are named ``"{name}.{inner key}"`` (inner ``None`` keys become the
    inner position). The VJP recomputes and keeps the sub-chain's activations while it runs,
    unless it is handed the tape of :meth:`forward_tape`.
    """

    def __init__(self, stages, *, name: str):
        stages = list(stages)
        if not stages:
            raise ValueError(f"Residual {name!r}: the sub-chain is empty")
        for j, s in enumerate(stages):
            if is_head(s):
                raise ValueError(f"Residual {name!r}: inner stage {j} is a head; a head can "
                                 f"only end the whole chain")
        if not name:
            raise ValueError("Residual needs a name (it prefixes the names of its linears)")
        self.stages, self.name = stages, name
        self._keys = []
        for j, s in enumerate(stages):
            for k in s.linears():
                self._keys.append((j, k, f"{name}.{j if k is None else k}"))
        self._names = {(j, k): full for j, k, full in self._keys}

    def linears(self):
        out = {}
        for j, k, full in self._keys:
            out[full] = self.stages[j].linears()[k]
        return out

    def arrays(self):
        return tuple(a for s in self.stages for a in s.arrays())

    def out_shape(self, in_shape):
        shape = tuple(in_shape)
        for j, s in enumerate(self.stages):
            try:
                shape = tuple(s.out_shape(shape))
            except ValueError as exc:
                raise ValueError(f"in Residual {self.name!r}, inner stage {j}: {exc}") from None
        if shape != tuple(in_shape):
            raise ValueError(f"Residual {self.name!r}: the sub-chain maps shape "
                             f"{tuple(in_shape)} to {shape}; a residual needs them equal")
        return shape

    def forward(self, xp, h):
        y = h
        for s in self.stages:
            y = s.forward(xp, y)
        return h + y

    def forward_collect(self, xp, h, collect):
        y = h
        for j, s in enumerate(self.stages):
            def inner(key, x, _j=j):
                collect(self._names[(_j, key)], x)
            y = forward_collect(s, xp, y, inner)
        return h + y

    def forward_tape(self, xp, h):
        """The output and the tape of the sub-chain: the inner stages' inputs (but ``h``)
        and the tapes of the inner stages that have one (:meth:`vjp` then recomputes
        nothing)."""
        states, tapes = [], []
        y = h
        for j, s in enumerate(self.stages):
            if j:
                states.append(y)
            if hasattr(s, "forward_tape"):
                y, t = s.forward_tape(xp, y)
            else:
                y, t = s.forward(xp, y), None
            tapes.append(t)
        return h + y, (tuple(states), tuple(tapes))

    def tape_bytes(self, in_shape, itemsize: int) -> int:
        """Bytes of :meth:`forward_tape`'s tape for an input of shape ``in_shape``."""
        total, shape = 0, tuple(in_shape)
        for j, s in enumerate(self.stages):
            if j:
                total += int(np.prod(shape)) * int(itemsize)
            if hasattr(s, "tape_bytes"):
                total += int(s.tape_bytes(shape, itemsize))
            shape = tuple(s.out_shape(shape))
        return total

    def vjp(self, xp, h, delta, collect, need_input_grad=True, tape=None):
        if tape is None:
            states, tapes = [h], [None] * len(self.stages)
            for s in self.stages[:-1]:
                states.append(s.forward(xp, states[-1]))
        else:
            states, tapes = [h, *tape[0]], list(tape[1])
        del tape
        names = self._names
        d = delta
        for j in range(len(self.stages) - 1, -1, -1):
            def inner(key, x, g, _j=j):
                collect(names[(_j, key)], x, g)
            kw = {} if tapes[j] is None else {"tape": tapes[j]}
            d = self.stages[j].vjp(xp, states[j], d, inner,
                                   need_input_grad=(j > 0 or need_input_grad), **kw)
            states[j] = tapes[j] = None
        return (delta + d) if need_input_grad else None


@dataclass(frozen=True)
class HeadContext:
    """What a head may depend on besides its input: the calibration batch and the seed.

    ``inputs`` is the batch's calibration input (e.g. token ids, from which a language-model
    head reads next-token labels) and ``mask`` the real positions the first stage reports
    (``token_mask``; ``None``: all), when the driver knows them.
    """

    batch_index: int
    seed: int
    inputs: object = None
    mask: object = None


class SoftmaxCrossEntropy:
    """Softmax cross-entropy over the last axis, summed over tokens.

    ``labels=None`` (default): each token's label is drawn from the model's own softmax
    (inverse CDF of a uniform from ``numpy.random.default_rng((seed, batch_index))``), so the
    gradient's outer products estimate the **Fisher**, the Hessian of the KL to the original
    model at the original weights; every pass and every budget draws the same labels.
    ``labels=[y_0, y_1, ...]`` (one integer array per calibration batch, shape of the batch
    axes): fixed labels (the empirical Fisher of the true-label loss).
    """

    is_head = True

    def __init__(self, labels=None, *, name: str = "head"):
        self.fixed = None if labels is None else list(labels)
        self.name = name

    def linears(self):
        return {}

    def arrays(self):
        return ()

    def check_input(self, in_shape):
        c = _last_axis(in_shape, self, "logits")
        if c < 2:
            raise ValueError(f"head {stage_label(self)} needs at least 2 classes, got logits "
                             f"of shape {tuple(in_shape)}")

    @staticmethod
    def probabilities(xp, z):
        e = xp.exp(z - xp.max(z, axis=-1, keepdims=True))
        return e / xp.sum(e, axis=-1, keepdims=True)

    def labels_for(self, xp, z, ctx: HeadContext):
        """The labels used for this batch (sampled or fixed), shape ``z.shape[:-1]``, int64."""
        lead = tuple(z.shape[:-1])
        C = z.shape[-1]
        if self.fixed is not None:
            if ctx.batch_index >= len(self.fixed):
                raise ValueError(f"head {stage_label(self)} has labels for "
                                 f"{len(self.fixed)} batches, but batch {ctx.batch_index} "
                                 f"was requested")
            y = xp.asarray(self.fixed[ctx.batch_index], device=_xp.device(z))
            if tuple(y.shape) != lead:
                raise ValueError(f"head {stage_label(self)}: labels of batch "
                                 f"{ctx.batch_index} have shape {tuple(y.shape)}, the logits "
                                 f"{tuple(z.shape)} need {lead}")
            y = xp.astype(y, xp.int64)
            if bool(xp.any(y < 0)) or bool(xp.any(y >= C)):
                raise ValueError(f"head {stage_label(self)}: labels of batch "
                                 f"{ctx.batch_index} must lie in 0..{C - 1}")
            return y
        u = np.random.default_rng((int(ctx.seed), int(ctx.batch_index))).random(lead)
        u = xp.asarray(u, device=_xp.device(z))
        cdf = xp.cumulative_sum(xp.astype(self.probabilities(xp, z), xp.float64), axis=-1)
        y = xp.sum(xp.astype(cdf < u[..., None], xp.int64), axis=-1)
        return xp.minimum(y, xp.asarray(C - 1, dtype=xp.int64, device=_xp.device(z)))

    def token_losses(self, xp, z, labels):
        """``-log softmax(z)[label]`` per token (shape ``z.shape[:-1]``)."""
        zs = z - xp.max(z, axis=-1, keepdims=True)
        lse = xp.log(xp.sum(xp.exp(zs), axis=-1))
        onehot = self._onehot(xp, labels, z)
        return lse - xp.sum(zs * onehot, axis=-1)

    @staticmethod
    def _onehot(xp, labels, z):
        C = z.shape[-1]
        classes = xp.arange(C, dtype=xp.int64, device=_xp.device(z))
        return xp.astype(labels[..., None] == classes, z.dtype)

    def grad(self, xp, z, ctx: HeadContext):
        """``∂loss/∂z = softmax(z) - onehot(label)`` per token (loss summed over tokens)."""
        y = self.labels_for(xp, z, ctx)
        return self.probabilities(xp, z) - self._onehot(xp, y, z)
