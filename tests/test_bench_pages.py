"""The benchmark pages (docs/benchmarks/): each command writes its own section of its page,
and the committed sections are what the committed results render to."""
from __future__ import annotations

import pathlib
import shutil

import pytest

from bakron.benchmarks import _page

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def test_splice_replaces_only_its_section():
    page = "# T\n\nhand text\n\n" + "\n".join(_page.markers("a")).replace(
        "-->\n", "-->\nold a\n") + "\n\nmore hand text\n"
    out = _page.splice(page, "a", "new a")
    assert "new a" in out and "old a" not in out
    assert out.startswith("# T\n\nhand text\n\n") and out.endswith("\n\nmore hand text\n")
    both = _page.splice(out, "b", "text b")          # absent: appended at the end
    assert both.startswith(out.rstrip("\n")) and both.endswith(
        "<!-- generated: b -->\ntext b\n<!-- end generated: b -->\n")
    assert _page.splice(both, "a", "new a") == both   # idempotent
    with pytest.raises(ValueError, match="section 'a' 2 times"):
        _page.splice(both + both, "a", "x")


def test_write_section_new_page_and_keeps_the_rest(tmp_path):
    path = tmp_path / "sub" / "p.md"
    _page.write_section(path, "k", "one", title="Title")
    assert path.read_text() == "# Title\n\n<!-- generated: k -->\none\n<!-- end generated: k -->\n"
    path.write_text(path.read_text() + "\nhand\n")
    _page.write_section(path, "k", "two", title="Title")
    assert path.read_text().endswith("-->\ntwo\n<!-- end generated: k -->\n\nhand\n")
    assert [p.name for p in path.parent.iterdir()] == ["p.md"]  # no temporary file left


def test_page_command_leaves_out_the_output_folder():
    assert _page.page_command("python -m x --a 1 --out /tmp/r --b") == "python -m x --a 1 --b"
    assert _page.page_command("python -m x --out=/tmp/r --b 'a b'") == "python -m x --b 'a b'"
    assert _page.page_command("python -m x --pytest-log /scratch/r/pytest.log --l=/a/b.txt") \
        == "python -m x --pytest-log pytest.log --l=b.txt"


def _section(text: str, key: str) -> str:
    begin, end = _page.markers(key)
    return text[text.index(begin):text.index(end)]


@pytest.mark.parametrize("page,key,data,render", [
    ("gpu.md", "gpu", "gpu.json", "gpu"),
    ("stacks.md", "stacks-gpu-suite", "stacks-gpu-suite.json", "stack"),
    ("cpu.md", "cpu-threads", "cpu-threads.json", "cpu"),
])
def test_committed_sections_are_their_results_rendered(tmp_path, page, key, data, render):
    """``--render data/X.json`` reproduces the committed section of the page exactly: its
    figures come from the stored results, nothing typed by hand."""
    import importlib

    shutil.copy(DOCS / page, tmp_path / page)
    mod = importlib.import_module(f"bakron.benchmarks.{render}")
    before = (tmp_path / page).read_text()
    args = ["--render", str(DOCS / "data" / data), "--out", str(tmp_path)]
    assert mod.main(args) == 0
    after = (tmp_path / page).read_text()
    assert _section(after, key) == _section(before, key)
    assert after == before
