"""The Kustomize trees under deploy/kubernetes, rendered with `kubectl kustomize` as a user
renders them, and what the tests read from the rendered objects: objects by kind and name,
a container's environment as the kubelet builds it, the files its volumes hold, and the
daemon's configuration as `kvstore serve` loads it from its ConfigMap and its flags.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import tempfile

import yaml

from kvstore.commands.cli import build_parser
from kvstore.commands.config_file import load_config
from kvstore.config import ServerConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
DAEMON_TREES = ("base", "overlays/etcd", "overlays/mooncake")
ENGINE_TREE = "engines"
TREES = (*DAEMON_TREES, ENGINE_TREE)
ENGINES = ("vllm", "sglang")
# What the downward API gives a pod (fieldRef), for expanding the daemon's $(VAR) flags.
SAMPLE_FIELDS = {"spec.nodeName": "gpu-node-1", "status.podIP": "10.0.0.7"}
RENDER_TIMEOUT_S = 120


def kubectl_missing() -> str | None:
    """Why the manifests cannot be rendered here, or None."""
    if shutil.which("kubectl") is None:
        return "no kubectl (it renders the Kustomize trees offline: `kubectl kustomize`)"
    return None


@functools.cache
def render(tree: str) -> tuple[dict, ...]:
    """Every object `kubectl kustomize deploy/kubernetes/<tree>` renders."""
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / tree)], capture_output=True, text=True,
                         timeout=RENDER_TIMEOUT_S)
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {tree} failed:\n{out.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def find(objects, kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects, kind: str, name: str | None = None) -> dict:
    found = find(objects, kind, name)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind} {name or ''}, rendered {len(found)}")
    return found[0]


def config_map(objects, name: str) -> dict:
    """The ConfigMap a pod names `name`: Kustomize's generators append a hash, and rewrite
    every reference, so the rendered name is what pods name."""
    return one(objects, "ConfigMap", name)


def daemon_set(objects) -> dict:
    return one(objects, "DaemonSet", "kvstore")


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(spec: dict, name: str, init: bool = False) -> dict:
    listed = spec["initContainers" if init else "containers"]
    found = [c for c in listed if c["name"] == name]
    if len(found) != 1:
        raise AssertionError(f"no container {name!r} among {[c['name'] for c in listed]}")
    return found[0]


def daemon_container(objects) -> dict:
    return container(pod_spec(daemon_set(objects)), "kvstore")


def volume(spec: dict, name: str) -> dict:
    found = [v for v in spec.get("volumes", []) if v["name"] == name]
    if len(found) != 1:
        raise AssertionError(f"no volume {name!r}")
    return found[0]


def security(spec: dict, ctr: dict, key: str):
    """A securityContext setting as it applies to `ctr`: its own, else the pod's."""
    own = ctr.get("securityContext", {})
    return own[key] if key in own else spec.get("securityContext", {}).get(key)


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of $(VAR) in command, args and env values: a defined variable is
    replaced, an undefined one stays as written, and $$ is a literal $."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(objects, ctr: dict, fields: dict[str, str] = SAMPLE_FIELDS) -> dict[str, str]:
    """The environment the kubelet gives `ctr`: envFrom ConfigMaps first, then env in order
    (each value expanded over what came before). Anything else is refused, so a manifest
    that grows a kind of source the tests do not model fails here instead of passing."""
    env: dict[str, str] = {}
    for source in ctr.get("envFrom", []):
        if set(source) != {"configMapRef"}:
            raise AssertionError(f"envFrom {source}: only configMapRef is modelled")
        env.update(config_map(objects, source["configMapRef"]["name"])["data"])
    for var in ctr.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var.get("valueFrom", {})
        if "fieldRef" in ref:
            env[var["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in ref:
            key = ref["configMapKeyRef"]
            env[var["name"]] = config_map(objects, key["name"])["data"][key["key"]]
        else:
            raise AssertionError(f"env {var['name']}: only value, fieldRef and configMapKeyRef are modelled")
    return env


def argv(objects, ctr: dict, fields: dict[str, str] = SAMPLE_FIELDS) -> list[str]:
    """The process `ctr` runs: command then args, $(VAR) expanded over its environment."""
    env = container_env(objects, ctr, fields)
    return [expand(part, env) for part in [*ctr.get("command", []), *ctr.get("args", [])]]


def mount_for(ctr: dict, path: str) -> dict:
    """The volumeMount of `ctr` that holds `path` (the longest mountPath above it)."""
    holding = [m for m in ctr.get("volumeMounts", [])
               if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    if not holding:
        raise AssertionError(f"{ctr['name']} mounts nothing at {path}")
    return max(holding, key=lambda m: len(m["mountPath"]))


def mounted_config_file(objects, spec: dict, ctr: dict, path: str) -> str:
    """The text of file `path` in `ctr`, which must come from a ConfigMap volume."""
    mount = mount_for(ctr, path)
    source = volume(spec, mount["name"])
    if "configMap" not in source:
        raise AssertionError(f"{path} is on volume {mount['name']}, not a ConfigMap")
    key = os.path.relpath(path, mount["mountPath"])
    return config_map(objects, source["configMap"]["name"])["data"][key]


def daemon_args(objects, fields: dict[str, str] = SAMPLE_FIELDS):
    """The daemon container's `kvstore serve` flags, parsed by kvstore's own parser."""
    command = argv(objects, daemon_container(objects), fields)
    if command[:2] != ["kvstore", "serve"]:
        raise AssertionError(f"the daemon runs {command}, not `kvstore serve`")
    return build_parser().parse_args(command[1:])


def daemon_config(objects, fields: dict[str, str] = SAMPLE_FIELDS) -> ServerConfig:
    """The daemon's configuration as `kvstore serve` loads it in the pod: the TOML its
    ConfigMap mounts where --config points, then its flags (node name and pod IP expanded)."""
    args = daemon_args(objects, fields)
    spec = pod_spec(daemon_set(objects))
    text = mounted_config_file(objects, spec, daemon_container(objects), args.config)
    with tempfile.TemporaryDirectory(prefix="kvs-k8s-") as tmp:
        path = os.path.join(tmp, "kvstore.toml")
        with open(path, "w") as f:
            f.write(text)
        args.config = path
        return load_config(args)


def image_uid() -> int:
    """The uid docker/Dockerfile gives the image's kvstore user (`useradd ... --uid N`)."""
    match = re.search(r"useradd\b[^\n]*--uid (\d+)", (ROOT / "docker" / "Dockerfile").read_text())
    if match is None:
        raise AssertionError("docker/Dockerfile makes no user with --uid")
    return int(match.group(1))


def shell_steps(command: list[str]) -> list[list[str]]:
    """The commands an init container runs: `sh -c "a && b"` as [a, b], split as sh would."""
    if command[:2] == ["sh", "-c"]:
        return [shlex.split(step) for step in command[2].split("&&")]
    return [command]


def installs(command: list[str]) -> dict[str, tuple[str, int]]:
    """What `install -m MODE SRC DEST` steps of `command` put where: {dest: (src, mode)}."""
    done = {}
    for step in shell_steps(command):
        if step[:2] == ["install", "-m"] and len(step) == 5:
            done[step[4]] = (step[3], int(step[2], 8))
    return done


_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity ("38Gi", "512M", "1073741824") in bytes."""
    match = re.fullmatch(r"(\d+)([KMGT]i|[kMGT])?", str(text))
    if match is None:
        raise AssertionError(f"not a memory quantity this test reads: {text!r}")
    return int(match.group(1)) * _QUANTITY.get(match.group(2) or "", 1)
