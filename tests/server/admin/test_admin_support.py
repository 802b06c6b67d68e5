"""Shared by the admin API tests: a real daemon process with its admin API on a free port.

Holds no tests itself; the test_admin_* modules import it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

from kvstore.client import Client
from kvstore import Hints, ObjectId, StateDescriptor
from kvstore.server.admin.client import AdminClient
from kvstore.commands.smoke import start_daemon

PAYLOAD = b"x" * 100


@dataclass
class AdminDaemon:
    proc: object
    socket_path: str
    data_dir: str
    api: AdminClient  # with the daemon's token

    def client(self, namespace: str = "default") -> Client:
        return Client.connect(self.socket_path, namespace=namespace)

    def anonymous(self, token: str | None = None) -> AdminClient:
        return AdminClient(self.api.url, token)


def _wait_for_addr(path: str, proc) -> str:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with code {proc.returncode}")
        try:
            with open(path) as f:
                url = f.read().strip()
            if url:
                return url
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{path} did not appear within 15 s")


@contextlib.contextmanager
def admin_daemon(data_dir, arena_bytes: str = "16MiB"):
    """A daemon serving a short socket path under /tmp, data in `data_dir`, admin on port 0."""
    data_dir = str(data_dir)
    sock_dir = tempfile.mkdtemp(prefix="kvs")
    socket_path = os.path.join(sock_dir, "s")
    try:
        proc = start_daemon(socket_path, arena_bytes, extra=["--data-dir", data_dir, "--admin-port", "0"])
    except BaseException:
        shutil.rmtree(sock_dir, ignore_errors=True)
        raise
    try:
        _wait_for_addr(os.path.join(data_dir, "admin.addr"), proc)
        yield AdminDaemon(proc, socket_path, data_dir, AdminClient.from_data_dir(data_dir))
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except Exception:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(sock_dir, ignore_errors=True)


def descriptor(namespace: str, model: str = "m", kind: str = "kv") -> StateDescriptor:
    return StateDescriptor(namespace, model, "r1", kind=kind)


def put_objects(client: Client, namespace: str, count: int, model: str = "m", kind: str = "kv",
                hints: Hints | None = None) -> list[ObjectId]:
    """Store `count` small objects under random ids; returns the ids."""
    ids = [ObjectId(os.urandom(32)) for _ in range(count)]
    results = client.put_many([(oid, PAYLOAD) for oid in ids], descriptor(namespace, model, kind), hints)
    errors = [r.error for r in results if r.error]
    assert not errors, errors[0]
    return ids
