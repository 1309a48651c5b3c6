"""``bakron quantize-model``: a model checkpoint in, a deployable quantized model out.

:func:`quantize_model` loads a Llama-family causal LM (a Hugging Face folder of
``LlamaForCausalLM`` / ``Qwen3ForCausalLM``, a ``llama`` or ``qwen3`` GGUF file, or the
built-in ``"smollm2"``), collects Hessian factors on calibration text, rounds every linear
layer onto the export format's own grid and writes the export:

==============  =================================  ============================================
``fmt``         grid                               written by
==============  =================================  ============================================
``gguf-q4_0``   llama.cpp Q4_0 blocks of 32        :func:`bakron.export.write_gguf` (GGUF source)
``gguf-q4_1``   llama.cpp Q4_1 blocks of 32        :func:`bakron.export.write_gguf` (GGUF source)
``gguf-q8_0``   llama.cpp Q8_0 blocks of 32        :func:`bakron.export.write_gguf` (GGUF source)
``gptq``        GPTQ min/max grid, fp16 scales     :func:`bakron.export.write_gptq` (HF folder)
``float``       uniform min/max grid               :func:`bakron.export.write_dequantized` (HF)
==============  =================================  ============================================

Any source goes to any format: a Hugging Face folder for a GGUF format is converted into
``OUT.work/source.gguf`` (:func:`bakron.export.to_gguf.gguf_source_from_hf`), a GGUF source
for ``gptq`` / ``float`` into ``OUT.work/source-hf/``
(:func:`bakron.export.from_gguf.gguf_to_hf`); whether it can be is checked before any work.

``factors`` chooses the rounding: ``rtn`` (the grid's round-to-nearest, llama.cpp's rule for
the GGUF grids; no calibration), ``input`` (one-sided LDLQ/GPTQ with each layer's input
second moment ``H_in``), ``global`` (two-sided with both Kronecker factors of the Fisher of the
KL to the original model, :func:`bakron.hessian.global_factors` with one refinement step) and
``input+global-out`` (two-sided with the local ``H_in`` and the global ``H_out``).

Resumable: every finished layer's codes are published write-once (temporary file, fsync,
link; :func:`bakron.distributed._outputs.write_layer_file`) into the work folder
``OUT.work/``. A killed run started again with the same arguments continues from the layers
already written; different arguments are refused. The export is written atomically once every
layer is done, then the work folder is removed. Every argument, the model and the format's
ability to hold the grid are checked before any work is done.

Scale-out (``scheduler=`` / ``gpus=`` / ``client=``, docs/export.md "Devices and scale-out"):
the factors are collected here and each layer's solve runs as one Dask task
(:mod:`bakron.distributed._model_jobs`) through the same :func:`_solve_and_publish`, so the
layer files and the export are the same.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from . import _xp
from ._lib.fs import atomic_write_json
from ._validate import check_bits, check_damp, check_int
from .io import InputError, OutputExistsError

__all__ = ["FORMATS", "FACTORS", "quantize_model", "work_folder", "calibration_sequences",
           "perplexity_and_kl", "reference_log_probs"]

FORMATS = ("gguf-q4_0", "gguf-q4_1", "gguf-q8_0", "gptq", "float")
FACTORS = ("rtn", "input", "global", "input+global-out")
_GGUF_BITS = {"gguf-q4_0": 4, "gguf-q4_1": 4, "gguf-q8_0": 8}
_LAYER_FORMAT = "bakron-model-layer"
_RUN_FILE = "run.json"
_VERSION = 1


def work_folder(out) -> Path:
    """The work folder of output ``out``: ``OUT.work`` next to it."""
    out = Path(os.path.abspath(out))
    return out.with_name(out.name + ".work")


# -- arguments -----------------------------------------------------------------------------------

def _checked(check, value, name, **kw):
    """``check(value, name, **kw)`` of :mod:`bakron._validate`, its ``ValueError`` raised as
    :class:`~bakron.io.InputError` (the error this module documents; same message)."""
    try:
        return check(value, name, **kw)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def _grid_settings(fmt, bits, group_size, sym):
    """The grid of ``fmt`` as a dict, or ``InputError`` naming what the format cannot hold."""
    if fmt not in FORMATS:
        raise InputError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt in _GGUF_BITS:
        want = _GGUF_BITS[fmt]
        what = f"{fmt} stores {want}-bit codes in blocks of 32 inputs with its own scale rule"
        if bits is not None and bits != want:
            raise InputError(f"{what}; it cannot represent a {bits}-bit grid (use --bits "
                             f"{want} or another --format)")
        if group_size is not None and group_size != 32:
            raise InputError(f"{what}; it cannot represent groups of {group_size} inputs")
        if sym is not None:
            raise InputError(f"{what}; --sym/--asym apply to --format gptq and float only")
        return {"format": fmt, "bits": want, "group_size": 32, "sym": None}
    bits = 4 if bits is None else _checked(check_bits, bits, "bits")
    if fmt == "gptq" and bits not in (2, 4, 8):
        raise InputError(f"gptq packs 2-, 4- or 8-bit codes into int32 words; it cannot "
                         f"represent a {bits}-bit grid (use --format float for {bits} bits)")
    group_size = 128 if group_size is None else _checked(
        check_int, group_size, "group_size", minimum=1, what="a positive integer")
    return {"format": fmt, "bits": bits, "group_size": group_size,
            "sym": True if sym is None else bool(sym)}


def _fit_grid(W, grid: dict):
    """The grid of one layer, fitted to ``W`` by the format's rule (deterministic)."""
    fmt = grid["format"]
    if fmt in _GGUF_BITS:
        from .export import fit_block_grid

        return fit_block_grid(W, fmt.split("-")[1].upper())
    if fmt == "gptq":
        from .export import GPTQGrid

        return GPTQGrid.fit(W, grid["bits"], group_size=grid["group_size"], sym=grid["sym"],
                            min_zero=1)
    from .quantizers import UniformQuantizer

    return UniformQuantizer.fit(W, grid["bits"], symmetric=grid["sym"], granularity="group",
                                group_size=grid["group_size"], method="minmax")


def _decode(grid, codes) -> np.ndarray:
    """``W_hat`` (float32) from codes, with the arithmetic of the grid's ``quantize``."""
    return np.asarray(grid.dequantize(np.asarray(codes), dtype=np.float32))


# -- calibration ---------------------------------------------------------------------------------

def _calibration_documents(calib) -> tuple[list[str], str]:
    if calib == "builtin":
        cal_all, held = _builtin_split()
        return cal_all, (f"the Python Language Reference (pydoc_data), calibration topics "
                         f"({len(cal_all)} sentences; {len(held)} of held-out topics left "
                         f"out)")
    path = Path(calib)
    if not path.is_file():
        raise InputError(f"--calib {calib}: no such file (give a text file or 'builtin')")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"--calib {calib}: not UTF-8 text ({exc})") from None
    docs = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
    if not docs:
        raise InputError(f"--calib {calib}: the file holds no text")
    return docs, f"{path} ({len(docs)} paragraphs)"


def _builtin_split():
    """(calibration sentences, held-out sentences) of the Language Reference: all of each
    side, the held-out topics being those :func:`calibration_and_heldout` keeps out."""
    import random

    from .models.textdata import python_reference_sentences

    by_topic = python_reference_sentences()
    topics = sorted(by_topic)
    rng = random.Random(0)
    held = set(rng.sample(topics, max(1, len(topics) // 4)))
    return ([s for t in topics if t not in held for s in by_topic[t]],
            [s for t in topics if t in held for s in by_topic[t]])


def calibration_sequences(lm, docs, n_seqs: int, seq_len: int) -> list[list[int]]:
    """``n_seqs`` token sequences of ``seq_len`` tokens cut from the documents' tokens laid end
    to end (EOS between documents when the model has one); fewer when the text runs out (the
    last one may be shorter, at least 2 tokens)."""
    stream: list[int] = []
    eos = getattr(lm.config, "eos_id", None)
    need = n_seqs * seq_len
    for ids in lm.tokenize(docs):
        stream.extend(ids)
        if eos is not None and 0 <= eos < lm.config.vocab_size:
            stream.append(int(eos))
        if len(stream) >= need:
            break
    seqs = [stream[i:i + seq_len] for i in range(0, min(len(stream), need), seq_len)]
    return [s for s in seqs if len(s) >= 2]


# -- the run -------------------------------------------------------------------------------------

def _say(progress, msg):
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _source_kind(model) -> tuple[str, Path | None]:
    """("gguf" | "hf", path or None for a named model not yet fetched)."""
    from .models.llm.fetch import MODELS

    if isinstance(model, str) and model.lower() in MODELS:
        return "gguf", None
    p = Path(model).expanduser()
    if p.is_dir():
        return "hf", p
    return "gguf", p


def _conversion(kind, fmt) -> str | None:
    """``"gguf"`` (an HF source for a GGUF format), ``"hf"`` (a GGUF source for gptq/float)
    or ``None`` (the source is of the format's own kind)."""
    if fmt in _GGUF_BITS:
        return "gguf" if kind == "hf" else None
    return "hf" if kind == "gguf" else None


def _check_convertible(lm, src, to, fmt, model):
    """``InputError`` naming the format and the reason when the loaded model ``lm`` (read
    from ``src``) cannot be written as the other kind of source (checked before any work)."""
    from .models.llm.config import UnsupportedModelError

    what = "a GGUF file" if to == "gguf" else "a Hugging Face folder"
    try:
        if to == "hf":
            from .export.from_gguf import check_tensor_names

            lm.config.to_hf()
            check_tensor_names(src)
        else:
            from .export.to_gguf import check_tensor_names

            if lm.tokenizer is None:
                raise UnsupportedModelError("it has no tokenizer.json")
            lm.tokenizer.gguf_fields(lm.config.vocab_size)
            check_tensor_names(src)
    except UnsupportedModelError as exc:
        raise InputError(f"--format {fmt} writes {what}; {model} cannot be converted to one: "
                         f"{exc}") from None


def _converted_source(src, work, to, progress) -> Path:
    """The source converted into the work folder (``source.gguf`` or ``source-hf/``),
    written atomically once and reused by a resumed run."""
    if to == "gguf":
        from .export.to_gguf import gguf_source_from_hf

        path = work / "source.gguf"
        if not path.is_file():
            _say(progress, f"converting {src} to GGUF ({path}) ...")
            gguf_source_from_hf(src, path)
    else:
        from .export.from_gguf import gguf_to_hf

        path = work / "source-hf"
        if not path.is_dir():
            _say(progress, f"converting {src} to a Hugging Face folder ({path}) ...")
            gguf_to_hf(src, path)
    return path


def _run_key(lm, source, grid, factors, options, calib_seqs) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"version": _VERSION, "source": str(source), "grid": grid,
                         "factors": factors, "options": options}, sort_keys=True).encode())
    for name in lm.linear_names():  # a sample of the weights: another checkpoint, another key
        h.update(np.ascontiguousarray(_xp.to_numpy(lm.linear_weight(name)))[::7, ::7]
                 .tobytes())
    h.update(json.dumps(calib_seqs).encode())
    return h.hexdigest()


def quantize_model(model, out, *, fmt: str = "gguf-q4_0", factors: str = "global",
                   bits: int | None = None, group_size: int | None = None,
                   sym: bool | None = None, calib="builtin", calib_seqs: int = 32,
                   calib_len: int = 128, memory_budget: int | None = None,
                   device: str | None = None, tile=(16, 16), damp: float = 0.01,
                   seed: int = 0, batch_size: int = 8, cache=None, wheel=None,
                   progress: bool = True, keep_weights: bool = False,
                   scheduler: str | None = None, gpus: int | None = None, client=None,
                   retries: int = 2, _after_layer=None) -> dict:
    """Quantize every linear layer of a causal LM and write the export ``out``.

    Parameters
    ----------
    model : str or path
        ``"smollm2"``, a ``llama`` or ``qwen3`` ``.gguf`` file or a Hugging Face folder
        (:func:`bakron.models.load_llm`); converted to the format's kind of source when it
        is of the other kind.
    out : path
        The export: a GGUF file (``gguf-*``) or a folder (``gptq``, ``float``); must not
        exist. Its work folder ``OUT.work`` holds the finished layers until the end.
    fmt : {"gguf-q4_0", "gguf-q4_1", "gguf-q8_0", "gptq", "float"}
    factors : {"rtn", "input", "global", "input+global-out"}
    bits, group_size, sym
        The grid of ``gptq`` (bits 2/4/8) and ``float`` (bits 2..8); defaults 4 bits, groups
        of 128, symmetric. The GGUF formats fix their grid (giving another is an error).
    calib : "builtin" or path
        Calibration text: the stdlib's Python Language Reference, or a UTF-8 file with one
        document per paragraph (blank-line separated).
    calib_seqs, calib_len
        Number and length (tokens) of the calibration sequences.
    memory_budget : int, optional
        Working-memory budget (bytes) of :func:`bakron.hessian.global_factors` (the
        recursive checkpointing); ``None`` stores every activation.
    device : {"auto", "cpu", "gpu"}, optional
        Where the model runs (the factor collection) and the solves run; ``None``: ``"gpu"``
        with ``gpus``, else ``"cpu"``. ``"cpu"`` with ``gpus`` is an error.
    tile, damp
        Solver tile and relative damping (:func:`bakron.quantize_layer`).
    seed : int
        Seed of the labels drawn for the Fisher.
    batch_size : int
        Calibration sequences per batch of the Hessian passes.
    cache, wheel
        Cache folder and local wheel of a named model (:func:`bakron.models.load_llm`).
    progress : bool
        A progress bar over the layers (tqdm, on stderr) and a few lines of report.
    keep_weights : bool
        Also return the quantized weights (``result["weights"]``: ``{name: W_hat}``, float32)
        and the loaded original model (``result["model_object"]``).
    scheduler, gpus, client
        Scale-out on Dask (at most one of them; docs/export.md, "Devices and scale-out"):
        the address of a running scheduler whose workers see ``OUT``'s folder, ``N`` to
        start a loopback cluster of one worker per GPU (the first N visible), or a
        ``distributed.Client`` of the caller's (left open). The factor collection stays in
        this process; each layer's solve is one Dask task, submitted as soon as the layer's
        factors are final, and the worker publishes the layer file write-once, as this
        process does without them (the same bytes). ``retries``: re-runs of a task that
        raised (on another worker when there is one).

    Returns a dict: ``out``, ``layers`` (per layer: seconds, resumed), ``seconds`` (per
    phase), ``resumed`` (layers found in the work folder), ``calibration``.

    Raises :class:`~bakron.io.InputError` (bad argument, a format that cannot hold the grid
    or the model's shapes, a source that cannot be converted to the format's kind, a work
    folder of another run), :class:`~bakron.io.OutputExistsError`
    (``out`` exists), ``ClusterUnavailable`` of ``bakron.distributed._model_jobs`` (Dask
    missing, the scheduler unreachable, fewer GPUs than ``gpus``; raised before the model is
    loaded), and the loader's errors (:func:`bakron.models.load_llm`).
    """
    from .distributed._outputs import verify_layer_file

    t_start = time.perf_counter()
    grid = _grid_settings(fmt, bits, group_size, sym)
    if factors not in FACTORS:
        raise InputError(f"factors must be one of {', '.join(FACTORS)}, got {factors!r}")
    calib_seqs, calib_len, batch_size = (
        _checked(check_int, v, name, minimum=lo) for name, v, lo in (
            ("calib_seqs", calib_seqs, 1), ("calib_len", calib_len, 2),
            ("batch_size", batch_size, 1)))
    if memory_budget is not None:
        memory_budget = _checked(check_int, memory_budget, "memory_budget", minimum=1,
                                 what="a positive number of bytes")
    seed = _checked(check_int, seed, "seed", minimum=0)
    retries = _checked(check_int, retries, "retries", minimum=0)
    if isinstance(tile, (str, bytes)) or not hasattr(tile, "__len__") or len(tile) != 2:
        raise InputError(f"tile must be a pair of positive integers (tx, ty), got {tile!r}")
    tile = tuple(_checked(check_int, t, "tile", minimum=1, what="a pair of positive integers")
                 for t in tile)
    damp = _checked(check_damp, damp, "damp")
    if gpus is not None:
        gpus = _checked(check_int, gpus, "gpus", minimum=1)
    if sum(x is not None for x in (scheduler, gpus, client)) > 1:
        raise InputError("give at most one of scheduler (--scheduler), gpus (--gpus) and "
                         "client")
    if device is None:
        device = "gpu" if gpus else "cpu"
    if device not in ("auto", "cpu", "gpu"):
        raise InputError(f"device must be one of auto, cpu, gpu, got {device!r}")
    if gpus and device == "cpu":
        raise InputError(f"gpus={gpus} (--gpus) runs the solves on GPU workers; device 'cpu' "
                         f"contradicts it (drop --device cpu, or use --scheduler with CPU "
                         f"workers)")
    out = Path(os.path.abspath(out))
    if out.exists() or out.is_symlink():
        raise OutputExistsError(f"{out} already exists; choose another --out (it is never "
                                f"replaced)")
    if not out.parent.is_dir():
        raise InputError(f"the folder of --out, {out.parent}, does not exist")
    kind, src = _source_kind(model)
    if kind == "hf" and fmt in _GGUF_BITS and not (src / "tokenizer.json").is_file() \
            and (src / "config.json").is_file():
        raise InputError(f"--format {fmt} writes a GGUF file, which carries the model's "
                         f"tokenizer; {model} has no tokenizer.json to convert")
    if src is not None and kind == "gguf" and not src.is_file():
        from .models.llm import ModelUnavailableError

        raise ModelUnavailableError(f"model {str(model)!r} not found: neither a known name nor "
                                    f"an existing GGUF file or Hugging Face folder")
    docs = None
    if factors != "rtn":
        docs, calib_note = _calibration_documents(calib)
    else:
        calib_note = "none (round-to-nearest)"

    # the cluster first: an unreachable scheduler or missing GPUs are refused before any work
    # (and the GPU workers start before this process makes a CUDA context)
    solves = None
    if scheduler is not None or gpus or client is not None:
        from .distributed._model_jobs import DaskLayerSolves

        solves = DaskLayerSolves.connect(scheduler=scheduler, gpus=gpus, client=client,
                                         retries=retries, device=device)
    try:
        from .demo._common import namespace
        from .models import load_llm

        xp, dev = namespace(device)
        seconds = {}
        t0 = time.perf_counter()
        _say(progress, f"loading {model} ...")
        lm = load_llm(model, xp=xp, cache=cache, wheel=wheel, progress=progress)
        if src is None:
            from .models.llm.fetch import model_file

            src = model_file(str(model).lower(), cache, wheel=wheel)
        convert = _conversion(kind, fmt)
        if convert is not None:   # before any work: can the source be written as the other kind?
            _check_convertible(lm, src, convert, fmt, model)
        names = list(lm.linear_names())
        for name in names:   # every layer's shape must fit the grid before any work
            m, n = lm.linear_weight(name).shape
            g = grid["group_size"]
            if n % g and fmt != "float":   # (a float export's grid may end in a shorter group)
                raise InputError(f"{fmt} with groups of {g} inputs cannot represent layer {name} "
                                 f"({m}x{n}): {n} inputs are not a multiple of {g}")
        seqs = []
        if docs is not None:
            seqs = calibration_sequences(lm, docs, calib_seqs, calib_len)
            if not seqs:
                raise InputError(f"the calibration text gives no sequence of at least 2 tokens "
                                 f"({calib_note})")
            if len(seqs) < calib_seqs or len(seqs[-1]) < calib_len:
                _say(progress, f"note: the calibration text gives {len(seqs)} sequence(s) "
                               f"({sum(map(len, seqs))} tokens), fewer than "
                               f"{calib_seqs} x {calib_len}")
        seconds["load"] = time.perf_counter() - t0

        options = {"tile": list(tile), "damp": float(damp), "seed": int(seed),
                   "refine_iters": 0 if factors in ("rtn", "input") else 1, "refine": "sequence"}
        key = _run_key(lm, str(model), grid, factors, options, seqs)
        work = work_folder(out)
        run_file = work / _RUN_FILE
        if work.exists():
            try:
                old = json.loads(run_file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                old = None
            if not isinstance(old, dict) or old.get("key") != key:
                raise InputError(f"the work folder {work} belongs to another run (another model, "
                                 f"calibration or settings); remove it or choose another --out")
        else:
            work.mkdir()
            atomic_write_json(run_file, {"key": key, "model": str(model), "grid": grid,
                                         "factors": factors, "options": options,
                                         "calibration": calib_note, "out": str(out)})

        from .distributed._outputs import LockHeld, OutputLock

        lock = OutputLock(str(work))
        try:
            lock.acquire()
        except LockHeld as exc:
            raise OutputExistsError(str(exc)) from None
        try:
            def layer_key(name):
                return f"{key}:{name}"

            def layer_file(name):
                return work / "layers" / f"{name}.safetensors"

            export_src = src
            if convert is not None:
                t0 = time.perf_counter()
                export_src = _converted_source(src, work, convert, progress)
                seconds["convert"] = time.perf_counter() - t0
            done = {}
            for name in names:
                ok, _reason, _sum, meta = verify_layer_file(str(layer_file(name)), layer_key(name),
                                                            fmt=_LAYER_FORMAT)
                if ok:
                    done[name] = meta
            todo = [n for n in names if n not in done]
            rows = {n: {"resumed": True, "seconds": float(done[n].get("seconds", 0.0))}
                    for n in done}
            if done:
                _say(progress, f"resuming: {len(done)} of {len(names)} layers already in {work}")
            state = {"W_hat": {}}

            from tqdm.auto import tqdm

            bar = tqdm(total=len(names), initial=len(done), unit="layer", desc="layers",
                       disable=not progress, file=sys.stderr, dynamic_ncols=True)

            def published(name, seconds, values=None):
                """A layer's file is published (here or on a worker): count it."""
                if keep_weights and values is not None:
                    state["W_hat"][name] = np.asarray(_xp.to_numpy(values), dtype=np.float32)
                rows[name] = {"resumed": False, "seconds": seconds}
                bar.set_postfix_str(name, refresh=False)
                bar.update(1)
                if _after_layer is not None:
                    _after_layer(name)

            def finish(name, H_in, H_out):
                """The factors of ``name`` are final: solve it here, or submit its solve."""
                if solves is not None:
                    solves.submit(name, layer_key(name), lm.linear_weight(name), H_in, H_out)
                    return
                t = time.perf_counter()
                values = _solve_and_publish(work, name, layer_key(name),
                                            lm.linear_weight(name), H_in, H_out, grid, tile,
                                            damp)
                published(name, time.perf_counter() - t, values)

            if solves is not None:
                solves.start(str(work), grid=grid, tile=tile, damp=damp, on_done=published)

            t0 = time.perf_counter()
            report = None
            try:
                if todo and factors == "rtn":
                    for name in todo:
                        finish(name, None, None)
                elif todo:
                    report = _collect(lm, xp, seqs, todo, factors, options, memory_budget,
                                      batch_size, finish, progress=progress)
                if solves is not None:
                    solves.wait()   # every submitted solve published (or the first error)
            finally:
                if solves is not None:
                    solves.cancel()   # after an error or an interrupt: drop what is queued
                bar.close()
            if report is not None:
                _say(progress, str(report))
            seconds["factors_and_solves"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            layers = {}
            for name in names:
                path = layer_file(name)
                ok, reason, _sum, _meta = verify_layer_file(str(path), layer_key(name),
                                                            fmt=_LAYER_FORMAT)
                if not ok:
                    raise OSError(f"{path}: the layer file no longer verifies ({reason})")
                from .io import read_tensors

                W = lm.linear_weight(name)
                q = _fit_grid(W, grid)
                W_hat = _decode(q, read_tensors(path)["codes"])
                if keep_weights and name not in state["W_hat"]:
                    state["W_hat"][name] = W_hat
                layers[name] = (W_hat, q)
            _say(progress, f"writing {out} ...")
            _export(fmt, out, export_src, layers)
            seconds["export"] = time.perf_counter() - t0
            seconds["total"] = time.perf_counter() - t_start
        finally:
            lock.release()
        shutil.rmtree(work, ignore_errors=True)
        result = {"out": str(out), "model": str(model), "source": str(src), "grid": grid,
                  "factors": factors, "calibration": {"text": calib_note, "sequences": len(seqs),
                                                      "tokens": int(sum(map(len, seqs)))},
                  "layers": rows, "resumed": len(done), "seconds": seconds, "device": dev}
        if keep_weights:
            result["weights"] = state["W_hat"]
            result["model_object"] = lm
        return result
    finally:
        if solves is not None:
            solves.close()


def _solve_and_publish(work, name, key, W, H_in, H_out, grid, tile, damp):
    """Fit ``W``'s grid, round the layer onto it (round-to-nearest when ``H_in`` is None)
    and publish its codes write-once; returns ``W_hat``. The one body of a layer's solve,
    in this process and on a Dask worker (bakron.distributed._model_jobs), so both write
    the same bytes."""
    t = time.perf_counter()
    q = _fit_grid(W, grid)
    if H_in is None:
        values, codes = q.rtn(W)
    else:
        from .layer import quantize_layer

        res = quantize_layer(W, H_in, H_out, quantizer=q, tile=tuple(tile), damp=damp,
                             metrics="none")
        values, codes = res.values, res.codes
    _publish(work, name, key, q, values, codes, seconds=time.perf_counter() - t)
    return values


def _publish(work, name, key, q, values, codes, *, seconds):
    """Write one layer's codes write-once, after checking that they decode to ``values``."""
    from ._lib.pipeline import codes_dtype
    from .distributed._outputs import publish_tensors

    c = np.asarray(_xp.to_numpy(codes))
    v = np.asarray(_xp.to_numpy(values), dtype=np.float32)
    if not np.array_equal(_decode(q, c), v):   # the file must give back exactly W_hat
        raise RuntimeError(f"layer {name}: the codes do not decode to the solver's values")
    final = str(Path(work) / "layers" / f"{name}.safetensors")
    publish_tensors(final, {"codes": c.astype(codes_dtype(q))},
                    {"key": key, "name": name, "seconds": f"{seconds:.6f}"}, _LAYER_FORMAT,
                    out_dir=str(work), journal={"layer": name})


def _collect(lm, xp, seqs, todo, factors, options, memory_budget, batch_size, finish,
             progress=False):
    """Run the Hessian passes and hand each layer of ``todo`` to ``finish`` as it is final;
    returns the passes' report."""
    from .hessian import global_factors, pad_batches

    batches, _ = pad_batches(seqs, batch_size=batch_size, xp=xp,
                             device=getattr(lm, "device", None))
    local: dict = {}

    def keep_local(name, H_in, H_out):
        local[name] = H_in

    def sink(name, H_in, H_out):
        if factors == "input":
            finish(name, H_in, None)
        elif factors == "global":
            finish(name, H_in, H_out)
        else:
            finish(name, local.pop(name), H_out)

    refine = options["refine_iters"]
    if progress:
        from .hessian.cost import announce

        _say(progress, announce(lm.stages(), seqs, passes=1 + 2 * refine,
                                batch_size=batch_size))
    _, rep = global_factors(lm.stages(), batches, refine_iters=refine, refine=options["refine"],
                            seed=options["seed"], budget_bytes=memory_budget, layers=todo,
                            sink=sink, progress=bool(progress),
                            kfac_sink=keep_local if factors == "input+global-out" else None)
    return rep


def _export(fmt, out, src, layers):
    if fmt in _GGUF_BITS:
        from .export import write_gguf

        write_gguf(out, src, layers, qk_order="hf")
    elif fmt == "gptq":
        from .export import write_gptq

        write_gptq(out, src, layers)
    else:
        from .export import write_dequantized

        write_dequantized(out, src, layers)


# -- evaluation ----------------------------------------------------------------------------------

def reference_log_probs(model, sequences, *, batch_size: int = 4) -> list:
    """The next-token log-probabilities of ``model`` on ``sequences`` as host arrays (one
    ``(rows, ids, log_probs)`` per batch), to pass as ``reference`` to
    :func:`perplexity_and_kl` when several models are compared with one reference."""
    return [(rows, np.asarray(_xp.to_numpy(ids)), np.asarray(_xp.to_numpy(lp)))
            for rows, ids, lp in model.batch_log_probs(sequences, batch_size=batch_size)]


def perplexity_and_kl(reference, quantized, sequences, *, batch_size: int = 4) -> dict:
    """Perplexity of ``quantized`` on ``sequences`` and the mean per-token
    KL(reference ‖ quantized) of the next-token distributions (both models'
    :meth:`~bakron.models.llm.CausalLM.batch_log_probs`; ``reference`` is a model, the list
    of :func:`reference_log_probs` for the same sequences and batch size, or ``None`` to skip
    the KL)."""
    nll = kl = 0.0
    n_tok = 0
    q_batches = quantized.batch_log_probs(sequences, batch_size=batch_size)
    if reference is None or isinstance(reference, list):
        r_batches = None if reference is None else iter(reference)
    else:
        r_batches = reference.batch_log_probs(sequences, batch_size=batch_size)
    for rows, ids, lq in q_batches:
        lr = next(r_batches)[2] if r_batches is not None else None
        ids_np = np.asarray(_xp.to_numpy(ids))
        lq_np = np.asarray(_xp.to_numpy(lq), dtype=np.float64)
        lr_np = None if lr is None else np.asarray(_xp.to_numpy(lr), dtype=np.float64)
        for r in range(ids_np.shape[0]):
            T = int((ids_np[r] >= 0).sum())
            if T < 2:
                continue
            nxt = ids_np[r, 1:T]
            nll -= float(lq_np[r, np.arange(T - 1), nxt].sum())
            if lr_np is not None:
                p = np.exp(lr_np[r, :T - 1])
                kl += float((p * (lr_np[r, :T - 1] - lq_np[r, :T - 1])).sum())
            n_tok += T - 1
    if n_tok == 0:
        raise ValueError("sequences hold no next token (every sequence is shorter than 2)")
    out = {"perplexity": float(np.exp(nll / n_tok)), "tokens": n_tok}
    if reference is not None:
        out["kl"] = kl / n_tok
    return out
