"""scripts/check_docs_html.py: the static checks of the built docs that CI runs."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_docs_html", ROOT / "scripts" / "check_docs_html.py")
cd = importlib.util.module_from_spec(_spec)
sys.modules["check_docs_html"] = cd
_spec.loader.exec_module(cd)

_MATH = '<p><span class="math notranslate nohighlight">\\(x^2\\)</span></p>'


def _site(tmp_path, head, body=_MATH, mathjax_file=True):
    (tmp_path / "_static" / "mathjax").mkdir(parents=True)
    if mathjax_file:
        (tmp_path / "_static" / "mathjax" / "tex-chtml.js").write_text("//", encoding="utf-8")
    page = tmp_path / "index.html"
    page.write_text(f"<html><head>{head}</head><body>{body}</body></html>", encoding="utf-8")
    return page


def test_bundled_mathjax_passes(tmp_path):
    page = _site(tmp_path, '<script defer="defer" src="_static/mathjax/tex-chtml.js"></script>')
    assert cd.static_problems(tmp_path, page) == []
    assert cd.pages(tmp_path) == [page]  # _static is not a page


def test_cdn_mathjax_fails(tmp_path):
    page = _site(tmp_path, '<script async="async" '
                 'src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>')
    bad = cd.static_problems(tmp_path, page)
    assert len(bad) == 1 and "network" in bad[0]


def test_missing_bundle_fails(tmp_path):
    page = _site(tmp_path, '<script src="_static/mathjax/tex-chtml.js"></script>', mathjax_file=False)
    bad = cd.static_problems(tmp_path, page)
    assert len(bad) == 1 and "not in the build" in bad[0]


def test_maths_without_mathjax_fails(tmp_path):
    page = _site(tmp_path, "")
    assert "loads no MathJax" in cd.static_problems(tmp_path, page)[0]


def test_internal_wording_fails(tmp_path):
    page = _site(tmp_path, "", body="<p>Targets (issue 3): see SPEC §4.</p>")
    bad = cd.static_problems(tmp_path, page)
    assert len(bad) == 2 and "issue 3" in bad[0] and "SPEC" in bad[1]


def test_the_real_docs_use_the_bundle():
    conf = (ROOT / "docs" / "conf.py").read_text(encoding="utf-8")
    assert "sphinx-mathjax-offline" in conf
