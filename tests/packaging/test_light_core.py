"""The light core: `pip install kvstore` (no extras) brings no torch, triton, gguf or
matplotlib, and its daemon and client still work (issue 12, packaging).

A fresh venv (no system site-packages) gets `pip install <checkout>` and nothing else;
then its own `kvstore serve` starts, and its own python does a client round trip.
"""

from __future__ import annotations

import os
import subprocess
import venv

import pytest
from kvs_testing import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ("torch", "triton", "gguf", "matplotlib", "transformers")

ROUND_TRIP = r"""
import sys, numpy as np
from client import Client
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
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", ROOT],
                   check=True, cwd=str(where), stdout=subprocess.DEVNULL)
    return where


def test_the_core_installs_without_torch_or_the_engine_extras(core_venv):
    py = str(core_venv / "bin" / "python")
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True, cwd=str(core_venv)).stdout.lower()
    installed = {line.split("==")[0] for line in listed.splitlines()}
    assert "kvstore" in installed
    assert not installed & set(HEAVY), f"the core pulled in {sorted(installed & set(HEAVY))}"


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
