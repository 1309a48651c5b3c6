"""The tutorials print what their pages show, with and without numba (scripts/check_tutorials.py).

Blocks that need a GPU (or torch) are skipped where there is none; a page whose every block is
skipped is reported as a skip, not a pass.
"""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_tutorials", ROOT / "scripts" / "check_tutorials.py")
ct = importlib.util.module_from_spec(_spec)
sys.modules["check_tutorials"] = ct  # dataclasses look their module up there
_spec.loader.exec_module(ct)

PAGES = sorted((ROOT / "docs" / "tutorials").glob("*.md"))


def test_there_are_tutorials():
    assert len(PAGES) >= 4, PAGES


@pytest.mark.slow
@pytest.mark.parametrize("no_numba", [False, True], ids=["numba", "no-numba"])
@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_tutorial_prints_what_the_page_shows(page, no_numba):
    if not no_numba:
        pytest.importorskip("numba")
    rep = ct.check(page, no_numba=no_numba)
    bad = ct.failures(rep)
    assert not bad, "\n\n".join(bad)
    blocks = rep["blocks"]
    assert blocks, f"{page.name}: no ```python blocks found"
    if all(b["status"] == "skipped" for b in blocks):
        pytest.skip(f"{page.name}: {blocks[0]['why']}")
    if not no_numba and rep["engine"] is not None:
        assert rep["engine"].startswith("numba"), rep["engine"]
    if no_numba and rep["engine"] is not None:
        assert rep["engine"].startswith("array_api"), rep["engine"]


# -- the runner itself ---------------------------------------------------------------------

_PAGE = """\
# t

```python
x = 2
print(x + 1)
```

```text
3
```

```python
print("a"); print("b")
```

<!-- check: with numba -->
```text
with
```

<!-- check: without numba -->
```text
without
```

```python
print("time 1.234 s")
```

<!-- check: output varies -->
```text
time 9 s
```

```bash
echo not python
```

```text
not an output
```

<!-- check: needs gpu -->
```python
import cupy
```
"""


def test_parse_pairs_outputs_and_directives():
    blocks = ct.parse(_PAGE)
    assert [b.code.strip().splitlines()[0] for b in blocks] == \
        ["x = 2", 'print("a"); print("b")', 'print("time 1.234 s")', "import cupy"]
    assert blocks[0].expected == "3\n" and not blocks[0].varies
    assert blocks[1].expected is None
    assert blocks[1].alternatives == {"with numba": "with\n", "without numba": "without\n"}
    assert blocks[2].varies
    assert blocks[3].expected is None and blocks[3].needs == ("gpu",)
    assert blocks[0].needs == ()


def test_runner_reports_a_wrong_output(tmp_path):
    page = tmp_path / "wrong.md"
    page.write_text("```python\nprint(1 + 1)\n```\n\n```text\n3\n```\n", encoding="utf-8")
    rep = ct.check(page)
    assert rep["blocks"][0]["status"] == "mismatch"
    assert rep["blocks"][0]["got"] == "2\n"
    assert ct.failures(rep) and "3" in ct.failures(rep)[0]


def test_runner_reports_an_exception_and_stops(tmp_path):
    page = tmp_path / "raises.md"
    page.write_text("```python\n1 / 0\n```\n\n```python\nprint('never')\n```\n\n```text\nnever\n```\n",
                    encoding="utf-8")
    rep = ct.check(page)
    assert [b["status"] for b in rep["blocks"]] == ["error"]
    assert "ZeroDivisionError" in ct.failures(rep)[0]


def test_no_numba_blocks_the_import(tmp_path):
    page = tmp_path / "nonumba.md"
    page.write_text("```python\ntry:\n    import numba\n    print('imported')\nexcept ImportError:\n"
                    "    print('blocked')\n```\n\n```text\nblocked\n```\n", encoding="utf-8")
    rep = ct.check(page, no_numba=True)
    assert ct.failures(rep) == [], rep


def test_unknown_directive_is_an_error():
    with pytest.raises(ValueError, match="unknown check directive 'with numbaa'"):
        ct.parse("<!-- check: with numbaa -->\n```text\nx\n```\n")
