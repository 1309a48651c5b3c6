"""Check the built HTML documentation: maths renders offline, no internal wording.

Usage::

    python -m sphinx -W -b html docs docs/_build/html
    python scripts/check_docs_html.py docs/_build/html                  # static checks (CI)
    python scripts/check_docs_html.py docs/_build/html --browser \\
        --screenshots docs/_build/screenshots                          # + headless Chromium

Static checks, on every page: a page with maths loads MathJax from a file inside the build (not
from a CDN) and that file exists; no page loads any script from the network; no page contains
internal wording ("SPEC §", "issue 3", "when it is part of your version") or a machine path
(``/tmp/...``, ``/work/...``, ``/root/...``, ``/home/...``). The user pages -- every page but
those under ``development/``, the development notes outside the user guide -- also contain no
lab-log wording: no commit hash in prose (7 to 40 hex digits with both a digit and a letter,
outside code), no numbered call ("call 2", "calls 2 / 4", "call 1, round 2") and no wording of
the machinery that ran the measurements ("device tool", "device call", "$OUT", "files_at").

``--browser`` opens every page in headless Chromium (Debian's ``chromium`` package) with DNS
resolution disabled, so nothing can come from the network, and checks in the rendered DOM that
every maths element was typeset by MathJax (an ``mjx-container`` for each, no raw ``\\(`` or
``$$`` left). ``--screenshots DIR`` also saves a 1280 x 900 screenshot of each page.
Exit status 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run",
                  "--host-resolver-rules=MAP * ~NOTFOUND"]  # offline: no name resolves

_SCRIPT_SRC = re.compile(r"<script\b[^>]*\bsrc=\"([^\"]+)\"", re.I)
_MATH = re.compile(r"<(span|div) class=\"math\b[^\"]*\"", re.I)
_INTERNAL = re.compile(r"SPEC\s*§|SPEC\.md|\bissue \d+\b|when it is part of your version", re.I)
_TAGS = re.compile(r"<script\b.*?</script>|<style\b.*?</style>|<[^>]+>", re.S | re.I)
_CODE = re.compile(r"<pre\b.*?</pre>|<code\b.*?</code>", re.S | re.I)
# everywhere, code included: absolute paths of the machines the docs were written on
_MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:tmp|work|root|home)/[\w.~-]+")
# user pages only (the development notes may keep their history): a commit hash in prose,
# a numbered call of the measuring machinery, the measuring machinery's own words
_HASH = re.compile(r"(?<![\w./#-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/-])")
_CALL = re.compile(r"\bcalls? \d+(?!\.\d)(?:\s*(?:/|,|–|-|and|or)\s*\d+)*\b", re.I)
_DEVICE = re.compile(r"\bdevice[ -](?:tool|calls?|machines?|host|time)\b|\$OUT\b|\bfiles_(?:at|fetch)\b",
                     re.I)
#: the folder of the development notes, outside the user path (exempt from the lab-log rules)
DEV_NOTES = "development"


def pages(root: Path) -> list[Path]:
    skip = {"_static", "_sources", "_images", "_modules"}
    return sorted(p for p in root.rglob("*.html") if not skip & set(p.relative_to(root).parts))


def static_problems(root: Path, page: Path) -> list[str]:
    html = page.read_text(encoding="utf-8")
    rel = page.relative_to(root)
    bad = []
    srcs = _SCRIPT_SRC.findall(html)
    remote = [s for s in srcs if re.match(r"(https?:)?//", s)]
    if remote:
        bad.append(f"{rel}: loads scripts from the network: {remote}")
    if _MATH.search(html):
        mj = [s for s in srcs if "mathjax" in s.lower() or "tex-" in s.lower()]
        if not mj:
            bad.append(f"{rel}: has maths but loads no MathJax script")
        for s in mj:
            if not re.match(r"(https?:)?//", s) and not (page.parent / s.split("?")[0]).is_file():
                bad.append(f"{rel}: MathJax script {s} is not in the build")
    return bad + wording_problems(rel, html)


def _hits(rel, what: str, pattern: re.Pattern, text: str) -> list[str]:
    out = []
    for m in pattern.finditer(text):
        ctx = " ".join(text[max(0, m.start() - 60):m.end() + 40].split())
        out.append(f"{rel}: {what} {m.group(0)!r}: ...{ctx}...")
    return out


def user_page(rel: Path) -> bool:
    """False for the development notes (``development/...``), True for every other page."""
    return not (rel.parts and rel.parts[0] == DEV_NOTES)


def wording_problems(rel: Path, html: str) -> list[str]:
    """The wording rules on one page's HTML (the module docstring lists them)."""
    body = re.sub(r"^.*?<body\b", "<body", html, count=1, flags=re.S | re.I)  # not the <head>
    text = _TAGS.sub(" ", body)
    bad = _hits(rel, "internal wording", _INTERNAL, text)
    bad += _hits(rel, "machine path", _MACHINE_PATH, text)
    if user_page(Path(rel)):
        prose = _TAGS.sub(" ", _CODE.sub(" ", body))
        bad += _hits(rel, "commit hash", _HASH, prose)
        bad += _hits(rel, "numbered call", _CALL, text)
        bad += _hits(rel, "device-tool wording", _DEVICE, text)
    return bad


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browser_problems(root: Path, page: Path, exe: str, shots: Path | None) -> list[str]:
    rel = page.relative_to(root)
    url = page.resolve().as_uri()
    cmd = [exe, *CHROMIUM_FLAGS, "--virtual-time-budget=20000"]
    p = subprocess.run(cmd + ["--dump-dom", url], capture_output=True, text=True, timeout=180)
    if p.returncode != 0 or "<body" not in p.stdout:
        return [f"{rel}: chromium failed (exit {p.returncode}): {p.stderr[-500:]}"]
    dom = p.stdout
    bad = []
    n_math = len(_MATH.findall(page.read_text(encoding="utf-8")))
    n_typeset = dom.count("<mjx-container")
    if n_typeset < n_math:
        bad.append(f"{rel}: {n_math} maths elements but only {n_typeset} typeset by MathJax "
                   f"(raw LaTeX is showing)")
    # the page's text outside typeset maths and code: where raw LaTeX would show
    text = re.sub(r"<mjx-container\b.*?</mjx-container>|<pre\b.*?</pre>|<code\b.*?</code>",
                  " ", dom, flags=re.S)
    text = _TAGS.sub(" ", text)
    for raw in (r"\(", r"\[", "$$"):
        if raw in text:
            bad.append(f"{rel}: raw LaTeX delimiter {raw!r} left in the rendered page")
    if shots is not None:
        out = shots / rel.with_suffix(".png")
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(cmd + ["--window-size=1280,900", "--hide-scrollbars",
                              f"--screenshot={out}", url],
                       capture_output=True, text=True, timeout=180, check=False)
        if not out.is_file():
            bad.append(f"{rel}: no screenshot written")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html_dir", type=Path, help="the Sphinx HTML output (docs/_build/html)")
    ap.add_argument("--browser", action="store_true",
                    help="also render every page in headless Chromium (offline)")
    ap.add_argument("--screenshots", type=Path, help="with --browser: save screenshots here")
    a = ap.parse_args(argv)
    root = a.html_dir
    found = pages(root)
    if not found:
        print(f"no HTML pages under {root}", file=sys.stderr)
        return 1
    bad = []
    for page in found:
        bad += static_problems(root, page)
    if a.browser:
        exe = chromium()
        if exe is None:
            print("--browser: no chromium on PATH (apt-get install chromium)", file=sys.stderr)
            return 1
        for page in found:
            bad += browser_problems(root, page, exe, a.screenshots)
    for b in bad:
        print("FAIL " + b)
    print(f"{len(found)} pages checked ({'static + browser' if a.browser else 'static'}): "
          f"{len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
