"""Sphinx configuration for the bakron documentation.

Build (warnings are errors, as in CI)::

    python -m sphinx -W -b html docs docs/_build/html
"""
from __future__ import annotations

import fnmatch
import os
import re
import sys

sys.path.insert(0, os.path.abspath(".."))  # document the source tree even when not installed

import bakron  # noqa: E402

project = "bakron"
author = "the bakron developers"
copyright = "the bakron developers"
release = bakron.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax 3 copied into _static/mathjax: maths renders offline
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "scripts", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autosummary_generate = False  # tables only; the entries live on the API page itself
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # numpydoc shows the documented types
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

html_theme = "pydata_sphinx_theme"
html_title = f"bakron {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    # the benchmark pages hold wide tables: give them the right-hand column too
    "secondary_sidebar_items": {"**": ["page-toc", "sourcelink"],
                                "benchmarks/cpu": [], "benchmarks/gpu": [],
                                "benchmarks/stacks": []},
}
# every page sits directly under the landing page, so the theme's "Section Navigation" (which
# starts one level down) would be empty: show the whole table of contents instead
html_sidebars = {"**": ["sidebar-site-nav"]}
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["bakron.css"]


# -- pages written by other parts of the project --------------------------------------------
# The index toctrees name some pages by :glob: pattern (docs/hessian.md, docs/benchmarks/*.md,
# ...). Sphinx warns -- an error under -W -- when a pattern matches nothing (pages named
# explicitly in any toctree of the index do not count), so before the index is parsed, glob
# entries that match no other page are dropped (and a toctree left empty is dropped).
# A toctree entry ``*remaining*`` lists every page that no toctree names, so a page added
# later never breaks the build with "document isn't included in any toctree".

_GLOB = re.compile(r"[*?\[]")
_FENCE = re.compile(r"^```\{toctree\}[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _all_pages(srcdir: str) -> list[str]:
    pages = []
    for dirpath, dirs, files in os.walk(srcdir):
        rel = os.path.relpath(dirpath, srcdir)
        dirs[:] = [d for d in dirs if not d.startswith((".", "_")) and d != "scripts"]
        for f in files:
            stem, ext = os.path.splitext(f)
            if ext in source_suffix:
                pages.append(stem if rel == "." else f"{rel}/{stem}".replace(os.sep, "/"))
    return sorted(pages)


def _entries(body: str) -> list[str]:
    return [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith(":")]


def _resolve_toctrees(app, docname, source):
    if docname != root_doc:
        return
    pages = [p for p in _all_pages(app.srcdir) if p != root_doc]
    text = source[0]
    named: set[str] = set()
    explicit: set[str] = set()  # pages named without a pattern: a glob never adds them again
    for m in _FENCE.finditer(text):
        for e in _entries(m.group(1)):
            if e == "*remaining*":
                continue
            if _GLOB.search(e):
                named.update(fnmatch.filter(pages, e))
            else:
                named.add(e)
                explicit.add(e)
    remaining = [p for p in pages if p not in named]

    def fix(m):
        lines, kept = [], 0
        for ln in m.group(1).splitlines():
            e = ln.strip()
            if e == "*remaining*":
                lines.extend(remaining)
                kept += len(remaining)
            elif e and not e.startswith(":") and _GLOB.search(e):
                hits = [p for p in fnmatch.filter(pages, e) if p not in explicit]
                if hits:
                    lines.append(ln)
                    kept += 1
            else:
                lines.append(ln)
                kept += bool(e) and not e.startswith(":")
        if kept == 0:
            return ""
        head = m.group(0).split("\n", 1)[0]
        return head + "\n" + "\n".join(lines) + "\n```"

    source[0] = _FENCE.sub(fix, text)


def setup(app):
    app.connect("source-read", _resolve_toctrees)
