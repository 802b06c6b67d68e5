"""Docs that cannot drift: every repository path the documentation names in backticks
(`server/tiering/manager.py`, `tiers/nvme/`, `bench/local.py`) exists, a name given with it
(`server/peer/service.py: PeerService`) is defined there, every method named on one of our
classes (`TierManager.get`) is defined on it, every `kvstore.*` module exists, and every
relative link resolves. A renamed or deleted file fails here, not in a reader's hands. And no
file cites the design document kept outside the repository: what the docs cite is here."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "docker" / "README.md",
               *(ROOT / "docs").rglob("*.md")])


def repository_files(root: pathlib.Path) -> list[str] | None:
    """The files of the repository at `root` as git sees them (tracked, or new and not
    ignored), or None where there is no git checkout."""
    if shutil.which("git") is None or not (root / ".git").exists():
        return None
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return [name for name in listed if name]


def top_level_names(root: pathlib.Path) -> set[str]:
    """The repository's top-level names: from git, so an ignored build/ or kvstore-demo/ on
    disk is not one (docker/README.md names build/docker/..., which a script makes: with a
    build/ folder present they were checked as repository paths, and failed). Without git
    (a source archive), what is on disk."""
    files = repository_files(root)
    if files is None:
        return {p.name for p in root.iterdir() if not p.name.startswith(".")}
    return {name.split("/")[0] for name in files}


FILES = repository_files(ROOT)
TOP = top_level_names(ROOT)
# `a/b.py`, `a/b/`, optionally followed by `: Name` or `:line`
PATH = re.compile(r"`((?:[A-Za-z0-9_.-]+/)+(?:[A-Za-z0-9_.-]+\.(?:py|sh|md|toml|yml|yaml|json|txt|in|cfg))?)(?::\s*([^`]*))?`")
METHOD = re.compile(r"`([A-Z][A-Za-z0-9]+)\.([a-z_][a-z0-9_]*)(?:\(\))?`")
# kvstore.<subpackage>...: other kvstore.x names are often loggers (`kvstore.admin`)
MODULE = re.compile(r"`(kvstore\.(?:server|client|tiers|gpu|adapters|commands)(?:\.[A-Za-z_][A-Za-z0-9_]*)*)`")
PACKAGES = ("kvstore", "server", "client", "tiers", "gpu", "adapters", "commands")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# A citation of the design document that lives outside the repository (`../shared/`): the
# design the docs and comments cite is in the repository or not cited. Spelled so that this
# file does not match it.
OUTSIDE_DESIGN = re.compile(rb"\bDESIGN\b(?:\.md|\s+section)")
# Frozen text that is data, not docs: the e2e bench's prompt corpus, a copy of old docs whose
# sha256 goes into every result (bench/e2e.py).
FROZEN = {"bench/e2e_corpus.txt"}


def _named_paths(text: str):
    for match in PATH.finditer(text):
        path = match.group(1)
        if path.split("/")[0] in TOP:  # a repository path, not /etc/... or an engine's own
            yield path


def _defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bself\.{name}\s*[:=]",
                     source, re.M) is not None


def _classes() -> dict[str, list[tuple[str, list[str]]]]:
    """Class name -> (source of the file that defines it, its base classes' names), per
    definition in the project."""
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            source = path.read_text()
            for name, bases in re.findall(r"^class\s+([A-Za-z0-9_]+)\s*(?:\(([^)]*)\))?", source, re.M):
                found.setdefault(name, []).append((source, re.findall(r"[A-Za-z_][A-Za-z0-9_]*", bases)))
    return found


def _has(classes: dict, cls: str, attr: str, seen=()) -> bool:
    """`cls` (one of ours) or a class it inherits from defines `attr`."""
    return any(_defines(source, attr) or any(_has(classes, b, attr, seen + (cls,)) for b in bases
                                             if b in classes and b not in seen)
               for source, bases in classes.get(cls, ()))


def _module_exists(dotted: str) -> bool:
    """kvstore.a.b names a module or package (kvstore.server.x is server/x.py or its package;
    kvstore.x is kvstore/x), or a name that the longest such module defines or imports."""
    parts = dotted.split(".")[1:]
    for n in range(len(parts), -1, -1):
        head, rest = parts[:n], parts[n:]
        base = ROOT / head[0] if head and head[0] in PACKAGES[1:] else ROOT / "kvstore"
        path = base.joinpath(*(head[1:] if head and head[0] in PACKAGES[1:] else head))
        source = path.with_suffix(".py") if n and path.with_suffix(".py").exists() else path / "__init__.py"
        if not source.exists():
            continue
        if not rest:
            return True
        text = source.read_text()
        return _defines(text, rest[0]) or re.search(rf"\b{rest[0]}\b", text) is not None  # defined, or imported
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_a_doc_gives_is_defined_where_it_says(doc):
    text, classes, wrong = doc.read_text(), _classes(), set()
    for match in PATH.finditer(text):
        path, name = match.group(1), (match.group(2) or "").strip()
        ident = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?", name)
        if path.endswith(".py") and ident and (ROOT / path).exists():
            source = (ROOT / path).read_text()
            if not all(_defines(source, part) for part in ident.groups() if part):
                wrong.add(f"{path}: {ident.group(0)}")
    for cls, attr in METHOD.findall(text):
        if cls in classes and not _has(classes, cls, attr):
            wrong.add(f"{cls}.{attr}")
    wrong |= {m for m in MODULE.findall(text) if not _module_exists(m)}
    assert not wrong, f"{doc.relative_to(ROOT)} names what the code does not define: {sorted(wrong)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc):
    missing = sorted({p for p in _named_paths(doc.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = sorted({t for t in LINK.findall(doc.read_text())
                     if "://" not in t and not t.startswith("mailto:") and not (doc.parent / t).exists()})
    assert not broken, f"{doc.relative_to(ROOT)} links to files that do not exist: {broken}"


def test_the_checks_read_the_docs():
    named = [p for doc in DOCS for p in _named_paths(doc.read_text())]
    assert len(DOCS) >= 5 and len(named) > 50, (len(DOCS), len(named))


@pytest.mark.skipif(FILES is None, reason="needs a git checkout")
def test_no_file_cites_the_design_outside_the_repository():
    files = [ROOT / name for name in FILES if name not in FROZEN and (ROOT / name).is_file()]
    citing = sorted(str(f.relative_to(ROOT)) for f in files if OUTSIDE_DESIGN.search(f.read_bytes()))
    assert len(files) > 100, len(files)
    assert not citing, f"these cite a design document that is not in the repository: {citing}"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_an_ignored_folder_on_disk_is_not_a_repository_path(tmp_path):
    """Issue 41 item 17: with an ignored build/ folder on disk the doc checks took build/...
    paths the docs name (made by scripts) for repository paths, and failed."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("build/\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("`build/docker/context`\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "out.txt").write_text("made by a script")
    subprocess.run(["git", "-C", str(tmp_path), "add", ".gitignore"], check=True)
    assert top_level_names(tmp_path) == {".gitignore", "docs"}


# Where the docs list the light core's dependencies: the text after "only", up to the end of the list.
CORE_LISTS = {"docs/commands.md": r"It brings only (.*?), so it installs", "docs/engines.md": r"only (msgpack.*?)\."}


@pytest.mark.parametrize("doc", sorted(CORE_LISTS))
def test_the_light_core_a_doc_lists_is_the_packages_dependencies(doc):
    """Issue 41 item 17: docs/commands.md listed the light core without pyzmq."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        wanted = {re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower() for dep in tomllib.load(f)["project"]["dependencies"]}
    text = " ".join((ROOT / doc).read_text().split())
    listed = re.search(CORE_LISTS[doc], text)
    assert listed, f"{doc}: no list of the light core's dependencies"
    named = {name.lower() for name in re.findall(r"[A-Za-z][A-Za-z0-9_.-]*", re.sub(r"\(.*?\)", "", listed.group(1)))
             if name != "and"}
    assert named == wanted, f"{doc} lists {sorted(named)}, pyproject.toml's dependencies are {sorted(wanted)}"
