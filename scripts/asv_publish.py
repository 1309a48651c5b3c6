"""``asv publish``, then make the published site work offline.

Usage::

    python scripts/asv_publish.py [--html .asv/html] [--no-publish]

asv's page loads jQuery, flot, bootstrap and three small plugins from CDNs; without network it
redirects to a page that says so and draws nothing. This script copies those files from their
npm packages (``npm pack``, cached in ``.asv/vendor/``, so only the first run needs the npm
registry) into ``<html>/_vendor/`` and points the page at them. When npm or the registry is
not reachable it says so and leaves the page as asv wrote it (it then explains itself).
Open the result with ``asv preview`` (browsers refuse the result files over ``file://``).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: CDN URL (as asv 0.6 writes it) -> (npm package@version, file inside the package)
_CDNJS = {"flot": "flot", "blueimp-md5": "blueimp-md5"}
# stupidtable 1.0.1 is not on npm; 1.1.3 is the same plugin (same call, sort on click)
_FIXED = {"https://cdnjs.cloudflare.com/ajax/libs/stupidtable/1.0.1/stupidtable.min.js":
          ("stupid-table-plugin@1.1.3", "stupidtable.min.js")}
_EXTRA = {"bootstrap": ["dist/fonts/"]}  # files the stylesheet refers to


def npm_source(url: str) -> tuple[str, str] | None:
    """The npm package and path holding the file that ``url`` serves, or ``None``."""
    if url in _FIXED:
        return _FIXED[url]
    m = re.match(r"https://cdn\.jsdelivr\.net/npm/([^/]+@[^/]+)/(.+)$", url)
    if m:
        return m.group(1), m.group(2)
    m = re.match(r"https://code\.jquery\.com/jquery-([\d.]+)(\.min)?\.js$", url)
    if m:
        return f"jquery@{m.group(1)}", f"dist/jquery{m.group(2) or ''}.js"
    m = re.match(r"https://cdnjs\.cloudflare\.com/ajax/libs/([^/]+)/([^/]+)/(.+)$", url)
    if m and m.group(1) in _CDNJS:
        return f"{_CDNJS[m.group(1)]}@{m.group(2)}", m.group(3)
    return None


def _pack(spec: str, cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    name, _, ver = spec.rpartition("@")
    hit = list(cache.glob(f"{name.replace('/', '-').lstrip('@')}-{ver}.tgz"))
    if hit:
        return hit[0]
    p = subprocess.run(["npm", "pack", "--silent", spec, "--pack-destination", str(cache)],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"npm pack {spec}: {p.stderr.strip()[-300:]}")
    return cache / p.stdout.strip().splitlines()[-1]


def _extract(tgz: Path, inner: str, dest: Path) -> str:
    """Copy ``inner`` (or its unminified twin when the package has no ``.min`` file, or a
    folder when ``inner`` ends in ``/``) out of the package; returns the path used."""
    with tarfile.open(tgz) as tar:
        names = set(tar.getnames())
        for cand in (inner, inner.replace(".min.", ".")):
            if cand.endswith("/"):
                members = [m for m in tar.getmembers()
                           if m.name.startswith("package/" + cand) and m.isfile()]
                for m in members:
                    out = dest / m.name[len("package/"):]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tar.extractfile(m).read())
                if members:
                    return cand
            elif "package/" + cand in names:
                out = dest / cand
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tar.extractfile("package/" + cand).read())
                return cand
    raise FileNotFoundError(f"{inner} is not in {tgz.name}")


_TAG = re.compile(r"<(script|link)\b[^>]*?\b(src|href)=\"(https://[^\"]+)\"[^>]*>", re.I)


def vendor(html_dir: Path, cache: Path) -> list[str]:
    """Rewrite ``html_dir/index.html`` to load its CDN files from ``html_dir/_vendor``.
    Returns the URLs that could not be vendored (the page keeps loading those from the CDN)."""
    index = html_dir / "index.html"
    text = index.read_text(encoding="utf-8")
    missing = []

    def local(m):
        tag, url = m.group(0), m.group(3)
        if m.group(1).lower() == "link" and "stylesheet" not in tag:
            return tag
        src = npm_source(url)
        if src is None:
            missing.append(f"{url} (no npm source known)")
            return tag
        spec, inner = src
        dest = html_dir / "_vendor" / spec.replace("/", "_")
        try:
            tgz = _pack(spec, cache)
            used = _extract(tgz, inner, dest)
            pkg = spec.rpartition("@")[0]
            for extra in _EXTRA.get(pkg, []):
                _extract(tgz, extra, dest)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            missing.append(f"{url} ({e})")
            return tag
        rel = f"_vendor/{spec.replace('/', '_')}/{used}"
        tag = tag.replace(url, rel)
        # the CDN's integrity hash is for its own (minified) bytes, not the package's
        return re.sub(r'\s(integrity|crossorigin|referrerpolicy)="[^"]*"', "", tag)

    new = _TAG.sub(local, text)
    tmp = index.with_suffix(".html.tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(index)
    return missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--html", type=Path, default=ROOT / ".asv" / "html")
    ap.add_argument("--cache", type=Path, default=ROOT / ".asv" / "vendor")
    ap.add_argument("--no-publish", action="store_true", help="only vendor an existing site")
    a = ap.parse_args(argv)
    if not a.no_publish:
        subprocess.run([sys.executable, "-m", "asv", "publish"], cwd=ROOT, check=True)
    if shutil.which("npm") is None:
        print("npm not found: the published page loads its scripts from CDNs (offline it "
              "shows asv's error page)", file=sys.stderr)
        return 1
    missing = vendor(a.html, a.cache)
    for m in missing:
        print(f"not vendored, still loaded from the network: {m}", file=sys.stderr)
    print(f"{a.html / 'index.html'}: " + ("every script is local" if not missing
                                           else f"{len(missing)} files still remote"))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
