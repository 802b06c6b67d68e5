"""The rendered manifests run for real on the local Docker engine, the next best thing to a
cluster (no kind or cluster image can be pulled here): the DaemonSet's pod (its init
containers, then the daemon) and the example engine pods, each container started with exactly
the user, groups, capabilities, environment, command and mounts the manifests give it
(pod_to_docker.py), the ConfigMaps and Secrets written as the kubelet writes them, the
hostPath directories shared through one directory standing in for the node.

Two things differ from the manifests, and only these: the sizes (the arena, NVMe and the
daemon's memory, set for this machine as a user sets them for theirs), and the engine pods'
image and process: the kvstore image (it holds the client) runs the client probe
(tests/docker/docker_probe.py) in place of vLLM and SGLang, which cannot run here.

Shown: the init steps hand the node directories and the Secret's token to the daemon; the
probes answer (the httpGet ones from outside, as the kubelet asks them, the exec one inside);
an engine pod puts through the socket in the node's /run/kvstore and another reads the
objects back bit-exact, as views into the arena memfd it received over that socket, its
mount read-only; without KVSTORE_DAEMON_UID the client refuses the daemon; the admin API
answers a router with the Secret's token and refuses one without; a rolling update (the pod
stopped, a new one started on the same node) keeps the objects, on NVMe.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import subprocess
import tempfile
import urllib.error
import urllib.request

import pytest
from kvs_testing import wait_until
from manifests import ENGINE_TREE, ENGINES, ROOT, container, daemon_container, daemon_set, find, one, pod_spec, render
from pod_to_docker import LABEL, Node, Pod, docker, pod_ip, probe, remove_all
from test_docker_cluster import SCRIPT, cannot_run_containers, unavailable_reason  # (one way to the image)

pytestmark = pytest.mark.docker

IMAGE = "kvstore:latest"  # what scripts/docker_cluster.sh build tags, and what the base names
PROBE = ROOT / "tests" / "docker" / "docker_probe.py"
BUILD_TIMEOUT_S = 1800
READY_S = 120.0  # a bound on waiting, not a timing: the daemon is ready in seconds
SIZE = 300_017
# This machine's sizes, in place of the manifests' (what a user changes for their nodes).
SIZES = {'arena_bytes = "32GiB"': 'arena_bytes = "256MiB"', 'capacity_bytes = "256GiB"': 'capacity_bytes = "64MiB"',
         'file_bytes = "1GiB"': 'file_bytes = "16MiB"'}
DAEMON_MEMORY = "1Gi"
# The engine pods' process while the probe runs in them: waits for SIGTERM (blocked first:
# PID 1 ignores signals it has no handler for), as compose's engine container.
WAIT_FOR_SIGTERM = ["python3", "-c", "import signal as s; t = {s.SIGTERM, s.SIGINT}; s.pthread_sigmask(s.SIG_BLOCK, t); s.sigwait(t)"]


def sized_for_this_machine(objects) -> list[dict]:
    """The rendered objects with the sizes of SIZES and DAEMON_MEMORY, nothing else changed."""
    objects = copy.deepcopy(list(objects))
    for cm in find(objects, "ConfigMap"):
        if cm["metadata"]["name"].startswith("kvstore-config"):
            for old, new in SIZES.items():
                assert cm["data"]["kvstore.toml"].count(old) == 1, old
                cm["data"]["kvstore.toml"] = cm["data"]["kvstore.toml"].replace(old, new)
    resources = daemon_container(objects)["resources"]
    resources["requests"]["memory"] = resources["limits"]["memory"] = DAEMON_MEMORY
    return objects


class Cluster:
    """One node: the daemon's pod and the engines' pods, on the local Docker engine."""

    def __init__(self, root: str):
        self.token = os.urandom(24).hex()
        self.node = Node(root, {"kvstore-admin-token": {"token": self.token.encode()}})
        self.daemon_objects = sized_for_this_machine(render("base"))
        self.engine_objects = render(ENGINE_TREE)
        self.daemon_spec = pod_spec(daemon_set(self.daemon_objects))
        self.daemon = daemon_container(self.daemon_objects)
        self.generation = 0
        self.cid = ""
        self.engines: dict[str, str] = {}

    def start_daemon(self) -> None:
        """A new daemon pod on the node (as a rolling update makes one): init steps, then the
        daemon, ready once its readiness probe passes."""
        self.generation += 1
        pod = Pod(self.node, self.daemon_objects, self.daemon_spec, f"kvstore-{self.generation}")
        pod.run_init_containers(IMAGE)
        self.cid = pod.start("kvstore", IMAGE)
        wait_until(lambda: self.running() and probe(self.cid, self.daemon, "readinessProbe")[0], READY_S,
                   "the daemon pod's readiness probe passes")

    def running(self) -> bool:
        state = docker("inspect", "-f", "{{.State.Running}}", self.cid).stdout.strip()
        if state != "true":
            raise AssertionError(f"the daemon exited:\n{docker('logs', self.cid, check=False).stderr[-3000:]}")
        return True

    def start_engines(self) -> None:
        """The engine pods (their user, groups, env and mounts), each waiting for the client
        probe to be run in it, as compose's engine container does (docker/docker-compose.yml)."""
        for name in ENGINES:
            spec = pod_spec(one(self.engine_objects, "Deployment", name))
            self.engines[name] = Pod(self.node, self.engine_objects, spec, name).start(name, IMAGE, WAIT_FOR_SIGTERM)

    def engine(self, name: str, *args, unset: tuple = ()) -> dict:
        """The client probe run in engine pod `name` (as its user, with its environment less
        `unset`): its JSON answer, or {"error": its last line of stderr}."""
        command = ["env", *[f"--unset={var}" for var in unset], "python3", "-", *map(str, args)]
        out = docker("exec", "-i", self.engines[name], *command, input=PROBE.read_text(), check=False)
        if out.returncode != 0:
            return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
        return json.loads(out.stdout.strip().splitlines()[-1])

    def admin(self, path: str, token: str | None) -> tuple[int, dict]:
        """GET `path` from outside the pod, as a router through the Service reaches it."""
        port = next(p["containerPort"] for p in self.daemon["ports"] if p["name"] == "admin")
        request = urllib.request.Request(f"http://{pod_ip(self.cid)}:{port}{path}",
                                         headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def node_path(self, path: str) -> str:
        return os.path.join(self.node.root, "node", path.lstrip("/"))


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    built = subprocess.run([SCRIPT, "build"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if built.returncode != 0:
        reason = cannot_run_containers()
        if reason:
            pytest.skip(reason)
        raise AssertionError(f"{SCRIPT} build exited {built.returncode}:\n{built.stderr[-3000:]}")
    root = tempfile.mkdtemp(prefix="kvs-k8s-node-")
    os.chmod(root, 0o755)  # the containers' users walk into the volumes below it
    remove_all()  # what a killed run left
    try:
        cluster = Cluster(root)
        cluster.start_daemon()
        cluster.start_engines()
        yield cluster
    finally:
        logs = ROOT / "build" / "docker" / "kubernetes"
        os.makedirs(logs, exist_ok=True)
        for cid in docker("ps", "-aq", "--filter", f"label={LABEL}", check=False).stdout.split():
            out = docker("logs", cid, check=False)
            (logs / f"{cid[:12]}.log").write_text(out.stdout + out.stderr)
        remove_all()
        shutil.rmtree(root, ignore_errors=True)
        assert docker("ps", "-aq", "--filter", f"label={LABEL}").stdout.split() == []


def test_the_init_steps_hand_the_node_directories_and_the_token_to_the_daemon(cluster):
    for path, mode in (("/run/kvstore", 0o750), ("/var/lib/kvstore", 0o700)):
        st = os.stat(cluster.node_path(path))
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (10001, 10001, mode), path
    token = os.stat(cluster.node_path("/var/lib/kvstore/admin.token"))
    assert (token.st_uid, stat.S_IMODE(token.st_mode)) == (10001, 0o600)
    with open(cluster.node_path("/var/lib/kvstore/admin.token")) as f:
        assert f.read().strip() == cluster.token
    sock = os.stat(cluster.node_path("/run/kvstore/kvstore.sock"))
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o660


def test_the_probes_answer_as_the_kubelet_asks_them(cluster):
    for kind in ("startupProbe", "livenessProbe"):
        ok, body = probe(cluster.cid, cluster.daemon, kind)
        assert ok and json.loads(body) == {"status": "ok"}, (kind, body)
    ok, out = probe(cluster.cid, cluster.daemon, "readinessProbe")
    assert ok and "ready" in out, out


def test_engine_pods_put_and_read_back_through_the_node_socket_directory(cluster):
    assert cluster.engine("vllm", "put", "default", "wiring", 1, SIZE) == {"put": 6}
    assert cluster.engine("sglang", "check", "default", "wiring", 1, SIZE) == {"exact": 6, "missing": [], "wrong": []}
    zero_copy = cluster.engine("sglang", "zero_copy", "default", "wiring", 1)
    assert zero_copy["inside_arena"] == [True] * 6 and zero_copy["mapping"].startswith("/memfd:kvstore-default")


def test_an_engine_without_the_daemon_uid_refuses_the_daemon(cluster):
    refused = cluster.engine("vllm", "check", "default", "wiring", 1, SIZE, unset=("KVSTORE_DAEMON_UID",))
    assert "KVSTORE_DAEMON_UID=10001" in refused.get("error", ""), refused


def test_the_admin_api_answers_a_router_with_the_secrets_token_only(cluster):
    status, doc = cluster.admin("/v1/stats", cluster.token)
    assert status == 200 and doc["ready"] is True
    assert cluster.admin("/v1/stats", None)[0] == 401
    assert cluster.admin("/v1/stats", "not-the-token")[0] == 401


def test_a_rolling_update_keeps_the_objects_on_the_nodes_nvme(cluster):
    """The pod stopped as the kubelet stops it (SIGTERM, then its grace period), a new one
    started on the node: the engines, still running, read what they put before."""
    assert cluster.engine("vllm", "put", "default", "update", 1, SIZE) == {"put": 6}
    grace = cluster.daemon_spec["terminationGracePeriodSeconds"]
    docker("stop", "--time", str(grace), cluster.cid, timeout=grace + 60)
    assert docker("inspect", "-f", "{{.State.ExitCode}}", cluster.cid).stdout.strip() == "0"
    logs = docker("logs", cluster.cid)
    assert "flush_done" in logs.stdout + logs.stderr
    old = cluster.cid
    cluster.start_daemon()  # a new container, the same node directories
    assert cluster.cid != old
    # Written to NVMe at the stop (flush_on_shutdown), read from there after it.
    assert cluster.engine("sglang", "tiers", "default", "update", 1) == {"tiers": ["nvme"] * 6}
    assert cluster.engine("sglang", "check", "default", "update", 1, SIZE) == {"exact": 6, "missing": [], "wrong": []}
