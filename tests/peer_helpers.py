"""Shared pieces of the peer tests: objects, a service on loopback, a remote tier bound to it."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import xxhash

from kvstore.identity import ObjectId, StateDescriptor
from bench.peer_service import InMemoryBackend
from kvstore.server.peer.service import PeerService
from kvstore.server.peer.client import connect_peer
from kvstore.server.peer.transports import make_transport
from kvstore.peer_messages import RemoteMeta
from kvs_testing import free_port  # noqa: F401 (peer tests import it from here)
from kvstore.tiers.remote import RemoteTier

SECRET = b"test-secret-0123456789"
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.ucx)]


def transport_or_skip(name: str):
    try:
        return make_transport(name)
    except ImportError as exc:
        pytest.skip(f"ucxx does not load here ({exc}); pip install ucxx-cu12")


def make_object(size: int, seed: int = 0, namespace: str = "ns"):
    data = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
    oid = ObjectId(hashlib.blake2b(f"{namespace}/{seed}/{size}".encode(), digest_size=32).digest())
    meta = RemoteMeta(size, xxhash.xxh3_128_digest(data), StateDescriptor(namespace, "m", "r1"))
    return oid, meta, data


@contextlib.asynccontextmanager
async def services(transport, names=("b",), backends=None, timeout_s=1.0):
    """Peer services on 127.0.0.1 named `names`; yields {name: (service, address)}."""
    started = {}
    try:
        for i, name in enumerate(names):
            backend = backends[i] if backends else InMemoryBackend()
            service = PeerService(backend, transport, SECRET, name, timeout_s)
            started[name] = (service, await service.start("127.0.0.1:0"))
        yield started
    finally:
        for service, _ in started.values():
            await service.stop()


def remote_tier(transport, members: dict, node_id="a", secret=SECRET, replicas=1, timeout_s=1.0) -> RemoteTier:
    """A tier for a node that is not itself a member (a pure client): every home is remote."""
    return RemoteTier(node_id, lambda: dict(members),
                      lambda address: connect_peer(transport, address, secret, node_id, timeout_s),
                      replicas=replicas, timeout_s=timeout_s)


_loop: asyncio.AbstractEventLoop | None = None


def run(coro, timeout_s: float = 30.0):
    """Run a scenario on the one loop these tests share (ucxx ties its progress tasks to a
    loop; one loop per process, as in the daemon, keeps them from piling up)."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        atexit.register(_close_loop)

    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coro
    return _loop.run_until_complete(bounded())


def _close_loop() -> None:
    pending = asyncio.all_tasks(_loop)
    for task in pending:
        task.cancel()
    async def drain():  # gather inside the loop: outside, it would bind another loop
        await asyncio.gather(*pending, return_exceptions=True)
    _loop.run_until_complete(drain())
    _loop.close()


_HEALTH = "import urllib.request,sys; print(urllib.request.urlopen(sys.argv[1] + '/health', timeout=1).read().decode())"


def _etcd_healthy(url: str, netns: str | None) -> bool:
    cmd = [sys.executable, "-c", _HEALTH, url]
    out = subprocess.run((["ip", "netns", "exec", netns] if netns else []) + cmd, capture_output=True, text=True)
    return '"health":"true"' in out.stdout


@contextlib.contextmanager
def etcd_server(workdir: str, host: str = "127.0.0.1", netns: str | None = None):
    """A throwaway single-node etcd on free ports; yields its client URL. Skips without etcd."""
    exe = shutil.which("etcd")
    if exe is None:
        pytest.skip("the etcd binary is missing (Debian: apt-get install -y etcd-server)")
    client, peer = free_port(), free_port()
    c_url, p_url = f"http://{host}:{client}", f"http://{host}:{peer}"
    cmd = [exe, "--name", "t", "--data-dir", os.path.join(workdir, "etcd"), "--listen-client-urls", c_url,
           "--advertise-client-urls", c_url, "--listen-peer-urls", p_url, "--initial-advertise-peer-urls", p_url,
           "--initial-cluster", f"t={p_url}", "--log-level", "warn"]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    log = open(os.path.join(workdir, "etcd.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {proc.returncode}; see {log.name}")
            if _etcd_healthy(c_url, netns):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not become healthy in 20 s; see {log.name}")
            time.sleep(0.1)
        yield c_url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
