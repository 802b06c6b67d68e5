"""The compose cluster (docker/docker-compose.yml) built offline and driven for real:
etcd, three kvstore nodes with two replicas, and an engine container that shares only node A's
socket volume (the sidecar pattern).

scripts/docker_cluster.sh builds the base image (debootstrap), the wheelhouse and the images,
and brings the cluster up; the checks run `docker exec` into the containers, piping
docker_probe.py into the image's python (the containers mount nothing of the repository).

Shown: a put from the engine container through node A reads back bit-exact through node C, and
the engine's reads are views into the arena memfd it received across the container boundary;
the admin API answers inside each container; a node container killed (`docker kill`) loses no
object (replicas = 2) and, started again, gets its share back (also when started again at
once, within its etcd lease); a node stopped cleanly
(`docker stop`: SIGTERM) hands over before it leaves; down leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys

import pytest
from docker_probe import NODES, REPLICAS, ids

from kvstore.ownership import home_nodes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster"))
from cluster_helpers import wait_until  # noqa: E402 (the network-namespace cluster's poll helper)

pytestmark = pytest.mark.docker

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(ROOT, "scripts", "docker_cluster.sh")
PROBE = os.path.join(HERE, "docker_probe.py")
PROJECT = "kvstoretest"
ENV = {**os.environ, "KVSTORE_COMPOSE_PROJECT": PROJECT}
BUILD_TIMEOUT_S = 1800  # a cold build (debootstrap, apt-get, images on vfs) takes minutes
CALL_TIMEOUT_S = 120
SIZE = 300_017
# etcd drops a killed node once its lease runs out (lease_ttl_s = 5 in docker/config); a
# generous bound for what follows: these wait, they do not time.
SETTLE_S = 60.0


def _run(args: list[str], timeout: float = CALL_TIMEOUT_S, check: bool = True, env: dict | None = None, **kwargs):
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env or ENV, **kwargs)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out


@functools.cache  # a skipped module fixture is set up again for each test: ask once
def unavailable_reason() -> str | None:
    """Why no Docker engine can run here, or None (starting dockerd as root if none answers)."""
    if shutil.which("docker") is None:
        return "no docker CLI (Debian: apt-get install -y docker.io)"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if os.geteuid() != 0:
            return "no Docker engine answers, and starting dockerd needs root"
        if shutil.which("dockerd") is None:
            return "no Docker engine answers and dockerd is missing (Debian: apt-get install -y docker.io)"
        started = subprocess.run([SCRIPT, "engine"], capture_output=True, text=True, env=ENV)
        if started.returncode != 0:
            return f"dockerd cannot run here: {started.stderr.strip().splitlines()[-1][-500:]}"
    compose_v2 = subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    if not compose_v2 and shutil.which("docker-compose") is None:
        return "neither `docker compose` nor docker-compose (Debian: apt-get install -y docker-compose)"
    base = subprocess.run(["docker", "image", "inspect", "kvstore-base:bookworm"], capture_output=True)
    if base.returncode != 0 and (os.geteuid() != 0 or shutil.which("debootstrap") is None):
        return "no kvstore-base:bookworm image, and making one needs root and debootstrap"
    return None


class Compose:
    """The running cluster: containers by service, probes and admin calls inside them.
    flags, env: what picks the compose file and project (`--mooncake`, its test project)."""

    def __init__(self, flags: tuple = (), env: dict | None = None):
        self.flags, self.env = list(flags), env or ENV
        self.project = self.env["KVSTORE_COMPOSE_PROJECT"]

    def script(self, *args: str, **kwargs):
        """scripts/docker_cluster.sh with this compose file's flags, for this project."""
        return _run([SCRIPT, *self.flags, *args], env=self.env, **kwargs)

    def labelled(self, *command: str, check: bool = True) -> list[str]:
        """The ids `docker <command> -q` lists of this project (containers, networks, volumes);
        [] when no engine answers and check is False."""
        out = _run(["docker", *command, "-q", "--filter", f"label=com.docker.compose.project={self.project}"],
                   check=check, env=self.env)
        return out.stdout.split() if out.returncode == 0 else []

    def save_logs(self, subdir: str) -> None:
        """Each of the project's containers' logs into build/docker/<subdir>/, for a post-mortem."""
        logdir = os.path.join(ROOT, "build", "docker", subdir)
        os.makedirs(logdir, exist_ok=True)
        for cid in self.labelled("ps", "-a", check=False):
            name = _run(["docker", "inspect", "-f", "{{.Name}}", cid], env=self.env).stdout.strip().lstrip("/")
            out = _run(["docker", "logs", "--timestamps", cid], check=False, env=self.env)
            with open(os.path.join(logdir, f"{name}.log"), "w") as f:
                f.write(out.stdout + out.stderr)

    def down_leaves_nothing(self, services: int) -> None:
        assert len(self.labelled("ps", "-a")) == services
        self.script("down")
        assert self.labelled("ps", "-a") == [] and self.labelled("network", "ls") == []
        assert self.labelled("volume", "ls") == []

    def container(self, service: str) -> str:
        cid = self.script("id", service).stdout.strip()
        if not cid:
            raise AssertionError(f"no container for service {service}")
        return cid

    def probe(self, service: str, *args) -> dict:
        with open(PROBE) as f:
            out = _run(["docker", "exec", "-i", self.container(service), "python3", "-", *map(str, args)], stdin=f,
                       env=self.env)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def admin(self, service: str, path: str) -> dict:
        """GET `path` on the node's admin API, from inside its container (127.0.0.1 there)."""
        code = ("import json, sys; from kvstore.server.admin.client import AdminClient; "
                "print(json.dumps(AdminClient.from_data_dir('/var/lib/kvstore').get(sys.argv[1])))")
        out = _run(["docker", "exec", self.container(service), "python3", "-c", code, path], env=self.env)
        return json.loads(out.stdout)

    def health(self, service: str) -> str:
        fmt = "{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}"
        return _run(["docker", "inspect", "-f", fmt, self.container(service)], env=self.env).stdout.strip()

    def logs(self, service: str) -> str:
        out = _run(["docker", "logs", self.container(service)], env=self.env)
        return out.stdout + out.stderr

    def sees_all(self) -> bool:
        return all(self.probe(node, "members")["members"] == NODES for node in NODES)

    def held_by_homes(self, namespace: str, tag: str, per_group: int, members=NODES) -> bool:
        """Every object is in the host tier of each of its homes among `members`."""
        keys = ids(tag, per_group)
        for node in members:
            tiers = self.probe(node, "tiers", namespace, tag, per_group)["tiers"]
            mine = [t for oid, t in zip(keys, tiers) if node in home_nodes(oid, list(members), REPLICAS)]
            if mine != ["host"] * len(mine):
                return False
        return True

    def check(self, service: str, namespace: str, tag: str, per_group: int) -> None:
        got = self.probe(service, "check", namespace, tag, per_group, SIZE)
        assert got == {"exact": len(ids(tag, per_group)), "missing": [], "wrong": []}, (service, got)


@contextlib.contextmanager
def running(compose: Compose):
    """`compose` up (built offline first if need be), down again after; skips where no
    engine can run containers."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    compose.script("down")  # what a killed run left
    try:
        up = compose.script("up", timeout=BUILD_TIMEOUT_S, check=False)
        if up.returncode != 0:
            reason = cannot_run_containers()
            if reason:
                pytest.skip(reason)
            raise AssertionError(f"{SCRIPT} {' '.join(compose.flags)} up exited {up.returncode}:\n"
                                 f"{up.stdout[-3000:]}{up.stderr[-3000:]}")
        yield compose
    finally:
        compose.script("down")


@pytest.fixture(scope="module")
def cluster():
    with running(Compose()) as compose:
        yield compose


def cannot_run_containers() -> str | None:
    """After a failed `up`: why the engine cannot run a container at all (a sandbox that lets
    dockerd start but not run anything), or None when it can and the failure is ours."""
    base = subprocess.run(["docker", "image", "inspect", "kvstore-base:bookworm"], capture_output=True)
    if base.returncode != 0:
        return None  # no base image: debootstrap or the import failed, which the log says
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", "kvstore-base:bookworm", "true"],
                         capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
    if out.returncode != 0:
        if "no space left on device" in out.stderr:  # a full disk is a failure to fix, not a skip
            raise AssertionError(f"the Docker engine's disk is full: {out.stderr.strip()[-500:]}")
        return f"the Docker engine here cannot run a container: {out.stderr.strip()[-500:]}"
    return None


@pytest.fixture(autouse=True)
def save_logs(request):
    """After each test, each container's log, kept for a post-mortem in build/docker/logs/
    (the last test takes the cluster down, so the module's end would find nothing)."""
    yield
    if "cluster" in request.fixturenames and shutil.which("docker") is not None:
        Compose().save_logs("logs")  # (nothing when no engine answers: the test skipped)


def test_put_from_the_engine_container_reads_bit_exact_on_node_c(cluster):
    wait_until(cluster.sees_all, SETTLE_S, "every node sees the three members")
    assert cluster.probe("engine", "put", "sidecar", "s", 2, SIZE) == {"put": 12}
    # Copies to the homes leave in the background (write_through): once they landed, C
    # reads its own share from its host tier and the rest from A and B.
    wait_until(lambda: cluster.held_by_homes("sidecar", "s", 2), SETTLE_S, "every object on both its homes")
    cluster.check("node-c", "sidecar", "s", 2)
    # Zero copy across the container boundary: the engine's leases are views into the arena
    # memfd node A's daemon passed over the shared socket (SCM_RIGHTS).
    zc = cluster.probe("engine", "zero_copy", "sidecar", "s", 2)
    assert zc["inside_arena"] == [True] * 12 and zc["mapping"].startswith("/memfd:kvstore-sidecar"), zc


def test_the_admin_api_answers_inside_each_container(cluster):
    for node in NODES:
        assert cluster.health(node) == "running/healthy"
        assert cluster.admin(node, "/readyz") == {"ready": True}
        doc = cluster.admin(node, "/v1/cluster")
        assert doc["self"] == node and doc["replicas"] == REPLICAS, doc
        assert [(m["node_id"], m["down"]) for m in doc["members"]] == [(n, False) for n in NODES], doc
        status = _run(["docker", "exec", cluster.container(node), "kvstore", "status", "--config",
                       "/etc/kvstore/kvstore.toml", "--json"])
        assert json.loads(status.stdout)["ready"] is True


def test_a_killed_node_loses_no_object_and_gets_its_share_back(cluster):
    assert cluster.probe("engine", "put", "kill", "k", 2, SIZE) == {"put": 12}
    wait_until(lambda: cluster.held_by_homes("kill", "k", 2), SETTLE_S, "every object on both its homes")
    _run(["docker", "kill", cluster.container("node-b")])
    assert cluster.health("node-b").startswith("exited")
    for node in ("node-a", "node-c"):  # reads of B's objects fail over to their other home
        cluster.check(node, "kill", "k", 2)
    for node in ("node-a", "node-c"):  # the list changes on both: re-homing to B waits for that
        wait_until(lambda node=node: cluster.probe(node, "members")["members"] == ["node-a", "node-c"], SETTLE_S,
                   f"{node} drops the killed B")
    wait_until(lambda: cluster.held_by_homes("kill", "k", 2, ["node-a", "node-c"]), SETTLE_S,
               "A and C hold everything")

    _run(["docker", "start", cluster.container("node-b")])
    wait_until(lambda: cluster.health("node-b") == "running/healthy", SETTLE_S, "B healthy again")
    wait_until(cluster.sees_all, SETTLE_S, "every node sees B again")
    # B restarted empty (host tier only); re-homing brings back what it is home to.
    wait_until(lambda: cluster.held_by_homes("kill", "k", 2), SETTLE_S, "B gets its share back")
    cluster.check("node-b", "kill", "k", 2)

    # Killed and started again at once, likely before its lease runs out: the member list
    # need not change, yet B comes back empty; its new registration tells the others.
    _run(["docker", "kill", cluster.container("node-b")])
    _run(["docker", "start", cluster.container("node-b")])
    wait_until(lambda: cluster.health("node-b") == "running/healthy", SETTLE_S, "B healthy again")
    wait_until(lambda: cluster.held_by_homes("kill", "k", 2), SETTLE_S, "B gets its share back again")
    cluster.check("node-b", "kill", "k", 2)


def test_a_clean_stop_hands_over_before_leaving(cluster):
    wait_until(cluster.sees_all, SETTLE_S, "every node sees the three members")
    assert cluster.probe("engine", "put", "stop", "t", 2, SIZE) == {"put": 12}
    wait_until(lambda: cluster.held_by_homes("stop", "t", 2), SETTLE_S, "every object on both its homes")
    _run(["docker", "stop", "--time", "30", cluster.container("node-b")])
    assert cluster.health("node-b").startswith("exited")
    logs = cluster.logs("node-b")
    done = [line for line in logs.splitlines() if "event=handover_done" in line]
    assert done and " sent=0 " not in done[-1], logs[-3000:]
    # B copied what A and C lacked to them before it left: both hold everything now.
    assert cluster.held_by_homes("stop", "t", 2, ["node-a", "node-c"])
    for node in ("node-a", "node-c"):
        cluster.check(node, "stop", "t", 2)
    _run(["docker", "start", cluster.container("node-b")])
    wait_until(lambda: cluster.health("node-b") == "running/healthy", SETTLE_S, "B healthy again")


def test_down_leaves_nothing_behind(cluster):
    cluster.down_leaves_nothing(services=5)
