"""Global Hessians: Kronecker factors of the end-to-end loss (docs/hessian.md).

A network is a chain of *stages* ending in a *head* (the loss). ``global_factors`` runs the
chain over calibration batches and returns, for every linear layer, the Kronecker factors
``H_in`` (n x n) and ``H_out`` (m x m) of the Fisher of the loss with respect to that layer's
weight (``H ~ H_out ⊗ H_in``, row-major ``vec``), within a memory budget.

Usage (numpy or cupy; the digits MLP of ``bakron demo``)::

    import bakron.hessian as bh

    stages = [
        bh.Linear(W1, b1, name="fc1"), bh.ReLU(),
        bh.Linear(W2, b2, name="fc2"), bh.GELU(),
        bh.Linear(W3, b3, name="out"),
        bh.SoftmaxCrossEntropy(),          # labels drawn from the model's own softmax (Fisher)
    ]
    factors, report = bh.global_factors(stages, X_calib, batch_size=256,
                                        budget_bytes=None, refine_iters=0, seed=0)
    H_in, H_out = factors["fc1"]           # float64 arrays of the input's namespace
    print(report)                          # passes, stage evaluations, peak memory

- ``X_calib`` is one array ``(N, features)`` or ``(N, T, features)`` (split into batches of
  ``batch_size``), or a list of such batches. The labels of the head are drawn with a generator
  seeded by ``(seed, batch index)``, so every pass (and every budget) sees the same labels.
- ``budget_bytes=None`` keeps everything (one pass, all activations stored). With a budget the
  driver checkpoints activations (binomial schedule, or ``checkpoint="bisection"`` /
  ``"store_all"``) and, when the factor buffers of all layers do not fit, bisects the layer
  range with cached boundary states. The factors are the same for every budget.
- ``refine_iters=k`` runs k power-iteration steps towards the nearest Kronecker product of the
  Fisher (``refine="token"`` or ``"sequence"``; 2 extra passes each).
- ``weights=`` (one array per batch, shape ``(B,)`` or ``(B, T)``) weighs samples or tokens.
- ``progress=True`` shows a progress bar on a terminal (tokens done / total, tokens per
  second, the pass, the time left); a callable receives a :class:`Progress` per batch.
- ``sink=fn`` receives ``fn(name, H_in, H_out)`` as soon as a layer is final (write factors
  out instead of keeping them); ``plan_global(...)`` shows the plan without running it.
- ``input_factors(stages, X_calib, ...)`` gives ``H_in`` alone (one-sided rounding) from
  forward passes: no head, no backward pass, bitwise the ``H_in`` of ``global_factors``.
- Bad input (mismatched shapes between stages, NaN/Inf activations or gradients, a budget too
  small for any plan) raises ``ValueError`` naming the stage, batch or sizes.

Building blocks:

- stages: :class:`Linear`, :class:`Bias`, :class:`ReLU`, :class:`GELU` (exact erf),
  :class:`LayerNorm`, :class:`Residual` (a stage holding a sub-chain), and the head
  :class:`SoftmaxCrossEntropy`; for decoder-only transformers (Llama, Qwen3) on token ids
  :class:`Embedding`, :class:`RMSNorm`, :class:`Attention` (causal GQA with rotary
  embeddings), :class:`SwiGLU` and the chunked language-model head :class:`LMHead`, with
  :func:`pad_batches` to build right-padded id batches. A custom stage implements ``out_shape``, ``forward``, ``vjp``
  and ``linears`` (see :mod:`bakron.hessian.stages`).
- :class:`FactorAccumulator`: streaming float64 second moments with weights, sequence
  updates and a fixed-order ``merge`` (shards combine reproducibly).
- checkpoint schedules and their cost formulas: :func:`reversal_cost`,
  :func:`binomial_cost`, :func:`bisection_cost`, :func:`bisection_slots`.
- test references: :func:`exact_fisher` (brute force, mn x mn) and
  :func:`nearest_kronecker` (Van Loan–Pitsianis).

See ``docs/hessian.md`` for the mathematics and the schedules.
"""
from .accumulate import (FactorAccumulator, pack_upper, sequence_mix, token_quadratic,
                         unpack_upper)
from .checkpoint import (bisection_cost, bisection_slots, binomial_cost, binomial_steps,
                         reversal_cost, reversal_slots)
from .driver import HessianReport, SweepRecord, global_factors, plan_global
from .forward import input_factors
from .progress import Progress
from .reference import exact_fisher, nearest_kronecker, per_sequence_gradients
from .stages import (GELU, Bias, HeadContext, LayerNorm, Linear, ReLU, Residual,
                     SoftmaxCrossEntropy, forward_collect)
from .transformer import (Attention, Embedding, LMHead, RMSNorm, SwiGLU, pad_batches,
                          rope_inv_freq)

__all__ = [
    "global_factors", "plan_global", "input_factors", "forward_collect", "HessianReport",
    "SweepRecord",
    "Linear", "Bias", "ReLU", "GELU", "LayerNorm", "Residual", "SoftmaxCrossEntropy",
    "HeadContext", "FactorAccumulator", "token_quadratic", "sequence_mix", "pack_upper",
    "unpack_upper", "reversal_cost", "reversal_slots", "binomial_cost", "binomial_steps",
    "bisection_cost", "bisection_slots", "exact_fisher", "per_sequence_gradients",
    "nearest_kronecker", "Embedding", "RMSNorm", "Attention", "SwiGLU", "LMHead",
    "pad_batches", "rope_inv_freq", "Progress",
]
