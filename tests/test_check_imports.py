"""scripts/check_imports.py: bakron's modules import each other without a cycle
(docs/architecture.md), lazy imports inside functions included."""
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_imports",
                                               ROOT / "scripts" / "check_imports.py")
ci = importlib.util.module_from_spec(_spec)
sys.modules["check_imports"] = ci
_spec.loader.exec_module(ci)

#: the foundations (docs/architecture.md): what bakron/_lib may import of bakron
FOUNDATIONS = {"bakron._xp", "bakron._safetensors"}


def test_bakron_has_no_import_cycle():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_imports.py")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("no import cycle among ")
    files, edges = ci.import_graph()
    assert ci.cycles(edges) == []
    assert [m for m in files if ci.layer_of(m) is None] == []
    assert len(ci.upward(edges)) <= ci.MAX_UP, ci.upward(edges)


def test_layers_name_modules_and_find_arrows_up():
    layer = {name: i for i, (name, _) in enumerate(ci.LAYERS)}
    assert ci.layer_of("bakron.solvers.schedule") == layer["schedule"]   # exact beats pkg.*
    assert ci.layer_of("bakron.solvers.stack") == layer["public API"]
    assert ci.layer_of("bakron.hessian.new_stage") == layer["public API"]
    assert ci.layer_of("bakron.brand_new") is None                      # must be placed
    edges = {"bakron._lib.fs": {"bakron.io": [3], "bakron._xp": [4]},
             "bakron.io": {"bakron._lib.fs": [5]}, "bakron._xp": {}}
    assert ci.upward(edges) == [("bakron._lib.fs", "bakron.io")]


def test_the_graph_holds_lazy_relative_and_backend_imports():
    files, edges = ci.import_graph()
    assert "bakron.backends.numba_cpu" in files and "bakron.solvers" in files
    # a lazy import inside a function, written relatively
    assert "bakron.pipeline" in edges["bakron.distributed._model_jobs"]
    # backends/ is bakron.backends: its relative imports reach bakron's modules
    assert "bakron.solvers.engines" in edges["bakron.backends.numba_cpu"]


def test_lib_imports_only_foundations():
    """Nothing in bakron/_lib imports the public API or anything above the foundations."""
    _, edges = ci.import_graph()
    bad = {(a, b) for a in edges if a.startswith("bakron._lib")
           for b in edges[a] if not (b.startswith("bakron._lib") or b in FOUNDATIONS)}
    assert not bad, sorted(bad)


def _tree(root: Path, modules: dict) -> None:
    for rel, text in modules.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_is_reported_with_its_modules_and_lines(tmp_path):
    """The checker can fail: a lazy relative import that closes a loop through backends/."""
    _tree(tmp_path, {
        "bakron/__init__.py": "",
        "bakron/a.py": "from .pkg import b\n",
        "bakron/pkg/__init__.py": "from .b import thing\n",
        "bakron/pkg/b.py": "def thing():\n    from ..backends import eng\n    return eng\n",
        "backends/__init__.py": "",
        "backends/eng.py": "import os\n\n\ndef f():\n    from bakron.a import x  # noqa\n",
        "bakron/free.py": "from . import a\n",
    })
    files, edges = ci.import_graph(tmp_path)
    comps = ci.cycles(edges)
    assert comps == [["bakron.a", "bakron.backends.eng", "bakron.pkg.b"]]
    text = ci.report(files, edges, comps, tmp_path)
    assert "bakron.backends.eng -> bakron.a    (backends/eng.py:5)" in text
    assert "bakron.pkg.b -> bakron.backends.eng    (bakron/pkg/b.py:2)" in text
    # a package __init__ that re-exports its child is not a cycle with it
    assert "bakron.pkg" not in {m for c in comps for m in c}


def test_importing_a_name_of_a_package_points_to_its_init(tmp_path):
    _tree(tmp_path, {
        "bakron/__init__.py": "from .pkg import run\n",
        "bakron/pkg/__init__.py": "from .impl import run\n",
        "bakron/pkg/impl.py": "def run():\n    from . import helper\n    from .. import pkg\n",
        "bakron/pkg/helper.py": "",
        "backends/__init__.py": "",
    })
    files, edges = ci.import_graph(tmp_path)
    assert set(edges["bakron.pkg.impl"]) == {"bakron.pkg.helper", "bakron.pkg"}
    assert ci.cycles(edges) == [["bakron.pkg", "bakron.pkg.impl"]]
