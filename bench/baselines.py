"""Baseline servers a bench suite starts on 127.0.0.1 for its same-run comparisons: Redis,
etcd, the Mooncake master (and a Mooncake store client). One that cannot run here raises
`BaselineUnavailable` saying what to install; the suite prints that on a skip line.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from typing import Iterator

from bench.common import BaselineUnavailable

# Baseline servers get this long to answer before the suite gives up on them.
SERVER_START_TIMEOUT_S = 20.0


_ports_given: set[int] = set()  # never the same port twice in one process


def free_port() -> int:
    """A TCP port on 127.0.0.1, free now, for a process that starts listening on it later.
    Taken below the kernel's ephemeral range: a port the kernel hands out (bind to 0) can be
    taken in between as the local port of an outgoing connection (a daemon dialling a peer
    that is not up yet, or retrying an absent server, makes one every half second), which
    fails the later listen with "Address already in use"."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _ports_given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        return port
    with socket.socket() as s:  # nothing free below the range: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, name: str, log_path: str) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BaselineUnavailable(f"{name} exited with code {proc.returncode} at start (log: {log_path})")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise BaselineUnavailable(f"{name} did not listen on 127.0.0.1:{port} within {SERVER_START_TIMEOUT_S:g} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _serving(name: str, argv: list[str], workdir: str, ports: list[int]):
    """Run `argv` (its output in <workdir>/<name>.log) until the block ends; ready once each
    of `ports` accepts a connection."""
    log_path = os.path.join(workdir, f"{name}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        for port in ports:
            _wait_for_port(port, proc, name, log_path)
        yield
    finally:
        _stop(proc)


@contextlib.contextmanager
def redis_server(workdir: str) -> Iterator[int]:
    """A throwaway Redis on 127.0.0.1 (no persistence); yields its port."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise BaselineUnavailable("redis-server is not installed (apt-get install -y redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        raise BaselineUnavailable("redis-py is missing (pip install redis)") from None
    port = free_port()
    with _serving("redis-server", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", workdir], workdir, [port]):
        yield port


@contextlib.contextmanager
def etcd_server(workdir: str) -> Iterator[str]:
    """A throwaway single-member etcd on 127.0.0.1; yields its client URL."""
    exe = shutil.which("etcd")
    if exe is None:
        raise BaselineUnavailable("etcd is not installed (apt-get install -y etcd-server)")
    client, peer = free_port(), free_port()
    c_url, p_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    with _serving("etcd", [exe, "--name", "bench", "--data-dir", os.path.join(workdir, "etcd"),
                           "--listen-client-urls", c_url, "--advertise-client-urls", c_url, "--listen-peer-urls",
                           p_url, "--initial-advertise-peer-urls", p_url, "--initial-cluster", f"bench={p_url}",
                           "--log-level", "warn"], workdir, [client]):
        yield c_url


@contextlib.contextmanager
def mooncake_master(workdir: str) -> Iterator[tuple[int, int]]:
    """A Mooncake master with its HTTP metadata server; yields (rpc_port, metadata_port).

    Its metadata port listens on every interface whatever the host flag says.
    """
    exe = shutil.which("mooncake_master", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        raise BaselineUnavailable("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
    rpc_port, meta_port = free_port(), free_port()
    # its metrics server too on a port of its own (its default, 9003, is one port per machine)
    with _serving("mooncake_master", [exe, "--rpc_address=127.0.0.1", f"--rpc_port={rpc_port}",
                                      "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                                      f"--http_metadata_server_port={meta_port}", "--metrics_host=127.0.0.1",
                                      f"--metrics_port={free_port()}"], workdir, [rpc_port, meta_port]):
        yield rpc_port, meta_port


def native_log_to(log_path: str) -> None:
    """Send this process's stderr (where Mooncake's native code logs) to `log_path`, for good."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def mooncake_store(rpc_port: int, meta_port: int, segment_bytes: int, buffer_bytes: int, log_path: str):
    """A set-up `MooncakeDistributedStore` over TCP. Its native log goes to `log_path`
    (this process's stderr is redirected there for good)."""
    native_log_to(log_path)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise BaselineUnavailable(f"mooncake does not import: {exc}") from None
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", f"http://127.0.0.1:{meta_port}/metadata", segment_bytes, buffer_bytes,
                     "tcp", "", f"127.0.0.1:{rpc_port}")
    if rc != 0:
        raise BaselineUnavailable(f"MooncakeDistributedStore.setup returned {rc} (log: {log_path})")
    return store
