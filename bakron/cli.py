"""The ``bakron`` command: ``demo``, ``quantize``, ``quantize-model`` and ``bench``.

Exit codes (stable; scripts may rely on them):

===  =========================================================================================
0    success
1    ``quantize``: at least one layer failed (the others are written; the report says which)
2    usage or validation error (bad option, missing/invalid/corrupt input, an OUT name the
     file system cannot hold, a tile larger than a layer); nothing was written
3    ``quantize``: the output folder exists and ``--force`` was not given, or it exists and is
     not a bakron output folder (never replaced, whatever ``--force`` says; with
     ``--scheduler``/``--gpus``: another bakron driver holds OUT); ``quantize-model``: OUT
     exists (it is never replaced); nothing was written
4    a part that the command needs is not available (an optional dependency, a demo model,
     ``bakron.bench``, a GPU for ``--device gpu``, ``--engine cuda`` or ``--gpus``;
     ``quantize-model``: a missing, corrupt or inconsistent model file or shard, a
     ``--scheduler`` that does not answer); checked before any layer runs, nothing was written
5    the output could not be written (I/O error such as a full disk or a read-only file
     system); no partial output folder is left
130  interrupted (Ctrl-C or SIGTERM); a ``quantize`` output folder is not left behind
===  =========================================================================================

``quantize-model`` checks everything it can before it makes its work folder ``OUT.work``; an
error found later (exit 2, 4 or 5) or an interrupt says what is left: a work folder that
holds finished layers is kept on purpose (the same command continues from them), one that
holds none is removed.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import sys
import time

import numpy as np

from .factors import OUT_ESTIMATORS, estimator_folds  # (bakron's __init__ imports it)

__all__ = ["main", "EXIT_OK", "EXIT_LAYER_FAILED", "EXIT_USAGE", "EXIT_OUT_EXISTS",
           "EXIT_UNAVAILABLE", "EXIT_WRITE_FAILED", "EXIT_INTERRUPTED"]

EXIT_OK = 0
EXIT_LAYER_FAILED = 1
EXIT_USAGE = 2
EXIT_OUT_EXISTS = 3
EXIT_UNAVAILABLE = 4
EXIT_WRITE_FAILED = 5
EXIT_INTERRUPTED = 130

DEFAULT_DEMO_OUT = "bakron-demo"
QM_FORMATS = ("gguf-q4_0", "gguf-q4_1", "gguf-q8_0", "gptq", "float")
QM_FACTORS = ("rtn", "input", "global", "input+global-out")
QM_CALIB_SEQS = 128   # bakron.quantize_model.CALIB_SEQS (a test holds them equal)
REPORT_NAME = "report.json"
#: layers with at least this many weights get progress lines inside the layer (factor
#: preparation, solve, proxy errors)
PROGRESS_INSIDE_LAYER = 1 << 22
REPORT_FORMAT_VERSION = 1
#: default ``--stack-memory``: the estimated memory of one stack of same-shape layers
#: (:func:`bakron.layer_groups.layer_bytes` per layer), docs/cli.md "Stacks"
STACK_MEMORY = 1 << 30  # = bakron.layer_groups.STACK_MEMORY (not imported: cli starts fast)


class UsageError(Exception):
    """A command-line usage or validation error (exit code 2)."""


class Unavailable(Exception):
    """A part the command needs is missing (exit code 4)."""


class WriteFailed(Exception):
    """The output could not be written (exit code 5)."""


def io_check_out(out):
    """``--out`` as an absolute path, or :class:`UsageError` for a name the file system cannot
    hold (a NUL byte, a name that is too long)."""
    from . import io

    try:
        return io.check_out_name(out)
    except io.InputError as exc:
        raise UsageError(str(exc)) from None


def _check_gpu_needs(args) -> None:
    """``--engine cuda`` runs on a GPU: refuse it up front (exit 2 with ``--device cpu``,
    exit 4 when there is no usable GPU). ``--method wavefront`` runs on the numba and cuda
    engines: refused (exit 2) with ``--engine array_api``."""
    from .io import array_module

    if args.method == "wavefront" and args.engine == "array_api":
        raise UsageError("--method wavefront runs on the numba and cuda engines, not on "
                         "--engine array_api; use --engine auto, numba or cuda, or another "
                         "--method")
    if args.engine != "cuda":
        return
    if args.device == "cpu" and not getattr(args, "gpus", None):
        raise UsageError("--engine cuda runs on a GPU; add --device gpu (or auto)")
    try:
        array_module("gpu")
    except RuntimeError as exc:
        raise Unavailable(f"--engine cuda needs a GPU: {exc}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would call sys.exit(2); main() returns instead
        raise UsageError(f"{self.prog}: error: {message}\n{self.format_usage().rstrip()}")


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- option parsing helpers ------------------------------------------------------------------

def _bits(text: str) -> int:
    try:
        b = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in 2..8, got {text!r}") from None
    if not 2 <= b <= 8:
        raise argparse.ArgumentTypeError(f"must be in 2..8, got {b}")
    return b


def _bits_list(text: str) -> tuple[int, ...]:
    parts = [p for p in text.replace(" ", "").split(",") if p]
    if not parts:
        raise argparse.ArgumentTypeError("give bit widths such as 2,3,4")
    return tuple(_bits(p) for p in parts)


def _tile(text: str) -> tuple[int, int]:
    parts = text.lower().replace(",", "x").split("x")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer or TXxTY such as 16 or 16x8, got {text!r}") from None
    if len(vals) == 1:
        vals = vals * 2
    if len(vals) != 2 or min(vals) < 1:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer or TXxTY such as 16 or 16x8, got {text!r}")
    return vals[0], vals[1]


def _int_at_least(minimum: int, what: str):
    """An argparse type: an integer >= ``minimum``, else an error saying ``what``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {v}")
        return v
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_count = _int_at_least(0, "an integer >= 0")


def _bytes(text: str) -> int:
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in units else ""
    try:
        v = float(t[:len(t) - len(unit)]) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of bytes such as 2000000000 or "
                                         f"2G, got {text!r}") from None
    if not 1 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return int(v)


def _damp_or_auto(text: str):
    return "auto" if text == "auto" else _damp(text)


def _incoherence(text: str):
    """``--incoherence``: auto, off or a seed."""
    if text in ("auto", "off"):
        return None if text == "off" else "auto"
    try:
        return _count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be auto, off or a seed (an integer >= 0), "
                                         f"got {text!r}") from None


def _labels(text: str) -> str:
    from .hessian.transformer import parse_labels

    try:
        parse_labels(text, 2 ** 31, "--labels")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--labels: ")) from None
    return text


def _out_estimator(text: str) -> str:
    return text if text == "auto" else _in_estimator(text, "auto, ")


def _in_estimator(text: str, auto: str = "") -> str:
    try:
        estimator_folds(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be {auto}{', '.join(OUT_ESTIMATORS)} or crossfit:K with K >= 2 folds, "
            f"got {text!r}") from None
    return text


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return v


def _damp(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not (v >= 0) or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from .solvers import ENGINES, METHODS

    p = _Parser(prog="bakron", description="Fast two-sided second-order rounding for "
                "post-training quantization.", epilog="Exit codes: 0 ok, 1 a layer failed, "
                "2 usage/validation error, 3 output exists (with --scheduler/--gpus: OUT in use by "
                "another bakron driver), 4 missing component, "
                "5 output not written (I/O error), 130 interrupted.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="{demo,quantize,quantize-model,evaluate,bench}",
                           parser_class=_Parser)

    d = sub.add_parser("demo", help="run a built-in demo end to end and write a report",
                       description="Quantize a small model at several bit widths with RTN, "
                       "one-sided LDLQ and two-sided bakron; print a table and write a "
                       "markdown report and a plot.")
    d.add_argument("--model", choices=("smollm2", "minilm", "mlp"), default="smollm2",
                   help="smollm2: the SmolLM2-135M causal LM, all 210 linear layers with "
                        "global Hessians (default); minilm: the all-MiniLM-L6-v2 sentence "
                        "encoder; mlp: a small MLP trained on scikit-learn's digits")
    d.add_argument("--out", default=DEFAULT_DEMO_OUT, metavar="DIR",
                   help=f"folder for the report and plot (default ./{DEFAULT_DEMO_OUT}/)")
    d.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto uses the GPU when cupy sees one (default auto)")
    d.add_argument("--bits", type=_bits_list, default=None, metavar="B[,B...]",
                   help="bit widths (default 3,4 for smollm2, 2,3,4 for minilm and mlp)")
    d.add_argument("--quick", action="store_true", help="a smaller, faster run")
    d.add_argument("--calib", choices=("docs", "generated+docs", "generated"), default=None,
                   help="smollm2 only: calibrate on the Language Reference sentences and as "
                        "many tokens sampled from the model (generated+docs, the default), "
                        "on the sentences alone (docs), or on the sampled text alone")
    d.add_argument("--calib-tokens", type=_positive_int, default=None, metavar="N",
                   help="smollm2 only: the calibration set's size in tokens (default "
                        "6400); the Hessian passes' time is predicted before they start")
    d.add_argument("--quiet", action="store_true", help="no progress output")
    d.set_defaults(func=_cmd_demo)

    q = sub.add_parser("quantize", help="quantize layers from .npz/.safetensors files",
                       description="Quantize layers stored as .npz or .safetensors files "
                       "holding W (m x n), H_in (n x n) and optionally H_out (m x m), or a "
                       "folder of such files. Writes OUT/<layer>.<format> with codes, scale "
                       "(zero_point), W_hat, and OUT/report.json. OUT appears atomically.")
    q.add_argument("input", metavar="IN", help="a layer file or a folder of layer files")
    q.add_argument("--out", required=True, metavar="OUT", help="output folder (must not exist "
                   "unless --force)")
    q.add_argument("--bits", type=_bits, default=4, help="bits per weight, 2..8 (default 4)")
    q.add_argument("--scale", choices=("row", "group", "tensor"), default="row",
                   help="scale granularity (default row)")
    q.add_argument("--group-size", type=_positive_int, default=None,
                   help="columns per scale group with --scale group (default 128)")
    q.add_argument("--asym", action="store_true", help="asymmetric grid with zero points")
    q.add_argument("--scale-method", choices=("rms", "minmax"), default="rms",
                   help="how scales are fitted to W (default rms)")
    q.add_argument("--tile", type=_tile, default=(16, 16), metavar="T|TXxTY",
                   help="tile shape, e.g. 16 or 16x8 (default 16)")
    q.add_argument("--method", choices=METHODS, default="auto", help="solver schedule")
    q.add_argument("--engine", choices=ENGINES, default="auto", help="compute engine")
    q.add_argument("--damp", type=_damp, default=0.01,
                   help="relative damping of the factors (default 0.01)")
    q.add_argument("--one-sided", action="store_true",
                   help="ignore H_out: one-sided LDLQ/GPTQ with H_in only")
    q.add_argument("--format", choices=("safetensors", "npz"), default="safetensors",
                   help="file format of the outputs (default safetensors)")
    q.add_argument("--device", choices=("auto", "cpu", "gpu"), default="cpu",
                   help="where to compute (default cpu; auto uses a GPU when cupy sees one)")
    q.add_argument("--force", action="store_true", help="replace OUT if it exists and is a "
                   "bakron output folder (any other non-empty folder is never replaced)")
    q.add_argument("--metrics", choices=("none", "basic", "full"), default="basic",
                   help="proxy errors to compute: basic = the layer's loss for the result and "
                        "RTN (default); full = also the one-sided ones; none = skip them "
                        "(fastest)")
    q.add_argument("--quiet", action="store_true", help="no progress or table")
    q.add_argument("--stack-memory", type=_bytes, default=STACK_MEMORY, metavar="BYTES",
                   help="memory for one stack of same-shape layers solved together (e.g. 2G; "
                        "default 1G; 1 solves the layers one by one)")
    q.add_argument("--scheduler", metavar="ADDRESS", default=None,
                   help="Dask tasks (a layer or a stack of layers) on this scheduler "
                        "(tcp://host:8786; workers must see the same paths); OUT is resumable "
                        "(needs bakron[dask])")
    q.add_argument("--gpus", type=_positive_int, default=None, metavar="N",
                   help="start a local Dask cluster with one worker per GPU (the first N "
                        "visible); OUT is resumable (needs bakron[dask])")
    q.set_defaults(func=_cmd_quantize)

    qm = sub.add_parser(
        "quantize-model", help="quantize a whole causal LM (HF folder, GGUF, smollm2) into "
        "a GGUF, GPTQ or float export",
        description="Quantize every linear layer of a Llama-family causal LM (a Hugging Face "
        "folder of LlamaForCausalLM/Qwen3ForCausalLM, a llama or qwen3 GGUF file, or smollm2) "
        "onto the export format's grid and write the export. Any source goes to any format: a "
        "source of the other kind is converted into OUT.work/ first. Finished layers are kept "
        "in OUT.work/; a killed run started again with the same arguments continues from "
        "them.")
    qm.add_argument("model", metavar="MODEL", help="smollm2, a .gguf file (llama or qwen3) or "
                    "a Hugging Face model folder")
    qm.add_argument("--out", required=True, metavar="OUT", help="the export: a .gguf file "
                    "(gguf-*) or a folder (gptq, float); must not exist")
    qm.add_argument("--format", dest="fmt", choices=QM_FORMATS, default="gguf-q4_0",
                    help="gguf-q4_0|q4_1|q8_0 (llama.cpp blocks of 32; a GGUF file), gptq "
                         "(packed safetensors) or float (W_hat in the source dtype), both a "
                         "Hugging Face folder; a source of the other kind is converted first "
                         "(default gguf-q4_0)")
    qm.add_argument("--factors", choices=QM_FACTORS, default="global",
                    help="rtn: round to nearest; input: one-sided LDLQ with each layer's H_in "
                         "(forward passes alone); global: two-sided with both K-FAC factors of "
                         "the KL-Fisher (default: 0.82x input's KL on SmolLM2 with --format "
                         "float, docs/llm.md); input+global-out: local H_in with the global "
                         "H_out")
    qm.add_argument("--calib", default="generated+docs",
                    metavar="FILE|generated+docs|builtin|generated",
                    help="calibration text: generated+docs (default: half sampled from the "
                         "model, cached, half the Python Language Reference of the stdlib; "
                         "sampled text makes up the rest when the Language Reference runs "
                         "out), builtin (the Language Reference alone), generated, or a UTF-8 "
                         "file, one document per paragraph")
    cs = qm.add_mutually_exclusive_group()
    cs.add_argument("--calib-seqs", type=_positive_int, default=None, metavar="N",
                    help=f"calibration sequences (default {QM_CALIB_SEQS})")
    cs.add_argument("--calib-tokens", type=_positive_int, default=None, metavar="N",
                    help="calibration tokens, rounded up to whole sequences of --calib-len "
                         "(instead of --calib-seqs); the Hessian passes' time is predicted "
                         "before they start")
    qm.add_argument("--calib-len", type=_positive_int, default=128, metavar="T",
                    help="tokens per calibration sequence (default 128)")
    qm.add_argument("--memory-budget", type=_bytes, default=None, metavar="BYTES",
                    help="working-memory budget of the Hessian passes (e.g. 2G; default: "
                         "store every activation); --factors input's forward passes hold "
                         "two stage boundaries of the calibration, else the budgeted global "
                         "pass runs")
    qm.add_argument("--bits", type=_bits, default=None,
                    help="bits of the gptq (2, 4, 8) or float (2..8) grid (default 4)")
    qm.add_argument("--group-size", type=_positive_int, default=None,
                    help="inputs per scale of the gptq/float grid (default 128)")
    sym = qm.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_const", const=True, default=None,
                     help="symmetric gptq/float grid (the default)")
    sym.add_argument("--asym", dest="sym", action="store_const", const=False,
                     help="asymmetric gptq/float grid (zero points)")
    qm.add_argument("--damp", type=_damp, default=0.01,
                    help="relative damping of the factors (default 0.01)")
    qm.add_argument("--damp-out", type=_damp_or_auto, default="auto", metavar="auto|D",
                    help="regularisation of a global H_out: auto (default) damps it toward "
                         "the identity by 0.1 (its mean diagonal) for a rotated layer "
                         "(--incoherence) with a cross-fitted H_out, by 3 for a rotated layer "
                         "with the mean, by 1 otherwise (docs/hessian.md); a number is its "
                         "relative damping")
    qm.add_argument("--shrink-out", type=_fraction, default=None, metavar="S",
                    help="with a numeric --damp-out: shrink a global H_out toward its "
                         "diagonal, (1-S) H_out + S diag(H_out), S in [0, 1] (default 0)")
    qm.add_argument("--labels", type=_labels, default="sample",
                    metavar="sample|sample:K|fisher:K|true",
                    help="estimator of a global H_out: one sampled label per token (default), "
                         "K draws, the output Fisher from the K most probable labels, or the "
                         "next token (docs/hessian.md)")
    qm.add_argument("--out-estimator", type=_out_estimator, default="auto",
                    metavar="auto|mean|crossfit|crossfit:K",
                    help="how a global H_out is formed from the calibration tokens: mean (the "
                         "K-FAC mean of all of them), crossfit (each half's eigenvectors with "
                         "eigenvalues measured on the other half), crossfit:K (K folds of "
                         "batches, each measured along the other folds' eigenvectors), auto "
                         "(default: crossfit for rotated layers, mean otherwise; "
                         "docs/hessian.md)")
    qm.add_argument("--in-estimator", type=_in_estimator, default="mean",
                    metavar="mean|crossfit|crossfit:K",
                    help="how H_in is formed, for one-sided and two-sided rounding: mean "
                         "(default: the mean of x x^T over the calibration tokens) or "
                         "cross-fitted from folds of batches as --out-estimator does "
                         "(docs/hessian.md)")
    qm.add_argument("--refine", type=_count, default=None, metavar="N",
                    help="per-sequence refinement steps of the global factors after their "
                         "K-FAC pass, two more Hessian passes each (default 0: the K-FAC "
                         "factors)")
    qm.add_argument("--blas-threads", type=_count, default=1, metavar="N",
                    help="BLAS threads of the Hessian passes and the solves on the CPU "
                         "(default 1, the faster setting on a 2-core machine; 0: the BLAS "
                         "library's own default)")
    qm.add_argument("--device", choices=("auto", "cpu", "gpu"), default=None,
                    help="where the model and the solves run (default cpu, gpu with --gpus; "
                         "auto uses a GPU when cupy sees one)")
    qm.add_argument("--incoherence", type=_incoherence, default="auto",
                    metavar="auto|off|SEED",
                    help="rotate every layer on both sides (random signs and Hadamard "
                         "transforms of this seed) before rounding: auto (default) is seed 0 "
                         "with --format float and Hessian-aware --factors, off for rtn and for "
                         "GGUF and GPTQ, whose files cannot carry the rotations (a seed is "
                         "refused there)")
    qm.add_argument("--quiet", action="store_true", help="no progress output")
    where = qm.add_mutually_exclusive_group()
    where.add_argument("--scheduler", metavar="ADDRESS", default=None,
                       help="solve each layer as one Dask task on this scheduler "
                            "(tcp://host:8786; workers must see OUT's folder); the factors "
                            "are collected here (needs bakron[dask])")
    where.add_argument("--gpus", type=_positive_int, default=None, metavar="N",
                       help="start a local Dask cluster of one worker per GPU (the first N "
                            "visible) for the solves (needs bakron[dask])")
    qm.set_defaults(func=_cmd_quantize_model)

    ev = sub.add_parser(
        "evaluate", help="KL of a quantized causal LM to its original on held-out text",
        description="The mean per-token KL(original || quantized) of the next-token "
        "distributions, with its standard error over texts, the perplexity and the top-1 "
        "agreement, on the first Lee news documents and on held-out sentences of the Python "
        "Language Reference (the demo's evaluation texts), or on your own text files "
        "(--text).")
    ev.add_argument("quantized", metavar="QUANTIZED", nargs="+",
                    help="quantized model(s): a folder written by quantize-model --format "
                         "float or gptq, or a GGUF file")
    ev.add_argument("--reference", required=True, metavar="MODEL",
                    help="the original: smollm2, a .gguf file or a Hugging Face folder")
    ev.add_argument("--text", metavar="FILE", action="append", default=None,
                    help="evaluate on this UTF-8 text file instead of the built-in texts "
                         "(repeat for several; each is tokenized whole and cut into windows "
                         "of --window tokens, the texts of the standard error)")
    ev.add_argument("--window", type=_positive_int, default=None, metavar="N",
                    help="tokens per window of a --text file (default 64, as the built-in "
                         "texts)")
    ev.add_argument("--json", metavar="FILE", default=None,
                    help="also write the figures to FILE (JSON)")
    ev.set_defaults(func=_cmd_evaluate)

    b = sub.add_parser("bench", help="benchmark methods x sizes on this machine (forwards "
                       "its arguments to bakron.bench)", add_help=False)
    b.set_defaults(func=None)
    return p


def main(argv=None) -> int:
    """Run the ``bakron`` command line with ``argv`` (default ``sys.argv[1:]``); return the
    exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _cmd_bench(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        _err(str(exc))
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if args.version:
        from . import __version__

        print(f"bakron {__version__}")
        return EXIT_OK
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    with _sigterm_as_interrupt():
        return _run_command(args)


class Terminated(BaseException):
    """SIGTERM arrived while a command ran (handled like Ctrl-C: exit code 130)."""


class _sigterm_as_interrupt:
    """While a command runs, SIGTERM raises :class:`Terminated`, handled like Ctrl-C: the
    temporary output is removed and the exit code is 130 (main thread only)."""

    def __enter__(self):
        import signal
        import threading

        self.old = None
        if threading.current_thread() is threading.main_thread():
            def handler(signum, frame):
                raise Terminated
            self.old = signal.signal(signal.SIGTERM, handler)
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            import signal

            signal.signal(signal.SIGTERM, self.old)
        return False


def _run_command(args) -> int:
    try:
        return args.func(args)
    except UsageError as exc:
        _err(f"bakron {args.command}: error: {exc}")
        return EXIT_USAGE
    except Unavailable as exc:
        _err(f"bakron {args.command}: {exc}")
        return EXIT_UNAVAILABLE
    except WriteFailed as exc:
        _err(f"bakron {args.command}: {exc}")
        return EXIT_WRITE_FAILED
    except (KeyboardInterrupt, Terminated) as exc:
        _err(f"bakron {args.command}: "
             f"{'terminated (SIGTERM)' if isinstance(exc, Terminated) else 'interrupted'}")
        return EXIT_INTERRUPTED
    except OSError as exc:  # the file system refused (permissions, read-only, ...): one line
        where = f" ({exc.filename})" if exc.filename else ""
        _err(f"bakron {args.command}: I/O error: {exc.strerror or exc}{where}; nothing was "
             f"written")
        return EXIT_WRITE_FAILED


# -- bench ---------------------------------------------------------------------------------

def _cmd_bench(rest: list[str]) -> int:
    try:
        mod = importlib.import_module("bakron.bench")
    except ModuleNotFoundError as exc:
        if exc.name in ("bakron.bench",):
            _err("bakron bench: not available: this bakron has no bakron.bench module")
        else:
            _err(f"bakron bench: not available: a dependency is missing ({exc}); try "
                 f"pip install 'bakron[bench]'")
        return EXIT_UNAVAILABLE
    try:
        rc = mod.main(rest)
    except SystemExit as exc:
        rc = exc.code
    except KeyboardInterrupt:
        _err("bakron bench: interrupted")
        return EXIT_INTERRUPTED
    if rc is None:
        return EXIT_OK
    return rc if isinstance(rc, int) else EXIT_LAYER_FAILED


# -- demo ----------------------------------------------------------------------------------

def _cmd_demo(args) -> int:
    from .io import array_module

    if args.device == "gpu":
        try:
            array_module("gpu")
        except RuntimeError as exc:
            raise Unavailable(str(exc)) from None
    modname = {"smollm2": "bakron.demo.llm", "minilm": "bakron.demo.minilm",
               "mlp": "bakron.demo.mlp"}[args.model]
    try:
        mod = importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        if exc.name == modname:
            raise Unavailable(f"the {args.model!r} demo is not part of this bakron "
                              f"({modname} is missing); try --model mlp") from None
        raise Unavailable(f"the {args.model!r} demo needs {exc.name!r}, which is not "
                          f"installed: pip install 'bakron[demo]'") from None
    out = io_check_out(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder")
    t0 = time.perf_counter()
    try:
        extra = {} if args.calib is None else {"calib": args.calib}
        if extra and args.model != "smollm2":
            raise UsageError(f"--calib {args.calib} applies to --model smollm2 only")
        if args.calib_tokens is not None:
            if args.model != "smollm2":
                raise UsageError("--calib-tokens applies to --model smollm2 only")
            extra["calib_tokens"] = args.calib_tokens
        if args.bits is not None:   # else the demo's own default
            extra["bits"] = tuple(args.bits)
        result = mod.run(args.out, device=args.device, quick=args.quick,
                         progress=not args.quiet, **extra)
    except OSError as exc:
        if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__ == "URLError":
            raise Unavailable(f"the {args.model!r} demo's model could not be fetched "
                              f"({exc})") from None
        raise WriteFailed(f"could not write the output in {out} "
                          f"({exc.strerror or exc}{': ' + exc.filename if exc.filename else ''})"
                          ) from None
    except ImportError as exc:  # an optional dependency imported inside the run
        raise Unavailable(f"the {args.model!r} demo needs a package that is not installed "
                          f"({exc}); pip install 'bakron[demo]'") from None
    except RuntimeError as exc:  # the model could not be fetched or failed its checksum
        if type(exc).__name__ in ("ModelUnavailableError", "ChecksumError"):
            raise Unavailable(f"the {args.model!r} demo's model is not available: {exc}") from None
        raise
    if not args.quiet:
        files = result.get("files") if isinstance(result, dict) else None
        where = ", ".join(str(f) for f in files) if files else os.path.abspath(args.out)
        print(f"bakron demo --model {args.model}: done in {time.perf_counter() - t0:.1f} s; "
              f"wrote {where}")
    return EXIT_OK


# -- quantize-model --------------------------------------------------------------------------

def _calib_seqs(args) -> int:
    """--calib-seqs, or --calib-tokens in whole sequences of --calib-len (default
    :data:`bakron.quantize_model.CALIB_SEQS`)."""
    if args.calib_tokens is not None:
        return -(-args.calib_tokens // args.calib_len)
    return QM_CALIB_SEQS if args.calib_seqs is None else args.calib_seqs


def _cmd_quantize_model(args) -> int:
    """``bakron quantize-model``: see :mod:`bakron.quantize_model`."""
    from .io import InputError, OutputExistsError, array_module

    out = io_check_out(args.out)
    if args.gpus and args.device == "cpu":
        raise UsageError(f"--gpus {args.gpus} runs the solves on GPU workers; --device cpu "
                         f"contradicts it (drop --device cpu, or use --scheduler with CPU "
                         f"workers)")
    device = args.device or ("gpu" if args.gpus else "cpu")
    if device == "gpu":
        try:
            array_module("gpu")
        except RuntimeError as exc:
            raise Unavailable(str(exc)) from None
    try:
        from . import quantize_model as qm
        from .distributed._model_jobs import ClusterUnavailable
        importlib.import_module("tqdm")   # the progress bar
    except ImportError as exc:
        raise Unavailable(f"quantize-model needs {exc.name!r}, which is not installed: "
                          f"pip install 'bakron[llm]'") from None
    from .models.llm import ChecksumError, ModelUnavailableError
    from .models.llm.schema import ModelFileError

    t0 = time.perf_counter()
    try:
        res = qm.quantize_model(args.model, out, fmt=args.fmt, factors=args.factors,
                                bits=args.bits, group_size=args.group_size, sym=args.sym,
                                calib=args.calib, calib_seqs=_calib_seqs(args),
                                calib_len=args.calib_len, memory_budget=args.memory_budget,
                                device=device, damp=args.damp, damp_out=args.damp_out,
                                shrink_out=args.shrink_out, labels=args.labels,
                                progress=not args.quiet,
                                scheduler=args.scheduler, gpus=args.gpus,
                                incoherence=args.incoherence,
                                out_estimator=args.out_estimator,
                                in_estimator=args.in_estimator,
                                blas_threads=args.blas_threads or None,
                                **({} if args.refine is None
                                   else {"refine_iters": args.refine}))
    except ClusterUnavailable as exc:
        raise Unavailable(str(exc)) from None
    except OutputExistsError as exc:
        _err(f"bakron quantize-model: {exc}")
        return EXIT_OUT_EXISTS
    except (KeyboardInterrupt, Terminated) as exc:
        for note in getattr(exc, "__notes__", ()):   # what is left in OUT.work
            _err(f"bakron quantize-model: {note}")
        raise
    except ModelFileError as exc:   # a malformed or inconsistent model file: exit 4 too
        raise Unavailable(_with_notes(f"the model files are not usable: {exc}", exc)) from None
    except (ModelUnavailableError, ChecksumError) as exc:
        raise Unavailable(_with_notes(f"the model is not available: {exc}", exc)) from None
    except ImportError as exc:
        raise Unavailable(_with_notes(f"quantize-model needs a package that is not installed "
                                      f"({exc}); pip install 'bakron[llm]'", exc)) from None
    except (InputError, ValueError) as exc:   # UnsupportedModelError is a ValueError
        raise UsageError(_with_notes(str(exc), exc)) from None
    except OSError as exc:   # a full disk, a read-only folder: exit 5, and what is left
        where = f" ({exc.filename})" if exc.filename else ""
        raise WriteFailed(_with_notes(f"I/O error: {exc.strerror or exc}{where}", exc,
                                      default="nothing was written")) from None
    if not args.quiet:
        print(f"bakron quantize-model: {len(res['layers'])} layers ({res['resumed']} resumed) "
              f"in {time.perf_counter() - t0:.1f} s; wrote {res['out']}")
    return EXIT_OK


def _with_notes(msg: str, exc: BaseException, default: str | None = None) -> str:
    """``msg`` and the notes :func:`bakron.quantize_model.quantize_model` adds to an error
    raised after it made ``OUT.work`` (what is left on disk), or ``default``."""
    notes = list(getattr(exc, "__notes__", ())) or ([default] if default else [])
    return "; ".join([msg, *notes])


# -- evaluate --------------------------------------------------------------------------------

def _cmd_evaluate(args) -> int:
    """``bakron evaluate``: see :mod:`bakron.models.llm.evaluation`."""
    from .models.llm import ChecksumError, ModelUnavailableError
    from .models.llm.evaluation import check_comparable, compare, evaluation_texts, file_texts

    if args.text is None and args.window is not None:
        raise UsageError("--window only applies with --text")
    try:
        from .models import load_llm

        ref = load_llm(args.reference)
        window = {} if args.window is None else {"window": args.window}
        texts = file_texts(ref, args.text, **window) if args.text else evaluation_texts(ref)
        models = {}
        for path in args.quantized:
            if not os.path.exists(path):
                raise UsageError(f"{path}: no such file or folder (a quantized model)")
            models[path] = load_llm(path)
            check_comparable(ref, models[path], path)
    except (ModelUnavailableError, ChecksumError) as exc:
        raise Unavailable(f"the model is not available: {exc}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if "lee_error" in texts:
        _err(f"bakron evaluate: the Lee corpus is unavailable ({texts['lee_error']}); held-out "
             f"documents only")
    tokens = sum(len(t) for v in texts.values() if isinstance(v, tuple) for t in v[0])
    _err(f"bakron evaluate: {len(models)} model(s) and the original on {tokens:,} tokens")

    def progress(label, i, n, seconds):
        _err(f"  {'the original' if label is None else f'{label} ({i}/{n})'}: {seconds:.0f} s")

    res = compare(ref, models, texts=texts, progress=progress)
    for key, src in res["sources"].items():
        print(f"{key}: {src}; original perplexity {res['original'][key]['perplexity']:.3f}")
    w = max([5, *map(len, res["sources"])])
    print(f"{'model':40s} {'set':{w}s} {'KL':>8s} {'s.e.':>7s} {'ppl':>8s} {'top-1':>6s}")
    for label, sets in res["models"].items():
        for key, e in sets.items():
            print(f"{label[-40:]:40s} {key:{w}s} {e['kl']:8.4f} {e['kl_text_sem']:7.4f} "
                  f"{e['perplexity']:8.3f} {e['top1_agreement']:6.3f}")
    if args.json:
        from ._lib.fs import atomic_write_json

        atomic_write_json(args.json, res)
    return EXIT_OK


# -- quantize ------------------------------------------------------------------------------

def _versions() -> dict:
    from . import __version__

    v = {"bakron": __version__, "numpy": np.__version__, "python": platform.python_version(),
         "platform": platform.platform()}
    for name in ("scipy", "numba", "cupy"):
        mod = sys.modules.get(name)
        if mod is None and name == "scipy":
            try:
                import scipy as mod
            except ImportError:  # pragma: no cover - scipy is a dependency
                mod = None
        if mod is not None:
            v[name] = getattr(mod, "__version__", "?")
    return v


def _check_options(args) -> None:
    if args.group_size is not None and args.scale != "group":
        raise UsageError("--group-size only applies with --scale group")
    if args.scale == "group" and args.group_size is None:
        args.group_size = 128


def _quantize_one(args, xp, tensors, info) -> tuple[dict, dict]:
    """Quantize one layer through the pipeline shared with the Dask runner: (arrays to
    write, report entry)."""
    from .pipeline import quantize_arrays

    t0 = time.perf_counter()
    settings = _settings(args)
    m, n = info.shape
    big = m * n >= PROGRESS_INSIDE_LAYER and not args.quiet
    say = (lambda msg: _err(f"    {msg} ...")) if big else None
    arrays, entry, _ = quantize_arrays(tensors["W"], tensors["H_in"], tensors.get("H_out"),
                                       settings, xp=xp, one_sided=args.one_sided,
                                       metrics=args.metrics, progress=say)
    entry["input_dtype"] = info.dtype
    entry["seconds_total"] = time.perf_counter() - t0
    return arrays, entry


def _sides(args, info) -> str:
    return ", two-sided" if info.has_H_out and not args.one_sided else ""


def _stack_chunks(infos, one_sided: bool, budget: int) -> list[list[int]]:
    """Indices of ``infos`` in stacks: layers of the same shape, stored dtype and sidedness, in
    order of first appearance, cut so that each stack fits ``budget``
    (:func:`bakron.layer_groups.stack_chunks`)."""
    from .layer_groups import layer_bytes, stack_chunks

    keys = [(tuple(i.shape), i.dtype, i.has_H_out and not one_sided) for i in infos]
    return stack_chunks(keys, [layer_bytes(*i.shape, i.has_H_out) for i in infos], budget)


def _quantize_chunk(args, xp, infos) -> list:
    """Quantize a stack of same-shape layers, read from their files now: per layer
    ``(arrays, report entry)`` or the exception it failed with. One layer goes through
    :func:`_quantize_one`; a stack through the same pipeline's stacked form, each layer
    exactly as alone (docs/cli.md "Stacks"); a stack that fails as a whole is run layer by
    layer."""
    from . import io
    from .pipeline import quantize_arrays_stack

    def alone(info):
        try:
            tensors, _ = io.read_layer(info.path, info.name)
            return _quantize_one(args, xp, tensors, info)
        except (KeyboardInterrupt, MemoryError, Terminated):
            raise
        except Exception as exc:  # noqa: BLE001 - the layer fails, the run goes on
            return exc

    if len(infos) == 1:
        return [alone(infos[0])]
    t0 = time.perf_counter()
    out: list = [None] * len(infos)
    live, layers = [], []
    for j, info in enumerate(infos):
        try:
            tensors, _ = io.read_layer(info.path, info.name)
        except (KeyboardInterrupt, MemoryError, Terminated):
            raise
        except Exception as exc:  # noqa: BLE001
            out[j] = exc
            continue
        live.append(j)
        layers.append((tensors["W"], tensors["H_in"], tensors.get("H_out")))
    m, n = infos[0].shape
    big = m * n >= PROGRESS_INSIDE_LAYER and not args.quiet
    say = (lambda msg: _err(f"    {msg} ...")) if big else None
    try:
        got = quantize_arrays_stack(layers, _settings(args), xp=xp, one_sided=args.one_sided,
                                    metrics=args.metrics, progress=say,
                                    max_bytes=args.stack_memory)
    except (KeyboardInterrupt, Terminated):
        raise
    except Exception:  # noqa: BLE001 - the stack as a whole failed: each layer alone
        del layers
        return [out[j] if out[j] is not None else alone(infos[j]) for j in range(len(infos))]
    del layers
    seconds = (time.perf_counter() - t0) / len(infos)
    for j, res in zip(live, got):
        if isinstance(res, MemoryError):
            raise res
        if isinstance(res, BaseException):
            out[j] = res
            continue
        arrays, entry, _ = res
        entry["input_dtype"] = infos[j].dtype
        entry["seconds_total"] = seconds
        out[j] = (arrays, entry)
    return out


def _settings(args) -> dict:
    return {"bits": args.bits, "tile": args.tile, "method": args.method,
            "engine": args.engine, "damp": args.damp, "symmetric": not args.asym,
            "granularity": args.scale, "group_size": args.group_size,
            "scale_method": args.scale_method}


def _cmd_quantize_distributed(args) -> int:
    from .distributed import quantize_folder

    if args.force:
        raise UsageError("--scheduler/--gpus resume an existing OUT instead of replacing it; "
                         "delete OUT yourself to start over")
    return quantize_folder(
        args.input, args.out, scheduler=args.scheduler, gpus=args.gpus or 0, quiet=args.quiet,
        bits=args.bits, tile=args.tile, method=args.method, engine=args.engine, damp=args.damp,
        symmetric=not args.asym, granularity=args.scale, group_size=args.group_size,
        scale_method=args.scale_method, one_sided=args.one_sided, file_format=args.format,
        stack_memory=args.stack_memory,
        device="gpu" if args.gpus and args.device == "cpu" else args.device)


def _cmd_quantize(args) -> int:
    from . import io

    _check_options(args)
    out = io_check_out(args.out)
    _check_gpu_needs(args)
    if args.scheduler or args.gpus:
        return _cmd_quantize_distributed(args)
    try:
        files = io.find_layer_files(args.input)
        io.check_output_path(args.out, [p for _, p in files])
    except io.InputError as exc:
        raise UsageError(str(exc)) from None
    if out.exists() or out.is_symlink():
        if not args.force:
            _err(f"bakron quantize: {out} already exists; use --force to replace it")
            return EXIT_OUT_EXISTS
        if not io.is_bakron_output(out):
            _err(f"bakron quantize: {out} exists and is not a bakron output folder (no bakron "
                 f"report.json); it is never replaced, even with --force: remove it yourself "
                 f"or choose another --out")
            return EXIT_OUT_EXISTS
    try:
        xp, device = io.array_module(args.device)
    except RuntimeError as exc:
        raise Unavailable(str(exc)) from None

    # 1. validate every input before any work
    errors, infos = [], []
    tx, ty = args.tile
    for name, path in files:
        try:
            _tensors, info = io.read_layer(path, name)
        except io.InputError as exc:
            errors.append(str(exc))
            continue
        m, n = info.shape
        if tx > m or ty > n:
            errors.append(f"{path}: --tile {tx}x{ty} is larger than W ({m} x {n}); use a tile "
                          f"no larger than the smallest layer")
        infos.append(info)
    if errors:
        raise UsageError("invalid input:\n  " + "\n  ".join(errors))

    # 2. quantize, writing into a temporary folder that becomes OUT at the end
    quiet = args.quiet
    report = {
        "format_version": REPORT_FORMAT_VERSION, "tool": "bakron quantize",
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "versions": _versions(), "device": device, "input": os.path.abspath(args.input),
        "output": str(out), "file_format": args.format,
        "options": {"bits": args.bits, "scale": args.scale, "group_size": args.group_size,
                    "symmetric": not args.asym, "scale_method": args.scale_method,
                    "tile": list(args.tile), "method": args.method, "engine": args.engine,
                    "damp": args.damp, "one_sided": args.one_sided, "metrics": args.metrics,
                    "stack_memory": args.stack_memory},
        "layers": [],
    }
    t_start = time.perf_counter()
    failed = 0
    chunks = _stack_chunks(infos, args.one_sided, args.stack_memory)
    entries: dict = {}
    try:
        with io.atomic_output_dir(out, force=args.force) as tmp:
            for s_no, chunk in enumerate(chunks, 1):
                m, n = infos[chunk[0]].shape
                if not quiet and len(chunk) > 1:
                    _err(f"stack {s_no}/{len(chunks)}: {len(chunk)} layers of {m} x {n}"
                         f"{_sides(args, infos[chunk[0]])}")
                elif not quiet:  # one layer: its line before the work, as it goes
                    _err(f"[{chunk[0] + 1}/{len(infos)}] {infos[chunk[0]].name} ({m} x {n}"
                         f"{_sides(args, infos[chunk[0]])})")
                got = _quantize_chunk(args, xp, [infos[k] for k in chunk])
                for j, (k, res) in enumerate(zip(chunk, got)):
                    info = infos[k]
                    m, n = info.shape
                    if not quiet and len(chunk) > 1:
                        _err(f"[{k + 1}/{len(infos)}] {info.name} ({m} x {n}"
                             f"{_sides(args, info)})")
                    entry = {"name": info.name, "input": os.path.abspath(info.path),
                             "shape": [m, n], "dtype": info.dtype, "has_H_out": info.has_H_out,
                             "ignored_tensors": info.ignored}
                    entries[k] = entry
                    if isinstance(res, BaseException):  # the layer fails, the run goes on
                        failed += 1
                        entry.update(status="failed", error=f"{type(res).__name__}: {res}")
                        if not quiet:
                            _err(f"    failed: {type(res).__name__}: {res}")
                        continue
                    arrays, figures = res
                    figures["stack"] = {"stack": s_no, "index": j, "size": len(chunk)}
                    fname = f"{info.name}.{args.format}"
                    meta = {"bakron_version": report["versions"]["bakron"], "layer": info.name,
                            "bits": args.bits, "symmetric": not args.asym,
                            "granularity": args.scale, "group_size": args.group_size or ""}
                    t_w = time.perf_counter()
                    io.write_tensors(tmp / fname, arrays, args.format, metadata=meta)
                    figures["seconds_write"] = time.perf_counter() - t_w
                    entry.update(status="ok", output=fname,
                                 codes_dtype=str(arrays["codes"].dtype),
                                 scale_shape=list(arrays["scale"].shape), **figures)
                    if not quiet and figures.get("proxy_error") is not None:
                        _err(f"    proxy error {figures['proxy_error']:.4g} (RTN "
                             f"{figures['rtn_proxy_error']:.4g}), "
                             f"{figures['seconds_total']:.2f} s")
                    elif not quiet:
                        _err(f"    done in {figures['seconds_total']:.2f} s")
            report["layers"] = [entries[k] for k in range(len(infos))]
            report["summary"] = {"layers": len(infos), "ok": len(infos) - failed,
                                 "failed": failed, "stacks": len(chunks),
                                 "seconds": time.perf_counter() - t_start}
            report["exit_code"] = EXIT_LAYER_FAILED if failed else EXIT_OK
            io.atomic_write_json(tmp / REPORT_NAME, report)
    except io.OutputExistsError as exc:
        _err(f"bakron quantize: {exc}")
        return EXIT_OUT_EXISTS
    except OSError as exc:
        state = "is unchanged" if out.exists() else "was not created"
        _err(f"bakron quantize: could not write the output ({exc}); {out} {state}")
        return EXIT_WRITE_FAILED
    if not quiet:
        print(_table(report))
        print(f"wrote {out} ({len(infos) - failed} of {len(infos)} layers"
              f"{', ' + str(failed) + ' failed' if failed else ''})")
    return EXIT_LAYER_FAILED if failed else EXIT_OK


def _table(report: dict) -> str:
    rows = [("layer", "shape", "sides", "proxy", "proxy 1-sided", "RTN", "RTN 1-sided",
             "damp in/out", "seconds")]
    for e in report["layers"]:
        shape = "x".join(str(s) for s in e["shape"])
        if e["status"] != "ok":
            rows.append((e["name"], shape, "", "FAILED", "", "", "", "", ""))
            continue
        damp = f"{e['damp_in']:.3g}/" + ("-" if e["damp_out"] is None else f"{e['damp_out']:.3g}")

        def g(key):
            return "-" if e.get(key) is None else f"{e[key]:.4g}"
        rows.append((e["name"], shape, "2" if e["two_sided"] else "1", g("proxy_error"),
                     g("proxy_error_one_sided"), g("rtn_proxy_error"),
                     g("rtn_proxy_error_one_sided"), damp, f"{e['seconds_total']:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
