"""Real daemons in network namespaces: `kvstore serve` per node, clients over the Unix sockets.

Each node's daemon (`python -m kvstore.commands.cli serve --config FILE`) runs inside that node's network
namespace and serves peers on its own address there. Clients stay in the test process: a Unix
socket is a filesystem object, so it reaches a daemon in any network namespace (and the arena
memfd crosses it by SCM_RIGHTS as usual). Only peer traffic and etcd use the namespaces' network.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from netns import HUB_ADDRESS, NetnsCluster, pid_alive, unavailable_reason

from kvstore.identity import ObjectId
from kvstore.ownership import home_nodes
from kvs_testing import payload, wait_until  # noqa: F401 (the cluster tests import them from here)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "cluster-test-secret-0001"
PORT = 7471
ARENA = "32MiB"
START_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 15.0  # a hung daemon call fails the test instead of hanging it


def _toml(config: dict) -> str:
    """{key: scalar, section: {key: scalar | [str]}} as TOML (JSON scalars and string lists are TOML)."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for name, table in config.items():
        if isinstance(table, dict):
            lines.append(f"[{name}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _remove_stale_dirs() -> None:
    """Socket and data directories left by a test run that was killed (its pid is gone)."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        parts = name.split("-")
        if name.startswith("kvc-") and len(parts) == 3 and parts[1].isdigit() and not pid_alive(int(parts[1])):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


class Daemon:
    """One node's `kvstore serve`, running in the node's network namespace."""

    def __init__(self, name: str, root: str, log_path: str):
        self.name, self.root, self.log_path = name, root, log_path
        self.socket = os.path.join(root, "kvstore.sock")
        self.proc: subprocess.Popen | None = None

    def client(self, namespace: str = "default", **kwargs):
        from kvstore.client import Client
        return Client.connect(self.socket, namespace=namespace, timeout_s=CLIENT_TIMEOUT_S, **kwargs)

    def cluster_stats(self) -> dict:
        """stats()["tiers"]["remote"]: members, remote-tier counters, num_replicated."""
        with self.client() as c:
            return c.stats()["tiers"]["remote"]

    def members(self) -> set:
        return set(self.cluster_stats()["members"])

    def counters(self) -> dict:
        return self.cluster_stats()["remote"]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


class Cluster:
    """Namespaces, an optional etcd in the hub, and one daemon per node."""

    def __init__(self, names: list[str], logdir: str, replicas: int = 1, etcd: bool = False,
                 lease_ttl_s: float = 2.0, peer_timeout_s: float = 1.0):
        self.names, self.logdir = names, logdir
        self.replicas, self.use_etcd = replicas, etcd
        self.lease_ttl_s, self.peer_timeout_s = lease_ttl_s, peer_timeout_s
        self.net = NetnsCluster(names)
        _remove_stale_dirs()
        self.tmp = tempfile.mkdtemp(prefix=f"kvc-{os.getpid()}-")  # short: sun_path is ~108 bytes
        self.daemons: dict[str, Daemon] = {}
        self.etcd_url: str | None = None

    def __getitem__(self, name: str) -> Daemon:
        return self.daemons[name]

    def start(self) -> Cluster:
        self.net.build()
        if self.use_etcd:
            self._start_etcd()
        peers = [f"{n}={self.net.addresses[n]}:{PORT}" for n in self.names]
        for name in self.names:
            root = os.path.join(self.tmp, name)
            os.makedirs(root)
            daemon = Daemon(name, root, os.path.join(self.logdir, f"daemon-{name}.log"))
            cluster = {"enabled": True, "node_id": name, "listen": f"{self.net.addresses[name]}:{PORT}",
                       "secret": SECRET, "peer_timeout_s": self.peer_timeout_s, "replicas": self.replicas}
            if self.use_etcd:
                cluster.update(membership="etcd", etcd_endpoint=self.etcd_url, lease_ttl_s=self.lease_ttl_s,
                               etcd_prefix=f"/kvstore-test-{os.getpid()}/members/")
            else:
                cluster.update(membership="static", peers=peers)
            config_path = os.path.join(root, "kvstore.toml")
            with open(config_path, "w") as f:
                f.write(_toml({"data_dir": os.path.join(root, "data"), "admin": {"port": 0}, "cluster": cluster}))
            log = open(daemon.log_path, "w")
            daemon.proc = self.net.popen(
                name, [sys.executable, "-m", "kvstore.commands.cli", "serve", "--config", config_path, "--socket",
                       daemon.socket, "--arena-bytes", ARENA, "--log-level", "info"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT,
                env={**os.environ, "PYTHONPATH": ROOT})
            log.close()
            self.daemons[name] = daemon
        for daemon in self.daemons.values():  # started in parallel, awaited in turn
            self._wait_ready(daemon)
        return self

    def _wait_ready(self, daemon: Daemon) -> None:
        from kvstore.client import DaemonUnavailable
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if daemon.proc.poll() is not None:
                raise AssertionError(f"daemon {daemon.name} exited with {daemon.proc.returncode}:\n"
                                     f"{daemon.log_tail()}")
            try:
                daemon.client().close()
                return
            except DaemonUnavailable:
                time.sleep(0.05)
        raise AssertionError(f"daemon {daemon.name} not ready within {START_TIMEOUT_S} s:\n{daemon.log_tail()}")

    def _start_etcd(self) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            pytest.fail("the etcd binary is missing (Debian: apt-get install -y etcd-server)")
        url, peer = f"http://{HUB_ADDRESS}:2379", f"http://{HUB_ADDRESS}:2380"
        log = open(os.path.join(self.logdir, "etcd.log"), "w")
        self.net.popen(None, [exe, "--name", "t", "--data-dir", os.path.join(self.tmp, "etcd"),
                              "--listen-client-urls", url, "--advertise-client-urls", url,
                              "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                              "--initial-cluster", f"t={peer}", "--log-level", "warn"],
                       stdout=log, stderr=log)
        log.close()
        probe = ("import urllib.request,sys\n"
                 "try: print(urllib.request.urlopen(sys.argv[1] + '/health', timeout=1).read().decode())\n"
                 "except OSError: pass")

        def healthy() -> bool:
            out = subprocess.run(["ip", "netns", "exec", self.net.hub, sys.executable, "-c", probe, url],
                                 capture_output=True, text=True)
            return '"health":"true"' in out.stdout

        wait_until(healthy, 20.0, "etcd healthy")
        self.etcd_url = url

    def close(self) -> None:
        try:
            self.net.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def start_cluster(names: list[str], logdir: str, **kwargs) -> Cluster:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = Cluster(names, logdir, **kwargs)
    try:
        return cluster.start()
    except BaseException:
        cluster.close()
        raise


# --- objects -------------------------------------------------------------------------

def key(tag: str, i: int) -> ObjectId:
    return ObjectId(hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest())


def keys_by_homes(tag: str, names: list[str], per_group: int, replicas: int = 1) -> dict[tuple, list[ObjectId]]:
    """{homes, best first: [ids]} with `per_group` ids for every ordered tuple of `replicas` nodes."""
    groups = {t: [] for t in itertools.permutations(names, replicas)}
    for i in itertools.count():
        oid = key(tag, i)
        homes = tuple(home_nodes(oid, names, replicas))
        if len(groups[homes]) < per_group:
            groups[homes].append(oid)
        if all(len(v) == per_group for v in groups.values()):
            return groups


def keys_by_home(tag: str, names: list[str], per_node: int) -> dict[str, list[ObjectId]]:
    """{home: [ids]}, `per_node` ids whose only home (one replica) is each node."""
    return {homes[0]: ids for homes, ids in keys_by_homes(tag, names, per_node).items()}


def read_exact(client, oid: ObjectId, size: int) -> bool | None:
    """None on a miss; otherwise whether the bytes read equal what was put."""
    out = np.empty(size, dtype=np.uint8)
    got = client.get_into(oid, out, verify=True)
    if got is None:
        return None
    return got == size and np.array_equal(out, payload(size, oid))
