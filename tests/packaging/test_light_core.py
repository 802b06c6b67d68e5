"""The light core: `pip install kvstore` (no extras) brings no torch, triton, gguf or
matplotlib, and its daemon and client still work (issue 12, packaging).

A fresh venv (no system site-packages) gets `pip install <checkout>` and nothing else;
then its own `kvstore serve` starts, and its own python does a client round trip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import venv

import pytest
from kvs_testing import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ("torch", "triton", "gguf", "matplotlib", "transformers")

ROUND_TRIP = r"""
import sys, numpy as np
from kvstore.client import Client
from kvstore.identity import ObjectId
with Client.connect(sys.argv[1]) as c:
    data = np.arange(1 << 16, dtype=np.uint8)
    key = ObjectId(bytes(range(32)))
    c.put(key, data)
    out = np.empty_like(data)
    assert c.get_into(key, out) == data.size and np.array_equal(out, data)
    with c.get(key) as lease:
        assert bytes(lease.buffer) == data.tobytes()
    assert c.lookup([key]).hits == 1
print("round trip ok")
"""


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory):
    where = tmp_path_factory.mktemp("core") / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(where)
    py = str(where / "bin" / "python")
    # from a copy of the sources: setuptools builds in the tree and reuses a build/lib left
    # there, which in a working checkout may hold packages an earlier layout had
    src = tmp_path_factory.mktemp("core") / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".*", "build", "__pycache__", "*.egg-info", "results", "kvstore-demo", "wheels"))
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)],
                   check=True, cwd=str(where), stdout=subprocess.DEVNULL)
    return where


def test_the_core_installs_without_torch_or_the_engine_extras(core_venv):
    py = str(core_venv / "bin" / "python")
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True, cwd=str(core_venv)).stdout.lower()
    installed = {line.split("==")[0] for line in listed.splitlines()}
    assert "kvstore" in installed
    assert not installed & set(HEAVY), f"the core pulled in {sorted(installed & set(HEAVY))}"


def test_the_wheel_installs_one_top_level_name(core_venv):
    """Everything kvstore installs lives under `kvstore` (its top_level.txt and every file its
    RECORD lists, but for its metadata and the `kvstore` script): an engine's environment gets
    no `server`, `client`, `gpu` or `adapters` package to collide with its own."""
    site = next(core_venv.glob("lib/python*/site-packages"))
    info = next(site.glob("kvstore-*.dist-info"))
    assert (info / "top_level.txt").read_text().split() == ["kvstore"]
    files = [line.split(",")[0] for line in (info / "RECORD").read_text().splitlines() if line]
    tops = {f.split("/")[0] for f in files if not f.startswith(("../", info.name))}
    assert tops == {"kvstore"}, tops
    for sub in ("server", "client", "tiers", "gpu", "adapters", "commands"):
        assert any(f.startswith(f"kvstore/{sub}/") and f.endswith(".py") for f in files), sub
        assert not (site / sub).exists(), f"{sub} installed at the top level"


def test_the_core_daemon_and_client_round_trip_without_torch(core_venv, tmp_path):
    py, kvstore_cli = str(core_venv / "bin" / "python"), str(core_venv / "bin" / "kvstore")
    sock = str(tmp_path / "s.sock")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    daemon = subprocess.Popen([kvstore_cli, "serve", "--socket", sock, "--arena-bytes", "16MiB",
                               "--data-dir", str(tmp_path / "data"), "--admin-port", "0"],
                              cwd=str(tmp_path), env=env, stdin=subprocess.DEVNULL)
    try:
        # not a timing claim: only "it started at all"
        wait_until(lambda: os.path.exists(sock) or daemon.poll() is not None, 60, "the core daemon did not start")
        assert daemon.poll() is None, f"the core daemon exited with {daemon.returncode}"
        done = subprocess.run([py, "-c", ROUND_TRIP, sock], capture_output=True, text=True, cwd=str(tmp_path),
                              env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "round trip ok" in done.stdout
        probe = subprocess.run([py, "-c", "import torch"], capture_output=True, cwd=str(tmp_path), env=env)
        assert probe.returncode != 0, "torch is importable in the core venv: the test proves nothing"
    finally:
        daemon.terminate()
        daemon.wait(30)
