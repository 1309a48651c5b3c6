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


# -- the wording rules of the user pages (the development notes keep their history) -------

_LAB_LOG = ("<p>Measured in call 2 / 4 on the device machine (commit 4ee809c), files under "
            "$OUT, written to /tmp/r/cpu.</p>")
_USER_TEXT = ("<p>Measured on an H200 (float32, tile 16): 1.77 ms at 1024². The whole call "
              "0.201 s; 12 calls of cuBLAS; the cache is ~/.cache/bakron.</p>"
              "<pre>sha256 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef</pre>"
              "<p><code>deadbeef1</code> in code is not prose; see https://example.org/home/x.</p>")


def _page(tmp_path, rel, body):
    page = tmp_path / rel
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(f"<html><head><title>t</title></head><body>{body}</body></html>",
                    encoding="utf-8")
    return page


def test_lab_log_wording_fails_on_a_user_page(tmp_path):
    page = _page(tmp_path, "benchmarks/cpu.html", _LAB_LOG)
    bad = cd.static_problems(tmp_path, page)
    kinds = sorted(b.split(": ", 1)[1].split(" '")[0] for b in bad)
    assert kinds == ["commit hash", "device-tool wording", "device-tool wording",
                     "machine path", "numbered call"], bad
    assert any("'call 2 / 4'" in b for b in bad) and any("'4ee809c'" in b for b in bad)
    assert any("'/tmp/r'" in b for b in bad) and any("'$OUT'" in b for b in bad)


def test_user_wording_passes(tmp_path):
    page = _page(tmp_path, "benchmarks/gpu.html", _USER_TEXT)
    assert cd.static_problems(tmp_path, page) == []


def test_development_notes_keep_history_but_no_machine_paths(tmp_path):
    page = _page(tmp_path, "development/engines.html", _LAB_LOG)
    bad = cd.static_problems(tmp_path, page)
    assert len(bad) == 1 and "machine path '/tmp/r'" in bad[0], bad
    assert not cd.user_page(Path("development/engines.html"))
    assert cd.user_page(Path("engines.html")) and cd.user_page(Path("tutorials/development.html"))


def test_numbered_calls_in_their_forms():
    for text in ("in call 1", "calls 2 and 3", "Call 2, round 1", "(calls 1, 1, 2)", "call 4"):
        assert cd._CALL.search(text), text
    for text in ("whole call 0.201 s", "a call of 12 ms", "60 calls", "call count"):
        assert not cd._CALL.search(text), text
