"""``H_in`` alone, from forward passes (one-sided rounding needs no ``H_out``).

A linear layer's input factor is the second moment of its inputs, ``E[x xᵀ]`` (weighted,
padding left out): the forward pass gives it, without the head, the backward pass or any
``H_out``. :func:`input_factors` runs the chain stage by stage over every calibration batch,
holding each batch's state at one stage boundary (two boundaries of all the calibration
tokens at a time), so that a stage's layers are final, and handed to ``sink``, as soon as that
stage has seen every batch, and their accumulators are gone before the next stage starts. It
stops after the last stage that holds a wanted layer.

Its ``H_in`` is bitwise that of :func:`~bakron.hessian.global_factors` without refinement (the
same rows, weights, products and order of batches; ``in_estimator`` as there).
"""
from __future__ import annotations

import time

from .. import _xp
from ..factors import estimator_folds
from .accumulate import FactorAccumulator, gram_buffer
from .driver import (HessianReport, SweepRecord, _defer_checks, _Engine, _Ledger, _prepare,
                     _Run)
from .progress import Progress, progress_bar
from .stages import stage_label

__all__ = ["input_factors", "input_peak_bytes"]


def input_factors(stages, calib_inputs, *, batch_size=None, weights=None, accum_dtype=None,
                  products=None, check_finite=True, sink=None, layers=None, progress=None,
                  in_estimator="mean"):
    """``H_in`` of every linear layer of a chain, from forward passes alone.

    The arguments are those of :func:`~bakron.hessian.global_factors` (``stages`` ends with
    a head, which is not evaluated). ``sink(name, H_in, None)`` is called as soon as a layer
    is final (its stage has seen every batch) and the returned dict then stays empty.

    Returns
    -------
    factors : dict
        ``{layer name: H_in}`` in chain order, bitwise the ``H_in`` of
        :func:`~bakron.hessian.global_factors` with the same arguments and no refinement.
    report : HessianReport
        One forward pass (``checkpoint="forward"``): stage evaluations, no VJPs, peak bytes
        (activations: the two stage boundaries of every batch; buffers: one stage's
        accumulators).
    """
    t0 = time.perf_counter()
    P = _prepare_inputs(stages, calib_inputs, batch_size, accum_dtype, weights, layers,
                        products, in_estimator)
    xp, body, batches = P["xp"], P["body"], P["batches"]
    last = max(i for i, names in enumerate(P["names_at"]) if names)
    report = HessianReport(n_stages=len(body), n_batches=len(batches),
                           n_layers=len(P["layer_shapes"]), budget_bytes=None,
                           checkpoint="forward", refine="token", refine_iters=0)
    eng = _Engine(xp, body, P["head"], 0, check_finite)
    ledger = _Ledger()
    run = _Run(P, eng, ledger, report, "token", 0, sink)
    show, close = progress_bar(progress)
    try:
        results = _pass(run, last, show, t0)
    finally:
        close()
    report.peak_bytes = ledger.peak_total
    report.peak_activation_bytes = ledger.peak["act"]
    report.peak_buffer_bytes = ledger.peak["buf"]
    report.peak_states = ledger.peak_states
    report.seconds = time.perf_counter() - t0
    return results, report


def input_peak_bytes(stages, calib_inputs, *, batch_size=None, accum_dtype=None, layers=None,
                     in_estimator="mean") -> int:
    """The bytes :func:`input_factors` holds at most (nothing is computed): every batch's
    states at two stage boundaries and the largest stage's accumulators (``n x n`` per layer
    and fold)."""
    P = _prepare_inputs(stages, calib_inputs, batch_size, accum_dtype, None, layers, None,
                        in_estimator)
    states = [sum(bs[i] for bs in P["batch_sizes"]) for i in range(len(P["body"]) + 1)]
    last = max(i for i, names in enumerate(P["names_at"]) if names)
    return max(states[i] + states[i + 1] + P["buf"][i] for i in range(last + 1))


def _prepare_inputs(stages, calib_inputs, batch_size, accum_dtype, weights, layers, products,
                    in_estimator) -> dict:
    """The driver's checks and batches, with no ``H_out`` buffers: ``P["buf"][i]`` is the
    bytes of stage ``i``'s ``H_in`` accumulators (``n x n`` per layer and fold)."""
    return _prepare(stages, calib_inputs, batch_size, None, "auto", None, accum_dtype, weights,
                    "token", 0, layers, products, out_copies=0,
                    in_copies=estimator_folds(in_estimator, "in_estimator"))


def _pass(run, last, show, t0) -> dict:
    """Stages ``0..last`` over every batch, stage by stage; ``{name: H_in}`` (empty with a
    sink)."""
    P, eng, ledger, xp = run.P, run.eng, run.ledger, run.xp
    prod, copies = P["products"], P["in_copies"]
    dev = _xp.device(P["batches"][0])
    defer = _defer_checks(xp) and eng.check
    chk = False if defer else "product"
    rec = SweepRecord("forward", 0, last + 1, None, "forward", 0)
    c0 = time.process_time()
    state = {"sel": None, "w_tok": None, "shared": None}
    run._state = state
    scratch = {}
    results = {}
    states = list(P["batches"])   # every batch's state at the current stage boundary
    ledger.alloc("act", sum(eng.nbytes(h) for h in states), len(states))
    for i in range(last + 1):
        names = P["names_at"][i]
        owner = set(names) | {n for n, j in P["skipped"].items() if j == i}
        accs = {n: ([FactorAccumulator(P["layer_shapes"][n][1], xp=xp, dtype=P["acc_dtype"],
                                       device=dev) for _ in range(copies)], None)
                for n in names}
        ledger.alloc("buf", P["buf"][i], 0)
        same_in = {}

        def collect(key, x, _i=i, _accs=accs, _same=same_in, _owner=owner):
            name = f"stage{_i}" if key is None else key
            if name not in _owner:
                raise ValueError(f"stage {stage_label(P['body'][_i], _i)} collected a layer "
                                 f"named {name!r} that its linears() does not declare")
            if P["skipped"].get(name, -1) == _i:   # a layer the caller did not ask for
                return
            n = P["layer_shapes"][name][1]
            if x.shape[-1] != n:
                raise ValueError(f"stage {stage_label(P['body'][_i], _i)} collected x of shape "
                                 f"{tuple(x.shape)} for layer {name!r}, which has {n} inputs")
            acc = _accs[name][0][state["fold"]]
            sh = state["shared"]
            if sh is not None and sh[0] is x:   # q/k/v, gate/up: one input, one product
                _same[name] = sh[3] if _same.get(name, sh[3]) == sh[3] else None
                acc.add_product(*sh[2])
                return
            xs = run._rows(x, n)
            if defer:
                eng._check(xs, f"input of layer {name!r}")
            if (n, True) not in scratch:
                scratch[(n, True)] = gram_buffer(xp, n, prod)
            gram = acc._update(xp, xs, state["w_tok"], products=prod, keep=True, check=chk,
                               out=scratch[(n, True)])
            _same[name] = None
            state["shared"] = [x, xs, gram, name]

        for k in range(len(states)):
            eng.batch, eng.shapes = k, P["shapes"][k]
            state["fold"] = k % copies
            state["w_tok"], state["sel"] = run._batch_rows(k)
            state["shared"] = None
            h = eng.forward(i, states[k], collect=collect if names else None)
            state["shared"] = None
            ledger.alloc("act", eng.nbytes(h), 1)
            ledger.free("act", eng.nbytes(states[k]), 1)
            states[k] = h
            del h
            eng.flush()
            if show is not None:
                done = (i * P["tokens"] + P["batch_tokens"][k]) // (last + 1)
                show(Progress("forward", 1, 1, done, P["tokens"], time.perf_counter() - t0))
        scratch.clear()
        # (one fold: the mean; folds: cross-fitted, a shared input once)
        results.update(run._crossfit_all(names, accs, run.sink, same_in))
        ledger.free("buf", P["buf"][i], 0)
    ledger.free("act", sum(eng.nbytes(h) for h in states), len(states))
    rec.stage_evals = eng.evals
    rec.seconds = time.perf_counter() - t0
    rec.cpu_seconds = time.process_time() - c0
    rec.tokens = P["tokens"]
    run.report.sweeps.append(rec)
    return {n: results[n][0] for names in P["names_at"] for n in names if n in results}
