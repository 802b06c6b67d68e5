"""Driving cluster test nodes: start them in their namespaces, send commands, read replies."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest
from cluster_node import digest, make_object
from netns import NetnsCluster, unavailable_reason

from kvstore.ownership import home_nodes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NODE_SCRIPT = os.path.join(ROOT, "tests", "cluster", "cluster_node.py")
SECRET = "cluster-test-secret-0001"
PORT = 7471
REPLY_TIMEOUT_S = 15.0


class Node:
    def __init__(self, name: str, proc: subprocess.Popen):
        self.name, self.proc = name, proc

    def ready(self) -> str:
        return self._read()["ready"]

    def cmd(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise AssertionError(f"node {self.name}: {reply['error']}")
        return reply

    def _read(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        if not ready:
            raise AssertionError(f"node {self.name} did not answer within {REPLY_TIMEOUT_S} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"node {self.name} exited with {self.proc.wait()}")
        return json.loads(line)


def start_cluster(names: list[str], workdir: str, etcd_url: str | None = None, timeout_s: float = 1.0,
                  ttl_s: float = 2.0, start_etcd=None):
    """Build the namespaces and start one node per name; returns (NetnsCluster, {name: Node})."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    net = NetnsCluster(names).build()
    try:
        if start_etcd is not None:
            etcd_url = start_etcd(net)
        nodes = {}
        for name in names:
            argv = [sys.executable, NODE_SCRIPT, "--node-id", name, "--listen", f"{net.addresses[name]}:{PORT}",
                    "--secret", SECRET, "--timeout-s", str(timeout_s), "--ttl-s", str(ttl_s)]
            if etcd_url:
                argv += ["--etcd", etcd_url]
            else:
                argv += [f"--peer={n}={net.addresses[n]}:{PORT}" for n in names]
            log = open(os.path.join(workdir, f"node-{name}.log"), "w")
            proc = net.popen(name, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
            nodes[name] = Node(name, proc)
        for node in nodes.values():
            node.ready()
        return net, nodes
    except BaseException:
        net.close()
        raise


def seeds_by_home(names: list[str], namespace: str, size: int, per_node: int, replicas: int = 1) -> dict:
    """{first home: [seeds]} with `per_node` objects homed on each node."""
    out: dict[str, list[int]] = {n: [] for n in names}
    seed = 0
    while min(len(v) for v in out.values()) < per_node:
        home = home_nodes(make_object(namespace, seed, size)[0], names, replicas)[0]
        if len(out[home]) < per_node:
            out[home].append(seed)
        seed += 1
    return out


def expected_digest(namespace: str, seed: int, size: int) -> str:
    return digest(make_object(namespace, seed, size)[2])


def wait_until(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic() - start


_HEALTH = "import urllib.request,sys; print(urllib.request.urlopen(sys.argv[1] + '/health', timeout=1).read().decode())"


def etcd_in_hub(workdir: str):
    """A `start_etcd` for start_cluster: etcd on the hub's bridge address; returns its URL."""
    import shutil

    exe = shutil.which("etcd")
    if exe is None:
        pytest.skip("the etcd binary is missing (Debian: apt-get install -y etcd-server)")

    def start(net) -> str:
        from netns import HUB_ADDRESS
        url, peer = f"http://{HUB_ADDRESS}:2379", f"http://{HUB_ADDRESS}:2380"
        log = open(os.path.join(workdir, "etcd.log"), "w")
        net.popen(None, [exe, "--name", "t", "--data-dir", os.path.join(workdir, "etcd"), "--listen-client-urls", url,
                         "--advertise-client-urls", url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
                         peer, "--initial-cluster", f"t={peer}", "--log-level", "warn"], stdout=log, stderr=log)

        def healthy() -> bool:
            out = subprocess.run(["ip", "netns", "exec", net.hub, sys.executable, "-c", _HEALTH, url],
                                 capture_output=True, text=True)
            return '"health":"true"' in out.stdout

        wait_until(healthy, 20.0, "etcd healthy")
        return url

    return start
