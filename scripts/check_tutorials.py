"""Run the tutorials under docs/tutorials/ and check that they print what the pages show.

Usage::

    python scripts/check_tutorials.py [--no-numba] [PAGE.md ...]   # default: every tutorial

Each page is run top to bottom in one namespace, as a reader would paste it. A ```python
block followed by a ```text block must print exactly that text (doctest's ``...`` ellipsis is
allowed); a ```python block without one is run without comparison. HTML comments on the line
before a block steer the check (they are invisible on the rendered page)::

    <!-- check: needs gpu -->      this block and the rest of the page need a CUDA device with
                                   cupy (``needs torch``, ``needs cupy``: that module); without
                                   it they are skipped and reported as such
    <!-- check: with numba -->     the next ```text block is the output when numba is
    <!-- check: without numba -->  installed (or not); the other one is not compared
    <!-- check: output varies -->  the next ```text block is not compared (timings)

``--no-numba`` runs as if numba were not installed (its import fails), so both branches of an
engine-dependent output can be checked on one machine. The report says which engine ran and how
long each block took (the first block that calls the numba engine includes its compilation,
unless numba's on-disk cache already holds the kernels). Exit status: 0 when every compared
output matched, 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import doctest
import io
import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "docs" / "tutorials"

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*check:\s*(.*?)\s*-->")


@dataclass
class Block:
    line: int                       # 1-based line of the opening fence
    code: str
    expected: str | None = None     # the ```text block that follows (None: not compared)
    needs: tuple[str, ...] = ()     # modules / "gpu" this block needs
    varies: bool = False
    alternatives: dict[str, str] = field(default_factory=dict)  # "with numba" -> text


def parse(text: str) -> list[Block]:
    """The ```python blocks of a page with their expected outputs and check directives."""
    blocks: list[Block] = []
    needs: list[str] = []
    last_end, prev = 0, None   # prev: what the fence before this one was
    for m in _FENCE.finditer(text):
        lang, body = m.group(1), m.group(2)
        directives = _DIRECTIVE.findall(text[last_end:m.start()])
        last_end = m.end()
        for d in directives:
            if d.startswith("needs "):
                needs.extend(d.split()[1:])
            elif d not in ("with numba", "without numba", "output varies"):
                line = text.count("\n", 0, m.start()) + 1
                raise ValueError(f"unknown check directive {d!r} before line {line}; known: "
                                 "'needs MODULE|gpu', 'with numba', 'without numba', "
                                 "'output varies'")
        if lang == "python":
            line = text.count("\n", 0, m.start()) + 1
            blocks.append(Block(line, body, needs=tuple(dict.fromkeys(needs))))
            prev = "python"
            continue
        # a ```text block is an output when it follows a ```python block (or an output of it
        # for the other engine); any other fenced block ends the pairing
        cond = next((d for d in directives if d in ("with numba", "without numba")), None)
        if lang == "text" and prev in ("python", "alternative"):
            b = blocks[-1]
            if cond is not None:
                b.alternatives[cond] = body
                prev = "alternative"
                continue
            if prev == "python":
                b.expected = body
                b.varies = "output varies" in directives
        prev = lang
    return blocks


def _block_numba() -> None:
    """Make ``import numba`` fail (and ``importlib.util.find_spec('numba')`` return ``None``),
    as when numba is not installed: a ``None`` entry in ``sys.modules`` does both."""
    for name in [n for n in sys.modules if n == "numba" or n.startswith("numba.")]:
        del sys.modules[name]
    sys.modules["numba"] = None


def _have(need: str) -> str | None:
    """``None`` when the requirement holds, else why not."""
    if need == "gpu":
        try:
            import cupy

            return None if cupy.cuda.runtime.getDeviceCount() > 0 else "no CUDA device"
        except Exception as e:  # ImportError, CUDA driver errors
            return f"no CUDA device with cupy ({type(e).__name__})"
    try:
        __import__(need)
        return None
    except Exception as e:
        return f"{need} not importable ({type(e).__name__})"


def _engine() -> str:
    from bakron.backends import numba_cpu

    if numba_cpu.available():
        import numba

        return f"numba {numba.__version__}"
    return "array_api (numba not installed)"


def run_page(path: Path, no_numba: bool) -> dict:
    """Run one page in this process; returns a JSON-able report."""
    cond = "without numba" if no_numba else "with numba"
    ns: dict = {"__name__": "__tutorial__"}
    page = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = {"page": str(page), "blocks": [], "engine": None}
    for b in parse(path.read_text(encoding="utf-8")):
        rec = {"line": b.line, "status": "ok", "seconds": 0.0}
        out["blocks"].append(rec)
        missing = [why for n in b.needs if (why := _have(n))]
        if missing:
            rec.update(status="skipped", why="; ".join(missing))
            continue
        buf = io.StringIO()
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(b.code, f"{path.name}:{b.line}", "exec"), ns)
        except Exception:
            rec.update(status="error", got=buf.getvalue(), error=traceback.format_exc(limit=-3))
            break  # later blocks depend on this one
        finally:
            rec["seconds"] = round(time.perf_counter() - t0, 2)
        want = b.alternatives.get(cond, b.expected)
        if b.alternatives and cond not in b.alternatives:
            want = None
        if want is None or b.varies:
            rec["status"] = "ran"
            continue
        got = buf.getvalue()
        if not doctest.OutputChecker().check_output(want, got, doctest.ELLIPSIS):
            rec.update(status="mismatch", want=want, got=got)
    if "bakron" in sys.modules:
        out["engine"] = _engine()
    return out


def _child(page: str, no_numba: bool) -> None:
    if no_numba:
        _block_numba()
    os.chdir(ROOT)
    print(json.dumps(run_page(Path(page).resolve(), no_numba)))


def check(page: Path, no_numba: bool = False, timeout: float = 1200) -> dict:
    """Run ``page`` in a fresh interpreter (so ``--no-numba`` and imports start clean)."""
    cmd = [sys.executable, __file__, "--child", str(page)] + (["--no-numba"] if no_numba else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        return {"page": str(page), "engine": None, "blocks": [],
                "crash": f"exit {p.returncode}\n{p.stderr[-4000:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def failures(report: dict) -> list[str]:
    """Human-readable failures of one page's report (empty when it passed)."""
    if "crash" in report:
        return [f"{report['page']}: the runner crashed: {report['crash']}"]
    bad = []
    for r in report["blocks"]:
        where = f"{report['page']}:{r['line']}"
        if r["status"] == "error":
            bad.append(f"{where}: the block raised\n{r['error']}")
        elif r["status"] == "mismatch":
            bad.append(f"{where}: printed\n{r['got']}--- but the page shows\n{r['want']}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="*", type=Path, help="default: docs/tutorials/*.md")
    ap.add_argument("--no-numba", action="store_true", help="run as if numba were not installed")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a.child, a.no_numba)
        return 0
    pages = a.pages or sorted(TUTORIALS.glob("*.md"))
    status = 0
    for page in pages:
        rep = check(page, a.no_numba)
        n = {s: sum(r["status"] == s for r in rep["blocks"]) for s in ("ok", "ran", "skipped")}
        secs = ", ".join(f"{r['line']}: {r['seconds']:.1f} s" for r in rep["blocks"]
                         if r["status"] != "skipped")
        print(f"{rep['page']}: engine {rep['engine']}; {n['ok']} outputs matched, "
              f"{n['ran']} blocks ran unchecked, {n['skipped']} skipped"
              + (f" ({rep['blocks'][-1].get('why', '')})" if n["skipped"] else ""))
        if secs:
            print(f"    seconds per block (by line): {secs}")
        for f in failures(rep):
            status = 1
            print("FAIL " + f)
    return status


if __name__ == "__main__":
    sys.exit(main())
