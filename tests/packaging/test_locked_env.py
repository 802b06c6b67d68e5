"""The running environment is the one its lock describes (scripts/lock.sh, locks/).

In the main run this checks .venv against locks/main-constraints.txt; scripts/test_engines.sh
runs it again inside each engine's environment with KVSTORE_LOCK=locks/<engine>.txt. Two checks:
every locked package that is installed has the locked version (an engine lock must also be
complete: every locked package installed), and no file is installed by two distributions.
The second is how cuda-python 12.6.2.post1 broke vLLM environments beside cuda-bindings 13: it
ships its own cuda/bindings/*, which shadowed cuda-bindings' and failed flashinfer's imports.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sysconfig
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = Path(os.environ.get("KVSTORE_LOCK", ROOT / "locks" / "main-constraints.txt"))
# Files that several distributions legitimately install (namespace packages' markers).
SHARED_OK = re.compile(r"(^|/)__init__\.py$|(^|/)__pycache__/|\.dist-info/|^\.\./|^bin/")
# Known overlaps, each checked to be harmless: flashinfer-python and torch-c-dlpack-ext both
# ship their own build helper as a top-level module; nothing imports it at run time.
KNOWN_OVERLAPS = {"build_backend.py": {"flashinfer-python", "torch-c-dlpack-ext"}}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(text: str) -> dict[str, str]:
    return {canonical(m.group(1)): m.group(2)
            for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", text, re.MULTILINE)}


def installed() -> list[importlib.metadata.Distribution]:
    """What the environment installed: its site-packages only. Other sys.path entries may hold
    vendored copies (setuptools puts setuptools/_vendor, with its own packaging, on sys.path)."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return list(importlib.metadata.distributions(path=paths))


def installed_versions() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in installed()}


def test_locked_versions_parse_a_hashed_lock():
    text = "a-b==1.0 \\\n    --hash=sha256:00\n    # via x\nC_d==2.3+cpu\n# e==9\n"
    assert locked_versions(text) == {"a-b": "1.0", "c-d": "2.3+cpu"}


def test_installed_versions_are_the_locked_ones():
    locked = locked_versions(LOCK.read_text())
    assert locked, f"{LOCK} locks nothing"
    installed = installed_versions()
    wrong = {name: (installed[name], version) for name, version in locked.items()
             if name in installed and installed[name].split("+")[0] != version.split("+")[0]}
    assert not wrong, f"installed (found, locked) differ from {LOCK.name}: {wrong}; run scripts/setup.sh or engine_env.sh"
    if LOCK.name != "main-constraints.txt":  # an engine environment is exactly its lock
        missing = sorted(set(locked) - set(installed))
        assert not missing, f"locked in {LOCK.name} but not installed: {missing}"


def test_no_file_is_installed_by_two_distributions():
    owners = defaultdict(set)
    for dist in installed():
        for file in dist.files or ():
            path = str(file)
            if not SHARED_OK.search(path):
                owners[path].add(canonical(dist.metadata["Name"]))
    shadowed = {path: sorted(names) for path, names in owners.items()
                if len(names) > 1 and not names <= KNOWN_OVERLAPS.get(path, set())}
    assert not shadowed, f"files installed by more than one distribution: {dict(list(shadowed.items())[:10])}"
