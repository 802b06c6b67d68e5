"""Network namespaces for cluster tests: one per node, joined by a bridge in a hub namespace.

Every interface and address lives inside these namespaces (the root namespace gains only
the namespace names), in the private range 10.77.0.0/24: node i gets 10.77.0.(i+1), the hub
10.77.0.254 (etcd listens there). `close()` removes everything, also after a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "10.77.0"
HUB_ADDRESS = f"{SUBNET}.254"


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "cluster tests need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command is missing (Debian: apt-get install -y iproute2)"
    probe = f"kvst-probe-{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if out.returncode != 0:
        return f"ip netns add fails here: {out.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class NetnsCluster:
    def __init__(self, nodes: list[str]):
        tag = os.getpid()
        self.hub = f"kvst-{tag}-hub"
        self.names = {node: f"kvst-{tag}-{node}" for node in nodes}
        self.addresses = {node: f"{SUBNET}.{i + 1}" for i, node in enumerate(nodes)}
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def build(self) -> NetnsCluster:
        try:
            for ns in [self.hub, *self.names.values()]:
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for node, ns in self.names.items():
                port = f"v-{node}"
                _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.hub, "link", "set", port, "master", "br0")
                _ip("-n", self.hub, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{self.addresses[node]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def set_link(self, node: str, up: bool) -> None:
        """Cut a node off (its only interface down) or bring it back."""
        _ip("-n", self.names[node], "link", "set", "eth0", "up" if up else "down")

    def popen(self, node: str | None, argv: list[str], **kwargs) -> subprocess.Popen:
        ns = self.hub if node is None else self.names[node]
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
