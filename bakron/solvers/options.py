"""The engines' options: typed, validated, frozen; and where their defaults come from.

``solve(..., options=...)`` (and :func:`bakron.solve_stack`, :func:`bakron.quantize_layer`,
:func:`bakron.quantize_layers`, ``bakron bench --option``) takes one options object or a
sequence of them, at most one per engine; the engine that runs the problem uses its own and
the defaults for a class not given. Every field is checked when the object is made, and the
error names the class and the field. The objects are hashable: the engines key their caches
(compiled kernels, plans, launch sizes) on them, so two option sets never share an entry.

Defaults: the field defaults below, each of which an environment variable may set
(``CudaOptions.ENV``); this module is the one place that reads them, when the defaults are
first needed after a change of the variables (docs/engine-contract.md, "Options").

The few other variables bakron reads (the cache folder, a size limit, the GPUs a process may
use) are declared in :data:`ENVIRONMENT` and read through :func:`environment`, here too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

__all__ = ["CudaOptions", "NumbaOptions", "OPTION_CLASSES", "as_options", "defaults",
           "parse_option", "ENVIRONMENT", "environment"]

#: every environment variable bakron reads besides the options' own (``CudaOptions.ENV``,
#: ``NumbaOptions.ENV``), with what it sets
ENVIRONMENT = {
    "BAKRON_CACHE": "the cache folder of the named models and data (bakron.models._fetch)",
    "XDG_CACHE_HOME": "the base of the default cache folder, ~/.cache when unset",
    "BAKRON_SMOLLM2_WHEEL": "a local copy of the SmolLM2 wheel (bakron.models.llm.fetch)",
    "BAKRON_MINILM_WHEEL": "a local copy of the MiniLM wheel (bakron.models.minilm)",
    "BAKRON_NPZ_MAX_MEMBER_BYTES": "allows an .npz member to expand to this many bytes "
                                   "(bakron.io: larger expansions are refused as zip bombs)",
    "CUDA_VISIBLE_DEVICES": "the GPUs a process may use (bakron.distributed)",
    "NUMBA_ENABLE_CUDASIM": "numba-cuda's simulator: the cuda engine runs on the host",
    "OMP_WAIT_POLICY": "left as the caller set it; else the numba engine sets PASSIVE "
                       "before OpenMP loads (workers sleep between parallel regions)",
    "OPENBLAS_NUM_THREADS": "BLAS threads (recorded on the CPU benchmark pages)",
    "OPENBLAS_THREAD_TIMEOUT": "BLAS thread timeout (recorded on the CPU benchmark pages)",
    "NUMBA_NUM_THREADS": "numba threads (recorded on the CPU benchmark pages)",
    "OMP_NUM_THREADS": "OpenMP threads (recorded on the CPU benchmark pages)",
    "MKL_NUM_THREADS": "MKL threads (recorded on the CPU benchmark pages)",
}


def environment(name: str):
    """The value of the environment variable ``name`` (``None`` when unset), which must be one
    of :data:`ENVIRONMENT`: the one place outside the options where bakron reads the
    environment."""
    if name not in ENVIRONMENT:
        raise KeyError(f"{name!r} is not an environment variable bakron reads (see "
                       f"bakron.solvers.options.ENVIRONMENT)")
    return os.environ.get(name)


def _check(cls_name: str, name: str, value, kind, low=None, choices=None, what=None):
    """``value`` checked for the field ``name``; ``what`` names it in the error (default
    ``Class.field``)."""
    label = what or f"{cls_name}.{name}"
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{label} must be True or False, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{label} must be an integer >= {low}, got {value!r}")
        return value
    if value not in choices:
        raise ValueError(f"{label} must be {_one_of(choices)}, got {value!r}")
    return value


def _one_of(choices) -> str:
    q = [repr(c) for c in choices]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " or " + q[-1]


class _Options:
    """What every options class shares: field checks from ``_SPEC``, reading the defaults
    from ``ENV``, ``with_`` for a copy with some fields changed."""

    #: field -> (kind, lowest value or choices)
    _SPEC: dict = {}
    #: field -> environment variable that sets its default
    ENV: dict = {}

    def __post_init__(self):
        for f in fields(self):
            kind, arg = self._SPEC[f.name]
            _check(type(self).__name__, f.name, getattr(self, f.name), kind,
                   low=arg if kind is int else None, choices=arg if kind is str else None)

    def with_(self, **changes):
        """A copy with ``changes`` (checked like the constructor's arguments)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {unknown}; its fields are "
                            f"{[f.name for f in fields(self)]}")
        return replace(self, **changes)

    @classmethod
    def defaults(cls):
        """The options a solve runs with when none of this class is given: the field
        defaults, each set by its environment variable when that is set (``ENV``)."""
        return defaults(cls)

    @classmethod
    def from_env(cls, environ=None):
        """The options with each default taken from its environment variable when set
        (``ENV``); a bad value is an error naming the variable and the field."""
        env = os.environ if environ is None else environ
        kw = {}
        for name, var in cls.ENV.items():
            raw = env.get(var)
            if raw is None:
                continue
            kind, arg = cls._SPEC[name]
            what = f"{var} ({cls.__name__}.{name})"
            if kind is bool:
                if raw not in ("0", "1"):
                    raise ValueError(f"{what} must be '0' or '1', got {raw!r}")
                kw[name] = raw == "1"
            elif kind is int:
                try:
                    v = int(raw)
                except ValueError:
                    v = None
                if v is None or v < arg:
                    raise ValueError(f"{what} must be an integer >= {arg}, got {raw!r}")
                kw[name] = v
            else:
                kw[name] = _check(cls.__name__, name, raw, str, choices=arg, what=what)
        return cls(**kw)


@dataclass(frozen=True)
class CudaOptions(_Options):
    """Options of the CUDA engine (``engine="cuda"``; docs/engines.md for what each does).

    Parameters
    ----------
    tf32 : bool
        Let cuBLAS use TF32 tensor cores for float32 GEMMs (faster, less accurate: Ŵ may
        differ from float64 in many more places). Default off.
    maxreg : int >= 0
        Register cap of the kernel (two CTAs of 256 threads per SM at 128); 0 leaves it to
        the compiler.
    per_thread : int >= 0
        Elements of a tile per thread of the kernel (a 16 x 16 tile: 256 threads at 1, 128
        at 2); 0 picks per step (2 for running sums, 1 for whole sums).
    launch : {"ptr", "array"}
        Pass raw device pointers to the kernel (no wrapping per launch) or wrapped 1-D
        arrays (slower). The simulator always wraps; so does a process where a pointer
        launch has failed once.
    step : {"auto", "running", "chain"}
        The kernel's tile step: running sums, or each tile's whole sums formed when it
        rounds; ``auto`` takes running sums when a block's sums need more than one K-chunk.
    local_blocks : int >= 0, local_tiles : int >= 1
        Launches of at least ``local_blocks`` blocks of at most ``local_tiles`` tiles solve
        whole blocks per CTA without grid synchronisations (0 blocks: never).
    stack_base : int >= 1
        The coarse block of a stack's wavefront when ``base`` is not given.
    stack : bool
        The stack hook (every launch and GEMM covers all items of a stack chunk); False
        declines every stack, so the stack layer solves the items one by one.
    scatter_rows, gather_tiles, gather_min_side, gather_split : int
        How the wavefront's GEMMs leave out the factors' zeros (``scatter_rows``,
        ``gather_tiles`` >= 0; ``gather_min_side``, ``gather_split`` >= 1): scatters by chunks of
        ``scatter_rows`` coarse block rows; gathers split along K into at most
        ``gather_split`` partial products when the blocks are at least ``gather_min_side``
        a side and ``gather_tiles`` allows (0 turns either off).
    """

    tf32: bool = False
    maxreg: int = 128
    per_thread: int = 0
    launch: str = "ptr"
    step: str = "auto"
    local_blocks: int = 64
    local_tiles: int = 16
    stack_base: int = 4
    stack: bool = True
    scatter_rows: int = 1
    gather_tiles: int = 512
    gather_min_side: int = 128
    gather_split: int = 8

    _SPEC = {"tf32": (bool, None), "maxreg": (int, 0), "per_thread": (int, 0),
             "launch": (str, ("ptr", "array")), "step": (str, ("auto", "running", "chain")),
             "local_blocks": (int, 0), "local_tiles": (int, 1), "stack_base": (int, 1),
             "stack": (bool, None), "scatter_rows": (int, 0), "gather_tiles": (int, 0),
             "gather_min_side": (int, 1), "gather_split": (int, 1)}
    ENV = {"tf32": "BAKRON_CUDA_TF32", "maxreg": "BAKRON_CUDA_MAXREG",
           "per_thread": "BAKRON_CUDA_PER_THREAD", "launch": "BAKRON_CUDA_LAUNCH",
           "step": "BAKRON_CUDA_STEP", "local_blocks": "BAKRON_CUDA_LOCAL_BLOCKS",
           "local_tiles": "BAKRON_CUDA_LOCAL_TILES", "stack_base": "BAKRON_CUDA_STACK_BASE",
           "stack": "BAKRON_CUDA_STACK", "scatter_rows": "BAKRON_CUDA_SCATTER_ROWS",
           "gather_tiles": "BAKRON_CUDA_GATHER_TILES",
           "gather_min_side": "BAKRON_CUDA_GATHER_MIN_SIDE",
           "gather_split": "BAKRON_CUDA_GATHER_SPLIT"}


@dataclass(frozen=True)
class NumbaOptions(_Options):
    """Options of the numba CPU engine (``engine="numba"``; docs/engines.md).

    Parameters
    ----------
    panel : int >= 1
        Panel width (elements) of the recursion's triangular products: the zero triangle of
        a unit-triangular block is skipped except inside the diagonal panels.
    base_elements : int >= 1
        Side of the base block in elements that ``base=None`` aims at.
    gather_rows : int >= 1, gather_k : int >= 1
        The wavefront's gathers are cut into pieces of at most ``gather_rows`` rows and
        ``gather_k`` columns of the inner dimension, one partial product per thread.
    gather_min_pieces : int >= 1, gather_min_rows : int >= 1
        A step whose gathers make fewer than ``gather_min_pieces`` pieces halves the
        pieces' height, down to ``gather_min_rows``.
    """

    panel: int = 64
    base_elements: int = 128
    gather_rows: int = 128
    gather_k: int = 512
    gather_min_pieces: int = 32
    gather_min_rows: int = 32

    _SPEC = {"panel": (int, 1), "base_elements": (int, 1), "gather_rows": (int, 1),
             "gather_k": (int, 1), "gather_min_pieces": (int, 1), "gather_min_rows": (int, 1)}
    ENV = {}


#: engine name -> its options class
OPTION_CLASSES = {"cuda": CudaOptions, "numba": NumbaOptions}

_DEFAULTS: dict = {}


def defaults(cls):
    """The default options of class ``cls``: its field defaults, each set by its environment
    variable when that is set. Read again whenever the variables change (the values of the
    variables are the cache key)."""
    key = (cls, tuple(os.environ.get(v) for v in cls.ENV.values()))
    hit = _DEFAULTS.get(key)
    if hit is None:
        hit = cls.from_env()
        if len(_DEFAULTS) > 64:
            _DEFAULTS.clear()
        _DEFAULTS[key] = hit
    return hit


def as_options(options) -> tuple:
    """``options`` of ``solve`` as a tuple of options objects, at most one per class
    (``None``: none); a ``TypeError``/``ValueError`` naming the argument otherwise."""
    if options is None:
        return ()
    items = (options,) if isinstance(options, _Options) else options
    try:
        if isinstance(items, (str, bytes)):
            raise TypeError
        items = tuple(items)
    except TypeError:
        raise TypeError(f"options must be an engine options object "
                        f"({', '.join(c.__name__ for c in OPTION_CLASSES.values())}) or a "
                        f"sequence of them, got {type(options).__name__}") from None
    seen = set()
    for o in items:
        if not isinstance(o, tuple(OPTION_CLASSES.values())):
            raise TypeError(f"options: each entry must be one of "
                            f"{', '.join(c.__name__ for c in OPTION_CLASSES.values())}, got "
                            f"{type(o).__name__}")
        if type(o) in seen:
            raise ValueError(f"options: two {type(o).__name__} objects; give one per engine")
        seen.add(type(o))
    return items


def pick(options: tuple, cls):
    """The options of class ``cls`` among ``options`` (``as_options``), else the defaults."""
    for o in options:
        if type(o) is cls:
            return o
    return defaults(cls)


def parse_option(text: str, engine: str | None = None):
    """``ENGINE.FIELD=VALUE`` (or ``FIELD=VALUE`` with ``engine``) from the command line as
    ``(class, field, value)``, the value converted to the field's type; errors name the
    text."""
    key, sep, raw = text.partition("=")
    if not sep:
        raise ValueError(f"--option {text!r}: expected ENGINE.FIELD=VALUE, e.g. "
                         f"numba.panel=64 or cuda.step=running")
    eng, dot, name = key.strip().rpartition(".")
    eng = eng or engine
    cls = OPTION_CLASSES.get(eng or "")
    if cls is None:
        raise ValueError(f"--option {text!r}: the engine must be one of "
                         f"{sorted(OPTION_CLASSES)} (ENGINE.FIELD=VALUE), got {eng or None!r}")
    if name not in cls._SPEC:
        raise ValueError(f"--option {text!r}: {cls.__name__} has no field {name!r}; its fields "
                         f"are {list(cls._SPEC)}")
    kind, arg = cls._SPEC[name]
    raw = raw.strip()
    if kind is bool:
        if raw.lower() not in ("0", "1", "true", "false", "on", "off"):
            raise ValueError(f"--option {text!r}: {cls.__name__}.{name} takes 0/1, true/false "
                             f"or on/off")
        value = raw.lower() in ("1", "true", "on")
    elif kind is int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"--option {text!r}: {cls.__name__}.{name} must be an integer >= "
                             f"{arg}") from None
    else:
        value = raw
    return cls, name, value


def from_cli(texts, engine: str | None = None) -> tuple:
    """The options objects that ``--option`` arguments ``texts`` describe, each class's
    unnamed fields at their defaults (``defaults``)."""
    changes: dict = {}
    for t in texts or ():
        cls, name, value = parse_option(t, engine)
        changes.setdefault(cls, {})[name] = value
    return tuple(defaults(cls).with_(**kw) for cls, kw in changes.items())
