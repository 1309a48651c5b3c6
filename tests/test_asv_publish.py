"""scripts/asv_publish.py: every CDN file of asv's page maps to an npm package (no network)."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("asv_publish", ROOT / "scripts" / "asv_publish.py")
ap = importlib.util.module_from_spec(_spec)
sys.modules["asv_publish"] = ap
_spec.loader.exec_module(ap)


def test_known_cdn_urls():
    assert ap.npm_source("https://code.jquery.com/jquery-3.3.1.min.js") == \
        ("jquery@3.3.1", "dist/jquery.min.js")
    assert ap.npm_source("https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.min.js") == \
        ("flot@0.8.3", "jquery.flot.min.js")
    assert ap.npm_source("https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/css/bootstrap.min.css") \
        == ("bootstrap@3.1.1", "dist/css/bootstrap.min.css")
    assert ap.npm_source("https://example.com/x.js") is None


def test_every_url_of_the_installed_asv_page_has_a_source():
    asv = pytest.importorskip("asv")
    index = Path(asv.__file__).parent / "www" / "index.html"
    urls = [m.group(3) for m in ap._TAG.finditer(index.read_text(encoding="utf-8"))
            if m.group(1) == "script" or "stylesheet" in m.group(0)]
    assert urls, "asv's page loads nothing from a CDN any more: the script is not needed"
    assert [u for u in urls if ap.npm_source(u) is None] == []
    assert all(re.match(r"https://", u) for u in urls)
