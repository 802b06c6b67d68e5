"""A rendered pod spec run as the kubelet would run it, on the local Docker engine: one node
(a temporary directory standing in for the node's filesystem), its volumes made as the
kubelet makes them, and each container started with `docker run` given exactly the pod's
user, groups, capabilities, read-only root, memory limit, environment, command and mounts.

Only what the manifests use is modelled; anything else raises, so a manifest that grows a
field the translation ignores fails the wiring test instead of passing it untested.

    node = Node(root, secrets={"kvstore-admin-token": {"token": b"..."}})
    pod = Pod(node, objects, spec, name="kvstore")
    pod.run_init_containers(image)          # each to completion, in order
    cid = pod.start("kvstore", image)       # detached
"""

from __future__ import annotations

import os
import sys

from manifests import ROOT, SAMPLE_FIELDS, config_map, container, container_env, expand, quantity_bytes, security

sys.path.insert(0, str(ROOT / "tests" / "docker"))
from test_docker_cluster import _run as run_with  # noqa: E402 (the Docker tests' way to run a command)

LABEL = "org.kvstore.test=kubernetes-wiring"  # every container started here; removed by label
CALL_TIMEOUT_S = 300
# kubelet's default modes: a ConfigMap's or Secret's files without defaultMode, an emptyDir.
DEFAULT_FILE_MODE = 0o644
EMPTY_DIR_MODE = 0o777


def docker(*args: str, timeout: float = CALL_TIMEOUT_S, check: bool = True, **kwargs):
    return run_with(["docker", *args], timeout=timeout, check=check, **kwargs)


def remove_all() -> None:
    """Every container this module started, with its anonymous volumes."""
    ids = docker("ps", "-aq", "--filter", f"label={LABEL}", check=False).stdout.split()
    if ids:
        docker("rm", "-f", "-v", *ids)


class Node:
    """The node's filesystem under `root`: hostPath directories, shared by every pod on it,
    and each pod's own volumes. `secrets`: name -> {key: bytes}, what the API server holds."""

    def __init__(self, root: str, secrets: dict[str, dict[str, bytes]]):
        self.root, self.secrets = root, secrets

    def host_path(self, path: str, kind: str) -> str:
        """A hostPath volume's directory; DirectoryOrCreate makes it as the kubelet does
        (root's, 0755), Directory must exist."""
        where = os.path.join(self.root, "node", path.lstrip("/"))
        if kind == "DirectoryOrCreate":
            if not os.path.isdir(where):
                os.makedirs(where, mode=0o755)
                os.chown(where, 0, 0)
        elif kind != "Directory" or not os.path.isdir(where):
            raise AssertionError(f"hostPath {path} of type {kind!r}: only an existing Directory or DirectoryOrCreate")
        return where


class Pod:
    """One pod of `spec` (a rendered pod template's spec) on `node`."""

    def __init__(self, node: Node, objects, spec: dict, name: str):
        self.node, self.objects, self.spec, self.name = node, objects, spec, name
        self.volumes = {v["name"]: self._make_volume(v) for v in spec.get("volumes", [])}

    def _make_volume(self, vol: dict) -> str:
        kinds = set(vol) - {"name"}
        pod_dir = os.path.join(self.node.root, "pods", self.name, vol["name"])
        fs_group = self.spec.get("securityContext", {}).get("fsGroup")
        if kinds == {"hostPath"}:
            return self.node.host_path(vol["hostPath"]["path"], vol["hostPath"].get("type", ""))
        if kinds == {"configMap"}:
            data = {k: v.encode() for k, v in config_map(self.objects, vol["configMap"]["name"])["data"].items()}
            return self._files(pod_dir, data, vol["configMap"], fs_group)
        if kinds == {"secret"}:
            return self._files(pod_dir, self.node.secrets[vol["secret"]["secretName"]], vol["secret"], fs_group)
        if kinds == {"emptyDir"}:
            os.makedirs(pod_dir)
            os.chmod(pod_dir, EMPTY_DIR_MODE | (0o2000 if fs_group is not None else 0))
            if fs_group is not None:
                os.chown(pod_dir, 0, fs_group)
            return pod_dir
        raise AssertionError(f"volume {vol['name']}: {sorted(kinds)} is not modelled")

    @staticmethod
    def _files(where: str, data: dict[str, bytes], source: dict, fs_group: int | None) -> str:
        """A ConfigMap's or Secret's keys as files, root's, with defaultMode; with fsGroup the
        kubelet gives them that group and read for it (a read-only volume: mode | 0440)."""
        if "items" in source:
            raise AssertionError("volume items are not modelled")
        os.makedirs(where)
        for key, value in data.items():
            path = os.path.join(where, key)
            with open(path, "wb") as f:
                f.write(value)
            mode = source.get("defaultMode", DEFAULT_FILE_MODE)
            os.chown(path, 0, 0 if fs_group is None else fs_group)
            os.chmod(path, mode | (0o440 if fs_group is not None else 0))
        if fs_group is not None:
            os.chown(where, 0, fs_group)
            os.chmod(where, 0o2755)
        return where

    def run_args(self, ctr: dict, image: str, command: list[str] | None = None) -> list[str]:
        """`docker run` arguments (after `run`) for container `ctr`; `command` replaces the
        manifest's (an engine's process, where the engine itself cannot run here)."""
        allowed = {"name", "image", "imagePullPolicy", "command", "args", "env", "envFrom", "ports", "resources",
                   "securityContext", "volumeMounts", "startupProbe", "livenessProbe", "readinessProbe"}
        if set(ctr) - allowed:
            raise AssertionError(f"container {ctr['name']}: {sorted(set(ctr) - allowed)} not modelled")
        args = ["--label", LABEL, "--name", f"{self.name}-{ctr['name']}"]
        uid, gid = security(self.spec, ctr, "runAsUser"), security(self.spec, ctr, "runAsGroup")
        if uid is not None:
            args += ["--user", str(uid) if gid is None else f"{uid}:{gid}"]
        pod_security = self.spec.get("securityContext", {})
        for group in [pod_security.get("fsGroup"), *pod_security.get("supplementalGroups", [])]:
            if group is not None:
                args += ["--group-add", str(group)]
        own = ctr.get("securityContext", {})
        args += [f"--cap-drop={cap}" for cap in own.get("capabilities", {}).get("drop", [])]
        args += [f"--cap-add={cap}" for cap in own.get("capabilities", {}).get("add", [])]
        if own.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        if own.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        memory = ctr.get("resources", {}).get("limits", {}).get("memory")
        if memory is not None:
            args += ["--memory", str(quantity_bytes(memory)), "--memory-swap", str(quantity_bytes(memory))]
        env = container_env(self.objects, ctr, SAMPLE_FIELDS)
        for key, value in env.items():
            args += ["--env", f"{key}={value}"]
        for mount in ctr.get("volumeMounts", []):
            if set(mount) - {"name", "mountPath", "readOnly"}:
                raise AssertionError(f"volumeMount {mount}: only name, mountPath and readOnly are modelled")
            source = self.volumes[mount["name"]]
            ro = ",readonly" if mount.get("readOnly") else ""
            args += ["--mount", f"type=bind,source={source},target={mount['mountPath']}{ro}"]
        process = command or [expand(p, env) for p in [*ctr.get("command", []), *ctr.get("args", [])]]
        if not process:
            raise AssertionError(f"container {ctr['name']} gives no command: the manifests always say what runs")
        return [*args, "--entrypoint", process[0], image, *process[1:]]

    def run_init_containers(self, image: str) -> None:
        """Each init container to completion, in the pod's order (as the kubelet runs them)."""
        for ctr in self.spec.get("initContainers", []):
            docker("run", "--rm", *self.run_args(ctr, image))

    def start(self, name: str, image: str, command: list[str] | None = None) -> str:
        """Container `name` started detached (with `command` in place of its own); its id."""
        return docker("run", "-d", *self.run_args(container(self.spec, name), image, command)).stdout.strip()


def probe(cid: str, ctr: dict, kind: str) -> tuple[bool, str]:
    """Probe `kind` (startupProbe, livenessProbe, readinessProbe) of `ctr`, asked of running
    container `cid` as the kubelet asks it: an exec runs in the container as its user; an
    httpGet goes from outside to the pod's IP (here the container's), with no token."""
    spec = ctr[kind]
    if "exec" in spec:
        out = docker("exec", cid, *spec["exec"]["command"], check=False, timeout=spec.get("timeoutSeconds", 1) + 30)
        return out.returncode == 0, out.stdout + out.stderr
    if "httpGet" in spec:
        import urllib.error
        import urllib.request
        get = spec["httpGet"]
        port = get["port"] if isinstance(get["port"], int) else \
            {p["name"]: p["containerPort"] for p in ctr["ports"]}[get["port"]]
        try:
            with urllib.request.urlopen(f"http://{pod_ip(cid)}:{port}{get['path']}", timeout=10) as reply:
                return 200 <= reply.status < 400, reply.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            return False, str(exc)
    raise AssertionError(f"{kind}: only exec and httpGet probes are modelled")


def pod_ip(cid: str) -> str:
    return docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", cid).stdout.strip()
