"""Fetch one release's source archive from the package index as a plain file, building nothing.

    python3 scripts/fetch_sdist.py NAME VERSION LOCK DEST_DIR     -> prints the archive's path

`pip download --no-binary` prepares an sdist's metadata, which installs its build dependencies
(for vLLM that fails). This asks the index's simple API (PEP 691 JSON, PEP 503 HTML as the
fallback) for the file named NAME-VERSION.tar.gz, downloads it, and accepts it only when its
sha256 is one that LOCK (a hashed lock made by scripts/lock.sh) lists for NAME==VERSION.
The index is $UV_DEFAULT_INDEX, $UV_INDEX_URL or $PIP_INDEX_URL, else pip's default.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import re
import sys
import urllib.parse
import urllib.request

JSON_TYPE = "application/vnd.pypi.simple.v1+json"


def locked_hashes(lock_path: str, name: str, version: str) -> set[str]:
    """The sha256 digests a `uv pip compile --generate-hashes` lock lists for name==version."""
    text = open(lock_path, encoding="utf-8").read()
    match = re.search(rf"^{re.escape(name)}=={re.escape(version)}((?:\s*\\\n\s*--hash=sha256:[0-9a-f]+)+)",
                      text, re.MULTILINE | re.IGNORECASE)
    if match is None:
        raise SystemExit(f"fetch_sdist: {lock_path} has no hashed entry {name}=={version}; run scripts/lock.sh")
    return set(re.findall(r"sha256:([0-9a-f]{64})", match.group(1)))


def index_url() -> str:
    for var in ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_INDEX_URL"):
        if os.environ.get(var):
            return os.environ[var].rstrip("/")
    from pip._internal.models.index import PyPI  # pip's own default, so no host is written here
    return PyPI.simple_url.rstrip("/")


class _Anchors(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def file_url(index: str, name: str, filename: str) -> str:
    page = f"{index}/{re.sub(r'[-_.]+', '-', name).lower()}/"
    request = urllib.request.Request(page, headers={"Accept": f"{JSON_TYPE}, text/html;q=0.1"})
    with urllib.request.urlopen(request, timeout=60) as response:
        kind = response.headers.get("Content-Type", "")
        body = response.read()
    if kind.startswith(JSON_TYPE):
        links = [(f["filename"], f["url"]) for f in json.loads(body)["files"]]
    else:
        parser = _Anchors()
        parser.feed(body.decode("utf-8", "replace"))
        links = parser.links
    for found, url in links:
        if found == filename:
            return urllib.parse.urljoin(page, url)
    raise SystemExit(f"fetch_sdist: the index at {index} lists no {filename}")


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    name, version, lock, dest = argv
    wanted = locked_hashes(lock, name, version)
    filename = f"{name.replace('-', '_')}-{version}.tar.gz"
    url = file_url(index_url(), name, filename)
    os.makedirs(dest, exist_ok=True)
    path = os.path.join(dest, filename)
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as response, open(path + ".part", "wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() not in wanted:
        os.unlink(path + ".part")
        raise SystemExit(f"fetch_sdist: {filename} has sha256 {digest.hexdigest()}, which {lock} does not list")
    os.replace(path + ".part", path)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
