"""What the API's schemas cannot check in the rendered manifests: that the daemon accepts its
config, that engines and daemon meet at one socket directory on the node, that the uids and
groups line up with what the daemon and the client check, that probes ask routes the admin API
serves (asked of a real daemon), that the Service selects the daemon's pods, that secrets
reach the daemon private and its own, and that the memory holds the host tier."""

import os
import subprocess
import sys
from urllib.parse import urlsplit

import pytest
from manifests import (DAEMON_TREES, ENGINE_TREE, ENGINES, ROOT, argv, container, container_env,
                       daemon_args, daemon_config, daemon_container, daemon_set, find, image_uid, installs,
                       mount_for, one, pod_spec, quantity_bytes, render, security, shell_steps, volume)

from kvstore.client.daemon_peer import trusted_uids
from kvstore.server.admin.routes import ROUTES
from kvstore.server.host_memory import HostMemory, check_host_tier

GET_ROUTES = {path for method, path, _ in ROUTES if method == "GET"}
# What the daemon process takes beside its arenas (Python, the index, RocksDB's, the event
# buffers): the memory limit must leave this much on top of the arenas and the headroom.
PROCESS_BYTES = 1 << 30


def daemon_pod(tree: str) -> dict:
    return pod_spec(daemon_set(render(tree)))


def host_path(spec: dict, ctr: dict, path: str) -> str:
    """Where on the node `path` of `ctr` lies: its volume must be a hostPath."""
    mount = mount_for(ctr, path)
    source = volume(spec, mount["name"])
    assert "hostPath" in source, f"{path} is on volume {mount['name']}, not on the node"
    return os.path.normpath(os.path.join(source["hostPath"]["path"], os.path.relpath(path, mount["mountPath"])))


def engine(name: str) -> tuple[dict, dict]:
    spec = pod_spec(one(render(ENGINE_TREE), "Deployment", name))
    return spec, container(spec, name)


def http_probes(ctr: dict) -> list[dict]:
    return [ctr[p]["httpGet"] for p in ("startupProbe", "livenessProbe", "readinessProbe") if "httpGet" in ctr.get(p, {})]


def port_number(ctr: dict, port) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in ctr.get("ports", [])}
    assert port in named, f"{ctr['name']} has no port named {port!r}"
    return named[port]


@pytest.mark.parametrize("tree", DAEMON_TREES)
def test_each_daemon_config_is_one_kvstore_serve_accepts(tree):
    config = daemon_config(render(tree))  # the TOML from the ConfigMap, then the flags: raises on any bad key
    assert config.socket_path and config.nvme.enabled
    if tree == "overlays/etcd":
        assert (config.cluster.node_id, config.cluster.advertise) == ("gpu-node-1", "10.0.0.7:8471")
        assert config.cluster.membership == "etcd" and config.cluster.replicas == 2
    if tree == "overlays/mooncake":
        assert config.remote.mooncake_enabled and config.remote.mooncake.local_hostname == "10.0.0.7"


@pytest.mark.parametrize("tree", DAEMON_TREES)
def test_socket_and_data_directories_are_on_the_node(tree):
    objects, spec = render(tree), daemon_pod(tree)
    config, ctr = daemon_config(objects), daemon_container(objects)
    assert host_path(spec, ctr, config.socket_path) == "/run/kvstore/kvstore.sock"
    assert host_path(spec, ctr, config.nvme_path).startswith(host_path(spec, ctr, config.data_dir))


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("tree", DAEMON_TREES)
def test_engines_find_the_daemons_socket_through_the_same_node_directory(tree, name):
    objects, spec = render(tree), daemon_pod(tree)
    socket_on_node = host_path(spec, daemon_container(objects), daemon_config(objects).socket_path)
    engine_spec, ctr = engine(name)
    env = container_env(render(ENGINE_TREE), ctr)
    assert host_path(engine_spec, ctr, env["KVSTORE_SOCKET"]) == socket_on_node
    # The adapter's own socket_path, in the engine's flags, says the same.
    assert any(f'"socket_path": "{env["KVSTORE_SOCKET"]}"' in part for part in argv(render(ENGINE_TREE), ctr))
    # Read-only: a socket connects through a read-only mount; nothing can be put at the path.
    assert mount_for(ctr, env["KVSTORE_SOCKET"]).get("readOnly") is True


@pytest.mark.parametrize("name", ENGINES)
def test_engines_trust_the_daemons_uid_and_may_open_its_socket(name, monkeypatch):
    uid = image_uid()
    spec, ctr = engine(name)
    named = container_env(render(ENGINE_TREE), ctr)["KVSTORE_DAEMON_UID"]
    monkeypatch.setenv("KVSTORE_DAEMON_UID", named)
    assert named == str(uid) and uid in trusted_uids()  # the client's SO_PEERCRED check lets it through
    for tree in DAEMON_TREES:
        daemon_spec = daemon_pod(tree)
        ctr_d = daemon_container(render(tree))
        assert security(daemon_spec, ctr_d, "runAsUser") == uid, tree
        gid = security(daemon_spec, ctr_d, "runAsGroup")
        # An engine of another uid reaches the socket through the daemon's group: the socket
        # is group read-write, its directory group-enterable but not group-writable.
        assert security(spec, ctr, "runAsUser") != uid and gid in spec["securityContext"]["supplementalGroups"]
        assert daemon_config(render(tree)).socket_mode & 0o060 == 0o060
        steps = shell_steps(container(daemon_spec, "directories", init=True)["command"])
        modes = {step[2]: int(step[1], 8) for step in steps if step[0] == "chmod"}
        assert modes["/run/kvstore"] & 0o070 == 0o050, modes


@pytest.mark.parametrize("tree", DAEMON_TREES)
def test_the_directories_step_hands_the_node_directories_to_the_daemon_first(tree):
    spec = daemon_pod(tree)
    assert [c["name"] for c in spec["initContainers"]] == ["directories", "secrets"]
    step = container(spec, "directories", init=True)
    assert security(spec, step, "runAsUser") == 0 and step["securityContext"]["capabilities"] == {
        "drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    chowned = {path for s in shell_steps(step["command"]) if s[0] == "chown" for path in s[2:]}
    assert all(s[1] == f"{image_uid()}:{image_uid()}" for s in shell_steps(step["command"]) if s[0] == "chown")
    ctr = daemon_container(render(tree))
    node_dirs = {m["mountPath"] for m in ctr["volumeMounts"] if "hostPath" in volume(spec, m["name"])}
    assert chowned == node_dirs
    # The daemon refuses a directory others can write (server/data_dir.py: refuse_unless_ours).
    modes = [int(s[1], 8) for s in shell_steps(step["command"]) if s[0] == "chmod"]
    assert modes and all(mode & 0o022 == 0 for mode in modes)


@pytest.mark.parametrize("tree", DAEMON_TREES)
def test_secrets_reach_the_daemon_private_and_its_own(tree):
    objects, spec = render(tree), daemon_pod(tree)
    config = daemon_config(objects)
    step = container(spec, "secrets", init=True)
    assert security(spec, step, "runAsUser") == image_uid()  # what it installs is the daemon's
    # kubelet gives a Secret's files to group fsGroup (mode | 0440): the step reads them so.
    assert spec["securityContext"]["fsGroup"] == security(spec, step, "runAsGroup")
    secrets = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
    assert secrets and all(s["defaultMode"] == 0o400 for s in secrets.values())
    put = installs(step["command"])
    token = os.path.join(config.data_dir, "admin.token")
    assert put[token][1] == 0o600 and mount_for(step, put[token][0])["name"] in secrets
    wanted = {"kvstore-admin-token"}
    if config.cluster.enabled:
        wanted.add("kvstore-cluster-secret")
        src, mode = put[config.cluster.secret_file]
        assert mode == 0o400 and mount_for(step, src)["name"] in secrets
        # Where the daemon reads it: memory, mounted in both containers.
        memory = volume(spec, mount_for(daemon_container(objects), config.cluster.secret_file)["name"])
        assert memory["emptyDir"]["medium"] == "Memory"
        assert mount_for(step, config.cluster.secret_file)["name"] == memory["name"]
    assert {s["secretName"] for s in secrets.values()} == wanted
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert all(f"create secret generic {name}" in docs for name in wanted)  # the install steps make them


@pytest.mark.parametrize("tree", DAEMON_TREES)
def test_probes_ask_routes_the_admin_api_serves_where_the_kubelet_reaches_them(tree):
    objects = render(tree)
    config, ctr = daemon_config(objects), daemon_container(objects)
    assert {p["path"] for p in http_probes(ctr)} == {"/healthz"}  # no token: the one open route
    assert all(port_number(ctr, p["port"]) == config.admin.port for p in http_probes(ctr))
    assert config.admin.host not in ("127.0.0.1", "localhost", "::1")  # the kubelet dials the pod IP
    readiness = ctr["readinessProbe"]["exec"]["command"]
    assert readiness == ["kvstore-healthcheck", daemon_args(objects).config]
    assert "docker/healthcheck.py /opt/kvstore/bin/kvstore-healthcheck" in (ROOT / "docker" / "Dockerfile").read_text()
    annotations = pod_spec_annotations(tree)
    assert int(annotations["prometheus.io/port"]) == config.admin.port
    assert annotations["prometheus.io/path"] in GET_ROUTES and "/readyz" in GET_ROUTES


def pod_spec_annotations(tree: str) -> dict:
    return daemon_set(render(tree))["spec"]["template"]["metadata"]["annotations"]


def test_the_probes_answer_on_a_real_daemon(daemon):
    """The base's probes, asked of a real daemon: its httpGet probes without a token (as the
    kubelet sends them), its readiness command against the daemon's config file."""
    import urllib.error
    import urllib.request
    url = open(os.path.join(daemon.data_dir, "admin.addr")).read().strip()
    for probe in http_probes(daemon_container(render("base"))):
        with urllib.request.urlopen(url + probe["path"], timeout=10) as reply:
            assert reply.status == 200
    with pytest.raises(urllib.error.HTTPError) as refused:  # why readiness is not an httpGet
        urllib.request.urlopen(url + "/readyz", timeout=10)
    assert refused.value.code == 401
    readiness = daemon_container(render("base"))["readinessProbe"]["exec"]["command"]
    check = subprocess.run([sys.executable, str(ROOT / "docker" / "healthcheck.py"), daemon.config_path],
                           capture_output=True, text=True, timeout=60)
    assert readiness[0] == "kvstore-healthcheck" and check.returncode == 0, check.stderr


@pytest.mark.parametrize("tree", DAEMON_TREES)
def test_the_node_local_service_selects_the_daemons_pods_only(tree):
    objects = render(tree)
    service, ds = one(objects, "Service", "kvstore"), daemon_set(objects)
    config, ctr = daemon_config(objects), daemon_container(objects)
    selector = service["spec"]["selector"]
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert service["metadata"]["namespace"] == ds["metadata"]["namespace"]
    selected = [w for kind in ("DaemonSet", "Deployment") for w in find(objects, kind)
                if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
    assert selected == [ds]
    ports = {p["name"]: port_number(ctr, p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports["admin"] == config.admin.port
    assert {ports["events"], ports["events-replay"]} == {
        int(urlsplit(config.events.endpoint).port), int(urlsplit(config.events.replay_endpoint).port)}


@pytest.mark.parametrize("tree", DAEMON_TREES)
def test_the_memory_limit_holds_the_host_tier_and_no_gpu_is_asked(tree):
    objects = render(tree)
    config, ctr, spec = daemon_config(objects), daemon_container(objects), daemon_pod(tree)
    resources = ctr["resources"]
    limit = quantity_bytes(resources["limits"]["memory"])
    assert quantity_bytes(resources["requests"]["memory"]) == limit
    # The daemon's own start-up check, in a container of this limit with the process running.
    check_host_tier(config.host, HostMemory(total_bytes=limit, available_bytes=limit - PROCESS_BYTES))
    assert not any("gpu" in key for part in resources.values() for key in part)
    assert spec["priorityClassName"] == "system-node-critical"
    for name in ENGINES:  # engines are scheduled where the daemons run
        engine_spec, _ = engine(name)
        assert engine_spec["nodeSelector"] == spec["nodeSelector"]
        assert engine_spec["tolerations"] == spec["tolerations"]


def test_a_host_tier_larger_than_the_limit_fails_the_memory_check():
    config = daemon_config(render("base"))
    limit = quantity_bytes(daemon_container(render("base"))["resources"]["limits"]["memory"])
    with pytest.raises(Exception, match="host.arena_bytes"):
        check_host_tier(config.host, HostMemory(total_bytes=limit // 2, available_bytes=limit // 2))


@pytest.mark.parametrize("tree", DAEMON_TREES)
def test_the_config_names_services_the_tree_renders(tree):
    objects = render(tree)
    config = daemon_config(objects)
    named = []
    if config.cluster.enabled:
        named.append(urlsplit(config.cluster.etcd_endpoint).netloc)
    if config.remote.mooncake_enabled:
        named += [config.remote.mooncake.master, urlsplit(config.remote.mooncake.master_metrics_url).netloc]
    for address in named:
        host, port = address.rsplit(":", 1)
        service = one(objects, "Service", host)
        assert int(port) in [p["port"] for p in service["spec"]["ports"]], address
    assert named or tree == "base"


def test_the_images_are_the_ones_scripts_docker_cluster_sh_builds():
    script = (ROOT / "scripts" / "docker_cluster.sh").read_text()
    wanted = {"base": "kvstore:latest", "overlays/mooncake": "kvstore-mooncake:latest"}
    for tree, image in wanted.items():
        assert f"{image}" in script
        spec = daemon_pod(tree)
        assert {c["image"] for c in spec["containers"] + spec["initContainers"]} == {image}
    etcd = pod_spec(one(render("overlays/etcd"), "Deployment", "kvstore-etcd"))
    assert etcd["containers"][0]["image"] == "kvstore-etcd:latest" and "kvstore-etcd:latest" in script
