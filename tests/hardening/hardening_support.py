"""Shared by the hardening tests (holds no tests): objects whose bytes follow from their id,
daemon processes with a raw TOML config, and the checks every hardening test ends with.

Any process can regenerate an object's bytes from its id, so client processes, killed or
not, and the test itself agree on what every object must contain.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile

import numpy as np

from kvstore.identity import ObjectId
from kvs_testing import wait_for

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# Client processes import this module and the project.
# Child processes (workers.py) import this module, and with it tests/kvs_testing.py.
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, HERE, os.path.dirname(HERE)])}
TOKEN = "vault-token-0123456789abcdef"  # a namespace token for tests (>= 16 characters)
# Examples per fuzz property; raise it for a release run (KVSTORE_FUZZ_EXAMPLES=20000).
FUZZ_EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "250"))


def key(tag: str, i: int) -> ObjectId:
    return ObjectId(hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=32).digest())


def size_of(k: ObjectId, lo: int = 4096, hi: int = 256 * 1024) -> int:
    return lo + int.from_bytes(k.digest[:4], "little") % (hi - lo)


def content(k: ObjectId, size: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(k.digest[:16], "little")).integers(0, 256, size, dtype=np.uint8)


def read_state(client, k: ObjectId, size: int, namespace: str | None = None) -> str:
    """"ok" (bit-exact), "missing" (a clean miss) or "WRONG" (bytes that differ)."""
    out = np.empty(size + 1, np.uint8)
    got = client.get_into(k, out, namespace=namespace)
    if got is None:
        return "missing"
    return "ok" if got == size and np.array_equal(out[:size], content(k, size)) else "WRONG"


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def nvme(**overrides) -> dict:
    return {"enabled": True, "capacity_bytes": "128MiB", "file_bytes": "32MiB", **overrides}


def _toml(config: dict) -> str:
    """{key: scalar, table: {key: scalar}} as TOML (JSON scalars and lists are TOML too)."""
    top = [f"{k} = {json.dumps(v)}" for k, v in config.items() if not isinstance(v, dict)]
    tables = []
    for name, table in config.items():
        if isinstance(table, dict):
            tables += [f"[{name}]"] + [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    return "\n".join(top + tables) + "\n"


class DaemonProc:
    """A `kvstore serve` process in its own temporary directory; `extra_toml` is appended
    to the config as is (for nested tables such as [auth.namespaces.<name>])."""

    def __init__(self, config: dict | None = None, extra_toml: str = "", arena_bytes: str = "16MiB"):
        self.root = tempfile.mkdtemp(prefix="kvh-")
        self.socket = os.path.join(self.root, "kvstore.sock")
        self.data_dir = os.path.join(self.root, "data")
        self.config_path = os.path.join(self.root, "kvstore.toml")
        self.arena_bytes = arena_bytes
        config = dict(config or {})
        config["data_dir"] = self.data_dir
        config["admin"] = {"port": 0, **config.get("admin", {})}
        with open(self.config_path, "w") as f:
            f.write(_toml(config) + extra_toml)
        os.chmod(self.config_path, 0o600)
        self.proc = None

    def start(self) -> DaemonProc:
        from kvstore.commands.smoke import start_daemon
        self.proc = start_daemon(self.socket, self.arena_bytes, extra=["--config", self.config_path])
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, **kwargs):
        from kvstore.client import Client
        return Client.connect(self.socket, **kwargs)

    def admin(self):
        """The admin API with the operator token (sees every namespace)."""
        from kvstore.server.admin.client import AdminClient
        return AdminClient.from_data_dir(self.data_dir)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.alive():
            self.proc.send_signal(sig)
            self.proc.wait(timeout)
        return None if self.proc is None else self.proc.returncode

    def cleanup(self) -> None:
        try:
            self.stop(signal.SIGKILL)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def assert_clean(daemon: DaemonProc, client, expect_clients: int = 1) -> dict:
    """What every hardening test ends with: no lease left on the node, every allocator,
    index and policy consistent (check_integrity raises otherwise), and only `client`'s
    connections left. Node-wide numbers come from the admin API (an operator's view)."""
    api = daemon.admin()
    assert wait_for(lambda: api.get("/v1/stats")["leases"] == 0, timeout=20), f"leases left: {api.get('/v1/stats')['leases']}"
    client.check_integrity()
    stats = api.get("/v1/stats")
    assert stats["clients"] == expect_clients, stats["clients"]
    assert daemon.alive()
    return stats
