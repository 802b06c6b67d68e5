"""Network namespaces for cluster tests: one per node, joined by a bridge in a hub namespace.

Every interface and address lives inside these namespaces (the root namespace gains only
the namespace names), in the private range 10.77.0.0/24: node i gets 10.77.0.(i+1), the hub
10.77.0.254 (etcd listens there). `close()` kills the processes started here and removes
every namespace, also after a failure; namespaces left by a test run that was itself killed
are removed by the next run (their names carry the dead run's pid).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

SUBNET = "10.77.0"
HUB_ADDRESS = f"{SUBNET}.254"
PREFIX = "kvst-"


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "cluster tests need root (ip netns add, veth, bridge)"
    if shutil.which("ip") is None:
        return "the ip command is missing (Debian: apt-get install -y iproute2)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if out.returncode != 0:
        return f"ip netns add fails here: {out.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Delete kvst-<pid>-* namespaces whose test run (pid) is gone."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        parts = name.split("-")
        if name.startswith(PREFIX) and len(parts) >= 3 and parts[1].isdigit() and not pid_alive(int(parts[1])):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:  # daemons of that dead run, still in its namespace
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


class NetnsCluster:
    def __init__(self, nodes: list[str]):
        tag = os.getpid()
        self.hub = f"{PREFIX}{tag}-hub"
        self.names = {node: f"{PREFIX}{tag}-{node}" for node in nodes}
        self.addresses = {node: f"{SUBNET}.{i + 1}" for i, node in enumerate(nodes)}
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def build(self) -> NetnsCluster:
        remove_stale()
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

    @contextlib.contextmanager
    def cut_off(self, node: str):
        """The node's link down for the block, back up after it (also on failure)."""
        self.set_link(node, up=False)
        try:
            yield
        finally:
            self.set_link(node, up=True)

    def popen(self, node: str | None, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start argv inside the node's namespace (None: the hub). `ip netns exec` execs, so
        the returned process is argv itself: signals reach it directly."""
        ns = self.hub if node is None else self.names[node]
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
