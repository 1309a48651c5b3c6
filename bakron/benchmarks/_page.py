"""The benchmark pages of ``docs/benchmarks/``: one page per subject (cpu, gpu, stacks), each
benchmark command writes its own section of it.

A section lies between two marker lines, ``<!-- generated: KEY -->`` and
``<!-- end generated: KEY -->`` (HTML comments: invisible in the rendered page). A command
replaces the text between its markers and keeps the rest of the page (the hand-written
explanations around the tables) as it is; where the page has no such section yet, the
section is added at its end, and a page that does not exist yet starts with its title.
Pages are written atomically (``bakron._lib.fs``).
"""
from __future__ import annotations

import datetime
import os
import re

from .._lib.fs import atomic_write_text


def markers(key: str) -> tuple[str, str]:
    """The begin and end marker lines of section ``key``."""
    return f"<!-- generated: {key} -->", f"<!-- end generated: {key} -->"


def today() -> str:
    """The date of a run, UTC, as the pages print it (``2026-12-04``)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def splice(page: str, key: str, text: str) -> str:
    """``page`` with section ``key`` replaced by ``text`` (added at the end if absent)."""
    begin, end = markers(key)
    body = f"{begin}\n{text.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)
    found = pattern.findall(page)
    if len(found) > 1:
        raise ValueError(f"the page has section {key!r} {len(found)} times")
    if found:
        return pattern.sub(lambda _: body, page)
    return page.rstrip("\n") + "\n\n" + body + "\n"


def write_section(path, key: str, text: str, *, title: str) -> str:
    """Write ``text`` as section ``key`` of the page ``path`` (a new page: ``# title``
    first) atomically; returns the path."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            page = fh.read()
    except FileNotFoundError:
        page = f"# {title}\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write_text(path, splice(page, key, text))
    return path


def page_command(command: str) -> str:
    """A run's command as its page shows it: without ``--out DIR`` (where this copy of the
    page went is no part of how to reproduce it) and with every absolute path of an argument
    cut to its file name (``--pytest-log /scratch/run/pytest.log``: ``pytest.log``), so that
    no machine's folders appear on the page."""
    import shlex

    def short(word: str) -> str:
        if word.startswith("/"):
            return os.path.basename(word.rstrip("/")) or word
        if word.startswith("--") and "=/" in word:
            opt, value = word.split("=", 1)
            return f"{opt}={short(value)}"
        return word

    keep, skip = [], False
    for w in shlex.split(command):
        if skip:
            skip = False
        elif w == "--out":
            skip = True
        elif not w.startswith("--out="):
            keep.append(short(w))
    return " ".join(shlex.quote(w) for w in keep)
