"""Report the import cycles of bakron's modules and the imports that run up the layers
(docs/architecture.md: no circle, at most one arrow back up).

    python scripts/check_imports.py            # exit 0: clean; 1: each problem listed
    python scripts/check_imports.py --edges    # also print every edge (importer -> imported)

Exit 1 when there is a cycle, a module that is in no layer of :data:`LAYERS`, or more than
:data:`MAX_UP` imports from a layer to a layer above it.

Every ``.py`` file of ``bakron/`` and ``backends/`` (installed as ``bakron.backends``) is
parsed with :mod:`ast`; every ``import`` / ``from ... import`` statement counts wherever it
stands: at module level, inside a function or method (lazy imports), under ``try`` or
``if``. Relative imports are resolved against the importing module's package.
Imports by name count too: ``importlib.import_module("literal")``, and in a module that calls
``import_module`` with a computed name (a registry, such as the engines' ``ENGINE_MODULES`` or
the CLI's demo table), every string constant that is exactly the name of one of our modules
is an edge from that module.

The rule for packages (``__init__.py``):

- each package's ``__init__`` is one node, named for the package (``bakron.solvers``);
- ``import a.b.c`` and ``from a.b import c`` where ``a/b/c`` is a module (or package) give
  the edge ``importer -> a.b.c``;
- ``from a.b import name`` where ``name`` is not a module gives ``importer -> a.b``: the
  importer depends on what the package's ``__init__`` defines or re-exports;
- Python also runs the parent packages' ``__init__`` when it imports ``a.b.c``; that is not
  counted as an edge, since the importer uses none of their names (otherwise every package
  whose ``__init__`` re-exports its children would be a circle with each of them).

A cycle is a strongly connected component of more than one module (or a module that imports
itself); the report names its modules and the edges inside it, each with the file and line of
the import statement, so a cycle can be found and cut.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: source folders and the package each is installed as (pyproject's package-dir)
SOURCES = (("bakron", "bakron"), ("backends", "bakron.backends"))

#: The layers of docs/architecture.md, bottom first. An entry is a module's name, or
#: ``"pkg.*"`` for a package and everything below it; the most specific entry wins
#: (``bakron.solvers.schedule`` before ``bakron.solvers.*``). A module that no entry names
#: (a new top-level module) must be added here.
LAYERS = (
    ("foundations", ("bakron._xp", "bakron._validate", "bakron.quantizers", "bakron.factors",
                     "bakron._lib.*", "bakron._safetensors")),
    ("schedule", ("bakron.solvers.schedule",)),
    ("engine contract", ("bakron.solvers.engines", "bakron.solvers.options",
                         "bakron.solvers._problem")),
    ("kernels", ("bakron.backends._numba_kernels", "bakron.backends._cuda_kernels",
                 "bakron.backends._cuda_layout", "bakron.backends._cuda_launch")),
    ("engines", ("bakron.backends.*", "bakron.solvers.array_api", "bakron.solvers.naive",
                 "bakron.solvers.antidiagonal", "bakron.solvers.recursive")),
    ("public API", ("bakron", "bakron.solvers.*", "bakron.layer", "bakron.layer_groups",
                    "bakron.incoherence",
                    "bakron.hessian.*")),
    ("models and formats", ("bakron.models.*", "bakron.io", "bakron.factor_files",
                            "bakron.export.*", "bakron.distributed._outputs")),
    ("pipeline", ("bakron.pipeline",)),
    ("applications", ("bakron.cli", "bakron.__main__", "bakron.quantize_model",
                      "bakron.distributed.*", "bakron.demo.*", "bakron.benchmarks.*",
                      "bakron.bench", "bakron.bench_gpu", "bakron.bench_stack")),
)
#: imports allowed to run from a layer up to a higher one (docs/architecture.md: at most one)
MAX_UP = 1


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the source folders."""
    out: dict[str, Path] = {}
    for folder, package in SOURCES:
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return name in files and files[name].name == "__init__.py"


def _resolve_relative(importer: str, level: int, module: str | None,
                      files: dict[str, Path]) -> str:
    package = importer if _is_package(importer, files) else importer.rpartition(".")[0]
    parts = package.split(".")
    if level - 1 > len(parts) - 1:
        raise ValueError(f"{importer}: relative import beyond the top-level package")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _known(name: str, files: dict[str, Path]) -> str | None:
    """``name`` or its nearest enclosing module that is one of ours (``None``: not ours)."""
    while name:
        if name in files:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str, files: dict[str, Path]) -> list[tuple[str, int]]:
    """The modules of ours that module ``name`` imports: ``[(target, line), ...]``."""
    tree = ast.parse(files[name].read_text(encoding="utf-8"), filename=str(files[name]))
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, files)
                if target:
                    out.append((target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(name, node.level, node.module, files) if node.level
                    else node.module or "")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in files else _known(base, files)
                if target:
                    out.append((target, node.lineno))
    # import by name: importlib.import_module("literal"), and where a module imports a
    # computed name (a registry such as solvers.registry.ENGINE_MODULES), every string
    # constant of that module that is exactly the name of one of our modules
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args
             and (getattr(node.func, "attr", None) == "import_module"
                  or getattr(node.func, "id", None) == "import_module")]
    computed = False
    for call in calls:
        arg = call.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            target = _known(arg.value, files)
            if target:
                out.append((target, call.lineno))
        else:
            computed = True
    if computed:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value in files and node.value != name:
                out.append((node.value, node.lineno))
    return out


def import_graph(root: Path = ROOT) -> tuple[dict[str, Path], dict[str, dict[str, list[int]]]]:
    """``(files, edges)``: ``edges[a][b]`` is the lines where module ``a`` imports ``b``."""
    files = module_files(root)
    edges: dict[str, dict[str, list[int]]] = {m: {} for m in files}
    for m in files:
        for target, line in imports_of(m, files):
            lines = edges[m].setdefault(target, [])
            if line not in lines:
                lines.append(line)
    return files, edges


def cycles(edges: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """The strongly connected components with a cycle (Tarjan's algorithm, iterative),
    each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in edges[v]:
                        found.append(sorted(comp))
    return sorted(found)


def layer_of(name: str) -> int | None:
    """Index in :data:`LAYERS` of module ``name`` (``None``: in no layer)."""
    best = None
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            pkg = e[:-2] if e.endswith(".*") else None
            hit = name == e or (pkg is not None and (name == pkg or name.startswith(pkg + ".")))
            rank = len(e) + (1 if pkg is None else 0)   # an exact name beats its package's .*
            if hit and (best is None or rank > best[1]):
                best = (i, rank)
    return None if best is None else best[0]


def upward(edges) -> list[tuple[str, str]]:
    """The imports from a layer to a layer above it, ``[(importer, imported), ...]``."""
    out = []
    for a in sorted(edges):
        for b in sorted(edges[a]):
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and lb > la:
                out.append((a, b))
    return out


def report(files, edges, comps, root: Path = ROOT) -> str:
    lines = []
    for k, comp in enumerate(comps, 1):
        lines.append(f"cycle {k}: {len(comp)} modules: {', '.join(comp)}")
        members = set(comp)
        for a in comp:
            for b in sorted(edges[a]):
                if b in members:
                    where = ", ".join(str(n) for n in edges[a][b])
                    rel = files[a].relative_to(root) if files[a].is_relative_to(root) else files[a]
                    lines.append(f"    {a} -> {b}    ({rel}:{where})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", action="store_true", help="print every edge too")
    args = ap.parse_args(argv)
    files, edges = import_graph()
    if args.edges:
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"{a} -> {b}")
    comps = cycles(edges)
    n_edges = sum(len(v) for v in edges.values())
    bad = False
    if comps:
        print(report(files, edges, comps))
        print(f"{len(comps)} import cycle(s) among {len(files)} modules ({n_edges} edges)")
        bad = True
    else:
        print(f"no import cycle among {len(files)} modules ({n_edges} edges)")
    lost = [m for m in sorted(files) if layer_of(m) is None]
    for m in lost:
        print(f"module {m} ({files[m].relative_to(ROOT)}) is in no layer: add it to LAYERS "
              f"in scripts/check_imports.py (and to docs/architecture.md)")
    up = upward(edges)
    for a, b in up:
        print(f"up: {a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})    "
              f"({files[a].relative_to(ROOT)}:{', '.join(map(str, edges[a][b]))})")
    print(f"{len(up)} import(s) running up the layers (at most {MAX_UP})")
    return 1 if bad or lost or len(up) > MAX_UP else 0


if __name__ == "__main__":
    sys.exit(main())
