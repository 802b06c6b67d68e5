"""gpu/ and tiers/gpu.py import without triton (kernels load lazily) and point the right way:
tiers/gpu.py uses the shared extent allocator (with tiers/initial_extents.py, its own part)
and no other tier."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
sys.modules["triton"] = None  # any 'import triton' now raises ImportError
import kvstore.gpu, kvstore.gpu.formats, kvstore.gpu.paged, kvstore.gpu.sparse, kvstore.gpu.delta_rule, kvstore.tiers.gpu
bad = sorted(m for m in sys.modules if m == "kvstore.server" or m.startswith("kvstore.server."))
bad += sorted(m for m in sys.modules if m.startswith("kvstore.tiers.") and m not in (
    "kvstore.tiers.gpu", "kvstore.tiers.allocator", "kvstore.tiers.initial_extents"))  # the allocator's own
print(",".join(bad))
"""


def test_reference_modules_need_no_triton_and_no_server_or_other_tiers():
    done = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_gpu_package_imports_only_kvstore_and_client_from_the_project():
    for path in (ROOT / "gpu").glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "from"):
                top = ".".join(words[1].split(".")[:2])
                assert top not in ("kvstore.server", "kvstore.tiers", "bench"), f"{path.name}: {line.strip()}"
